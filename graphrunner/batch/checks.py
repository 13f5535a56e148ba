"""The decode batch's argument checks, run before anything changes (a failing
call leaves the batch and the pools as they were)."""

from __future__ import annotations

import torch

from graphrunner.batch.host import BatchError
from graphrunner.pools.checks import bad_arg, check_each, check_tensor, same_device
from graphrunner.pools.kv import TokenToKVPoolAllocator
from graphrunner.pools.req_to_token import ReqToTokenPool

__all__ = ["check_input_ids", "check_prepare", "check_requests"]


def check_requests(reqs: list[int], lens: list[int], max_context_len: int) -> None:
    """Pool rows ``>= 1``, each once; lengths in ``0..max_context_len``."""
    row = "a pool row >= 1 (0 is padding)"
    check_each("from_requests: req_pool_indices", reqs, 1, error=BatchError, what=row)
    check_each("from_requests: seq_lens", lens, 0, max_context_len, error=BatchError)
    if len(set(reqs)) != len(reqs):
        raise bad_arg("from_requests: req_pool_indices", reqs, "each pool row once", BatchError)


def check_input_ids(name: str, input_ids: object, bs: int, device: torch.device) -> None:
    """int64 ``[bs]`` on ``device``."""
    check_tensor(
        name, input_ids, dtype=torch.int64, shape=(bs,), devices=(device,), error=BatchError
    )


def check_prepare(
    req_pool: ReqToTokenPool,
    kv_alloc: TokenToKVPoolAllocator,
    reqs: list[int],
    lens: list[int],
    device: torch.device,
    max_context_len: int,
) -> None:
    """The pools of ``prepare_decode`` fit the batch, and every row has room
    for one more token in an allocated request row."""
    if not isinstance(req_pool, ReqToTokenPool):
        raise bad_arg("prepare_decode: req_pool", req_pool, "a ReqToTokenPool")
    if not isinstance(kv_alloc, TokenToKVPoolAllocator):
        raise bad_arg("prepare_decode: kv_alloc", kv_alloc, "a TokenToKVPoolAllocator")
    if not same_device(req_pool.device, device):
        raise BatchError(f"prepare_decode: req_pool is on {req_pool.device}; expected {device}")
    if req_pool.max_context_len < max_context_len:
        raise BatchError(
            f"prepare_decode: req_pool.max_context_len {req_pool.max_context_len} is below "
            f"the batch's {max_context_len}; expected at least that"
        )
    for i, (req, n) in enumerate(zip(reqs, lens, strict=True)):
        if n + 1 > max_context_len:
            raise BatchError(
                f"prepare_decode: row {i} (request {req}): seq_len {n} + 1 exceeds "
                f"max_context_len {max_context_len}; expected room for one more token"
            )
        if not req_pool.is_allocated(req):
            raise BatchError(
                f"prepare_decode: row {i}: request {req} is not allocated in req_pool; "
                "expected live rows"
            )
