"""Errors raised by the pools. All are ``ValueError`` subclasses (bad input, not bad state)."""

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

    def __init__(self, requested: int, available: int, unit: str = "slots") -> None:
        super().__init__(f"requested {requested} {unit}, only {available} available")
        self.requested = requested
        self.available = available


class InvalidSlot(PoolError):
    """An index that can never be valid: 0 (padding), out of range, not an integer,
    a float tensor, or a tensor not on the CPU (reading it would be a device→host sync)."""


class DoubleFree(PoolError):
    """A slot freed twice: listed twice in one call, or not currently allocated."""
