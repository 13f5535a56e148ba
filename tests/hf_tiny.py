"""The tiny random ``transformers.LlamaForCausalLM`` that the oracle and the
loader tests save with ``save_pretrained`` and load through graphrunner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The shape of the tiny random decoders of other architectures (transformers
#: config keyword arguments; initializer_range 0.1 keeps greedy choices clear of ties).
TINY_DECODER: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)


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


def hf_greedy(model: Any, requests: Any) -> dict[int, list[int]]:
    """transformers' greedy new tokens of each request alone (``rid``,
    ``prompt``, ``max_new_tokens``), every request run to its budget."""
    import torch

    model.generation_config.eos_token_id = None
    tokens = {}
    for req in requests:
        ids = torch.tensor([req.prompt])
        with torch.no_grad():  # an explicit mask: token 0 in a prompt is not padding
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=req.max_new_tokens,
                pad_token_id=0,
            )
        tokens[req.rid] = out[0, len(req.prompt) :].tolist()
    return tokens
