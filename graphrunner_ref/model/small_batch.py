"""A Llama decoder's projections through the Triton small-batch linears.

:func:`use_small_batch_linears` routes every step of at most ``max_rows``
token rows through :func:`~graphrunner_ref.model.kernels.gemv.gemv`, four
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

from typing import TYPE_CHECKING, cast

import torch

from graphrunner_ref.model.kernels.gemv import MAX_ROWS, gemv
from graphrunner_ref.model.kernels.rope_store import rope_store

if TYPE_CHECKING:
    from graphrunner_ref.model.attention_meta import AttnMetadata, KVStore
    from graphrunner_ref.model.layers import RotaryEmbedding
    from graphrunner_ref.model.llama import LlamaDecoder, LlamaDecoderLayer

__all__ = [
    "fits",
    "rope_store_op",
    "small_batch_layer",
    "small_batch_linear",
    "use_small_batch_linears",
]


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


@rope_store_op.register_fake
def _rope_store_fake(
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
    return qkv.new_empty((qkv.shape[0], heads * k_cache.shape[2]))


def use_small_batch_linears(model: LlamaDecoder, max_rows: int) -> None:
    """Run ``model``'s steps of at most ``max_rows`` token rows (``0``: none,
    the default) through the small-batch linears. Call it before capture: a
    captured size keeps the path it was captured with.

    Raises ``ValueError`` for ``max_rows`` outside ``0..MAX_ROWS`` or a
    quantized model (its linears hold compact weights the kernels do not read).
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 0 <= max_rows <= MAX_ROWS:
        raise ValueError(
            f"use_small_batch_linears: max_rows={max_rows!r}: expected an int in 0..{MAX_ROWS}"
        )
    if model.quantization is not None and max_rows:
        raise ValueError(
            f"use_small_batch_linears: the model is quantized ({model.quantization!r}); "
            "the small-batch linears read float weights (leave max_rows=0)"
        )
    model.small_batch_rows = max_rows
    for layer in model.model.layers:
        cast("LlamaDecoderLayer", layer).small_batch_rows = max_rows


def small_batch_layer(
    layer: LlamaDecoderLayer,
    h: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kv: KVStore,
    meta: AttnMetadata,
    rotary: RotaryEmbedding,
) -> torch.Tensor:
    """``layer.forward`` through the small-batch linears (``h [n, hidden]``)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    pdl = layer.programmatic_launch
    qkv = small_batch_linear(h, attn.qkv_weight, norm_weight=norm1.weight, eps=norm1.eps, pdl=pdl)
    heads = _attend(layer, qkv, positions, out_loc, kv, meta, rotary)
    h = _add_projected(layer, h, heads, cast(torch.Tensor, attn.o_proj.weight))
    gated = small_batch_linear(
        h, mlp.gate_proj.weight, mlp.up_proj.weight, norm_weight=norm2.weight, eps=norm2.eps,
        pdl=pdl,
    )  # fmt: skip
    return _add_projected(layer, h, gated, mlp.down_proj.weight)


def _attend(
    layer: LlamaDecoderLayer,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kv: KVStore,
    meta: AttnMetadata,
    rotary: RotaryEmbedding,
) -> torch.Tensor:
    """The heads' outputs from the stacked projection: rotary and KV write in
    one launch when the cache holds ``qkv``'s dtype (else the module's ops)."""
    attn = layer.self_attn
    k_cache, v_cache = kv.get_kv(attn.layer_id)
    if k_cache.dtype != qkv.dtype:  # set_kv casts; the kernel writes the dtype it reads
        return attn.attend_qkv(qkv, positions, out_loc, kv, meta, rotary)
    q = rope_store_op(
        qkv, positions, out_loc, rotary.cos, rotary.sin, k_cache, v_cache, attn.num_heads,
        layer.programmatic_launch,
    )  # fmt: skip
    return attn.attend_rotated(q, kv, meta)


def _add_projected(
    layer: LlamaDecoderLayer, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``h + all_reduce(x @ weight.T)``: alone on its rank, the add is the
    kernel's epilogue; tensor-parallel, it follows the all-reduce."""
    pdl = layer.programmatic_launch
    if layer.tp.alone:
        return small_batch_linear(x, weight, residual=h, pdl=pdl)
    return h + layer.tp.all_reduce(small_batch_linear(x, weight, pdl=pdl))


def fits(rows: int, max_rows: int) -> bool:
    """Whether a step of ``rows`` token rows takes the small-batch path."""
    return 0 < rows <= max_rows
