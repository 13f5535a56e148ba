"""Errors raised by the pools. All are ``ValueError`` subclasses (bad input, not bad state).

A wrong value is one of these; a wrong type (``None``, a float, a str, a bool, a
non-sequence where indices are expected) is a ``TypeError``. Both name the entry
point, the argument, its value and what was expected, and leave the pool as it was.
"""

from __future__ import annotations

__all__ = ["DoubleFree", "InvalidSlot", "PoolError", "PoolExhausted"]


class PoolError(ValueError):
    """Base class of every pool error; the pool is left exactly as it was."""


class PoolExhausted(PoolError):
    """More slots were requested than are free.

    Attributes:
        requested: how many were asked for (in the pool's unit: slots, tokens).
        available: how many were free at the time.
    """

    def __init__(
        self, requested: int, available: int, unit: str = "slots", name: str = "alloc: n"
    ) -> None:
        super().__init__(
            f"{name}={requested}: requested {requested} {unit}, only {available} available; "
            f"expected at most {available}"
        )
        self.requested = requested
        self.available = available


class InvalidSlot(PoolError):
    """An index that is not valid here: 0 (padding), out of range, not allocated where
    a live slot is needed, or an index tensor that is not a 1-D integer CPU tensor
    (reading a device tensor would be a device→host sync)."""


class DoubleFree(PoolError):
    """A slot freed twice: listed twice in one call, or not currently allocated."""
