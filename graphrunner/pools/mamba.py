"""Mamba conv/SSM state per request, with state ops deferred to the forward stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from graphrunner.pools.errors import DoubleFree, InvalidSlot
from graphrunner.pools.slots import (
    DeviceLike,
    SlotAllocator,
    SlotPool,
    as_index_list,
    check_count,
)

__all__ = ["MambaStatePool"]


@dataclass(frozen=True, slots=True)
class _StateOp:
    kind: Literal["clear", "copy"]
    src: tuple[int, ...]
    dst: tuple[int, ...]


class MambaStatePool(SlotPool):
    """Conv and SSM state of each request's Mamba layers, one slot per request.

    Tensors (``dtype``, on ``device``, zero-initialised):
        conv_state: ``[size + 1, *conv_shape]``.
        ssm_state: ``[size + 1, *ssm_shape]``.
    Slot 0 is the write sink of padded rows and is never handed out.

    NOTE: ``record_clear`` / ``record_copy`` do not touch the state; they queue
    the op (validated now, on the host). ``run_pending`` executes the queue in
    order on the forward stream. Running them on the scheduler stream while the
    forward stream still writes the state would race.
    """

    def __init__(
        self,
        size: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: DeviceLike,
    ) -> None:
        self.size = check_count("size", size, minimum=1)
        self.conv_shape = _check_shape("conv_shape", conv_shape)
        self.ssm_shape = _check_shape("ssm_shape", ssm_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._slots = SlotAllocator(self.size, name="mamba slot")
        self._pending: list[_StateOp] = []
        self.conv_state = self._zeros(self.conv_shape)
        self.ssm_state = self._zeros(self.ssm_shape)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros((self.size + 1, *shape), dtype=self.dtype, device=self.device)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def clear(self) -> None:
        """Back to the initial state: all slots free, no pending ops, state all zeros."""
        self._slots.clear()
        self._pending = []
        self.conv_state.zero_()
        self.ssm_state.zero_()

    def record_clear(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Queue zeroing the state of allocated slots ``indices`` (each listed once)."""
        dst = self._check_targets(indices, "record_clear")
        self._pending.append(_StateOp("clear", (), tuple(dst)))

    def record_copy(
        self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor
    ) -> None:
        """Queue ``state[dst[i]] = state[src[i]]`` (all sources read before any write)."""
        sources = as_index_list(src, "mamba slot")
        targets = self._check_targets(dst, "record_copy")
        if len(sources) != len(targets):
            raise InvalidSlot(
                f"record_copy got {len(sources)} sources and {len(targets)} targets; "
                "expected equal lengths"
            )
        for slot in sources:
            self._check_live(slot, "record_copy source")
        self._pending.append(_StateOp("copy", tuple(sources), tuple(targets)))

    def run_pending(self, stream: torch.cuda.Stream | None = None) -> int:
        """Execute the queued ops in order on ``stream`` (None: the current stream).

        Returns how many ops ran. Index tensors are built on the host and moved
        with ``non_blocking``: nothing is read back.
        """
        if stream is None:
            return self._run_all()
        with torch.cuda.stream(stream):
            return self._run_all()

    def _run_all(self) -> int:
        ran = 0
        while self._pending:
            self._run(self._pending.pop(0))
            ran += 1
        return ran

    def _run(self, op: _StateOp) -> None:
        dst = self._device_index(op.dst)
        if op.kind == "clear":
            self.conv_state.index_fill_(0, dst, 0)
            self.ssm_state.index_fill_(0, dst, 0)
            return
        src = self._device_index(op.src)
        for state in (self.conv_state, self.ssm_state):
            state.index_copy_(0, dst, state.index_select(0, src))

    def _device_index(self, indices: tuple[int, ...]) -> torch.Tensor:
        host = torch.tensor(indices, dtype=torch.int64)
        return host.to(self.device, non_blocking=True)

    def _check_targets(self, indices: Sequence[int] | torch.Tensor, what: str) -> list[int]:
        targets = as_index_list(indices, "mamba slot")
        if len(set(targets)) != len(targets):
            raise DoubleFree(f"{what} lists a target twice: {targets}")
        for slot in targets:
            self._check_live(slot, f"{what} target")
        return targets

    def _check_live(self, slot: int, what: str) -> None:
        self._slots.check_in_range(slot)
        if not self._slots.is_allocated(slot):
            raise InvalidSlot(f"{what} {slot} is not allocated; state ops need live slots")


def _check_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = tuple(check_count(f"{name}[{i}]", d, minimum=1) for i, d in enumerate(shape))
    if not dims:
        raise ValueError(f"{name} must have at least one dimension, got {shape!r}")
    return dims
