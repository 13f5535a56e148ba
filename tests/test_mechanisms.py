"""Capture mechanisms composed into runners: every size compiled (no silent
dynamo fallback past its recompile limit), inductor's own CUDA graphs
refused, graph memory measured on the pool itself."""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, make_runner
from graphrunner import CpuGraphRunner, GraphRunner, create_runner, decode_buffer_specs
from graphrunner.mechanisms import CaptureMechanism, EagerCapture, InductorCapture, create_mechanism
from graphrunner.mechanisms.compile import inductor_patches
from graphrunner.mechanisms.cuda_graph import pool_bytes
from graphrunner.testing import ToyWorld

COMPILING = ["cpu"] + (["cuda+compile"] if HAS_CUDA else [])
COMPILING_PARAMS = [
    pytest.param(k, marks=pytest.mark.cuda) if k.startswith("cuda") else k for k in COMPILING
]


@pytest.mark.parametrize("label", COMPILING_PARAMS)
def test_every_size_is_compiled_past_dynamos_recompile_limit(label: str):
    """More sizes than dynamo's recompile limit (lowered to 2 here, so the
    test stays cheap): each size still gets its own program, called directly."""
    sizes = [1, 2, 3, 4, 5]
    world = ToyWorld("cuda" if label.startswith("cuda") else "cpu")
    runner = make_runner(label, world.model, decode_buffer_specs(), capture_sizes=sizes)
    with torch._dynamo.config.patch(recompile_limit=2):
        report = runner.capture()
    assert [s.programs for s in report.sizes] == [1] * len(sizes)
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


def test_a_runner_composes_a_mechanism_by_object_or_name():
    world = ToyWorld()
    specs = decode_buffer_specs()
    by_name = GraphRunner(world.model, specs, device="cpu", mechanism="eager", max_bs=2)
    assert isinstance(by_name.mechanism, EagerCapture) and by_name.kind == "eager"
    inductor = InductorCapture()
    by_object = GraphRunner(world.model, specs, device="cpu", mechanism=inductor, max_bs=2)
    assert by_object.mechanism is inductor and by_object.kind == "cpu"
    default = GraphRunner(world.model, specs, device="cpu", max_bs=2)
    assert isinstance(default.mechanism, InductorCapture)  # CPU device: inductor programs
    with pytest.raises(ValueError, match="unknown runner kind 'tpu'"):
        GraphRunner(world.model, specs, device="cpu", mechanism="tpu", max_bs=2)
    with pytest.raises(TypeError, match="mechanism=3; expected a CaptureMechanism"):
        GraphRunner(world.model, specs, device="cpu", mechanism=3, max_bs=2)  # type: ignore[arg-type]


def test_a_phase_runner_is_one_class_on_every_mechanism():
    """A phase declares its buffers, outputs and forward once; the mechanism
    is a constructor argument, not a subclass."""

    class ToyDecodeRunner(GraphRunner):
        def __init__(self, world: ToyWorld, mechanism: str | CaptureMechanism) -> None:
            super().__init__(
                world.model,
                decode_buffer_specs(),
                device=world.device,
                mechanism=mechanism,
                capture_sizes=[2, 4],
                show_progress=False,
            )

    world = ToyWorld()
    batch = world.make_batch(3, seed=4)
    expected, _ = world.eager_reference(batch)
    for mechanism in ("eager", "cpu"):
        runner = ToyDecodeRunner(world, mechanism)
        runner.capture()
        torch.testing.assert_close(runner.replay(batch), expected)
        assert runner.kind == mechanism


def test_options_of_another_mechanism_are_named():
    with pytest.raises(TypeError, match="runner kind 'eager' takes no option compile=True"):
        create_mechanism("eager", compile=True)
    with pytest.raises(TypeError, match="runner kind 'cpu' takes no option compile=True"):
        create_runner(
            "cpu", ToyWorld().model, decode_buffer_specs(), device="cpu", max_bs=2, compile=True
        )


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_cuda_mechanism_refuses_without_a_device():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        create_runner("cuda", ToyWorld().model, decode_buffer_specs(), max_bs=2, compile=True)
