"""A linear over 4-bit weights in groups of 32 input columns, float32
activations (``--quantize int4``).

Format (like GGUF's Q4_1): each output row's input columns are cut into
groups of :data:`GROUP` = 32; a group stores a float32 ``scale`` and
``min`` and 32 codes ``q`` in 0..15, with ``w ~ q * scale + min`` (the
group's smallest weight maps to 0, its largest to 15, so every weight is
within half a scale of its rounding). Two codes share a byte: byte ``j`` of
a group holds code ``j`` in its low nibble and code ``j + 16`` in its high
one. ``packed`` is uint8 ``[out, groups * 16]``, ``scales`` and ``mins``
float32 ``[out, groups]``: 4.5 + 1.5 bits a weight against float32's 32.
An ``in`` that is not a multiple of 32 is padded: the last group's extra
codes exist in ``packed`` but no input column meets them.

:class:`Int4Linear` keeps its codes blocked for the kernel
(:func:`block_codes`): output rows in blocks of :data:`BLOCK_ROWS` = 4, each
group's 16 bytes of a block's 4 rows side by side (one 64-byte line), so a
step that streams the weights from memory reads one stream of codes, not
four. ``scales`` and ``mins`` keep their ``[out, groups]`` order (a block's
rows are already side by side there).

The product runs one of two ways, chosen once per process:

* ``kernel``: a small C++ kernel (in ``cpu_kernels.cpp``,
  :mod:`~graphrunner_ref.model.cpu_kernels`), built on first use with
  ``torch.utils.cpp_extension.load_inline`` into torch's extension cache,
  registered as the op ``graphrunner_int4::linear`` with a fake
  implementation, so ``torch.compile`` (inductor) calls it as one extern
  kernel. It multiplies float32 activations by the codes widened to float32
  in registers, accumulating in float32:
  ``y = sum_g scale_g * (x_g . q_g) + min_g * sum(x_g)``, AVX2/FMA. Each
  input row is first rewritten once per call so that half of a group's
  floats come from its bytes whole (``b = lo + 16 * hi``) and only the other
  half need a nibble mask: ``x[j] lo + x[j+16] hi = (x[j+16]/16) b +
  (x[j] - x[j+16]/16) lo`` (``x/16`` exact; the difference rounds once, as a
  product does); up to 4 outputs run in one pass over the groups
  (``cpu_kernels.cpp``). Measured on an AVX2 EPYC (Zen 3), one thread
  (``bench/results/int4-avx2-cpu.md``), this took a 576 x 1536 product at one
  row from about 0.5x to about 0.85x of the int4-q8 kernel's speed (integer
  dots on 8-bit activations), about 1.5x float32 ``F.linear``; the older loop
  (one output a pass, every code masked) measured on a Zen 4 EPYC
  (``bench/results/int4-cpu.md``): 4.5x float32 at 1 row for a 576 x 49152
  weight (streamed from memory), about even at 1 row for a 576 x 1536 one
  (in cache). int4's gain over fbgemm's float16 weights (``--quantize
  fp16``) is memory: about 1/5 of float32's bytes, not 1/2.
* ``torch``: dequantize to float32, then ``F.linear`` (plain torch ops,
  compile-friendly) where no compiler or no AVX2 is at hand; this rebuilds
  the float weight every call, so it is slower than float32 and says so
  once.

Each output row reads only its own input row, in the same order whatever
the batch, so a padded row cannot change a live one (bit for bit).
``torch.ops.aten._weight_int4pack_mm_for_cpu`` was measured too and lost
(see the benchmark); its ``(q - 8) * scale + zero`` format maps onto this one
with ``zero = min + 8 * scale``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner_ref.model.cpu_kernels import KERNEL_ENV, KERNEL_SOURCE, kernel_status, kernels_run

__all__ = [
    "BLOCK_ROWS",
    "GROUP",
    "KERNEL_ENV",
    "KERNEL_SOURCE",
    "Int4Linear",
    "Int4Weight",
    "block_codes",
    "dequantize_int4",
    "int4_kernel_status",
    "int4_reference_linear",
    "quantize_int4",
    "unblock_codes",
]

#: Input columns per quantization group (one scale and one min each).
GROUP = 32
#: Output rows whose codes the kernel's layout interleaves (:func:`block_codes`).
BLOCK_ROWS = 4


class Int4Weight(NamedTuple):
    """A weight in this module's 4-bit format: ``packed`` uint8
    ``[out, groups * 16]``, ``scales`` and ``mins`` float32 ``[out, groups]``
    (``w[o, 32 g + j] = q * scales[o, g] + mins[o, g]``)."""

    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """``weight`` ``[out, in]`` (any float dtype) as ``(packed, scales, mins)``:
    uint8 ``[out, groups * 16]`` and float32 ``[out, groups]`` with
    ``groups = ceil(in / 32)``; every weight within half a scale of
    ``q * scale + min``. A constant group gets scale 1 (codes 0, exact).
    An ``in`` not a multiple of 32 pads the last group with copies of its
    last column (so they do not widen its range)."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] == 0:
        raise ValueError(
            f"quantize_int4: weight {tuple(weight.shape)} {weight.dtype}: expected a 2-D "
            "float [out, in] tensor with in >= 1"
        )
    w = weight.detach().float().cpu()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_int4: weight holds NaN or inf; expected finite values")
    out, inp = w.shape
    groups = -(-inp // GROUP)
    if groups * GROUP != inp:
        w = torch.cat([w, w[:, -1:].expand(out, groups * GROUP - inp)], dim=1)
    g = w.view(out, groups, GROUP)
    mins = g.amin(dim=2)
    scales = (g.amax(dim=2) - mins) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - mins[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return Int4Weight(packed.reshape(out, groups * 16).contiguous(), scales, mins)


def block_codes(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` uint8 ``[out, groups * 16]`` in the kernel's blocked layout:
    uint8 ``[ceil(out / 4), groups * 64]``, block ``b``'s group ``g`` holding
    the 16 bytes of rows ``4b .. 4b + 3`` in turn (rows past ``out`` zero)."""
    out, width = packed.shape
    blocks = -(-out // BLOCK_ROWS)
    padded = packed.new_zeros(blocks * BLOCK_ROWS, width)
    padded[:out] = packed
    grouped = padded.view(blocks, BLOCK_ROWS, width // 16, 16).transpose(1, 2)
    return grouped.reshape(blocks, width * BLOCK_ROWS).contiguous()


def unblock_codes(blocked: torch.Tensor, out: int) -> torch.Tensor:
    """The ``[out, groups * 16]`` codes of :func:`block_codes`' ``blocked``."""
    blocks, width = blocked.shape
    rows = blocked.view(blocks, width // (16 * BLOCK_ROWS), BLOCK_ROWS, 16).transpose(1, 2)
    return rows.reshape(blocks * BLOCK_ROWS, width // BLOCK_ROWS)[:out]


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int
) -> torch.Tensor:
    """The float32 weight ``[out, in_features]`` of :func:`quantize_int4`'s
    ``packed`` ``[out, groups * 16]``, ``scales`` and ``mins`` ``[out, groups]``."""
    out, groups = scales.shape
    b = packed.view(out, groups, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=2).float()
    w = q * scales[..., None] + mins[..., None]
    return w.reshape(out, groups * GROUP)[:, :in_features]


def int4_reference_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 times the dequantized weight: ``[..., out]``
    (the torch path, and the oracle of the kernel)."""
    return F.linear(x, dequantize_int4(packed, scales, mins, x.shape[-1]))


#: Whether the C++ kernels run here, else why not (the shared build's status).
int4_kernel_status = kernel_status


class Int4Linear(nn.Module):
    """Group-wise 4-bit linear: ``[..., in]`` float32 ``-> [..., out]`` float32.

    Buffers: ``blocked`` uint8 ``[ceil(out / 4), groups * 64]`` (the codes in
    the kernel's layout, :func:`block_codes`), ``scales`` and ``mins`` float32
    ``[out, groups]`` (:func:`quantize_int4`); :attr:`packed` gives the codes
    in :class:`Int4Weight`'s order. ``kernel`` picks the product: None (the
    C++ kernel where it builds, else the torch path), True (the kernel;
    RuntimeError where it cannot run) or False (torch).
    """

    blocked: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, weight: torch.Tensor, kernel: bool | None = None) -> None:
        super().__init__()
        packed, scales, mins = quantize_int4(weight)
        self.register_buffer("blocked", block_codes(packed))
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.out_features, self.in_features = weight.shape
        if kernel is None:
            kernel = kernels_run()
        elif kernel and int4_kernel_status() is not None:
            raise RuntimeError(f"Int4Linear(kernel=True): {int4_kernel_status()}")
        # A plain bool read at trace time: dynamo compiles one branch.
        self.kernel = kernel

    def set_rows(self, start: int, weight: Int4Weight) -> None:
        """Overwrite output rows ``start .. start + out`` with ``weight``'s codes,
        scales and mins (``out`` its rows; a stacked projection takes each part's
        codes at its own offset). ValueError names a shape that does not fit."""
        rows, width = weight.packed.shape
        groups = self.scales.shape[1]
        fits = (
            start >= 0
            and start + rows <= self.out_features
            and width == groups * 16
            and weight.scales.shape == weight.mins.shape == (rows, groups)
            and weight.packed.dtype == torch.uint8
        )
        if not fits:
            raise ValueError(
                f"Int4Linear.set_rows(start={start}): packed {tuple(weight.packed.shape)} "
                f"{weight.packed.dtype}, scales {tuple(weight.scales.shape)}, mins "
                f"{tuple(weight.mins.shape)}: expected uint8 [rows, {groups * 16}] and "
                f"[rows, {groups}] with start + rows <= {self.out_features}"
            )
        end = start + rows
        packed = self.packed.clone()
        packed[start:end] = weight.packed
        self.blocked.copy_(block_codes(packed))
        self.scales[start:end] = weight.scales.float()
        self.mins[start:end] = weight.mins.float()

    @property
    def packed(self) -> torch.Tensor:
        """The codes as uint8 ``[out, groups * 16]`` (:class:`Int4Weight`'s order)."""
        return unblock_codes(self.blocked, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this linear multiplies by."""
        return dequantize_int4(self.packed, self.scales, self.mins, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return int4_reference_linear(x, self.packed, self.scales, self.mins)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.graphrunner_int4.linear(flat, self.blocked, self.scales, self.mins)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ AVX2 kernel" if self.kernel else "dequantize + F.linear"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP} ({path}), float32 activations"
        )
