"""Rotary embedding and the KV write of a step, in one Triton launch.

Between the stacked q/k/v product and the attention, a step rotates q and k
by each row's position and writes k and v at the row's KV slot: in torch
ops a gather of the cos/sin rows, the products, a concatenation and two
scatters, which inductor turns into several small kernels. Here one launch
takes ``qkv [M, (H + 2 H_kv) D]``, a grid of ``(M, H + 2 H_kv)`` programs,
program ``(m, h)`` one head of one row:

* a query head: rotated, written to ``q [M, H D]`` (the attention's input);
* a key head: rotated, written to ``k_cache[out_loc[m], h - H]``;
* a value head: written to ``v_cache[out_loc[m], h - H - H_kv]``.

The roundings are :class:`~graphrunner_ref.model.layers.RotaryEmbedding`'s: the
float32 cos/sin table cast to the dtype, each product rounded, then the sum
(the rotation pairs element ``i`` with ``i + D / 2``). A padded row (position
0, slot 0) writes KV slot 0 only, the sink; no program reads another row.

CPU tensors run in Triton's interpreter (how CI checks the kernel against
:func:`reference`), CUDA tensors compiled.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from graphrunner_ref.model.kernels.build import jit_or_interpret, pow2_at_least
from graphrunner_ref.model.kernels.pdl import check_device, triton_launch
from graphrunner_ref.model.layers import rotary_rows, rotate

with contextlib.suppress(ModuleNotFoundError):
    import triton.language as tl
with contextlib.suppress(ImportError):  # Triton >= 3.4; read only by a kernel launched with PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["reference", "rope_store", "rope_store_fake"]


# Arguments are annotated with triton.language names only (see decode_attention).
def _rope_store_kernel(
    QKV: tl.tensor,
    Pos: tl.tensor,
    Cos: tl.tensor,
    Sin: tl.tensor,
    Loc: tl.tensor,
    Q: tl.tensor,
    KC: tl.tensor,
    VC: tl.tensor,
    stride_xm: tl.int32,
    stride_cos: tl.int32,
    stride_qm: tl.int32,
    stride_ks: tl.int32,
    stride_kh: tl.int32,
    stride_vs: tl.int32,
    stride_vh: tl.int32,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Program ``(m, h)``: head ``h`` of row ``m`` (see the module's docstring)."""
    if PDL:  # launched early (kernels/pdl.py): wait before any access, then release the next
        gdc_wait()
        gdc_launch_dependents()
    m = tl.program_id(0)
    h = tl.program_id(1)
    dtype = QKV.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    ok = offs < HALF
    head = QKV + m * stride_xm + h * (2 * HALF)
    xa = tl.load(head + offs, mask=ok, other=0.0).to(tl.float32)
    xb = tl.load(head + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    if h < HEADS + KV_HEADS:  # q or k: x * cos + rotate_half(x) * sin, each product rounded
        row = tl.load(Pos + m).to(tl.int64) * stride_cos
        c = tl.load(Cos + row + offs, mask=ok, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(Sin + row + offs, mask=ok, other=0.0).to(dtype).to(tl.float32)
        ra = (xa * c).to(dtype).to(tl.float32) - (xb * s).to(dtype).to(tl.float32)
        rb = (xb * c).to(dtype).to(tl.float32) + (xa * s).to(dtype).to(tl.float32)
        xa, xb = ra, rb
    if h < HEADS:
        dst = Q + m * stride_qm + h * (2 * HALF)
    elif h < HEADS + KV_HEADS:
        dst = KC + tl.load(Loc + m).to(tl.int64) * stride_ks + (h - HEADS) * stride_kh
    else:
        dst = VC + tl.load(Loc + m).to(tl.int64) * stride_vs + (h - HEADS - KV_HEADS) * stride_vh
    tl.store(dst + offs, xa.to(dtype), mask=ok)
    tl.store(dst + HALF + offs, xb.to(dtype), mask=ok)


@functools.cache
def _kernel(interpret: bool) -> Any:
    return jit_or_interpret(_rope_store_kernel, interpret, "the Triton rotary and KV write")


def _check(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    table: torch.Tensor,
    k_cache: torch.Tensor,
    heads: int,
) -> None:
    m, width = qkv.shape if qkv.dim() == 2 else (0, 0)
    _, kv_heads, head_dim = k_cache.shape if k_cache.dim() == 3 else (0, 0, 0)
    ok = (
        qkv.dim() == 2
        and k_cache.dim() == 3
        and head_dim % 2 == 0
        and width == (heads + 2 * kv_heads) * head_dim
        and qkv.stride(1) == 1
        and k_cache.dtype == qkv.dtype
        and k_cache.stride(2) == 1
        and table.dim() == 2
        and table.shape[1] == head_dim
        and table.stride(1) == 1
        and positions.shape == out_loc.shape == (m,)
    )
    if not ok:
        raise ValueError(
            f"rope_store: qkv {tuple(qkv.shape)} {qkv.dtype}, {heads} query heads, cache "
            f"{tuple(k_cache.shape)} {k_cache.dtype}, cos/sin {tuple(table.shape)}, positions "
            f"{tuple(positions.shape)}, out_loc {tuple(out_loc.shape)}: expected qkv [M, (H + "
            "2 H_kv) D] in the cache's dtype, caches [slots, H_kv, D] with D even, cos/sin "
            "[positions, D], positions and out_loc [M], unit stride on the last dims"
        )


def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    heads: int,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Rotate and write one step's keys and values; returns the rotated ``q [M, H D]``.

    qkv: ``[M, (H + 2 H_kv) D]``, the stacked projection, in the caches' dtype.
    positions, out_loc: int64 ``[M]``: each row's position and KV slot.
    cos, sin: float32 ``[max_positions, D]`` (a ``RotaryEmbedding``'s tables).
    k_cache, v_cache: ``[slots, H_kv, D]``, written at ``out_loc`` in place.
    heads: ``H``, the query heads. out: optional ``[M, H D]`` to write ``q`` into.
    pdl: launch programmatically (:mod:`~graphrunner_ref.model.kernels.pdl`; CUDA sm_90+).
    """
    _check(qkv, positions, out_loc, cos, k_cache, heads)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or sin.shape != cos.shape:
        raise ValueError(
            f"rope_store: v_cache {tuple(v_cache.shape)} {v_cache.dtype}, sin "
            f"{tuple(sin.shape)}: expected k_cache's {tuple(k_cache.shape)} {k_cache.dtype} "
            f"and cos's {tuple(cos.shape)}"
        )
    if pdl:
        check_device(qkv.device, "rope_store")
    m, (_, kv_heads, head_dim) = qkv.shape[0], k_cache.shape
    if out is None:
        out = qkv.new_empty((m, heads * head_dim))
    if m == 0:
        return out
    half = head_dim // 2
    _kernel(qkv.device.type != "cuda")[(m, heads + 2 * kv_heads)](
        qkv, positions, cos, sin, out_loc, out, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        HEADS=heads, KV_HEADS=kv_heads, HALF=half, BLOCK=pow2_at_least(half, 2),
        **triton_launch(pdl),
    )  # fmt: skip
    return out


def rope_store_fake(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    pdl: bool = False,
) -> torch.Tensor:
    """A rotary + KV write op's output for tracing, the Triton op's
    (``graphrunner::rope_store``) and the CPU's C++ one's
    (``graphrunner_attention::rope_store``) alike: the rotated ``q [M, H D]``."""
    return qkv.new_empty((qkv.shape[0], heads * k_cache.shape[2]))


def reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    heads: int,
) -> torch.Tensor:
    """:func:`rope_store` in torch ops, the model's own (``RotaryEmbedding``'s
    :func:`~graphrunner_ref.model.layers.rotate`, ``KVCache.set_kv``'s ``index_copy_``)."""
    m, (_, kv_heads, head_dim) = qkv.shape[0], k_cache.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(m, heads, head_dim), k.reshape(m, kv_heads, head_dim)
    c, s = rotary_rows(cos, sin, positions, qkv.dtype)
    k_cache.index_copy_(0, out_loc, rotate(k, c, s).to(k_cache.dtype))
    v_cache.index_copy_(0, out_loc, v.reshape(m, kv_heads, head_dim).to(v_cache.dtype))
    return rotate(q, c, s).reshape(m, heads * head_dim)
