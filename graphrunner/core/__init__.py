"""The runner: capture once per size, replay padded; the runner kinds and the
future-token map of overlap scheduling."""

from __future__ import annotations

from graphrunner.core.future_map import FutureMap, future_refs
from graphrunner.core.input_check import host_range
from graphrunner.core.replay import GraphKey, NotCapturedError
from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners import (
    RUNNERS,
    CpuGraphRunner,
    CudaGraphRunner,
    EagerRunner,
    best_runner_kind,
    create_runner,
)

__all__ = [
    "RUNNERS",
    "CpuGraphRunner",
    "CudaGraphRunner",
    "EagerRunner",
    "FutureMap",
    "GraphKey",
    "GraphRunner",
    "NotCapturedError",
    "best_runner_kind",
    "create_runner",
    "future_refs",
    "host_range",
]
