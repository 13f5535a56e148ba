"""The fused populate (one Triton launch) equals the torch populate bit for
bit, for random declarations: every integer, float and bool dtype, per-request,
per-token and per-candidate rows, extra row shapes, host buffers, the future
gather, KEEP tails, poisoned buffers, misaligned and strided sources.

On the CPU the kernel runs in Triton's interpreter (chosen by the buffers'
device, so these tests share a process with the rest of the suite), with small
blocks; the same property runs on a GPU (marked cuda).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrunner import BufferSpec, PadRule
from graphrunner.declare import StaticBuffers
from graphrunner.writers import populate
from graphrunner.writers.base import check_sources
from graphrunner.writers.fused import FusedPopulate, InGraphPopulate, pad_pattern
from graphrunner.writers.staging import DEPTH, TableStaging
from hopper import compile_for_hopper

INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES = [*INTS, *FLOATS, torch.bool]
FUTURE_ROWS = 6  # rows of the future map in the declarations that have one


@st.composite
def specs_strategy(draw: st.DrawFn) -> list[BufferSpec]:
    """1 to 5 buffers of random dtype, rule, layout; maybe a host buffer and a future one."""
    specs = []
    for i in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        rules = [PadRule.ZERO, PadRule.FILL, PadRule.KEEP]
        rules += [PadRule.WIDTH] if dtype in INTS else []
        rule = draw(st.sampled_from(rules))
        kwargs: dict[str, object] = {}
        if rule is PadRule.FILL:
            if dtype is torch.bool:
                kwargs["fill_value"] = True
            elif dtype in INTS:
                low = 0 if dtype is torch.uint8 else -100
                kwargs["fill_value"] = draw(st.integers(low, 100).filter(bool))
            else:
                kwargs["fill_value"] = draw(st.sampled_from([0.5, -2.25, 3.0, -0.0, 0.125]))
        if rule is PadRule.WIDTH:
            kwargs["width"] = draw(st.integers(1, 7))
        rows = draw(st.sampled_from([1, 1, 2, 3]))  # per request, per token, per candidate
        extra = draw(st.sampled_from([(), (), (3,), (2, 2)]))
        specs.append(
            BufferSpec(f"f{i}", dtype, rule, rows_per_request=rows, extra_shape=extra, **kwargs)
        )
    if draw(st.booleans()):
        specs.append(BufferSpec("host_f", torch.int64, PadRule.FILL, fill_value=3, host=True))
    if draw(st.booleans()):
        specs.append(BufferSpec("ids", torch.int64, PadRule.ZERO, index=True, future=True))
    return specs


def random_rows(
    spec: BufferSpec, rows: int, gen: torch.Generator, layout: str, device: str = "cpu"
) -> torch.Tensor:
    """``rows`` rows of random bits (NaN payloads included) on ``device``, laid
    out as asked: contiguous, one element past an 8-byte boundary, or strided."""
    shape = (rows, *spec.extra_shape)
    n = torch.Size(shape).numel()
    if spec.future:
        # About half of them future references -r (r >= 1; row 0 is padding).
        refs = -torch.randint(1, FUTURE_ROWS, (n,), generator=gen)
        tokens = torch.randint(0, 1000, (n,), generator=gen)
        values = torch.where(torch.rand(n, generator=gen) < 0.5, refs, tokens)
    elif spec.dtype is torch.bool:
        values = torch.randint(0, 2, (n,), generator=gen).bool()
    else:
        size = torch.empty((), dtype=spec.dtype).element_size()
        raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
        values = raw.view(spec.dtype)
    values = values.to(device)
    if layout == "strided":
        wide = torch.zeros(2 * n, dtype=values.dtype, device=device)
        wide[::2] = values
        return wide[::2].view(shape)
    if layout == "misaligned" and n:
        bytes_ = values.view(torch.uint8)
        size = bytes_.numel() // n
        holder = torch.zeros(bytes_.numel() + size, dtype=torch.uint8, device=device)
        holder[size:] = bytes_
        return holder[size:].view(values.dtype).view(shape)  # offset by one element
    return values.view(shape)


@dataclass
class Pair:
    """The same declaration twice: written by the torch populate and by the fused one."""

    reference: StaticBuffers
    fused: StaticBuffers


def make_pair(specs: list[BufferSpec], max_bs: int, device: str, seed: int) -> Pair:
    gen = torch.Generator().manual_seed(seed)
    future = torch.randint(0, 1 << 40, (FUTURE_ROWS,), generator=gen)
    has_future = any(s.future for s in specs)
    pair = Pair(
        *(
            StaticBuffers(
                specs, max_bs, device, future_tokens=future.to(device) if has_future else None
            )
            for _ in range(2)
        )
    )
    for name, a in pair.reference.tensors.items():
        poison = random_rows(BufferSpec(name, a.dtype, PadRule.KEEP), a.numel(), gen, "contiguous")
        a.copy_(poison.view(a.shape))
        pair.fused.tensors[name].copy_(a)
    return pair


def assert_bit_equal(pair: Pair, *, nan_for_nan: bool = False) -> None:
    """Every buffer bit-equal; with ``nan_for_nan``, a NaN in both counts as
    equal whatever its payload: torch's CUDA ``_foreach_copy_`` (the torch
    populate) writes every half or bfloat16 NaN as 0x7fff (measured on an
    H100), while the fused kernel copies the bits as they are."""
    for name, a in pair.reference.tensors.items():
        b = pair.fused.tensors[name]
        differ = a.view(torch.uint8) != b.view(torch.uint8)
        if nan_for_nan and a.is_floating_point() and differ.any():
            both_nan = (a.isnan() & b.isnan()).reshape(-1, 1)
            per_element = differ.reshape(-1, a.element_size()) & ~both_nan
            differ = per_element.reshape(differ.shape)
        if differ.any():
            diff = differ.nonzero()[:4].tolist()
            raise AssertionError(f"{name} ({a.dtype}) differs at {diff}")


def run_property(specs: list[BufferSpec], sizes: list[tuple[int, int]], device: str, seed: int):
    max_bs = max(bs for _, bs in sizes)
    pair = make_pair(specs, max_bs, device, seed)
    writer = FusedPopulate(pair.fused, block=32)
    gen = torch.Generator().manual_seed(seed + 1)
    for step, (raw_bs, bs) in enumerate(sizes):
        layout = ["contiguous", "misaligned", "strided"][step % 3]
        inputs = SimpleNamespace(
            **{
                s.name: random_rows(s, s.rows(raw_bs), gen, layout, str(pair.fused.device_of(s)))
                for s in specs
            }
        )
        populate(pair.reference, inputs if raw_bs else None, raw_bs, bs)
        sources = check_sources(pair.fused, inputs, raw_bs) if raw_bs else []
        writer.write(sources, raw_bs, bs)
        assert_bit_equal(pair, nan_for_nan=device != "cpu")
    assert writer.launches == len(sizes)


sizes_strategy = st.lists(
    st.integers(1, 5).flatmap(lambda bs: st.tuples(st.integers(0, bs), st.just(bs))),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_strategy(), sizes=sizes_strategy, seed=st.integers(0, 1 << 16))
def test_fused_equals_torch_populate_on_cpu(specs, sizes, seed):
    run_property(specs, sizes, "cpu", seed)


@pytest.mark.cuda
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_strategy(), sizes=sizes_strategy, seed=st.integers(0, 1 << 16))
def test_fused_equals_torch_populate_on_gpu(specs, sizes, seed):
    run_property(specs, sizes, "cuda", seed)


def test_wide_and_byte_paths_and_many_blocks():
    """Rows longer than several blocks, 8-byte aligned (word path) and not (byte path)."""
    specs = [
        BufferSpec("hidden", torch.float32, PadRule.ZERO, rows_per_request=2, extra_shape=(40,)),
        BufferSpec("odd", torch.int8, PadRule.FILL, fill_value=-3, extra_shape=(7,)),
        BufferSpec("lens", torch.int64, PadRule.WIDTH, width=4),
    ]
    run_property(specs, [(3, 4), (1, 4), (4, 4), (0, 2)], "cpu", seed=7)


def test_pad_pattern_is_the_pad_value_repeated():
    def bytes_of(spec: BufferSpec) -> list[int]:
        return list(torch.tensor([pad_pattern(spec)]).view(torch.uint8).tolist())

    fill16 = BufferSpec("a", torch.float16, PadRule.FILL, fill_value=0.5)
    assert bytes_of(fill16) == [0x00, 0x38] * 4  # 0.5 in binary16, little endian
    width8 = BufferSpec("b", torch.int8, PadRule.WIDTH, width=3)
    assert bytes_of(width8) == [3] * 8
    neg32 = BufferSpec("c", torch.int32, PadRule.FILL, fill_value=-2)
    assert bytes_of(neg32) == [0xFE, 0xFF, 0xFF, 0xFF] * 2
    assert (
        pad_pattern(BufferSpec("d", torch.bool, PadRule.FILL, fill_value=True))
        == 0x0101010101010101
    )
    assert pad_pattern(BufferSpec("e", torch.float64, PadRule.KEEP)) == 0


def test_an_element_wider_than_eight_bytes_is_refused_by_name():
    specs = [BufferSpec("spectrum", torch.complex128, PadRule.ZERO)]
    with pytest.raises(ValueError, match=r"'spectrum'.*complex128.*16-byte"):
        FusedPopulate(StaticBuffers(specs, 2, "cpu"))


def test_in_graph_writer_stages_only_and_a_bare_launch_changes_nothing():
    """InGraphPopulate.write stages the table without launching (the graph's
    kernel applies it); a launch with nothing staged (relaunch) gets an empty
    table, so the buffers stay as they are even when the last sources are gone."""
    specs = [BufferSpec("x", torch.int32, PadRule.FILL, fill_value=9, rows_per_request=2)]
    bufs = StaticBuffers(specs, 4, "cpu")
    writer = InGraphPopulate(bufs, block=16)
    src = torch.arange(4, dtype=torch.int32)
    assert writer.write([src], 2, 4) == 1 and writer.launches == 0
    writer.before_replay()  # a staged table: kept for the launch
    writer.launch_captured(4)  # what the graph does
    assert bufs.tensors["x"].tolist() == [0, 1, 2, 3, 9, 9, 9, 9]
    bufs.tensors["x"].fill_(-1)
    writer.before_replay()  # nothing staged since the last launch
    writer.launch_captured(4)
    assert bufs.tensors["x"].tolist() == [-1] * 8


def test_staging_cycles_a_ring_of_host_buffers_into_one_device_table():
    specs = [BufferSpec("x", torch.int64, PadRule.ZERO)]
    writer = FusedPopulate(StaticBuffers(specs, 2, "cpu"), block=16)
    staging = writer.staging
    seen = []
    for _ in range(DEPTH):
        seen.append(staging.next_host())
        staging.upload()
    assert len({id(h) for h in seen}) == DEPTH and staging.next_host() is seen[0]
    table = staging.device_table.data_ptr()
    writer.write([torch.tensor([5, 6])], 2, 2)
    assert staging.device_table.data_ptr() == table and staging.copies == DEPTH + 1
    assert staging.device_table[0, 0] == writer.buffers.tensors["x"].data_ptr()


@pytest.mark.parametrize("depth", [1, 0, True, 2.0])
def test_a_ring_shorter_than_two_is_refused_by_name(depth: object):
    with pytest.raises(ValueError, match=rf"depth={depth!r}: expected an int >= 2"):
        TableStaging(1, 8, torch.device("cpu"), depth=depth)  # type: ignore[arg-type]


_COMPILE_POPULATE = """
    import graphrunner.writers.fused_kernel as pf

    consts = dict(ROW=pf.ROW, BLOCK=pf.BLOCK)
    assert compile(pf._populate, ["*i64", "*i64"], consts)
    print("compiled")
"""


def test_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    """The interpreter runs what the GPU compiler refuses (a ``typing.Any``
    annotation on an argument did); lowering to sm_90 catches it on the CPU."""
    compile_for_hopper(_COMPILE_POPULATE, tmp_path)


@pytest.mark.parametrize("layout", ["contiguous", "misaligned"])
def test_the_in_graph_launch_covers_a_keep_buffer_wider_than_every_padded_one(layout: str):
    """Inside a graph the kernel runs with the grid captured for the
    all-padding table of size ``bs``; it must still reach every live byte of
    a KEEP buffer (no tail, so no padded bytes) that is longer than the
    padded buffers."""
    specs = [
        BufferSpec("hidden", torch.float32, PadRule.KEEP, extra_shape=(6,)),
        BufferSpec("flag", torch.int8, PadRule.ZERO),
    ]
    pair = make_pair(specs, 8, "cpu", seed=3)
    writer = InGraphPopulate(pair.fused, block=32)
    gen = torch.Generator().manual_seed(4)
    for raw_bs, bs in [(8, 8), (5, 8), (1, 1)]:
        rows = {s.name: random_rows(s, s.rows(raw_bs), gen, layout) for s in specs}
        inputs = SimpleNamespace(**rows)
        populate(pair.reference, inputs, raw_bs, bs)
        writer.before_capture(bs)
        writer.write(check_sources(pair.fused, inputs, raw_bs), raw_bs, bs)
        writer.launch_captured(bs)  # what the graph replays
        assert_bit_equal(pair)
