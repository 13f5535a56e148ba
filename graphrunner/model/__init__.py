"""The reference model executor: a Llama-style decoder over paged KV pools.

Used by the demo, the oracle tests and the benchmarks; checkpoints load
through :mod:`graphrunner.io`.
"""

from __future__ import annotations

from graphrunner.model.attention import PagedAttention
from graphrunner.model.attention_backend import TorchPagedBackend
from graphrunner.model.attention_meta import AttnMetadata
from graphrunner.model.build import ModelBundle, build_model
from graphrunner.model.config import CheckpointError, ModelConfig, UnsupportedConfigError
from graphrunner.model.default import (
    EMBEDDED_CONFIGS,
    default_config,
    default_model,
    init_random_weights,
    shape_1b_config,
)
from graphrunner.model.llama import LlamaDecoder, WeightError

__all__ = [
    "EMBEDDED_CONFIGS",
    "AttnMetadata",
    "CheckpointError",
    "LlamaDecoder",
    "ModelBundle",
    "ModelConfig",
    "PagedAttention",
    "TorchPagedBackend",
    "UnsupportedConfigError",
    "WeightError",
    "build_model",
    "default_config",
    "default_model",
    "init_random_weights",
    "shape_1b_config",
]
