"""Compact weights for a loaded Llama model: ``--quantize`` int8, fp16, int4, int4-q8 or int4-bf16.

:func:`quantize_model` replaces every projection of the decoder (each
layer's stacked query/key/value, output, gate, up and down projections) and
the LM head with a linear over compact weights: int8 per output channel
(:mod:`graphrunner_ref.model.int8_linear`), float16 with float32 activations
(:mod:`graphrunner_ref.model.fp16_linear`) or 4-bit groups of 32 input
columns with float32 activations (:mod:`graphrunner_ref.model.int4_linear`),
or the same weights times activations quantized to 8 bits per group
(``int4-q8``, opt-in: :mod:`graphrunner_ref.model.int4_q8`; the attention's
q/k/v projection keeps wider activations there, bfloat16 on AVX-512 BF16,
else float32: :func:`qkv_linear`; the LM head too, but on the tiles path:
:func:`int4_q8_head`),
or weights and activations rounded to bfloat16 (``int4-bf16``, opt-in, for
batches of 8 and more on AVX-512 BF16: :mod:`graphrunner_ref.model.int4_bf16`).
With int4 the LM head takes int8 weights in groups of 32
(:class:`~graphrunner_ref.model.int8_linear.Int8GroupLinear`, float32
activations) where they hold its weight exactly (a GGUF file's Q8_0 head:
half float16's bytes), else float16 weights (4-bit logits leave the float
model's answers within a few tokens); with int4-q8, int8 groups always.
Quantization runs after the weights are loaded, whatever their source: a float
checkpoint, or a GGUF file (whose blocks the import dequantized to floats:
they are requantized here, per output channel for int8 and per group of 32
for int4; with the int4 modes, ``codes`` (:func:`~graphrunner_ref.io.gguf_int4.read_gguf_int4`)
puts the file's own Q4_0 / Q4_1 / Q4_K codes in place of the requantized
ones, so those projections run the file's weights exactly). The
token embedding stays in the model's dtype (a lookup reads one row), and so
does the float LM head weight that draft heads share. After quantization the
model cannot load weights again.

CPU only: on CUDA the model's own half-precision dtypes and the Triton
path are the fast ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from graphrunner_ref.model.cpu_features import kernel_path
from graphrunner_ref.model.fp16_linear import Fp16WeightLinear, head_linear
from graphrunner_ref.model.int4_bf16 import Int4Bf16Linear, Int8GroupBf16Linear
from graphrunner_ref.model.int4_linear import Int4Linear, Int4Weight
from graphrunner_ref.model.int4_q8 import TILES_PATHS, Int4Q8Linear, Int8GroupQ8Linear
from graphrunner_ref.model.int8_linear import Int8GroupLinear, Int8Linear
from graphrunner_ref.model.layers import SwiGLUMLP
from graphrunner_ref.model.shapes import projection_shapes

if TYPE_CHECKING:
    from graphrunner_ref.model.llama import LlamaDecoder

__all__ = [
    "INT4_MODES",
    "QUANTIZATIONS",
    "STACKS",
    "check_quantization",
    "compact_head",
    "compact_linear",
    "exact_or_fp16_head",
    "int4_q8_head",
    "qkv_linear",
    "quantize_model",
    "wide_int4_linear",
    "wide_int8_head",
]

#: ``--quantize`` names and what each runs.
QUANTIZATIONS = {
    "int8": "int8 weights per output channel, activations in the model's dtype "
    "(float32: a C++ AVX2 kernel built on first use, about fp16's speed at batch 1 with half "
    "its bytes; half precision: torch._weight_int8pack_mm, fast with AVX-512 or AMX)",
    "fp16": "float16 weights, float32 activations and accumulation "
    "(a C++ AVX2/F16C kernel built on first use, fbgemm where it cannot be: half the "
    "weight bytes)",
    "int4": "4-bit weights in groups of 32 input columns with a float32 scale and min "
    "(like GGUF Q4_1: about 1/5 of float32's bytes), float32 activations and accumulation "
    "(a C++ AVX2 kernel built on first use: ~4.5x float32 at batch 1 where weights stream "
    "from memory, about even in cache, slower than fp16 at batch 8; without a compiler, "
    "dequantize-then-matmul, far slower than float32)",
    "int4-q8": "int4's weights, each row's activations quantized to 8 bits per group of 32 "
    "and multiplied in integers, as llama.cpp's Q4 x Q8 (opt-in, not exact: answers may "
    "leave float32's; the attention's q/k/v projection keeps wider activations, bfloat16 "
    "where the CPU has AVX-512 BF16, else float32, which halves the logits' divergence, and "
    "so does the LM head but on AVX-512 VNNI's tiles; a C++ kernel on AVX2, AVX-VNNI or "
    "AVX-512 VNNI (tiles of 16 outputs), whichever the CPU has; rows independent of the "
    "batch bit for bit)",
    "int4-bf16": "int4's weights and each row's activations rounded to bfloat16, float32 sums "
    "(opt-in, not exact, about half int4-q8's error; for batches of 8 and more on a CPU with "
    "AVX-512 BF16, where its C++ kernel outruns int4-q8's: slower at batch 1; elsewhere a "
    "torch emulation, far slower; rows independent of the batch bit for bit)",
}

#: The modes over int4's weights: a float32 model only, a GGUF file's own Q4
#: codes taken as they are, a compact LM head of their own (:func:`compact_head`).
INT4_MODES = ("int4", "int4-q8", "int4-bf16")


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
    if mode in INT4_MODES and dtype != torch.float32:
        raise ValueError(
            f"quantize={mode!r} runs float32 activations over 4-bit weights; the model's "
            f"dtype is {dtype}, expected torch.float32 (use quantize='int8' for a "
            "half-precision model)"
        )


def compact_linear(mode: str, dtype: torch.dtype) -> Callable[[torch.Tensor], nn.Module]:
    """What makes a bias-free compact linear of ``mode`` from a float weight
    ``[out, in]`` for a ``dtype`` model (checked by :func:`check_quantization`)."""
    if mode == "int8":
        return lambda w: Int8Linear(w, dtype)
    if mode == "int4":
        return Int4Linear
    if mode == "int4-q8":
        return Int4Q8Linear
    if mode == "int4-bf16":
        return Int4Bf16Linear
    return Fp16WeightLinear


def qkv_linear(mode: str, dtype: torch.dtype) -> Callable[[torch.Tensor], nn.Module]:
    """What makes the attention's q/k/v projection of ``mode`` (stacked or
    each alone) from its float weight: :func:`compact_linear`'s, except for
    int4-q8, whose q/k/v projection keeps wider activations than 8 bits
    (:func:`wide_int4_linear`: bfloat16 where the CPU multiplies it, else
    int4's float32, the same weights).
    On SmolLM2 (8 chat prompts, 32 tokens each, teacher-forced against
    float32 transformers, ``bench/bench_agreement.py``) each projection's
    8-bit inputs were a share of the mode's logits' KL (2.75e-3) out of
    proportion to its weights': q/k/v 53% of it for 16% of a layer's weights
    (gate/up 40% for 50%, down 33% for 25%, output 9% for 9%). With q/k/v's
    inputs in float32 the KL is 1.30e-3 (llama.cpp's Q4_1 x Q8: 2.71e-3) and
    the free-running rows equal to transformers' went from 3/8 to 5/8
    (leading tokens 16.1 to 27.1; llama.cpp 3/8, 19.9), for 0-5% of the
    batch-1 speed (0.95x and 1.00x of all-8-bit in two interleaved runs,
    ``bench/results/int4-q8-qkv-float-cpu.md``); in bfloat16 (and the head's
    too) 1.37e-3 on a Zen 4, for 1.18x the batch-8 speed of float32 inputs
    (``bench/results/int4-q8-tiles-zen4-cpu.md``)."""
    if mode == "int4-q8":
        return wide_int4_linear
    return compact_linear(mode, dtype)


def bf16_units() -> bool:
    """Whether int4-bf16's kernel runs here (AVX-512 BF16, kernels built)."""
    return kernel_path("int4-bf16") is not None


def wide_int4_linear(weight: torch.Tensor) -> nn.Module:
    """int4-q8's linear of wider activations (its q/k/v projection): int4's
    weights times bfloat16 activations where the CPU multiplies them
    (:class:`~graphrunner_ref.model.int4_bf16.Int4Bf16Linear`: faster than
    float32's from a few rows up, far closer than 8 bits), else float32's
    (:class:`~graphrunner_ref.model.int4_linear.Int4Linear`)."""
    return Int4Bf16Linear(weight) if bf16_units() else Int4Linear(weight)


def int4_q8_head(weight: torch.Tensor) -> nn.Module:
    """int4-q8's LM head, int8 in groups of 32: on the tiles path (AVX-512
    VNNI) its input quantized to 8 bits as the projections' are
    (:class:`~graphrunner_ref.model.int4_q8.Int8GroupQ8Linear`: on a Zen 4
    alone 1.29-1.31 ms at 1 row against the float32 head's 1.50, and at 8 rows
    2.3-2.9 ms against the bfloat16 head's 4.3-4.7; teacher-forced KL 1.73e-3
    against 1.37e-3 with the bfloat16 head, llama.cpp's 3.38e-3), else wider
    (:func:`wide_int8_head`)."""
    path = kernel_path("int4-q8")
    if path is not None and path.code in TILES_PATHS:
        return Int8GroupQ8Linear(weight)
    return wide_int8_head(weight)


def wide_int8_head(weight: torch.Tensor) -> nn.Module:
    """An LM head of int8 groups times bfloat16 activations where the CPU
    multiplies them, else float32's (:func:`wide_int4_linear`'s rule)."""
    return Int8GroupBf16Linear(weight) if bf16_units() else Int8GroupLinear(weight)


def compact_head(mode: str, dtype: torch.dtype) -> Callable[[torch.Tensor], nn.Module]:
    """What makes the LM head of ``mode`` from its float weight ``[vocab, hidden]``:
    float16 weights for fp16; for int4, int8 in groups of 32 where they
    hold the weight exactly, else float16 (:func:`exact_or_fp16_head`);
    int8 in groups of 32 for int4-q8 (half float16's bytes: a batch-1 step
    reads the head more than any layer; :func:`int4_q8_head`) and for
    int4-bf16, multiplied there as its projections are
    (:class:`~graphrunner_ref.model.int4_bf16.Int8GroupBf16Linear`); the
    projections' own linear for int8."""
    if mode == "fp16":
        return head_linear
    if mode == "int4":
        return exact_or_fp16_head
    if mode == "int4-q8":
        return int4_q8_head
    if mode == "int4-bf16":
        return Int8GroupBf16Linear
    return compact_linear(mode, dtype)


def exact_or_fp16_head(weight: torch.Tensor) -> nn.Module:
    """The exact int4 mode's LM head over ``weight`` ``[vocab, hidden]``: int8
    in groups of 32 where that holds every weight bit for bit (a head
    dequantized from a GGUF file's Q8_0 blocks), read in half float16's
    bytes; else float16 (4-bit logits drift from the float model's within a
    few tokens, and int8 groups would round this weight too)."""
    grouped = Int8GroupLinear(weight)
    if torch.equal(grouped.dequantized(), weight.detach().float().cpu()):
        return grouped
    return head_linear(weight)


def quantize_model(
    model: nn.Module, mode: str, *, codes: Mapping[str, Int4Weight] | None = None
) -> nn.Module:
    """Quantize ``model`` (a :class:`~graphrunner_ref.model.llama.LlamaDecoder`,
    weights loaded) in place with ``mode`` (a :data:`QUANTIZATIONS` name);
    returns it. ``codes`` (:data:`INT4_MODES` only): 4-bit weights by transformers name
    (``model.layers.0.mlp.up_proj.weight``) taken as they are for those
    projections, the rest quantized from the model's floats. Raises
    ValueError for another model, one already quantized, an unknown mode, a
    CUDA model, ``fp16`` / ``int4`` on a half-precision model, or ``codes``
    with another mode, an unknown name or a shape that does not fit."""
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
    if codes and mode not in INT4_MODES:
        raise ValueError(
            f"quantize={mode!r}: codes are 4-bit weights; expected a mode of {INT4_MODES}"
        )
    config = model.config
    if config.attention_bias or config.mlp_bias:
        raise ValueError(
            f"quantize={mode!r}: the compact linears take no biases; this model has "
            f"attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias} "
            "(expected a bias-free Llama)"
        )
    make = compact_linear(mode, dtype)
    make_qkv = qkv_linear(mode, dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            cast(PagedAttention, layer.self_attn).quantize(make, make_qkv)
            cast(SwiGLUMLP, layer.mlp).quantize(make)
        model.head_proj = compact_head(mode, dtype)(model.lm_head_weight)
        if codes:
            _take_codes(model, codes)
    model.quantization = mode
    return model


#: Each layer's compact linears: (module, linear, the projections stacked in it, in order).
STACKS = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


def _take_codes(model: LlamaDecoder, codes: Mapping[str, Int4Weight]) -> None:
    """Overwrite each int4 projection's rows with ``codes``' weight where it has one."""
    unused = set(codes)
    shapes = projection_shapes(model.config)
    for i, layer in enumerate(model.model.layers):
        for module, linear_name, parts in STACKS:
            linear = cast(Int4Linear, getattr(getattr(layer, module), linear_name))
            start = 0
            for part in parts:
                rows = shapes[f"{module}.{part}"][0]
                name = f"model.layers.{i}.{module}.{part}.weight"
                if name in codes:
                    try:
                        linear.set_rows(start, codes[name])
                    except ValueError as e:
                        raise ValueError(f"codes[{name!r}]: {e}") from None
                    unused.discard(name)
                start += rows
    if unused:
        raise ValueError(
            f"codes: {len(unused)} name(s) match no projection of this model, e.g. "
            f"{sorted(unused)[0]!r}; expected model.layers.<i>.(self_attn|mlp).<proj>.weight"
        )
