"""Per-token rows of a multi-token step (verify, draft extend) as decode rows.

A step of ``W`` tokens per request (``[bs * W]`` per-token fields, ``[bs]``
per-request ones) is run as ``bs * W`` decode rows: each token reads its
request's ``req_to_token`` row up to its own position, so attention is causal
within the request and nothing new is needed of the attention. Every token's
K/V is written before any is read (each layer writes all rows first), so a
token sees the earlier tokens of its own step.

A padded request (row 0, positions 0) gives ``W`` tokens at position 0, each
reading one column of ``req_to_token`` row 0: KV slot 0, the padding sink.
"""

from __future__ import annotations

import torch

from graphrunner import BufferView
from graphrunner.declare import PER_TOKEN_FIELD_NAMES

__all__ = ["TokenRows"]


class TokenRows(BufferView):
    """A ``W``-token step's view as the :class:`~graphrunner.BufferView` of
    ``bs * W`` decode rows.

    Args:
        inputs: the decode fields of a ``W``-token step: the
            :data:`~graphrunner.declare.decode.PER_TOKEN_FIELD_NAMES` (int64
            ``[bs * W]``), copied as they are, and per-request
            ``req_pool_indices`` (int64 ``[bs]``), repeated ``W`` times;
            ``seq_lens`` becomes each token's ``position + 1``.

    ``W`` is read from the shapes (host-side, static in a graph).
    """

    def __init__(self, inputs: BufferView) -> None:
        rows = {name: getattr(inputs, name) for name in PER_TOKEN_FIELD_NAMES}
        req, positions = inputs.req_pool_indices, rows["positions"]
        width = positions.shape[0] // max(req.shape[0], 1)
        rows["req_pool_indices"] = req.repeat_interleave(width)
        rows["seq_lens"] = positions + 1
        super().__init__(positions.shape[0], rows)
        self.width = width

    def select(self, accept_lens: torch.Tensor) -> torch.Tensor:
        """Each request's last accepted token row: ``row * W + accept_len - 1``,
        int64 ``[bs]``; inside the request's own rows when ``1 <= accept_len <= W``
        (a padded row's accept length is ``W``: its last row)."""
        bs = accept_lens.shape[0]
        return torch.arange(bs, device=accept_lens.device) * self.width + accept_lens - 1
