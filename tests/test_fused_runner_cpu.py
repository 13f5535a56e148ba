"""The fused and in-graph populate inside a runner, on the CPU (the kernel in
Triton's interpreter): the replay path hands the validated sources to the
mechanism's writer, the in-graph protocol (an all-padding table staged before
each capture, the kernel launched ahead of the forward, a table staged per
replay, an empty one for a bare relaunch) gives what the torch populate gives
at every raw size, future references included.

The mechanisms here are test doubles of ``CudaGraphCapture``'s populate
options over the eager mechanism (no CUDA graph on a CPU); the CUDA runner
itself is tested in ``tests/test_in_graph_populate.py`` (marked cuda)."""

from __future__ import annotations

import pytest
import torch

from graphrunner import FutureMap, GraphRunner, create_runner, decode_buffer_specs
from graphrunner.declare.buffers import BufferView, StaticBuffers
from graphrunner.mechanisms import MECHANISMS, CaptureMechanism, EagerCapture
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.testing import ToyWorld
from graphrunner.writers import PopulateError
from graphrunner.writers.fused import FusedPopulate, InGraphPopulate

SIZES = [1, 2, 4, 8]


class FusedEager(EagerCapture):
    """The eager mechanism with the fused writer (``populate="fused"``)."""

    kind = "fused-eager"

    def bind_buffers(self, buffers: StaticBuffers) -> None:
        self.populate_writer = FusedPopulate(buffers, block=32)


class InGraphEager(EagerCapture):
    """The eager mechanism run as ``CudaGraphCapture(populate="graph")`` runs:
    the kernel is part of each size's step, the launcher stages nothing."""

    kind = "in-graph-eager"

    def bind_buffers(self, buffers: StaticBuffers) -> None:
        self.writer = InGraphPopulate(buffers, block=32)
        self.populate_writer = self.writer

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        self.writer.before_capture(bs)

        def step() -> object:
            self.writer.launch_captured(bs)  # "inside the graph", ahead of the forward
            return forward(view)

        return step  # type: ignore[return-value]

    def capture(self, bs: int, fn: Launcher) -> Launcher:
        def launch() -> object:
            self.writer.before_replay()
            return fn()

        return launch  # type: ignore[return-value]


def _runner(
    world: ToyWorld, mechanism: type[CaptureMechanism], future: FutureMap | None = None
) -> GraphRunner:
    with pytest.MonkeyPatch.context() as patch:  # a mechanism kind of the tests' own
        patch.setitem(MECHANISMS, mechanism.kind, mechanism)
        runner = create_runner(
            world.model,
            decode_buffer_specs(future=future is not None),
            kind=mechanism.kind,
            device="cpu",
            capture_sizes=SIZES,
            future_map=future,
            show_progress=False,
        )
    runner.capture()
    return runner


@pytest.mark.parametrize("mechanism", [FusedEager, InGraphEager])
def test_every_raw_size_equals_the_torch_populate_runner(mechanism: type):
    world = ToyWorld()
    fused, reference = _runner(world, mechanism), _runner(world, EagerCapture)
    for raw_bs in range(1, 9):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        for runner in (fused, reference):
            for t in runner.buffers.tensors.values():
                t.fill_(-7)  # poison: a stale or unwritten row would show
        before = world.state()
        expected = reference.replay(batch).clone()
        world.restore(before)
        out = fused.replay(batch)
        assert torch.equal(out, expected), raw_bs
        bs = fused.graph_size_for(raw_bs)
        for name, t in fused.buffers.tensors.items():
            assert torch.equal(t[:bs], reference.buffers.tensors[name][:bs]), (raw_bs, name)
        ops = 2 if mechanism is FusedEager else 1  # table copy (+ the launch)
        assert fused.stats.last_populate_ops == ops


def test_a_bare_relaunch_stages_an_empty_table():
    world = ToyWorld()
    runner = _runner(world, InGraphEager)
    runner.replay(world.make_batch(3, seed=1))
    for t in runner.buffers.tensors.values():
        t[:4].fill_(1)
    filled = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    runner.relaunch(4)
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, filled[name]), name


@pytest.mark.parametrize("mechanism", [FusedEager, InGraphEager])
def test_future_references_are_resolved_by_the_kernel(mechanism: type):
    world = ToyWorld()
    future = FutureMap(world.req_pool.req_to_token.shape[0], "cpu")
    runners = {
        "fused": _runner(world, mechanism, future),
        "torch": _runner(world, EagerCapture, future),
    }
    batch = world.make_batch(3, seed=5)
    rows = batch.req_pool_indices_cpu.tolist()
    future.tokens[rows[0]], future.tokens[rows[2]] = 11, 13
    batch.input_ids = torch.tensor([-rows[0], 7, -rows[2]])
    for runner in runners.values():
        runner.replay(batch)
    ids = {k: r.buffers.tensors["input_ids"][:4].tolist() for k, r in runners.items()}
    assert ids["fused"] == ids["torch"] == [11, 7, 13, 0]


@pytest.mark.parametrize("mechanism", [FusedEager, InGraphEager])
def test_a_bad_input_is_refused_before_the_writer_stages_anything(mechanism: type):
    world = ToyWorld()
    runner = _runner(world, mechanism)
    batch = world.make_batch(3, seed=2)
    batch.positions = batch.positions.to(torch.int32)
    writer = runner.mechanism.populate_writer
    assert isinstance(writer, FusedPopulate)
    copies, before = (
        writer.staging.copies,
        {n: t.clone() for n, t in runner.buffers.tensors.items()},
    )
    with pytest.raises(PopulateError, match=r"'positions' has dtype torch.int32"):
        runner.replay(batch)
    assert writer.staging.copies == copies
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, before[name]), name
