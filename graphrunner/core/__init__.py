"""The runner: capture once per size, replay padded; the one constructor,
its options and the runners named by their mechanism; the future-token map
of overlap scheduling."""

from __future__ import annotations

from graphrunner.core.create import CpuGraphRunner, CudaGraphRunner, create_runner
from graphrunner.core.future_map import FutureMap, future_refs
from graphrunner.core.input_check import host_range
from graphrunner.core.options import RunnerOptions, best_runner_kind
from graphrunner.core.replay import NotCapturedError
from graphrunner.core.runner import GraphRunner

__all__ = [
    "CpuGraphRunner",
    "CudaGraphRunner",
    "FutureMap",
    "GraphRunner",
    "NotCapturedError",
    "RunnerOptions",
    "best_runner_kind",
    "create_runner",
    "future_refs",
    "host_range",
]
