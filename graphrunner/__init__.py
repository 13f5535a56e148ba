"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely.

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from graphrunner.backend import GraphBackend, NullBackend
from graphrunner.buffers import BufferSpec, BufferView, PadRule, StaticBuffers
from graphrunner.decode import (
    DECODE_FIELDS,
    DECODE_HOST_MIRRORS,
    MAMBA_DECODE_FIELDS,
    decode_buffer_specs,
)
from graphrunner.histogram import BatchSizeHistogram, read_histogram
from graphrunner.inputs import DecodeInputs, StepInputs
from graphrunner.mechanisms import (
    CaptureMechanism,
    CudaGraphCapture,
    EagerCapture,
    InductorCapture,
    create_mechanism,
)
from graphrunner.outputs import OutputDeclarationError, OutputSpec
from graphrunner.overlap import FutureMap, future_refs
from graphrunner.pools import HybridReqToTokenPool, MambaStatePool
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
from graphrunner.size_plan import SizePlan, budget_capture_sizes, optimal_capture_sizes
from graphrunner.sizes import BatchSizeError, default_capture_sizes, pad_to, padding_waste
from graphrunner.spec import (
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    SpecBatch,
    TargetVerifyRunner,
)
from graphrunner.state_ops import StateOps

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
