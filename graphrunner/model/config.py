"""Model configuration: the Llama-style decoder the reference executor runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# Hugging Face fields whose only honoured value is the one given here: any other
# value changes the maths, and running it anyway would give wrong tokens silently.
_REQUIRED_VALUES: dict[str, object] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing file, bad config, mismatched tensors."""


class UnsupportedConfigError(CheckpointError):
    """A checkpoint config asks for something this executor cannot honour."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-style decoder (no biases, SwiGLU, RoPE, RMSNorm).

    ``head_dim`` defaults to ``hidden_size // num_heads``; ``num_heads`` must be a
    multiple of ``num_kv_heads`` (grouped-query attention).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = derive from hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r}: expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim}: expected an even int >= 2 "
                "(rotary embedding rotates pairs)"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps}: expected > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta={self.rope_theta}: expected > 0")

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises :class:`UnsupportedConfigError` naming the architecture or field
        when the checkpoint needs maths this executor does not implement.
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "llama")
        unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if model_type != "llama" or not archs or unknown:
            raise UnsupportedConfigError(
                f"unsupported architecture {archs or None!r} (model_type={model_type!r}); "
                f"expected one of {SUPPORTED_ARCHITECTURES}"
            )
        for name, wanted in _REQUIRED_VALUES.items():
            if hf.get(name, wanted) != wanted:
                raise UnsupportedConfigError(
                    f"config field {name}={hf[name]!r} is not supported; expected {wanted!r}"
                )
        if hf.get("pretraining_tp", 1) != 1:
            raise UnsupportedConfigError(
                f"config field pretraining_tp={hf['pretraining_tp']!r} is not supported; expected 1"
            )
        rope_theta = _rope_theta(hf)
        try:
            kwargs: dict[str, Any] = {
                "vocab_size": hf["vocab_size"],
                "hidden_size": hf["hidden_size"],
                "intermediate_size": hf["intermediate_size"],
                "num_layers": hf["num_hidden_layers"],
                "num_heads": hf["num_attention_heads"],
            }
        except KeyError as e:
            msg = f"config is missing required field {e.args[0]!r}"
            raise UnsupportedConfigError(msg) from None
        kwargs["num_kv_heads"] = hf.get("num_key_value_heads") or kwargs["num_heads"]
        kwargs["head_dim"] = hf.get("head_dim") or 0
        kwargs["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
        kwargs["rope_theta"] = rope_theta
        kwargs["max_position_embeddings"] = hf.get("max_position_embeddings", 2048)
        kwargs["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` transformers would write for this model (round-trips)."""
        return {
            "architectures": list(SUPPORTED_ARCHITECTURES),
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }


def _rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 nests RoPE settings in ``rope_parameters``; 4.x had ``rope_theta``."""
    params = hf.get("rope_parameters")
    if params is None:
        return float(hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedConfigError(
            f"config field rope_parameters.rope_type={rope_type!r} is not supported; "
            "expected 'default' (no RoPE scaling)"
        )
    extra = sorted(set(params) - {"rope_type", "rope_theta"})
    if extra:
        raise UnsupportedConfigError(
            f"config field rope_parameters has unsupported keys {extra}; "
            "expected only rope_type and rope_theta"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
