"""Capture mechanisms: how a size is captured and launched (CUDA graphs, with
or without an inductor-compiled forward; inductor programs called directly;
eager). A runner composes one; see :class:`CaptureMechanism`."""

from __future__ import annotations

from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher
from graphrunner.mechanisms.cuda_graph import CudaGraphCapture
from graphrunner.mechanisms.eager import EagerCapture
from graphrunner.mechanisms.inductor import InductorCapture
from graphrunner.mechanisms.uncapturable import UncapturableError

__all__ = [
    "MECHANISMS",
    "CaptureMechanism",
    "CudaGraphCapture",
    "EagerCapture",
    "ForwardFn",
    "InductorCapture",
    "Launcher",
    "UncapturableError",
]

MECHANISMS: dict[str, type[CaptureMechanism]] = {
    cls.kind: cls for cls in (CudaGraphCapture, InductorCapture, EagerCapture)
}
