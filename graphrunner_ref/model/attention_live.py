"""The CPU decode attention whose cost follows the live context.

The torch reference gathers every column of a row's ``req_to_token`` capacity
(``max_context_len``), so a step at 20 live tokens costs at 8192 columns of
capacity ~35x what it costs at 128. This attention reads only the columns up
to the batch's longest live row (rounded up to :data:`COLUMN_STEP`): the same
masked gather and softmax as the reference, over ``[B, width]`` instead of
``[B, max_context_len]``. The columns it drops are ones the reference masks
out (probability exactly 0), so it computes the same values, up to the order
of float32 sums.

The width is a host read of ``seq_lens``, so it is an opaque
``torch.library`` op: the compiled CPU program calls it as one extern kernel
with its width chosen per step (a CUDA graph could not: there, the Triton
kernel plays this part, reading each row's live tokens on the device).
Where it builds, the C++ kernel of :mod:`~graphrunner_ref.model.attention_cpu`
runs in its place (float32): each row its own live tokens, no gather, no
per-op dispatch; this op stays the reference it must equal. Over an int8
cache (:class:`graphrunner.pools.Int8KVCache`) the ``_q8`` op and kernel run,
the reference dequantizing the gathered columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner_ref.model.attention_cpu import (
    cpp_attention_runs,
    cpp_decode_attention,
    cpp_decode_attention_q8,
    cpp_q8_runs,
    decode_attention_fake,
)
from graphrunner_ref.model.attention_torch import Scales, decode_columns, gathered_attention

__all__ = [
    "COLUMN_STEP",
    "LiveRows",
    "live_attention",
    "live_decode_attention",
    "live_decode_attention_q8",
]

#: The gather's width is a multiple of this many columns (at most the capacity),
#: so batches whose longest rows are close take the same shapes.
COLUMN_STEP = 64


@dataclass(frozen=True, slots=True)
class LiveRows:
    """The rows the live attention reads: row ``b`` of ``[B]`` reads the KV slots
    ``req_to_token[req_pool_indices[b], :seq_lens[b]]``.

    req_to_token: int32 ``[num_reqs + 1, max_context_len]``.
    req_pool_indices, seq_lens: int64 ``[B]`` on the CPU.
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


@torch.library.custom_op("graphrunner::live_decode_attention", mutates_args=())
def live_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of ``q [B, H_kv, R, D]`` over each row's first
    ``seq_lens`` KV slots; a new ``[B, H_kv, R, D]``."""
    return _live(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, None)


live_decode_attention.register_fake(decode_attention_fake)


@torch.library.custom_op("graphrunner::live_decode_attention_q8", mutates_args=())
def live_decode_attention_q8(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`live_decode_attention` over an int8 cache, its values times
    ``k_scale`` / ``v_scale`` (float32 ``[slots, H_kv]``) as read."""
    scales = (k_scale, v_scale)
    return _live(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, scales)


@live_decode_attention_q8.register_fake
def _(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _live(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    scales: Scales | None,
) -> torch.Tensor:
    capacity = req_to_token.shape[1]
    longest = int(seq_lens.max()) if seq_lens.numel() else 1
    width = min(capacity, -(-max(longest, 1) // COLUMN_STEP) * COLUMN_STEP)
    columns = torch.arange(width, device=seq_lens.device)
    slots, mask, keys = decode_columns(
        req_to_token, req_pool_indices, seq_lens, columns, q.shape[2]
    )
    # Run eagerly inside the op, the scores take the matmul (decode=False): the
    # broadcast product pays only where inductor fuses it, and here it would
    # write out [B, H_kv, R, T, D] per layer.
    return gathered_attention(q, k_buf, v_buf, slots, mask, keys, False, scale, scales).contiguous()


def live_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: LiveRows,
    scale: float,
    scales: Scales | None = None,
) -> torch.Tensor:
    """:func:`live_decode_attention` of ``q [B, H_kv, R, D]`` over ``rows``:
    the C++ kernel where it runs (float32 on the CPU), else this reference;
    over an int8 cache with its ``scales``, their ``_q8`` twins."""
    table, pools, lens = rows.req_to_token, rows.req_pool_indices, rows.seq_lens
    if scales is not None:
        q8 = cpp_decode_attention_q8 if cpp_q8_runs(q, k_buf) else live_decode_attention_q8
        return q8(q, k_buf, v_buf, scales[0], scales[1], table, pools, lens, scale)
    attend = cpp_decode_attention if cpp_attention_runs(q, k_buf) else live_decode_attention
    return attend(q, k_buf, v_buf, table, pools, lens, scale)
