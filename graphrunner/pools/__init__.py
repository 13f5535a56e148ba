"""Pools of request rows, KV token slots and Mamba state; slot 0 of each is padding."""

from __future__ import annotations

from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolError, PoolExhausted
from graphrunner.pools.hybrid import DecodeHybridReqToTokenPool, HybridReqToTokenPool
from graphrunner.pools.kv import KVCache, TokenToKVPoolAllocator, starts_page, whole_pages
from graphrunner.pools.mamba import MambaStatePool, PendingStateOp
from graphrunner.pools.req_to_token import DecodeReqToTokenPool, ReqToTokenPool
from graphrunner.pools.slots import SlotAllocator

__all__ = [
    "DecodeHybridReqToTokenPool",
    "DecodeReqToTokenPool",
    "DoubleFree",
    "HybridReqToTokenPool",
    "InvalidSlot",
    "KVCache",
    "MambaStatePool",
    "PendingStateOp",
    "PoolError",
    "PoolExhausted",
    "ReqToTokenPool",
    "SlotAllocator",
    "TokenToKVPoolAllocator",
    "starts_page",
    "whole_pages",
]
