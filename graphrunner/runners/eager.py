"""The eager runner: same buffers, populate and padding, no graph.

The reference in tests: it runs the padded batch exactly as a graph would,
so a difference between it and a graph runner is the graph's, not padding's.
"""

from __future__ import annotations

from graphrunner.runner import GraphRunner, Launcher

__all__ = ["EagerRunner"]


class EagerRunner(GraphRunner):
    """Runs ``forward`` on the padded static buffers each replay, uncaptured."""

    kind = "eager"

    def _capture(self, bs: int, fn: Launcher) -> Launcher:
        return fn
