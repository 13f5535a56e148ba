"""The CPU runner replays its compiled programs directly (no dynamo guards),
and falls back to the dynamo path, counted and warned, where it cannot."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from conftest import CapturedToy
from graphrunner import CpuGraphRunner, decode_buffer_specs
from graphrunner.declare.buffers import BufferView
from graphrunner.mechanisms import InductorCapture, UncapturableError
from graphrunner.mechanisms.compile import SizeCompiler
from graphrunner.testing import ToyWorld


def test_toy_programs_are_called_directly(captured_toy: CapturedToy):
    if captured_toy.kind != "cpu":
        pytest.skip("CPU runner only")
    runner = captured_toy.runner
    assert runner.kind == "cpu" and isinstance(runner.mechanism, InductorCapture)
    assert runner.direct_fallbacks == 0
    batch = captured_toy.world.make_batch(3, seed=0)
    with profile() as prof:
        runner.replay(batch)
    names = {e.name for e in prof.events()}
    assert any(name.startswith("## Call CompiledFxGraph") for name in names)
    assert "TorchDynamo Cache Lookup" not in names  # no guard evaluation
    assert not any(name.startswith("Torch-Compiled Region") for name in names)


def test_graph_break_falls_back_to_dynamo_with_a_warning():
    world = ToyWorld()

    def forward_with_graph_break(b: object) -> dict[str, torch.Tensor]:
        logits = world.model(b)
        torch._dynamo.graph_break()
        return {"logits": logits, "twice": logits * 2}

    runner = CpuGraphRunner(
        forward_with_graph_break,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[4],
        show_progress=False,
    )
    with pytest.warns(
        RuntimeWarning, match="size 4: the compiled program cannot be called"
    ) as caught:
        runner.capture()
    ours = [w for w in caught if "graphrunner" in str(w.message) or "size 4" in str(w.message)]
    assert [Path(w.filename).name for w in ours] == [Path(__file__).name]  # the caller's line
    assert runner.direct_fallbacks == 1
    batch = world.make_batch(3, seed=1)
    expected, _ = world.eager_reference(batch)
    out = runner.replay(batch)
    assert isinstance(out, dict)
    torch.testing.assert_close(out["logits"], expected)
    torch.testing.assert_close(out["twice"], expected * 2)


def test_dict_outputs_replay_directly():
    world = ToyWorld()

    def forward_dict(b: object) -> dict[str, torch.Tensor]:
        logits = world.model(b)
        return {"logits": logits, "top": logits.argmax(-1)}

    runner = CpuGraphRunner(
        forward_dict, decode_buffer_specs(), device="cpu", capture_sizes=[4], show_progress=False
    )
    runner.capture()
    assert runner.direct_fallbacks == 0
    batch = world.make_batch(3, seed=2)
    expected, _ = world.eager_reference(batch)
    out = runner.replay(batch)
    assert isinstance(out, dict) and out["logits"].shape == (3, world.cfg.vocab)
    torch.testing.assert_close(out["logits"], expected)
    assert torch.equal(out["top"], expected.argmax(-1))


def test_nan_on_padded_rows_keeps_the_direct_call():
    """A padded row may compute NaN (here: every row of request 0, the
    padding row): both paths agree on it, so the program is still called
    directly, and live rows are unaffected."""
    world = ToyWorld()

    def forward_nan_on_padding(b: BufferView) -> torch.Tensor:
        padding = b.req_pool_indices[:, None] == 0
        return world.model(b) + torch.where(padding, float("nan"), 0.0)

    runner = CpuGraphRunner(
        forward_nan_on_padding, decode_buffer_specs(), device="cpu", capture_sizes=[2],
        show_progress=False,
    )  # fmt: skip
    runner.capture()  # capture runs all-padding rows: every output NaN
    assert runner.direct_fallbacks == 0
    batch = world.make_batch(1, seed=3)
    expected, _ = world.eager_reference(batch)
    torch.testing.assert_close(runner.replay(batch), expected)


def test_a_retried_capture_counts_fallbacks_afresh(monkeypatch: pytest.MonkeyPatch):
    """Fallbacks of a capture that failed and was dropped are not counted again."""
    world = ToyWorld()
    fail = {"on": True}

    def forward(b: BufferView) -> torch.Tensor:
        if fail["on"] and b.bs == 2:
            raise RuntimeError("boom at bs=2")
        return world.model(b)

    # No compile: every size then takes the dynamo-path fallback, cheaply.
    monkeypatch.setattr(
        SizeCompiler, "step_fn", lambda self, bs, forward, view: lambda: forward(view)
    )
    runner = CpuGraphRunner(
        forward, decode_buffer_specs(), device="cpu", capture_sizes=[2, 4], show_progress=False
    )
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="boom"):
        warnings.simplefilter("ignore")
        runner.capture()
    assert runner.direct_fallbacks == 0
    fail["on"] = False
    with pytest.warns(RuntimeWarning, match="cannot be called directly") as caught:
        runner.capture()
    assert runner.direct_fallbacks == 2 and len(caught) == 1


def test_fullgraph_refuses_a_branch_on_a_tensor_value_naming_the_line():
    """A data-dependent branch (a host read) cannot be captured: with
    fullgraph=True the capture refuses it with the reason and the model's
    line, instead of running that size through dynamo piecewise."""
    world = ToyWorld()

    def forward_with_host_branch(b: object) -> torch.Tensor:
        logits = world.model(b)
        if logits.sum() > 0:  # the branch reads the tensor's value on the host
            return logits * 2
        return logits

    runner = CpuGraphRunner(
        forward_with_host_branch,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[2, 4],
        show_progress=False,
        fullgraph=True,
    )
    line = forward_with_host_branch.__code__.co_firstlineno + 2
    with pytest.raises(UncapturableError) as caught:
        runner.capture()
    message = str(caught.value)
    assert message.startswith("size 4: the forward cannot be captured in forward_with_host_branch")
    assert f"test_cpu_runner.py:{line}" in message
    assert not runner.is_captured  # nothing half-captured
