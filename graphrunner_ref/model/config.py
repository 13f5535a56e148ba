"""Model configuration: the Llama-style decoder the reference executor runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# Hugging Face fields whose only honoured value is the one given here: any other
# value changes the maths, and running it anyway would give wrong tokens silently.
_REQUIRED_VALUES: dict[str, object] = {
    "hidden_act": "silu",
    "pretraining_tp": 1,
}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing file, bad config, mismatched tensors."""


class UnsupportedConfigError(CheckpointError):
    """A checkpoint config asks for something this executor cannot honour."""


class UnsupportedModelError(UnsupportedConfigError):
    """A valid config of a model the native executor does not implement (another
    architecture, or maths it lacks: RoPE scaling, biases, partial rotary);
    transformers' own modules run it through the bridge."""


@dataclass(frozen=True, slots=True)
class Llama3Rope:
    """Llama 3.1's RoPE scaling (``rope_type: llama3``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, those shorter than ``... / high_freq_factor`` kept, the band
    between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not _is_positive_number(getattr(self, name)):
                raise ValueError(f"Llama3Rope.{name}={getattr(self, name)!r}: expected > 0")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"Llama3Rope.high_freq_factor={self.high_freq_factor!r}: expected more than "
                f"low_freq_factor={self.low_freq_factor!r}"
            )
        if not _is_positive_int(self.original_max_position_embeddings):
            raise ValueError(
                "Llama3Rope.original_max_position_embeddings="
                f"{self.original_max_position_embeddings!r}: expected a positive int"
            )

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """``inv_freq [D / 2]`` (float32) as Llama 3.1 scales it."""
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        long = wavelen > context / self.low_freq_factor
        short = wavelen < context / self.high_freq_factor
        scaled = torch.where(long, inv_freq / self.factor, inv_freq)
        ramp = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - ramp) * scaled / self.factor + ramp * scaled
        return torch.where(~long & ~short, blended, scaled)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-style decoder (SwiGLU, RoPE, RMSNorm;
    biases on the q/k/v/o projections with ``attention_bias``, on the MLP's with
    ``mlp_bias``).

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
    rope_scaling: Llama3Rope | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

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
            if not _is_positive_int(value):
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
        head_dim = self.head_dim
        if not _is_positive_int(head_dim) or head_dim < 2 or head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={head_dim!r}: expected an even int >= 2 "
                "(rotary embedding rotates pairs)"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_positive_number(value):
                raise ValueError(f"ModelConfig.{name}={value!r}: expected a finite number > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3Rope):
            raise ValueError(
                f"ModelConfig.rope_scaling={self.rope_scaling!r}: expected a Llama3Rope or None"
            )
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: expected a bool")

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises :class:`UnsupportedConfigError` naming the architecture or field
        when the checkpoint needs maths this executor does not implement, or
        naming the field and value when a field is missing or not a valid value
        (``head_dim`` 16.0, ``rms_norm_eps`` null).
        """
        _check_architecture(hf)
        for name, wanted in _REQUIRED_VALUES.items():
            if hf.get(name, wanted) != wanted:
                raise UnsupportedModelError(
                    f"config field {name}={hf[name]!r} is not supported; expected {wanted!r}"
                )
        if hf.get("partial_rotary_factor") not in (None, 1.0):
            raise UnsupportedModelError(
                f"config field partial_rotary_factor={hf['partial_rotary_factor']!r} is not "
                "supported; expected 1.0"
            )
        rope_theta, rope_scaling = _rope(hf)
        kwargs: dict[str, Any] = {"rope_scaling": rope_scaling}
        for ours, theirs in (
            ("vocab_size", "vocab_size"),
            ("hidden_size", "hidden_size"),
            ("intermediate_size", "intermediate_size"),
            ("num_layers", "num_hidden_layers"),
            ("num_heads", "num_attention_heads"),
        ):
            if theirs not in hf:
                raise UnsupportedConfigError(f"config is missing required field {theirs!r}")
            kwargs[ours] = _positive_int(theirs, hf[theirs])
        # transformers derives both from the other fields when they are null or absent.
        num_kv_heads = hf.get("num_key_value_heads")
        kwargs["num_kv_heads"] = (
            kwargs["num_heads"]
            if num_kv_heads is None
            else _positive_int("num_key_value_heads", num_kv_heads)
        )
        head_dim = hf.get("head_dim")
        kwargs["head_dim"] = 0 if head_dim is None else _positive_int("head_dim", head_dim)
        kwargs["rms_norm_eps"] = _positive_float("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))
        kwargs["rope_theta"] = rope_theta
        kwargs["max_position_embeddings"] = _positive_int(
            "max_position_embeddings", hf.get("max_position_embeddings", 2048)
        )
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            value = hf.get(name, False)
            if not isinstance(value, bool):
                raise UnsupportedConfigError(
                    f"config field {name}={value!r}: expected true or false"
                )
            kwargs[name] = value
        try:
            return cls(**kwargs)
        except ValueError as e:  # a combination of valid fields, e.g. heads vs KV heads
            raise UnsupportedConfigError(str(e)) from None

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
            "rope_parameters": {
                **({"rope_type": "default"} if self.rope_scaling is None else {}),
                **(self.rope_scaling.to_hf_dict() if self.rope_scaling is not None else {}),
                "rope_theta": self.rope_theta,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
        }


def _check_architecture(hf: dict[str, Any]) -> None:
    """Llama by ``architectures`` or, when that is null or absent (transformers then
    goes by ``model_type``), by ``model_type``; nothing else."""
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    if archs is None:
        archs = []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UnsupportedConfigError(
            f"config field architectures={archs!r}: expected a list of class names"
        )
    unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    named = bool(archs) or model_type is not None
    if unknown or not named or model_type not in (None, "llama"):
        raise UnsupportedModelError(
            f"unsupported architecture {archs or None!r} (model_type={model_type!r}); "
            f"expected one of {SUPPORTED_ARCHITECTURES} or model_type 'llama' for the native "
            "model (any transformers decoder runs through the bridge: --model-impl transformers)"
        )


def _is_positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive_number(value: object) -> TypeGuard[int | float]:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _positive_int(name: str, value: object) -> int:
    if not _is_positive_int(value):
        raise UnsupportedConfigError(f"config field {name}={value!r}: expected a positive int")
    return value


def _positive_float(name: str, value: object) -> float:
    if not _is_positive_number(value):
        raise UnsupportedConfigError(
            f"config field {name}={value!r}: expected a positive finite number"
        )
    return float(value)


#: What a ``llama3`` RoPE object holds besides its type and base.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(hf: dict[str, Any]) -> tuple[float, Llama3Rope | None]:
    """Plain RoPE or Llama 3.1's scaling, as transformers reads them: the
    parameters are ``rope_scaling`` when set (the 4.x name), else
    ``rope_parameters`` (5.x); the type is their ``rope_type`` (or 4.x
    ``type``), default ``default``; the base is their ``rope_theta``, else the
    top-level ``rope_theta``, else 10000. Other types run through the bridge."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise UnsupportedConfigError(
            f"config field {field}={params!r} is not supported; expected an object"
        )
    key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(key, "default")
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModelError(
            f"config field {field}.{key}={rope_type!r} is not supported by the native model; "
            "expected 'default' or 'llama3' (--model-impl transformers runs the others)"
        )
    known = {"rope_type", "type", "rope_theta", *(_LLAMA3_KEYS if rope_type == "llama3" else ())}
    extra = sorted(set(params) - known)
    if extra:
        raise UnsupportedModelError(
            f"config field {field} has unsupported keys {extra}; expected only "
            f"{sorted(known - {'type'})}"
        )
    if "rope_theta" in params:
        theta = _positive_float(f"{field}.rope_theta", params["rope_theta"])
    else:
        theta = _positive_float("rope_theta", hf.get("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise UnsupportedConfigError(f"config field {field} (llama3) is missing {missing}")
    try:
        return theta, Llama3Rope(**{k: params[k] for k in _LLAMA3_KEYS})
    except ValueError as e:
        raise UnsupportedConfigError(f"config field {field}: {e}") from None
