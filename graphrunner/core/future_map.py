"""Overlap scheduling: the next step's input tokens as future references.

With overlap, the host prepares step N+1 while step N still runs, before step
N's sampled tokens are known on the host. Step N stores them in a
:class:`FutureMap` at each request's **request-pool row**, and step N+1's
``input_ids`` hold a future reference ``-req_pool_index`` instead of a token;
populate resolves it on the device (a gather from the map, declared on the
``input_ids`` buffer: ``BufferSpec(..., future=True)``).

Indexed by request-pool row, never by a ring counter: a row means one request
for its whole life, so a reference cannot wrap onto another request's token,
and a reused row's first token is stored before the step that reads it. Row 0
is padding: no live request stores there, and a padded row (``input_ids`` 0)
is a token, never a reference.

Populate and :meth:`FutureMap.store` run on the stream that runs the forward
(the caller's current stream), so a store and the read that follows it are
ordered on the device without a host sync.
"""

from __future__ import annotations

import torch

from graphrunner.declare.decode import REQ_POOL_INDICES
from graphrunner.pools.checks import DeviceLike

__all__ = ["FutureMap", "future_refs"]


class FutureMap:
    """Next-token ids per request-pool row: int64 ``[num_rows]`` on ``device``.

    Args:
        num_rows: rows of the request pool's ``req_to_token`` (its size + 1).
        device: where the map lives (the forward's device).
    """

    def __init__(self, num_rows: int, device: DeviceLike) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 2:
            raise ValueError(f"num_rows={num_rows!r}; expected an int >= 2 (row 0 is padding)")
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def store(self, req_pool_indices: torch.Tensor, tokens: torch.Tensor) -> None:
        """``tokens`` (``[bs]`` or ``[bs, 1]``, int32 or int64) at rows
        ``req_pool_indices`` (int64 ``[bs]``, on the map's device), on the
        current stream. An empty batch is a no-op; nothing is read back."""
        if not isinstance(req_pool_indices, torch.Tensor) or not isinstance(tokens, torch.Tensor):
            raise TypeError(
                f"store: req_pool_indices and tokens must be tensors, got "
                f"{type(req_pool_indices).__name__} and {type(tokens).__name__}"
            )
        bs = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
        flat = tokens.reshape(-1) if tokens.dim() == 2 and tokens.shape[1] == 1 else tokens
        if bs < 0 or flat.shape != (bs,) or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"store: req_pool_indices {tuple(req_pool_indices.shape)} and tokens "
                f"{tokens.dtype} {tuple(tokens.shape)}; expected [bs] and int32/int64 "
                f"[bs] or [bs, 1]"
            )
        if req_pool_indices.dtype != torch.int64:
            raise ValueError(f"store: req_pool_indices is {req_pool_indices.dtype}; expected int64")
        for name, t in ((REQ_POOL_INDICES, req_pool_indices), ("tokens", tokens)):
            if t.device != self.tokens.device:
                raise ValueError(f"store: {name} is on {t.device}; expected {self.tokens.device}")
        if bs:
            self.tokens.index_copy_(0, req_pool_indices, flat.to(torch.int64))


def future_refs(req_pool_indices: torch.Tensor) -> torch.Tensor:
    """The future references of a batch's rows: ``-req_pool_indices`` (int64 ``[bs]``)."""
    return req_pool_indices.neg()
