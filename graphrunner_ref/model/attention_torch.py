"""The torch attention over gathered KV slots: the reference every other
decode attention must equal (:func:`gathered_attention`), and the decode
rows' slots and masks it reads over a given set of columns
(:func:`decode_columns`), and the read of a cache's slots in the queries'
dtype every attention shares (:func:`read_kv`; an int8 cache dequantized)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphrunner.pools import Int8KVCache

__all__ = ["Scales", "decode_columns", "gathered_attention", "read_kv", "torch_prompt_attention"]

#: An int8 cache's ``(k, v)`` scales of one layer, float32 ``[slots, H_kv]`` each
#: (:class:`graphrunner.pools.Int8KVCache`).
Scales = tuple[torch.Tensor, torch.Tensor]


def read_kv(
    buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None
) -> torch.Tensor:
    """``buf [slots, H_kv, D]`` at ``slots`` (any shape ``[...]``), ``[..., H_kv, D]``
    in ``dtype``: a float cache widened (or narrowed), an int8 cache's values
    times their ``scale [slots, H_kv]`` (:meth:`Int8KVCache.dequantize`)."""
    if scale is not None:
        return Int8KVCache.dequantize(_rows(buf, slots), _rows(scale, slots), dtype)
    if buf.dtype == torch.int8:
        raise ValueError(
            "an int8 KV cache read without its scales: expected the (k, v) scales of "
            "graphrunner.pools.Int8KVCache.get_scales with it"
        )
    return _rows(buf, slots).to(dtype)


def _rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]`` by ``index_select`` over the flat slots: the same rows,
    copied whole (on the CPU about 3x faster than advanced indexing, which
    copies element by element; a prefix-cache hit's prompt reads a whole
    cached prefix this way every layer)."""
    rows = buf.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *buf.shape[1:])


def torch_prompt_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    scales: Scales | None = None,
) -> torch.Tensor:
    """One request's prompt chunk ``q [n, H, D]`` over its ``slots`` (int64
    ``[L]``, ``L >= n``, the chunk's own tokens the last ``n``), token ``i``
    reading slots ``0 .. L - n + i``: torch's fused attention, heads sharing
    their KV head (``enable_gqa``). A whole prompt (``L == n``) is plainly
    causal, which lets the fused kernel skip the masked half; a chunk after a
    prefix reads its mask. Returns ``[n, H D]`` in ``q``'s dtype: the twin of
    :func:`~graphrunner_ref.model.attention_cpu.cpp_prompt_attention`, where
    that kernel does not run."""
    n, length = q.shape[0], slots.shape[0]
    k_scale, v_scale = (None, None) if scales is None else scales
    k = read_kv(k_buf, slots, q.dtype, k_scale).transpose(0, 1)[None]  # [1, H_kv, L, D]
    v = read_kv(v_buf, slots, q.dtype, v_scale).transpose(0, 1)[None]
    whole = length == n
    columns = torch.arange(length, device=q.device)
    mask = None if whole else columns[None, :] <= (length - n + columns[:n, None])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=whole, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1).reshape(n, -1)


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
    scales: Scales | None = None,
) -> torch.Tensor:
    """Grouped-query attention of ``q [B, H_kv, R, D]`` over the KV slots
    ``slots`` int64 ``[B, T]`` of ``k_buf`` / ``v_buf`` (``[slots, H_kv, D]``,
    read in q's dtype; int8 with ``scales``: dequantized, :func:`read_kv`),
    query row ``r`` of ``B`` reading column ``t`` where ``mask [B, 1, R, T]``
    holds. ``keys [B, T, 1, 1]`` (decode): the live columns, the others' values
    zeroed. Returns ``[B, H_kv, R, D]`` in q's dtype; softmax runs in float32
    as in transformers."""
    # A cache of another dtype (float16 or int8 under float32 queries) widened as read.
    k_scale, v_scale = (None, None) if scales is None else scales
    k = read_kv(k_buf, slots, q.dtype, k_scale).transpose(1, 2)  # [B, H_kv, T, D]
    v = read_kv(v_buf, slots, q.dtype, v_scale)
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
