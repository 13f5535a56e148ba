"""Small-batch linears in Triton: each weight streamed once, norm and gate fused in.

At batch 1 a decode step is a chain of matrix-vector products whose time is
the weights' bytes over the memory bandwidth, plus a small kernel per norm
and activation between them. One launch here computes ``y = x @ W.T`` for a
few rows ``x [M, K]`` (``M <= MAX_ROWS``), optionally with

* the RMSNorm of ``x`` before the product (``norm_weight``, ``eps``): each
  program sums the squares of its rows (``K`` values, a few KB) before it
  streams its weight tile, so the normed activations never go to memory;
* a second weight ``W2`` and the SwiGLU gate after it:
  ``silu(x @ W.T) * (x @ W2.T)``, both products from one read of ``x``;
* a residual added to the result (``h + o_proj(...)``), so the residual
  stream's add is not a kernel of its own.

Each program owns ``BLOCK_N`` output columns of every row and loops over
``K`` in ``BLOCK_K`` chunks, accumulating in float32; nothing is atomic, so
the result is the same on every run. The roundings follow the torch modules
op for op (the norm's float32 statistics cast back to the input dtype, then
times the weight in that dtype; the gate's product, SiLU and multiply each
rounded to the dtype), so the kernel equals :func:`reference` up to the
order of the float32 sums.

Launches choose interpretation by device: CPU tensors run in Triton's
interpreter (how CI checks the kernel), CUDA tensors compiled.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from graphrunner_ref.model.kernels.build import jit_or_interpret, pow2_at_least
from graphrunner_ref.model.kernels.pdl import check_device, triton_launch

with contextlib.suppress(ModuleNotFoundError):
    import triton.language as tl
with contextlib.suppress(ImportError):  # Triton >= 3.4; read only by a kernel launched with PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["MAX_ROWS", "GemvBlocks", "choose_blocks", "gemv", "reference"]

#: Most rows one launch takes (the accumulator holds every row of a tile).
MAX_ROWS = 16
#: Elements of one ``[BLOCK_M, BLOCK_N, BLOCK_K]`` product tile: 64 float32
#: registers a thread at 4 warps.
TILE_ELEMENTS = 8192
#: Programs worth aiming at: about four resident per SM of an H100 (132 SMs),
#: enough loads in flight to keep the memory busy.
TARGET_PROGRAMS = 512


@dataclass(frozen=True, slots=True)
class GemvBlocks:
    """One launch's tiling: rows, output columns and reduction chunk per program."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def choose_blocks(m: int, n: int, k: int, *, target_programs: int = TARGET_PROGRAMS) -> GemvBlocks:
    """The tiling of an ``[m, k] x [n, k]^T`` product: as few output columns per
    program as give about ``target_programs`` programs (4 to 16), and the
    longest reduction chunk that keeps the product tile within
    :data:`TILE_ELEMENTS` (at most ``k``, at least 16). A pure function of the
    shape, so each captured size has one fixed grid."""
    if not (1 <= m <= MAX_ROWS and n >= 1 and k >= 1):
        raise ValueError(
            f"choose_blocks(m={m}, n={n}, k={k}): expected 1 <= m <= {MAX_ROWS} and positive n, k"
        )
    block_m = pow2_at_least(m)
    block_n = min(16, max(4, _pow2_at_most(n // target_programs)))
    block_k = max(16, min(pow2_at_least(k), TILE_ELEMENTS // (block_m * block_n)))
    return GemvBlocks(block_m, block_n, block_k)


# Arguments are annotated with triton.language names only (see decode_attention).
def _gemv_kernel(
    X: tl.tensor,
    W: tl.tensor,
    W2: tl.tensor,
    NormW: tl.tensor,
    Res: tl.tensor,
    Y: tl.tensor,
    M: tl.int32,
    N: tl.int32,
    K: tl.int32,
    stride_xm: tl.int32,
    stride_wn: tl.int32,
    stride_w2n: tl.int32,
    stride_rm: tl.int32,
    stride_ym: tl.int32,
    eps: tl.float32,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Program ``pid`` writes ``Y[:M, pid * BLOCK_N : (pid + 1) * BLOCK_N]``."""
    if PDL:  # launched early (kernels/pdl.py): wait before any access, then release the next
        gdc_wait()
        gdc_launch_dependents()
    dtype = X.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = X + offs_m[:, None] * stride_xm
    inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:  # the rows' statistics first: K values each, cheap beside the weights
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_ok[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            squares += tl.sum(x * x, 1)
        inv_rms = tl.rsqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:  # RMSNorm's roundings: normed in float32, cast, times the weight
            g = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * inv_rms[:, None]).to(dtype)
            x = (x.to(tl.float32) * g[None, :]).to(dtype)
        x3 = x.to(tl.float32)[:, None, :]
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
        acc += tl.sum(x3 * w.to(tl.float32)[None, :, :], 2)
        if GATED:
            w2_ptrs = W2 + offs_n[:, None] * stride_w2n + offs_k[None, :]
            w2 = tl.load(w2_ptrs, mask=w_mask, other=0.0)
            acc2 += tl.sum(x3 * w2.to(tl.float32)[None, :, :], 2)
    out = acc
    if GATED:  # silu(gate) * up, each rounded to the dtype as the torch ops do
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = act * acc2.to(dtype).to(tl.float32)
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RESIDUAL:  # the product rounded to the dtype, then the add (torch's order)
        res = tl.load(Res + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        out = out.to(dtype).to(tl.float32) + res.to(tl.float32)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=mask)


@functools.cache
def _kernel(interpret: bool) -> Any:
    return jit_or_interpret(_gemv_kernel, interpret, "the Triton small-batch linears")


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight2: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    ok = (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.dtype == x.dtype
        and (weight2 is None or (weight2.shape == weight.shape and weight2.stride(1) == 1))
    )
    if not ok:
        second = "" if weight2 is None else f", weight2 {tuple(weight2.shape)}"
        raise ValueError(
            f"gemv: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}{second}: expected x [M, K] with 1 <= M <= {MAX_ROWS}, weights "
            "[N, K] of x's dtype (one shape for both), unit stride on K"
        )
    want = (x.shape[0], weight.shape[0])
    if residual is not None and (
        residual.shape != want or residual.dtype != x.dtype or residual.stride(1) != 1
    ):
        raise ValueError(
            f"gemv: residual {tuple(residual.shape)} {residual.dtype}: expected {want} "
            f"{x.dtype} with unit stride on N"
        )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight2: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    blocks: GemvBlocks | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` for ``M <= MAX_ROWS``, in ``x``'s dtype.

    norm_weight: ``[K]``; if given, ``x`` is RMS-normed first (``eps``).
    weight2: ``[N, K]``; if given, returns ``silu(x @ weight.T) * (x @ weight2.T)``.
    residual: ``[M, N]``; if given, added to the result.
    blocks: the tiling (tuning); :func:`choose_blocks` otherwise.
    out: optional ``[M, N]`` in ``x``'s dtype to write into.
    pdl: launch programmatically (:mod:`~graphrunner_ref.model.kernels.pdl`; CUDA sm_90+).
    """
    _check(x, weight, weight2, residual)
    if pdl:
        check_device(x.device, "gemv")
    (m, k), n = x.shape, weight.shape[0]
    blocks = blocks or choose_blocks(m, n, k)
    if out is None:
        out = x.new_empty((m, n))
    kernel = _kernel(x.device.type != "cuda")
    # An absent operand's pointer is any tensor: its constexpr flag keeps it unread.
    kernel[(-(-n // blocks.block_n),)](
        x, weight, weight if weight2 is None else weight2,
        x if norm_weight is None else norm_weight, out if residual is None else residual, out,
        m, n, k, x.stride(0), weight.stride(0),
        weight.stride(0) if weight2 is None else weight2.stride(0),
        out.stride(0) if residual is None else residual.stride(0), out.stride(0), eps,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        HAS_NORM=norm_weight is not None, GATED=weight2 is not None,
        HAS_RESIDUAL=residual is not None, num_warps=blocks.num_warps, **triton_launch(pdl),
    )  # fmt: skip
    return out


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight2: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """:func:`gemv` in torch ops, the modules' arithmetic (RMSNorm, linear,
    SwiGLU, the residual add)."""
    if norm_weight is not None:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        x = norm_weight * normed.to(x.dtype)
    y = F.linear(x, weight)
    if weight2 is not None:
        y = F.silu(y) * F.linear(x, weight2)
    return y if residual is None else residual + y
