"""The runner's counters an engine run reports: rows computed and padding
sanitizer checks, read before and after the run, the difference recorded."""

from __future__ import annotations

from dataclasses import dataclass

from graphrunner import GraphRunner
from graphrunner_ref.engine.results import EngineStats

__all__ = ["RunnerCounts"]


@dataclass(frozen=True, slots=True)
class RunnerCounts:
    """A runner's live and padded rows and its sanitizer's replays checked
    and seconds (0 without one), so far."""

    live_rows: int
    padded_rows: int
    sanitized_replays: int
    sanitizer_seconds: float

    @classmethod
    def of(cls, runner: GraphRunner) -> RunnerCounts:
        rows, sanitizer = runner.stats, runner.sanitizer
        if sanitizer is None:
            return cls(rows.live_rows, rows.padded_rows, 0, 0.0)
        checks = sanitizer.stats
        return cls(rows.live_rows, rows.padded_rows, checks.replays_checked, checks.seconds)

    def record_since(self, start: RunnerCounts, stats: EngineStats, steps_per_launch: int) -> None:
        """The counts from ``start`` to these into ``stats``. At N steps a
        launch a row counts once a step, and a live row's steps after it
        stopped inside a launch are padding too (they read and write slot 0)."""
        stats.sanitized_replays = self.sanitized_replays - start.sanitized_replays
        stats.sanitizer_seconds = self.sanitizer_seconds - start.sanitizer_seconds
        live, padded = self.live_rows - start.live_rows, self.padded_rows - start.padded_rows
        if steps_per_launch == 1:
            stats.live_rows, stats.padded_rows = live, padded
            return
        stats.live_rows = stats.decode_tokens
        stats.padded_rows = (live + padded) * steps_per_launch - stats.decode_tokens
