"""The runners, and a factory by name."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.runner import GraphRunner
from graphrunner.runners.cpu import CpuGraphRunner
from graphrunner.runners.cuda import CudaGraphRunner
from graphrunner.runners.eager import EagerRunner

__all__ = [
    "RUNNERS",
    "CpuGraphRunner",
    "CudaGraphRunner",
    "EagerRunner",
    "best_runner_kind",
    "create_runner",
]

RUNNERS: dict[str, type[GraphRunner]] = {
    cls.kind: cls for cls in (CudaGraphRunner, CpuGraphRunner, EagerRunner)
}


def best_runner_kind() -> str:
    """``"cuda"`` where a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def create_runner(kind: str, *args: Any, **kwargs: Any) -> GraphRunner:
    """Build the runner named ``kind`` (``cuda``, ``cpu`` or ``eager``)."""
    if not isinstance(kind, str) or kind not in RUNNERS:
        raise ValueError(f"unknown runner kind {kind!r}; expected one of {sorted(RUNNERS)}")
    return RUNNERS[kind](*args, **kwargs)
