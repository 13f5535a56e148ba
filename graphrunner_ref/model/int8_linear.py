"""A linear over int8 weights with one float scale per output channel
(``--quantize int8``).

:func:`quantize_per_channel` gives ``w ~ w_int8 * scale[:, None]``
(symmetric, -127..127); :class:`Int8Linear` is weight-only: the activations
keep the model's dtype. Float32 activations go through the project's C++
kernel (``graphrunner_int8::linear``, :mod:`~graphrunner_ref.model.cpu_kernels`:
codes widened to float32 in registers, AVX2/FMA); torch's
``torch._weight_int8pack_mm`` with float32 activations was measured 10x
slower than float32 at 1 row and 24x at 8 rows on an AVX-512 Zen 4 (and
10-40x on an AVX2 CPU), so it runs only for half-precision activations,
where it is faster than the model's own product at 1 row, and where the
kernel cannot be built. Each output row reads only its own input row, so a
padded row cannot change a live one.

Activations quantized per call (fbgemm's dynamic int8 linear, fast on AVX2)
are not offered: they share one scale per tensor, so a padded row's values
would change every live row's result.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrunner_ref.model.cpu_kernels import kernels_run

__all__ = ["GROUP", "Int8GroupLinear", "Int8Linear", "quantize_per_channel", "quantize_per_group"]

#: Input columns per scale of :func:`quantize_per_group` (GGUF's Q8_0 blocks).
GROUP = 32


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` (any float dtype) as int8 ``[out, in]`` and
    float32 scales ``[out]`` with ``weight ~ q * scales[:, None]``: each row's
    largest magnitude maps to 127, every value within half a scale of its
    rounding. An all-zero row gets scale 1 (and zeros)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"quantize_per_channel: weight {tuple(weight.shape)} {weight.dtype}: expected a "
            "2-D float [out, in] tensor"
        )
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_per_channel: weight holds NaN or inf; expected finite values")
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_per_group(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int8 ``[out, groups * 32]`` (zeros past
    ``in``) and float32 scales ``[out, groups]``, ``groups = ceil(in / 32)``:
    each group's largest magnitude maps to 127 (GGUF's Q8_0), so a weight
    dequantized from Q8_0 (``d * q``, ``d`` a float16, some ``|q|`` 127 in
    every block) comes back bit for bit. An all-zero group gets scale 1."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] == 0:
        raise ValueError(
            f"quantize_per_group: weight {tuple(weight.shape)} {weight.dtype}: expected a "
            "2-D float [out, in] tensor with in >= 1"
        )
    w = weight.detach().float().cpu()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_per_group: weight holds NaN or inf; expected finite values")
    out, inp = w.shape
    groups = -(-inp // GROUP)
    g = torch.nn.functional.pad(w, (0, groups * GROUP - inp)).view(out, groups, GROUP)
    scales = g.abs().amax(dim=2) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(g / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(out, groups * GROUP), scales


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Int8Linear(nn.Module):
    """Weight-only int8 linear: ``[..., in] -> [..., out]`` in the input's dtype.

    Buffers: ``weight`` int8 ``[out, in]``, ``scales`` ``[out]`` in the
    activation dtype (``dtype``).
    """

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        q, scales = quantize_per_channel(weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.out_features, self.in_features = q.shape
        # A plain bool read at trace time: dynamo compiles one branch.
        self.kernel = dtype == torch.float32 and kernels_run()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this linear multiplies by."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            out = torch.ops.graphrunner_int8.linear(_flat(x), self.weight, self.scales)
        else:
            out = torch._weight_int8pack_mm(_flat(x), self.weight, self.scales)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ AVX2 kernel" if self.kernel else "torch._weight_int8pack_mm"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 weight-only ({path})"
        )


class Int8GroupLinear(nn.Module):
    """int8 weights in groups of 32 input columns, a float32 scale each
    (:func:`quantize_per_group`), float32 activations and accumulation:
    ``[..., in] -> [..., out]``. The C++ kernel (``graphrunner_int8::linear_grouped``)
    widens the codes to float32 in registers; where the kernels cannot run,
    dequantize-then-``F.linear``. Each output row reads only its own input row.
    The LM head of ``--quantize int4-q8``: half the float16 head's bytes, and
    a GGUF file's Q8_0 head exactly."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scales = quantize_per_group(weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.out_features, self.in_features = weight.shape
        self.kernel = kernels_run()

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[out, groups * 32]`` (a subclass may hold them in
        another layout and give them back here)."""
        return self.weight

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this linear multiplies by."""
        g = self.codes().view(self.out_features, -1, GROUP).float() * self.scales[..., None]
        return g.view(self.out_features, -1)[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            out = torch.ops.graphrunner_int8.linear_grouped(_flat(x), self.weight, self.scales)
        else:
            out = torch.nn.functional.linear(_flat(x), self.dequantized())
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ AVX2 kernel" if self.kernel else "dequantize + F.linear"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 groups of {GROUP}, float32 activations ({path})"
        )
