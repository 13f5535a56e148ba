"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely.

The public API is what ``__all__`` lists (what an integrator needs); the
subpackages ``graphrunner.pools``, ``.declare``, ``.batch``, ``.writers``,
``.sanitizer``, ``.sampling``, ``.sizing``, ``.mechanisms``, ``.core``,
``.phases`` and ``.util`` each list their advanced names in their own
``__all__``; every other module is internal. Four contracts plug a model in:
declare the buffers and their pad rules (:class:`BufferSpec`,
:class:`PadRule`, :func:`decode_buffer_specs`), hand the runner a batch with
the declared fields and host mirrors (:class:`StepInputs`, or
:class:`DecodeBatch`), implement the attention backend's hooks
(:class:`GraphBackend`), keep slot 0 of every pool for the padded rows
(:class:`ReqToTokenPool`, :class:`TokenToKVPoolAllocator`, :class:`KVCache`).
``examples/own_model.py`` is a complete example; the reference engine built on
these names is the separate package ``graphrunner_ref``.
"""

from __future__ import annotations

from graphrunner.batch import DecodeBatch
from graphrunner.core import (
    CpuGraphRunner,
    CudaGraphRunner,
    FutureMap,
    GraphRunner,
    NotCapturedError,
    best_runner_kind,
    create_runner,
)
from graphrunner.declare import (
    BufferSpec,
    BufferView,
    GraphBackend,
    Index,
    OutputSpec,
    PadRule,
    StateOps,
    StepInputs,
    decode_buffer_specs,
)
from graphrunner.phases import EagleDraftExtendRunner, FrozenKvMtpRunner, Phase, decode_phase
from graphrunner.pools import (
    KVCache,
    MambaStatePool,
    PoolError,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from graphrunner.sanitizer import GuardedTensor, PaddingSanitizer, PaddingViolation
from graphrunner.util.version import version as _version
from graphrunner.util.warn import warn_at_caller

#: The installed distribution's version (the source tree's when not installed).
__version__ = _version()

__all__ = [
    "__version__",
    # pools: slot 0 of each is the padded rows' sink (hybrid ones: graphrunner.pools)
    "KVCache",
    "MambaStatePool",
    "PoolError",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    # declarations: buffers, pad rules, outputs, the step's inputs, the backend
    "BufferSpec",
    "BufferView",
    "GraphBackend",
    "Index",
    "OutputSpec",
    "PadRule",
    "StateOps",
    "StepInputs",
    "decode_buffer_specs",
    # a batch with host mirrors
    "DecodeBatch",
    # runners: a phase on a mechanism
    "CpuGraphRunner",
    "CudaGraphRunner",
    "EagleDraftExtendRunner",
    "FrozenKvMtpRunner",
    "GraphRunner",
    "NotCapturedError",
    "Phase",
    "best_runner_kind",
    "create_runner",
    "decode_phase",
    # overlap scheduling
    "FutureMap",
    # debugging
    "GuardedTensor",
    "PaddingSanitizer",
    "PaddingViolation",
]


def __getattr__(name: str) -> object:
    # The first release's name of StepInputs, kept as a deprecated alias.
    if name == "DecodeInputs":
        message = "graphrunner.DecodeInputs is deprecated; use graphrunner.StepInputs"
        warn_at_caller(message, DeprecationWarning)
        return StepInputs
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
