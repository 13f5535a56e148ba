"""What one attention forward reads: the KV store protocol, the per-forward
metadata (:class:`AttnMetadata`) and the grouped-query attention over gathered
slots (:func:`attend`), shared by the module and its backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from graphrunner_ref.model.attention_live import LiveRows, live_attention
from graphrunner_ref.model.attention_op import PagedRows, paged_attention
from graphrunner_ref.model.attention_tokens import TokenLayout
from graphrunner_ref.model.attention_torch import Scales, gathered_attention

__all__ = ["AttnMetadata", "KVStore", "attend", "kv_scales"]


class KVStore(Protocol):
    """What attention needs of :class:`graphrunner.pools.KVCache`.

    ``set_kv`` must be the plain write of ``k``/``v`` at ``loc`` into the
    buffers ``get_kv`` returns (cast to their dtype): the fused writers (the
    CPU's C++ rotary + KV write, the CUDA small-batch path) write those
    buffers directly instead of calling it."""

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def kv_scales(kv: KVStore, layer: int) -> Scales | None:
    """The ``(k, v)`` scales of ``layer`` where ``kv`` is an int8 cache
    (:class:`graphrunner.pools.Int8KVCache`, ``get_scales``); None otherwise."""
    get_scales = getattr(kv, "get_scales", None)
    return None if get_scales is None else get_scales(layer)


@dataclass(frozen=True, slots=True)
class AttnMetadata:
    """Which KV slots each query reads, shared by all layers of one forward.

    slots: int64 ``[B, T]``, KV slot of each key column (``B`` is ``bs`` in decode,
        1 in extend, where every query reads the same prompt row).
    mask: bool ``[B, 1, R, T]``, True where a query row may read a key column
        (``R`` = query heads per KV head in decode, ``tokens * that`` in extend).
    decode: one query token per row (decode) rather than a whole prompt (extend).
    keys: bool ``[B, T, 1, 1]``, True where a column holds a live key of the row
        (decode); None where every column is some query's live key (extend).
    paged: the rows for the Triton kernel (decode with ``kernel="triton"``),
        which then replaces the gather; None for the torch attention.
    live: the rows for the CPU live-width attention (decode with
        ``kernel="live"``), which then replaces the full-width gather.
    tokens: a token batch's layout, planned on the host: the attention runs
        per request (:mod:`graphrunner_ref.model.attention_tokens`); None otherwise.
    """

    slots: torch.Tensor
    mask: torch.Tensor
    decode: bool
    keys: torch.Tensor | None = None
    paged: PagedRows | None = None
    live: LiveRows | None = None
    tokens: TokenLayout | None = None


def attend(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    scales: Scales | None = None,
) -> torch.Tensor:
    """Grouped-query attention over gathered KV slots.

    q: ``[B, H_kv, R, D]``, the query rows that share each KV head.
    k_buf, v_buf: the layer's KV pool, ``[num_slots + page_size, H_kv, D]``.
    scales: an int8 pool's ``(k, v)`` scales (:func:`kv_scales`); None for a float one.
    Returns ``[B, H_kv, R, D]`` in q's dtype; softmax runs in float32 as in transformers.
    """
    if meta.paged is not None:
        if scales is not None:  # the CUDA kernel; an int8 cache is refused before
            raise ValueError("an int8 KV cache under the Triton attention: expected the CPU")
        return paged_attention(q, k_buf, v_buf, meta.paged, scale)
    if meta.live is not None:
        return live_attention(q, k_buf, v_buf, meta.live, scale, scales)
    return gathered_attention(
        q, k_buf, v_buf, meta.slots, meta.mask, meta.keys, meta.decode, scale, scales
    )
