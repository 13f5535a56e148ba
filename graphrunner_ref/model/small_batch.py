"""A Llama decoder's projections through the Triton small-batch linears.

:func:`~graphrunner_ref.model.llama.use_small_batch_linears` routes every step of
at most ``max_rows`` token rows through :func:`~graphrunner_ref.model.kernels.gemv.gemv`, four
launches of it a layer where the torch path runs a norm, a product, a gate
and a multiply apiece, and one more for the rotary embedding:

* input RMSNorm + stacked q/k/v projection (one launch), then the rotary
  embedding and the KV write (one launch, :mod:`~graphrunner_ref.model.kernels.rope_store`,
  when the KV cache holds the model's dtype);
* the output projection and the residual add;
* post-attention RMSNorm + gate and up projections + SiLU gate (one launch);
* the down projection and the residual add;

and the LM head (tensor-parallel, the adds follow the all-reduces). Larger
steps keep the torch path (cuBLAS's GEMMs win there).
The kernels are an opaque ``torch.library`` op, as the attention is: inductor
compiles what lies between them and a CUDA graph captures them. Row by row
the arithmetic is the torch modules' (see the kernel's roundings), so a
padded row cannot reach a live one.
"""

from __future__ import annotations

import torch

from graphrunner_ref.model.kernels.gemv import MAX_ROWS, gemv
from graphrunner_ref.model.kernels.rope_store import rope_store, rope_store_fake

__all__ = ["MAX_ROWS", "fits", "rope_store_op", "small_batch_linear"]


@torch.library.custom_op("graphrunner::small_batch_linear", mutates_args=())
def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight2: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
) -> torch.Tensor:
    """:func:`~graphrunner_ref.model.kernels.gemv.gemv` as an op: ``x [M, K]`` to a
    new ``[M, N]`` (``M <= MAX_ROWS``)."""
    return gemv(
        x.contiguous(),
        weight,
        weight2=weight2,
        norm_weight=norm_weight,
        residual=residual,
        eps=eps,
        pdl=pdl,
    )


@small_batch_linear.register_fake
def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight2: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


# The caches are declared mutated: inductor passes them straight in and keeps
# the op before the attention that reads them.
@torch.library.custom_op("graphrunner::rope_store", mutates_args=("k_cache", "v_cache"))
def rope_store_op(
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
    """:func:`~graphrunner_ref.model.kernels.rope_store.rope_store` as an op: the
    rotated ``q [M, H D]``, the step's K/V written into the caches."""
    return rope_store(
        qkv.contiguous(), positions, out_loc, cos, sin, k_cache, v_cache, heads=heads, pdl=pdl
    )


rope_store_op.register_fake(rope_store_fake)


def fits(rows: int, max_rows: int) -> bool:
    """Whether a step of ``rows`` token rows takes the small-batch path."""
    return 0 < rows <= max_rows
