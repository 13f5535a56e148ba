"""A ready-made step of any phase (:class:`SpecBatch`); the phase value
itself is :class:`graphrunner.core.phase.Phase`."""

from __future__ import annotations

import torch

from graphrunner.core.phase import Phase
from graphrunner.declare.buffers import BufferView, check_width

__all__ = ["Phase", "SpecBatch", "check_width"]


class SpecBatch(BufferView):
    """A ready-made step of any phase: its declared buffers as named tensors
    (so it is also what a forward reads, run eagerly) plus the host mirrors
    ``req_pool_indices_cpu`` and ``seq_lens_cpu`` (CPU int64 ``[bs]``).

    ``batch_size`` comes from the host mirror (never a device read).
    """

    def __init__(
        self,
        *,
        req_pool_indices_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        **tensors: torch.Tensor,
    ) -> None:
        super().__init__(int(req_pool_indices_cpu.shape[0]), tensors)
        self.req_pool_indices_cpu = req_pool_indices_cpu
        self.seq_lens_cpu = seq_lens_cpu

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices_cpu.shape[0])
