"""The Triton paged decode attention, in each layout of its split launch,
equals the torch attention (the reference) for random shapes, lengths (1,
key-block and page boundaries, the full context), grouped heads, split counts
and padded rows, reading only each row's live tokens. Without a GPU the kernels run in Triton's interpreter
(conftest sets ``TRITON_INTERPRET=1`` before triton is imported); with one,
on the device. Grids stay small: the interpreter runs each program in Python."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner_ref.model.attention_backend import TorchPagedBackend
from graphrunner_ref.model.attention_meta import attend
from graphrunner_ref.model.attention_op import paged_decode_attention
from graphrunner_ref.model.kernels.decode_attention import (
    BLOCK_N,
    LAYOUTS,
    MAX_SPLITS,
    DecodeScratch,
    choose_splits,
    decode_attention,
)
from hopper import compile_for_hopper

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


@dataclass
class World:
    """Paged KV for ``bs`` live rows (then ``pad`` padded ones): every slot no
    live row reads holds NaN, except slot 0, the padded rows' sink."""

    q: torch.Tensor  # [rows, heads, head_dim]
    k: torch.Tensor  # [slots, kv_heads, head_dim]
    v: torch.Tensor
    req_to_token: torch.Tensor  # int32 [bs + 1, ctx]
    req: torch.Tensor  # int64 [rows]
    lens: torch.Tensor  # int64 [rows]
    group: int

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.req_to_token, self.req, self.lens

    def reference(self) -> torch.Tensor:
        """The torch attention in float32 over the same (rounded) inputs."""
        rows, heads, dim = self.q.shape
        meta = TorchPagedBackend(self.req_to_token).rows_metadata(self.req, self.lens, self.group)
        q = self.q.float().view(rows, heads // self.group, self.group, dim)
        out = attend(q, self.k.float(), self.v.float(), meta, 1 / math.sqrt(dim))
        return out.reshape(rows, heads, dim)


def make_world(
    lens: list[int],
    *,
    kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 16,
    ctx: int = 160,
    page_size: int = 1,
    pad: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> World:
    gen = torch.Generator().manual_seed(seed)
    bs, per_row = len(lens), -(-ctx // page_size)
    pages = torch.randperm(bs * per_row, generator=gen) + 1  # page 0 is padding
    num_slots = (bs * per_row + 1) * page_size
    r2t = torch.zeros(bs + 1, ctx, dtype=torch.int32)
    live = torch.zeros(num_slots, dtype=torch.bool)
    live[0] = True
    order = torch.randperm(bs, generator=gen) + 1  # rows map to scattered request rows
    for i, n in enumerate(lens):
        row_pages = pages[i * per_row : (i + 1) * per_row]
        slots = (row_pages[:, None] * page_size + torch.arange(page_size)).flatten()[:ctx]
        r2t[order[i]] = slots.int()
        live[slots[:n]] = True
    shape = (num_slots, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k[~live], v[~live] = NAN, NAN
    q = torch.randn(bs + pad, kv_heads * group, head_dim, generator=gen)
    req = torch.cat([order, torch.zeros(pad, dtype=torch.int64)])
    seq = torch.tensor(lens + [1] * pad)
    return World(
        *(t.to(DEVICE, dtype) for t in (q, k, v)),
        r2t.to(DEVICE),
        req.to(DEVICE),
        seq.to(DEVICE),
        group,
    )


def run(world: World, splits: int, **kwargs: object) -> torch.Tensor:
    scale = 1 / math.sqrt(world.q.shape[-1])
    return decode_attention(*world.args(), scale=scale, num_splits=splits, **kwargs)  # type: ignore[arg-type]


CASES = [
    # lens, kv_heads, group, head_dim, ctx, page_size, splits
    ([1, 2, 3], 2, 4, 16, 160, 1, 1),
    ([BLOCK_N - 1, BLOCK_N, BLOCK_N + 1], 2, 4, 16, 160, 1, 2),
    ([160, 1, 97], 1, 8, 32, 160, 16, 3),  # full context, page boundaries below
    ([16, 17, 32, 33], 4, 1, 64, 64, 16, 4),  # no grouping
    ([5, 150], 2, 2, 24, 150, 4, MAX_SPLITS),  # head_dim not a power of two; empty chunks
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("lens", "kv_heads", "group", "head_dim", "ctx", "page", "splits"), CASES)
def test_kernel_equals_torch_attention(
    lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    ctx: int,
    page: int,
    splits: int,
    layout: str,
) -> None:
    world = make_world(
        lens, kv_heads=kv_heads, group=group, head_dim=head_dim, ctx=ctx, page_size=page, pad=2
    )
    out = run(world, splits, layout=layout)
    assert torch.isfinite(out).all()  # NaN everywhere but the live tokens and slot 0
    torch.testing.assert_close(out, world.reference(), atol=1e-5, rtol=1e-5)


@settings(max_examples=8, deadline=None)  # the interpreter's first launch parses the kernel
@given(
    lens=st.lists(st.integers(1, 96), min_size=1, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3, 8]),
    page=st.sampled_from([1, 8, 32]),
    splits=st.integers(1, 4),
    pad=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(LAYOUTS),
)
def test_kernel_equals_torch_attention_on_random_shapes(
    lens: list[int],
    kv_heads: int,
    group: int,
    page: int,
    splits: int,
    pad: int,
    seed: int,
    layout: str,
) -> None:
    world = make_world(
        lens, kv_heads=kv_heads, group=group, ctx=96, page_size=page, pad=pad, seed=seed
    )
    out = run(world, splits, layout=layout)
    torch.testing.assert_close(out, world.reference(), atol=1e-5, rtol=1e-5)


ALL_HEADS_CASES = [
    # lens, kv_heads, group, head_dim, splits, block_n: blocks of 16 and 32 keys
    # around their boundaries; 3 KV heads padded to 4, and a single one.
    ([1, 15, 16, 17], 3, 2, 16, 2, 16),
    ([31, 32, 33, 96], 1, 8, 32, 3, 32),
    ([1, 48, 96], 4, 2, 64, 4, None),  # 4 KV heads of 64: blocks of 16
]


@pytest.mark.parametrize(
    ("lens", "kv_heads", "group", "head_dim", "splits", "block"), ALL_HEADS_CASES
)
def test_all_heads_equals_per_head_and_torch(
    lens: list[int], kv_heads: int, group: int, head_dim: int, splits: int, block: int | None
) -> None:
    world = make_world(lens, kv_heads=kv_heads, group=group, head_dim=head_dim, ctx=96, pad=2)
    out = run(world, splits, layout="all_heads", block_n=block)
    assert torch.isfinite(out).all()  # NaN in every slot it must not read
    torch.testing.assert_close(out, world.reference(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, run(world, splits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_within_rounding_of_the_float32_reference(layout: str) -> None:
    world = make_world([1, 64, 130], dtype=torch.bfloat16, pad=1)
    out = run(world, 3, layout=layout)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), world.reference(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_rows_read_slot_zero_only(layout: str) -> None:
    world = make_world([40, 7], pad=3)
    out = run(world, 2, layout=layout)
    kv_head = torch.arange(world.q.shape[1], device=DEVICE) // world.group
    # One key: probability 1, the output is slot 0's value, whatever the query.
    expected = world.v[0, kv_head].expand(3, -1, -1)
    torch.testing.assert_close(out[2:], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stale_scratch_and_output_are_overwritten(layout: str) -> None:
    world = make_world([3, 70, 1], pad=1)
    heads, dim = world.q.shape[1:]
    scratch = DecodeScratch.allocate(8, heads, dim, device=DEVICE)
    scratch.partial_out.fill_(NAN)
    scratch.partial_lse.fill_(NAN)
    out = torch.full_like(world.q, NAN)
    got = run(world, 3, out=out, scratch=scratch, layout=layout)
    assert got is out
    torch.testing.assert_close(got, world.reference(), atol=1e-5, rtol=1e-5)


def test_choose_splits_fills_the_device_within_the_context() -> None:
    assert choose_splits(1, 4, 1024) == MAX_SPLITS  # 1024 / 64 = 16 key blocks
    assert choose_splits(1, 4, 100) == 2  # never more chunks than key blocks
    assert choose_splits(64, 4, 1024) == 2
    assert choose_splits(256, 8, 1024) == 1
    assert all(1 <= choose_splits(bs, 4, 1024) <= MAX_SPLITS for bs in range(1, 300))
    with pytest.raises(ValueError, match=r"bs=0"):
        choose_splits(0, 4, 1024)
    # One program per chunk, not one per KV head: as many programs, more chunks.
    assert choose_splits(64, 4, 1024, layout="all_heads") == 8
    assert choose_splits(64, 1, 1024) == choose_splits(64, 4, 1024, layout="all_heads")
    with pytest.raises(ValueError, match=r"layout='rows': expected one of"):
        choose_splits(1, 4, 1024, layout="rows")


def test_bad_arguments_are_named() -> None:
    world = make_world([4])
    with pytest.raises(ValueError, match=r"num_splits=0"):
        run(world, 0)
    with pytest.raises(ValueError, match=r"layout='by_token'"):
        run(world, 1, layout="by_token")
    with pytest.raises(ValueError, match=r"block_n=24"):
        run(world, 1, layout="all_heads", block_n=24)
    with pytest.raises(ValueError, match=r"q \(1, 8, 16\), k_buf"):
        decode_attention(
            world.q, world.k[:, :, :8], world.v, *world.args()[3:], scale=1.0, num_splits=1
        )


def test_custom_op_is_registered_with_a_fake() -> None:
    world = make_world([5, 66], pad=1)
    scratch = DecodeScratch.allocate(4, world.q.shape[1], 16, device=DEVICE)
    args = (*world.args(), scratch.partial_out, scratch.partial_lse)
    torch.library.opcheck(
        paged_decode_attention, (*args, 0.25, 2), test_utils=("test_schema", "test_faketensor")
    )
    out = paged_decode_attention(*args, 1 / math.sqrt(16), 2)
    torch.testing.assert_close(out, world.reference(), atol=1e-5, rtol=1e-5)


# Compiled, not interpreted: the kernels must lower to Hopper code with no GPU present.
_COMPILE_ATTENTION = """
    import graphrunner_ref.model.kernels.decode_attention as da

    # Each kernel with and without programmatic launch: the wait and release
    # are in the code exactly when PDL is set.
    cases = (("bf16", "tf32", 8, 64, False), ("fp32", "ieee", 2, 16, False),
             ("bf16", "tf32", 8, 64, True))
    for dt, prec, group, dim, pdl in cases:
        ptrs = ["*" + dt] * 3 + ["*i32", "*i64", "*i64", "*fp32", "*fp32", "fp32"]
        consts = dict(GROUP=group, BLOCK_G=16, HEAD_DIM=dim, BLOCK_D=max(16, dim),
                      BLOCK=da.BLOCK_N, NUM_SPLITS=3, PRECISION=prec, PDL=pdl)
        ptx = [compile(da._split_kernel, ptrs + ["i32"] * 12, consts, "ptx")]
        for kv_heads in (1, 4):  # a batch of one KV head; the 1.1B shape's 4
            consts.update(KV_HEADS=kv_heads, BLOCK_H=kv_heads, BLOCK=16)
            ptx.append(compile(da._split_all_heads_kernel, ptrs + ["i32"] * 12, consts, "ptx"))
        consts = dict(HEAD_DIM=dim, BLOCK_D=max(16, dim), NUM_SPLITS=3, BLOCK_S=4, PDL=pdl)
        types = ["*fp32", "*fp32", "*" + dt] + ["i32"] * 7
        ptx.append(compile(da._merge_kernel, types, consts, "ptx"))
        assert all(programmatic(code) == pdl for code in ptx), (dt, pdl)
        assert all("griddepcontrol" not in code for code in ptx if not pdl)
    print("compiled")
"""


def test_kernels_compile_for_hopper(tmp_path: Path) -> None:
    compile_for_hopper(_COMPILE_ATTENTION, tmp_path)
