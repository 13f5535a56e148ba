"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely.

The public API is what ``__all__`` lists (what an integrator needs); the
subpackages ``graphrunner.pools``, ``.declare``, ``.batch``, ``.writers``,
``.sanitizer``, ``.sampling``, ``.sizing``, ``.mechanisms``, ``.core``,
``.phases`` and ``.util`` each list their advanced names in their own
``__all__``; every other module is internal. Four contracts plug a model in:
declare the buffers and their pad rules (:class:`BufferSpec`,
:class:`PadRule`, :func:`decode_buffer_specs`), hand the runner a step, validated
where it is made (:class:`DecodeBatch`, the decode scheduler's batch with
host mirrors; :class:`SpecBatch`, any phase's fields), implement the attention backend's hooks
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
    decode_buffer_specs,
)
from graphrunner.phases import (
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    Phase,
    SpecBatch,
    decode_phase,
)
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
    # declarations: buffers, pad rules, outputs, what a forward reads, the backend
    "BufferSpec",
    "BufferView",
    "GraphBackend",
    "Index",
    "OutputSpec",
    "PadRule",
    "StateOps",
    "decode_buffer_specs",
    # a step: validated where it is made, with host mirrors
    "DecodeBatch",
    "SpecBatch",
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
    # The protocol a replay's inputs once had to be named by (DecodeInputs,
    # then StepInputs): a step is a DecodeBatch or a SpecBatch now; any other
    # object with their attributes is still taken, checked in full each replay.
    if name in ("DecodeInputs", "StepInputs"):
        message = (
            f"graphrunner.{name} is deprecated: a replay takes a graphrunner.DecodeBatch "
            "or a graphrunner.SpecBatch (any object with their attributes is checked in full)"
        )
        warn_at_caller(message, DeprecationWarning)
        from graphrunner.declare.inputs import StepInputs

        return StepInputs
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
