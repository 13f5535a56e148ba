"""What a runner needs from a batch: named device tensors plus host mirrors.

The runner never depends on :class:`graphrunner.batch.decode_batch.DecodeBatch`; an engine
can pass its own batch object as long as it has these attributes. The
attributes are those of :mod:`graphrunner.declare.decode` (a test keeps them equal).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["DecodeInputs", "StepInputs"]


class StepInputs(Protocol):
    """The device tensors of one decode step, ``bs`` requests, one token each
    (int64 ``[bs]``): a batch, or a runner's :class:`~graphrunner.BufferView`.

    input_ids: the token fed to each request this step.
    req_pool_indices: each request's row in ``req_to_token`` (never 0 when live).
    seq_lens: tokens in the cache per request, the new token included.
    out_cache_loc: the KV slot the new token is written to (never 0 when live).
    positions: the new token's position, ``seq_lens - 1``.

    A scheduler that builds these on the host may hand them over as CPU
    tensors (a runner's buffers take host-produced integer inputs; the fused
    populate stages them with its table, one copy for all of them).

    A static mirror of :data:`graphrunner.declare.decode.DECODE_FIELDS` for
    type checkers: tests/test_structure.py keeps its attributes equal to them.
    """

    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor


@runtime_checkable
class DecodeInputs(StepInputs, Protocol):
    """The inputs of one decode step: :class:`StepInputs` plus host mirrors.

    Host mirrors (CPU int64 ``[bs]``), equal to their device twins and kept in
    step by the scheduler so no step reads a device value back:
    ``req_pool_indices_cpu``, ``seq_lens_cpu``.
    """

    req_pool_indices_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

    @property
    def batch_size(self) -> int:
        """Live requests in the batch (from the host mirror, never a sync)."""
        ...
