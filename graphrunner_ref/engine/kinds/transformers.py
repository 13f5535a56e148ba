"""The transformers kind: any transformers ``*ForCausalLM`` decoder run by
its own modules over graphrunner's attention and pools
(:mod:`graphrunner_ref.bridge`): what ``--model-impl transformers`` asks for,
and what ``auto`` falls back to where the native model does not run a
checkpoint."""

from __future__ import annotations

from pathlib import Path

from graphrunner_ref.bridge import TransformersBundle, load_transformers
from graphrunner_ref.bridge.quantize import quantize_linears
from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.engine.kinds.llama import note_quantization, pooled_step
from graphrunner_ref.engine.registry import DecodeStep, ModelKind
from graphrunner_ref.io.safetensors_files import read_json
from graphrunner_ref.model import ModelConfig

__all__ = ["KIND", "bridge_config"]


def _recognises(config: EngineConfig) -> bool:
    return config.checkpoint is not None and config.model_impl != "native"


def _check(config: EngineConfig) -> None:
    """The native model's options are refused by name."""
    for flag, value, default in (
        ("--attention", config.attention, "auto"),
        ("--tp", config.tp, None),
    ):
        if value != default and not (flag == "--tp" and value == 1):
            raise UsageError(
                f"{flag} {value}: the native model's option; --model-impl transformers runs "
                "the checkpoint's own modules (leave it out)"
            )
    if config.speculative:
        raise UsageError(
            "--speculative: the draft heads are the native model's; expected --model-impl "
            "native (or a checkpoint the native model runs)"
        )


def bridge_config(path: Path) -> ModelConfig:
    """The shape of a transformers checkpoint as the checks read it
    (vocabulary, context, the sizes a memory estimate counts)."""
    hf = read_json(path / "config.json")
    text = hf.get("text_config") or hf
    try:
        heads = int(text["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size") or 4 * text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or 0),
            max_position_embeddings=int(text.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(
            f"{path}: config.json is not a decoder's ({e}); the transformers bridge needs "
            "vocab_size, hidden_size, num_hidden_layers and num_attention_heads"
        ) from None


def _shape(config: EngineConfig) -> ModelConfig:
    return bridge_config(config.checkpoint or Path())


def _load(config: EngineConfig, max_requests: int, context: int) -> TransformersBundle:
    """The checkpoint's own modules over graphrunner's pools (their linears
    compact ones with ``quantize``)."""
    bundle = load_transformers(
        config.checkpoint or Path(),
        max_requests=max_requests,
        max_context_len=context,
        device=config.device,
        dtype=config.torch_dtype,
        page_size=config.page_size,
    )
    if config.quantize is not None:
        try:
            count = quantize_linears(bundle.model.hf, config.quantize)
        except ValueError as e:
            raise UsageError(f"--quantize {config.quantize}: {e}") from None
        note_quantization(config, f"{count} nn.Linear modules replaced")
    return bundle


def _step(bundle: TransformersBundle) -> DecodeStep:
    return pooled_step(bundle, fullgraph=True)


KIND = ModelKind(
    name="transformers",
    bundle_type=TransformersBundle,
    recognises=_recognises,
    shape=_shape,
    load=_load,
    step=_step,
    check=_check,
    impl="transformers",
)
