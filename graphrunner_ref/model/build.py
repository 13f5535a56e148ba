"""A model together with the pools it reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from graphrunner.pools import CachedKVAllocator, Int8KVCache, whole_pages
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.llama import LlamaDecoder
from graphrunner_ref.model.parallel import SINGLE, TensorParallel, local_config

__all__ = ["OTHER_KV_DTYPES", "ModelBundle", "PooledBundle", "build_model", "check_kv_dtype"]


class PooledBundle:
    """What every bundle derives from its pools: the context, the KV page and
    the device (a base of the bundle dataclasses, which hold the pools)."""

    __slots__ = ()
    req_pool: ReqToTokenPool
    kv_alloc: TokenToKVPoolAllocator

    @property
    def max_context_len(self) -> int:
        return self.req_pool.max_context_len

    @property
    def page_size(self) -> int:
        """KV slots per page (1: unpaged)."""
        return self.kv_alloc.page_size

    @property
    def device(self) -> torch.device:
        return self.req_pool.device


@dataclass(frozen=True, slots=True)
class ModelBundle(PooledBundle):
    """A :class:`LlamaDecoder` and the pools it was built over.

    ``req_pool.req_to_token`` is int32 ``[max_requests + 1, max_context_len]``;
    ``kv_cache`` holds ``kv_slots + page_size`` token slots per layer (page 0,
    slots ``0..page_size - 1``, is the padding page); ``kv_alloc`` hands out
    whole pages of ``page_size`` slots.
    """

    model: LlamaDecoder
    req_pool: ReqToTokenPool
    kv_alloc: TokenToKVPoolAllocator
    kv_cache: KVCache

    @property
    def config(self) -> ModelConfig:
        return self.model.config


#: The KV cache dtypes a model of each dtype may take besides its own (the
#: CPU only), under a float32 model: float16, read by the CPU's C++ attention
#: widened exactly, written rounded to nearest even; int8, a scale per token
#: per KV head (:class:`graphrunner.pools.Int8KVCache`, llama.cpp's q8_0 cache).
OTHER_KV_DTYPES: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float32: (torch.float16, torch.int8)
}


def check_kv_dtype(
    kv_dtype: torch.dtype | None,
    dtype: torch.dtype,
    device: torch.device | str,
    name: str | None = None,
) -> torch.dtype:
    """The KV cache dtype of a ``dtype`` model on ``device``: ``kv_dtype``,
    or ``dtype`` when None; a ``ValueError`` for one the model's attention
    does not read (:data:`OTHER_KV_DTYPES`, CPU only), starting with ``name``
    (default ``kv_dtype=float16``, the argument as given)."""
    if kv_dtype is None or kv_dtype == dtype:
        return dtype
    name = name or f"kv_dtype={str(kv_dtype).removeprefix('torch.')}"
    model = str(dtype).removeprefix("torch.")
    allowed = OTHER_KV_DTYPES.get(dtype, ())
    if kv_dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in (dtype, *allowed))
        raise ValueError(f"{name}: a {model} model's KV cache may be {names}")
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"{name}: under a {model} model, a cache of another dtype runs on the CPU; "
            f"the device here is {device}"
        )
    return kv_dtype


def build_model(
    config: ModelConfig,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    kv_slots: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    tp: TensorParallel = SINGLE,
    kv_dtype: torch.dtype | None = None,
) -> ModelBundle:
    """Allocate pools and an (uninitialised) model over them.

    ``max_context_len`` defaults to ``config.max_position_embeddings``;
    ``kv_slots`` to ``max_requests`` times ``max_context_len`` rounded up to
    whole pages, enough that ``max_requests`` requests of full length never
    exhaust the KV pool. ``page_size`` (>= 1) is the KV page in token slots;
    an explicit ``kv_slots`` must be a multiple of it. With ``tp.world > 1``
    the model is rank ``tp.rank``'s shard and the KV cache holds its KV heads
    only (see :mod:`graphrunner_ref.model.parallel`). ``kv_dtype`` (default:
    ``dtype``) is the KV cache's: float16 under a float32 model on the CPU
    halves the bytes the attention reads, int8 (an :class:`Int8KVCache`)
    about quarters them (:func:`check_kv_dtype`).
    """
    kv_dtype = check_kv_dtype(kv_dtype, dtype, device)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}: expected an int >= 1")
    ctx = config.max_position_embeddings if max_context_len is None else max_context_len
    if not 1 <= ctx <= config.max_position_embeddings:
        raise ValueError(
            f"max_context_len={ctx}: expected 1..max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    if kv_slots is None:
        slots = max_requests * whole_pages(ctx, page_size)
    elif isinstance(kv_slots, int) and kv_slots % page_size:  # the pools check the rest
        raise ValueError(f"kv_slots={kv_slots}: expected a multiple of page_size={page_size}")
    else:
        slots = kv_slots
    req_pool = ReqToTokenPool(max_requests, ctx, device)
    # Shares full prompt pages between requests once the engine indexes them
    # (prefix caching); the plain allocator until then.
    kv_alloc = CachedKVAllocator(slots, device, page_size=page_size)
    kv_heads = local_config(config, tp).num_kv_heads
    kv_cache = (
        Int8KVCache(slots, config.num_layers, kv_heads, config.head_dim, device, page_size)
        if kv_dtype == torch.int8
        else KVCache(
            slots, config.num_layers, kv_heads, config.head_dim, kv_dtype, device, page_size
        )
    )
    model = LlamaDecoder(config, req_pool, kv_cache, dtype=dtype, tp=tp)
    return ModelBundle(model, req_pool, kv_alloc, kv_cache)
