"""Host-produced inputs: an integer or bool field handed over as a CPU tensor
(ids, positions, lengths, slots a scheduler builds on the host).

Every writer takes one for a device buffer; the fused writers stage its bytes
in the pinned buffer that carries their table, so one copy brings every such
field and the caller may rewrite its tensor as soon as the call returns. On
the CPU (the kernel in Triton's interpreter) every integer source is a host
source, so the staging path is the one the fused tests run; the CUDA runner's
own checks are marked ``cuda``."""

from __future__ import annotations

import pytest
import torch

from graphrunner import CudaGraphRunner, decode_buffer_specs
from graphrunner.declare.buffers import BufferSpec, PadRule, StaticBuffers
from graphrunner.declare.decode import DECODE_FIELD_NAMES
from graphrunner.phases.base import SpecBatch
from graphrunner.testing import ToyWorld
from graphrunner.writers import PopulateError
from graphrunner.writers.base import write_sources
from graphrunner.writers.fused import FusedPopulate, InGraphPopulate
from graphrunner.writers.staging import TableStaging

SPECS = [
    BufferSpec("ids", torch.int64, PadRule.ZERO, index=True),
    BufferSpec("lens", torch.int32, PadRule.FILL, fill_value=1),
    BufferSpec("mask", torch.bool, PadRule.ZERO, rows_per_request=3),
    BufferSpec("hidden", torch.float32, PadRule.KEEP, extra_shape=(5,)),
    BufferSpec("lens_cpu", torch.int64, PadRule.FILL, fill_value=1, host=True),
]


def _sources(raw_bs: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 100, (raw_bs,), generator=gen),
        torch.randint(1, 100, (raw_bs,), generator=gen, dtype=torch.int32),
        torch.randint(0, 2, (raw_bs * 3,), generator=gen).bool(),
        torch.randn(raw_bs, 5, generator=gen),
        torch.randint(1, 100, (raw_bs,), generator=gen),
    ]


def _poisoned_buffers() -> StaticBuffers:
    buffers = StaticBuffers(SPECS, max_bs=8, device="cpu")
    for t in buffers.tensors.values():
        t.fill_(7)
    return buffers


def test_only_device_integer_and_bool_buffers_take_a_host_source():
    assert [s.takes_host_source for s in SPECS] == [True, True, True, False, False]


def test_the_in_graph_writer_reads_what_the_host_held_at_write_not_at_launch():
    writer, reference = InGraphPopulate(_poisoned_buffers(), block=16), _poisoned_buffers()
    for raw_bs, bs in [(3, 4), (1, 8), (8, 8)]:
        sources = _sources(raw_bs, seed=raw_bs)
        write_sources(reference, sources, raw_bs, bs)
        writer.write(sources, raw_bs, bs)
        for t in sources[:3]:
            t.fill_(0)  # the caller reuses its host tensors for the next step
        writer.launch_captured(bs)  # the graph's kernel runs later
        for name, t in writer.buffers.tensors.items():
            if name != "hidden":  # a device-produced input: read where it is
                assert torch.equal(t, reference.tensors[name]), (raw_bs, name)


def test_each_step_is_one_copy_and_one_launch_with_host_and_device_sources():
    writer, reference = FusedPopulate(_poisoned_buffers(), block=16), _poisoned_buffers()
    for step, (raw_bs, bs) in enumerate([(2, 2), (5, 8), (1, 4)], start=1):
        sources = _sources(raw_bs, seed=step)
        host_ops = write_sources(reference, sources, raw_bs, bs, host_only=True)
        assert writer.write(sources, raw_bs, bs) == 2 + host_ops  # the copy and the launch
        write_sources(reference, sources, raw_bs, bs)
        assert (writer.staging.copies, writer.launches) == (step, step)
        for name, t in writer.buffers.tensors.items():
            assert torch.equal(t, reference.tensors[name]), (raw_bs, name)


def test_staged_sources_may_be_strided_and_every_ring_buffer_is_used():
    writer, reference = FusedPopulate(_poisoned_buffers(), block=16), _poisoned_buffers()
    for step in range(2 * writer.staging.depth + 1):
        raw_bs = 1 + step % 8
        sources = _sources(2 * raw_bs, seed=step)
        strided = [t[::2] if i != 2 else t[: raw_bs * 3] for i, t in enumerate(sources)]
        write_sources(reference, strided, raw_bs, 8)
        writer.write(strided, raw_bs, 8)
        for name, t in writer.buffers.tensors.items():
            assert torch.equal(t, reference.tensors[name]), (step, name)


@pytest.mark.parametrize("data_bytes", [-8, 1.5, True, "64"])
def test_a_bad_data_region_size_is_refused_by_name(data_bytes: object):
    with pytest.raises(ValueError, match=rf"data_bytes={data_bytes!r}: expected an int >= 0"):
        TableStaging(2, 8, torch.device("cpu"), data_bytes=data_bytes)  # type: ignore[arg-type]


# On a GPU: the CUDA runner over host-produced fields.

SIZES = [1, 2, 4, 8]


def _host_copy(batch: object, *, pinned: bool) -> SpecBatch:
    """``batch`` with every device field as a CPU tensor (pinned or pageable)."""
    fields = {}
    for name in DECODE_FIELD_NAMES:
        host = getattr(batch, name).cpu()
        fields[name] = host.pin_memory() if pinned else host
    return SpecBatch(
        req_pool_indices_cpu=batch.req_pool_indices_cpu,  # type: ignore[attr-defined]
        seq_lens_cpu=batch.seq_lens_cpu,  # type: ignore[attr-defined]
        **fields,
    )


def _cuda_runner(world: ToyWorld, populate: str, sizes: list[int] = SIZES) -> CudaGraphRunner:
    runner = CudaGraphRunner(
        world.model, decode_buffer_specs(), capture_sizes=sizes, populate=populate,
        show_progress=False,
    )  # fmt: skip
    runner.capture()
    return runner


@pytest.mark.cuda
@pytest.mark.parametrize("populate", ["torch", "fused", "graph"])
@pytest.mark.parametrize("pinned", [True, False])
def test_a_cuda_runner_fed_host_fields_equals_one_fed_device_fields(populate: str, pinned: bool):
    world = ToyWorld("cuda")
    runner = _cuda_runner(world, populate)
    for raw_bs in (1, 3, 8):
        batch = world.make_batch(raw_bs, seed=raw_bs)
        before = world.state()
        expected = runner.replay(batch).clone()
        expected_state = world.state()
        world.restore(before)
        host = _host_copy(batch, pinned=pinned)
        out = runner.replay(host)
        if populate != "torch":  # the fused writers copied the host bytes at the call
            for name in ("input_ids", "seq_lens", "out_cache_loc", "positions"):
                getattr(host, name).fill_(0)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), (populate, raw_bs)
        for name, t in world.state().items():
            assert torch.equal(t, expected_state[name]), (populate, raw_bs, name)


@pytest.mark.cuda
def test_a_host_float_field_is_refused_by_name_before_anything_is_written():
    specs = [*decode_buffer_specs(), BufferSpec("scale", torch.float32, PadRule.KEEP)]
    world = ToyWorld("cuda")
    runner = CudaGraphRunner(
        lambda view: world.model(view) * view.scale[:, None], specs, capture_sizes=SIZES,
        show_progress=False,
    )  # fmt: skip
    runner.capture()
    batch = world.make_batch(2, seed=0)
    host = _host_copy(batch, pinned=False)
    host.scale = torch.ones(2)  # type: ignore[attr-defined]
    before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    with pytest.raises(PopulateError, match=r"input 'scale' is on cpu, expected cuda"):
        runner.replay(host)
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, before[name]), name


@pytest.mark.cuda
def test_the_eager_fallback_moves_host_fields_to_the_device():
    world = ToyWorld("cuda")
    runner = _cuda_runner(world, "fused", sizes=[1, 2])
    batch = world.make_batch(3, seed=5)  # above every captured size
    expected, expected_state = world.eager_reference(batch)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = runner.replay(_host_copy(batch, pinned=False))
    assert runner.stats.eager_fallbacks == 1
    assert torch.equal(out, expected)
    for name, t in world.state().items():
        assert torch.equal(t, expected_state[name]), name
