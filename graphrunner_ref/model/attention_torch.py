"""The torch attention over gathered KV slots: the reference every other
decode attention must equal (:func:`gathered_attention`), and the decode
rows' slots and masks it reads over a given set of columns
(:func:`decode_columns`)."""

from __future__ import annotations

import torch

__all__ = ["decode_columns", "gathered_attention"]


def decode_columns(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    columns: torch.Tensor,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What decode rows read over the first ``T = len(columns)`` columns
    (``columns``: ``arange(T)``): row ``b`` of ``[B]`` reads
    ``req_to_token[req_pool_indices[b], :seq_lens[b]]``. Returns the slots
    int64 ``[B, T]``, the mask bool ``[B, 1, group, T]`` and the live keys
    bool ``[B, T, 1, 1]`` of :func:`gathered_attention`."""
    live = columns < seq_lens[:, None]
    # Columns past seq_len read slot 0 instead of whatever stale slot the row
    # holds there: their scores are masked anyway, and one hot row costs far
    # less than a scattered read per column.
    slots = torch.where(live, req_to_token[req_pool_indices, : columns.shape[0]], 0).long()
    return slots, live[:, None, None, :].expand(-1, 1, group, -1), live[:, :, None, None]


def gathered_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    keys: torch.Tensor | None,
    decode: bool,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention of ``q [B, H_kv, R, D]`` over the KV slots
    ``slots`` int64 ``[B, T]`` of ``k_buf`` / ``v_buf`` (``[slots, H_kv, D]``,
    read in q's dtype),
    query row ``r`` of ``B`` reading column ``t`` where ``mask [B, 1, R, T]``
    holds. ``keys [B, T, 1, 1]`` (decode): the live columns, the others' values
    zeroed. Returns ``[B, H_kv, R, D]`` in q's dtype; softmax runs in float32
    as in transformers."""
    # A cache of another dtype (float16 under float32 queries) widened as read.
    k = k_buf[slots].to(q.dtype).transpose(1, 2)  # [B, H_kv, T, D]
    v = v_buf[slots].to(q.dtype)
    if keys is not None:
        # Masked columns read slot 0, the padding sink: a zero probability times
        # a non-finite value there would be NaN, so their values are zeroed.
        v = v.masked_fill(~keys, 0)
    v = v.transpose(1, 2)
    if decode:
        # A broadcast product summed over D, not a matmul: compiled, the key gather
        # fuses into the reduction and the gathered keys are never written out
        # (the CPU step runs ~1.5x faster). Eager it costs about what the matmul
        # does at decode sizes; a prompt's [T, T] scores take the matmul.
        scores = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) * scale
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
