"""The one host-side free list every pool uses; slot 0 is padding and never handed out."""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from typing import SupportsIndex, TypeAlias, TypeGuard

import torch

from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolExhausted

__all__ = ["DeviceLike", "SlotAllocator", "SlotIndices", "as_index_list", "check_count"]

DeviceLike: TypeAlias = "torch.device | str"
SlotIndices: TypeAlias = "Sequence[int] | torch.Tensor"


def _is_host_int(value: object) -> TypeGuard[SupportsIndex]:
    # A tensor has __index__ too, but reading it is a device→host sync on a GPU:
    # host indices come as Python (or NumPy) ints only.
    return not isinstance(value, (bool, torch.Tensor)) and hasattr(value, "__index__")


def check_count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int ``>= minimum``; TypeError / ValueError naming ``name`` otherwise."""
    if not _is_host_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    n = operator.index(value)
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {n}")
    return n


def as_index_list(indices: SlotIndices, name: str = "slot") -> list[int]:
    """Host ints from a sequence of ints or a 1-D CPU integer tensor.

    A tensor on another device is refused rather than read: reading it would be a
    device→host sync, which is exactly what the scheduler must never do per step.
    """
    if isinstance(indices, torch.Tensor):
        _check_index_tensor(indices, name)
        return [int(i) for i in indices.tolist()]
    if isinstance(indices, (str, bytes)):
        raise InvalidSlot(f"{name} indices must be ints, got {indices!r}")
    out: list[int] = []
    for value in indices:
        if not _is_host_int(value):
            raise InvalidSlot(f"{name} index must be an int, got {value!r}")
        out.append(operator.index(value))
    return out


def _check_index_tensor(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cpu":
        raise InvalidSlot(
            f"{name} index tensor is on {t.device}; expected a CPU tensor or host ints "
            "(reading a device tensor would be a device→host sync)"
        )
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise InvalidSlot(f"{name} index tensor has dtype {t.dtype}; expected an integer dtype")
    if t.dim() != 1:
        raise InvalidSlot(f"{name} index tensor has shape {tuple(t.shape)}; expected 1-D")


class SlotAllocator:
    """Free list over ``1..size``; hands out the lowest free slots first (deterministic).

    Host-only: no tensors. Slot 0 is the padding slot of every pool and is never
    handed out, freed or reported as allocated. Every failing call leaves the
    allocator unchanged.
    """

    __slots__ = ("_allocated", "_free", "name", "size")

    def __init__(self, size: int, *, name: str = "slot") -> None:
        self.size = check_count("size", size, minimum=1)
        self.name = name
        self._free: list[int] = []
        self._allocated: set[int] = set()
        self.clear()

    def clear(self) -> None:
        """Free everything: back to the state right after construction."""
        self._free = list(range(1, self.size + 1))  # sorted, hence already a heap
        self._allocated = set()

    def available_size(self) -> int:
        return len(self._free)

    def is_allocated(self, index: int) -> bool:
        return index in self._allocated

    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    def alloc(self, n: int) -> list[int]:
        """The ``n`` lowest free slots, ascending; PoolExhausted if fewer are free."""
        n = check_count("n", n)
        if n > len(self._free):
            raise PoolExhausted(n, len(self._free), f"{self.name}s")
        out = [heapq.heappop(self._free) for _ in range(n)]
        self._allocated.update(out)
        return out

    def free(self, indices: SlotIndices) -> None:
        """Return slots to the free list; all-or-nothing (nothing is freed on error)."""
        slots = self.check_allocated(indices)
        self._allocated.difference_update(slots)
        for slot in slots:
            heapq.heappush(self._free, slot)

    def check_allocated(self, indices: SlotIndices) -> list[int]:
        """Validate without mutating: every index in range, allocated, and listed once."""
        slots = as_index_list(indices, self.name)
        seen: set[int] = set()
        for slot in slots:
            self.check_in_range(slot)
            if slot in seen:
                raise DoubleFree(f"{self.name} {slot} is listed twice in one call")
            if slot not in self._allocated:
                raise DoubleFree(
                    f"{self.name} {slot} is not allocated (already freed or never handed out)"
                )
            seen.add(slot)
        return slots

    def check_in_range(self, slot: int) -> None:
        if not 1 <= slot <= self.size:
            raise InvalidSlot(
                f"{self.name} {slot} is out of range: expected 1..{self.size} "
                f"(0 is the reserved padding {self.name})"
            )


class SlotPool:
    """The slot-handling half of a pool whose slots are whole rows: it hands
    out rows ``1..n`` of its tensors through one :class:`SlotAllocator`."""

    _slots: SlotAllocator

    def alloc(self, n: int) -> list[int]:
        """``n`` free rows, lowest first (never 0); ``PoolExhausted`` if too few."""
        return self._slots.alloc(n)

    def free(self, indices: SlotIndices) -> None:
        """Return rows; all-or-nothing (``InvalidSlot`` / ``DoubleFree``)."""
        self._slots.free(indices)

    def available_size(self) -> int:
        return self._slots.available_size()

    def is_allocated(self, index: int) -> bool:
        return self._slots.is_allocated(index)

    def allocated(self) -> frozenset[int]:
        return self._slots.allocated()
