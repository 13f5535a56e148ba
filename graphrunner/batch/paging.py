"""Which KV slot each row of a decode step takes: a fresh page's first slot, or
the slot after the row's last token, gathered on the device (never read back)."""

from __future__ import annotations

import torch

from graphrunner.pools.req_to_token import ReqToTokenPool

__all__ = ["next_slots"]


def next_slots(
    req_pool: ReqToTokenPool,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    starting: list[int],
    first_slots: list[int],
) -> torch.Tensor:
    """int64 ``[bs]`` on the batch's device: ``first_slots`` (host ints) for
    the ``starting`` rows, the slot after the last token (``req_to_token`` at
    ``seq_lens - 1``) for the others. ``req_pool_indices`` and ``seq_lens``
    are the batch's device tensors (int64 ``[bs]``), before the step."""
    bs = int(req_pool_indices.shape[0])
    device = req_pool_indices.device
    if len(starting) == bs:  # page size 1, or every row at a page boundary
        return _to(device, torch.tensor(first_slots, dtype=torch.int64))
    last = (seq_lens - 1).clamp_(min=0)
    after_last = req_pool.req_to_token[req_pool_indices, last].to(torch.int64) + 1
    is_starting = torch.zeros(bs, dtype=torch.bool)
    is_starting[starting] = True
    fresh = torch.zeros(bs, dtype=torch.int64)
    fresh[starting] = torch.tensor(first_slots, dtype=torch.int64)
    return torch.where(_to(device, is_starting), _to(device, fresh), after_last)


def _to(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    # copy=True: on a CPU batch the device tensor must not alias a host tensor.
    return host.to(device, non_blocking=True, copy=True)
