"""A model together with the pools it reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner.model.config import ModelConfig
from graphrunner.model.llama import LlamaDecoder
from graphrunner.pools import KVCache, ReqToTokenPool, TokenToKVPoolAllocator


@dataclass(frozen=True, slots=True)
class ModelBundle:
    """A :class:`LlamaDecoder` and the pools it was built over.

    ``req_pool.req_to_token`` is int32 ``[max_requests + 1, max_context_len]``;
    ``kv_cache`` holds ``kv_slots + 1`` token slots per layer (slot 0 padding).
    """

    model: LlamaDecoder
    req_pool: ReqToTokenPool
    kv_alloc: TokenToKVPoolAllocator
    kv_cache: KVCache

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def max_context_len(self) -> int:
        return self.req_pool.max_context_len

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device


def build_model(
    config: ModelConfig,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    kv_slots: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ModelBundle:
    """Allocate pools and an (uninitialised) model over them.

    ``max_context_len`` defaults to ``config.max_position_embeddings``;
    ``kv_slots`` to ``max_requests * max_context_len``, enough that
    ``max_requests`` requests of full length never exhaust the KV pool.
    """
    ctx = config.max_position_embeddings if max_context_len is None else max_context_len
    if not 1 <= ctx <= config.max_position_embeddings:
        raise ValueError(
            f"max_context_len={ctx}: expected 1..max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    slots = max_requests * ctx if kv_slots is None else kv_slots
    req_pool = ReqToTokenPool(max_requests, ctx, device)
    kv_alloc = TokenToKVPoolAllocator(slots, device)
    kv_cache = KVCache(
        slots, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device
    )
    model = LlamaDecoder(config, req_pool, kv_cache, dtype=dtype)
    return ModelBundle(model, req_pool, kv_alloc, kv_cache)
