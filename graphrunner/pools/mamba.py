"""Mamba conv/SSM state per request, with state ops deferred to the forward stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from graphrunner.pools.checks import (
    DeviceLike,
    as_index_list,
    bad_arg,
    check_count,
    check_device,
    check_float_dtype,
)
from graphrunner.pools.errors import InvalidSlot, PoolError
from graphrunner.pools.slots import SlotAllocator, SlotPool

__all__ = ["MambaStatePool", "PendingStateOp"]


class PendingStateOp(PoolError):
    """A slot was freed while a recorded state op still reads or writes it: the
    op would run on a slot another request may own by then."""


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
        where = "MambaStatePool"
        self.size = check_count(f"{where}: size", size, minimum=1)
        self.conv_shape = _check_shape(f"{where}: conv_shape", conv_shape)
        self.ssm_shape = _check_shape(f"{where}: ssm_shape", ssm_shape)
        self.dtype = check_float_dtype(f"{where}: dtype", dtype)
        self.device = check_device(f"{where}: device", device)
        self._slots = SlotAllocator(self.size, name="mamba slot")
        self._pending: list[_StateOp] = []
        self.conv_state = self._zeros(self.conv_shape)
        self.ssm_state = self._zeros(self.ssm_shape)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros((self.size + 1, *shape), dtype=self.dtype, device=self.device)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pending_slots(self) -> frozenset[int]:
        """Slots a queued op reads or writes (host facts, no device read)."""
        return frozenset(s for op in self._pending for s in (*op.src, *op.dst))

    def free(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Return slots; all-or-nothing. A slot a queued op still reads or writes
        is refused (:class:`PendingStateOp`): run the ops first (the runner's
        pre-launch step does), so no op ever lands on a freed slot."""
        slots = self._slots.check_allocated(indices, "free: indices")
        busy = self.pending_slots()
        for i, slot in enumerate(slots):
            if slot in busy:
                expected = "a slot no pending state op reads or writes (run_pending first)"
                raise bad_arg(f"free: indices[{i}]", slot, expected, PendingStateOp)
        self._slots.free(slots)

    def clear(self) -> None:
        """Back to the initial state: all slots free, no pending ops, state all zeros."""
        self._slots.clear()
        self._pending = []
        self.conv_state.zero_()
        self.ssm_state.zero_()

    def record_clear(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Queue zeroing the state of allocated slots ``indices`` (each listed once)."""
        dst = self._live(indices, "record_clear: indices", unique=True)
        self._pending.append(_StateOp("clear", (), tuple(dst)))

    def record_copy(
        self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor
    ) -> None:
        """Queue ``state[dst[i]] = state[src[i]]`` (all sources read before any write)."""
        sources = self._live(src, "record_copy: src", unique=False)
        targets = self._live(dst, "record_copy: dst", unique=True)
        if len(sources) != len(targets):
            expected = f"as many targets as src has sources ({len(sources)})"
            raise bad_arg("record_copy: dst", dst, expected, InvalidSlot)
        self._pending.append(_StateOp("copy", tuple(sources), tuple(targets)))

    def run_pending(self, stream: torch.cuda.Stream | None = None) -> int:
        """Execute the queued ops in order on ``stream`` (None: the current stream).

        Returns how many ops ran. Index tensors are built on the host and moved
        with ``non_blocking``: nothing is read back.
        """
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise bad_arg("run_pending: stream", stream, "None or a torch.cuda.Stream")
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

    def _live(self, indices: object, name: str, *, unique: bool) -> list[int]:
        """Allocated slots (state ops need live ones; else ``InvalidSlot``)."""
        return self._slots.check_allocated(indices, name, unique=unique, free_error=InvalidSlot)


def _check_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = as_index_list(shape, name, expected="a tuple of ints", error=PoolError)
    if not dims:
        raise bad_arg(name, shape, "at least one dimension", PoolError)
    return tuple(check_count(f"{name}[{i}]", d, minimum=1) for i, d in enumerate(dims))
