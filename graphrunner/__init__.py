"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely.

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from graphrunner.core.future_map import FutureMap, future_refs
from graphrunner.core.replay import NotCapturedError
from graphrunner.core.runner import GraphRunner
from graphrunner.core.runners import (
    CpuGraphRunner,
    CudaGraphRunner,
    EagerRunner,
    best_runner_kind,
    create_runner,
)
from graphrunner.declare.buffers import BufferSpec, BufferView, PadRule, StaticBuffers
from graphrunner.declare.decode import (
    DECODE_FIELDS,
    DECODE_HOST_MIRRORS,
    MAMBA_DECODE_FIELDS,
    decode_buffer_specs,
)
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.declare.inputs import DecodeInputs, StepInputs
from graphrunner.declare.outputs import OutputDeclarationError, OutputSpec
from graphrunner.declare.state_ops import StateOps
from graphrunner.mechanisms import (
    CaptureMechanism,
    CudaGraphCapture,
    EagerCapture,
    InductorCapture,
    create_mechanism,
)
from graphrunner.phases import (
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    SpecBatch,
    TargetVerifyRunner,
)
from graphrunner.pools import HybridReqToTokenPool, MambaStatePool
from graphrunner.sizing.histogram import BatchSizeHistogram, read_histogram
from graphrunner.sizing.plan import SizePlan, budget_capture_sizes, optimal_capture_sizes
from graphrunner.sizing.report import CaptureReport, RunnerStats, SizeReport
from graphrunner.sizing.sizes import BatchSizeError, default_capture_sizes, pad_to, padding_waste
from graphrunner.writers.base import PopulateError, populate

__all__ = [
    "DECODE_FIELDS",
    "DECODE_HOST_MIRRORS",
    "MAMBA_DECODE_FIELDS",
    "BatchSizeError",
    "BatchSizeHistogram",
    "BufferSpec",
    "BufferView",
    "CaptureMechanism",
    "CaptureReport",
    "CpuGraphRunner",
    "CudaGraphCapture",
    "CudaGraphRunner",
    "DecodeInputs",
    "EagerCapture",
    "EagerRunner",
    "EagleDraftExtendRunner",
    "FrozenKvMtpRunner",
    "FutureMap",
    "GraphBackend",
    "GraphRunner",
    "HybridReqToTokenPool",
    "InductorCapture",
    "MambaStatePool",
    "NotCapturedError",
    "NullBackend",
    "OutputDeclarationError",
    "OutputSpec",
    "PadRule",
    "PopulateError",
    "RunnerStats",
    "SizePlan",
    "SizeReport",
    "SpecBatch",
    "StateOps",
    "StaticBuffers",
    "StepInputs",
    "TargetVerifyRunner",
    "best_runner_kind",
    "budget_capture_sizes",
    "create_mechanism",
    "create_runner",
    "decode_buffer_specs",
    "default_capture_sizes",
    "future_refs",
    "optimal_capture_sizes",
    "pad_to",
    "padding_waste",
    "populate",
    "read_histogram",
]
