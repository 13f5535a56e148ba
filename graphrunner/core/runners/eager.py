"""The eager runner: same buffers, populate and padding, no graph.

The reference in tests: it runs the padded batch exactly as a graph would,
so a difference between it and a graph runner is the graph's, not padding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.mechanisms import EagerCapture
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["EagerRunner"]


class EagerRunner(GraphRunner):
    """Runs ``forward`` on the padded static buffers each replay, uncaptured,
    on any device."""

    def __init__(
        self,
        forward: ForwardFn,
        specs: Sequence[BufferSpec],
        *,
        device: torch.device | str,
        **kwargs: Any,
    ) -> None:
        super().__init__(forward, specs, device=device, mechanism=EagerCapture(), **kwargs)
