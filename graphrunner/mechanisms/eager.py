"""Eager: the forward runs on the padded static buffers each launch, uncaptured."""

from __future__ import annotations

from graphrunner.mechanisms.base import CaptureMechanism, Launcher

__all__ = ["EagerCapture"]


class EagerCapture(CaptureMechanism):
    """No graph, no compile: the reference every other mechanism must equal."""

    kind = "eager"
    warmup_runs = 1  # the outputs' check: nothing initialises lazily, nothing is captured
    freezes_heap = False  # nor compiled: a full collection would be pure cost

    def capture(self, bs: int, fn: Launcher) -> Launcher:
        return fn
