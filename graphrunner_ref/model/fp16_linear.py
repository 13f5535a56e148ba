"""A linear over float16 weights with float32 activations and accumulation
(``--quantize fp16``): half the weight bytes of float32 on any x86 CPU.

A decode step on the CPU streams every weight once per step; at small batch
sizes that read is the step. The product runs the project's C++ kernel
(``graphrunner_fp16::linear``, :mod:`~graphrunner_ref.model.cpu_kernels`):
the weight is packed in blocks of 8 output rows (:func:`pack_fp16`), each
block streamed from memory once and widened to float32 in registers (F16C),
multiplied by float32 activations and accumulated in float32: no activation
is rounded, each output row reads only its own input row (a padded row
cannot change a live one), and it needs no AVX-512 or AMX. It is a
dispatcher op with no Python in its call, so inductor calls it as one kernel
inside the compiled CPU program.

fbgemm's float16-weight product (``torch.ops.quantized.linear_dynamic_fp16``)
is the fallback where the kernels cannot be built, and the LM head's product
(:func:`head_linear`); how the two compare on each shape:
``docs/text-and-gguf.md``.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from graphrunner_ref.model.cpu_kernels import kernels_run

__all__ = [
    "BLOCK",
    "Fp16WeightLinear",
    "fp16_weights_available",
    "head_linear",
    "pack_fp16",
    "unpack_fp16",
]

#: Output rows a packed block holds (and input columns a chunk of it).
BLOCK = 8

# fbgemm's packed weights of the fallback path, by handle: opaque objects the
# compiled program cannot hold, so a registered op reads them by number.
_PACKED: dict[int, Any] = {}
_HANDLES = itertools.count(1)


def fp16_weights_available() -> str | None:
    """None where float16 weights run here (the C++ kernel, or else fbgemm's
    float16-weight linear), else why not."""
    if kernels_run():
        return None
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm")):
        return f"this torch build has no x86/fbgemm quantized engine (it has {engines})"
    return None


def pack_fp16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` rounded to float16 and packed for the kernel:
    float16 ``[ceil(out / 8), 8 * in8]`` (``in8`` = ``in`` rounded up to 8),
    each row a block of 8 output rows laid out ``[in8 / 8][8 rows][8 columns]``,
    zeros past ``out`` and ``in``."""
    out, inp = weight.shape
    out8, in8 = -(-out // BLOCK) * BLOCK, -(-inp // BLOCK) * BLOCK
    padded = torch.zeros(out8, in8, dtype=torch.float16)
    padded[:out, :inp] = weight.to(torch.float16)
    blocks = padded.view(out8 // BLOCK, BLOCK, in8 // BLOCK, BLOCK).permute(0, 2, 1, 3)
    return blocks.contiguous().view(out8 // BLOCK, BLOCK * in8)


def unpack_fp16(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The float16 weight ``[out, inp]`` of :func:`pack_fp16`'s ``packed``."""
    in8 = packed.shape[1] // BLOCK
    blocks = packed.view(-1, in8 // BLOCK, BLOCK, BLOCK).permute(0, 2, 1, 3)
    return blocks.reshape(-1, in8)[:out, :inp]


# Registered through the low-level library API rather than
# ``torch.library.custom_op``, whose Python wrapper about doubles the cost of
# a call this short.
_LIB = torch.library.Library("graphrunner", "FRAGMENT")
_LIB.define("fp16_weight_linear(Tensor x, int handle, int out_features) -> Tensor")


def _fp16_weight_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``x`` float32 ``[rows, in]`` times fbgemm's packed weight ``handle``: ``[rows, out]``."""
    return torch.ops.quantized.linear_dynamic_fp16(x, _PACKED[handle])


def _fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_LIB.impl("fp16_weight_linear", _fp16_weight_linear, "CPU")
torch.library.register_fake("graphrunner::fp16_weight_linear", _fake, lib=_LIB)
fp16_weight_linear = torch.ops.graphrunner.fp16_weight_linear.default


def head_linear(weight: torch.Tensor) -> Fp16WeightLinear:
    """A float16 LM head over ``weight`` ``[vocab, hidden]``: fbgemm's blocked
    product, faster than the C++ kernel on a weight this large at several
    rows and close to it at one; the kernel's gain is per call, which one
    head call a step hardly pays."""
    return Fp16WeightLinear(weight, kernel=False)


class Fp16WeightLinear(nn.Module):
    """``[..., in]`` float32 ``-> [..., out]`` float32 over ``weight``
    ``[out, in]`` rounded to float16; no float32 copy is kept. Buffer:
    ``packed`` float16 (:func:`pack_fp16`) where the C++ kernel runs, else
    the weight lives in fbgemm's packed form (read by handle). ``kernel``:
    None (the C++ kernel where it builds, else fbgemm) or False (fbgemm).
    Raises ValueError for weights outside float16's range."""

    packed: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, kernel: bool | None = None) -> None:
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
        self.handle = 0
        if kernels_run() and kernel is not False:
            self.register_buffer("packed", pack_fp16(w))
        else:
            self.register_buffer("packed", None)
            self.handle = next(_HANDLES)
            _PACKED[self.handle] = torch.ops.quantized.linear_prepack_fp16(w, None)
            weakref.finalize(self, _PACKED.pop, self.handle, None)

    @property
    def kernel(self) -> bool:
        """Whether the C++ kernel runs this linear (else fbgemm)."""
        return self.packed is not None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` (float16 values) this linear multiplies by."""
        if self.packed is not None:
            return unpack_fp16(self.packed, self.out_features, self.in_features).float()
        weight, _ = torch.ops.quantized.linear_unpack_fp16(_PACKED[self.handle])
        return weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed is not None:
            out = torch.ops.graphrunner_fp16.linear(flat, self.packed, self.out_features)
        else:
            out = fp16_weight_linear(flat, self.handle, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ AVX2 kernel" if self.kernel else "fbgemm"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"float16 weights, float32 activations ({path})"
        )
