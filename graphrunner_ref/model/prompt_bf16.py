"""Prompt chunks of the 4-bit modes on the CPU's bfloat16 units (``--prefill-bf16``).

A decode step multiplies few rows and is bound by the bytes of its weights,
where 4 bits a weight win; a prompt chunk multiplies hundreds of rows and is
bound by arithmetic, where the 4-bit kernels reach a fraction of what the
CPU's AMX-BF16 (or AVX-512 BF16) units do through oneDNN (one Xeon core,
SmolLM2's shapes at 512 rows: 750-1,140 GFLOP/s in bfloat16 against 180-300
GOP/s for int4-q8 on AMX-INT8, ``bench/results/gemm-peak-*.md``).

:func:`widen_prompts` wraps each 4-bit projection of a quantized Llama in a
:class:`PromptBf16Linear` holding the same weights widened once to bfloat16
(the 4-bit codes dequantized: decode and prefill multiply the same weights;
2 bytes a weight more in memory). Calls of :data:`PROMPT_ROWS` rows or more
(prompt chunks) multiply in bfloat16 with float32 results; fewer (decode
steps) go to the 4-bit linear as before, so a decode step is unchanged. Such
a chunk's attention runs in bfloat16 too (the K/V read from the cache in
bfloat16; on AMX-BF16 the C++ tile kernel, else torch's fused attention):
at 4,096 prompt tokens the float32 attention took most of the prefill.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner_ref.model.cpu_features import cpu_features
from graphrunner_ref.model.quantize import INT4_MODES, STACKS

__all__ = [
    "PROMPT_ROWS",
    "PromptBf16Linear",
    "bf16_matmul_units",
    "slow_bf16_note",
    "widen_prompts",
]

#: Rows from which a call multiplies in bfloat16: above any decode batch the
#: engine captures by default (16), a short prompt chunk's size.
PROMPT_ROWS = 32


class PromptBf16Linear(nn.Module):
    """A 4-bit linear (``quantized``: ``[..., in] -> [..., out]`` float32,
    with ``dequantized()`` and ``set_rows``) whose calls of :data:`PROMPT_ROWS`
    rows or more multiply its weights widened to bfloat16 (``prompt_weight``
    ``[out, in]``), float32 in and out."""

    prompt_weight: torch.Tensor

    def __init__(self, quantized: nn.Module, rows: int = PROMPT_ROWS) -> None:
        super().__init__()
        self.quantized = quantized
        self.rows = rows
        self.in_features: int = int(cast(Any, quantized).in_features)
        self.out_features: int = int(cast(Any, quantized).out_features)
        self.register_buffer("prompt_weight", self._widened())

    def _widened(self) -> torch.Tensor:
        return cast(Any, self.quantized).dequantized().to(torch.bfloat16).contiguous()

    def set_rows(self, start: int, weight: Any) -> None:
        """The 4-bit linear's ``set_rows``, the widened weight made again."""
        cast(Any, self.quantized).set_rows(start, weight)
        self.prompt_weight = self._widened()

    def dequantized(self) -> torch.Tensor:
        return cast(torch.Tensor, cast(Any, self.quantized).dequantized())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows are a static size where the step is captured: one path traced.
        if x.numel() // self.in_features < self.rows:
            return cast(torch.Tensor, self.quantized(x))
        return F.linear(x.to(torch.bfloat16), self.prompt_weight).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.rows}+ rows in bfloat16, fewer through the 4-bit linear"


def bf16_matmul_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX-BF16 or AVX-512 BF16)."""
    features = cpu_features()
    return features.has("amx_bf16") or features.has("avx512_bf16")


def slow_bf16_note() -> str | None:
    """What to tell a user of ``--prefill-bf16`` whose CPU multiplies
    bfloat16 with AVX-512 BF16 but not AMX (None where AMX-BF16 runs, or no
    bfloat16 units at all: refused elsewhere). A Xeon whose hypervisor hides
    AMX ran oneDNN's bfloat16 products at half its float32 rate, and int4-q8's
    prompt chunks faster without the flag than with it."""
    features = cpu_features()
    if features.has("amx_bf16") or not features.has("avx512_bf16"):
        return None
    return (
        "--prefill-bf16: this CPU multiplies bfloat16 on AVX-512 BF16, without AMX; "
        "on such a Xeon oneDNN's bfloat16 products ran at half its float32 rate and "
        "int4-q8 prefilled faster without the flag "
        "(bench/results/prefill-vllm-intel-r-xeon-r-processor-avx512.md)"
    )


def widen_prompts(model: nn.Module, rows: int = PROMPT_ROWS) -> nn.Module:
    """Wrap each 4-bit projection of ``model`` (a Llama quantized to an int4
    mode) in a :class:`PromptBf16Linear`; returns ``model``. ValueError for
    a model not quantized to 4 bits, or one wrapped already."""
    mode = getattr(model, "quantization", None)
    if mode not in INT4_MODES:
        raise ValueError(
            f"prefill_bf16: the model's quantization is {mode!r}; expected an int4 mode "
            "(int4, int4-q8, int4-bf16), whose 4-bit prompt chunks it widens"
        )
    layers = cast(Any, model).model.layers
    for layer in layers:
        for module_name, linear_name, _ in STACKS:
            module = getattr(layer, module_name)
            linear = getattr(module, linear_name)
            if isinstance(linear, PromptBf16Linear):
                raise ValueError("prefill_bf16: the model's prompt chunks are widened already")
            setattr(module, linear_name, PromptBf16Linear(linear, rows))
        layer.self_attn.prompt_bf16_rows = rows
    return model
