"""The native Llama kind: the embedded random models and every Llama-family
checkpoint the reference model runs (:mod:`graphrunner_ref.model`), loaded
with the config's decode attention and compact weights (``quantize``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from graphrunner import GuardedTensor, PaddingSanitizer
from graphrunner.pools import Int8KVCache
from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.engine.registry import DecodeStep, ModelKind
from graphrunner_ref.io import load_any, read_config
from graphrunner_ref.io.gguf_int4 import read_gguf_int4
from graphrunner_ref.model import (
    EMBEDDED_CONFIGS,
    ModelBundle,
    ModelConfig,
    UnsupportedModelError,
    default_model,
)
from graphrunner_ref.model.build import check_kv_dtype
from graphrunner_ref.model.cpu_features import kernel_path
from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.int4_linear import Int4Weight
from graphrunner_ref.model.prompt_bf16 import bf16_matmul_units, slow_bf16_note, widen_prompts
from graphrunner_ref.model.quantize import INT4_MODES, quantize_model
from graphrunner_ref.model.shapes import projection_shapes

__all__ = [
    "EMBEDDED_MODELS",
    "KIND",
    "embedded_config",
    "native_refusal",
    "note_quantization",
    "pooled_step",
    "scale_guards",
    "with_attention",
    "with_quantization",
]

#: Names of the embedded random models, and their configs' names.
EMBEDDED_MODELS = {"embedded": "default", "embedded-1.1b": "1.1b"}


def embedded_config(name: str | None) -> ModelConfig:
    """The config of the embedded model ``name``."""
    return EMBEDDED_CONFIGS[EMBEDDED_MODELS[name or "embedded"]]()


def native_refusal(checkpoint: Path) -> str | None:
    """Why the native model does not run ``checkpoint`` (None: it does; a
    config it cannot read at all is the load's to report)."""
    try:
        read_config(checkpoint)
    except UnsupportedModelError as e:
        return str(e)
    except ValueError:
        return None
    return None


def _recognises(config: EngineConfig) -> bool:
    if config.checkpoint is None or config.model_impl == "native":
        return True
    return config.model_impl == "auto" and native_refusal(config.checkpoint) is None


def _check(config: EngineConfig) -> None:
    if config.checkpoint is None and config.model_impl == "transformers":
        raise UsageError(
            "--model-impl transformers: needs a checkpoint (--model DIR); the embedded "
            "models run natively"
        )
    try:
        flag = f"--kv-dtype {config.kv_dtype}"
        check_kv_dtype(config.torch_kv_dtype, config.torch_dtype, config.device, flag)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.kv_dtype == "int8" and config.speculative:
        raise UsageError(
            f"--kv-dtype int8: not supported with --speculative {config.speculative} (its "
            "draft reads the cache unquantized); expected --kv-dtype float16 or float32"
        )


def _shape(config: EngineConfig) -> ModelConfig:
    if config.checkpoint is None:
        return embedded_config(config.model)
    try:
        return read_config(config.checkpoint)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _model(config: EngineConfig, max_requests: int, context: int) -> ModelBundle:
    where: dict[str, Any] = {
        "max_requests": max_requests,
        "max_context_len": context,
        "device": config.device,
        "dtype": config.torch_dtype,
        "page_size": config.page_size,
        "tp": config.placement,
        "kv_dtype": config.torch_kv_dtype,
    }
    if config.checkpoint is None:
        embedded = None if config.model == "embedded" else embedded_config(config.model)
        return default_model(seed=config.seed, config=embedded, **where)
    try:
        bundle = load_any(config.checkpoint, **where)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not isinstance(bundle, ModelBundle):  # read_config refused it before
        raise UsageError(f"{config.source}: expected a Llama-family model")
    return bundle


def _load(config: EngineConfig, max_requests: int, context: int) -> ModelBundle:
    bundle = _model(config, max_requests, context)
    return with_quantization(config, with_attention(config, bundle))


def with_attention(config: EngineConfig, bundle: ModelBundle) -> ModelBundle:
    """``bundle`` with the decode attention ``config.attention`` names (auto: the model's own)."""
    if config.attention != "auto":
        bundle.model.attn_backend.use(config.attention)
    return bundle


def with_quantization(config: EngineConfig, bundle: ModelBundle) -> ModelBundle:
    """``bundle`` with its model quantized as ``config.quantize`` says
    (unchanged without it); int4 from a GGUF file takes the file's own Q4 codes;
    ``config.prefill_bf16`` widens the 4-bit prompt chunks to bfloat16
    (:mod:`~graphrunner_ref.model.prompt_bf16`)."""
    mode = config.quantize
    _check_prefill_bf16(config)
    if mode is None:
        return bundle
    codes = _gguf_codes(config) if mode in INT4_MODES else None
    try:
        quantize_model(bundle.model, mode, codes=codes)
    except ValueError as e:
        raise UsageError(f"--quantize {mode}: {e}") from None
    source = None
    if mode in INT4_MODES:
        shape = bundle.model.config
        total = shape.num_layers * len(projection_shapes(shape))
        source = (
            f"{len(codes)} of {total} projections keep the GGUF file's own 4-bit codes, "
            f"{total - len(codes)} quantized from floats"
            if codes is not None
            else f"{total} projections quantized from floats"
        )
    note_quantization(config, source)
    if config.prefill_bf16:
        widen_prompts(bundle.model)
        note = slow_bf16_note()
        if note is not None and not config.quiet:
            print(f"graphrunner: {note}", file=sys.stderr)
    return bundle


def _check_prefill_bf16(config: EngineConfig) -> None:
    """``--prefill-bf16`` refused by name where it cannot help: without a
    4-bit mode, or on a CPU that multiplies bfloat16 in software."""
    if not config.prefill_bf16:
        return
    if config.quantize not in INT4_MODES:
        raise UsageError(
            f"--prefill-bf16 with --quantize {config.quantize}: it widens a 4-bit mode's "
            f"prompt chunks; expected --quantize one of {', '.join(INT4_MODES)}"
        )
    if not bf16_matmul_units():
        raise UsageError(
            "--prefill-bf16: this CPU has neither AMX-BF16 nor AVX-512 BF16, so bfloat16 "
            "products are slower than the 4-bit kernels; expected a CPU with either"
        )


def _gguf_codes(config: EngineConfig) -> dict[str, Int4Weight] | None:
    """The Q4 codes of the GGUF file the checkpoint was converted from (None: no such file)."""
    return None if config.gguf_file is None else read_gguf_int4(config.gguf_file)


def note_quantization(config: EngineConfig, source: str | None = None) -> None:
    """One line on stderr (unless ``quiet``): where the quantized weights
    came from (``source``, when there is something to say) and which product
    runs on this CPU."""
    if config.quiet:
        return
    mode, why = config.quantize, kernel_status()
    if mode == "int8" and config.torch_dtype != torch.float32:
        product = "torch's weight-only int8 product (half-precision activations)"
    elif why is None:
        path = kernel_path(mode)
        if path is not None:
            kernels = f"the C++ {path.name.upper()} kernels"
        elif mode == "int4-bf16":  # no AVX-512 BF16 here
            kernels = "the torch emulation of the bfloat16 product (no C++ path on this CPU)"
        else:
            kernels = "the C++ kernels"
        product = kernels + ("" if mode == "int8" else ", a compact LM head")
    else:
        product = f"torch's and fbgemm's fallbacks ({why})"
    capability = torch.backends.cpu.get_cpu_capability()
    where = "" if source is None else f"{source}; "
    print(
        f"graphrunner: --quantize {mode}: {where}products: {product} (CPU capability {capability})",
        file=sys.stderr,
    )


def pooled_step(bundle: Any, *, fullgraph: bool = False) -> DecodeStep:
    """The decode step of a bundle whose model decodes the plain decode
    fields over the KV pool (the native Llama, a transformers decoder)."""
    return DecodeStep(
        forward=bundle.model.forward_decode,
        backend=bundle.model.attn_backend,
        inputs=None,
        sanitizer=lambda: PaddingSanitizer.for_pools(
            bundle.req_pool,
            bundle.kv_cache,
            kv_allocator=bundle.kv_alloc,
            vocab_size=bundle.config.vocab_size,
            guard=scale_guards(bundle.kv_cache),
        ),
        fullgraph=fullgraph,
    )


def scale_guards(kv_cache: object) -> list[GuardedTensor]:
    """An int8 cache's scales (:class:`~graphrunner.pools.Int8KVCache`),
    guarded as its values are: a step writes only its live rows'
    ``out_cache_loc`` slots, padded rows slot 0; none for a float cache."""
    if not isinstance(kv_cache, Int8KVCache):
        return []
    return [
        GuardedTensor(f"{side}_scale[{layer}]", scales, "out_cache_loc", sink_rows=1)
        for layer in range(kv_cache.num_layers)
        for side, scales in zip("kv", kv_cache.get_scales(layer), strict=True)
    ]


KIND = ModelKind(
    name="llama",
    bundle_type=ModelBundle,
    recognises=_recognises,
    shape=_shape,
    load=_load,
    step=pooled_step,
    check=_check,
)
