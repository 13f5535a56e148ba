"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely.

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from graphrunner.backend import GraphBackend, NullBackend
from graphrunner.buffers import BufferSpec, BufferView, PadRule, StaticBuffers, decode_buffer_specs
from graphrunner.inputs import DecodeInputs
from graphrunner.populate import PopulateError, populate
from graphrunner.replay import NotCapturedError
from graphrunner.report import CaptureReport, RunnerStats, SizeReport
from graphrunner.runner import GraphRunner
from graphrunner.runners import (
    CpuGraphRunner,
    CudaGraphRunner,
    EagerRunner,
    best_runner_kind,
    create_runner,
)
from graphrunner.sizes import BatchSizeError, default_capture_sizes, pad_to, padding_waste

__all__ = [
    "BatchSizeError",
    "BufferSpec",
    "BufferView",
    "CaptureReport",
    "CpuGraphRunner",
    "CudaGraphRunner",
    "DecodeInputs",
    "EagerRunner",
    "GraphBackend",
    "GraphRunner",
    "NotCapturedError",
    "NullBackend",
    "PadRule",
    "PopulateError",
    "RunnerStats",
    "SizeReport",
    "StaticBuffers",
    "best_runner_kind",
    "create_runner",
    "decode_buffer_specs",
    "default_capture_sizes",
    "pad_to",
    "padding_waste",
    "populate",
]
