"""The shape of a hybrid attention + Mamba stack, read from a dense
``JambaForCausalLM`` (Mamba-1 layers, no rotary embedding) or a
``BambaForCausalLM`` (Mamba-2 layers, rotary embedding on part of each head)
``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphrunner_ref.model.config import ModelConfig, UnsupportedConfigError
from graphrunner_ref.model.mamba import config_int, is_unbounded
from graphrunner_ref.model.mamba2_mixer import Mamba2Shape
from graphrunner_ref.model.mamba_mixer import MixerShape

__all__ = ["HybridConfig"]


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """``attention`` (the attention layers' and the MLPs' shape), which layers
    are attention (the others are Mamba), the Mamba mixer's shape, and the
    rotary dims of each attention head (0: no rotary embedding)."""

    attention: ModelConfig
    mixer: MixerShape | Mamba2Shape
    attention_layers: tuple[int, ...]
    rotary_dim: int = 0

    @property
    def num_layers(self) -> int:
        return self.attention.num_layers

    @property
    def vocab_size(self) -> int:
        return self.attention.vocab_size

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.attention_layers)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> HybridConfig:
        """From a Jamba or Bamba ``config.json``; refuses MoE layers and biases."""
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(
                f"config field hidden_act={hf['hidden_act']!r}; expected 'silu'"
            )
        if hf.get("model_type") == "bamba" or "BambaForCausalLM" in (hf.get("architectures") or []):
            return _bamba(hf)
        return _jamba(hf)


def _attention(hf: dict[str, Any], eps: float, theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(
        vocab_size=config_int(hf, "vocab_size"),
        hidden_size=config_int(hf, "hidden_size"),
        intermediate_size=config_int(hf, "intermediate_size"),
        num_layers=config_int(hf, "num_hidden_layers"),
        num_heads=config_int(hf, "num_attention_heads"),
        num_kv_heads=config_int(hf, "num_key_value_heads", hf.get("num_attention_heads")),
        rms_norm_eps=eps,
        rope_theta=theta,
        max_position_embeddings=config_int(hf, "max_position_embeddings", 262144),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _check_mix(attn: tuple[int, ...], layers: int, what: str) -> tuple[int, ...]:
    if not attn or len(attn) == layers:
        raise UnsupportedConfigError(
            f"{what} over {layers} layers give {len(attn)} attention layers; expected a mix "
            f"of attention and Mamba layers"
        )
    return attn


def _jamba(hf: dict[str, Any]) -> HybridConfig:
    experts = hf.get("num_experts", 1)
    if experts != 1:
        raise UnsupportedConfigError(f"config field num_experts={experts!r}; expected 1 (dense)")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    attention = _attention(hf, eps)
    hidden, layers = attention.hidden_size, attention.num_layers
    rank = hf.get("mamba_dt_rank", "auto")
    mixer = MixerShape(
        hidden_size=hidden,
        intermediate_size=config_int(hf, "mamba_expand", 2) * hidden,
        state_size=config_int(hf, "mamba_d_state", 16),
        conv_kernel=config_int(hf, "mamba_d_conv", 4),
        time_step_rank=-(-hidden // 16) if rank == "auto" else config_int(hf, "mamba_dt_rank"),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        bcdt_norm_eps=eps,
    )
    period, offset = config_int(hf, "attn_layer_period", 8), hf.get("attn_layer_offset", 4)
    attn = tuple(i for i in range(layers) if i % period == offset)
    what = f"attn_layer_period={period}, attn_layer_offset={offset}"
    return HybridConfig(attention, mixer, _check_mix(attn, layers, what))


def _bamba(hf: dict[str, Any]) -> HybridConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise UnsupportedConfigError(f"config field {flag}={hf[flag]!r}; expected false")
    limit = hf.get("time_step_limit", [0.0, None])
    if not isinstance(limit, list) or limit[:1] != [0.0] or not is_unbounded(limit[1:]):
        raise UnsupportedConfigError(
            f"config field time_step_limit={limit!r}; expected [0.0, Infinity]"
        )
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedConfigError(
            f"config field rope_parameters={rope!r}; expected default rope"
        )
    eps = float(hf.get("rms_norm_eps", 1e-5))
    attention = _attention(hf, eps, float(rope.get("rope_theta", 10000.0)))
    hidden, layers = attention.hidden_size, attention.num_layers
    inner = config_int(hf, "mamba_expand", 2) * hidden
    heads = config_int(hf, "mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    mixer = Mamba2Shape(
        hidden_size=hidden,
        intermediate_size=inner,
        state_size=config_int(hf, "mamba_d_state", 256),
        conv_kernel=config_int(hf, "mamba_d_conv", 4),
        num_heads=heads,
        head_dim=inner // heads if head_dim == "auto" else config_int(hf, "mamba_d_head"),
        n_groups=config_int(hf, "mamba_n_groups", 1),
        norm_eps=eps,
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
    )
    indices = hf.get("attn_layer_indices") or []
    attn = tuple(i for i in range(layers) if i in indices)
    # transformers fixes Bamba's partial_rotary_factor at 0.5.
    factor = float(rope.get("partial_rotary_factor", 0.5))
    rotary = int(attention.head_dim * factor)
    return HybridConfig(
        attention, mixer, _check_mix(attn, layers, f"attn_layer_indices={indices}"), rotary
    )
