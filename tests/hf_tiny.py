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


#: Integer fields of a config shrunk for the whole-mapping sweep, by a word of
#: their name (the first that matches), to at most this value: experts to 4 of
#: top 2, every width and count to :data:`SWEPT_DECODER`'s scale.
_SHRINK: tuple[tuple[str, int], ...] = (
    ("per_tok", 2),
    ("topk_group", 1),
    ("n_group", 1),
    ("topk", 2),
    ("top_k", 2),
    ("moe_k", 2),
    ("shared_expert", 32),
    ("n_shared", 1),
    ("expert_ffn", 32),
    ("moe_intermediate", 32),
    ("expert", 4),
    ("lora_rank", 16),
    ("rope_head_dim", 8),
    ("nope_head_dim", 8),
    ("head_dim", 16),
    ("kv_heads", 2),
    ("key_value_heads", 2),
    ("heads", 4),
    ("layers", 2),
    ("n_layer", 2),
    ("intermediate", 128),
    ("ffn", 128),
    ("hidden", 64),
    ("d_model", 64),
    ("embed_dim", 64),
    ("n_embd", 64),
    ("state_size", 16),
    ("vocab", 128),
    ("max_position", 64),
    ("max_length", 64),
)


def _shrunk_fields(cls: Any) -> dict[str, Any]:
    """Keyword arguments shrinking config class ``cls``: its integer fields
    named as in :data:`_SHRINK`, sub-configs (``cls.sub_configs``) as dicts
    shrunk the same way."""
    try:
        defaults = cls().to_dict()
    except Exception:  # a class that needs arguments: shrink by the common names only
        return {}
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        low = key.lower()
        for word, size in _SHRINK:
            if word in low:
                if value > size:
                    out[key] = size
                break
    for key, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            out[key] = {**SWEPT_DECODER, **_shrunk_fields(sub)}
    return out


def swept_config(model_type: str, **extra: Any) -> Any:
    """transformers' config of ``model_type`` (any in its causal-LM mapping)
    shrunk for the sweep: :data:`SWEPT_DECODER`'s common names, as a
    decoder (``is_decoder``), over every integer field and sub-config named
    as in :data:`_SHRINK` (``extra`` over all). Falls back to
    :func:`tiny_config` where the class refuses the shrunk fields."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = {**_shrunk_fields(cls), **SWEPT_DECODER, "is_decoder": True}
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: RoPE's share is head_dim
        fields["head_dim"] = fields["qk_rope_head_dim"]
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields.update(extra)
    for drop in ((), ("head_dim",)):
        kwargs = {k: v for k, v in fields.items() if k not in drop}
        try:
            return cls(**kwargs)
        except Exception:  # noqa: S112 - the next, smaller set of fields
            continue
    return tiny_config(model_type, is_decoder=True, **extra)
