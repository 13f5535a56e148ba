// Compact-weight products with float32 activations (graphrunner_ref/model/
// cpu_kernels.py builds this file):
//
// graphrunner_int4::linear: 4-bit weights in groups of 32 input columns
// (int4_linear.py describes the format and holds the torch reference):
//   y[r, o] = sum_g scale[o, g] * (x[r, g] . q[o, g]) + min[o, g] * sum(x[r, g])
// graphrunner_int8::linear: int8 weights, one scale per output channel
// (int8_linear.py):  y[r, o] = scale[o] * (x[r] . q[o])
// graphrunner_fp16::linear: float16 weights, packed (fp16_linear.py):  y[r, o] = x[r] . w[o]
//
// AVX2/FMA, 8 lanes at a time. Each output row accumulates over its groups
// alternately into two accumulators (even and odd groups: two FMA chains in
// flight), in an order that does not depend on how many rows run together:
// a row's result never depends on the rows beside it, bit for bit. (An
// AVX-512 build of the same loop, 16 codes widened per instruction, was
// measured on a Zen 4 EPYC and not kept: 4% faster at 1 row, 25% slower at 8.)
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The mins' share of output row o for input row r: min_g times the group's input sum.
inline float min_share(const float* mins, const float* sums, int64_t groups) {
  float m = 0.0f;
  for (int64_t g = 0; g < groups; ++g) m = std::fma(mins[g], sums[g], m);
  return m;
}

// R input rows (each padded to groups * 32 floats, zeros past `in`) against
// output rows [o0, o1), 8 lanes at a time.
template <int R>
void rows_avx2(const float* xp, const float* sx, int64_t groups, const uint8_t* packed,
               const float* scales, const float* mins, float* y, int64_t out, int64_t o0,
               int64_t o1) {
  const int64_t kp = groups * kGroup;
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wq = packed + o * groups * 16;
    const float* sc = scales + o * groups;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      // 16 bytes: codes 0..15 in the low nibbles, 16..31 in the high ones. Each
      // half is zero-extended to 32-bit lanes straight from memory and its
      // nibbles split there (fewer shuffles than splitting the bytes first).
      const uint8_t* bytes = wq + g * 16;
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
      const __m256i b1 =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));  // codes 0..7
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));  // codes 8..15
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));   // codes 16..23
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));   // codes 24..31
      const __m256 d = _mm256_broadcast_ss(sc + g);
      for (int r = 0; r < R; ++r) {
        const float* xg = xp + r * kp + g * kGroup;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
        acc[r][g & 1] = _mm256_fmadd_ps(t, d, acc[r][g & 1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dot = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
      y[r * out + o] = dot + min_share(mins + o * groups, sx + r * groups, groups);
    }
  }
}

using RowsFn = void (*)(const float*, const float*, int64_t, const uint8_t*, const float*,
                        const float*, float*, int64_t, int64_t, int64_t);
constexpr int kTile = 8;
constexpr RowsFn kAvx2[kTile + 1] = {nullptr,      rows_avx2<1>, rows_avx2<2>,
                                     rows_avx2<3>, rows_avx2<4>, rows_avx2<5>,
                                     rows_avx2<6>, rows_avx2<7>, rows_avx2<8>};

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
    const RowsFn fn = kAvx2[nr];
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

// int8: R input rows against output rows [o0, o1), 16 weights an iteration
// (two accumulators, as above), the columns past the last 16 in scalar FMAs.
template <int R>
void rows_int8(const float* x, int64_t in, const int8_t* q, const float* scales, float* y,
               int64_t out, int64_t o0, int64_t o1) {
  const int64_t body = in - in % 16;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* w = q + o * in;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += 16) {
      const __m128i* b = reinterpret_cast<const __m128i*>(w + i);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(b)));
      const __m256 w1 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i + 8))));
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * in + i;
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float dot = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
      for (int64_t i = body; i < in; ++i) dot = std::fma(static_cast<float>(w[i]), x[r * in + i], dot);
      y[r * out + o] = dot * scales[o];
    }
  }
}

using Int8Fn = void (*)(const float*, int64_t, const int8_t*, const float*, float*, int64_t,
                        int64_t, int64_t);
constexpr Int8Fn kInt8[kTile + 1] = {nullptr,      rows_int8<1>, rows_int8<2>,
                                     rows_int8<3>, rows_int8<4>, rows_int8<5>,
                                     rows_int8<6>, rows_int8<7>, rows_int8<8>};

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "graphrunner_int8::linear: x must be a 2-D float32 CPU tensor [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "graphrunner_int8::linear: weight must be contiguous int8 [out, in=", x.size(1),
              "], got ", weight.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == weight.size(0),
              "graphrunner_int8::linear: scales must be contiguous float32 [out]");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const float* xs = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, rows - r0));
    const Int8Fn fn = kInt8[nr];
    at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
      fn(xs + r0 * in, in, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), yp + r0 * out,
         out, o0, o1);
    });
  }
  return y;
}


// fp16: the weight is packed in blocks of 8 output rows (fp16_linear.py):
// [out / 8][in8 / 8][8 rows][8 columns], zero rows and columns past `out` and
// `in`, so each block streams from memory in order. Every block is read once
// from memory and then, from cache, by each tile of up to 3 input rows (the
// rows copied into zero-padded rows of in8 floats): R rows against P of the
// block's outputs at a time (R * P accumulators, x loaded once a column chunk
// for all P), 8 columns an FMA. Each (row, output) pair has one accumulator
// filled in column order, whatever R and P are.
constexpr int kFp16Tile = 3;

// The 8 float16 weights at w, widened to float32.
inline __m256 load8(const uint16_t* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

template <int R>
void block_fp16(const float* x, int64_t in8, const uint16_t* block, float* y, int64_t out,
                int64_t o) {
  constexpr int P = R == 1 ? 8 : 4;
  for (int p0 = 0; p0 < 8; p0 += P) {
    __m256 acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < P; ++k) acc[r][k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < in8; c += 8) {
      const uint16_t* chunk = block + c * 8 + p0 * 8;
      __m256 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * in8 + c);
      for (int k = 0; k < P; ++k) {
        const __m256 wv = load8(chunk + k * 8);
        for (int r = 0; r < R; ++r) acc[r][k] = _mm256_fmadd_ps(wv, xv[r], acc[r][k]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < P && o + p0 + k < out; ++k) y[r * out + o + p0 + k] = hsum(acc[r][k]);
  }
}

using Fp16Fn = void (*)(const float*, int64_t, const uint16_t*, float*, int64_t, int64_t);
constexpr Fp16Fn kFp16[kFp16Tile + 1] = {nullptr, block_fp16<1>, block_fp16<2>, block_fp16<3>};

at::Tensor linear_fp16(const at::Tensor& x, const at::Tensor& packed, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "graphrunner_fp16::linear: x must be a 2-D float32 CPU tensor [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1), in8 = (in + 7) / 8 * 8, blocks = (out + 7) / 8;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kHalf && packed.is_contiguous() &&
                  packed.size(0) == blocks && packed.size(1) == 8 * in8,
              "graphrunner_fp16::linear: packed must be contiguous float16 [", blocks, ", ",
              8 * in8, "] for out=", out, " and in=", in, ", got ", packed.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const float* xs = xc.data_ptr<float>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  std::vector<float> xpad(rows * in8, 0.0f);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(xpad.data() + r * in8, xs + r * in, in * sizeof(float));
  const float* xp = xpad.data();
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < rows; r0 += kFp16Tile) {
        const int nr = static_cast<int>(std::min<int64_t>(kFp16Tile, rows - r0));
        kFp16[nr](xp + r0 * in8, in8, w + b * 8 * in8, yp + r0 * out, out, b * 8);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(graphrunner_int4, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_int4, CPU, m) { m.impl("linear", &linear); }

TORCH_LIBRARY(graphrunner_int8, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_int8, CPU, m) { m.impl("linear", &linear_int8); }

TORCH_LIBRARY(graphrunner_fp16, m) {
  m.def("linear(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_fp16, CPU, m) { m.impl("linear", &linear_fp16); }
