"""graphrunner's attention as a transformers attention implementation.

transformers' decoders call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with each layer's rotated ``query`` ``[1, H, T, D]``, ``key`` / ``value``
``[1, KVH, T, D]`` and the keyword arguments the model was called with. The
bridge calls the model on a step's ``T`` token rows as one sequence of batch 1
(``use_cache=False``) and passes the step's pools and indices as
``graphrunner=StepKV(...)``; :func:`paged_attention` writes each row's K/V at
its ``out_cache_loc`` slot (padded rows: the sink slot 0) and attends over the
slots ``req_to_token`` lists for its request row, up to its length. What the
layer asks for is honoured: ``scaling`` (``query_pre_attn_scalar`` models),
``sliding_window``, attention logit ``softcap``, grouped KV heads. Everything
is a device tensor operation: the step never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphrunner import KVCache
from graphrunner.util import needs_extra

__all__ = ["ATTENTION", "StepKV", "paged_attention", "register"]

#: The name the bridge registers with transformers' attention (and mask) interfaces.
ATTENTION = "graphrunner"


@dataclass(frozen=True, slots=True)
class StepKV:
    """One step's pools and indices, per token row (``T`` rows).

    rows: each token's request row of ``req_to_token`` (int64 ``[T]``; 0 on padded rows).
    lens: how many cached tokens it attends to, itself included (int64 ``[T]``).
    slots: the KV slot its K/V are written to (int64 ``[T]``; 0 on padded rows).
    """

    kv: KVCache
    req_to_token: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    graphrunner: StepKV | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over graphrunner's pools (see the
    module); returns ``[1, T, H, D]`` and no weights."""
    if graphrunner is None:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): the "
            f"{ATTENTION!r} attention needs the step's pools (graphrunner=StepKV(...)); "
            "call the model through graphrunner_ref.bridge.TransformersDecoder"
        )
    step, layer = graphrunner, int(getattr(module, "layer_idx"))  # noqa: B009 (an int)
    q = query[0].transpose(0, 1)  # [T, H, D]
    step.kv.set_kv(layer, step.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_all, v_all = step.kv.get_kv(layer)
    cols = step.req_to_token[step.rows].long()  # [T, ctx]: each row's slots
    k, v = k_all[cols], v_all[cols]  # [T, ctx, KVH, D]
    t, heads, dim = q.shape
    groups = heads // k.shape[2]
    qg = q.reshape(t, k.shape[2], groups, dim).float()
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.einsum("tkgd,tckd->tkgc", qg, k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    col = torch.arange(cols.shape[1], device=q.device)
    seen = col[None, :] < step.lens[:, None]  # [T, ctx]
    if sliding_window is not None:
        seen = seen & (col[None, :] >= step.lens[:, None] - sliding_window)
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    out = torch.einsum("tkgc,tckd->tkgd", scores.softmax(-1), v.float())
    return out.reshape(t, heads, dim).to(query.dtype)[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # The attention masks by each row's length and window itself.
    return None


def register() -> None:
    """Register :func:`paged_attention` (and a mask function that builds no
    mask) under :data:`ATTENTION`; idempotent."""
    with needs_extra("text", "the transformers bridge"):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
