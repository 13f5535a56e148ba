"""The transformers kind: any transformers ``*ForCausalLM`` decoder run by
its own modules over graphrunner's attention and pools
(:mod:`graphrunner_ref.bridge`): what ``--model-impl transformers`` asks for,
and what ``auto`` falls back to where the native model does not run a
checkpoint."""

from __future__ import annotations

from pathlib import Path

from graphrunner_ref.bridge import TransformersBundle, load_transformers
from graphrunner_ref.bridge.quantize import quantize_linears
from graphrunner_ref.bridge.shape import checkpoint_shape
from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.engine.kinds.llama import note_quantization, pooled_step
from graphrunner_ref.engine.registry import DecodeStep, ModelKind
from graphrunner_ref.model import ModelConfig

__all__ = ["KIND", "bridge_config"]


def _recognises(config: EngineConfig) -> bool:
    return config.checkpoint is not None and config.model_impl != "native"


def _check(config: EngineConfig) -> None:
    """The native model's options are refused by name."""
    # Each flag's default, and the value that means the same here.
    for flag, value, default, same in (
        ("--attention", config.attention, "auto", "auto"),
        ("--tp", config.tp, None, 1),
        ("--kv-dtype", config.kv_dtype, None, config.dtype),
    ):
        if value not in (default, same):
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
    (vocabulary, context, the sizes a memory estimate counts), through
    transformers' config object (:func:`~graphrunner_ref.bridge.shape.checkpoint_shape`)."""
    try:
        return checkpoint_shape(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _shape(config: EngineConfig) -> ModelConfig:
    return bridge_config(config.checkpoint or Path())


def _load(config: EngineConfig, max_requests: int, context: int) -> TransformersBundle:
    """The checkpoint's own modules over graphrunner's pools (their linears
    compact ones with ``quantize``)."""
    if config.prefill_bf16:
        raise UsageError(
            "--prefill-bf16: widens the native Llama's 4-bit projections; expected it "
            "without --model-impl transformers"
        )
    try:
        bundle = load_transformers(
            config.checkpoint or Path(),
            max_requests=max_requests,
            max_context_len=context,
            device=config.device,
            dtype=config.torch_dtype,
            page_size=config.page_size,
        )
    except ValueError as e:  # the bridge's one-line refusal of the checkpoint
        raise UsageError(str(e)) from None
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
