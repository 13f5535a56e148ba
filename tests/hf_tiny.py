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


def mixed_trace() -> list[Any]:
    """Three requests of different lengths arriving over three steps: sizes
    1, 2 and 4 of a capture list ``[1, 2, 4]`` all run, the last padded."""
    from graphrunner_ref import Request

    return [
        Request(0, (3, 17, 5, 9, 22, 7), 6),
        Request(1, (11, 2), 5, arrival_step=1),
        Request(2, (40, 41, 42, 43), 4, arrival_step=2),
    ]


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


def save_decoders(
    root: Any, configs: dict[str, Any], *, random_biases: bool = False
) -> dict[str, tuple[Path, Any]]:
    """Each transformers config saved once as a seeded random model (eager
    attention) under a new directory of ``root`` (a pytest
    ``TempPathFactory``): its directory and the model, by name.
    ``random_biases``: biases drawn from N(0, 0.1) (transformers starts them at 0)."""
    import copy

    import torch
    import transformers

    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="eager"
        ).eval()
        if random_biases:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    torch.nn.init.normal_(module.bias, std=0.1)
        path = root.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


#: The shape of the swept decoders, in the names transformers' config classes
#: map onto their own fields (``n_head``, ``n_embd``, ...).
SWEPT_DECODER: dict[str, Any] = dict(
    TINY_DECODER,
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    pad_token_id=0,
)


def tiny_config(model_type: str, **extra: Any) -> Any:
    """transformers' config of ``model_type`` shrunk to :data:`SWEPT_DECODER`
    (``extra`` over it); ``head_dim`` left to the class where it derives it."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = {**SWEPT_DECODER, **extra}
    try:
        return cls(**kwargs)
    except (AttributeError, TypeError, ValueError):  # head_dim is a read-only property
        kwargs.pop("head_dim")
        return cls(**kwargs)
