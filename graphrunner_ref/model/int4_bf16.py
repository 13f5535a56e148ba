"""4-bit weights times bfloat16 activations (``--quantize int4-bf16``), opt-in,
for batches of 8 and more on CPUs with AVX-512 BF16.

The weights are :mod:`~graphrunner_ref.model.int4_linear`'s (groups of 32
input columns, a float32 scale and min each). Each weight is taken as the
bfloat16 nearest its float32 value ``code * scale + min`` (int4's
dequantize, two roundings), each activation as the bfloat16 nearest it, and
the products are summed in float32 as AVX-512 BF16's ``vdpbf16ps`` sums
them: 16 lanes, lane ``i`` taking the pair of columns ``(2i, 2i + 1)`` of
each group in turn,

    acc[i] = (acc[i] + w[2i+1] * x[2i+1]) + w[2i] * x[2i]

(a product of two bfloat16 values is exact in float32; each sum rounds to
nearest even), then the 16 lanes summed in a fixed order: ``(acc[0:8] +
acc[8:16])``, halves again, then ``(s0 + s2) + (s1 + s3)``.

A group's scale and min make one 16-entry table of bfloat16 weights per
(output, group), looked up by code (``vpermw``) and shared by every row, so
a row costs one ``vdpbf16ps`` per group and no per-row scale work. Measured
on a Zen 4 EPYC (``bench/results/int4-q8-tiles-zen4-cpu.md``): at 8 rows
1.11-1.19x int4-q8's blocked AVX-512 VNNI kernel on SmolLM2's layer shapes
(its tiles path, since, runs about 2x this one), slower at 1 row (0.66-0.71x),
where the table costs as much as the dots; its error against the float
weight's product is about half int4-q8's, and its SmolLM2 answers kept every
row float32 transformers' at batch 1 and 8.

The C++ kernel (``graphrunner_int4::linear_bf16``) runs only where the CPU
has AVX-512 BF16 (:data:`~graphrunner_ref.model.cpu_features.KERNEL_PATHS`);
elsewhere, or with ``GRAPHRUNNER_CPU_DISABLE=avx512_bf16``,
:func:`int4_bf16_reference_linear` runs: the same arithmetic in torch, equal
to the kernel bit for bit, much slower. A row's sums never meet another
row's and run in the same order whatever the batch, so a row's output never
depends on the rows beside it or their number.
"""

from __future__ import annotations

import functools

import torch

from graphrunner.util import warn_at_caller
from graphrunner_ref.model.cpu_features import cpu_features, kernel_path
from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.int4_linear import GROUP, Int4Linear, dequantize_int4
from graphrunner_ref.model.int8_linear import Int8GroupLinear

__all__ = [
    "Int4Bf16Linear",
    "Int8GroupBf16Linear",
    "bf16_grouped_dot",
    "int4_bf16_reference_linear",
]

#: Lanes of the float32 accumulator (a 512-bit register), two columns each per group.
LANES = 16


def _lane_sum(acc: torch.Tensor) -> torch.Tensor:
    """``acc`` ``[..., 16]`` summed in the kernel's order (its ``hsum16``)."""
    a = acc[..., :8] + acc[..., 8:]
    q = a[..., :4] + a[..., 4:]
    return (q[..., 0] + q[..., 2]) + (q[..., 1] + q[..., 3])


def _bf16_daz(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16 (nearest even), back as float32, subnormal
    values as zero: ``vdpbf16ps`` reads a subnormal input as zero."""
    b = t.to(torch.bfloat16).float()
    return torch.where(b.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(b), b)


def bf16_grouped_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 times ``weight`` float32 ``[out, groups * 32]``
    (``in`` <= its columns), both rounded to bfloat16, summed as the kernels'
    ``vdpbf16ps`` lanes are: ``[..., out]`` float32, equal to them bit for bit
    (subnormal inputs read as zero, as the instruction reads them; a sum
    below float32's smallest normal, which it flushes, does not arise from
    weights and activations of a model's magnitudes)."""
    lead, inp = x.shape[:-1], x.shape[-1]
    out, width = weight.shape
    groups = width // GROUP
    rows = x.reshape(-1, inp).float()
    padded = rows.new_zeros(rows.shape[0], width)
    padded[:, :inp] = rows
    xb = _bf16_daz(padded).view(-1, 1, groups, LANES, 2)
    wb = _bf16_daz(weight).view(1, out, groups, LANES, 2)
    acc = rows.new_zeros(rows.shape[0], out, LANES)
    for g in range(groups):
        prod = xb[:, :, g] * wb[:, :, g]  # exact: bfloat16 times bfloat16
        acc = (acc + prod[..., 1]) + prod[..., 0]
    return _lane_sum(acc).view(*lead, out)


def int4_bf16_reference_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 through the int4 x bfloat16 product:
    ``[..., out]`` float32 (``packed`` ``[out, groups * 16]``, ``scales`` /
    ``mins`` ``[out, groups]``), equal to the kernel bit for bit."""
    groups = scales.shape[1]
    return bf16_grouped_dot(x, dequantize_int4(packed, scales, mins, groups * GROUP))


@functools.cache
def _fallback_note() -> None:
    """Say once that the torch emulation runs in the kernel's place."""
    why = kernel_status()
    reason = (
        f"the C++ kernels do not run here ({why})"
        if why is not None
        else f"the C++ kernel needs AVX-512 BF16, which this CPU ({cpu_features().describe()}) "
        "lacks or hides"
    )
    warn_at_caller(
        f"--quantize int4-bf16: {reason}; the torch emulation runs "
        "(the same numbers, far slower): int4-q8 or int4 are the fast modes here"
    )


class Int4Bf16Linear(Int4Linear):
    """:class:`~graphrunner_ref.model.int4_linear.Int4Linear`'s weights and
    buffers, weights and activations rounded to bfloat16, float32 sums:
    ``[..., in]`` float32 ``-> [..., out]`` float32. ``kernel``: None (the C++
    kernel where the CPU has AVX-512 BF16 and the kernels build, else
    :func:`int4_bf16_reference_linear`, said once), True (the kernel;
    RuntimeError where it cannot run) or False (the torch path)."""

    def __init__(self, weight: torch.Tensor, kernel: bool | None = None) -> None:
        super().__init__(weight, kernel=False if kernel is False else None)
        path = kernel_path("int4-bf16") if self.kernel else None
        if kernel and path is None:
            raise RuntimeError(
                "Int4Bf16Linear(kernel=True): no int4-bf16 kernel path for this CPU "
                f"({cpu_features().describe()}): it needs AVX-512 BF16"
            )
        if kernel is None and path is None:
            _fallback_note()
        # A plain bool read at trace time: dynamo compiles one branch.
        self.kernel = path is not None
        self.path_name = "torch" if path is None else path.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return int4_bf16_reference_linear(x, self.packed, self.scales, self.mins)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.graphrunner_int4.linear_bf16(flat, self.blocked, self.scales, self.mins)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = f"C++ {self.path_name} kernel" if self.kernel else "torch emulation"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP}, weights and activations rounded to bfloat16 ({path})"
        )


class Int8GroupBf16Linear(Int8GroupLinear):
    """The LM head of ``--quantize int4-bf16``:
    :class:`~graphrunner_ref.model.int8_linear.Int8GroupLinear`'s int8 codes in
    groups of 32 (a GGUF file's Q8_0 head exactly), each weight rounded to
    bfloat16 from its float32 ``q * scale``, activations rounded to bfloat16,
    the same float32 sums as :class:`Int4Bf16Linear`'s
    (``graphrunner_int8::linear_grouped_bf16``; where it cannot run,
    :func:`bf16_grouped_dot` in torch, equal bit for bit):
    ``[..., in]`` float32 ``-> [..., out]`` float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        path = kernel_path("int4-bf16") if self.kernel else None
        if path is None:
            _fallback_note()
        self.kernel = path is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            groups = self.weight.float().view(self.out_features, -1, GROUP)
            return bf16_grouped_dot(x, (groups * self.scales[..., None]).flatten(1))
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.graphrunner_int8.linear_grouped_bf16(flat, self.weight, self.scales)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ avx512-bf16 kernel" if self.kernel else "torch emulation"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 groups of {GROUP}, weights and activations rounded to bfloat16 ({path})"
        )
