"""graphrunner's attention as a transformers attention implementation.

transformers' decoders call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with each layer's rotated ``query`` ``[1, H, T, D]``, ``key`` / ``value``
``[1, KVH, T, D]`` and whatever keyword arguments their layers pass on. The
bridge calls the model on a step's ``T`` token rows as one sequence of batch 1
(``use_cache=False``). The step's pools and indices (:class:`StepKV`) do not
travel as keyword arguments, which not every decoder layer passes down: each
attention module the bridge found (:mod:`.find`) carries a :class:`Binding`
to its decoder's :class:`StepSlot`, which the decoder fills around each model
call, and to its KV layer. :func:`paged_attention` writes each row's K/V at
its ``out_cache_loc`` slot (padded rows: the sink slot 0) and attends over the
slots ``req_to_token`` lists for its request row, up to its length. What the
layer asks for is honoured: ``scaling`` (``query_pre_attn_scalar`` models),
``sliding_window``, attention logit ``softcap``, grouped KV heads, and
attention sinks (``s_aux``: a logit per head that joins every row's softmax
and attends to nothing, as GPT-OSS's).

On the CPU plain attention (no window, softcap or sinks) runs as the native
model's decode attention does, each token row over its own live slots (the
C++ kernel of :mod:`~graphrunner_ref.model.attention_cpu` where it runs);
with a window, softcap or sinks a step reads each row's columns only up to
the batch's longest live row (:func:`live_rows_attention`). Either way its
cost follows the live context, not the pool's capacity; the width is read
from host tensors, never the device. Elsewhere (a CUDA graph replays
fixed shapes) every row reads its whole capacity (:func:`rows_attention`):
device tensor operations only, the step never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphrunner import KVCache
from graphrunner.util import needs_extra
from graphrunner_ref.model.attention_live import COLUMN_STEP, LiveRows, live_attention

__all__ = [
    "ATTENTION",
    "BINDING",
    "Binding",
    "StepKV",
    "StepSlot",
    "bind",
    "live_rows_attention",
    "paged_attention",
    "register",
    "rows_attention",
]

#: The name the bridge registers with transformers' attention (and mask) interfaces.
ATTENTION = "graphrunner"
#: The attribute of an attention module that holds its :class:`Binding`.
BINDING = "graphrunner_kv"


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


class StepSlot:
    """Where a decoder leaves the step it is running for its attention
    modules: ``step`` is set around each model call and None between them."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: StepKV | None = None


@dataclass(frozen=True, slots=True)
class Binding:
    """An attention module's decoder (the slot it reads its step from) and
    the KV layer it writes and reads."""

    slot: StepSlot
    layer: int


def bind(modules: tuple[nn.Module, ...], slot: StepSlot) -> None:
    """Bind attention module ``i`` of ``modules`` to KV layer ``i`` and ``slot``."""
    for layer, module in enumerate(modules):
        setattr(module, BINDING, Binding(slot, layer))


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
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over graphrunner's pools (see the
    module); returns ``[1, T, H, D]`` and no weights."""
    binding: Binding | None = getattr(module, BINDING, None)
    step = None if binding is None else binding.slot.step
    if binding is None or step is None:
        raise ValueError(
            f"{type(module).__name__}: the {ATTENTION!r} attention reads the step's pools "
            "from the decoder that bound it; call the model through "
            "graphrunner_ref.bridge.TransformersDecoder"
        )
    q = query[0].transpose(0, 1)  # [T, H, D]
    step.kv.set_kv(binding.layer, step.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_all, v_all = step.kv.get_kv(binding.layer)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    plain = sliding_window is None and softcap is None and s_aux is None
    if plain and q.device.type == "cpu":
        return _native_live(q, k_all, v_all, step, scale).to(query.dtype)[None], None
    # On the CPU the live width is a host read of host tensors; a CUDA graph
    # cannot replay one, so there every row reads its whole capacity.
    attend = live_rows_attention if q.device.type == "cpu" else rows_attention
    out = attend(
        q,
        k_all,
        v_all,
        step.req_to_token,
        step.rows,
        step.lens,
        scale,
        sliding_window,
        softcap,
        s_aux,
    )
    return out.to(query.dtype)[None], None


def _native_live(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, step: StepKV, scale: float
) -> torch.Tensor:
    """Plain attention (no window, softcap or sinks) of ``q [T, H, D]`` on
    the CPU through the native model's live attention, each token row one
    decode row over its own ``lens`` slots: the C++ kernel where it runs
    (float32 queries over a float32 or float16 cache), no gather of the
    step's columns; its torch reference elsewhere. ``[T, H, D]``."""
    t, heads, dim = q.shape
    grouped = q.reshape(t, k_all.shape[1], heads // k_all.shape[1], dim)
    rows = LiveRows(step.req_to_token, step.rows, step.lens)
    return live_attention(grouped, k_all, v_all, rows, scale).reshape(t, heads, dim)


def rows_attention(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over the first ``width`` columns (default:
    all) of each token's ``req_to_token`` row ``rows [T]``, of which it reads
    ``lens [T]`` (its last ``window``, if given), grouped KV heads, scores
    soft-capped by ``softcap``, each head's ``sinks [H]`` logit (if given) in
    its softmax's denominator; float32 ``[T, H, D]``. Columns past a length
    read the sink slot 0, their values zeroed, so whatever a stale column or
    the sink holds never reaches a row."""
    cols = torch.arange(req_to_token.shape[1] if width is None else width, device=q.device)
    seen = cols[None, :] < lens[:, None]  # [T, width]
    if window is not None:
        seen = seen & (cols[None, :] >= lens[:, None] - window)
    slots = torch.where(seen, req_to_token[rows, : cols.shape[0]], 0).long()
    k = k_all[slots]  # [T, width, KVH, D]
    v = v_all[slots].masked_fill(~seen[:, :, None, None], 0)
    t, heads, dim = q.shape
    groups = heads // k.shape[2]
    qg = q.reshape(t, k.shape[2], groups, dim).float()
    scores = torch.einsum("tkgd,tckd->tkgc", qg, k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # the sink's column joins the softmax, then is dropped: it attends to nothing
        sink = sinks.float().reshape(1, k.shape[2], groups, 1).expand(t, -1, -1, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    out = torch.einsum("tkgc,tckd->tkgd", probs, v.float())
    return out.reshape(t, heads, dim)


@torch.library.custom_op("graphrunner::bridge_live_attention", mutates_args=())
def live_rows_attention(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`rows_attention` over the columns up to the longest of ``lens``
    (rounded up to :data:`~graphrunner_ref.model.attention_live.COLUMN_STEP`,
    at most the capacity), so its cost follows the live context, not the
    pool's. The columns it drops are ones every row masks (probability
    exactly 0). The width is a host read of ``lens``, hence an opaque op: a
    compiled CPU program calls it as one extern kernel, its width chosen per
    step, as the native model's live attention
    (:func:`~graphrunner_ref.model.attention_live.live_decode_attention`)."""
    longest = int(lens.max()) if lens.numel() else 1
    width = min(req_to_token.shape[1], -(-max(longest, 1) // COLUMN_STEP) * COLUMN_STEP)
    return rows_attention(
        q, k_all, v_all, req_to_token, rows, lens, scale, window, softcap, sinks, width
    )


@live_rows_attention.register_fake
def _fake(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


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
