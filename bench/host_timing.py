"""Host time per call of a zero-argument callable, with the device idle or busy.

Device-agnostic: the device is reached only through the callables passed in
(``sync`` drains it, ``occupy`` enqueues long work on it, ``still_busy`` says
whether that work is still running), so on a CPU they are no-ops (and
``still_busy`` returns True) and the helpers are unit-testable there. Every
call is timed on its own with :func:`time.perf_counter_ns`; a result is the
median and the 10th / 90th percentiles (nearest rank) over all timed calls.

Two modes, to be reported side by side with a reference (e.g. a bare graph
launch) measured the same way in the same run:

* :func:`time_idle`: each timed call starts with the device drained (a
  ``sync`` after every call, untimed): the host cost of a step issued to an
  idle device, which is what a latency goal "with the GPU idle" is about.
* :func:`time_busy`: long device work is enqueued first, so the calls queue
  behind it and the host runs ahead, as an engine's loop does; no ``sync``
  between the timed calls, and the result is refused unless the device was
  still busy after the last one.

Comparing the two modes (and each against the bare launch in the same mode)
separates what a call costs the host from what it costs only when the device
has just gone idle.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceWentIdle", "HostTimes", "summarize", "time_busy", "time_idle"]


class DeviceWentIdle(RuntimeError):
    """The device finished its occupying work before the timed calls did."""


@dataclass(frozen=True)
class HostTimes:
    """Host microseconds per call: median, 10th and 90th percentile, over
    ``calls`` individually timed calls in ``mode`` ("idle" or "busy")."""

    median_us: float
    p10_us: float
    p90_us: float
    calls: int
    mode: str
    #: Every timed call, in order (for merging runs; left out of repr and ==).
    samples_us: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def spread(self) -> str:
        """The p10-p90 range as text, e.g. ``"4.1-6.3"``."""
        return f"{self.p10_us:.1f}-{self.p90_us:.1f}"

    def summary(self) -> dict[str, Any]:
        """The statistics as a JSON-ready dict (no samples)."""
        return {
            "median_us": round(self.median_us, 2),
            "p10_us": round(self.p10_us, 2),
            "p90_us": round(self.p90_us, 2),
            "calls": self.calls,
            "mode": self.mode,
        }


def summarize(samples_us: Sequence[float], mode: str) -> HostTimes:
    """Median and nearest-rank p10 / p90 of ``samples_us`` (at least one)."""
    if not samples_us:
        raise ValueError("no timed calls to summarize")
    ordered = sorted(samples_us)
    last = len(ordered) - 1
    return HostTimes(
        median_us=statistics.median(ordered),
        p10_us=ordered[round(0.1 * last)],
        p90_us=ordered[round(0.9 * last)],
        calls=len(ordered),
        mode=mode,
        samples_us=tuple(samples_us),
    )


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def _positive(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name}={value}: expected at least 1")


def time_idle(
    fn: Callable[[], Any],
    *,
    sync: Callable[[], Any],
    blocks: int,
    calls_per_block: int,
    warmup: int,
) -> HostTimes:
    """Host time of ``fn`` issued to an idle device.

    ``warmup`` untimed calls first (each followed by ``sync``). Then
    ``blocks`` blocks: the device is drained (``sync``, untimed) before each
    block; within a block each of ``calls_per_block`` calls is timed on its
    own and followed by an untimed ``sync``, so every timed call starts with
    the device idle and its own device work is not in the time. ``sync`` is
    called ``warmup + blocks * (1 + calls_per_block)`` times.

    This is the condition a single call after a synchronize also meets; what
    the method adds is many calls after a warm-up, percentiles rather than one
    number, and :func:`time_busy` beside it: a cost that appears only here (and
    not for the same call with the device busy) is paid for issuing work to a
    device that has just gone idle, not for the call's own host work.
    """
    _positive(blocks=blocks, calls_per_block=calls_per_block)
    for _ in range(warmup):
        fn()
        sync()
    samples: list[float] = []
    for _ in range(blocks):
        sync()
        for _ in range(calls_per_block):
            samples.append(_timed(fn))
            sync()
    return summarize(samples, "idle")


def time_busy(
    fn: Callable[[], Any],
    *,
    sync: Callable[[], Any],
    occupy: Callable[[], Any],
    still_busy: Callable[[], bool],
    calls: int,
    warmup: int,
    blocks: int = 1,
) -> HostTimes:
    """Host time of ``fn`` with the device busy (the host running ahead).

    ``warmup`` untimed calls, then ``sync``. Then ``blocks`` blocks, each:
    ``occupy()`` (untimed) enqueues long device work; ``calls`` calls are
    timed back to back, each on its own, with no ``sync`` between them, so
    they queue behind that work; ``still_busy()`` must then return True (the
    occupying work not finished yet: no timed call waited for the device or
    found it idle), else :class:`DeviceWentIdle`; then ``sync`` drains the
    device. Several short blocks rather than one long one keep the number
    of calls queued at once small (a launch queue, or a ring of staging
    buffers, that fills makes the host wait on the device).
    """
    _positive(blocks=blocks, calls=calls)
    for _ in range(warmup):
        fn()
    sync()
    samples: list[float] = []
    for block in range(blocks):
        occupy()
        samples.extend(_timed(fn) for _ in range(calls))
        busy = still_busy()
        sync()
        if not busy:
            raise DeviceWentIdle(
                f"the device finished its occupying work before the {calls} timed calls of "
                f"block {block + 1}/{blocks} did, so some calls may have found it idle or "
                "waited for it: raise the occupy length (or time fewer calls per block)"
            )
    return summarize(samples, "busy")
