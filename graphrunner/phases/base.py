"""A ready-made step of any phase (:class:`SpecBatch`); the phase value
itself is :class:`graphrunner.core.phase.Phase`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphrunner.core.input_check import check_host_mirrors
from graphrunner.core.phase import Phase
from graphrunner.core.runner_setup import token_count, token_field
from graphrunner.declare.buffers import Axis, BufferSpec, BufferView, Size, StepSize, check_width
from graphrunner.declare.decode import DECODE_HOST_MIRRORS
from graphrunner.declare.sealed import (
    HostRanges,
    SealKey,
    cached_range,
    seal_key,
    widened,
)
from graphrunner.writers.base import PopulateError, check_fields

__all__ = ["Phase", "SpecBatch", "check_width"]

_MIRRORS = tuple(DECODE_HOST_MIRRORS.values())


class SpecBatch(BufferView):
    """A ready-made step of any phase: its declared buffers as named tensors
    (so it is also what a forward reads, run eagerly) plus the host mirrors
    ``req_pool_indices_cpu`` and ``seq_lens_cpu`` (CPU int64 ``[bs]``).

    ``batch_size`` comes from the host mirror (never a device read). Sealed
    (:meth:`seal`, or as ``token_batch_inputs`` builds it), it was checked once
    against a phase's buffers and knows its mirrors' ranges: a runner of those
    buffers skips its per-field checks, as for a sealed ``DecodeBatch``. Any
    assignment from outside breaks the seal; an in-place change of a mirror
    drops its known range (its version counter moves).
    """

    #: True while nothing was assigned since the seal (read by a runner without a call).
    sealed: bool = False
    #: What the seal checked (:func:`~graphrunner.declare.sealed.seal_key`), and on which device.
    seal_key: SealKey | None = None
    device: torch.device | None = None
    batch_size: int
    host_ranges: HostRanges
    req_pool_indices_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

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
        object.__setattr__(self, "host_ranges", {})

    def __setattr__(self, name: str, value: object) -> None:
        # Anything assigned from outside may not be what the seal checked (the
        # seal's own bookkeeping goes through object.__setattr__).
        object.__setattr__(self, name, value)
        object.__setattr__(self, "sealed", False)
        if name == _MIRRORS[0] and isinstance(value, torch.Tensor):  # req_pool_indices_cpu
            object.__setattr__(self, "batch_size", int(value.shape[0]))

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        object.__setattr__(self, "sealed", False)

    def is_sealed(self) -> bool:
        return self.sealed

    def host_range(self, name: str) -> tuple[int, int] | None:
        """``(min, max)`` of host mirror ``name``, None when empty (known while unchanged)."""
        return cached_range(self.host_ranges, name, getattr(self, name))

    def seal(self, specs: Sequence[BufferSpec], device: torch.device | str) -> SpecBatch:
        """Check every field once against ``specs`` (a phase's buffers) on
        ``device`` (its runner's) as a replay would: dtype, device (or the CPU
        for a host-produced integer field), ``[spec.rows(size), *extra_shape]``;
        mirrors CPU int64 ``[bs]``, rows >= 1. Raises the replay's
        ``PopulateError`` naming the field; returns this batch, sealed."""
        where = torch.empty(0, device=device).device  # "cuda" as its tensors report it
        requests = self.batch_size
        size: Size = requests
        if any(s.axis is Axis.TOKEN for s in specs):
            size = StepSize(token_count(self, token_field(specs), requests), requests)
        check_host_mirrors(self, size)
        check_fields(specs, where, self, size)
        self.made(seal_key(specs, where))
        return self

    @classmethod
    def extending(
        cls, base: Any, specs: Sequence[BufferSpec] = (), **tensors: torch.Tensor
    ) -> SpecBatch:
        """``base``'s step (a :class:`~graphrunner.DecodeBatch`, a
        ``SpecBatch``, or any inputs object with its tensors as attributes)
        with ``tensors`` added, as one ``SpecBatch``: the fields a phase reads
        beyond the batch (a Mamba slot per row, sampling rows).

        A sealed ``base`` gives a sealed step: ``tensors`` are checked here,
        once, against ``specs`` (their declarations, one per tensor) on
        ``base``'s device, and the seal widened to them. Tensors that do not
        fit leave the step unsealed, for the replay's full check to refuse
        naming the field. ``base``'s known mirror ranges carry over.
        """
        step = cls(**_tensors_of(base), **tensors)
        key = getattr(base, "seal_key", None)
        if getattr(base, "sealed", False) and key is not None:
            try:
                check_fields(specs, key.device, step, step.batch_size)
            except PopulateError:
                return step  # unsealed: the replay's full check names the field
            step.made(widened(key, specs), known=getattr(base, "host_ranges", None))
        return step

    def made(self, key: SealKey, *, known: HostRanges | None = None) -> None:
        """Seal for ``key`` unchecked: for a builder whose construction makes
        every field of ``key``. Records the mirrors' ranges (host tensors, no
        sync), starting from ``known`` (a sealed batch's, whose mirrors these are)."""
        held = dict(known or {})
        mine = {m: getattr(self, m) for m in _MIRRORS if m in self.__dict__}
        for name, mirror in mine.items():
            cached_range(held, name, mirror)  # a lookup where ``known`` has it
        ranges = {n: entry for n, entry in held.items() if mine.get(n) is entry[0]}
        object.__setattr__(self, "host_ranges", ranges)
        object.__setattr__(self, "seal_key", key)
        object.__setattr__(self, "device", key.device)
        object.__setattr__(self, "sealed", True)


def _tensors_of(base: Any) -> dict[str, torch.Tensor]:
    """``base``'s tensors by name: a batch's own ``tensors()``, else its attributes."""
    if callable(getattr(base, "tensors", None)):
        tensors = base.tensors()
    elif hasattr(base, "__dict__"):
        tensors = vars(base)
    else:
        raise TypeError(
            f"base: a {type(base).__name__} has no tensors() and no attributes of its own; "
            "expected a DecodeBatch, a SpecBatch or an object holding its fields as attributes"
        )
    return {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
