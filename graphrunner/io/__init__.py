"""Files in: checkpoints (safetensors, Hugging Face layout), GGUF import,
tokenizers and chat templates."""

from __future__ import annotations

from graphrunner.io.checkpoint import load_model, read_config, read_weights, save_checkpoint

__all__ = ["load_model", "read_config", "read_weights", "save_checkpoint"]
