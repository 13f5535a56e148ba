"""NVTX ranges: named per phase and size, visible in a torch profiler trace,
and a shared no-op when disabled."""

from __future__ import annotations

import importlib

import pytest
from torch.profiler import profile

from conftest import CapturedToy
from graphrunner.util import nvtx


def test_replay_ranges_appear_in_a_torch_profiler_trace(captured_toy: CapturedToy):
    batch = captured_toy.world.make_batch(3, seed=0)
    with profile() as prof:
        captured_toy.runner.replay(batch)
    names = {e.name for e in prof.events()}
    for expected in ("replay bs=4", "populate bs=4", "launch bs=4"):
        assert f"graphrunner::{expected}" in names


def test_capture_ranges_per_size():
    from graphrunner import create_runner, decode_buffer_specs
    from graphrunner.testing import ToyWorld

    world = ToyWorld()
    runner = create_runner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[2, 4],
        show_progress=False,
        kind="eager",
    )
    with profile() as prof:
        runner.capture()
    names = [e.name for e in prof.events() if e.name.startswith("graphrunner::capture")]
    assert "graphrunner::capture eager" in names
    assert names.index("graphrunner::capture bs=4") < names.index("graphrunner::capture bs=2")


def test_disabled_ranges_are_a_shared_noop(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(nvtx.SWITCH, "enabled", False)
    assert nvtx.range("a") is nvtx.range("b")
    with profile() as prof, nvtx.range("hidden"):
        pass
    assert not any("hidden" in e.name for e in prof.events())


@pytest.mark.parametrize(("value", "on"), [("0", False), ("false", False), (" Off ", False),
                                           ("no", False), ("", False), ("1", True),
                                           ("yes", True)])  # fmt: skip
def test_env_switch_reads_the_usual_spellings(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
):
    monkeypatch.setenv("GRAPHRUNNER_NVTX", value)
    try:
        assert importlib.reload(nvtx).enabled() is on
    finally:
        monkeypatch.delenv("GRAPHRUNNER_NVTX")
        importlib.reload(nvtx)


def test_set_enabled_takes_a_bool():
    with pytest.raises(TypeError, match="takes a bool, got '0'"):
        nvtx.set_enabled("0")  # type: ignore[arg-type]


class RecordingDomain:
    """Stands in for the nvtx domain: records what Nsight would be sent."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def get_event_attributes(self, message: str) -> str:
        return message

    def push_range(self, attrs: str) -> None:
        self.events.append(("push", attrs))

    def pop_range(self) -> None:
        self.events.append(("pop", None))


def test_replay_pushes_balanced_nvtx_ranges(
    captured_toy: CapturedToy, monkeypatch: pytest.MonkeyPatch
):
    domain = RecordingDomain()
    monkeypatch.setattr(nvtx, "_domain", domain)
    monkeypatch.setattr(nvtx.SWITCH, "injected", True)  # as under Nsight
    captured_toy.runner.replay(captured_toy.world.make_batch(3, seed=0))
    pushed = [name for kind, name in domain.events if kind == "push"]
    assert pushed == ["replay bs=4", "populate bs=4", "launch bs=4"]
    depth = 0
    for kind, _ in domain.events:  # every push is popped, in nesting order
        depth += 1 if kind == "push" else -1
        assert depth >= 0
    assert depth == 0


def test_ranges_cost_nothing_when_nobody_profiles(
    captured_toy: CapturedToy, monkeypatch: pytest.MonkeyPatch
):
    """No Nsight injection and no torch profiler: nothing is pushed, and every
    range is the shared no-op."""
    domain = RecordingDomain()
    monkeypatch.setattr(nvtx, "_domain", domain)
    monkeypatch.setattr(nvtx.SWITCH, "injected", False)
    assert nvtx.range("a") is nvtx.range("b")
    captured_toy.runner.replay(captured_toy.world.make_batch(3, seed=0))
    assert domain.events == []
    with profile():  # a torch profiler turns them back on
        captured_toy.runner.replay(captured_toy.world.make_batch(3, seed=0))
    assert ("push", "replay bs=4") in domain.events


def test_the_injection_variable_is_what_nsight_sets(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")
    assert type(nvtx.SWITCH)().injected
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    monkeypatch.delenv("NVTX_INJECTION32_PATH", raising=False)
    assert not type(nvtx.SWITCH)().injected
