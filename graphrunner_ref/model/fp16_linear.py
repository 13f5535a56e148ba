"""A linear over float16 weights with float32 activations and accumulation
(``--quantize fp16``): half the weight bytes of float32 on any x86 CPU.

A decode step on the CPU streams every weight once per step; at small batch
sizes that read is the step. fbgemm's half-precision product
(``torch.ops.quantized.linear_dynamic_fp16``) keeps the weight packed in
float16 and widens it in registers (F16C), multiplying float32 activations
and accumulating in float32: no activation is rounded, each output row reads
only its own input row (a padded row cannot change a live one), and it needs
no AVX-512 or AMX. Measured on an AVX2 CPU, one thread, against float32
``F.linear``: 1.2x at 1 row and 1.8x at 8 rows for a 1536 x 576 weight
(in cache), 5x for an 8192 x 576 one (streamed from memory).

It runs as a ``torch.library`` op (``graphrunner::fp16_weight_linear``), so
inductor calls it as one kernel inside the compiled CPU program; the packed
weight (an opaque object, not a tensor) lives in a registry the op reads by
handle. Each call costs fbgemm's fixed ~20 µs on top of the product, so it
pays on weights of real models (a layer's projections of a MB and more),
not on the tiny embedded one.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["Fp16WeightLinear", "fp16_weights_available"]

#: Handle -> packed float16 weight of each live Fp16WeightLinear.
_PACKED: dict[int, Any] = {}
_HANDLES = itertools.count(1)


def fp16_weights_available() -> str | None:
    """None where fbgemm's float16-weight linear runs here, else why not."""
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm")):
        return f"this torch build has no x86/fbgemm quantized engine (it has {engines})"
    return None


# Registered through the low-level library API rather than
# ``torch.library.custom_op``: the op is called once per projection per step,
# and custom_op's Python wrapper doubled its call cost (measured 53 against
# 27 µs per call, fbgemm's own 21 µs included).
_LIB = torch.library.Library("graphrunner", "FRAGMENT")
_LIB.define("fp16_weight_linear(Tensor x, int handle, int out_features) -> Tensor")


def _fp16_weight_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``x`` float32 ``[rows, in]`` times the packed weight ``handle``: ``[rows, out]``."""
    return torch.ops.quantized.linear_dynamic_fp16(x, _PACKED[handle])


def _fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_LIB.impl("fp16_weight_linear", _fp16_weight_linear, "CPU")
torch.library.register_fake("graphrunner::fp16_weight_linear", _fake, lib=_LIB)
fp16_weight_linear = torch.ops.graphrunner.fp16_weight_linear.default


class Fp16WeightLinear(nn.Module):
    """``[..., in]`` float32 ``-> [..., out]`` float32 over ``weight``
    ``[out, in]`` rounded to float16 (packed; no float32 copy is kept).
    Raises ValueError for weights outside float16's range."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        why = fp16_weights_available()
        if why is not None:
            raise RuntimeError(f"Fp16WeightLinear: {why}")
        w = weight.detach().float().cpu()
        if w.dim() != 2 or not bool(w.abs().le(torch.finfo(torch.float16).max).all()):
            raise ValueError(
                f"Fp16WeightLinear: weight {tuple(w.shape)}: expected a 2-D [out, in] "
                f"tensor of finite values within float16's range (|w| <= 65504)"
            )
        self.out_features, self.in_features = w.shape
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = torch.ops.quantized.linear_prepack_fp16(w, None)
        weakref.finalize(self, _PACKED.pop, self.handle, None)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` (float16 values) this linear multiplies by."""
        weight, _ = torch.ops.quantized.linear_unpack_fp16(_PACKED[self.handle])
        return weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp16_weight_linear(x.reshape(-1, self.in_features), self.handle, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "float16 weights, float32 activations"
        )
