"""The one host-side free list every pool uses; slot 0 is padding and never handed out.

The argument checks it (and the other pools and the batch) use live in
:mod:`graphrunner.pools.checks`.
"""

from __future__ import annotations

import heapq

from graphrunner.pools.checks import (
    SlotIndices,
    as_index_list,
    bad_arg,
    check_count,
    check_each,
    check_int,
    first_repeat,
    host_int,
)
from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolError, PoolExhausted

__all__ = ["SlotAllocator", "SlotPool"]


class SlotAllocator:
    """Free list over ``1..size``; hands out the lowest free slots first (deterministic).

    Host-only: no tensors. Slot 0 is the padding slot of every pool and is never
    handed out, freed or reported as allocated. Every failing call leaves the
    allocator unchanged.
    """

    __slots__ = ("_allocated", "_free", "name", "size")

    def __init__(self, size: int, *, name: str = "slot") -> None:
        self.size = check_count("SlotAllocator: size", size, minimum=1)
        if not isinstance(name, str):
            raise bad_arg("SlotAllocator: name", name, "a str")
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
        """Whether ``index`` (any int; 0 and out of range: False) is handed out."""
        return check_int("is_allocated: index", index) in self._allocated

    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    def alloc(self, n: int) -> list[int]:
        """The ``n`` lowest free slots, ascending; PoolExhausted if fewer are free."""
        n = check_count("alloc: n", n)
        if n > len(self._free):
            raise PoolExhausted(n, len(self._free), f"{self.name}s")
        out = [heapq.heappop(self._free) for _ in range(n)]
        self._allocated.update(out)
        return out

    def free(self, indices: SlotIndices, name: str = "free: indices") -> None:
        """Return slots to the free list; all-or-nothing (nothing is freed on error)."""
        slots = self.check_allocated(indices, name)
        self._allocated.difference_update(slots)
        for slot in slots:
            heapq.heappush(self._free, slot)

    def check_allocated(
        self,
        indices: object,
        name: str = "check_allocated: indices",
        *,
        unique: bool = True,
        free_error: type[PoolError] = DoubleFree,
    ) -> list[int]:
        """Validate without mutating: every index in range, allocated (else
        ``free_error``) and, if ``unique``, listed once (else ``DoubleFree``)."""
        slots = as_index_list(indices, name)
        check_each(name, slots, 1, self.size, error=InvalidSlot, what=self._in_range())
        if unique and len(set(slots)) != len(slots):
            i = first_repeat(slots)
            raise bad_arg(f"{name}[{i}]", slots[i], f"each {self.name} listed once", DoubleFree)
        if not self._allocated.issuperset(slots):
            i, slot = next((i, s) for i, s in enumerate(slots) if s not in self._allocated)
            expected = f"an allocated {self.name} (it is free: freed, or never handed out)"
            raise bad_arg(f"{name}[{i}]", slot, expected, free_error)
        return slots

    def check_in_range(self, slot: object, name: str = "check_in_range: slot") -> int:
        """``slot`` as an int in ``1..size``: ``TypeError`` / ``InvalidSlot`` naming ``name``."""
        n = host_int(slot)
        if n is not None and 1 <= n <= self.size:
            return n
        return check_count(name, slot, 1, self.size, error=InvalidSlot, what=self._in_range())

    def _in_range(self) -> str:
        return f"a {self.name} in 1..{self.size} (0 is the reserved padding {self.name})"


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
