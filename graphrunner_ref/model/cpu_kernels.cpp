// Compact-weight products with float32 activations (graphrunner_ref/model/
// cpu_kernels.py builds this file):
//
// graphrunner_int4::linear: 4-bit weights in groups of 32 input columns
// (int4_linear.py describes the format and holds the torch reference):
//   y[r, o] = sum_g scale[o, g] * (x[r, g] . q[o, g]) + min[o, g] * sum(x[r, g])
// The codes come blocked (int4_linear.block_codes): output rows in blocks of
// 4, a block's groups in order, each group's 16 bytes of its 4 rows side by
// side (64 bytes, one cache line). A step at a few rows streams the weights
// from memory; four rows' codes in one stream, fetched a few blocks ahead,
// took a 30-layer SmolLM2-shaped pass at 1 row from 16.6 to 12.3 ms (median,
// interleaved in one process, AVX2 EPYC) against four rows' own streams.
// graphrunner_int8::linear: int8 weights, one scale per output channel
// (int8_linear.py):  y[r, o] = scale[o] * (x[r] . q[o])
// graphrunner_fp16::linear: float16 weights, packed (fp16_linear.py):  y[r, o] = x[r] . w[o]
//
// AVX2/FMA, 8 lanes at a time. int4: each input row is first rewritten once
// per call (its own floats only) so that a group's 16 bytes need no nibble
// split for half their codes: byte j of a group is b = lo + 16 * hi (lo code j,
// hi code j + 16), so
//   x[j] * lo + x[j + 16] * hi = (x[j + 16] / 16) * b + (x[j] - x[j + 16] / 16) * lo
// (x / 16 is exact; the difference rounds once, as a product does). Per group:
// two byte-to-lane widenings, two masks and four conversions make the 32
// weights' floats (b for bytes 0..7 and 8..15, lo for the same), four FMAs
// against the rewritten row and one FMA by the group's scale. One accumulator
// per (row, output), groups in order; rows run in tiles of up to 8 and
// outputs in blocks of up to 4 (fewer for more rows, the block's tail reusing
// the last output), so a row's arithmetic never depends on the rows or
// outputs beside it, bit for bit. The mins' share, min_g * sum(x_g), starts
// each accumulator (8 groups a lane). (An AVX-512 build of the older loop,
// 16 codes widened per instruction, was measured on a Zen 4 EPYC and not
// kept: 4% faster at 1 row, 25% slower at 8.)
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kGroup = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// mins . sums over a row's groups, 8 at a time (a fixed order for a given row).
inline float min_share8(const float* mins, const float* sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(sums + g), acc);
  float m = hsum(acc);
  for (; g < groups; ++g) m = std::fma(mins[g], sums[g], m);
  return m;
}

// Output rows per block of the blocked codes, and the bytes between one
// group's codes and the next within a row.
constexpr int64_t kBlockRows = 4;
constexpr int64_t kCodeStride = kBlockRows * 16;

// Row o's codes in the blocked layout: group g's 16 bytes at + g * kCodeStride.
inline const uint8_t* row_codes(const uint8_t* blocked, int64_t groups, int64_t o) {
  return blocked + (o / kBlockRows) * groups * kCodeStride + (o % kBlockRows) * 16;
}

// At a few rows a step the 4-bit weights stream from memory, and the hardware
// prefetcher alone leaves the kernel waiting on them. The block kAheadBlocks
// past the one being multiplied is asked for while this one is: one line of
// its codes a group, and one of its scales and of its mins every 4 groups
// (a block's 4 rows hold 16 bytes of each a group), spread over the group
// loop. Asked for all at once as a block began (three dozen lines for
// SmolLM2's 18 groups), the requests queued behind each other and the kernel
// waited on them: a 30-layer SmolLM2-shaped pass at 1 row took 13.7 ms that
// way, 9.9 ms spread, 12.2 ms with no software prefetch at all (medians,
// interleaved in one process, AVX2 EPYC; 1 to 4 blocks ahead within noise).
// At hidden 2048 (3 Llama-1B-shaped layers, a block ~6 KB of codes) the same:
// 23.4 ms in a burst, 16.4 spread, 1 to 4 blocks ahead within noise.
constexpr int64_t kAheadBlocks = 2;

// The lines of one block ahead, requested group by group (see above); a pass
// that starts no block, or whose block ahead holds no row it multiplies,
// requests nothing.
struct BlockPrefetch {
  const char* codes = nullptr;
  const char* scales = nullptr;
  const char* mins = nullptr;

  // For a pass of P output rows from o, of [.., end): the block kAheadBlocks
  // past o's, once per block whatever P (and wherever a thread's rows begin),
  // if that block holds a row before end.
  static BlockPrefetch ahead(const uint8_t* blocked, const float* scales, const float* mins,
                             int64_t groups, int64_t o, int P, int64_t end) {
    const int64_t b = o / kBlockRows + kAheadBlocks;
    if (o % kBlockRows >= P || b * kBlockRows >= end) return {};
    return {reinterpret_cast<const char*>(blocked + b * groups * kCodeStride),
            reinterpret_cast<const char*>(scales + b * kBlockRows * groups),
            reinterpret_cast<const char*>(mins + b * kBlockRows * groups)};
  }

  // Group g's share: its line of codes, and every 4th group a line of scales and of mins.
  // Always inlined: left a call, GCC's mod/ref analysis finds it writes no
  // memory and drops every call to it, prefetches and all.
  __attribute__((always_inline)) inline void group(int64_t g) const {
    if (codes == nullptr) return;
    _mm_prefetch(codes + g * kCodeStride, _MM_HINT_T0);
    if (g % 4 == 0) {
      _mm_prefetch(scales + g * 16, _MM_HINT_T0);
      _mm_prefetch(mins + g * 16, _MM_HINT_T0);
    }
  }
};

// A row rewritten for the int4 kernel (see the top of the file): per group of
// the zero-padded row x, 32 floats [x[16..32) / 16, x[0..16) - x[16..32) / 16],
// and the group's sum of x.
void int4_row(const float* x, int64_t groups, float* xt, float* sums) {
  const __m256 sixteenth = _mm256_set1_ps(0.0625f);
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    float* tg = xt + g * kGroup;
    const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
    const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
    const __m256 a0 = _mm256_mul_ps(x2, sixteenth), a1 = _mm256_mul_ps(x3, sixteenth);
    _mm256_storeu_ps(tg, a0);
    _mm256_storeu_ps(tg + 8, a1);
    _mm256_storeu_ps(tg + 16, _mm256_sub_ps(x0, a0));
    _mm256_storeu_ps(tg + 24, _mm256_sub_ps(x1, a1));
    sums[g] = hsum(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
  }
}

// R rewritten input rows against the P output rows os[0..P): one accumulator
// per pair, the group's 32 weights widened once for all R rows.
template <int R, int P>
inline void block_int4(const float* xt, const float* sx, int64_t groups, const uint8_t* blocked,
                       const float* scales, const float* mins, float* y, int64_t out,
                       const int64_t (&os)[P], const BlockPrefetch& ahead) {
  const int64_t kp = groups * kGroup;
  const __m256i low = _mm256_set1_epi32(0x0F);
  const uint8_t* wq[P];
  const float* sc[P];
  for (int p = 0; p < P; ++p) {
    wq[p] = row_codes(blocked, groups, os[p]);
    sc[p] = scales + os[p] * groups;
  }
  // Each accumulator starts with its mins' share, 8 groups a lane (masked past the last).
  __m256 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 8) {
    const int live = static_cast<int>(std::min<int64_t>(8, groups - g));
    const __m256i mask =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; ++r) {
      const __m256 s8 = _mm256_maskload_ps(sx + r * groups + g, mask);
      for (int p = 0; p < P; ++p)
        acc[r][p] =
            _mm256_fmadd_ps(_mm256_maskload_ps(mins + os[p] * groups + g, mask), s8, acc[r][p]);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    ahead.group(g);
    for (int p = 0; p < P; ++p) {
      const uint8_t* bytes = wq[p] + g * kCodeStride;
      const __m256i b0 =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
      const __m256i b1 =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
      const __m256 w0 = _mm256_cvtepi32_ps(b0);                           // bytes 0..7
      const __m256 w1 = _mm256_cvtepi32_ps(b1);                           // bytes 8..15
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));  // codes 0..7
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));  // codes 8..15
      const __m256 d = _mm256_broadcast_ss(sc[p] + g);
      for (int r = 0; r < R; ++r) {
        const float* tg = xt + r * kp + g * kGroup;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(tg));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(tg + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(tg + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(tg + 24), t);
        acc[r][p] = _mm256_fmadd_ps(t, d, acc[r][p]);
      }
    }
  }
  // Each accumulator's 8 lanes summed as ((0+1)+(2+3)) + ((4+5)+(6+7)): four
  // at a time (horizontal adds) or one alone, the same sums either way.
  for (int r = 0; r < R; ++r) {
    float v[P];
    if constexpr (P == 4) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                      _mm256_hadd_ps(acc[r][2], acc[r][3]));
      _mm_storeu_ps(v, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else {
      for (int p = 0; p < P; ++p) {
        const __m256 h1 = _mm256_hadd_ps(acc[r][p], acc[r][p]);
        const __m256 h = _mm256_hadd_ps(h1, h1);
        v[p] = _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      }
    }
    for (int p = 0; p < P; ++p) y[r * out + os[p]] = v[p];
  }
}

// Outputs per block for R rows: as many as the 16 registers hold accumulators for.
template <int R>
constexpr int kOutBlock = R <= 2 ? 4 : (R <= 4 ? 2 : 1);

// R rewritten input rows against output rows [o0, o1), kOutBlock<R> at a time;
// a short last block repeats output o1 - 1 (the same value, written again).
template <int R>
void rows_avx2(const float* xt, const float* sx, int64_t groups, const uint8_t* blocked,
               const float* scales, const float* mins, float* y, int64_t out, int64_t o0,
               int64_t o1) {
  constexpr int P = kOutBlock<R>;
  int64_t os[P];
  for (int64_t o = o0; o < o1; o += P) {
    for (int p = 0; p < P; ++p) os[p] = std::min(o + p, o1 - 1);
    block_int4<R, P>(xt, sx, groups, blocked, scales, mins, y, out, os,
                     BlockPrefetch::ahead(blocked, scales, mins, groups, o, P, o1));
  }
}

using RowsFn = void (*)(const float*, const float*, int64_t, const uint8_t*, const float*,
                        const float*, float*, int64_t, int64_t, int64_t);
constexpr int kTile = 8;
constexpr RowsFn kAvx2[kTile + 1] = {nullptr,      rows_avx2<1>, rows_avx2<2>,
                                     rows_avx2<3>, rows_avx2<4>, rows_avx2<5>,
                                     rows_avx2<6>, rows_avx2<7>, rows_avx2<8>};

// The int4 ops' argument checks (op names the op in the errors); the groups.
// The output rows are the scales' rows.
int64_t check_int4(const char* op, const at::Tensor& x, const at::Tensor& blocked,
                   const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-D float32 CPU tensor [rows, in]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat &&
                  mins.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  mins.is_contiguous() && mins.sizes() == scales.sizes(),
              op, ": scales and mins must be contiguous float32 [out, groups], got ",
              scales.sizes(), " and ", mins.sizes());
  const int64_t in = x.size(1), out = scales.size(0), groups = scales.size(1);
  TORCH_CHECK((in + kGroup - 1) / kGroup == groups, op, ": scales ", scales.sizes(),
              " do not fit in=", in, " (expected ", (in + kGroup - 1) / kGroup, " groups)");
  TORCH_CHECK(blocked.dim() == 2 && blocked.scalar_type() == at::kByte &&
                  blocked.is_contiguous() &&
                  blocked.size(0) == (out + kBlockRows - 1) / kBlockRows &&
                  blocked.size(1) == groups * kCodeStride,
              op, ": blocked codes must be contiguous uint8 [", (out + kBlockRows - 1) / kBlockRows,
              ", ", groups * kCodeStride, "] for out=", out, " (int4_linear.block_codes), got ",
              blocked.sizes());
  return groups;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocked, const at::Tensor& scales,
                  const at::Tensor& mins) {
  const int64_t groups = check_int4("graphrunner_int4::linear", x, blocked, scales, mins);
  const int64_t rows = x.size(0), in = x.size(1), out = scales.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const int64_t kp = groups * kGroup;
  const float* xs = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Scratch for one tile (no more rows than the call has: a 1-row call
  // clears kp floats, not 8 * kp).
  const int64_t tile = std::min<int64_t>(rows, kTile);
  std::vector<float> xpad(kp, 0.0f), xt(tile * kp), sx(tile * groups);
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, rows - r0));
    for (int r = 0; r < nr; ++r) {  // each row alone, zero-padded to whole groups
      std::memcpy(xpad.data(), xs + (r0 + r) * in, in * sizeof(float));
      int4_row(xpad.data(), groups, xt.data() + r * kp, sx.data() + r * groups);
    }
    const RowsFn fn = kAvx2[nr];
    const float* xtp = xt.data();
    const float* sxp = sx.data();
    float* yt = yp + r0 * out;
    // Output rows split across torch's intra-op threads (one with set_num_threads(1)).
    at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
      fn(xtp, sxp, groups, blocked.data_ptr<uint8_t>(), scales.data_ptr<float>(),
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


// int8 in groups (graphrunner_int8::linear_grouped, int8_linear.py): int8 codes
// in groups of 32 input columns with one float scale each (GGUF's Q8_0 layout,
// -127..127), float32 activations:  y[r, o] = sum_g scale[o, g] * (x[r, g] . q[o, g]).
// A tile of up to 8 rows (zero-padded to whole groups) against each output
// row; each row's groups alternate between two accumulators, as int4's do.
template <int R>
inline void int8g_group(const int8_t* q, float d, const float* xp, int64_t kp, int64_t g,
                        __m256 (&acc)[R]) {
  __m256 w[4];
  for (int k = 0; k < 4; ++k)
    w[k] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k))));
  const __m256 dv = _mm256_set1_ps(d);
  for (int r = 0; r < R; ++r) {
    const float* xg = xp + r * kp + g * kGroup;
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), t);
    t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), t);
    acc[r] = _mm256_fmadd_ps(t, dv, acc[r]);
  }
}

// The output row this many bytes of codes ahead is requested while a row is
// multiplied, a line every 2 groups and a line of its scales every 16 (the
// LM head at 1 row streams ~30 MB a step: SmolLM2's ran 1.16x to 1.37x
// faster in three interleaved A/B runs on an AVX2 EPYC, 3.7 to 2.7 ms at
// best; 4 to 12 rows of 576 ahead within noise).
constexpr int64_t kInt8AheadBytes = 3072;

// That row's lines for a pass over row o of [.., end): none where it would
// lie at or past end (past the weight's end a pointer may not even be formed).
struct RowPrefetch {
  const char* codes = nullptr;
  const char* scales = nullptr;

  static RowPrefetch ahead(const int8_t* q, const float* scales, int64_t groups, int64_t o,
                           int64_t end) {
    const int64_t kp = groups * kGroup, rows = std::max<int64_t>(1, kInt8AheadBytes / kp);
    if (o + rows >= end) return {};
    return {reinterpret_cast<const char*>(q + (o + rows) * kp),
            reinterpret_cast<const char*>(scales + (o + rows) * groups)};
  }

  // Group g's share: a line of codes every 2 groups, of scales every 16.
  // Always inlined, as BlockPrefetch::group (GCC drops such a call otherwise).
  __attribute__((always_inline)) inline void group(int64_t g) const {
    if (codes == nullptr || g % 2 != 0) return;
    _mm_prefetch(codes + g * kGroup, _MM_HINT_T0);
    if (g % 16 == 0) _mm_prefetch(scales + g * 4, _MM_HINT_T0);
  }
};

template <int R>
void rows_int8g(const float* xp, int64_t groups, const int8_t* q, const float* scales, float* y,
                int64_t out, int64_t o0, int64_t o1) {
  const int64_t kp = groups * kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wq = q + o * kp;
    const float* sc = scales + o * groups;
    const RowPrefetch next = RowPrefetch::ahead(q, scales, groups, o, o1);
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      next.group(g);
      int8g_group<R>(wq + g * kGroup, sc[g], xp, kp, g, even);
      int8g_group<R>(wq + (g + 1) * kGroup, sc[g + 1], xp, kp, g + 1, odd);
    }
    if (g < groups) int8g_group<R>(wq + g * kGroup, sc[g], xp, kp, g, even);
    for (int r = 0; r < R; ++r) y[r * out + o] = hsum(_mm256_add_ps(even[r], odd[r]));
  }
}

using Int8gFn = void (*)(const float*, int64_t, const int8_t*, const float*, float*, int64_t,
                         int64_t, int64_t);
constexpr Int8gFn kInt8g[kTile + 1] = {nullptr,       rows_int8g<1>, rows_int8g<2>,
                                       rows_int8g<3>, rows_int8g<4>, rows_int8g<5>,
                                       rows_int8g<6>, rows_int8g<7>, rows_int8g<8>};

// The grouped int8 ops' arguments checked (op names the op): the groups of x's columns.
int64_t check_int8_grouped(const char* op, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-D float32 CPU tensor [rows, in]");
  const int64_t in = x.size(1), out = weight.size(0);
  const int64_t groups = (in + kGroup - 1) / kGroup, kp = groups * kGroup;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) == kp,
              op, ": weight must be contiguous int8 [out, ", kp, "] for in=", in, ", got ",
              weight.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == out * groups,
              op, ": scales must be contiguous float32 [out, ", groups, "]");
  return groups;
}

at::Tensor linear_int8_grouped(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& scales) {
  const int64_t groups = check_int8_grouped("graphrunner_int8::linear_grouped", x, weight, scales);
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  const int64_t kp = groups * kGroup;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const float* xs = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> xpad(std::min<int64_t>(rows, kTile) * kp);
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, rows - r0));
    std::fill(xpad.begin(), xpad.end(), 0.0f);
    for (int r = 0; r < nr; ++r)
      std::memcpy(xpad.data() + r * kp, xs + (r0 + r) * in, in * sizeof(float));
    const Int8gFn fn = kInt8g[nr];
    const float* xpp = xpad.data();
    float* yt = yp + r0 * out;
    at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
      fn(xpp, groups, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), yt, out, o0, o1);
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


// int4 x q8 (graphrunner_int4::linear_q8, int4_q8.py): the same 4-bit weights,
// each input row's groups of 32 quantized to int8 with one float scale per
// group (d = max|x_g| / 127, q = round-half-even(x * 127 / max|x_g|)), as
// llama.cpp's Q8 blocks are. Per group an integer dot of 32 unsigned codes
// with 32 signed activations, exact in int32 whichever instructions run it:
//   y[r, o] = sum_g (scale[o, g] * d[r, g]) * (q[o, g] . qx[r, g]) + min[o, g] * d[r, g] * sum(qx[r, g])
// The min's share takes the quantized row's sum (as llama.cpp's Q8_1 blocks
// do), so the product is the dequantized row's times the weight, and each
// activation's rounding meets its own weight, not the weight minus the group's
// min: the rounding errors cancel as the weights' signs do. (Taking the
// floats' own sum there, as an earlier version did, left the errors times
// weights that are all of one sign: SmolLM2 kept 12.4 leading tokens of 32 of
// float32 transformers', against llama.cpp's 19.9.) The paths
// differ only in the instruction of the integer dot, so their outputs are
// equal bit for bit; each row's float accumulation order is fixed (two
// chains, even and odd groups), whatever the batch.
//
// A row's groups, quantized: codes (groups * 32 int8), scales d, the codes'
// sums times d (the dequantized group's sum, one rounding) and the sums
// themselves (n, exact: the tiled head's offset).
void quantize_row_q8(const float* x, int64_t groups, int8_t* q, float* d, float* s, int32_t* n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(xg + 8 * k);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    d[g] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i i[4];
    for (int k = 0; k < 4; ++k)
      i[k] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[k], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // Packing interleaves the 128-bit lanes; the permute puts codes back in order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup),
                        _mm256_permutevar8x32_epi32(p, order));
    // The codes' sum, exact in int32 (the packs' saturation cannot bite: |x * inv| <= 127).
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    n[g] = _mm_cvtsi128_si32(t);
    s[g] = d[g] * static_cast<float>(n[g]);
  }
}

// Up to kTile rows of x [rows, in] quantized as above, each alone, zero-padded
// to whole groups: the scratch every int4-q8 product (blocked, tiles, head) reads.
struct Q8Rows {
  int64_t in, groups, kp;
  std::vector<float> xpad, xd, sx;
  std::vector<int8_t> xq;
  std::vector<int32_t> xn;
  Q8Rows(int64_t in, int64_t groups, int64_t rows)
      : in(in), groups(groups), kp(groups * kGroup), xpad(kp, 0.0f), xd(rows * groups),
        sx(rows * groups), xq(rows * kp), xn(rows * groups) {}
  // Rows r0 .. r0 + nr of x.
  void quantize(const float* x, int64_t r0, int nr) {
    for (int r = 0; r < nr; ++r) {
      std::memcpy(xpad.data(), x + (r0 + r) * in, in * sizeof(float));
      quantize_row_q8(xpad.data(), groups, xq.data() + r * kp, xd.data() + r * groups,
                      sx.data() + r * groups, xn.data() + r * groups);
    }
  }
};

// x [rows, in]'s rows quantized kTile at a time, body(q, r0, nr) after each tile.
template <class Body>
void over_q8_rows(const at::Tensor& x, int64_t groups, const Body& body) {
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0);
  Q8Rows q(x.size(1), groups, std::min<int64_t>(rows, kTile));
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, rows - r0));
    q.quantize(xc.data_ptr<float>(), r0, nr);
    body(static_cast<const Q8Rows&>(q), r0, nr);
  }
}

// The 32 codes of a group (byte j: code j low, code j + 16 high) in order, one a byte.
inline __m256i codes32(const uint8_t* bytes) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// The integer dot of each path: 8 int32 lanes, lane i the sum of bytes 4i..4i+3's
// products. AVX2: maddubs (u8 x s8 pairs to int16: 15 * 127 * 2 cannot saturate),
// then madd by ones (pairs of int16 to int32).
struct DotAvx2 {
  static inline __m256i dot(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  }
};

template <int R, class Dot>
inline void q8_group(const uint8_t* bytes, float dw, const int8_t* xq, const float* xd,
                     int64_t kp, int64_t groups, int64_t g, __m256 (&acc)[R]) {
  const __m256i w = codes32(bytes);
  for (int r = 0; r < R; ++r) {
    const __m256i xv =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * kp + g * kGroup));
    const __m256 p = _mm256_cvtepi32_ps(Dot::dot(w, xv));
    acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xd[r * groups + g]), acc[r]);
  }
}

// Outputs per pass for R rows (a block's 4 share its cache lines of codes).
template <int R>
constexpr int kQ8OutBlock = R == 1 ? 4 : (R == 2 ? 2 : 1);

// R quantized rows against the P output rows os[0..P): per pair two chains
// (even and odd groups), then the mins' share; the same sums whatever P is.
template <int R, int P, class Dot>
inline void block_q8(const int8_t* xq, const float* xd, const float* sx, int64_t groups,
                     const uint8_t* blocked, const float* scales, const float* mins, float* y,
                     int64_t out, const int64_t (&os)[P], const BlockPrefetch& ahead) {
  const int64_t kp = groups * kGroup;
  const uint8_t* wq[P];
  const float* sc[P];
  __m256 even[P][R], odd[P][R];
  for (int p = 0; p < P; ++p) {
    wq[p] = row_codes(blocked, groups, os[p]);
    sc[p] = scales + os[p] * groups;
    for (int r = 0; r < R; ++r) even[p][r] = odd[p][r] = _mm256_setzero_ps();
  }
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    ahead.group(g);
    ahead.group(g + 1);
    for (int p = 0; p < P; ++p) {
      q8_group<R, Dot>(wq[p] + g * kCodeStride, sc[p][g], xq, xd, kp, groups, g, even[p]);
      q8_group<R, Dot>(wq[p] + (g + 1) * kCodeStride, sc[p][g + 1], xq, xd, kp, groups, g + 1,
                       odd[p]);
    }
  }
  if (g < groups) {
    ahead.group(g);
    for (int p = 0; p < P; ++p)
      q8_group<R, Dot>(wq[p] + g * kCodeStride, sc[p][g], xq, xd, kp, groups, g, even[p]);
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) {
      const float dot = hsum(_mm256_add_ps(even[p][r], odd[p][r]));
      y[r * out + os[p]] = dot + min_share8(mins + os[p] * groups, sx + r * groups, groups);
    }
}

// R quantized rows against output rows [o0, o1), kQ8OutBlock<R> at a time; a
// short last pass repeats output o1 - 1 (the same value, written again).
template <int R, class Dot>
inline void rows_q8_body(const int8_t* xq, const float* xd, const float* sx, int64_t groups,
                         const uint8_t* blocked, const float* scales, const float* mins, float* y,
                         int64_t out, int64_t o0, int64_t o1) {
  constexpr int P = kQ8OutBlock<R>;
  int64_t os[P];
  for (int64_t o = o0; o < o1; o += P) {
    for (int p = 0; p < P; ++p) os[p] = std::min(o + p, o1 - 1);
    block_q8<R, P, Dot>(xq, xd, sx, groups, blocked, scales, mins, y, out, os,
                        BlockPrefetch::ahead(blocked, scales, mins, groups, o, P, o1));
  }
}

// Each path's entry: the body inlined whole (flatten) under the path's own
// target, so the dot's instruction is inlined too; the rest of the file stays AVX2.
template <int R>
__attribute__((flatten)) void rows_q8_avx2(const int8_t* xq, const float* xd, const float* sx,
                                           int64_t groups, const uint8_t* blocked,
                                           const float* scales, const float* mins, float* y,
                                           int64_t out, int64_t o0, int64_t o1) {
  rows_q8_body<R, DotAvx2>(xq, xd, sx, groups, blocked, scales, mins, y, out, o0, o1);
}

using Q8Fn = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                      const float*, const float*, float*, int64_t, int64_t, int64_t);

#define GRAPHRUNNER_Q8_ROWS(fn) \
  {nullptr, fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>, fn<7>, fn<8>}

// The paths, by number (cpu_features.py's table names them): 0 AVX2, 1 AVX-VNNI
// (256-bit vpdpbusd, VEX), 2 AVX-512 VNNI (the same instruction on 512-bit
// registers, two groups at a time, below). A path is compiled only where the
// compiler can target it (its functions alone, with a target attribute) and
// run only where the CPU has it (checked again in linear_q8).
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define GRAPHRUNNER_VNNI 1
struct DotAvxVnni {
  __attribute__((target("avxvnni"))) static inline __m256i dot(__m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
  }
};
struct DotAvx512Vnni {
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __m256i dot(
      __m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
  }
};

template <int R>
__attribute__((target("avxvnni"), flatten)) void rows_q8_avxvnni(
    const int8_t* xq, const float* xd, const float* sx, int64_t groups, const uint8_t* blocked,
    const float* scales, const float* mins, float* y, int64_t out, int64_t o0, int64_t o1) {
  rows_q8_body<R, DotAvxVnni>(xq, xd, sx, groups, blocked, scales, mins, y, out, o0, o1);
}

// Path 2, AVX-512 VNNI: two groups an instruction, on 512-bit registers. A
// register's low 8 lanes take group g and its high 8 lanes group g + 1, so
// they are the even and odd chains of block_q8, lane for lane: the same
// int32 dots, the same products and FMAs in the same order, the same output
// bit for bit (the odd count's last group joins the even chain at 256 bits).
// Measured on a Zen 4 EPYC (bench/results/int4-q8-zmm-zen4-cpu.md) against
// the same instruction on 256-bit registers, one group at a time: 1.03-1.09x
// at 1 row, 1.09-1.17x at 8 on SmolLM2's shapes; that path is not kept.
#define GRAPHRUNNER_ZMM __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// Groups g and g + 1 of one output row's codes, one a byte, in the order of
// their 64 activations: [g low nibbles, g high, g + 1 low, g + 1 high].
GRAPHRUNNER_ZMM inline __m512i codes64(const uint8_t* bytes) {
  const __m256i g0 =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i g1 = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + kCodeStride)));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(g0), g1, 1);
  // Each 128-bit lane's shift: 0 for the low nibbles, 4 for the high ones.
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                           0x0004000400040004, 0x0004000400040004);
  return _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0F));
}

// R quantized rows against the P output rows os[0..P), as block_q8.
template <int R, int P>
GRAPHRUNNER_ZMM inline void block_q8_zmm(const int8_t* xq, const float* xd, const float* sx,
                                         int64_t groups, const uint8_t* blocked,
                                         const float* scales, const float* mins, float* y,
                                         int64_t out, const int64_t (&os)[P],
                                         const BlockPrefetch& ahead) {
  const int64_t kp = groups * kGroup;
  // Lane i of a product's scale: pair element i / 8 (group g's low, g + 1's high).
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const uint8_t* wq[P];
  const float* sc[P];
  __m512 acc[P][R];
  for (int p = 0; p < P; ++p) {
    wq[p] = row_codes(blocked, groups, os[p]);
    sc[p] = scales + os[p] * groups;
    for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
  }
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    ahead.group(g);
    ahead.group(g + 1);
    for (int p = 0; p < P; ++p) {
      const __m512i w = codes64(wq[p] + g * kCodeStride);
      const __m128 dw = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sc[p] + g)));
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xq + r * kp + g * kGroup);
        const __m512 prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv));
        const __m128 dx =
            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xd + r * groups + g)));
        const __m512 s = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_mul_ps(dw, dx)));
        acc[p][r] = _mm512_fmadd_ps(prod, s, acc[p][r]);
      }
    }
  }
  __m256 even[P][R], odd[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) {
      even[p][r] = _mm512_castps512_ps256(acc[p][r]);
      odd[p][r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][r]), 1));
    }
  if (g < groups) {
    ahead.group(g);
    for (int p = 0; p < P; ++p)
      q8_group<R, DotAvx512Vnni>(wq[p] + g * kCodeStride, sc[p][g], xq, xd, kp, groups, g,
                                 even[p]);
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) {
      const float dot = hsum(_mm256_add_ps(even[p][r], odd[p][r]));
      y[r * out + os[p]] = dot + min_share8(mins + os[p] * groups, sx + r * groups, groups);
    }
}

template <int R>
GRAPHRUNNER_ZMM __attribute__((flatten)) void rows_q8_avx512vnni(
    const int8_t* xq, const float* xd, const float* sx, int64_t groups, const uint8_t* blocked,
    const float* scales, const float* mins, float* y, int64_t out, int64_t o0, int64_t o1) {
  constexpr int P = kQ8OutBlock<R>;
  int64_t os[P];
  for (int64_t o = o0; o < o1; o += P) {
    for (int p = 0; p < P; ++p) os[p] = std::min(o + p, o1 - 1);
    block_q8_zmm<R, P>(xq, xd, sx, groups, blocked, scales, mins, y, out, os,
                       BlockPrefetch::ahead(blocked, scales, mins, groups, o, P, o1));
  }
}

// Path 3, AVX-512 VNNI on tiles (graphrunner_int4::linear_q8_tiled, int4_q8.py's
// tile_codes): 16 output rows a tile, one a 32-bit lane. A tile's group g holds
// 8 quads of 32 bytes; quad j's byte t carries the codes of columns 4j + t % 4
// of output t / 4 (low nibble) and of output 8 + t / 4 (high nibble), so one
// 64-byte register of codes meets the row's 4 activations of quad j
// broadcast to every lane, and 8 vpdpbusd leave each output's whole integer
// dot of the group in its lane: exact, with no horizontal sum and no float
// work until the group ends. Then per (row, output), groups in order:
//   acc = fma(float(dot), scale * d, acc);  acc = fma(min, d * sum(qx), acc)
// (the same quantized rows as the other paths, another order of float sums:
// its outputs differ from theirs in the last bits). A tile's scales and mins
// are float16, as a Q4_1 file's are (int4_q8.py rounds the module's to
// them): at 1 row the tiles stream from memory, and float32 ones were a
// third of the bytes. The codes of a tile are
// unpacked once for every row of the batch, and a row's float work is three
// instructions a group for 16 outputs, where the paths above spend five a
// group for each output. Measured on a Zen 4 EPYC against path 2
// (bench/results/int4-q8-tiles-zen4-cpu.md): 1.55x at 1 row and 2.2-2.5x at
// 8 on SmolLM2's layer shapes, 0.92x at 1 row on its LM head's (streamed
// from memory), 2.2x at 8. A tile's codes are one stream, which the hardware
// prefetcher follows: asking for the tile two on, group by group, as the
// blocked paths do, took a batch-1 SmolLM2 step's tiles from 3.7 to 4.2 ms.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileGroupBytes = 256;

// dot += w . the 4 int8 activations at p, broadcast to every lane, in place.
// The broadcast rides in the instruction ({1to16}) and the dot stays in its
// register: the intrinsics' version broadcast each quad with an instruction
// of its own, and, the j loop rolled, GCC 12 copied each dot out and back
// around its vpdpbusd (16 moves a pass). A 512-row chunk of SmolLM2's
// shapes ran 1.16-1.18x faster (1.44-1.47x with the other hyperthread
// busy), outputs equal: a harness of both in one process, best of 8
// interleaved rounds, on a Xeon without AMX.
GRAPHRUNNER_ZMM inline void dpbusd_broadcast(__m512i& dot, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(dot)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

template <int R>
GRAPHRUNNER_ZMM __attribute__((flatten)) void tile_q8(const int8_t* xq, const float* xd,
                                                     const float* sx, int64_t groups,
                                                     const uint8_t* tile, const uint16_t* ts,
                                                     const uint16_t* tm, float* y, int64_t out,
                                                     int64_t o0) {
  const int64_t kp = groups * kGroup;
  // Each 256-bit half's shift: 0 for the low nibbles (outputs 0..7), 4 for the high.
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0x0004000400040004);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = tile + g * kTileGroupBytes;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i both = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * j)));
      const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(both, shifts), low4);
      for (int r = 0; r < R; ++r) dpbusd_broadcast(dot[r], w, xq + r * kp + g * kGroup + 4 * j);
    }
    const __m512 scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ts + g * kTileRows)));
    const __m512 min = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tm + g * kTileRows)));
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
    }
  }
  const int64_t live = std::min<int64_t>(kTileRows, out - o0);
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * out + o0, keep, acc[r]);
}

using TileFn = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                        const uint16_t*, const uint16_t*, float*, int64_t, int64_t);
constexpr TileFn tile_table[kTile + 1] = {nullptr,    tile_q8<1>, tile_q8<2>, tile_q8<3>,
                                          tile_q8<4>, tile_q8<5>, tile_q8<6>, tile_q8<7>,
                                          tile_q8<8>};

// int8 groups x q8 on tiles (graphrunner_int8::linear_grouped_q8_tiled: int4-q8's
// LM head where this path runs; int4_q8.py's tile_int8): int8_linear's grouped
// codes (symmetric, one scale a group) in tiles of 16 outputs, quad j of a
// group 64 bytes, byte 4 * lane + c the weight of column 4j + c for output
// lane, stored plus 128: vpdpbusd multiplies unsigned by signed bytes, so the
// weights go in as unsigned and each group's dot gains 128 times the row's
// code sum, taken off again (xn, each row's group sums of its codes):
//   acc = fma(float(dot - 128 * sum(qx)), scale * d, acc)
// per (row, output), groups in order. The row is the same quantized row as
// the projections' (quantize_row_q8), so the head reads 8-bit activations too;
// the offset rides on the row, not on a per-output table the head would
// stream (an int32 a group and output: an eighth of the codes' bytes).
constexpr int64_t kInt8TilesAhead = 2;

template <int R>
GRAPHRUNNER_ZMM __attribute__((flatten)) void tile_int8g_q8(const int8_t* xq, const int32_t* xn,
                                                           const float* xd, int64_t groups,
                                                           const uint8_t* tile, const float* ts,
                                                           float* y, int64_t out, int64_t o0,
                                                           bool fetch) {
  const int64_t kp = groups * kGroup;
  // The tile kInt8TilesAhead on, a line for each line read (where it exists):
  // the head's int8 tiles stream twice int4's bytes and the prefetcher alone
  // fell behind at 1 row (1.80 ms against the float kernel's 1.51, which fetches ahead).
  const int64_t ahead = kInt8TilesAhead * groups * 2 * kTileGroupBytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = tile + g * 2 * kTileGroupBytes;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      if (fetch) _mm_prefetch(reinterpret_cast<const char*>(codes + 64 * j + ahead), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(codes + 64 * j);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * kp + g * kGroup + 4 * j, sizeof(quad));
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(quad));
      }
    }
    const __m512 scale = _mm512_loadu_ps(ts + g * kTileRows);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * groups + g]));
      const __m512i exact = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * xn[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), s, acc[r]);
    }
  }
  const int64_t live = std::min<int64_t>(kTileRows, out - o0);
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * out + o0, keep, acc[r]);
}

using Int8TileFn = void (*)(const int8_t*, const int32_t*, const float*, int64_t, const uint8_t*,
                            const float*, float*, int64_t, int64_t, bool);
constexpr Int8TileFn int8_tile_table[kTile + 1] = {
    nullptr,          tile_int8g_q8<1>, tile_int8g_q8<2>, tile_int8g_q8<3>, tile_int8g_q8<4>,
    tile_int8g_q8<5>, tile_int8g_q8<6>, tile_int8g_q8<7>, tile_int8g_q8<8>};

// Path 4, AMX-INT8 on path 3's tiles (graphrunner_int4::linear_q8_amx): a
// prompt chunk's rows as one GEMM. Below kAmxMinRows rows (decode) the op runs
// path 3 unchanged. From there, per tile of 16 outputs, each group's codes are
// unpacked once (the 8 registers tile_q8 makes, stored: quad j is row j of an
// AMX B operand, lane n's 4 bytes output n's codes of columns 4j..4j+3) and
// reused by every block of 16 token rows of the chunk: tdpbsud multiplies the
// block's signed int8 activations of the group (A: 16 rows of 32 bytes,
// AmxRows below) by the unsigned codes (B), one group a tile multiply (K = 32,
// never 64: two groups summed in int32 would lose their scales), into 16 x 16
// exact int32 dots. Each token row's 16 dots then take tile_q8's float steps
// in its order, instruction for instruction:
//   acc = fma(float(dot), scale * d, acc);  acc = fma(min, d * sum(qx), acc)
// so a row's output is path 3's bit for bit, alone or in any chunk (a block's
// rows past the chunk's end are computed from stale or zero codes and dropped).
// Tiles: 0 and 1 the dots of groups g and g + 1, 2 and 3 their activations,
// 4 and 5 their codes. Those float steps, four vector instructions per 16
// outputs, row and group, are half the time: on the 2-core Xeon measured
// (bench/results/gemm-peak-intel-r-xeon-r-processor.md) the tile
// instructions and the vector ones did not overlap, whatever the order
// (stores of the next groups' dots before or after this group's sums, two
// blocks by two tiles of dots a group, tile multiplies beside sums of
// unrelated data: each about the sum of the two alone), so the path ran
// 1.2-1.5x path 3 on SmolLM2's projections at 512 rows, not the int8 peak.
constexpr int64_t kAmxRows = 16;        // token rows a tile multiply
constexpr int64_t kAmxMinRows = 16;     // fewer rows: path 3 (decode stays as it was)
constexpr int64_t kAmxChunk = 512;      // token rows quantized and multiplied at a time
constexpr int64_t kAmxGroupBytes = 512; // a group's unpacked codes: 8 quads x 64 bytes

#define GRAPHRUNNER_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
// GCC's tile loads are asm without a memory clobber: this tells the compiler
// the codes and rows stored by ordinary code before are read.
#define GRAPHRUNNER_AMX_READS() __asm__ volatile("" ::: "memory")

// The 64-byte tile configuration (palette 1): bytes per row and rows per tile.
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

GRAPHRUNNER_AMX void amx_configure() {
  AmxConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = kAmxRows;  // int32 dots [rows, 16 outputs]
    c.colsb[t] = 64;
    c.rows[2 + t] = kAmxRows;  // int8 activations [rows, 32]
    c.colsb[2 + t] = kGroup;
    c.rows[4 + t] = kGroup / 4;  // codes [8 quads, 16 outputs x 4]
    c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// One tile's codes (tile_codes' layout, groups * 256 bytes) unpacked to one
// byte a code, groups * kAmxGroupBytes bytes at w: group g's quad j at
// w + g * 512 + 64 * j, exactly tile_q8's register w.
GRAPHRUNNER_AMX void amx_unpack(const uint8_t* tile, int64_t groups, uint8_t* w) {
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0x0004000400040004);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t q = 0; q < groups * 8; ++q) {
    const __m512i both = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * q)));
    _mm512_storeu_si512(w + 64 * q, _mm512_and_si512(_mm512_srlv_epi16(both, shifts), low4));
  }
}

// A block's 16 rows of one group's dots (dots [16 rows, 16 outputs] int32)
// into their accumulators, tile_q8's float steps (d, n: the 16 rows' scales
// and code sums times the scales for the group, side by side).
GRAPHRUNNER_AMX __attribute__((always_inline)) inline void amx_sum_group(
    const int32_t* dots, const float* d, const float* n, __m512 scale, __m512 min,
    __m512 (&acc)[kAmxRows]) {
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(d[r]));
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * r));
    acc[r] = _mm512_fmadd_ps(dot, s, acc[r]);
    acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(n[r]), acc[r]);
  }
}

GRAPHRUNNER_AMX __attribute__((always_inline)) inline __m512 amx_half(const uint16_t* v) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
}

// A chunk's quantized rows in blocks of 16, as the tiles read them: codes
// [block, group, 16 rows, 32] (a group's A operand 512 bytes in a row: 8 whole
// lines, where the rows' own layout spread it over 16 lines, half of each
// read), scales d and scaled sums [block, group, 16 rows] (a group's 16
// values of a block side by side, one register's broadcasts at fixed offsets).
struct AmxRows {
  std::vector<int8_t> xq;
  std::vector<float> xd, sx;
  // Rows [r0, r0 + nr) of x [rows, in] (in's groups of 32), quantized a block
  // at a time, each row alone (quantize_row_q8); a last block's rows past nr
  // keep what they held. The buffers only grow: a caller keeps one per
  // thread, so a prompt's calls reuse their pages (a fresh chunk-sized
  // buffer a call was fresh pages from the OS each time, faulted in).
  void quantize(const float* x, int64_t in, int64_t groups, int64_t r0, int64_t nr) {
    const int64_t blocks = (nr + kAmxRows - 1) / kAmxRows, per_block = groups * kAmxRows;
    if (static_cast<int64_t>(xd.size()) < blocks * per_block) {
      xq.resize(blocks * per_block * kGroup);
      xd.resize(blocks * per_block);
      sx.resize(blocks * per_block);
    }
    Q8Rows q(in, groups, kAmxRows);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t live = std::min(kAmxRows, nr - b * kAmxRows);
      q.quantize(x, r0 + b * kAmxRows, static_cast<int>(live));
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t r = 0; r < live; ++r) {
          const int64_t at = (b * groups + g) * kAmxRows + r;
          std::memcpy(xq.data() + at * kGroup, q.xq.data() + r * q.kp + g * kGroup, kGroup);
          xd[at] = q.xd[r * groups + g];
          sx[at] = q.sx[r * groups + g];
        }
    }
  }
};

// One block of 16 rows (AmxRows' xq, xd, sx from the block's start) against
// one tile's unpacked codes w and float16 scales ts and mins tm: the first
// `live` rows' 16 outputs from o0 written to y (rows out apart). dots: 2 x 256
// int32 of scratch, 64-byte aligned. Not inlined: its 16 accumulators stay
// in registers.
GRAPHRUNNER_AMX __attribute__((noinline)) void amx_block(
    const int8_t* xq, const float* xd, const float* sx, int64_t groups, const uint8_t* w,
    const uint16_t* ts, const uint16_t* tm, int32_t* dots, float* y, int64_t out, int64_t o0,
    int64_t live) {
  constexpr int64_t kRowsBytes = kAmxRows * kGroup;
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  GRAPHRUNNER_AMX_READS();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    _tile_loadd(2, xq + g * kRowsBytes, kGroup);
    _tile_loadd(4, w + g * kAmxGroupBytes, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    _tile_loadd(3, xq + (g + 1) * kRowsBytes, kGroup);
    _tile_loadd(5, w + (g + 1) * kAmxGroupBytes, 64);
    _tile_zero(1);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(0, dots, 64);
    _tile_stored(1, dots + 256, 64);
    amx_sum_group(dots, xd + g * kAmxRows, sx + g * kAmxRows, amx_half(ts + g * kTileRows),
                  amx_half(tm + g * kTileRows), acc);
    amx_sum_group(dots + 256, xd + (g + 1) * kAmxRows, sx + (g + 1) * kAmxRows,
                  amx_half(ts + (g + 1) * kTileRows), amx_half(tm + (g + 1) * kTileRows), acc);
  }
  if (g < groups) {
    _tile_loadd(2, xq + g * kRowsBytes, kGroup);
    _tile_loadd(4, w + g * kAmxGroupBytes, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, dots, 64);
    amx_sum_group(dots, xd + g * kAmxRows, sx + g * kAmxRows, amx_half(ts + g * kTileRows),
                  amx_half(tm + g * kTileRows), acc);
  }
  const int64_t width = std::min<int64_t>(kTileRows, out - o0);
  const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1);
  for (int64_t r = 0; r < live; ++r) _mm512_mask_storeu_ps(y + r * out + o0, keep, acc[r]);
}

// Output tiles [b0, b1) against the nr rows of a (whole blocks of 16 held),
// into y (row 0 of the chunk). Tiles go kAmxTilesTogether at a time, their
// codes unpacked once for every block of rows, each block read once for them
// all (a block's codes, 16 x 32 bytes a group, stay in L1 between tiles). One
// thread's share: it configures its own tiles and releases them.
constexpr int64_t kAmxTilesTogether = 2;

GRAPHRUNNER_AMX void amx_tiles(const AmxRows& a, int64_t groups, int64_t nr,
                               const uint8_t* tiles, const uint16_t* ts, const uint16_t* tm,
                               float* y, int64_t out, int64_t b0, int64_t b1) {
  const int64_t per_tile = groups * kAmxGroupBytes, kp = groups * kGroup;
  std::vector<uint8_t> w(kAmxTilesTogether * per_tile);
  alignas(64) int32_t dots[2 * kAmxRows * kTileRows];
  amx_configure();
  for (int64_t b = b0; b < b1; b += kAmxTilesTogether) {
    const int64_t together = std::min(kAmxTilesTogether, b1 - b);
    for (int64_t t = 0; t < together; ++t)
      amx_unpack(tiles + (b + t) * groups * kTileGroupBytes, groups, w.data() + t * per_tile);
    for (int64_t r0 = 0; r0 < nr; r0 += kAmxRows)
      for (int64_t t = 0; t < together; ++t)
        amx_block(a.xq.data() + r0 * kp, a.xd.data() + r0 * groups, a.sx.data() + r0 * groups,
                  groups, w.data() + t * per_tile, ts + (b + t) * groups * kTileRows,
                  tm + (b + t) * groups * kTileRows, dots, y + r0 * out, out,
                  (b + t) * kTileRows, std::min(kAmxRows, nr - r0));
  }
  _tile_release();
}
#define GRAPHRUNNER_Q8_AMX 1
#undef GRAPHRUNNER_AMX
#undef GRAPHRUNNER_AMX_READS

#define GRAPHRUNNER_Q8_TILES 1
#undef GRAPHRUNNER_ZMM
#define GRAPHRUNNER_Q8_VNNI GRAPHRUNNER_Q8_ROWS(rows_q8_avxvnni)
#define GRAPHRUNNER_Q8_VNNI512 GRAPHRUNNER_Q8_ROWS(rows_q8_avx512vnni)
#else
#define GRAPHRUNNER_Q8_VNNI {}
#define GRAPHRUNNER_Q8_VNNI512 {}
#endif

constexpr int kQ8Paths = 3;
// The tiled path's number (its own op and layout, not a row of q8_table).
constexpr int kQ8TilesPath = 3;
constexpr Q8Fn q8_table[kQ8Paths][kTile + 1] = {
    GRAPHRUNNER_Q8_ROWS(rows_q8_avx2), GRAPHRUNNER_Q8_VNNI, GRAPHRUNNER_Q8_VNNI512};

// Whether this CPU runs path p (the Python table chose it; this is the guard
// against an illegal instruction, never the choice).
bool q8_cpu_has(int64_t p) {
#ifdef GRAPHRUNNER_VNNI
  __builtin_cpu_init();
  if (p == 1) return __builtin_cpu_supports("avxvnni");
  if (p == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return p == 0;
}

// The AMX path's number (path 3's op and layout, AMX for prompt chunks).
constexpr int kQ8AmxPath = 4;

// Whether this CPU has AMX-INT8 (CPUID leaf 7: EDX bits 24 tile, 25 int8) and
// the OS grants this process the tile data (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18; asked once, as
// cpu_features.amx_permitted asks). The guard against a fault, never the choice.
bool amx_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1))
      return false;
#ifdef __linux__
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

// Bit p set: path p is compiled into this build.
int64_t q8_paths() {
  int64_t bits = 0;
  for (int p = 0; p < kQ8Paths; ++p)
    if (q8_table[p][1] != nullptr) bits |= int64_t{1} << p;
#ifdef GRAPHRUNNER_Q8_TILES
  bits |= int64_t{1} << kQ8TilesPath;
#endif
#ifdef GRAPHRUNNER_Q8_AMX
  bits |= int64_t{1} << kQ8AmxPath;
#endif
  return bits;
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& blocked, const at::Tensor& scales,
                     const at::Tensor& mins, int64_t path) {
  const int64_t groups = check_int4("graphrunner_int4::linear_q8", x, blocked, scales, mins);
  const int64_t rows = x.size(0), out = scales.size(0);
  TORCH_CHECK(path >= 0 && path < kQ8Paths && q8_table[path][1] != nullptr && q8_cpu_has(path),
              "graphrunner_int4::linear_q8: path ", path,
              " is not compiled into this build or not supported by this CPU (compiled: bits ",
              q8_paths(), ")");
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  float* yp = y.data_ptr<float>();
  over_q8_rows(x, groups, [&](const Q8Rows& q, int64_t r0, int nr) {
    const Q8Fn fn = q8_table[path][nr];
    at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
      fn(q.xq.data(), q.xd.data(), q.sx.data(), groups, blocked.data_ptr<uint8_t>(),
         scales.data_ptr<float>(), mins.data_ptr<float>(), yp + r0 * out, out, o0, o1);
    });
  });
  return y;
}


// The tiled ops' x and tiles checked (op names the op, made the function that
// lays the tiles out): x 2-D float32 [rows, in], tiles of dtype [ceil(out / 16),
// groups * bytes] for in's groups, and a CPU with AVX-512 VNNI; the groups.
int64_t check_tiles(const char* op, const at::Tensor& x, const at::Tensor& tiles,
                    at::ScalarType dtype, int64_t bytes, int64_t out, const char* made) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-D float32 CPU tensor [rows, in]");
  const int64_t in = x.size(1), groups = (in + kGroup - 1) / kGroup, count = (out + 15) / 16;
  TORCH_CHECK(out >= 0 && tiles.dim() == 2 && tiles.scalar_type() == dtype &&
                  tiles.is_contiguous() && tiles.size(0) == count &&
                  tiles.size(1) == groups * bytes,
              op, ": tiles must be contiguous ", dtype, " [", count, ", ", groups * bytes,
              "] for out=", out, " and in=", in, " (", made, "), got ", tiles.sizes());
  TORCH_CHECK(q8_cpu_has(2), op, ": needs AVX-512 VNNI, which this CPU lacks");
  return groups;
}

// A tiled op's per-(tile, group, output) values `name` checked: contiguous
// dtype [count, groups, 16].
void check_tile_scales(const char* op, const char* name, const at::Tensor& t,
                       at::ScalarType dtype, int64_t count, int64_t groups) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 3 &&
                  t.size(0) == count && t.size(1) == groups && t.size(2) == 16,
              op, ": ", name, " must be contiguous ", dtype, " [", count, ", ", groups,
              ", 16], got ", t.scalar_type(), " ", t.sizes());
}

// Tiles of 16 output rows (path 3 above): tiles uint8 [ceil(out / 16), groups * 256],
// tile_scales and tile_mins float16 [ceil(out / 16), groups, 16] (zero past out).
at::Tensor linear_q8_tiled(const at::Tensor& x, const at::Tensor& tiles,
                           const at::Tensor& tile_scales, const at::Tensor& tile_mins,
                           int64_t out) {
  const char* op = "graphrunner_int4::linear_q8_tiled";
  const int64_t groups = check_tiles(op, x, tiles, at::kByte, 256, out, "int4_q8.tile_codes");
  const int64_t rows = x.size(0), count = tiles.size(0);
  check_tile_scales(op, "tile_scales", tile_scales, at::kHalf, count, groups);
  check_tile_scales(op, "tile_mins", tile_mins, at::kHalf, count, groups);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
#ifdef GRAPHRUNNER_Q8_TILES
  float* yp = y.data_ptr<float>();
  over_q8_rows(x, groups, [&](const Q8Rows& q, int64_t r0, int nr) {
    const TileFn fn = tile_table[nr];
    at::parallel_for(0, count, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        fn(q.xq.data(), q.xd.data(), q.sx.data(), groups, tiles.data_ptr<uint8_t>() + b * groups * 256,
           reinterpret_cast<const uint16_t*>(tile_scales.data_ptr()) + b * groups * 16,
           reinterpret_cast<const uint16_t*>(tile_mins.data_ptr()) + b * groups * 16,
           yp + r0 * out, out, b * 16);
    });
  });
#endif
  return y;
}

// Path 4 (amx_tiles above): linear_q8_tiled's arguments and output, bit for
// bit; from kAmxMinRows rows the chunk runs on AMX, kAmxChunk rows at a time.
at::Tensor linear_q8_amx(const at::Tensor& x, const at::Tensor& tiles,
                         const at::Tensor& tile_scales, const at::Tensor& tile_mins,
                         int64_t out) {
  // Decode's few rows: path 3's loop, before any other check (its own run).
  if (x.dim() != 2 || x.size(0) < kAmxMinRows)
    return linear_q8_tiled(x, tiles, tile_scales, tile_mins, out);
  const char* op = "graphrunner_int4::linear_q8_amx";
  TORCH_CHECK((q8_paths() >> kQ8AmxPath & 1) && amx_granted(), op,
              ": needs a build with AMX-INT8 and a CPU whose OS grants its tile data; "
              "this build, CPU or OS does not (q8_paths bits ", q8_paths(),
              "; run graphrunner_int4::linear_q8_tiled instead)");
  const int64_t groups = check_tiles(op, x, tiles, at::kByte, 256, out, "int4_q8.tile_codes");
  const int64_t rows = x.size(0), count = tiles.size(0);
  check_tile_scales(op, "tile_scales", tile_scales, at::kHalf, count, groups);
  check_tile_scales(op, "tile_mins", tile_mins, at::kHalf, count, groups);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (out == 0) return y;
#ifdef GRAPHRUNNER_Q8_AMX
  const at::Tensor xc = x.contiguous();
  float* yp = y.data_ptr<float>();
  const auto* ts = reinterpret_cast<const uint16_t*>(tile_scales.data_ptr());
  const auto* tm = reinterpret_cast<const uint16_t*>(tile_mins.data_ptr());
  // Whole blocks of 16 rows: the rows past a chunk's end are multiplied and dropped.
  static thread_local AmxRows a;
  for (int64_t r0 = 0; r0 < rows; r0 += kAmxChunk) {
    const int64_t nr = std::min(kAmxChunk, rows - r0);
    a.quantize(xc.data_ptr<float>(), x.size(1), groups, r0, nr);
    at::parallel_for(0, count, kAmxTilesTogether, [&](int64_t b0, int64_t b1) {
      amx_tiles(a, groups, nr, tiles.data_ptr<uint8_t>(), ts, tm, yp + r0 * out, out, b0, b1);
    });
  }
#endif
  return y;
}

// int4-q8's LM head on tiles (tile_int8g_q8 above): tiles uint8 (the codes plus
// 128) [ceil(out / 16), groups * 512], tile_scales float32 [ceil(out / 16), groups, 16].
at::Tensor linear_grouped_q8_tiled(const at::Tensor& x, const at::Tensor& tiles,
                                   const at::Tensor& tile_scales, int64_t out) {
  const char* op = "graphrunner_int8::linear_grouped_q8_tiled";
  const int64_t groups = check_tiles(op, x, tiles, at::kByte, 512, out, "int4_q8.tile_int8");
  const int64_t rows = x.size(0), count = tiles.size(0);
  check_tile_scales(op, "tile_scales", tile_scales, at::kFloat, count, groups);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
#ifdef GRAPHRUNNER_Q8_TILES
  float* yp = y.data_ptr<float>();
  over_q8_rows(x, groups, [&](const Q8Rows& q, int64_t r0, int nr) {
    const Int8TileFn fn = int8_tile_table[nr];
    at::parallel_for(0, count, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        fn(q.xq.data(), q.xn.data(), q.xd.data(), groups,
           tiles.data_ptr<uint8_t>() + b * groups * 512,
           tile_scales.data_ptr<float>() + b * groups * 16, yp + r0 * out, out, b * 16,
           b + kInt8TilesAhead < b1);
    });
  });
#endif
  return y;
}

// int4 x bfloat16 (graphrunner_int4::linear_bf16, int4_bf16.py): the same
// 4-bit weights, each weight rounded to bfloat16 (round-to-nearest-even of
// the float32 code * scale + min, the same two roundings as int4's
// dequantize), each activation rounded to bfloat16, products summed in
// float32 by AVX-512 BF16's vdpbf16ps: 16 lanes, lane i taking the pair of
// columns (2i, 2i + 1) of every group in turn, each step
//   acc_i = (acc_i + w[2i+1] * x[2i+1]) + w[2i] * x[2i]
// (a bfloat16 product is exact in float32; each sum rounds to nearest even),
// then the 16 lanes summed in a fixed order (hsum16). A group's weights come
// from a 16-entry table of its bfloat16 values, looked up by code with
// vpermw, so the scale and min cost one table per (output, group), shared by
// every row; no per-row scale work is left, which is where int4-q8's blocked
// kernels spend their time at 8 rows. Measured on a Zen 4 EPYC against them
// (bench/results/int4-q8-tiles-zen4-cpu.md: 1.11-1.19x path 2 at 8 rows,
// 0.66-0.71x at 1). A row's sums never meet
// another row's, in the same order whatever the batch: rows independent of
// the batch bit for bit; int4_bf16.py's torch reference is equal bit for bit.
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define GRAPHRUNNER_BF16 1
#define GRAPHRUNNER_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// A group's 32 codes (byte j: code j low, code j + 16 high) as 16-bit table
// indices in column order. The low half keeps its byte whole: vpermw reads
// an index's low 5 bits, and the table below is written twice over, so the
// high nibble's low bit picks the same entry.
GRAPHRUNNER_BF16_TARGET inline __m512i code_indices(const uint8_t* bytes) {
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0x0004000400040004);
  return _mm512_srlv_epi16(_mm512_cvtepu8_epi16(b), shifts);
}

// One group's 32 weights as bfloat16 words in column order (word j: column
// j): the group's 16 possible weights, code * scale + min rounded twice as
// int4's dequantize (no FMA: the build's -ffp-contract=off keeps the
// multiply and the add apart), then to bfloat16, looked up by code (vpermw).
GRAPHRUNNER_BF16_TARGET inline __m512i group_words(const uint8_t* codes, float scale, float min) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 v = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scale)), _mm512_set1_ps(min));
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v, v));
  return _mm512_permutexvar_epi16(code_indices(codes), table);
}

// Lanes 0..7 + 8..15, then hsum: a fixed order of the 16 lanes.
GRAPHRUNNER_BF16_TARGET inline float hsum16(__m512 v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

// R bfloat16 rows (xb: [R, kp]) against the P output rows os[0..P).
template <int R, int P>
GRAPHRUNNER_BF16_TARGET inline void block_bf16(const uint16_t* xb, int64_t groups,
                                               const uint8_t* blocked, const float* scales,
                                               const float* mins, float* y, int64_t out,
                                               const int64_t (&os)[P],
                                               const BlockPrefetch& ahead) {
  const int64_t kp = groups * kGroup;
  const uint8_t* wq[P];
  const float* sc[P];
  const float* mn[P];
  __m512 acc[P][R];
  for (int p = 0; p < P; ++p) {
    wq[p] = row_codes(blocked, groups, os[p]);
    sc[p] = scales + os[p] * groups;
    mn[p] = mins + os[p] * groups;
    for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    ahead.group(g);
    for (int p = 0; p < P; ++p) {
      const __m512bh w =
          reinterpret_cast<__m512bh>(group_words(wq[p] + g * kCodeStride, sc[p][g], mn[p][g]));
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + r * kp + g * kGroup));
        acc[p][r] = _mm512_dpbf16_ps(acc[p][r], w, xv);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) y[r * out + os[p]] = hsum16(acc[p][r]);
}

// Outputs per pass for R rows: more rows share a weight's lookup already.
template <int R>
constexpr int kBf16OutBlock = R <= 2 ? 4 : (R <= 4 ? 2 : 1);

template <int R>
GRAPHRUNNER_BF16_TARGET __attribute__((flatten)) void rows_bf16(
    const uint16_t* xb, int64_t groups, const uint8_t* blocked, const float* scales,
    const float* mins, float* y, int64_t out, int64_t o0, int64_t o1) {
  constexpr int P = kBf16OutBlock<R>;
  int64_t os[P];
  for (int64_t o = o0; o < o1; o += P) {
    for (int p = 0; p < P; ++p) os[p] = std::min(o + p, o1 - 1);
    block_bf16<R, P>(xb, groups, blocked, scales, mins, y, out, os,
                     BlockPrefetch::ahead(blocked, scales, mins, groups, o, P, o1));
  }
}

// int8 groups x bfloat16 (graphrunner_int8::linear_grouped_bf16): the LM head
// of int4-bf16 mode, int8_linear's grouped codes (q, one scale a group), each
// weight rounded to bfloat16 from its float32 q * scale, the same sums as
// linear_bf16's; one output row a pass, the row ahead fetched as int8g's.
template <int R>
GRAPHRUNNER_BF16_TARGET __attribute__((flatten)) void rows_int8g_bf16(
    const uint16_t* xb, int64_t groups, const int8_t* q, const float* scales, float* y,
    int64_t out, int64_t o0, int64_t o1) {
  const int64_t kp = groups * kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wq = q + o * kp;
    const float* sc = scales + o * groups;
    const RowPrefetch next = RowPrefetch::ahead(q, scales, groups, o, o1);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      next.group(g);
      const int8_t* qg = wq + g * kGroup;
      const __m512 d = _mm512_set1_ps(sc[g]);
      const __m512 lo = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)))), d);
      const __m512 hi = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)))), d);
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);  // word j: column j
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + r * kp + g * kGroup));
        acc[r] = _mm512_dpbf16_ps(acc[r], w, xv);
      }
    }
    for (int r = 0; r < R; ++r) y[r * out + o] = hsum16(acc[r]);
  }
}

using Int8gBf16Fn = void (*)(const uint16_t*, int64_t, const int8_t*, const float*, float*,
                             int64_t, int64_t, int64_t);
constexpr Int8gBf16Fn int8g_bf16_table[kTile + 1] = {
    nullptr,            rows_int8g_bf16<1>, rows_int8g_bf16<2>, rows_int8g_bf16<3>,
    rows_int8g_bf16<4>, rows_int8g_bf16<5>, rows_int8g_bf16<6>, rows_int8g_bf16<7>,
    rows_int8g_bf16<8>};

// A prompt chunk's rows (more than a tile's): the table lookups above made
// once per (output, group) for kBf16SpanRows rows, where block_bf16 makes
// them again for every tile of 8 rows, and block_bf16's sums run as float32
// FMAs. vdpbf16ps is, lane by lane, two FMAs of exact products (two
// bfloat16s' product fits float32's mantissa): the lane's odd word's first,
// then its even word's, rounded to nearest even, denormal inputs and results
// read and written as zero (checked against the instruction on random
// operands). This core retires float32 FMAs at twice its rate (~215 against
// ~105 GFLOP/s in a loop of independent ones), so widened to float32 the
// same sums run about twice as fast: a group's 32 bfloat16 words become 16
// floats of its odd words, then 16 of its even words (widen_words), rows
// once a chunk, weights kBf16Unpacked outputs at a time (the same vpermw of
// the same table, so the same values). Then blocks of rows that stay in L1
// run against them kBf16PassRows rows by kBf16PassOuts outputs a pass,
// under MXCSR's flush-to-zero and denormals-are-zero (WithBf16Rounding).
// Each (row, output) takes its groups in order, odd then even, then hsum16's
// additions: block_bf16's sums in its order, bit for bit whatever the rows
// beside it, save a hsum16 whose exact sum of normal lanes is subnormal
// (below 1.2e-38), which reads zero here.
// SmolLM2's projections over 16 to 512 rows, on a Xeon with AVX-512 BF16
// and no AMX: see bench/bench_bf16_prompt.py.
constexpr int64_t kBf16Unpacked = 64;
constexpr int kBf16PassRows = 4;
constexpr int kBf16PassOuts = 4;
constexpr int64_t kBf16BlockBytes = 32 << 10;  // of widened rows a block (L1: 48 KB)
// Rows a weight unpack serves: over more, x's rows left L2 between passes of
// the same weights (512 rows: ~110 GFLOP/s against ~150 in spans of 96).
constexpr int64_t kBf16SpanRows = 96;

// 32 bfloat16 words (16 lanes of two) as 16 floats of the odd words (a lane's
// high half), then 16 of the even words (its low half, shifted up), at to.
GRAPHRUNNER_BF16_TARGET inline void widen_words(__m512i words, float* to) {
  _mm512_storeu_si512(to, _mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  _mm512_storeu_si512(to + 16, _mm512_slli_epi32(words, 16));
}

// Outputs [o0, o1)'s bfloat16 weights, widened, into wf [o1 - o0, kp].
GRAPHRUNNER_BF16_TARGET void unpack_widened(const uint8_t* blocked, const float* scales,
                                            const float* mins, int64_t groups, int64_t o0,
                                            int64_t o1, float* wf) {
  const int64_t kp = groups * kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wq = row_codes(blocked, groups, o);
    for (int64_t g = 0; g < groups; ++g) {
      widen_words(group_words(wq + g * kCodeStride, scales[o * groups + g], mins[o * groups + g]),
                  wf + (o - o0) * kp + g * kGroup);
    }
  }
}

// bfloat16 rows xb [rows, kp], widened, into xf [rows, kp].
GRAPHRUNNER_BF16_TARGET void widen_rows(const uint16_t* xb, int64_t rows, int64_t kp, float* xf) {
  for (int64_t k = 0; k < rows * kp; k += kGroup)
    widen_words(_mm512_loadu_si512(xb + k), xf + k);
}

// Zeroed floats from a 64-byte line's start: every row of kp floats (whole
// groups, 128 bytes each) then starts a line, and no 64-byte load splits two
// (split loads ran the pass at 144 against 185 GFLOP/s).
class LineAligned {
 public:
  explicit LineAligned(int64_t n) : data_(n + 16) {}
  float* data() {
    const auto at = reinterpret_cast<std::uintptr_t>(data_.data());
    return data_.data() + ((64 - at % 64) % 64) / sizeof(float);
  }

 private:
  std::vector<float> data_;
};

// vdpbf16ps' rounding for this thread while alive: flush-to-zero and
// denormals-are-zero, to nearest even; the caller's MXCSR back after.
class WithBf16Rounding {
 public:
  WithBf16Rounding() : saved_(_mm_getcsr()) {
    _mm_setcsr((saved_ & ~_MM_ROUND_MASK) | _MM_ROUND_NEAREST | _MM_FLUSH_ZERO_ON |
               _MM_DENORMALS_ZERO_ON);
  }
  ~WithBf16Rounding() { _mm_setcsr(saved_); }
  WithBf16Rounding(const WithBf16Rounding&) = delete;
  WithBf16Rounding& operator=(const WithBf16Rounding&) = delete;

 private:
  unsigned int saved_;
};

// hsum16 of 16 accumulators at once, the same additions: hsum16 adds lane i
// to lane i + 8, then i + 4, i + 2 and i + 1; here each level pairs the same
// lanes of two accumulators side by side in one register. Lane 4q + t of the
// result is v[4t + q]'s sum.
GRAPHRUNNER_BF16_TARGET inline __m512 hsum16_of_16(const __m512 (&v)[16]) {
  __m512 u[8], w[4], z[2];
  for (int k = 0; k < 8; ++k)  // i + 8: lanes 0-7 of v[2k], then of v[2k + 1]
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // i + 4: quarter q of w[m] holds v[4m + q]'s
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0xDD));
  for (int n = 0; n < 2; ++n)  // i + 2, within each quarter
    z[n] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),  // i + 1
                       _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

// kBf16PassRows widened rows (xf: [4, kp]) against 4 widened weight rows (wf:
// [4, kp]); outputs [o, o + live_outs) of rows [0, live_rows) written to y
// (rows out apart).
GRAPHRUNNER_BF16_TARGET inline void pass_widened(const float* xf, const float* wf, int64_t kp,
                                                 float* y, int64_t out, int64_t o,
                                                 int live_rows, int live_outs) {
  constexpr int R = kBf16PassRows, P = kBf16PassOuts;
  static_assert(R * P == 16, "one hsum16_of_16 a pass");
  __m512 acc[R * P];  // acc[4p + r]: output p of row r
  for (int j = 0; j < R * P; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; k += kGroup) {
    for (int64_t half = 0; half < kGroup; half += 16) {  // odd words, then even
      __m512 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(xf + r * kp + k + half);
      for (int p = 0; p < P; ++p) {
        const __m512 wv = _mm512_loadu_ps(wf + p * kp + k + half);
        for (int r = 0; r < R; ++r) acc[4 * p + r] = _mm512_fmadd_ps(wv, xv[r], acc[4 * p + r]);
      }
    }
  }
  const __m512 sums = hsum16_of_16(acc);  // lane 4r + p: output p of row r
  const __mmask8 outs = static_cast<__mmask8>((1u << live_outs) - 1);
  for (int r = 0; r < live_rows; ++r) {
    __m128 row;
    switch (r) {  // the extract's lane is an immediate
      case 0: row = _mm512_extractf32x4_ps(sums, 0); break;
      case 1: row = _mm512_extractf32x4_ps(sums, 1); break;
      case 2: row = _mm512_extractf32x4_ps(sums, 2); break;
      default: row = _mm512_extractf32x4_ps(sums, 3); break;
    }
    _mm_mask_storeu_ps(y + r * out + o, outs, row);
  }
}

using Bf16Fn = void (*)(const uint16_t*, int64_t, const uint8_t*, const float*, const float*,
                        float*, int64_t, int64_t, int64_t);
constexpr Bf16Fn bf16_table[kTile + 1] = {nullptr,      rows_bf16<1>, rows_bf16<2>,
                                          rows_bf16<3>, rows_bf16<4>, rows_bf16<5>,
                                          rows_bf16<6>, rows_bf16<7>, rows_bf16<8>};
#undef GRAPHRUNNER_BF16_TARGET
#endif

// Whether this build has the bfloat16 kernel and this CPU runs it.
bool bf16_runs() {
#ifdef GRAPHRUNNER_BF16
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// 1 where the bfloat16 kernel is compiled into this build, else 0.
int64_t bf16_paths() {
#ifdef GRAPHRUNNER_BF16
  return 1;
#else
  return 0;
#endif
}

// The bfloat16 ops' guard: op refuses to run where its instruction cannot.
void require_bf16(const char* op) {
  TORCH_CHECK(bf16_runs(), op, ": needs AVX-512 BF16 (",
              bf16_paths() ? "this CPU lacks it" : "not compiled into this build", ")");
}

#ifdef GRAPHRUNNER_BF16
// x [rows, in] float32 rounded to bfloat16 into xb [rows, kp], each row
// alone, zero-padded to whole groups: round to nearest even on the bits, as
// torch's float32 -> bfloat16 (vcvtneps2bf16 would flush denormal inputs to
// zero, torch does not), NaN to torch's quiet NaN. Plain stores, not an ATen
// tensor: four ATen calls a product cost ~1.4 ms of a 24 ms SmolLM2 step at 8 rows.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_to_bf16(
    const float* x, int64_t rows, int64_t in, int64_t kp, uint16_t* xb) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  const __m512i quiet = _mm512_set1_epi32(0x7FC0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    uint16_t* br = xb + r * kp;
    for (int64_t k = 0; k < kp; k += 16) {
      const __mmask16 live = k + 16 <= in ? __mmask16(0xFFFF)
                             : k < in     ? __mmask16((1u << (in - k)) - 1)
                                          : __mmask16(0);
      const __m512 v = _mm512_maskz_loadu_ps(live, xr + k);
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(bias, lsb)), 16);
      h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(br + k), _mm512_cvtepi32_epi16(h));
    }
  }
}

// x [rows, in]'s rows rounded to bfloat16 (rows_to_bf16): [rows, kp].
inline std::vector<uint16_t> bf16_rows(const at::Tensor& x, int64_t kp) {
  const at::Tensor xc = x.contiguous();
  std::vector<uint16_t> xb(x.size(0) * kp);
  rows_to_bf16(xc.data_ptr<float>(), x.size(0), x.size(1), kp, xb.data());
  return xb;
}

// x's rows rounded to bfloat16 once, then body(their bfloat16 rows, the count
// nr, the tile's output rows, o0, o1) for each tile of up to kTile rows, its
// outputs [o0, o1) split over threads.
template <class Body>
void over_bf16_tiles(const at::Tensor& x, int64_t groups, int64_t out, float* y,
                     const Body& body) {
  const int64_t rows = x.size(0), kp = groups * kGroup;
  const std::vector<uint16_t> xb = bf16_rows(x, kp);
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, rows - r0));
    at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
      body(xb.data() + r0 * kp, nr, y + r0 * out, o0, o1);
    });
  }
}
#endif

#ifdef GRAPHRUNNER_BF16
// linear_bf16 over more rows than a tile (unpack_widened above): x's rows
// rounded to bfloat16 and widened once; each thread's outputs kBf16Unpacked
// at a time unpacked, then every row against them.
void bf16_prompt(const at::Tensor& x, const at::Tensor& blocked, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t groups, float* y) {
  const int64_t rows = x.size(0), out = scales.size(0), kp = groups * kGroup;
  // Whole passes of rows: the last pass's rows past the chunk read zeros.
  LineAligned xf((rows + kBf16PassRows - 1) / kBf16PassRows * kBf16PassRows * kp);
  widen_rows(bf16_rows(x, kp).data(), rows, kp, xf.data());
  const int64_t block_rows =
      std::max<int64_t>(1, kBf16BlockBytes / (kp * 4 * kBf16PassRows)) * kBf16PassRows;
  at::parallel_for(0, out, kBf16Unpacked, [&](int64_t t0, int64_t t1) {
    LineAligned wf(kBf16Unpacked * kp);
    for (int64_t s0 = 0; s0 < rows; s0 += kBf16SpanRows) {
      const int64_t s1 = std::min(s0 + kBf16SpanRows, rows);
      for (int64_t o0 = t0; o0 < t1; o0 += kBf16Unpacked) {
        const int64_t o1 = std::min(o0 + kBf16Unpacked, t1);
        unpack_widened(blocked.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                       mins.data_ptr<float>(), groups, o0, o1, wf.data());
        const WithBf16Rounding rounding;
        // A block of rows stays in L1 while each 4 outputs' weights pass over it.
        for (int64_t b0 = s0; b0 < s1; b0 += block_rows) {
          const int64_t b1 = std::min(b0 + block_rows, s1);
          for (int64_t o = o0; o < o1; o += kBf16PassOuts) {
            const int outs = static_cast<int>(std::min<int64_t>(kBf16PassOuts, o1 - o));
            for (int64_t r0 = b0; r0 < b1; r0 += kBf16PassRows) {
              const int live = static_cast<int>(std::min<int64_t>(kBf16PassRows, rows - r0));
              pass_widened(xf.data() + r0 * kp, wf.data() + (o - o0) * kp, kp, y + r0 * out,
                           out, o, live, outs);
            }
          }
        }
      }
    }
  });
}
#endif

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& blocked, const at::Tensor& scales,
                       const at::Tensor& mins) {
  const int64_t groups = check_int4("graphrunner_int4::linear_bf16", x, blocked, scales, mins);
  require_bf16("graphrunner_int4::linear_bf16");
  const int64_t rows = x.size(0), out = scales.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
#ifdef GRAPHRUNNER_BF16
  if (rows > kTile) {
    bf16_prompt(x, blocked, scales, mins, groups, y.data_ptr<float>());
    return y;
  }
  over_bf16_tiles(x, groups, out, y.data_ptr<float>(),
                  [&](const uint16_t* xb, int nr, float* yt, int64_t o0, int64_t o1) {
                    bf16_table[nr](xb, groups, blocked.data_ptr<uint8_t>(),
                                   scales.data_ptr<float>(), mins.data_ptr<float>(), yt, out, o0,
                                   o1);
                  });
#endif
  return y;
}

at::Tensor linear_int8_grouped_bf16(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& scales) {
  const int64_t groups = check_int8_grouped("graphrunner_int8::linear_grouped_bf16", x, weight, scales);
  require_bf16("graphrunner_int8::linear_grouped_bf16");
  const int64_t rows = x.size(0), out = weight.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
#ifdef GRAPHRUNNER_BF16
  over_bf16_tiles(x, groups, out, y.data_ptr<float>(),
                  [&](const uint16_t* xb, int nr, float* yt, int64_t o0, int64_t o1) {
                    int8g_bf16_table[nr](xb, groups, weight.data_ptr<int8_t>(),
                                         scales.data_ptr<float>(), yt, out, o0, o1);
                  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(graphrunner_int4, m) {
  m.def("linear(Tensor x, Tensor blocked, Tensor scales, Tensor mins) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor blocked, Tensor scales, Tensor mins, int path) -> Tensor");
  m.def("q8_paths() -> int", &q8_paths);
  m.def(
      "linear_q8_tiled(Tensor x, Tensor tiles, Tensor tile_scales, Tensor tile_mins, int out) "
      "-> Tensor");
  m.def(
      "linear_q8_amx(Tensor x, Tensor tiles, Tensor tile_scales, Tensor tile_mins, int out) "
      "-> Tensor");
  m.def("linear_bf16(Tensor x, Tensor blocked, Tensor scales, Tensor mins) -> Tensor");
  m.def("bf16_paths() -> int", &bf16_paths);
}

TORCH_LIBRARY_IMPL(graphrunner_int4, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_q8", &linear_q8);
  m.impl("linear_q8_tiled", &linear_q8_tiled);
  m.impl("linear_q8_amx", &linear_q8_amx);
  m.impl("linear_bf16", &linear_bf16);
}

TORCH_LIBRARY(graphrunner_int8, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("linear_grouped(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("linear_grouped_bf16(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def(
      "linear_grouped_q8_tiled(Tensor x, Tensor tiles, Tensor tile_scales, int out) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_int8, CPU, m) {
  m.impl("linear", &linear_int8);
  m.impl("linear_grouped", &linear_int8_grouped);
  m.impl("linear_grouped_bf16", &linear_int8_grouped_bf16);
  m.impl("linear_grouped_q8_tiled", &linear_grouped_q8_tiled);
}

TORCH_LIBRARY(graphrunner_fp16, m) {
  m.def("linear(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_fp16, CPU, m) { m.impl("linear", &linear_fp16); }
