"""Paged decode attention in Triton: split-KV over each row's live tokens.

One query token per row, its keys at the KV slots listed in its row of
``req_to_token``. Two launches, both with a grid fixed by the batch size, the
heads and the split count (nothing read back, nothing data-dependent):

1. ``(bs, kv_heads, splits)`` programs: each takes one row, one KV head with
   all the query heads of its group (one ``tl.dot`` per key block), and one
   contiguous chunk of the row's first ``seq_lens`` tokens; online softmax over
   the chunk; writes the chunk's normalised output and log-sum-exp. That is
   the default ``"per_head"`` layout; ``"all_heads"`` runs ``(bs, splits)``
   programs, each over every KV head of its chunk, so each token's K and V
   are read as the whole ``[kv_heads, head_dim]`` slot the pool stores
   contiguously (not yet measured against the default on a GPU).
2. ``(bs, heads)`` programs merge the chunks by their log-sum-exp.

Columns at or past ``seq_lens`` are never loaded: a non-finite value in a
slot no live token maps to cannot reach a live row. A padded row
(``req_pool_indices`` 0, ``seq_lens`` 1) reads ``req_to_token[0, 0] = 0``:
KV slot 0 only. A chunk with no tokens (a short row in a wide split) writes
a zero output and a log-sum-exp of ``-inf``, weight 0 in the merge.

Under ``TRITON_INTERPRET=1`` (read at launch) the kernels run in Triton's
interpreter on CPU tensors: that is how CI checks them against the torch
attention.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphrunner.util import needs_extra
from graphrunner_ref.model.kernels.build import jit_or_interpret, pow2_at_least
from graphrunner_ref.model.kernels.pdl import check_device, triton_launch

# Without the [cuda] extra the module still imports (its pure-torch helpers,
# the kernel bodies as plain functions); launching a kernel names the extra
# (the bodies read `tl` only when Triton compiles or interprets them).
with contextlib.suppress(ModuleNotFoundError):
    import triton.language as tl
with contextlib.suppress(ImportError):  # Triton >= 3.4; read only by a kernel launched with PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = [
    "BLOCK_N",
    "LAYOUTS",
    "MAX_SPLITS",
    "DecodeScratch",
    "choose_splits",
    "decode_attention",
]

#: Keys per block of the per-head split loop (a ``tl.dot`` dimension: at least 16).
BLOCK_N = 64
#: Most chunks one row is split into.
MAX_SPLITS = 16
#: The split launch's layouts (see :func:`decode_attention`); the first is the default.
LAYOUTS = ("per_head", "all_heads")
#: Programs of the split launch worth aiming at: a few waves of an H100's 132 SMs.
TARGET_PROGRAMS = 512


def choose_splits(
    bs: int,
    kv_heads: int,
    max_context_len: int,
    *,
    target_programs: int = TARGET_PROGRAMS,
    layout: str = "per_head",
) -> int:
    """Chunks per row for a captured size ``bs``: enough programs to fill the
    device when the batch is small, never more chunks than key blocks in the
    longest row, never more than :data:`MAX_SPLITS`. A pure function of shapes,
    so each captured size gets one fixed grid. ``layout`` (one of
    :data:`LAYOUTS`) says how many programs a chunk takes: one per KV head
    (``"per_head"``) or one (``"all_heads"``)."""
    if bs < 1 or kv_heads < 1 or max_context_len < 1:
        raise ValueError(
            f"choose_splits(bs={bs}, kv_heads={kv_heads}, max_context_len={max_context_len}): "
            "expected positive ints"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"choose_splits: layout={layout!r}: expected one of {LAYOUTS}")
    per_chunk = kv_heads if layout == "per_head" else 1
    wanted = -(-target_programs // (bs * per_chunk))
    blocks = -(-max_context_len // BLOCK_N)
    return max(1, min(wanted, blocks, MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class DecodeScratch:
    """Per-chunk partial results, allocated once for the largest batch.

    partial_out: float32 ``[max_bs, heads, max_splits, head_dim]``.
    partial_lse: float32 ``[max_bs, heads, max_splits]``.
    A launch of ``bs <= max_bs`` rows and ``splits <= max_splits`` uses the head.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(
        cls,
        max_bs: int,
        heads: int,
        head_dim: int,
        *,
        max_splits: int = MAX_SPLITS,
        device: torch.device | str = "cpu",
    ) -> DecodeScratch:
        shape = (max_bs, heads, max_splits)
        return cls(
            torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )

    def fits(self, bs: int, heads: int, splits: int, head_dim: int) -> bool:
        b, h, s, d = self.partial_out.shape
        return bs <= b and heads == h and splits <= s and head_dim == d


# Kernel arguments are annotated with triton.language names only: Triton
# resolves annotations when it compiles (not when it interprets), and a name
# from elsewhere (typing.Any) fails there.
def _split_kernel(
    Q: tl.tensor,
    K: tl.tensor,
    V: tl.tensor,
    ReqToToken: tl.tensor,
    ReqIdx: tl.tensor,
    SeqLens: tl.tensor,
    PartO: tl.tensor,
    PartLse: tl.tensor,
    scale: tl.tensor,
    stride_qb: tl.tensor,
    stride_qh: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_vs: tl.tensor,
    stride_vh: tl.tensor,
    stride_r2t: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    stride_os: tl.tensor,
    stride_lb: tl.tensor,
    stride_lh: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    if PDL:  # launched early (kernels/pdl.py): wait before any access, then release the next
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + row).to(tl.int32)
    req = tl.load(ReqIdx + row).to(tl.int64)
    # Whole key blocks per chunk, so only the last block of a chunk is partial.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK) * BLOCK
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK)
    heads = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    # Dots run on float32 operands (TF32 for 16-bit models, whose values TF32
    # holds exactly; IEEE for float32 ones): one code path, which Triton's
    # interpreter also runs correctly (its 16-bit dot does not).
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    # A finite floor, not -inf: a block whose columns are all masked then gives
    # exp(-inf - floor) = 0 instead of exp(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK):
        cols = n0 + offs_n
        live = cols < end
        slots = tl.load(ReqToToken + req * stride_r2t + cols, mask=live, other=0).to(tl.int64)
        kv_mask = live[:, None] & d_ok[None, :]
        k = tl.load(
            K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(live[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = PartO + row * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_ptrs + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(PartLse + row * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


def _split_all_heads_kernel(
    Q: tl.tensor,
    K: tl.tensor,
    V: tl.tensor,
    ReqToToken: tl.tensor,
    ReqIdx: tl.tensor,
    SeqLens: tl.tensor,
    PartO: tl.tensor,
    PartLse: tl.tensor,
    scale: tl.tensor,
    stride_qb: tl.tensor,
    stride_qh: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_vs: tl.tensor,
    stride_vh: tl.tensor,
    stride_r2t: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    stride_os: tl.tensor,
    stride_lb: tl.tensor,
    stride_lh: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """The ``"all_heads"`` layout: one program per (row, chunk) over every KV
    head, so a token's K (and V) load is its whole slot, ``[kv_heads,
    head_dim]``, contiguous in the pool. Tiles are 3D, KV head first: q and
    the accumulator ``[BLOCK_H, BLOCK_G, BLOCK_D]``, scores ``[BLOCK_H,
    BLOCK_G, BLOCK]``, one batched ``tl.dot`` per key block (no product
    between a query head and another group's keys)."""
    if PDL:  # launched early (kernels/pdl.py): wait before any access, then release the next
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(SeqLens + row).to(tl.int32)
    req = tl.load(ReqIdx + row).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK) * BLOCK
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK)
    # Query head of (kv head, group member): [BLOCK_H, BLOCK_G].
    heads = offs_h[:, None] * GROUP + offs_g[None, :]
    hg_ok = (offs_h[:, None] < KV_HEADS) & (offs_g[None, :] < GROUP)
    hgd_ok = hg_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    q_ptrs = Q + row * stride_qb + heads[:, :, None] * stride_qh + offs_d[None, None, :]
    q = tl.load(q_ptrs, mask=hgd_ok, other=0.0).to(tl.float32)
    # One slot's K row, [BLOCK_H, BLOCK_D]: contiguous when stride_kh == head_dim.
    hd_ok = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k_row = offs_h[:, None] * stride_kh + offs_d[None, :]
    v_row = offs_h[:, None] * stride_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_H, BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H, BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK):
        cols = n0 + offs_n
        live = cols < end
        slots = tl.load(ReqToToken + req * stride_r2t + cols, mask=live, other=0).to(tl.int64)
        kv_mask = live[:, None, None] & hd_ok[None, :, :]
        # [BLOCK, BLOCK_H, BLOCK_D], the pool's order, then KV head first.
        k = tl.load(
            K + slots[:, None, None] * stride_ks + k_row[None, :, :], mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.permute(k.to(tl.float32), (1, 2, 0)), input_precision=PRECISION)
        s = tl.where(live[None, None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        v = tl.load(
            V + slots[:, None, None] * stride_vs + v_row[None, :, :], mask=kv_mask, other=0.0
        )
        pv = tl.dot(p, tl.permute(v.to(tl.float32), (1, 0, 2)), input_precision=PRECISION)
        acc = acc * alpha[:, :, None] + pv
        m_i = m_new

    has = l_i > 0.0
    out = tl.where(has[:, :, None], acc / tl.where(has, l_i, 1.0)[:, :, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = PartO + row * stride_ob + heads[:, :, None] * stride_oh + split * stride_os
    tl.store(o_ptrs + offs_d[None, None, :], out, mask=hgd_ok)
    tl.store(PartLse + row * stride_lb + heads * stride_lh + split, lse, mask=hg_ok)


def _merge_kernel(
    PartO: tl.tensor,
    PartLse: tl.tensor,
    Out: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    stride_os: tl.tensor,
    stride_lb: tl.tensor,
    stride_lh: tl.tensor,
    stride_outb: tl.tensor,
    stride_outh: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    if PDL:  # launched early (kernels/pdl.py): wait before any access, then release the next
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(
        PartLse + row * stride_lb + head * stride_lh + offs_s, mask=s_ok, other=float("-inf")
    )
    # Chunk 0 always holds the row's first token, so the maximum is finite.
    weight = tl.exp(lse - tl.max(lse, 0))
    o_ptrs = PartO + row * stride_ob + head * stride_oh + offs_s[:, None] * stride_os
    part = tl.load(o_ptrs + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    out_ptrs = Out + row * stride_outb + head * stride_outh + offs_d
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)


_KERNELS = (_split_kernel, _split_all_heads_kernel, _merge_kernel)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """The per-head split, all-heads split and merge kernels, jitted or
    interpreted (``TRITON_INTERPRET`` is read at launch rather than import, so
    one process can run both)."""
    split, all_heads, merge = (jit_or_interpret(k, interpret, _NEEDS) for k in _KERNELS)
    return split, all_heads, merge


_NEEDS = "the Triton decode attention (--attention torch runs without it)"


def _needs_triton() -> contextlib.AbstractContextManager[None]:
    return needs_extra("cuda", _NEEDS)


def _triton() -> Any:
    """The ``triton`` module; :class:`MissingExtraError` naming the extra without it."""
    with _needs_triton():
        import triton

    return triton


def _interpreting() -> bool:
    knobs = getattr(_triton(), "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def _precision(dtype: torch.dtype) -> str:
    # float32 models are checked token for token against transformers: no TF32
    # rounding of their operands. 16-bit values fit TF32 exactly.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(layout: str, kv_heads: int, head_dim: int, block_n: int | None) -> int:
    """Keys per block: ``block_n`` if given (a power of two, at least 16), else
    :data:`BLOCK_N` for ``"per_head"`` and, for ``"all_heads"``, as many as
    keep one K tile at ``BLOCK_N * 64`` elements (the per-head tile at
    head_dim 64): 16 at 4 KV heads of 64."""
    if block_n is not None:
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"decode_attention: block_n={block_n}: expected a power of two >= 16")
        return block_n
    if layout == "per_head":
        return BLOCK_N
    tile = pow2_at_least(kv_heads, 1) * pow2_at_least(head_dim, 16)
    return max(16, min(BLOCK_N, BLOCK_N * 64 // tile))


def _check_args(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, num_splits: int, layout: str
) -> None:
    heads, head_dim = q.shape[1:]
    if heads % k_buf.shape[1] or k_buf.shape[2] != head_dim or v_buf.shape != k_buf.shape:
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)}, k_buf {tuple(k_buf.shape)}, v_buf "
            f"{tuple(v_buf.shape)}: expected heads a multiple of kv_heads and one head_dim"
        )
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits={num_splits}: expected 1..{MAX_SPLITS}")
    if layout not in LAYOUTS:
        raise ValueError(f"decode_attention: layout={layout!r}: expected one of {LAYOUTS}")


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    scratch: DecodeScratch | None = None,
    layout: str = "per_head",
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one query token per row over its paged KV.

    q: ``[bs, heads, head_dim]``; heads ``h`` reads KV head ``h // (heads // kv_heads)``.
    k_buf, v_buf: ``[num_slots, kv_heads, head_dim]`` in q's dtype, unit stride on the last dim.
    req_to_token: int32 ``[num_reqs, max_context_len]``, contiguous rows.
    req_pool_indices, seq_lens: int ``[bs]``; row ``b`` reads the KV slots
        ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` (``seq_lens >= 1``).
    num_splits: chunks per row, ``1..MAX_SPLITS`` (see :func:`choose_splits`,
        given the same ``layout``: the ``"all_heads"`` grid has ``kv_heads``
        times fewer programs).
    out: optional ``[bs, heads, head_dim]`` in q's dtype to write into.
    scratch: optional buffers for the chunks' partial results; fresh ones
        otherwise (inside a CUDA graph those come from the graph's pool, once).
    layout: the split launch (one of :data:`LAYOUTS`): ``"per_head"`` (the
        default), grid ``(bs, kv_heads, splits)``, or ``"all_heads"``, grid
        ``(bs, splits)``, each program over every KV head of its chunk.
    block_n: keys per block of the split loop (tuning; see :func:`_block_n`).
    num_warps, num_stages: the split launch's Triton settings (tuning).
    pdl: launch both kernels programmatically (:mod:`~graphrunner_ref.model.kernels.pdl`;
        CUDA sm_90+).
    Returns ``out`` (or a new tensor). The softmax runs in float32.
    """
    _check_args(q, k_buf, v_buf, num_splits, layout)
    if pdl:
        check_device(q.device, "decode_attention")
    bs, heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if scratch is None or not scratch.fits(bs, heads, num_splits, head_dim):
        scratch = DecodeScratch.allocate(
            bs, heads, head_dim, max_splits=num_splits, device=q.device
        )
    if bs == 0:
        return out
    per_head, all_heads, merge_kernel = _kernels(_interpreting())
    po, pl = scratch.partial_out, scratch.partial_lse
    kv_heads, group, block_d = k_buf.shape[1], heads // k_buf.shape[1], pow2_at_least(head_dim, 16)
    consts: dict[str, Any] = dict(
        GROUP=group, BLOCK_G=pow2_at_least(group, 16), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK=_block_n(layout, kv_heads, head_dim, block_n), NUM_SPLITS=num_splits,
        PRECISION=_precision(q.dtype),
    )  # fmt: skip
    grid: tuple[int, ...] = (bs, kv_heads, num_splits)
    split_kernel = per_head
    if layout == "all_heads":  # one program over every KV head of a chunk
        split_kernel, grid = all_heads, (bs, num_splits)
        consts.update(KV_HEADS=kv_heads, BLOCK_H=pow2_at_least(kv_heads, 1))
    split_kernel[grid](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, po, pl, scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        **consts, num_warps=num_warps, num_stages=num_stages, **triton_launch(pdl),
    )  # fmt: skip
    merge_kernel[(bs, heads)](
        po, pl, out,
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=pow2_at_least(num_splits, 2), **triton_launch(pdl),
    )  # fmt: skip
    return out
