"""One caller at a time: a guard that refuses a second entry instead of
letting two threads interleave on shared state (a runner's static buffers, an
engine's pools), which gives wrong results with no error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

__all__ = ["ConcurrentUseError", "Exclusive"]


class ConcurrentUseError(RuntimeError):
    """A second caller entered an object that serves one caller at a time."""


class Exclusive:
    """A non-blocking guard: ``with guard.held():`` (or ``enter()`` ...
    ``leave()``) enters, or raises :class:`ConcurrentUseError` naming ``what``
    and the thread inside (the same thread re-entering from a callback is
    refused too).

    Args:
        what: how the guarded call is named in the error, e.g. ``"Engine.run"``.
    """

    __slots__ = ("lock", "owner", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.lock = threading.Lock()
        self.owner: int | None = None

    def enter(self) -> None:
        """Enter, or raise :class:`ConcurrentUseError`; pair with :meth:`leave`
        (the hot path's form: no context manager to build; a replay inlines
        it as ``lock.acquire(blocking=False)`` or :meth:`refuse`)."""
        if not self.lock.acquire(blocking=False):
            self.refuse()
        self.owner = threading.get_ident()  # an int: its name is looked up only for an error

    def refuse(self) -> NoReturn:
        """Raise :class:`ConcurrentUseError` naming the thread inside."""
        raise ConcurrentUseError(
            f"{self.what} is already running (in thread {_name_of(self.owner)!r}); it "
            "serves one caller at a time: give each thread its own, or serialise the calls"
        )

    def leave(self) -> None:
        self.owner = None
        self.lock.release()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()


def _name_of(ident: int | None) -> str | None:
    return next((t.name for t in threading.enumerate() if t.ident == ident), None)
