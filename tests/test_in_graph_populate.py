"""The fused and in-graph populate inside a CUDA runner (marked cuda; skipped
without a device): every raw size 1..8 against the torch-populate runner and
the eager model, with poisoned buffers; a bare relaunch changes nothing; the
device operations each replay issues outside the graph; the overlap future
gather through the in-graph kernel. Off a GPU: the option is refused by name
on the CPU runners."""

from __future__ import annotations

import pytest
import torch

from graphrunner import CudaGraphRunner, create_runner, decode_buffer_specs
from graphrunner.testing import ToyWorld

SIZES = [1, 2, 4, 8]
MODES = ["fused", "graph"]


def _runner(world: ToyWorld, populate: str) -> CudaGraphRunner:
    runner = CudaGraphRunner(
        world.model,
        decode_buffer_specs(),
        capture_sizes=SIZES,
        populate=populate,
        show_progress=False,
    )
    runner.capture()
    return runner


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_every_raw_size_equals_eager_and_the_torch_populate(mode: str):
    world = ToyWorld("cuda")
    fused, reference = _runner(world, mode), _runner(world, "torch")
    for raw_bs in range(1, 9):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, expected_state = world.eager_reference(batch)
        for runner in (fused, reference):
            for t in runner.buffers.tensors.values():
                t.fill_(-7)  # poison: a stale row would show
        before = world.state()
        out_ref = reference.replay(batch).clone()
        state_ref = world.state()
        world.restore(before)
        out = fused.replay(batch).clone()
        torch.cuda.synchronize()
        # Bit for bit the torch populate's replay; eager ran the unpadded batch
        # (other GEMM shapes on a GPU), so equal to it within float32 rounding.
        assert torch.equal(out, out_ref), raw_bs
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5), raw_bs
        for name, t in world.state().items():
            # Bit for bit what the torch populate's replay left, padded rows'
            # writes to KV slot 0 included; and eager's state in every slot a
            # live row or a bystander owns (eager runs no padded row).
            assert torch.equal(t, state_ref[name]), (raw_bs, name)
            live = slice(None) if name == "req_to_token" else slice(1, None)
            assert torch.equal(t[live], expected_state[name][live]), (raw_bs, name)
        bs = fused.graph_size_for(raw_bs)
        for name, t in fused.buffers.tensors.items():
            ref = reference.buffers.tensors[name]
            assert torch.equal(t[:bs], ref[:bs]), (raw_bs, name)
        assert fused.stats.last_populate_ops == (2 if mode == "fused" else 1)


@pytest.mark.cuda
def test_a_bare_relaunch_of_an_in_graph_runner_leaves_the_buffers_as_they_are():
    world = ToyWorld("cuda")
    runner = _runner(world, "graph")
    runner.replay(world.make_batch(3, seed=1))
    torch.cuda.synchronize()
    before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    for t in runner.buffers.tensors.values():
        t[:4].fill_(1)  # a valid index everywhere, not what the last step wrote
    after_fill = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    runner.relaunch(4)
    torch.cuda.synchronize()
    # Re-reading the last step's table would put its rows back.
    assert any(not torch.equal(after_fill[n], before[n]) for n in before)
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, after_fill[name]), name


@pytest.mark.cuda
def test_the_in_graph_kernel_resolves_future_references():
    from graphrunner import FutureMap

    world = ToyWorld("cuda")
    future = FutureMap(world.req_pool.req_to_token.shape[0], "cuda")
    runners = {
        mode: CudaGraphRunner(
            world.model,
            decode_buffer_specs(future=True),
            capture_sizes=SIZES,
            populate=mode,
            future_map=future,
            show_progress=False,
        )
        for mode in ("torch", "graph")
    }
    for runner in runners.values():
        runner.capture()
    batch = world.make_batch(3, seed=5)
    rows = batch.req_pool_indices_cpu.tolist()
    future.tokens[rows[0]] = 11
    future.tokens[rows[2]] = 13
    batch.input_ids = torch.tensor([-rows[0], 7, -rows[2]], device="cuda")
    for runner in runners.values():
        runner.replay(batch)
    torch.cuda.synchronize()
    ids = {mode: r.buffers.tensors["input_ids"][:4].tolist() for mode, r in runners.items()}
    assert ids["graph"] == ids["torch"] == [11, 7, 13, 0]


@pytest.mark.parametrize("kind", ["cpu", "eager"])
def test_the_cpu_runners_refuse_the_populate_option_by_name(kind: str):
    world = ToyWorld()
    with pytest.raises(TypeError, match="populate='fused'"):
        create_runner(world.model, decode_buffer_specs(), device="cpu", populate="fused", kind=kind)


@pytest.mark.cuda
def test_in_graph_populate_over_a_compiled_forward():
    """The kernel is recorded ahead of the size's inductor program in the graph."""
    world = ToyWorld("cuda")
    runner = CudaGraphRunner(
        world.model,
        decode_buffer_specs(),
        capture_sizes=[1, 2],
        populate="graph",
        compile=True,
        show_progress=False,
    )
    runner.capture()
    for raw_bs in (1, 2):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        for t in runner.buffers.tensors.values():
            t.fill_(-7)
        out = runner.replay(batch)
        torch.cuda.synchronize()
        # An inductor program sums in its own order: equal within float32 rounding.
        assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4), raw_bs
