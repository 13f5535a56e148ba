"""Tiny random ``transformers`` Mamba and Jamba models that the oracle tests
save with ``save_pretrained`` and load through graphrunner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _spread(model: Any) -> Any:
    """Widen the random weights (std 0.1, not 0.02) so greedy choices stay
    clear of float-rounding ties; A_log, D and dt_proj keep transformers' init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "embeddings.weight", "embed_tokens.weight")):
                p.normal_(0.0, 0.1 if "embed" in name else 0.4)
    return model.eval()


def _save(path: Path, model_class: str, config_class: str, seed: int, **config: Any) -> Any:
    """Build ``transformers.<model_class>(<config_class>(**config))`` from
    ``seed``, widen its weights and save it to ``path``."""
    import transformers

    torch.manual_seed(seed)
    model_config = getattr(transformers, config_class)(**config)
    model = _spread(getattr(transformers, model_class)(model_config))
    model.save_pretrained(path)
    return model


def save_tiny_mamba(path: Path, *, seed: int = 0) -> Any:
    """Save a seeded 2-layer Mamba-1 LM (hidden 32, state 8, conv 4, vocab 256)."""
    return _save(
        path,
        "MambaForCausalLM",
        "MambaConfig",
        seed,
        vocab_size=256,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        expand=2,
        time_step_rank=4,
    )


def save_tiny_jamba(path: Path, *, seed: int = 0) -> Any:
    """Save a seeded 4-layer Jamba (Mamba, attention, Mamba, attention; dense
    MLPs; hidden 32, 4/2 heads, vocab 256)."""
    return _save(
        path,
        "JambaForCausalLM",
        "JambaConfig",
        seed,
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        max_position_embeddings=256,
    )


def save_tiny_mamba2(path: Path, *, seed: int = 0) -> Any:
    """Save a seeded 2-layer Mamba-2 LM (hidden 32, 8 heads of 8, 2 groups,
    state 8, conv 4, vocab 256)."""
    return _save(
        path,
        "Mamba2ForCausalLM",
        "Mamba2Config",
        seed,
        vocab_size=256,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        expand=2,
        num_heads=8,
        head_dim=8,
        n_groups=2,
    )


def save_tiny_bamba(path: Path, *, seed: int = 0) -> Any:
    """Save a seeded 4-layer Bamba (Mamba-2, attention, Mamba-2, attention;
    hidden 32, 4/2 heads with rotary on half of each, 8 Mamba heads in 2
    groups, vocab 256)."""
    return _save(
        path,
        "BambaForCausalLM",
        "BambaConfig",
        seed,
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=256,
    )


def groups_the_gated_norm(model: Any) -> bool:
    """Whether ``model`` (a transformers Mamba-2 or Bamba) normalises a Mamba-2
    layer's gated RMSNorm per group of channels (``n_groups`` groups), as the
    Mamba-2 paper's kernels do and graphrunner's mixer does. Older releases
    (5.17, for one) normalise over all channels at once, so their tokens differ
    from any grouped implementation once ``n_groups > 1``. The norm's class is
    found through the model, never by its module-private name."""
    import inspect

    layers = model.backbone.layers if hasattr(model, "backbone") else model.model.layers
    mixer = next(
        getattr(layer, n) for layer in layers for n in ("mixer", "mamba") if hasattr(layer, n)
    )
    return "group_size" in inspect.signature(type(mixer.norm).__init__).parameters
