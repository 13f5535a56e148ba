"""4-bit weights times 8-bit activations (``--quantize int4-q8``), opt-in.

The weights are :mod:`~graphrunner_ref.model.int4_linear`'s (groups of 32
input columns, a float32 scale and min each). Each input row is cut into
the same groups of 32 and quantized on its own, as llama.cpp's Q8 blocks
are: ``d = max|x_g| / 127`` and ``qx = round_half_even(x_g * (127 / max|x_g|))``
in -127..127 (a group of zeros: ``d = 0``, codes 0). The product is then an
integer dot per group, exact in int32, and a float sum over groups:

    y[r, o] = sum_g (scale[o, g] * d[r, g]) * (q[o, g] . qx[r, g])
              + min[o, g] * d[r, g] * sum(qx[r, g])

that is, the dequantized row ``d * qx`` times the weight, as llama.cpp's
Q4_1 x Q8_1 product. The min's share takes the quantized row's sum, not the
floats': then each activation's rounding error meets its own weight (of
either sign, so the errors cancel as the weights do), where the floats' sum
would leave it times ``weight - min`` (all of one sign). On SmolLM2,
teacher-forced over the 8 chat prompts (``bench/bench_agreement.py``), that
took the logits' RMS error against float32 transformers' from 0.58 to 0.27
(llama.cpp's Q4_1 x Q8_1: 0.24) and the greedy picks equal to theirs from
93% to 98% (llama.cpp 97%). The C++ kernel
(``graphrunner_int4::linear_q8``) runs the integer dot with the instruction
its path names (AVX2 ``vpmaddubsw`` + ``vpmaddwd``, AVX-VNNI or AVX-512 VNNI
``vpdpbusd``: :data:`~graphrunner_ref.model.cpu_features.KERNEL_PATHS`); every
path gives the same int32, so the same output bit for bit. A row's groups
are quantized from that row alone and summed in a fixed order, so a row's
output never depends on the rows beside it or their number.

The mode runs this product for each layer's output, gate/up and down
projections; the q/k/v projection keeps int4's float32 activations
(:func:`~graphrunner_ref.model.quantize.qkv_linear` says why).

:func:`int4_q8_reference_linear` is the torch oracle (and the fallback where
the kernels cannot run): the same quantization, equal bit for bit, and the
same integer dots; only its float sum's order differs.
"""

from __future__ import annotations

import torch

from graphrunner_ref.model.cpu_features import kernel_path
from graphrunner_ref.model.int4_linear import GROUP, Int4Linear

__all__ = ["Int4Q8Linear", "int4_q8_reference_linear", "quantize_activations_q8"]


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` float32 ``[rows, in]`` per group of 32 columns (the last padded
    with zeros): int8 codes ``[rows, groups, 32]``, float32 scales ``d`` and
    float32 sums of the dequantized groups ``d * sum(qx)`` ``[rows, groups]``,
    the kernel's quantization exactly."""
    rows, inp = x.shape
    groups = -(-inp // GROUP)
    padded = torch.zeros(rows, groups * GROUP, dtype=torch.float32)
    padded[:, :inp] = x
    g = padded.view(rows, groups, GROUP)
    amax = g.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).clamp_(-128, 127).to(torch.int8)
    d = amax / 127.0
    return q, d, d * q.sum(dim=2, dtype=torch.int32).float()


def int4_q8_reference_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 through the int4 x q8 product: ``[..., out]``
    float32 (``packed`` ``[out, groups * 16]``, ``scales``/``mins`` ``[out, groups]``)."""
    lead, inp = x.shape[:-1], x.shape[-1]
    out, groups = scales.shape
    qx, d, sums = quantize_activations_q8(x.reshape(-1, inp).float())
    b = packed.view(out, groups, 16)
    codes = torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.int32)  # [out, groups, 32]
    # Integer dots per (row, output, group): exact in int32 (|dot| <= 32 * 15 * 128).
    dots = torch.einsum("rgk,ogk->rog", qx.to(torch.int32), codes)
    y = (dots.double() * (scales[None] * d[:, None, :]).double()).sum(dim=2)
    y = y + (mins[None].double() * sums[:, None, :].double()).sum(dim=2)
    return y.float().view(*lead, out)


class Int4Q8Linear(Int4Linear):
    """:class:`~graphrunner_ref.model.int4_linear.Int4Linear`'s weights and
    buffers, its activations quantized to 8 bits per group of 32:
    ``[..., in]`` float32 ``-> [..., out]`` float32. ``kernel``: None (the C++
    kernel on :func:`~graphrunner_ref.model.cpu_features.kernel_path`'s path
    where the kernels build, else :func:`int4_q8_reference_linear`), True (the
    kernel; RuntimeError where it cannot run) or False (the torch path)."""

    def __init__(self, weight: torch.Tensor, kernel: bool | None = None) -> None:
        super().__init__(weight, kernel)
        path = kernel_path("int4-q8") if self.kernel else None
        if self.kernel and path is None:
            raise RuntimeError("Int4Q8Linear: no int4-q8 kernel path for this CPU's features")
        # A plain int read at trace time: the compiled program calls one path.
        self.path = -1 if path is None else path.code
        self.path_name = "torch" if path is None else path.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return int4_q8_reference_linear(x, self.packed, self.scales, self.mins)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.graphrunner_int4.linear_q8(
            flat, self.blocked, self.scales, self.mins, self.path
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = f"C++ {self.path_name} kernel" if self.kernel else "torch reference"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP} x int8 activations per group ({path})"
        )
