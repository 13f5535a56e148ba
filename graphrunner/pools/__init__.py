"""Pools of request rows, KV slots (prefix-shared; int8), Mamba state; slot 0 of each pads."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolError, PoolExhausted
from graphrunner.pools.hybrid import DecodeHybridReqToTokenPool, HybridReqToTokenPool
from graphrunner.pools.kv import KVCache, TokenToKVPoolAllocator, starts_page, whole_pages
from graphrunner.pools.mamba import MambaStatePool, PendingStateOp
from graphrunner.pools.req_to_token import DecodeReqToTokenPool, ReqToTokenPool
from graphrunner.pools.slots import SlotAllocator

if TYPE_CHECKING:
    from graphrunner.pools.kv_int8 import Int8KVCache
    from graphrunner.pools.prefix_cache import CachedKVAllocator, PrefixCacheStats, PrefixMatch
    from graphrunner.pools.prefix_index import CacheScope, PrefixIndex

#: Names loaded on first use (a pool that never shares pages never imports them).
_LAZY = {
    "graphrunner.pools.kv_int8": ("Int8KVCache",),
    "graphrunner.pools.prefix_cache": ("CachedKVAllocator", "PrefixCacheStats", "PrefixMatch"),
    "graphrunner.pools.prefix_index": ("CacheScope", "PrefixIndex"),
}

__all__ = [
    "CacheScope",
    "CachedKVAllocator",
    "DecodeHybridReqToTokenPool",
    "DecodeReqToTokenPool",
    "DoubleFree",
    "HybridReqToTokenPool",
    "Int8KVCache",
    "InvalidSlot",
    "KVCache",
    "MambaStatePool",
    "PendingStateOp",
    "PoolError",
    "PoolExhausted",
    "PrefixCacheStats",
    "PrefixIndex",
    "PrefixMatch",
    "ReqToTokenPool",
    "SlotAllocator",
    "TokenToKVPoolAllocator",
    "starts_page",
    "whole_pages",
]


def __getattr__(name: str) -> object:
    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'graphrunner.pools' has no attribute {name!r}")
