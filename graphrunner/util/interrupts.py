"""Ctrl-C held to a step boundary, so an interrupted run loses nothing.

A ``KeyboardInterrupt`` raised at an arbitrary bytecode can land between a
pool allocation and the record of who holds it (a KV page handed out, not
yet on any request): the run's cleanup then cannot free it. While a run
holds :func:`deferred_interrupts`, SIGINT only marks the interrupt; the
engine raises it at the next step boundary, where every row and page is
recorded, and the run frees them all. A second Ctrl-C raises at once (a
stuck step can still be stopped). Only Python's default SIGINT handler is
replaced, and only in the main thread: an application's own handler stays.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["deferred_interrupts"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Callable[[], None]]:
    """Hold SIGINT during the block; yields ``check``, which raises the held
    ``KeyboardInterrupt`` (call it where the state is consistent)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: None
        return
    pending = False

    def hold(signum: int, frame: FrameType | None) -> None:
        nonlocal pending
        if pending:  # pressed twice: stop now
            raise KeyboardInterrupt
        pending = True

    def check() -> None:
        nonlocal pending
        if pending:
            pending = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
