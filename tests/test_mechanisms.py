"""Capture mechanisms composed into runners: every size compiled (no silent
dynamo fallback past its recompile limit), inductor's own CUDA graphs
refused, graph memory measured on the pool itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import HAS_CUDA, make_runner
from graphrunner import (
    CpuGraphRunner,
    create_runner,
    decode_buffer_specs,
    decode_phase,
)
from graphrunner.core import RunnerOptions
from graphrunner.declare.buffers import BufferView
from graphrunner.mechanisms import EagerCapture, InductorCapture
from graphrunner.mechanisms.compile import inductor_patches
from graphrunner.mechanisms.cuda_graph import pool_bytes
from graphrunner.testing import ToyWorld

COMPILING = ["cpu"] + (["cuda+compile"] if HAS_CUDA else [])
COMPILING_PARAMS = [
    pytest.param(k, marks=pytest.mark.cuda) if k.startswith("cuda") else k for k in COMPILING
]


@pytest.mark.parametrize("label", COMPILING_PARAMS)
def test_one_compilation_serves_every_size(label: str):
    """The default: one program with a symbolic batch dimension, compiled
    on the first (largest) size and called directly at every size, batch 1
    included, equal to eager; replays never compile again."""
    sizes = [1, 2, 3, 4, 5]
    world = ToyWorld("cuda" if label.startswith("cuda") else "cpu")
    runner = make_runner(label, world.model, decode_buffer_specs(), capture_sizes=sizes)
    report = runner.capture()
    assert [s.programs for s in report.sizes] == [1, 0, 0, 0, 0]
    assert report.compilations == runner.compilations == 1
    assert report.sizes[0].compile_seconds > 0
    assert [s.compile_seconds for s in report.sizes[1:]] == [0.0] * 4
    assert runner.direct_fallbacks == 0
    for raw_bs in (1, 2, 3, 4, 5):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        torch.testing.assert_close(runner.replay(batch), expected)
    assert runner.compilations == 1


@pytest.mark.parametrize("label", COMPILING_PARAMS)
def test_per_size_programs_pass_dynamos_recompile_limit(label: str):
    """``dynamic_batch=False``: more sizes than dynamo's recompile limit
    (lowered to 2 here, so the test stays cheap): each size still gets its
    own program, called directly."""
    sizes = [1, 2, 3, 4, 5]
    world = ToyWorld("cuda" if label.startswith("cuda") else "cpu")
    runner = make_runner(
        label, world.model, decode_buffer_specs(), capture_sizes=sizes, dynamic_batch=False
    )
    with torch._dynamo.config.patch(recompile_limit=2):
        report = runner.capture()
    assert [s.programs for s in report.sizes] == [1] * len(sizes)
    assert runner.compilations == len(sizes)
    assert runner.direct_fallbacks == 0
    for raw_bs in (1, 3, 5):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        torch.testing.assert_close(runner.replay(batch), expected)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_inductor_modes_with_their_own_cuda_graphs_are_refused(mode: str):
    with pytest.raises(ValueError, match=f"compile_mode='{mode}' turns on inductor's own CUDA"):
        inductor_patches(mode, None)
    with pytest.raises(ValueError, match=f"compile_mode='{mode}'"):
        CpuGraphRunner(
            ToyWorld().model, decode_buffer_specs(), device="cpu", max_bs=2, compile_mode=mode
        )


def test_inductor_cudagraph_option_and_unknown_modes_are_refused():
    with pytest.raises(ValueError, match=r"inductor_options\['triton.cudagraphs'\]=True"):
        inductor_patches(None, {"triton.cudagraphs": True})
    with pytest.raises(ValueError, match="compile_mode='fastest'.*Unrecognized mode"):
        inductor_patches("fastest", None)
    with pytest.raises(TypeError, match="compile_mode=3"):
        inductor_patches(3, None)  # type: ignore[arg-type]
    # What is allowed keeps inductor's CUDA graphs off explicitly.
    patches = inductor_patches("max-autotune-no-cudagraphs", {"max_fusion_size": 32})
    assert patches["triton.cudagraphs"] is False and patches["max_fusion_size"] == 32


def test_pool_bytes_counts_only_the_pools_segments_on_its_device():
    pool = (0, 7)
    segments = [
        {"device": 0, "total_size": 2 << 20, "segment_pool_id": (0, 7)},
        {"device": 0, "total_size": 4 << 20, "segment_pool_id": [0, 7]},  # lists from C++
        {"device": 0, "total_size": 8 << 20, "segment_pool_id": (0, 0)},  # the default pool
        {"device": 1, "total_size": 16 << 20, "segment_pool_id": (0, 7)},
        {"device": 0, "total_size": 32 << 20},  # no pool id reported
    ]
    assert pool_bytes(segments, pool, 0) == 6 << 20


def test_the_kind_picks_the_mechanism_and_the_device_its_default():
    world = ToyWorld()
    specs = decode_buffer_specs()
    by_kind = create_runner(world.model, specs, device="cpu", kind="eager", max_bs=2)
    assert isinstance(by_kind.mechanism, EagerCapture) and by_kind.kind == "eager"
    default = create_runner(world.model, specs, device="cpu", max_bs=2)
    assert isinstance(default.mechanism, InductorCapture)  # CPU device: inductor programs
    with pytest.raises(ValueError, match="kind='tpu'; expected one of"):
        create_runner(world.model, specs, device="cpu", kind="tpu", max_bs=2)
    with pytest.raises(TypeError, match=r"unknown runner option\(s\) \['mechanism'\]"):
        create_runner(world.model, specs, device="cpu", mechanism="eager", max_bs=2)


def test_a_phase_runs_on_every_mechanism_through_one_constructor():
    """A phase declares its buffers, outputs and forward once; the mechanism
    is an option of the one constructor, not a subclass."""
    world = ToyWorld()
    batch = world.make_batch(3, seed=4)
    expected, _ = world.eager_reference(batch)
    phase = decode_phase(world.model)
    for kind in ("eager", "cpu"):
        runner = create_runner(
            phase, kind=kind, device=world.device, capture_sizes=[2, 4], show_progress=False
        )
        runner.capture()
        torch.testing.assert_close(runner.replay(batch), expected)
        assert runner.kind == kind


def test_options_of_another_mechanism_are_named():
    with pytest.raises(TypeError, match="runner kind 'eager' takes no option compile=True"):
        RunnerOptions(kind="eager", compile=True)
    with pytest.raises(TypeError, match="runner kind 'cpu' takes no option compile=True"):
        create_runner(
            ToyWorld().model,
            decode_buffer_specs(),
            device="cpu",
            max_bs=2,
            compile=True,
            kind="cpu",
        )


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_cuda_mechanism_refuses_without_a_device():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        create_runner(ToyWorld().model, decode_buffer_specs(), max_bs=2, compile=True, kind="cuda")


def test_one_program_gives_the_per_size_programs_tokens_at_every_size():
    """The one program and the per-size programs, on the same batch and
    state: equal tokens, logits within float rounding, at every raw size."""
    sizes = [1, 2, 4, 6]
    world = ToyWorld()
    runners = {
        dynamic: make_runner(
            "cpu", world.model, decode_buffer_specs(), capture_sizes=sizes, dynamic_batch=dynamic
        )
        for dynamic in (True, False)
    }
    for runner in runners.values():
        runner.capture()
    assert runners[True].compilations == 1 and runners[False].compilations == len(sizes)
    for raw_bs in range(1, 7):
        batch = world.make_batch(raw_bs, seed=10 + raw_bs)
        one, per_size = (runners[d].replay(batch).clone() for d in (True, False))
        assert torch.equal(one.argmax(-1), per_size.argmax(-1)), raw_bs
        torch.testing.assert_close(one, per_size, rtol=0, atol=1e-5)
    assert runners[True].compilations == 1  # replays never compile


def test_a_second_capture_of_the_same_step_is_a_warm_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An empty inductor cache folder: the first capture is cold; a second
    runner over the same step finds its program in the cache (warm)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    world = ToyWorld()
    reports = [
        make_runner("cpu", world.model, decode_buffer_specs(), capture_sizes=[2, 4]).capture()
        for _ in range(2)
    ]
    assert [r.start for r in reports] == ["cold", "warm"]
    assert [(r.compilations, r.cache_hits) for r in reports] == [(1, 0), (1, 1)]
    assert "warm start: 1 compilation(s)" in reports[1].format()
    assert any(tmp_path.iterdir())  # the cache lives where the variable says


def test_a_size_the_forward_branches_on_gets_a_program_of_its_own():
    """A forward that decides on the batch size in Python: the one program,
    traced at the largest size, must not serve a size that takes the other
    branch; that size is compiled on its own, and every size equals eager."""
    world = ToyWorld()

    def branching(b: BufferView) -> torch.Tensor:
        logits = world.model(b)
        return logits * 2 if b.input_ids.shape[0] > 2 else logits - 1

    runner = make_runner("cpu", branching, decode_buffer_specs(), capture_sizes=[1, 2, 4])
    report = runner.capture()
    assert [s.programs for s in report.sizes] == [1, 1, 1]  # 4 for all; 2 and 1 each their own
    for raw_bs in (1, 2, 3, 4):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        twice = runner.graph_size_for(raw_bs) > 2
        torch.testing.assert_close(runner.replay(batch), expected * 2 if twice else expected - 1)
