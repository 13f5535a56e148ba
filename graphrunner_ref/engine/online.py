"""Requests that arrive while the engine runs: the :class:`RequestSource`
an online run (``Engine.run(..., source=)``, ``graphrunner serve``) takes.

The engine asks its source at every step boundary, where every request row
and KV page is recorded on a request: the source appends the requests that
arrived to ``run.pending`` (arrival step ``run.clock``), drops the waiting
ones that were cancelled, and blocks while the run is idle until one
arrives or it closes. A running request is cut through the engine's
``stop`` hook (it finishes after its next token, and the schedule frees its
row and pages as it frees any finished request), so every schedule (plain,
overlap, several steps a launch) cancels the same way, and the run lasts
until the source is closed and drained.
"""

from __future__ import annotations

from typing import Protocol

from graphrunner_ref.engine.results import Run

__all__ = ["RequestSource"]


class RequestSource(Protocol):
    """Where an online run's requests come from (see the module doc)."""

    def feed(self, run: Run) -> None:
        """At a step boundary: add the arrived requests to ``run.pending`` and
        drop cancelled waiting ones; while ``run`` has nothing pending,
        prefilling or live, wait for an arrival, or return once closed."""
        ...
