"""The reference model executor: a Llama-style decoder over paged KV pools.

Used by the demo, the oracle tests and the benchmarks; it loads Hugging
Face-layout checkpoints (``config.json`` + safetensors).
"""

from __future__ import annotations

from graphrunner.model.attention import AttnMetadata, PagedAttention, TorchPagedBackend
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
from graphrunner.model.loader import load_model, read_config, read_weights, save_checkpoint

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
    "load_model",
    "read_config",
    "read_weights",
    "save_checkpoint",
    "shape_1b_config",
]
