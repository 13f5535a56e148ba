"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely.

The public API is what ``__all__`` lists; everything else is internal. A
model of one's own plugs in through the same names: pools whose slot 0 is
reserved (:class:`ReqToTokenPool`, :class:`TokenToKVPoolAllocator`,
:class:`KVCache`, :class:`MambaStatePool`), a batch (:class:`DecodeBatch`, or
any object with the attributes of :class:`DecodeInputs`), buffer declarations
(:class:`BufferSpec`, :class:`PadRule`, :class:`Index`, :func:`decode_buffer_specs`,
:class:`OutputSpec`), a runner (:func:`create_runner`) and, while debugging,
a :class:`PaddingSanitizer` guarding the model's own state
(:class:`GuardedTensor`). ``examples/own_model.py`` is a complete example.
"""

from __future__ import annotations

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.core.future_map import FutureMap, future_refs
from graphrunner.core.replay import GraphKey, NotCapturedError
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
from graphrunner.declare.indexes import Index
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
    EagleDraftDecodeRunner,
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    Phase,
    SpecBatch,
    TargetVerifyRunner,
    decode_phase,
    eagle_draft_decode_phase,
    eagle_draft_extend_phase,
    frozen_kv_mtp_phase,
    verify_phase,
)
from graphrunner.pools import (
    HybridReqToTokenPool,
    KVCache,
    MambaStatePool,
    PoolError,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from graphrunner.sanitizer.padding import (
    GuardedTensor,
    PaddingSanitizer,
    PaddingViolation,
    SanitizerStats,
)
from graphrunner.sizing.histogram import BatchSizeHistogram, read_histogram
from graphrunner.sizing.plan import SizePlan, budget_capture_sizes, optimal_capture_sizes
from graphrunner.sizing.report import CaptureReport, RunnerStats, SizeReport
from graphrunner.sizing.sizes import BatchSizeError, default_capture_sizes, pad_to, padding_waste
from graphrunner.util.exclusive import ConcurrentUseError
from graphrunner.util.extras import MissingExtraError
from graphrunner.util.version import version as _version
from graphrunner.writers.base import PopulateError, populate

#: The installed distribution's version (the source tree's when not installed).
__version__ = _version()

__all__ = [
    "__version__",
    "DECODE_FIELDS",
    "DECODE_HOST_MIRRORS",
    "MAMBA_DECODE_FIELDS",
    "BatchSizeError",
    "BatchSizeHistogram",
    "BufferSpec",
    "BufferView",
    "CaptureMechanism",
    "CaptureReport",
    "ConcurrentUseError",
    "CpuGraphRunner",
    "CudaGraphCapture",
    "CudaGraphRunner",
    "DecodeBatch",
    "DecodeInputs",
    "EagerCapture",
    "EagerRunner",
    "EagleDraftDecodeRunner",
    "EagleDraftExtendRunner",
    "FrozenKvMtpRunner",
    "FutureMap",
    "GraphBackend",
    "GraphKey",
    "GraphRunner",
    "GuardedTensor",
    "HybridReqToTokenPool",
    "Index",
    "InductorCapture",
    "KVCache",
    "MambaStatePool",
    "MissingExtraError",
    "NotCapturedError",
    "NullBackend",
    "OutputDeclarationError",
    "OutputSpec",
    "PadRule",
    "PaddingSanitizer",
    "PaddingViolation",
    "Phase",
    "PoolError",
    "PopulateError",
    "ReqToTokenPool",
    "RunnerStats",
    "SanitizerStats",
    "SizePlan",
    "SizeReport",
    "SpecBatch",
    "StateOps",
    "StaticBuffers",
    "StepInputs",
    "TargetVerifyRunner",
    "TokenToKVPoolAllocator",
    "best_runner_kind",
    "budget_capture_sizes",
    "create_mechanism",
    "create_runner",
    "decode_buffer_specs",
    "decode_phase",
    "default_capture_sizes",
    "eagle_draft_decode_phase",
    "eagle_draft_extend_phase",
    "frozen_kv_mtp_phase",
    "future_refs",
    "optimal_capture_sizes",
    "pad_to",
    "padding_waste",
    "populate",
    "read_histogram",
    "verify_phase",
]
