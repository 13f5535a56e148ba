"""What a runner's replay reads of its inputs: :class:`StepInputs`, the
attributes of a step (internal: the type the replay path is annotated with).

A step is a :class:`~graphrunner.DecodeBatch` or a
:class:`~graphrunner.SpecBatch`, each validated where it is made (its seal,
:mod:`graphrunner.declare.sealed`). The runner depends on no batch class:
any other object with an attribute per buffer its phase declares, the host
mirrors and an int ``batch_size`` is taken too, checked in full on every
replay. What the forward reads is one view of the declared buffers by name,
:class:`~graphrunner.declare.buffers.BufferView`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["StepInputs"]


@runtime_checkable
class StepInputs(Protocol):
    """One step's inputs: ``batch_size`` live requests and, as attributes,
    one tensor per buffer the runner's phase declares (``batch_size *
    rows_per_request`` rows each; decode: ``input_ids``, ``req_pool_indices``,
    ``seq_lens``, ``out_cache_loc``, ``positions``, int64 ``[bs]``), which a
    scheduler may hand over as CPU tensors for the runner to stage.

    Host mirrors (CPU int64 ``[bs]``), equal to their device twins and kept
    in step by the scheduler so that no step reads a device value back:
    ``req_pool_indices_cpu`` (rows >= 1; 0 is the padding row) and
    ``seq_lens_cpu``.
    """

    req_pool_indices_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

    @property
    def batch_size(self) -> int:
        """Live requests in the step (a host int, never a device read)."""
        ...
