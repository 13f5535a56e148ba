"""Files in: checkpoints (safetensors, Hugging Face layout), GGUF import,
tokenizers and chat templates. :func:`load_any` is the one checkpoint
dispatcher (Llama, Mamba / hybrid, GGUF) the CLI and the library share;
:func:`resolve_checkpoint` the one GGUF entry point."""

from __future__ import annotations

from graphrunner_ref.io.checkpoint import (
    load_any,
    load_any_model,
    load_model,
    read_any_config,
    read_config,
    read_weights,
    resolve_checkpoint,
    save_checkpoint,
    state_space_kind,
)

__all__ = [
    "load_any",
    "load_any_model",
    "load_model",
    "read_any_config",
    "read_config",
    "read_weights",
    "resolve_checkpoint",
    "save_checkpoint",
    "state_space_kind",
]
