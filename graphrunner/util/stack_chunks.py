"""Calling a compiled program where its calls do not cross a stack chunk.

CPython (3.11 on) keeps frames in chunks of a per-thread stack. A frame that
does not fit in the current chunk gets a new one (16 KB or more, mapped from
the OS), freed again when that frame returns. Inductor's Python wrapper is
one function whose frame holds a slot for every buffer it names (1,700 for
SmolLM2), and it calls an op through a small Python frame per layer and
projection. Where the wrapper's frame ends a few slots short of its chunk's
end, every one of those calls maps a chunk, faults its page in and unmaps it:
~10 µs a call, 150 calls a SmolLM2 step, 25% of its batch-1 decode. Whether
it happens depends only on how deep the caller stands, so it came and went
between runs of the same benchmark. CPython caches one chunk from 3.13's and
3.14's later releases on (gh-142183), not in 3.11 or 3.12.

:class:`ChunkSafeCall` calls the program from a spacer frame, one of a few
sizes, and counts the page faults a call takes (each fresh chunk takes at
least one): it keeps the first spacer whose calls run without them (or the
one with the fewest), and checks one call in :data:`RECHECK` after that, so
a caller that moves deeper is followed. Faults come from elsewhere too (a
KV page written for the first time), so a checked call over the mark has
the spacer in use measured again first, and only a spacer that stays over
it is left; such a choice is made again no sooner than a gap of calls that
doubles each time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["ChunkSafeCall"]

T = TypeVar("T")

#: Slots each spacer adds to the call's depth: 0 is the plain call. A shift
#: larger than the op's frame moves the wrapper's frame out of the window.
SPACER_SLOTS = (0, 48, 160, 480)
#: Calls measured at each spacer while choosing.
PROBES = 2
#: Faults a call may take and still count as clean (a new output's page).
QUIET = 2
#: Once a spacer is chosen, one call in this many is measured.
RECHECK = 4
#: Calls between two choices at first, and at most (the gap doubles).
FIRST_GAP, LAST_GAP = 4, 1024
#: False: every ChunkSafeCall calls its program plainly (a benchmark's baseline).
ENABLED = True


def _spacer(slots: int) -> Callable[..., Any]:
    """``spacer(fn, *args)``: ``fn(*args)`` called from a frame ``slots``
    locals larger (declared, never assigned: the frame is all they cost)."""
    if slots == 0:
        return lambda fn, *args: fn(*args)
    names = " = ".join(f"_{i}" for i in range(slots))
    namespace: dict[str, Callable[..., Any]] = {}
    src = f"def spacer(fn, *args):\n    if False:\n        {names} = None\n    return fn(*args)\n"
    exec(src, namespace)
    return namespace["spacer"]


_SPACERS = tuple(_spacer(slots) for slots in SPACER_SLOTS)


def _fault_counter() -> Callable[[], int] | None:
    """The calling thread's minor page faults so far; None where the OS
    does not count them (the call then runs plain)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return lambda: resource.getrusage(who).ru_minflt


_faults = _fault_counter()


class ChunkSafeCall(Generic[T]):
    """``fn(*args)`` called from the spacer frame its calls take the fewest
    page faults under (see the module's docstring); the result is ``fn``'s."""

    def __init__(self, fn: Callable[..., T], faults: Callable[[], int] | None = _faults) -> None:
        self.fn = fn
        self._faults = faults
        self.at = 0  # the spacer in use, an index into SPACER_SLOTS
        self.settled = faults is None
        self._seen: list[int | None] = [None] * len(_SPACERS)
        self._probes = PROBES
        self._calls = 0
        self._clean = QUIET  # a probed call at most this faulty settles the choice
        self._gap = FIRST_GAP
        self._next_choice = FIRST_GAP

    def __call__(self, *args: Any) -> T:
        if not ENABLED:
            return self.fn(*args)
        self._calls += 1
        if self.settled and (self._faults is None or self._calls % RECHECK):
            return _SPACERS[self.at](self.fn, *args)
        assert self._faults is not None
        before = self._faults()
        out: T = _SPACERS[self.at](self.fn, *args)
        self._observe(self._faults() - before)
        return out

    def _observe(self, faults: int) -> None:
        if self.settled:
            mark = max(QUIET, 2 * (self._seen[self.at] or 0))
            if faults > mark and self._calls >= self._next_choice:
                self._choose_again(mark)
            return
        seen = self._seen[self.at]
        self._seen[self.at] = faults if seen is None else min(seen, faults)
        self._probes -= 1
        if faults <= self._clean:
            self.settled = True
        elif self._probes == 0:
            self._next()

    def _choose_again(self, mark: int) -> None:
        """Probe again, the spacer in use first: a call as clean as ``mark``
        keeps it (the faults were another cause's)."""
        self._seen = [None] * len(_SPACERS)
        self._probes, self.settled, self._clean = PROBES, False, mark
        self._gap = min(2 * self._gap, LAST_GAP)
        self._next_choice = self._calls + self._gap

    def _next(self) -> None:
        """Probe the next spacer not yet seen, or settle on the best seen."""
        unseen = [i for i, seen in enumerate(self._seen) if seen is None]
        if unseen:
            self.at, self._probes = unseen[0], PROBES
            return
        self.at = min(range(len(_SPACERS)), key=lambda i: self._seen[i] or 0)
        self.settled = True
