"""Compact weights for a loaded Llama model: ``--quantize int8`` / ``fp16`` / ``int4``.

:func:`quantize_model` replaces every projection of the decoder (each
layer's stacked query/key/value, output, gate, up and down projections) and
the LM head with a linear over compact weights: int8 per output channel
(:mod:`graphrunner_ref.model.int8_linear`), float16 with float32 activations
(:mod:`graphrunner_ref.model.fp16_linear`) or 4-bit groups of 32 input
columns with float32 activations (:mod:`graphrunner_ref.model.int4_linear`).
With int4 the LM head takes float16 weights: 4-bit logits leave the float
model's answers within a few tokens. It runs after the weights are loaded,
whatever their source: a float
checkpoint, or a GGUF file (whose Q8_0 / Q4 blocks the import dequantized to
floats: they are requantized here, per output channel for int8 and per
group of 32 for int4, so the compact weights are not the file's blocks). The
token embedding stays in the model's dtype (a lookup reads one row), and so
does the float LM head weight that draft heads share. After quantization the
model cannot load weights again.

CPU only: on CUDA the model's own half-precision dtypes and the Triton
path are the fast ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from graphrunner_ref.model.fp16_linear import Fp16WeightLinear
from graphrunner_ref.model.int4_linear import Int4Linear
from graphrunner_ref.model.int8_linear import Int8Linear
from graphrunner_ref.model.layers import SwiGLUMLP

__all__ = ["QUANTIZATIONS", "check_quantization", "quantize_model"]

#: ``--quantize`` names and what each runs.
QUANTIZATIONS = {
    "int8": "int8 weights per output channel, activations in the model's dtype "
    "(torch._weight_int8pack_mm: fast with AVX-512 or AMX)",
    "fp16": "float16 weights, float32 activations and accumulation "
    "(fbgemm: half the weight bytes, fast on AVX2)",
    "int4": "4-bit weights in groups of 32 input columns with a float32 scale and min "
    "(like GGUF Q4_1: about 1/5 of float32's bytes), float32 activations and accumulation "
    "(a C++ AVX2 kernel built on first use: ~4.5x float32 at batch 1 where weights stream "
    "from memory, about even in cache, slower than fp16 at batch 8; without a compiler, "
    "dequantize-then-matmul, far slower than float32)",
}


def check_quantization(mode: str, dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise ValueError naming what is wrong with quantizing a ``dtype`` model
    on ``device`` with ``mode``."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantize={mode!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantize={mode!r} runs on the CPU; the model is on {device}")
    if mode == "fp16" and dtype != torch.float32:
        raise ValueError(
            f"quantize='fp16' runs float32 activations over float16 weights; the model's "
            f"dtype is {dtype} (use quantize='int8' for a half-precision model)"
        )
    if mode == "int4" and dtype != torch.float32:
        raise ValueError(
            f"quantize='int4' runs float32 activations over 4-bit weights; the model's "
            f"dtype is {dtype}, expected torch.float32 (use quantize='int8' for a "
            "half-precision model)"
        )


def _factory(mode: str, dtype: torch.dtype) -> Callable[[torch.Tensor], nn.Module]:
    if mode == "int8":
        return lambda w: Int8Linear(w, dtype)
    if mode == "int4":
        return Int4Linear
    return Fp16WeightLinear


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Quantize ``model`` (a :class:`~graphrunner_ref.model.llama.LlamaDecoder`,
    weights loaded) in place with ``mode`` (a :data:`QUANTIZATIONS` name);
    returns it. Raises ValueError for another model, one already quantized,
    an unknown mode, a CUDA model or ``fp16`` / ``int4`` on a half-precision
    model."""
    from graphrunner_ref.model.attention import PagedAttention
    from graphrunner_ref.model.llama import LlamaDecoder

    if not isinstance(model, LlamaDecoder):
        raise ValueError(
            f"quantize={mode!r}: supported for Llama models; this model is {type(model).__name__}"
        )
    if model.quantization is not None:
        raise ValueError(
            f"quantize={mode!r}: the model is already quantized ({model.quantization!r}); "
            "load it again to quantize it another way"
        )
    dtype = model.model.norm.weight.dtype
    check_quantization(mode, dtype, model.model.norm.weight.device)
    config = model.config
    if config.attention_bias or config.mlp_bias:
        raise ValueError(
            f"quantize={mode!r}: the compact linears take no biases; this model has "
            f"attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias} "
            "(expected a bias-free Llama)"
        )
    make = _factory(mode, dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            cast(PagedAttention, layer.self_attn).quantize(make)
            cast(SwiGLUMLP, layer.mlp).quantize(make)
        # 4-bit logits drift from the float model's within a few tokens (the
        # head is often a tied embedding kept at 8 bits by GGUF files): the
        # LM head of int4 keeps float16 weights, half float32's bytes.
        head = Fp16WeightLinear if mode == "int4" else make
        model.head_proj = head(model.lm_head_weight)
    model.quantization = mode
    return model
