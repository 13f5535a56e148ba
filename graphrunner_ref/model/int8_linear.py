"""A linear over int8 weights with one float scale per output channel
(``--quantize int8``).

:func:`quantize_per_channel` gives ``w ~ w_int8 * scale[:, None]``
(symmetric, -127..127); :class:`Int8Linear` is weight-only: the activations
keep the model's dtype and ``torch._weight_int8pack_mm`` multiplies them by
the int8 weights, scaling each output channel. Each output row reads only
its own input row, so a padded row cannot change a live one. Fast where the
CPU has AVX-512 or AMX; measured on an AVX2 CPU 10-40x slower than float32
(:func:`graphrunner_ref.model.cpu_features.int8_weight_only_note`).

Activations quantized per call (fbgemm's dynamic int8 linear, fast on AVX2)
are not offered: they share one scale per tensor, so a padded row's values
would change every live row's result.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Int8Linear", "quantize_per_channel"]


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

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this linear multiplies by."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(_flat(x), self.weight, self.scales)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"
