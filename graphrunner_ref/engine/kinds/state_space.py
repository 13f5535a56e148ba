"""The Mamba / hybrid kind: a Mamba-1, Mamba-2, Jamba or Bamba checkpoint
(:func:`graphrunner_ref.io.state_space_kind`), served natively over a hybrid
request pool whose Mamba state each decode row reads by its slot."""

from __future__ import annotations

from pathlib import Path

from graphrunner import GraphBackend
from graphrunner.declare import NullBackend
from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.engine.mamba_step import MambaSanitizer, state_space_inputs
from graphrunner_ref.engine.registry import DecodeStep, ModelKind
from graphrunner_ref.io.checkpoint import load_any, read_any_config, state_space_kind
from graphrunner_ref.io.mamba_checkpoint import DEFAULT_CONTEXT, StateSpaceBundle
from graphrunner_ref.model.config import CheckpointError, ModelConfig
from graphrunner_ref.model.hybrid import HybridLM
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.mamba import MambaConfig

__all__ = ["KIND", "is_state_space_checkpoint"]

#: What a run of this kind does not do, by option.
_REFUSED = ("check", "speculative", "overlap", "quantize", "prefill_bf16")


def is_state_space_checkpoint(path: Path | str | None) -> bool:
    """Whether ``path`` is a checkpoint directory of a Mamba or Jamba model
    (an unreadable ``config.json`` is left to the Llama kind to word)."""
    if path is None:
        return False
    try:
        return state_space_kind(path) is not None
    except CheckpointError:
        return False


def _recognises(config: EngineConfig) -> bool:
    return is_state_space_checkpoint(config.checkpoint)


def _check(config: EngineConfig) -> None:
    if config.model_impl == "transformers":
        raise UsageError(
            f"--model-impl transformers: {config.checkpoint} holds a model with Mamba layers, "
            "which runs natively (--model-impl native or auto)"
        )
    if config.sharded:
        raise UsageError(
            f"--tp {config.tp}: {config.source} is a Mamba/Jamba model, not sharded; "
            "expected --tp 1"
        )
    if config.steps_per_launch > 1:
        raise UsageError(
            f"--steps-per-launch {config.steps_per_launch}: not supported for a Mamba or "
            "Jamba checkpoint; expected 1"
        )
    for flag in _REFUSED:
        if getattr(config, flag):
            name = flag.replace("_", "-")
            raise UsageError(f"--{name} is not supported for a Mamba or Jamba checkpoint")
    if config.kv_dtype not in (None, config.dtype):
        raise UsageError(
            f"--kv-dtype {config.kv_dtype}: a Mamba or Jamba model's KV cache is in its "
            f"--dtype ({config.dtype}); leave it out"
        )


def _shape(config: EngineConfig) -> ModelConfig:
    """The fields the checks read (vocabulary, context) as a ModelConfig."""
    try:
        shape = read_any_config(config.checkpoint or "")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if isinstance(shape, ModelConfig):
        return shape
    if isinstance(shape, HybridConfig):
        return shape.attention
    return _as_model_config(shape)


def _as_model_config(shape: MambaConfig) -> ModelConfig:
    return ModelConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.mixer.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=1,
        num_kv_heads=1,
        max_position_embeddings=DEFAULT_CONTEXT,
    )


def _load(config: EngineConfig, max_requests: int, context: int) -> StateSpaceBundle:
    try:
        bundle = load_any(
            config.checkpoint or "",
            max_requests=max_requests,
            max_context_len=context,
            device=config.device,
            dtype=config.torch_dtype,
            page_size=config.page_size,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not isinstance(bundle, StateSpaceBundle):
        raise UsageError(f"{config.source}: expected a Mamba or Jamba model")
    return bundle


def _step(bundle: StateSpaceBundle) -> DecodeStep:
    """The plain decode fields plus each row's Mamba slot; the request
    pool's recorded state ops run before each launch."""
    model = bundle.model
    backend: GraphBackend = model.attn_backend if isinstance(model, HybridLM) else NullBackend()
    return DecodeStep(
        forward=model.forward_decode,
        backend=backend,
        inputs=lambda batch: state_space_inputs(batch, bundle.req_pool),
        sanitizer=lambda: MambaSanitizer.for_pools(
            bundle.req_pool,
            bundle.kv_cache,
            kv_allocator=bundle.kv_alloc,
            mamba_pool=bundle.mamba_pool,
            vocab_size=bundle.config.vocab_size,
        ),
        state_ops=bundle.req_pool,
        mamba=True,
        rerun_reason="an eager rerun would advance each request's Mamba state twice",
    )


KIND = ModelKind(
    name="state-space",
    bundle_type=StateSpaceBundle,
    recognises=_recognises,
    shape=_shape,
    load=_load,
    step=_step,
    check=_check,
    memory_checked=False,
)
