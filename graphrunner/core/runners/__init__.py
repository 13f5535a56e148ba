"""The runners users know by name, and a factory by name."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners.cpu import CpuGraphRunner
from graphrunner.core.runners.cuda import CudaGraphRunner
from graphrunner.core.runners.eager import EagerRunner
from graphrunner.mechanisms import check_mechanism_options

__all__ = [
    "RUNNERS",
    "CpuGraphRunner",
    "CudaGraphRunner",
    "EagerRunner",
    "best_runner_kind",
    "create_runner",
]

RUNNERS: dict[str, type[GraphRunner]] = {
    "cuda": CudaGraphRunner,
    "cpu": CpuGraphRunner,
    "eager": EagerRunner,
}


def best_runner_kind() -> str:
    """``"cuda"`` where a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def create_runner(kind: str, *args: Any, **kwargs: Any) -> GraphRunner:
    """Build the runner named ``kind`` (``cuda``, ``cpu`` or ``eager``).

    Keyword options of one mechanism go to it: ``compile=True`` (and
    ``compile_mode``, ``inductor_options``) for ``cuda``; ``compile_mode`` and
    ``inductor_options`` for ``cpu``.
    """
    check_mechanism_options(kind, kwargs)
    return RUNNERS[kind](*args, **kwargs)
