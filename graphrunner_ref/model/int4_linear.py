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

The product runs one of two ways, chosen once per process:

* ``kernel``: a small AVX2/FMA C++ kernel (:data:`_KERNEL_SOURCE`), built
  on first use with ``torch.utils.cpp_extension.load_inline`` into torch's
  extension cache and registered as the op ``graphrunner_int4::linear``
  with a fake implementation, so ``torch.compile`` (inductor) calls it as
  one extern kernel. It widens each group's codes to float32 in registers
  and multiplies float32 activations, accumulating in float32:
  ``y = sum_g scale_g * (x_g . q_g) + min_g * sum(x_g)``. Measured on a
  Zen 4 EPYC, one thread, against float32 ``F.linear``
  (``bench/results/int4-cpu.md``): 4.5x at 1 row and 1.7-1.9x at 8 rows for
  a 576 x 49152 weight (streamed from memory), about even at 1 row (0.9-1.15x
  across runs) and 0.75-0.8x at 8 rows for a 576 x 1536 one (in cache: the
  widening of the codes costs more than the bytes it saves). fbgemm's
  float16 weights (``--quantize fp16``) are as fast at 1 row and faster at
  8; int4's gain over them is memory: about 1/5 of float32's bytes, not 1/2.
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

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.util import warn_at_caller

__all__ = [
    "GROUP",
    "Int4Linear",
    "Int4Weight",
    "dequantize_int4",
    "int4_kernel",
    "int4_kernel_status",
    "int4_reference_linear",
    "quantize_int4",
]

#: Input columns per quantization group (one scale and one min each).
GROUP = 32
#: Set to ``torch`` to skip the C++ kernel (the dequantize-then-matmul path).
KERNEL_ENV = "GRAPHRUNNER_INT4_KERNEL"
#: Bump with any change to the source: it names the cached build.
_KERNEL_NAME = "graphrunner_int4_avx2_v1"

_KERNEL_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R input rows (each padded to groups * 32 floats, zeros past `in`) against
// output rows [o0, o1). Every row's arithmetic is the same sequence whatever
// R is, so a row's result never depends on the rows beside it.
template <int R>
void rows_kernel(const float* xp, const float* sx, int64_t groups, const uint8_t* packed,
                 const float* scales, const float* mins, float* y, int64_t out,
                 int64_t o0, int64_t o1) {
  const int64_t kp = groups * kGroup;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wq = packed + o * groups * 16;
    const float* sc = scales + o * groups;
    const float* mn = mins + o * groups;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      // 16 bytes: codes 0..15 in the low nibbles, 16..31 in the high ones.
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + g * 16));
      const __m128i lo = _mm_and_si128(b, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      const __m256 d = _mm256_broadcast_ss(sc + g);
      for (int r = 0; r < R; ++r) {
        const float* xg = xp + r * kp + g * kGroup;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
        acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // The mins' share: min_g times the group's input sum.
      const float* s = sx + r * groups;
      float m = 0.0f;
      for (int64_t g = 0; g < groups; ++g) m = std::fma(mn[g], s[g], m);
      y[r * out + o] = hsum(acc[r]) + m;
    }
  }
}

using RowsFn = void (*)(const float*, const float*, int64_t, const uint8_t*, const float*,
                        const float*, float*, int64_t, int64_t, int64_t);
constexpr int kTile = 8;
constexpr RowsFn kRows[kTile + 1] = {nullptr, rows_kernel<1>, rows_kernel<2>, rows_kernel<3>,
                                     rows_kernel<4>, rows_kernel<5>, rows_kernel<6>,
                                     rows_kernel<7>, rows_kernel<8>};

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "graphrunner_int4::linear: x must be a 2-D float32 CPU tensor [rows, in]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "graphrunner_int4::linear: packed must be contiguous uint8 [out, groups * 16]");
  const int64_t rows = x.size(0), in = x.size(1), out = packed.size(0);
  const int64_t groups = packed.size(1) / 16;
  TORCH_CHECK(packed.size(1) == groups * 16 && (in + kGroup - 1) / kGroup == groups,
              "graphrunner_int4::linear: packed ", packed.sizes(), " does not fit in=", in);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && mins.is_contiguous() &&
                  scales.numel() == out * groups && mins.numel() == out * groups,
              "graphrunner_int4::linear: scales and mins must be contiguous float32 [out, groups]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const int64_t kp = groups * kGroup;
  const float* xs = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> xpad(kTile * kp), sx(kTile * groups);
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, rows - r0));
    // Copy the tile's rows, zero-padded to whole groups, with each group's sum.
    std::fill(xpad.begin(), xpad.end(), 0.0f);
    for (int r = 0; r < nr; ++r) {
      std::memcpy(xpad.data() + r * kp, xs + (r0 + r) * in, in * sizeof(float));
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = xpad.data() + r * kp + g * kGroup;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
        sx[r * groups + g] = hsum(s);
      }
    }
    const RowsFn fn = kRows[nr];
    const float* xpp = xpad.data();
    const float* sxp = sx.data();
    float* yt = yp + r0 * out;
    // Output rows split across torch's intra-op threads (one with set_num_threads(1)).
    at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
      fn(xpp, sxp, groups, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
         mins.data_ptr<float>(), yt, out, o0, o1);
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(graphrunner_int4, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_int4, CPU, m) { m.impl("linear", &linear); }
"""


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


def _build_kernel() -> str | None:
    """Build (or load the cached build of) the C++ kernel; None on success,
    else why not. Called through :func:`int4_kernel_status` (cached), so once
    per process: the op's fake is registered once."""
    if os.environ.get(KERNEL_ENV, "") == "torch":
        return f"{KERNEL_ENV}=torch"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the C++ kernel needs AVX2 and FMA; this CPU's capability is {capability}"
    try:
        from torch.utils import cpp_extension

        # is_python_module=False: the library's TORCH_LIBRARY block registers the
        # op with the dispatcher, so compiled code calls it without Python.
        cpp_extension.load_inline(
            name=_KERNEL_NAME,
            cpp_sources=[_KERNEL_SOURCE],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off"],
            is_python_module=False,
            no_implicit_headers=True,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path runs
        return f"building the C++ kernel failed ({type(e).__name__}: {str(e).strip()[:300]})"
    torch.library.register_fake("graphrunner_int4::linear", _fake_linear)
    return None


def _fake_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """The op's output for tracing: ``[rows, out]`` float32, no data."""
    return x.new_empty(x.shape[0], packed.shape[0])


@functools.cache
def int4_kernel_status() -> str | None:
    """None where the C++ kernel runs here (building it on first call), else
    why not, warned once: the torch path (dequantize-then-matmul) runs instead."""
    why = _build_kernel()
    if why is not None:
        warn_at_caller(
            f"int4 weights: {why}; falling back to dequantize-then-matmul in torch "
            "(correct but slower than float32)"
        )
    return why


def int4_kernel() -> bool:
    """Whether the C++ kernel runs here (building it on first call)."""
    return int4_kernel_status() is None


class Int4Linear(nn.Module):
    """Group-wise 4-bit linear: ``[..., in]`` float32 ``-> [..., out]`` float32.

    Buffers: ``packed`` uint8 ``[out, groups * 16]``, ``scales`` and ``mins``
    float32 ``[out, groups]`` (:func:`quantize_int4`). ``kernel`` picks the
    product: None (the C++ kernel where it builds, else the torch path),
    True (the kernel; RuntimeError where it cannot run) or False (torch).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, weight: torch.Tensor, kernel: bool | None = None) -> None:
        super().__init__()
        packed, scales, mins = quantize_int4(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.out_features, self.in_features = weight.shape
        if kernel is None:
            kernel = int4_kernel()
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
        self.packed[start:end] = weight.packed
        self.scales[start:end] = weight.scales.float()
        self.mins[start:end] = weight.mins.float()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` this linear multiplies by."""
        return dequantize_int4(self.packed, self.scales, self.mins, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return int4_reference_linear(x, self.packed, self.scales, self.mins)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.graphrunner_int4.linear(flat, self.packed, self.scales, self.mins)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ AVX2 kernel" if self.kernel else "dequantize + F.linear"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP} ({path}), float32 activations"
        )
