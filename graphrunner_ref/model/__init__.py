"""The reference model executor: a Llama-style decoder over paged KV pools.

Used by the demo, the oracle tests and the benchmarks; checkpoints load
through :mod:`graphrunner_ref.io`.
"""

from __future__ import annotations

from graphrunner_ref.model.attention import PagedAttention
from graphrunner_ref.model.attention_backend import TorchPagedBackend
from graphrunner_ref.model.attention_meta import AttnMetadata
from graphrunner_ref.model.build import ModelBundle, build_model
from graphrunner_ref.model.config import (
    CheckpointError,
    ModelConfig,
    UnsupportedConfigError,
    UnsupportedModelError,
)
from graphrunner_ref.model.default import (
    EMBEDDED_CONFIGS,
    default_config,
    default_model,
    init_random_weights,
    shape_1b_config,
)
from graphrunner_ref.model.llama import LlamaDecoder, WeightError

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
    "UnsupportedModelError",
    "WeightError",
    "build_model",
    "default_config",
    "default_model",
    "init_random_weights",
    "shape_1b_config",
]
