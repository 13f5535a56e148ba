"""The tiny random ``transformers.LlamaForCausalLM`` that the oracle and the
loader tests save with ``save_pretrained`` and load through graphrunner."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_tiny_llama(path: Path, *, tie: bool = False, seed: int = 0) -> Any:
    """Save a seeded 2-layer Llama (hidden 64, 4/2 heads, vocab 256) to ``path``
    and return it in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    # initializer_range 0.1 (not 0.02) spreads the logits, keeping greedy
    # choices clear of float-rounding ties.
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model
