"""The inputs of a speculative step (:class:`SpecBatch`); the phase value
itself is :class:`graphrunner.core.phase.Phase`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphrunner.core.phase import Phase
from graphrunner.declare.buffers import check_width

__all__ = ["Phase", "SpecBatch", "check_width"]


class SpecBatch:
    """The inputs of a speculative step: named device tensors plus the host
    mirrors ``req_pool_indices_cpu`` and ``seq_lens_cpu`` (CPU int64 ``[bs]``).

    ``batch_size`` comes from the host mirror (never a device read).
    """

    def __init__(
        self,
        *,
        req_pool_indices_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        **tensors: torch.Tensor,
    ) -> None:
        self.req_pool_indices_cpu = req_pool_indices_cpu
        self.seq_lens_cpu = seq_lens_cpu
        self.__dict__.update(tensors)

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices_cpu.shape[0])

    if TYPE_CHECKING:  # its named tensors, as the phase input protocols see them

        def __getattr__(self, name: str) -> torch.Tensor: ...
