"""Declarations: the static buffers and their pad rules, the decode field list
and its host mirrors, declared outputs, the
attention backend's hooks and the state operations a step records."""

from __future__ import annotations

from graphrunner.declare.buffers import (
    Axis,
    BufferSpec,
    BufferView,
    PadRule,
    Size,
    StaticBuffers,
    StepSize,
    check_width,
)
from graphrunner.declare.decode import (
    DECODE_FIELD_NAMES,
    DECODE_FIELDS,
    DECODE_HOST_MIRRORS,
    INPUT_IDS,
    MAMBA_DECODE_FIELDS,
    OUT_CACHE_LOC,
    PER_TOKEN_FIELD_NAMES,
    POSITIONS,
    REQ_POOL_INDICES,
    SEQ_LENS,
    decode_buffer_specs,
    per_token_fields,
)
from graphrunner.declare.hooks import BaseGraphBackend, GraphBackend, NullBackend
from graphrunner.declare.indexes import Index
from graphrunner.declare.outputs import OutputDeclarationError, OutputSpec
from graphrunner.declare.state_ops import StateOps, run_state_ops

__all__ = [
    "DECODE_FIELDS",
    "DECODE_FIELD_NAMES",
    "DECODE_HOST_MIRRORS",
    "INPUT_IDS",
    "OUT_CACHE_LOC",
    "POSITIONS",
    "REQ_POOL_INDICES",
    "SEQ_LENS",
    "MAMBA_DECODE_FIELDS",
    "PER_TOKEN_FIELD_NAMES",
    "Axis",
    "BaseGraphBackend",
    "BufferSpec",
    "BufferView",
    "GraphBackend",
    "Index",
    "NullBackend",
    "OutputDeclarationError",
    "OutputSpec",
    "PadRule",
    "Size",
    "StepSize",
    "StateOps",
    "StaticBuffers",
    "check_width",
    "decode_buffer_specs",
    "per_token_fields",
    "run_state_ops",
]
