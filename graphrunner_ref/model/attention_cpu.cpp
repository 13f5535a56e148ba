// The CPU attention step's ops, float32, AVX2/FMA, decode also AVX-512
// (attention_cpu.py builds this file):
//
// * graphrunner_attention::rope_store, the rotary embedding and the KV write
//   between the stacked q/k/v product and the attention (the torch reference
//   it must equal bit for bit: kernels/rope_store.py's `reference`);
// * graphrunner_attention::decode, decode attention over each row's live KV
//   slots (the torch reference it must equal: attention_live.py);
// * rope_store_q8 and decode_q8: the same over an int8 cache, each head
//   vector of a slot with a float32 scale (llama.cpp's q8_0 cache; the torch
//   reference: graphrunner.pools.Int8KVCache.quantize / dequantize):
//
//   out[b, h, r] = sum_t softmax_t(scale * q[b, h, r] . k[s_t, h]) * v[s_t, h],
//   s_t = req_to_token[req_pool_indices[b], t],  t < seq_lens[b]
//
// q [B, H_kv, R, D] (R query heads share KV head h), k_buf / v_buf
// [slots, H_kv, D]. Only a row's live tokens are read, so a step's cost
// follows the live context, not the capacity; each (row, KV head) is computed
// alone, so a row's output never depends on the rows beside it. The softmax
// runs in float32 with its maximum subtracted, as torch's does (its
// exponential a polynomial within 2 ulp of expf). Per query head, the scores
// take 8 keys at a time (8 accumulators, one horizontal reduction for all
// 8), and the weighted sum of values keeps 64 output floats in registers
// over every value: about half the instructions of a dot with its own
// horizontal sum per key and an output read and written per value.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// The KV cache holds float32 or float16 (at::Half): 8 of either widened to
// float32 (exactly: every float16 is a float32), or float32 rounded to nearest
// even on the way in, as torch's .to(torch.float16) rounds.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 int8 widened to float32 (exactly; the scale is applied by the caller).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// ---- rotary embedding + KV write -------------------------------------------
//
// Row m of qkv [M, (H + 2 H_kv) D] at position p = positions[m] and KV slot
// l = out_loc[m]: each query head rotated into q [M, H D], each key head
// rotated into k_cache[l], each value head copied into v_cache[l]. The
// rotation is RotaryEmbedding's, element i paired with i + D / 2:
//
//   out[i]         = x[i] cos[p, i]         - x[i + D/2] sin[p, i]
//   out[i + D/2]   = x[i + D/2] cos[p, i + D/2] + x[i] sin[p, i + D/2]
//
// each product rounded, then the sum (this file is built with
// -ffp-contract=off, so no FMA fuses them): torch's roundings bit for bit. In
// torch the step is a gather of the tables' rows, an elementwise rotation and
// two scatters, several kernels a layer in the compiled CPU program; here it
// is one call. Everything is checked before anything is written.

// dst[0 .. 2 half) = x rotated by the table rows c, s (see above), in dst's type.
template <typename T>
inline void rotate_head(const float* x, const float* c, const float* s, int64_t half, T* dst) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    const __m256 first = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                       _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
    const __m256 second = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
    store8(dst + i, first);
    store8(dst + half + i, second);
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    dst[i] = static_cast<T>(a * c[i] - b * s[i]);
    dst[half + i] = static_cast<T>(b * c[half + i] + a * s[half + i]);
  }
}

// dst[0 .. n) = x, in dst's type.
template <typename T>
inline void copy_row(const float* x, int64_t n, T* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(x + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(x[i]);
}

// qkv, the tables and the indices of a rope_store into a cache of kv_heads x dim.
void check_rope_store(const char* op, const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& out_loc, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t kv_heads, int64_t dim, int64_t heads) {
  TORCH_CHECK(heads >= 1, op, ": heads = ", heads, ", expected at least 1");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_cpu() &&
                  qkv.size(1) == (heads + 2 * kv_heads) * dim,
              op, ": qkv must be float32 CPU [M, ", (heads + 2 * kv_heads) * dim,
              "] ((H + 2 H_kv) D for H = ", heads, ", H_kv = ", kv_heads, ", D = ", dim,
              "), got ", qkv.sizes(), " ", qkv.scalar_type());
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->dim() == 2 && table->scalar_type() == at::kFloat && table->is_cpu() &&
                    table->size(1) == dim && table->sizes() == cos.sizes(),
                op, ": cos and sin must be float32 CPU [positions, ", dim, "] alike, got ",
                cos.sizes(), " and ", sin.sizes());
  const int64_t rows = qkv.size(0);
  for (const at::Tensor* index : {&positions, &out_loc})
    TORCH_CHECK(index->dim() == 1 && index->scalar_type() == at::kLong && index->is_cpu() &&
                    index->size(0) == rows,
                op, ": positions and out_loc must be int64 CPU [", rows, "], got ",
                positions.sizes(), " and ", out_loc.sizes());
}

// Each row's position and slot within their tables, checked before any write.
void check_rows(const int64_t* pos, const int64_t* loc, int64_t rows, int64_t positions,
                int64_t slots) {
  const char* op = "graphrunner_attention::rope_store";
  for (int64_t m = 0; m < rows; ++m) {
    TORCH_CHECK(pos[m] >= 0 && pos[m] < positions, op, ": positions[", m, "] = ", pos[m],
                " out of range [0, ", positions, ")");
    TORCH_CHECK(loc[m] >= 0 && loc[m] < slots, op, ": out_loc[", m, "] = ", loc[m],
                " out of range [0, ", slots, ")");
  }
}

// The rows' q into qp, their k and v into the caches at their slots (of type T).
template <typename T>
void rope_store_rows(const float* xp, const int64_t* pos, const int64_t* loc, const float* cp,
                     const float* sp, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                     float* qp, T* kp, T* vp) {
  const int64_t width = (heads + 2 * kv_heads) * dim, kv_width = kv_heads * dim, half = dim / 2;
  // Rows in order, one thread: padded rows all write slot 0 (the sink), and
  // rows written in parallel would race there.
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = xp + m * width;
    const float* c = cp + pos[m] * dim;
    const float* s = sp + pos[m] * dim;
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(row + h * dim, c, s, half, qp + (m * heads + h) * dim);
    for (int64_t h = 0; h < kv_heads; ++h)
      rotate_head(row + (heads + h) * dim, c, s, half, kp + loc[m] * kv_width + h * dim);
    copy_row(row + (heads + kv_heads) * dim, kv_width, vp + loc[m] * kv_width);
  }
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& out_loc, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, int64_t heads) {
  const char* op = "graphrunner_attention::rope_store";
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && (kv_type == at::kFloat || kv_type == at::kHalf) &&
                  k_cache.is_cpu() && k_cache.is_contiguous() && k_cache.size(2) % 2 == 0,
              op, ": k_cache must be a contiguous float32 or float16 CPU tensor [slots, H_kv, D] "
              "with D even, got ", k_cache.sizes(), " ", kv_type);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kv_type &&
                  v_cache.is_cpu() && v_cache.is_contiguous(),
              op, ": v_cache must be contiguous ", kv_type, " ", k_cache.sizes(),
              " as k_cache, got ", v_cache.sizes(), " ", v_cache.scalar_type());
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(2);
  check_rope_store(op, qkv, positions, out_loc, cos, sin, kv_heads, dim, heads);
  const at::Tensor x = qkv.contiguous(), pos_t = positions.contiguous(),
                   loc_t = out_loc.contiguous(), c_t = cos.contiguous(), s_t = sin.contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t* loc = loc_t.data_ptr<int64_t>();
  check_rows(pos, loc, rows, cos.size(0), k_cache.size(0));
  at::Tensor q = at::empty({rows, heads * dim}, qkv.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c_t.data_ptr<float>();
  const float* sp = s_t.data_ptr<float>();
  if (k_cache.scalar_type() == at::kHalf)
    rope_store_rows(xp, pos, loc, cp, sp, rows, heads, kv_heads, dim, q.data_ptr<float>(),
                    k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else
    rope_store_rows(xp, pos, loc, cp, sp, rows, heads, kv_heads, dim, q.data_ptr<float>(),
                    k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return q;
}

// ---- int8 KV write ---------------------------------------------------------
//
// A head vector x of D floats is held as D int8 and one float32 scale:
// d = max|x| / 127, q = round(x * (1 / d)) (half to even; 0 where d is 0),
// Int8KVCache.quantize's float32 ops in its order, so equal to it bit for bit.

void quantize_head(const float* x, int64_t dim, int8_t* q, float* d) {
  float amax = 0.0f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t i = 0; i < dim; ++i)
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * inv))));
  *d = scale;
}

at::Tensor rope_store_q8(const at::Tensor& qkv, const at::Tensor& positions,
                         const at::Tensor& out_loc, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& k_scale,
                         at::Tensor& v_scale, int64_t heads) {
  const char* op = "graphrunner_attention::rope_store_q8";
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.scalar_type() == at::kChar && k_cache.is_cpu() &&
                  k_cache.is_contiguous() && k_cache.size(2) % 2 == 0 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kChar &&
                  v_cache.is_cpu() && v_cache.is_contiguous(),
              op, ": k_cache and v_cache must be contiguous int8 CPU tensors [slots, H_kv, D] "
              "alike with D even, got ", k_cache.sizes(), " ", k_cache.scalar_type(), " and ",
              v_cache.sizes(), " ", v_cache.scalar_type());
  for (const at::Tensor* sc : {&k_scale, &v_scale})
    TORCH_CHECK(sc->dim() == 2 && sc->scalar_type() == at::kFloat && sc->is_cpu() &&
                    sc->is_contiguous() && sc->size(0) == k_cache.size(0) &&
                    sc->size(1) == k_cache.size(1),
                op, ": k_scale and v_scale must be contiguous float32 CPU [", k_cache.size(0),
                ", ", k_cache.size(1), "], got ", k_scale.sizes(), " and ", v_scale.sizes());
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(2);
  check_rope_store(op, qkv, positions, out_loc, cos, sin, kv_heads, dim, heads);
  const at::Tensor x = qkv.contiguous(), pos_t = positions.contiguous(),
                   loc_t = out_loc.contiguous(), c_t = cos.contiguous(), s_t = sin.contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t* loc = loc_t.data_ptr<int64_t>();
  check_rows(pos, loc, rows, cos.size(0), k_cache.size(0));
  at::Tensor q = at::empty({rows, heads * dim}, qkv.options());
  const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
  const float* xp = x.data_ptr<float>();
  const float* cp = c_t.data_ptr<float>();
  const float* sp = s_t.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  int8_t* kp = k_cache.data_ptr<int8_t>();
  int8_t* vp = v_cache.data_ptr<int8_t>();
  float* ksp = k_scale.data_ptr<float>();
  float* vsp = v_scale.data_ptr<float>();
  std::vector<float> rotated(static_cast<size_t>(dim));
  // Rows in order, one thread: padded rows all write slot 0 (the sink).
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = xp + m * width;
    const float* c = cp + pos[m] * dim;
    const float* s = sp + pos[m] * dim;
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(row + h * dim, c, s, half, qp + (m * heads + h) * dim);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = loc[m] * kv_heads + h;
      rotate_head(row + (heads + h) * dim, c, s, half, rotated.data());
      quantize_head(rotated.data(), dim, kp + at * dim, ksp + at);
      quantize_head(row + (heads + kv_heads + h) * dim, dim, vp + at * dim, vsp + at);
    }
  }
  return q;
}

// ---- decode attention ------------------------------------------------------

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of 8 accumulators' lanes, one a lane: [sum(a[0]), ..., sum(a[7])].
inline __m256 sum8x8(const __m256 (&a)[8]) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// scores[i] = scale * (q . keys[i]) for the n <= 8 keys given (keys[n..8) repeat
// the last one; their sums are dropped). One accumulator a key, the query's
// 8-float chunks in order, the 8 sums reduced together: a dot's horizontal sum
// amortized over 8 keys, each chunk of the query loaded once for all of them.
template <typename T>
inline void scores8(const float* q, const T* const (&keys)[8], int n, int64_t dim, float scale,
                    float* scores) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(keys[i] + d), acc[i]);
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sum8x8(acc));
  for (int i = 0; i < n; ++i) {
    float s = sums[i];
    for (int64_t e = d; e < dim; ++e)  // a head size not of 8s
      s = std::fma(q[e], static_cast<float>(keys[i][e]), s);
    scores[i] = s * scale;
  }
}

// e^x for x <= 0 (x = n ln2 + f, |f| <= ln2 / 2; e^f by its degree-6 Taylor
// polynomial, 2^n put into the exponent): within 2 ulp of expf; below
// kExpFloor (past float's normal range) 0. exp8 and exp16 take these steps on
// 8 and 16 lanes, so they give the same values.
constexpr float kExpFloor = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln2 in two parts
// The polynomial's coefficients, highest degree first (Horner's order).
constexpr float kExpTaylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline __m256 exp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(kExpFloor), x);  // a NaN x stays NaN (maxps returns its second)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), f);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// p[0..n) = softmax(p[0..n)) in place: maximum subtracted, exponentials
// summed in float32, each divided by the sum.
inline void softmax(float* p, int64_t n) {
  const float m = *std::max_element(p, p + n);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mv));
    _mm256_storeu_ps(p + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = sum8(acc);
  for (; t < n; ++t) total += (p[t] = std::exp(p[t] - m));
  const __m256 tv = _mm256_set1_ps(total);
  t = 0;
  for (; t + 8 <= n; t += 8) _mm256_storeu_ps(p + t, _mm256_div_ps(_mm256_loadu_ps(p + t), tv));
  for (; t < n; ++t) p[t] /= total;
}

// out[c .. c + 8 NV) = sum_t p[t] * values[t][c ..], NV vectors of 8 held in
// registers over all n values (t in order, one FMA each: the same sums as
// adding each p[t] * values[t] to out in turn).
template <int NV, typename T>
inline void weigh_values(const T* const* values, const float* p, int64_t n, int64_t c,
                         float* out) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pv = _mm256_set1_ps(p[t]);
    for (int j = 0; j < NV; ++j)
      acc[j] = _mm256_fmadd_ps(pv, load8(values[t] + c + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + c + 8 * j, acc[j]);
}

template <typename T>
using WeighFn = void (*)(const T* const*, const float*, int64_t, int64_t, float*);
template <typename T>
constexpr WeighFn<T> kWeigh[9] = {nullptr,
                                  weigh_values<1, T>, weigh_values<2, T>, weigh_values<3, T>,
                                  weigh_values<4, T>, weigh_values<5, T>, weigh_values<6, T>,
                                  weigh_values<7, T>, weigh_values<8, T>};

// out[0 .. dim) = sum_t p[t] * values[t]: 64 floats at a time in registers,
// a head size not of 8s finished one float at a time.
template <typename T>
inline void weigh(const T* const* values, const float* p, int64_t n, int64_t dim, float* out) {
  const int64_t whole = dim / 8 * 8;
  for (int64_t c = 0; c < whole; c += 64)
    kWeigh<T>[std::min<int64_t>(8, (whole - c) / 8)](values, p, n, c, out);
  for (int64_t e = whole; e < dim; ++e) {
    float acc = 0.0f;
    for (int64_t t = 0; t < n; ++t) acc = std::fma(p[t], static_cast<float>(values[t][e]), acc);
    out[e] = acc;
  }
}

// ---- decode attention, AVX-512 ---------------------------------------------
//
// The same attention with 16 floats a register, taken where the CPU has
// AVX-512 (F, BW, VL) and the head size is a multiple of 16 (the path is
// chosen once a process: use_path). A row's KV heads are computed together
// (attend_row_avx512): a slot's heads lie side by side in the cache, so
// reading a block of slots for all heads uses every cache line it fetches,
// and the next block is prefetched while this one is multiplied. Within a KV
// head, its R query heads go 4 at a time: each key and each value is loaded
// and widened once for all of them (the AVX2 path above reads each R times).
// The softmax's exponentials are summed 16 at a time and the division by
// their sum is applied to a head's output (dim divisions, not len). So the
// two paths agree within float32 rounding, not bit for bit; on the AVX-512
// path too a row's output never depends on the rows beside it.

#define GR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// How many keys (or values) ahead of the one being multiplied are prefetched.
constexpr int64_t kPrefetchAhead = 16;

GR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
GR_AVX512 inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
GR_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Ask for the cache lines of `n` elements at p.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t at = 0; at < n * static_cast<int64_t>(sizeof(T)); at += 64)
    _mm_prefetch(bytes + at, _MM_HINT_T0);
}

// A 16-float register's two halves added: 8 floats.
GR_AVX512 inline __m256 fold16(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// exp8 on 16 lanes (its constants and steps).
GR_AVX512 inline __m512 exp16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_set1_ps(kExpFloor), x);  // a NaN x stays NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), f);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpTaylor[i]));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}

// The largest of p[0..n), 16 at a time (the tail masked).
GR_AVX512 inline float row_max(const float* p, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, p + t));
  }
  return _mm512_reduce_max_ps(m);
}

// p[0..n) = e^(p - m) in place; returns their sum.
GR_AVX512 inline float exp_sum(float* p, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = static_cast<__mmask16>(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p + t), mv)));
    _mm512_mask_storeu_ps(p + t, live, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// p[0..n) = e^(p - max p) in place, 16 at a time (the tail masked); returns
// their sum. The division by it is left to the caller: dividing the n
// probabilities costs n divisions, dividing a head's output dim.
GR_AVX512 inline float exp_shifted(float* p, int64_t n) { return exp_sum(p, n, row_max(p, n)); }

// scores[r * stride + i] = scale * (q[r] . keys[i][at ..]) for RB query heads
// q [RB, dim] and the n <= 8 keys given (their rows' head at `at`; keys[n..8)
// repeat the last one, their sums dropped): each key's chunks loaded once and
// multiplied into all RB heads' accumulators, each head's 8 sums reduced
// together (sum8x8).
template <int RB, typename T>
GR_AVX512 void scores8_heads(const float* q, const T* const* keys, int n, int64_t at,
                             int64_t dim, float scale, float* scores, int64_t stride) {
  __m256 folded[RB][8];
  for (int i = 0; i < 8; ++i) {
    const T* key = keys[std::min(i, n - 1)] + at;
    __m512 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512 kv = load16(key + c);
      for (int r = 0; r < RB; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * dim + c), kv, acc[r]);
    }
    for (int r = 0; r < RB; ++r) folded[r][i] = fold16(acc[r]);
  }
  for (int r = 0; r < RB; ++r) {
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum8x8(folded[r]));
    for (int i = 0; i < n; ++i) scores[r * stride + i] = sums[i] * scale;
  }
}

// out[r][c .. c + 16 NV) += sum_{t < n} p[r * stride + t] * values[t][at + c ..]
// for RB heads: each value's NV registers loaded once for all RB heads, the
// RB x NV sums carried in registers over the n values (t in order, one FMA
// each) and through `out` from one block of values to the next.
template <int RB, int NV, typename T>
GR_AVX512 void weigh_heads_tile(const T* const* values, int64_t at, const float* p,
                                int64_t stride, int64_t n, int64_t dim, int64_t c, float* out) {
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_loadu_ps(out + r * dim + c + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16(values[t] + at + c + 16 * j);
    for (int r = 0; r < RB; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * stride + t]);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(pr, v[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + r * dim + c + 16 * j, acc[r][j]);
}

// All of dim for RB heads, 64 floats (4 registers a head) at a time.
template <int RB, typename T>
GR_AVX512 void weigh_heads(const T* const* values, int64_t at, const float* p, int64_t stride,
                           int64_t n, int64_t dim, float* out) {
  for (int64_t c = 0; c < dim; c += 64) {
    switch (std::min<int64_t>(4, (dim - c) / 16)) {
      case 1: weigh_heads_tile<RB, 1>(values, at, p, stride, n, dim, c, out); break;
      case 2: weigh_heads_tile<RB, 2>(values, at, p, stride, n, dim, c, out); break;
      case 3: weigh_heads_tile<RB, 3>(values, at, p, stride, n, dim, c, out); break;
      default: weigh_heads_tile<RB, 4>(values, at, p, stride, n, dim, c, out); break;
    }
  }
}

// scores8_heads and weigh_heads for a runtime block of rb (1 to 4) heads.
template <typename T>
GR_AVX512 void scores8_block(int rb, const float* q, const T* const* keys, int n, int64_t at,
                             int64_t dim, float scale, float* scores, int64_t stride) {
  switch (rb) {
    case 1: scores8_heads<1>(q, keys, n, at, dim, scale, scores, stride); break;
    case 2: scores8_heads<2>(q, keys, n, at, dim, scale, scores, stride); break;
    case 3: scores8_heads<3>(q, keys, n, at, dim, scale, scores, stride); break;
    default: scores8_heads<4>(q, keys, n, at, dim, scale, scores, stride); break;
  }
}

template <typename T>
GR_AVX512 void weigh_block(int rb, const T* const* values, int64_t at, const float* p,
                           int64_t stride, int64_t n, int64_t dim, float* out) {
  switch (rb) {
    case 1: weigh_heads<1>(values, at, p, stride, n, dim, out); break;
    case 2: weigh_heads<2>(values, at, p, stride, n, dim, out); break;
    case 3: weigh_heads<3>(values, at, p, stride, n, dim, out); break;
    default: weigh_heads<4>(values, at, p, stride, n, dim, out); break;
  }
}

// Whether this CPU runs the AVX-512 path (asked of the CPU itself, so a
// saved program never reaches an instruction the machine lacks).
bool avx512_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return supported;
}

// The path decode and decode_q8 take: 0 AVX2, 1 AVX-512 (set by use_path;
// the best this CPU has until then).
int& attention_path() {
  static int path = avx512_supported() ? 1 : 0;
  return path;
}

// The paths this build runs on this CPU, a bit each (bit 0 AVX2, bit 1 AVX-512).
int64_t paths() { return 1 | (avx512_supported() ? 2 : 0); }

void use_path(int64_t code) {
  TORCH_CHECK(code == 0 || (code == 1 && avx512_supported()),
              "graphrunner_attention::use_path: code = ", code, ", expected 0 (AVX2)",
              avx512_supported() ? " or 1 (AVX-512)" : " (this CPU has no AVX-512)");
  attention_path() = static_cast<int>(code);
}

struct Shapes {
  int64_t heads, group, dim, slots, capacity;
};

// Scratch of one thread: a row's key and value rows of one KV head, and scores.
template <typename T>
struct Scratch {
  std::vector<const T*> keys, values;
  std::vector<float> scores, k_scale, v_scale, weights, totals;
};

// One (row, KV head): its R query heads against the row's `len` live slots.
// With scales (an int8 cache; nullptr otherwise, the float path unchanged):
// each score times its key's scale, each probability times its value's.
template <typename T>
void attend_head(const float* q, const T* k, const T* v, const float* ks, const float* vs,
                 const int32_t* slot_row, int64_t len, int64_t h, const Shapes& s, float scale,
                 float* out, Scratch<T>& scratch) {
  const auto n_len = static_cast<size_t>(len);
  scratch.keys.resize(n_len);
  scratch.values.resize(n_len);
  scratch.scores.resize(static_cast<size_t>(s.group) * n_len);
  if (ks != nullptr) {
    scratch.k_scale.resize(n_len);
    scratch.v_scale.resize(n_len);
    scratch.weights.resize(n_len);
  }
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = slot_row[t];
    TORCH_CHECK(slot >= 0 && slot < s.slots, "graphrunner_attention::decode: KV slot ", slot,
                " out of range [0, ", s.slots, ")");
    scratch.keys[t] = k + (slot * s.heads + h) * s.dim;
    scratch.values[t] = v + (slot * s.heads + h) * s.dim;
    if (ks != nullptr) {
      scratch.k_scale[t] = ks[slot * s.heads + h];
      scratch.v_scale[t] = vs[slot * s.heads + h];
    }
  }
  for (int64_t r = 0; r < s.group; ++r) {
    float* scores = scratch.scores.data() + r * len;
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, len - t0));
      const T* keys[8];
      for (int i = 0; i < 8; ++i) keys[i] = scratch.keys[t0 + std::min(i, n - 1)];
      scores8(q + r * s.dim, keys, n, s.dim, scale, scores + t0);
    }
    const float* p = scores;
    if (ks != nullptr) {
      for (int64_t t = 0; t < len; ++t) scores[t] *= scratch.k_scale[t];
      softmax(scores, len);
      for (int64_t t = 0; t < len; ++t) scratch.weights[t] = scores[t] * scratch.v_scale[t];
      p = scratch.weights.data();
    } else {
      softmax(scores, len);
    }
    weigh(scratch.values.data(), p, len, s.dim, out + r * s.dim);
  }
}

// One row's KV heads [h0, h1) on the AVX-512 path (q and out: the row's [H_kv,
// R, D]): its slots' rows read a block at a time for all those heads, so
// every cache line fetched is used (a slot's heads lie side by side) and the
// next block is prefetched while this one is multiplied. Keys 8 at a time
// into every query head's scores, the softmaxes (an int8 cache's scales as
// attend_head applies them), then values 32 at a time into every output.
constexpr int64_t kValueBlock = 32;

template <typename T>
void attend_row_avx512(const float* q, const T* k, const T* v, const float* ks, const float* vs,
                       const int32_t* slot_row, int64_t len, int64_t h0, int64_t h1,
                       const Shapes& s, float scale, float* out, Scratch<T>& scratch) {
  const int64_t row_width = s.heads * s.dim, span = (h1 - h0) * s.dim;
  const int64_t queries = (h1 - h0) * s.group, n_len = len;
  scratch.keys.resize(static_cast<size_t>(len));
  scratch.values.resize(static_cast<size_t>(len));
  scratch.scores.resize(static_cast<size_t>(queries * len));
  if (ks != nullptr) {
    scratch.k_scale.resize(static_cast<size_t>((h1 - h0) * len));
    scratch.v_scale.resize(static_cast<size_t>((h1 - h0) * len));
  }
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = slot_row[t];
    TORCH_CHECK(slot >= 0 && slot < s.slots, "graphrunner_attention::decode: KV slot ", slot,
                " out of range [0, ", s.slots, ")");
    scratch.keys[t] = k + slot * row_width;
    scratch.values[t] = v + slot * row_width;
    for (int64_t h = h0; ks != nullptr && h < h1; ++h) {
      scratch.k_scale[(h - h0) * len + t] = ks[slot * s.heads + h];
      scratch.v_scale[(h - h0) * len + t] = vs[slot * s.heads + h];
    }
  }
  const T* const* keys = scratch.keys.data();
  const T* const* values = scratch.values.data();
  float* scores = scratch.scores.data();
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    for (int64_t t = t0 + kPrefetchAhead; t < std::min(len, t0 + kPrefetchAhead + 8); ++t)
      prefetch(keys[t] + h0 * s.dim, span);
    const int n = static_cast<int>(std::min<int64_t>(8, len - t0));
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t r0 = 0; r0 < s.group; r0 += 4)
        scores8_block(static_cast<int>(std::min<int64_t>(4, s.group - r0)),
                      q + (h * s.group + r0) * s.dim, keys + t0, n, h * s.dim, s.dim, scale,
                      scores + ((h - h0) * s.group + r0) * n_len + t0, n_len);
  }
  scratch.totals.resize(static_cast<size_t>(queries));
  for (int64_t i = 0; i < queries; ++i) {
    float* p = scores + i * len;
    if (ks != nullptr) {
      const float* k_scale = scratch.k_scale.data() + (i / s.group) * len;
      for (int64_t t = 0; t < len; ++t) p[t] *= k_scale[t];
    }
    scratch.totals[i] = exp_shifted(p, len);
    if (ks != nullptr) {
      const float* v_scale = scratch.v_scale.data() + (i / s.group) * len;
      for (int64_t t = 0; t < len; ++t) p[t] *= v_scale[t];
    }
  }
  std::fill(out + h0 * s.group * s.dim, out + h1 * s.group * s.dim, 0.0f);
  for (int64_t t0 = 0; t0 < len; t0 += kValueBlock) {
    for (int64_t t = t0 + kValueBlock; t < std::min(len, t0 + 2 * kValueBlock); ++t)
      prefetch(values[t] + h0 * s.dim, span);
    const int64_t n = std::min<int64_t>(kValueBlock, len - t0);
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t r0 = 0; r0 < s.group; r0 += 4)
        weigh_block(static_cast<int>(std::min<int64_t>(4, s.group - r0)), values + t0,
                    h * s.dim, scores + ((h - h0) * s.group + r0) * n_len + t0, n_len, n,
                    s.dim, out + (h * s.group + r0) * s.dim);
  }
  for (int64_t i = 0; i < queries; ++i) {
    float* o = out + h0 * s.group * s.dim + i * s.dim;
    for (int64_t e = 0; e < s.dim; ++e) o[e] /= scratch.totals[i];
  }
}

// The KV cache of an op: k_buf and v_buf contiguous CPU [slots, heads, dim]
// alike, float32 or float16, or int8 with k_scale and v_scale (float32
// [slots, heads]; undefined tensors for a float cache).
void check_cache(const char* op, const at::Tensor& k_buf, const at::Tensor& v_buf,
                 const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t heads,
                 int64_t dim) {
  const auto kv_type = k_buf.scalar_type();
  const bool q8 = k_scale.defined();
  const bool type_ok = q8 ? kv_type == at::kChar : (kv_type == at::kFloat || kv_type == at::kHalf);
  for (const at::Tensor* buf : {&k_buf, &v_buf})
    TORCH_CHECK(buf->dim() == 3 && buf->scalar_type() == kv_type && type_ok &&
                    buf->is_cpu() && buf->is_contiguous() && buf->size(0) == k_buf.size(0) &&
                    buf->size(1) == heads && buf->size(2) == dim,
                op, ": k_buf and v_buf must be contiguous ", (q8 ? "int8" : "float32 or float16"),
                " alike [slots, ", heads, ", ", dim, "], got ", k_buf.sizes(), " ",
                kv_type, " and ", v_buf.sizes(), " ", v_buf.scalar_type());
  if (q8)
    for (const at::Tensor* sc : {&k_scale, &v_scale})
      TORCH_CHECK(sc->dim() == 2 && sc->scalar_type() == at::kFloat && sc->is_cpu() &&
                      sc->is_contiguous() && sc->size(0) == k_buf.size(0) &&
                      sc->size(1) == heads,
                  op, ": k_scale and v_scale must be contiguous float32 CPU [", k_buf.size(0),
                  ", ", heads, "], got ", k_scale.sizes(), " and ", v_scale.sizes());
}

// fn(k data, v data) in the cache's element type (int8, at::Half or float).
template <class Fn>
void on_cache(const at::Tensor& k_buf, const at::Tensor& v_buf, const Fn& fn) {
  if (k_buf.scalar_type() == at::kChar)
    fn(k_buf.data_ptr<int8_t>(), v_buf.data_ptr<int8_t>());
  else if (k_buf.scalar_type() == at::kHalf)
    fn(k_buf.data_ptr<at::Half>(), v_buf.data_ptr<at::Half>());
  else
    fn(k_buf.data_ptr<float>(), v_buf.data_ptr<float>());
}

// The checks and the loop of decode and decode_q8 (scales: undefined tensors
// for a float cache).
at::Tensor decode_rows(const char* op, const at::Tensor& q, const at::Tensor& k_buf,
                       const at::Tensor& v_buf, const at::Tensor& k_scale,
                       const at::Tensor& v_scale, const at::Tensor& req_to_token,
                       const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                       double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.device().is_cpu(), op,
              ": q must be a float32 CPU tensor [B, H_kv, R, D], got ", q.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  check_cache(op, k_buf, v_buf, k_scale, v_scale, heads, dim);
  const bool q8 = k_scale.defined();
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kInt &&
                  req_to_token.is_contiguous(),
              op, ": req_to_token must be contiguous int32 [requests, capacity]");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.numel() == rows && seq_lens.numel() == rows,
              op, ": req_pool_indices and seq_lens must be int64 [", rows, "]");
  const Shapes s{heads, group, dim, k_buf.size(0), req_to_token.size(1)};
  const at::Tensor qc = q.contiguous(), pools = req_pool_indices.contiguous(),
                   lens = seq_lens.contiguous();
  at::Tensor out = at::empty({rows, heads, group, dim}, q.options());
  const float* qp = qc.data_ptr<float>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t* pool = pools.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  float* op_out = out.data_ptr<float>();
  const int64_t requests = req_to_token.size(0);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(pool[b] >= 0 && pool[b] < requests, op, ": req_pool_indices[", b, "] = ",
                pool[b], " out of range [0, ", requests, ")");
    TORCH_CHECK(len[b] >= 1 && len[b] <= s.capacity, op, ": seq_lens[", b, "] = ", len[b],
                ", expected 1..", s.capacity);
  }
  const float* ksp = q8 ? k_scale.data_ptr<float>() : nullptr;
  const float* vsp = q8 ? v_scale.data_ptr<float>() : nullptr;
  const auto attend_all = [&](const auto* kp, const auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    if (attention_path() == 1 && dim % 16 == 0) {
      // A row's heads together; split by head where rows are too few to
      // give every thread one.
      const int64_t split = rows >= at::get_num_threads() ? 1 : heads;
      at::parallel_for(0, rows * split, 1, [&](int64_t begin, int64_t end) {
        Scratch<T> scratch;
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / split, part = i % split, at = b * heads * group * dim;
          attend_row_avx512(qp + at, kp, vp, ksp, vsp, table + pool[b] * s.capacity, len[b],
                            part * heads / split, (part + 1) * heads / split, s,
                            static_cast<float>(scale), op_out + at, scratch);
        }
      });
      return;
    }
    at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
      Scratch<T> scratch;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / heads, h = i % heads, at = i * group * dim;
        attend_head(qp + at, kp, vp, ksp, vsp, table + pool[b] * s.capacity, len[b], h, s,
                    static_cast<float>(scale), op_out + at, scratch);
      }
    });
  };
  on_cache(k_buf, v_buf, attend_all);
  return out;
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                  const at::Tensor& seq_lens, double scale) {
  return decode_rows("graphrunner_attention::decode", q, k_buf, v_buf, at::Tensor(),
                     at::Tensor(), req_to_token, req_pool_indices, seq_lens, scale);
}

at::Tensor decode_q8(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                     const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(k_scale.defined() && v_scale.defined(), "graphrunner_attention::decode_q8: ",
              "k_scale and v_scale must be tensors");
  return decode_rows("graphrunner_attention::decode_q8", q, k_buf, v_buf, k_scale, v_scale,
                     req_to_token, req_pool_indices, seq_lens, scale);
}

// ---- prompt attention, AVX-512 ---------------------------------------------
//
// graphrunner_attention::prompt (and prompt_q8 over an int8 cache): the n
// tokens of one request's prompt chunk, q [n, H, D] float32, over its L >= n
// slots (the chunk's own last), token i reading keys 0 .. L - n + i:
//
//   out[i, h] = sum_t softmax_t(scale * q[i, h] . k[s_t, h / R]) * v[s_t, h / R],  t <= L - n + i
//
// out [n, H D]. Each KV head alone: its keys widened to float32 and written
// transposed (kt[d][t], 16 keys a block transposed in registers), its values
// widened ([t][d]), once for all the chunk's tokens. The head's query rows
// (token, group head) go kPromptBlock at a time, over kPromptSpan keys at a
// time: a pass of kPromptRows rows takes the scores of 64 keys as one product
// (24 accumulators: each query float broadcast against 4 vectors of 16
// keys), every pass of the block reusing the 64 keys while they are in L1;
// then each row's softmax over the span against its running maximum (its
// output so far rescaled where the maximum rose, flash attention's online
// softmax), float32, exp16; then the values the same way, 6 rows x 64
// outputs in registers a pass; each row divided by its sum last. Causal
// masking costs nothing beyond a pass: a pass's scores stop at its last
// row's last key, each row's softmax and values at its own (no row reads a
// value past its keys, so a later token's NaN never reaches an earlier
// token). Against torch's fused attention over the same slots (the path it
// replaced), SmolLM2's heads, one thread, on a Xeon with AVX-512
// (bench/bench_prompt_attention.py): 1.4-2.2x at up to 1,024 keys, 1.2-1.4x
// for a 512-token chunk after 3,584, 1.0-1.1x for a whole 4,096-token
// prompt. Its sums run in another order, so the two agree within float32
// rounding, not bit for bit; a token's output depends on its own row's keys
// only, never on the chunk's other tokens.

constexpr int kPromptRows = 6;
constexpr int kPromptBlock = 8 * kPromptRows;
constexpr int64_t kPromptKeys = 64;
constexpr int64_t kPromptSpan = 4 * kPromptKeys;

struct PromptScratch {
  std::vector<float> kt, v, scores;
};

// r[i] <- column i of the 16 x 16 floats whose row j is r[j].
GR_AVX512 inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// 16 of head h's widened vectors from key t's slot, at column d (times the
// slot's scale in an int8 cache).
template <typename T>
GR_AVX512 inline __m512 widened(const T* buf, const float* sc, int64_t row, int64_t dim,
                                int64_t d) {
  const __m512 x = load16(buf + row * dim + d);
  return sc != nullptr ? _mm512_mul_ps(x, _mm512_set1_ps(sc[row])) : x;
}

// Head h of the slots' keys into kt [dim, lpad] (keys past len zero: their
// scores are never read), 16 keys a block transposed in registers, and its
// values into v [len, dim], float32; an int8 cache's times their scales.
template <typename T>
GR_AVX512 void widen_head(const T* k, const T* v, const float* ks, const float* vs,
                          const int64_t* slots, int64_t len, int64_t lpad, int64_t h,
                          int64_t heads, int64_t dim, float* kt, float* vr) {
  for (int64_t t = 0; t < len; ++t)
    for (int64_t d = 0; d < dim; d += 16)
      _mm512_storeu_ps(vr + t * dim + d, widened(v, vs, slots[t] * heads + h, dim, d));
  const int64_t whole = len / 16 * 16;
  for (int64_t t0 = 0; t0 < whole; t0 += 16)
    for (int64_t d = 0; d < dim; d += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; ++i) block[i] = widened(k, ks, slots[t0 + i] * heads + h, dim, d);
      transpose16(block);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d + i) * lpad + t0, block[i]);
    }
  alignas(64) float lanes[16];
  for (int64_t t = whole; t < len; ++t)
    for (int64_t d = 0; d < dim; d += 16) {
      _mm512_store_ps(lanes, widened(k, ks, slots[t] * heads + h, dim, d));
      for (int i = 0; i < 16; ++i) kt[(d + i) * lpad + t] = lanes[i];
    }
  for (int64_t d = 0; d < dim; ++d) std::fill(kt + d * lpad + len, kt + (d + 1) * lpad, 0.0f);
}

// dst[r * stride + j] = scale * q[r] . key t0 + j for R query rows and the 64
// keys from t0 (kt's columns).
template <int R>
GR_AVX512 __attribute__((flatten)) void prompt_scores(const float* const* q, const float* kt,
                                                      int64_t lpad, int64_t t0, int64_t dim,
                                                      float scale, float* dst, int64_t stride) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * lpad + t0;
    const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16),
                 k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r][d]);
      acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qd, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qd, k3, acc[r][3]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_ps(dst + r * stride + 16 * j, _mm512_mul_ps(acc[r][j], sc));
}

// out[r][d0 .. d0 + 16 NV) += sum_t p[r * stride + t - t0] v[t] over keys t
// in [t0, t1) before row r's limit lims[r] (lims rising): every row to the
// first row's limit, then each row alone to its own, so no row reads a value
// past its keys.
template <int R, int NV>
GR_AVX512 inline void prompt_values(const float* p, int64_t stride, const float* vr,
                                    int64_t dim, int64_t d0, int64_t t0, int64_t t1,
                                    const int64_t* lims, float* const* out) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_loadu_ps(out[r] + d0 + 16 * j);
  const int64_t shared = std::min(t1, lims[0]);
  for (int64_t t = t0; t < shared; ++t) {
    __m512 value[NV];
    for (int j = 0; j < NV; ++j) value[j] = _mm512_loadu_ps(vr + t * dim + d0 + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * stride + t - t0]);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(pr, value[j], acc[r][j]);
    }
  }
  for (int64_t t = std::max(t0, shared); t < std::min(t1, lims[R - 1]); ++t)
    for (int r = 0; r < R; ++r) {
      if (t >= lims[r]) continue;
      const __m512 pr = _mm512_set1_ps(p[r * stride + t - t0]);
      for (int j = 0; j < NV; ++j)
        acc[r][j] = _mm512_fmadd_ps(pr, _mm512_loadu_ps(vr + t * dim + d0 + 16 * j), acc[r][j]);
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out[r] + d0 + 16 * j, acc[r][j]);
}

// One pass of R rows: the values of keys [t0, t1) weighed into out, every head column.
template <int R>
GR_AVX512 __attribute__((flatten)) void prompt_pass_values(const float* p, int64_t stride,
                                                           const float* vr, int64_t dim,
                                                           int64_t t0, int64_t t1,
                                                           const int64_t* lims,
                                                           float* const* out) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    switch (std::min<int64_t>(4, (dim - d0) / 16)) {
      case 1: prompt_values<R, 1>(p, stride, vr, dim, d0, t0, t1, lims, out); break;
      case 2: prompt_values<R, 2>(p, stride, vr, dim, d0, t0, t1, lims, out); break;
      case 3: prompt_values<R, 3>(p, stride, vr, dim, d0, t0, t1, lims, out); break;
      default: prompt_values<R, 4>(p, stride, vr, dim, d0, t0, t1, lims, out); break;
    }
  }
}

using PromptScoresFn = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t,
                                float, float*, int64_t);
using PromptValuesFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                                const int64_t*, float* const*);
constexpr PromptScoresFn kPromptScores[kPromptRows + 1] = {
    nullptr,          prompt_scores<1>, prompt_scores<2>, prompt_scores<3>,
    prompt_scores<4>, prompt_scores<5>, prompt_scores<6>};
constexpr PromptValuesFn kPromptValues[kPromptRows + 1] = {
    nullptr, prompt_pass_values<1>, prompt_pass_values<2>, prompt_pass_values<3>,
    prompt_pass_values<4>, prompt_pass_values<5>, prompt_pass_values<6>};

// out[0..dim) *= by.
GR_AVX512 inline void scale_row(float* out, int64_t dim, float by) {
  const __m512 b = _mm512_set1_ps(by);
  for (int64_t d = 0; d < dim; d += 16)
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), b));
}

// Running softmax state of a block's rows: each row's largest score so far
// and its sum of exponentials against it.
struct RowState {
  float max = -INFINITY, sum = 0.0f;
};

// A block of query rows (q[r], out[r]; row r reading keys [0, lims[r]), lims
// rising), kPromptRows a pass, over kPromptSpan keys at a time: each 64 keys'
// block of the span is loaded once for every pass, scores first (into
// scores [rows, kPromptSpan]), then each row's softmax against its running
// maximum (its output so far rescaled where the maximum rose), then the
// values' blocks likewise, accumulated in out; each row divided by its sum last.
GR_AVX512 void prompt_block(const float* const* q, float* const* out, const int64_t* lims,
                            int rows, const float* kt, const float* vr, int64_t lpad,
                            int64_t dim, float scale, float* scores) {
  const int passes = (rows + kPromptRows - 1) / kPromptRows;
  const auto pass_rows = [&](int i) { return std::min(kPromptRows, rows - i * kPromptRows); };
  const auto pass_last = [&](int i) { return lims[i * kPromptRows + pass_rows(i) - 1]; };
  RowState state[kPromptBlock];
  for (int r = 0; r < rows; ++r) {
    state[r] = RowState{};
    std::fill(out[r], out[r] + dim, 0.0f);
  }
  for (int64_t span = 0; span < lims[rows - 1]; span += kPromptSpan) {
    const int64_t end = std::min(span + kPromptSpan, lims[rows - 1]);
    for (int64_t t0 = span; t0 < end; t0 += kPromptKeys)
      for (int i = 0; i < passes; ++i)
        if (t0 < pass_last(i))
          kPromptScores[pass_rows(i)](q + i * kPromptRows, kt, lpad, t0, dim, scale,
                                      scores + i * kPromptRows * kPromptSpan + (t0 - span),
                                      kPromptSpan);
    for (int r = 0; r < rows; ++r) {
      const int64_t n = std::min(end, lims[r]) - span;
      if (n <= 0) continue;
      float* p = scores + r * kPromptSpan;
      const float m = std::max(state[r].max, row_max(p, n));
      const float rescale = std::exp(state[r].max - m);  // 0 at the first span
      state[r].sum = state[r].sum * rescale + exp_sum(p, n, m);
      state[r].max = m;
      if (rescale != 1.0f) scale_row(out[r], dim, rescale);
    }
    for (int64_t t0 = span; t0 < end; t0 += kPromptKeys)
      for (int i = 0; i < passes; ++i)
        if (t0 < pass_last(i))
          kPromptValues[pass_rows(i)](scores + i * kPromptRows * kPromptSpan + (t0 - span),
                                      kPromptSpan, vr, dim, t0, t0 + kPromptKeys,
                                      lims + i * kPromptRows, out + i * kPromptRows);
  }
  for (int r = 0; r < rows; ++r) scale_row(out[r], dim, 1.0f / state[r].sum);
}

// KV head h of the chunk: its (token, group head) rows, kPromptBlock a block.
template <typename T>
void prompt_head(const float* q, const T* k, const T* v, const float* ks, const float* vs,
                 const int64_t* slots, int64_t n, int64_t len, int64_t h, int64_t heads,
                 int64_t group, int64_t dim, float scale, float* out, PromptScratch& scratch) {
  // Rows of kt a whole number of 64 keys, plus 16 floats: at 1,024 keys and
  // its multiples a row is 4 KB apart, and the 64 rows a score pass reads
  // would share one set of the L1 cache's.
  const int64_t lpad = (len + kPromptKeys - 1) / kPromptKeys * kPromptKeys + 16;
  scratch.kt.resize(static_cast<size_t>(dim * lpad));
  scratch.v.resize(static_cast<size_t>(len * dim));
  scratch.scores.resize(static_cast<size_t>(kPromptBlock * kPromptSpan));
  widen_head(k, v, ks, vs, slots, len, lpad, h, heads, dim, scratch.kt.data(), scratch.v.data());
  const int64_t rows = n * group, width = heads * group * dim;
  const float* qr[kPromptBlock];
  float* outr[kPromptBlock];
  int64_t lims[kPromptBlock];
  for (int64_t r0 = 0; r0 < rows; r0 += kPromptBlock) {
    const int nr = static_cast<int>(std::min<int64_t>(kPromptBlock, rows - r0));
    for (int r = 0; r < nr; ++r) {
      const int64_t token = (r0 + r) / group;
      const int64_t at = token * width + (h * group + (r0 + r) % group) * dim;
      qr[r] = q + at;
      outr[r] = out + at;
      lims[r] = len - n + token + 1;
    }
    prompt_block(qr, outr, lims, nr, scratch.kt.data(), scratch.v.data(), lpad, dim, scale,
                 scratch.scores.data());
  }
}

// The KV heads of k_buf [slots, H_kv, D] for queries q [n, H, D]: H a
// multiple of H_kv, D one of `multiple`; refused by name otherwise.
int64_t checked_heads(const char* op, const at::Tensor& q, const at::Tensor& k_buf,
                      int64_t multiple) {
  TORCH_CHECK(k_buf.dim() == 3, op, ": k_buf must be [slots, H_kv, D], got ", k_buf.sizes());
  const int64_t heads = k_buf.size(1), dim = q.size(2);
  TORCH_CHECK(heads > 0 && q.size(1) % heads == 0 && dim % multiple == 0 && k_buf.size(2) == dim,
              op, ": q [n, H, D] = ", q.sizes(), " against k_buf ", k_buf.sizes(),
              ": expected H a multiple of H_kv and D a multiple of ", multiple, ", alike");
  return heads;
}

// A prompt chunk's slots [L] (int64, each in [0, capacity)) for its n query
// tokens (1 <= n <= L), contiguous; refused by name otherwise.
at::Tensor checked_slots(const char* op, const at::Tensor& slots, int64_t n, int64_t capacity) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_cpu(), op,
              ": slots must be int64 CPU [L], got ", slots.sizes(), " ", slots.scalar_type());
  const int64_t len = slots.size(0);
  TORCH_CHECK(n >= 1 && n <= len, op, ": ", n, " query tokens over ", len,
              " slots, expected 1 <= n <= L (the chunk's own tokens the slots' last)");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < len; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, op, ": slots[", t, "] = ", sp[t],
                " out of range [0, ", capacity, ")");
  return sl;
}

// The checks and the loop of prompt and prompt_q8 (scales: undefined tensors
// for a float cache).
at::Tensor prompt_rows(const char* op, const at::Tensor& q, const at::Tensor& k_buf,
                       const at::Tensor& v_buf, const at::Tensor& k_scale,
                       const at::Tensor& v_scale, const at::Tensor& slots, double scale) {
  TORCH_CHECK(avx512_supported(), op, ": needs AVX-512 (F, BW, VL), which this CPU lacks");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(), op,
              ": q must be a float32 CPU tensor [n, H, D], got ", q.sizes(), " ", q.scalar_type());
  const int64_t n = q.size(0), all_heads = q.size(1), dim = q.size(2);
  const int64_t heads = checked_heads(op, q, k_buf, 16);
  check_cache(op, k_buf, v_buf, k_scale, v_scale, heads, dim);
  const bool q8 = k_scale.defined();
  const at::Tensor qc = q.contiguous(), sl = checked_slots(op, slots, n, k_buf.size(0));
  const int64_t len = sl.size(0);
  const int64_t* sp = sl.data_ptr<int64_t>();
  at::Tensor out = at::empty({n, all_heads * dim}, q.options());
  const float* ksp = q8 ? k_scale.data_ptr<float>() : nullptr;
  const float* vsp = q8 ? v_scale.data_ptr<float>() : nullptr;
  const auto run = [&](const auto* kp, const auto* vp) {
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      PromptScratch scratch;
      for (int64_t h = begin; h < end; ++h)
        prompt_head(qc.data_ptr<float>(), kp, vp, ksp, vsp, sp, n, len, h, heads,
                    all_heads / heads, dim, static_cast<float>(scale), out.data_ptr<float>(),
                    scratch);
    });
  };
  on_cache(k_buf, v_buf, run);
  return out;
}

at::Tensor prompt(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& slots, double scale) {
  return prompt_rows("graphrunner_attention::prompt", q, k_buf, v_buf, at::Tensor(), at::Tensor(),
                     slots, scale);
}

at::Tensor prompt_q8(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const at::Tensor& slots, double scale) {
  return prompt_rows("graphrunner_attention::prompt_q8", q, k_buf, v_buf, k_scale, v_scale,
                     slots, scale);
}


// ---- prompt attention, AMX-BF16 --------------------------------------------
//
// graphrunner_attention::prompt_bf16: prompt's attention (above) for
// bfloat16 queries q [n, H, D] (D a multiple of 64) over a bfloat16, float16
// or float32 cache, on the CPU's AMX tiles, out [n, H D] bfloat16, as torch's
// fused bfloat16 attention computes it: bfloat16 products summed in float32,
// the online softmax in float32, its probabilities rounded to bfloat16 for
// the value product. A float16 or float32 cache is rounded to bfloat16 on the
// way in (the path torch took read it as bfloat16 too).
//
// Everything runs transposed, a block of 16 query tokens in the 16 lanes of
// a register, so the softmax needs no horizontal sum or maximum: each KV
// head's keys are bfloat16 rows (the A tiles of the scores), its values
// transposed, vt [D, keys] (the A tiles of the output); each query head of
// its group then takes 16 tokens a block, their queries' dim pairs as one B
// tile per 32 dims, over 64 keys a span:
//
//   scores^T [64 keys, 16 tokens] = keys . q^T        4 x (D / 32) tdpbf16ps
//   p^T = e^(scale scores^T - ref), masked            16 lanes a key, in log2 units
//   out^T [D, 16 tokens] += vt . p^T                  (D / 16) x 2 tdpbf16ps
//
// each token's output divided by its sum and transposed back last. A
// token's reference is its maximum over its first span, raised only when a
// later score passes it by more than kLazyRescale (that span's probabilities
// taken again, its output and sum rescaled: FlashAttention-3's lazy
// rescaling), so most spans take their probabilities in one pass: the
// softmax is the same whatever the reference, and e^8 keeps every
// probability finite in bfloat16. A key past a token's own last
// has probability 0; a 32-key chunk whose values are not all finite (a zero
// times a later token's NaN would be NaN) is weighed token by token, each to
// its own last key, so a token's output depends on its own row's keys only,
// as on the float32 path.

#define GR_AMX_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")))
// GCC's tile loads are asm without a memory clobber: this tells the compiler
// that what ordinary code stored before is read.
#define GR_TILE_READS() __asm__ volatile("" ::: "memory")

constexpr int kTileRows = 16;        // query tokens a block (a B tile's 16 columns)
constexpr int64_t kTileKeys = 16;    // keys a score tile (an A tile's rows)
constexpr int64_t kChunkKeys = 32;   // keys a value product (an A tile's columns)
constexpr int64_t kSpanKeys = 64;    // keys a span: 4 score tiles, 2 value products
constexpr int64_t kTileWords = 256;  // 16 rows x 64 bytes, in 32-bit words
constexpr float kLazyRescale = 8.0f; // a reference maximum raised past this margin

// Whether this CPU has AMX-BF16 (CPUID leaf 7: EDX bits 22 bf16, 24 tile) and
// Linux grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, 18, asked once). The guard against a fault; the choice
// is cpu_features' (which hides amx_bf16 where GRAPHRUNNER_CPU_DISABLE asks).
bool amx_bf16_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!avx512_supported() || !__builtin_cpu_supports("avx512bf16") ||
        !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1))
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

// The 64-byte tile configuration (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

GR_AMX_BF16 void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// 32 of a row's elements from p as bfloat16 (rounded to nearest even where
// the cache is wider), one 512-bit register.
GR_AMX_BF16 inline __m512i bf16x32(const at::BFloat16* p) { return _mm512_loadu_si512(p); }
GR_AMX_BF16 inline __m512i bf16x32(const at::Half* p) {
  const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
GR_AMX_BF16 inline __m512i bf16x32(const float* p) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}

// 16 bfloat16 rounded from x, stored at p.
GR_AMX_BF16 inline void store_bf16x16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

// One bfloat16 widened to float32 (exactly).
inline float widen_bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Words of two 16-element halves (0-15, 16-31) paired by element: word 2i
// from the low half, 2i + 1 from the high half.
alignas(64) constexpr uint16_t kInterleave[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// n elements of T at a 64-byte boundary (whole tile rows a cache line),
// valid until the next get.
template <typename T>
struct AlignedBuffer {
  std::vector<uint8_t> bytes;
  T* get(int64_t n) {
    bytes.resize(static_cast<size_t>(n) * sizeof(T) + 64);
    const auto at = reinterpret_cast<uintptr_t>(bytes.data());
    return reinterpret_cast<T*>((at + 63) & ~static_cast<uintptr_t>(63));
  }
};

// A KV head laid out for the tiles: keys [lpad, dim] and values transposed
// vt [dim, lpad] (rows vstride apart), bfloat16, zero from len to lpad;
// finite[c]: whether the values of key chunk c (32 keys) are all finite.
struct HeadTiles {
  const uint16_t* keys;
  const uint16_t* vt;
  const uint8_t* finite;
  int64_t lpad, vstride, dim;
};

// One thread's scratch: a KV head's layout, and a block's queries (B tiles),
// scores, probabilities (B tiles) and transposed float32 output.
struct AmxScratch {
  AlignedBuffer<uint16_t> keys, vt, value_rows, queries, probs;
  AlignedBuffer<float> scores, out;
  std::vector<uint8_t> finite;
};

// Head h of the slots' keys and values in HeadTiles' layout. The values go
// through rows (32 keys at a time): each pair of keys interleaved by dim
// (a 32-bit word per dim), then 16 x 16 words transposed: row d of vt.
template <typename T>
GR_AMX_BF16 HeadTiles head_tiles(const T* k, const T* v, const int64_t* slots, int64_t len,
                                 int64_t h, int64_t heads, int64_t dim, AmxScratch& scratch) {
  const int64_t lpad = (len + kSpanKeys - 1) / kSpanKeys * kSpanKeys;
  // vt's rows a cache line more than lpad apart: at 2,048 keys and their
  // multiples a tile's 16 rows would otherwise share one set of the L1's.
  const int64_t vstride = lpad + 32;
  uint16_t* keys = scratch.keys.get(lpad * dim);
  uint16_t* vt = scratch.vt.get(vstride * dim);
  uint16_t* rows = scratch.value_rows.get(kChunkKeys * dim);
  scratch.finite.assign(static_cast<size_t>(lpad / kChunkKeys), 1);
  const __m512i exponent = _mm512_set1_epi16(0x7F80), order = _mm512_load_si512(kInterleave);
  for (int64_t t0 = 0; t0 < lpad; t0 += kChunkKeys) {
    __mmask32 odd = 0;  // lanes whose exponent is all ones: an infinity or NaN
    for (int64_t t = t0; t < t0 + kChunkKeys; ++t)
      for (int64_t d = 0; d < dim; d += 32) {
        const bool live = t < len;
        const int64_t at = (slots[live ? t : 0] * heads + h) * dim + d;
        const __m512i kx = live ? bf16x32(k + at) : _mm512_setzero_si512();
        const __m512i vx = live ? bf16x32(v + at) : _mm512_setzero_si512();
        _mm512_storeu_si512(keys + t * dim + d, kx);
        _mm512_storeu_si512(rows + (t - t0) * dim + d, vx);
        odd |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(vx, exponent), exponent);
      }
    scratch.finite[t0 / kChunkKeys] = odd == 0;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      __m512 pairs[16];
      for (int i = 0; i < 16; ++i) {
        const uint16_t* even = rows + 2 * i * dim + d0;
        const __m512i both = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + dim)), 1);
        pairs[i] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(order, both));
      }
      transpose16(pairs);  // pairs[d]: dim d0 + d of the chunk's 32 keys
      for (int d = 0; d < 16; ++d) _mm512_storeu_ps(reinterpret_cast<float*>(vt + (d0 + d) * vstride + t0), pairs[d]);
    }
  }
  return HeadTiles{keys, vt, scratch.finite.data(), lpad, vstride, dim};
}

// A block's 16 queries (rows of dim bfloat16 at q, the row stride `width`;
// rows from `live` on zero) as B tiles: qb[c * 256 + i * 16 + r] is the pair
// (dims 32c + 2i, 32c + 2i + 1) of query r.
GR_AMX_BF16 void query_tiles(const uint16_t* q, int64_t width, int64_t live, int64_t dim,
                             uint16_t* qb) {
  for (int64_t c = 0; c < dim / 32; ++c) {
    __m512 words[16];
    for (int r = 0; r < 16; ++r)
      words[r] = r < live ? _mm512_castsi512_ps(_mm512_loadu_si512(q + r * width + 32 * c))
                          : _mm512_setzero_ps();
    transpose16(words);
    for (int i = 0; i < 16; ++i)
      _mm512_storeu_ps(reinterpret_cast<float*>(qb + c * 2 * kTileWords + 32 * i), words[i]);
  }
}

// st[16 j + i][r] = key t0 + 16 j + i . query r for the span's first `tiles`
// score tiles, float32 [64 keys, 16 tokens].
GR_AMX_BF16 void span_scores(const uint16_t* qb, const HeadTiles& head, int64_t t0, int tiles,
                             float* st) {
  const int64_t chunks = head.dim / 32, stride = head.dim * 2;
  const uint16_t* k = head.keys + t0 * head.dim;
  GR_TILE_READS();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, qb + c * 2 * kTileWords, 64);
    _tile_loadd(6, k + 32 * c, stride);
    _tile_dpbf16ps(0, 6, 4);
    if (tiles > 1) {
      _tile_loadd(7, k + 16 * head.dim + 32 * c, stride);
      _tile_dpbf16ps(1, 7, 4);
    }
    if (tiles > 2) {
      _tile_loadd(6, k + 32 * head.dim + 32 * c, stride);
      _tile_dpbf16ps(2, 6, 4);
    }
    if (tiles > 3) {
      _tile_loadd(7, k + 48 * head.dim + 32 * c, stride);
      _tile_dpbf16ps(3, 7, 4);
    }
  }
  _tile_stored(0, st, 64);
  if (tiles > 1) _tile_stored(1, st + 256, 64);
  if (tiles > 2) _tile_stored(2, st + 512, 64);
  if (tiles > 3) _tile_stored(3, st + 768, 64);
}

// A block's running softmax, a token a lane: its limit (last key + 1), the
// reference maximum, the sum of exponentials against it.
struct BlockLanes {
  __m512i lim;
  __m512 ref, sum;  // ref in log2 units: a score's scale * log2(e) times it
  int64_t first, last;  // the smallest and largest limit
};

// 2^y (y = n + f, |f| <= 1/2: 2^f by the degree-5 Taylor polynomial of
// e^(f ln 2), then times 2^n by vscalefps): within 3e-6 relative, ample for
// probabilities rounded to bfloat16; a NaN y stays NaN, a y far below -126
// gives 0 (a -inf y gives NaN: masked lanes are zeroed by the caller).
constexpr float kExp2Taylor[] = {1.3333558146e-3f, 9.6181291076e-3f, 5.5504108665e-2f,
                                 2.4022650696e-1f, 6.9314718056e-1f, 1.0f};
GR_AMX_BF16 inline __m512 exp2_16(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
  return _mm512_scalef_ps(p, n);
}

// The lanes (tokens) that read key t: those whose limit is past it.
GR_AMX_BF16 inline __mmask16 reading(const BlockLanes& lanes, int64_t t) {
  return t < lanes.first ? static_cast<__mmask16>(0xFFFF)
                         : _mm512_cmpgt_epi32_mask(lanes.lim, _mm512_set1_epi32(static_cast<int>(t)));
}

// Each lane's largest scaled score (log2 units) over the span's keys it reads.
GR_AMX_BF16 __m512 span_top(const float* st, int64_t t0, int64_t keys, float scale2,
                            const BlockLanes& lanes) {
  const __m512 sc = _mm512_set1_ps(scale2);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < keys; ++t)
    top = _mm512_mask_max_ps(top, reading(lanes, t0 + t), top, _mm512_mul_ps(_mm512_load_ps(st + 16 * t), sc));
  return top;
}

// The span's probabilities 2^(scale2 s - ref), zero past each lane's limit,
// as bfloat16 B tiles (pb[kp * 16 + r] pairs keys 2 kp, 2 kp + 1 of token
// r) and, with pf, float32 [64, 16]; their sums added to total. Returns each
// lane's largest exponent (scale2 s - ref, -inf where it reads none).
GR_AMX_BF16 __m512 span_probs(const float* st, int64_t t0, int64_t keys, float scale2,
                              const BlockLanes& lanes, uint16_t* pb, float* pf, __m512& total) {
  const __m512 sc = _mm512_set1_ps(scale2);
  const __m512i order = _mm512_load_si512(kInterleave);
  __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < kSpanKeys; t += 2) {
    __m512 e[2];
    for (int j = 0; j < 2; ++j) {
      e[j] = _mm512_setzero_ps();
      if (t + j < keys) {
        const __mmask16 live = reading(lanes, t0 + t + j);
        const __m512 y = _mm512_fmsub_ps(_mm512_load_ps(st + 16 * (t + j)), sc, lanes.ref);
        top = _mm512_mask_max_ps(top, live, top, y);
        e[j] = _mm512_maskz_mov_ps(live, exp2_16(y));
      }
      if (pf != nullptr) _mm512_store_ps(pf + 16 * (t + j), e[j]);
      sum = _mm512_add_ps(sum, e[j]);
    }
    _mm512_store_si512(pb + 16 * t, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0])));
  }
  total = _mm512_add_ps(total, sum);
  return top;
}

// The span's softmax step from st (keys t0 .. t0 + 64, those from `last` on
// none of the block's): at a block's first span each lane's reference is
// its maximum; after, the probabilities are taken against the reference in
// one pass, and taken again where a lane's score passed it by more than
// kLazyRescale (its reference raised, its output out^T [dim, 16] and sum
// rescaled). pf (or nullptr) as span_probs.
GR_AMX_BF16 void span_softmax(const float* st, int64_t t0, float scale, int64_t dim,
                              BlockLanes& lanes, uint16_t* pb, float* pf, float* out) {
  const int64_t keys = std::min(kSpanKeys, lanes.last - t0);
  const float scale2 = scale * kLog2e;
  if (t0 == 0) lanes.ref = span_top(st, t0, keys, scale2, lanes);
  __m512 total = lanes.sum;
  const __m512 top = span_probs(st, t0, keys, scale2, lanes, pb, pf, total);
  const __mmask16 raise = _mm512_cmp_ps_mask(top, _mm512_set1_ps(kLazyRescale * kLog2e), _CMP_GT_OQ);
  if (raise != 0) {
    const __m512 ref = _mm512_mask_add_ps(lanes.ref, raise, lanes.ref, top);
    const __m512 by = exp2_16(_mm512_sub_ps(lanes.ref, ref));  // 1 where not raised
    for (int64_t d = 0; d < dim; ++d)
      _mm512_store_ps(out + 16 * d, _mm512_mul_ps(_mm512_load_ps(out + 16 * d), by));
    lanes.ref = ref;
    total = _mm512_mul_ps(lanes.sum, by);
    span_probs(st, t0, keys, scale2, lanes, pb, pf, total);
  }
  lanes.sum = total;
}

// out^T [dim, 16] += vt . p^T over the span's chunks [first, first + count)
// (32 keys each, all their values finite), 64 dims at a time.
GR_AMX_BF16 void chunks_values(const uint16_t* pb, int first, int count, const HeadTiles& head,
                               int64_t t0, float* out) {
  const int64_t stride = head.vstride * 2;
  for (int64_t g = 0; g < head.dim; g += 64) {
    float* o = out + 16 * g;
    GR_TILE_READS();
    _tile_loadd(0, o, 64);
    _tile_loadd(1, o + 256, 64);
    _tile_loadd(2, o + 512, 64);
    _tile_loadd(3, o + 768, 64);
    for (int pc = first; pc < first + count; ++pc) {
      const uint16_t* vt = head.vt + g * head.vstride + t0 + kChunkKeys * pc;
      _tile_loadd(4, pb + kChunkKeys * 16 * pc, 64);
      _tile_loadd(6, vt, stride);
      _tile_dpbf16ps(0, 6, 4);
      _tile_loadd(7, vt + 16 * head.vstride, stride);
      _tile_dpbf16ps(1, 7, 4);
      _tile_loadd(6, vt + 32 * head.vstride, stride);
      _tile_dpbf16ps(2, 6, 4);
      _tile_loadd(7, vt + 48 * head.vstride, stride);
      _tile_dpbf16ps(3, 7, 4);
    }
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 256, 64);
    _tile_stored(2, o + 512, 64);
    _tile_stored(3, o + 768, 64);
  }
}

// out^T += the values of keys [k0, k0 + 32) weighed token by token, each
// lane only to its own limit (a chunk with a value not finite), in float32
// FMAs of the bfloat16 probabilities and values.
GR_AMX_BF16 void chunk_values_lanes(const float* pf, int64_t t0, int64_t k0, const HeadTiles& head,
                                    const BlockLanes& lanes, float* out) {
  for (int64_t t = k0; t < std::min(k0 + kChunkKeys, lanes.last); ++t) {
    const __mmask16 reads = _mm512_cmpgt_epi32_mask(lanes.lim, _mm512_set1_epi32(static_cast<int>(t)));
    const __m512 p = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(pf + 16 * (t - t0)))), 16));
    for (int64_t d = 0; d < head.dim; ++d) {
      const __m512 v = _mm512_set1_ps(widen_bf16(head.vt[d * head.vstride + t]));
      _mm512_store_ps(out + 16 * d, _mm512_mask3_fmadd_ps(p, v, _mm512_load_ps(out + 16 * d), reads));
    }
  }
}

// One block of 16 query tokens (qb, their limits in lanes) over the head:
// out^T [dim, 16] their unnormalized outputs, lanes.sum their sums.
GR_AMX_BF16 void amx_block(const uint16_t* qb, const HeadTiles& head, float scale,
                           BlockLanes& lanes, float* st, uint16_t* pb, float* pf, float* out) {
  std::fill(out, out + 16 * head.dim, 0.0f);
  lanes.ref = _mm512_set1_ps(-INFINITY);
  lanes.sum = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < lanes.last; t0 += kSpanKeys) {
    const int tiles = static_cast<int>((std::min(kSpanKeys, lanes.last - t0) + kTileKeys - 1) / kTileKeys);
    span_scores(qb, head, t0, tiles, st);
    const int chunks = static_cast<int>(std::min<int64_t>(2, (lanes.last - t0 + kChunkKeys - 1) / kChunkKeys));
    bool all_finite = true;  // else the float32 probabilities are kept for chunk_values_lanes
    for (int pc = 0; pc < chunks; ++pc) all_finite = all_finite && head.finite[t0 / kChunkKeys + pc];
    span_softmax(st, t0, scale, head.dim, lanes, pb, all_finite ? nullptr : pf, out);
    for (int pc = 0; pc < chunks;) {
      int run = 0;  // finite chunks from pc on
      while (pc + run < chunks && head.finite[t0 / kChunkKeys + pc + run]) ++run;
      if (run > 0) {
        chunks_values(pb, pc, run, head, t0, out);
        pc += run;
      } else {
        chunk_values_lanes(pf, t0, t0 + kChunkKeys * pc, head, lanes, out);
        ++pc;
      }
    }
  }
}

// out rows (16 tokens from `live` on dropped, row stride `width`) = out^T
// [dim, 16] divided by each token's sum, transposed back 16 x 16 at a time,
// rounded to bfloat16.
GR_AMX_BF16 void store_block(const float* out_t, __m512 sum, int64_t dim, int64_t live,
                             int64_t width, uint16_t* dst) {
  const __m512 by = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    __m512 rows[16];
    for (int d = 0; d < 16; ++d) rows[d] = _mm512_mul_ps(_mm512_load_ps(out_t + 16 * (d0 + d)), by);
    transpose16(rows);
    for (int64_t r = 0; r < live; ++r) store_bf16x16(dst + r * width + d0, rows[r]);
  }
}

// KV head h of the chunk: its layout once, then each of its group's query
// heads 16 tokens a block.
template <typename T>
GR_AMX_BF16 void amx_head(const uint16_t* q, const T* k, const T* v, const int64_t* slots,
                          int64_t n, int64_t len, int64_t h, int64_t heads, int64_t group,
                          int64_t dim, float scale, uint16_t* out, AmxScratch& scratch) {
  const HeadTiles head = head_tiles(k, v, slots, len, h, heads, dim, scratch);
  uint16_t* qb = scratch.queries.get(kTileRows * dim);
  uint16_t* pb = scratch.probs.get(kTileRows * kSpanKeys);
  float* st = scratch.scores.get(2 * kTileRows * kSpanKeys);  // scores, then float32 probabilities
  float* o = scratch.out.get(kTileRows * dim);
  const int64_t width = heads * group * dim;
  BlockLanes lanes;
  alignas(64) int32_t lim[kTileRows];
  for (int64_t g = 0; g < group; ++g) {
    const int64_t col = (h * group + g) * dim;
    for (int64_t i0 = 0; i0 < n; i0 += kTileRows) {
      const int64_t live = std::min<int64_t>(kTileRows, n - i0);
      for (int r = 0; r < kTileRows; ++r)  // a lane past the chunk repeats its last token
        lim[r] = static_cast<int32_t>(len - n + i0 + std::min<int64_t>(r, live - 1) + 1);
      lanes.lim = _mm512_load_si512(lim);
      lanes.first = lim[0];
      lanes.last = lim[kTileRows - 1];
      query_tiles(q + i0 * width + col, width, live, dim, qb);
      amx_block(qb, head, scale, lanes, st, pb, st + kTileRows * kSpanKeys, o);
      store_block(o, lanes.sum, dim, live, width, out + i0 * width + col);
    }
  }
}

// A thread's heads [begin, end): its tiles configured, then released.
template <typename T>
GR_AMX_BF16 void amx_heads(int64_t begin, int64_t end, const uint16_t* q, const T* k,
                           const T* v, const int64_t* slots, int64_t n, int64_t len,
                           int64_t heads, int64_t group, int64_t dim, float scale,
                           uint16_t* out) {
  configure_tiles();
  AmxScratch scratch;
  for (int64_t h = begin; h < end; ++h)
    amx_head(q, k, v, slots, n, len, h, heads, group, dim, scale, out, scratch);
  _tile_release();
}

at::Tensor prompt_bf16(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                       const at::Tensor& slots, double scale) {
  const char* op = "graphrunner_attention::prompt_bf16";
  TORCH_CHECK(amx_bf16_granted(), op,
              ": needs AMX-BF16 (and the OS's grant of its tiles), which this process lacks");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.device().is_cpu(), op,
              ": q must be a bfloat16 CPU tensor [n, H, D], got ", q.sizes(), " ",
              q.scalar_type());
  const int64_t n = q.size(0), all_heads = q.size(1), dim = q.size(2);
  const int64_t heads = checked_heads(op, q, k_buf, 64);
  const auto kv_type = k_buf.scalar_type();
  for (const at::Tensor* buf : {&k_buf, &v_buf})
    TORCH_CHECK(buf->dim() == 3 && buf->scalar_type() == kv_type &&
                    (kv_type == at::kBFloat16 || kv_type == at::kHalf || kv_type == at::kFloat) &&
                    buf->is_cpu() && buf->is_contiguous() && buf->sizes() == k_buf.sizes(),
                op, ": k_buf and v_buf must be contiguous bfloat16, float16 or float32 alike [slots, ",
                heads, ", ", dim, "], got ", k_buf.sizes(), " ", kv_type, " and ", v_buf.sizes(),
                " ", v_buf.scalar_type());
  const at::Tensor qc = q.contiguous(), sl = checked_slots(op, slots, n, k_buf.size(0));
  const int64_t len = sl.size(0);
  const int64_t* sp = sl.data_ptr<int64_t>();
  at::Tensor out = at::empty({n, all_heads * dim}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  auto* op_out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto run = [&](const auto* kp, const auto* vp) {
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      amx_heads(begin, end, qp, kp, vp, sp, n, len, heads, all_heads / heads, dim,
                static_cast<float>(scale), op_out);
    });
  };
  if (kv_type == at::kBFloat16)
    run(k_buf.data_ptr<at::BFloat16>(), v_buf.data_ptr<at::BFloat16>());
  else if (kv_type == at::kHalf)
    run(k_buf.data_ptr<at::Half>(), v_buf.data_ptr<at::Half>());
  else
    run(k_buf.data_ptr<float>(), v_buf.data_ptr<float>());
  return out;
}

// Whether prompt_bf16 runs in this process (AMX-BF16 present and granted).
bool prompt_bf16_runs() { return amx_bf16_granted(); }

}  // namespace

TORCH_LIBRARY(graphrunner_attention, m) {
  m.def(
      "decode(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
  m.def(
      "rope_store(Tensor qkv, Tensor positions, Tensor out_loc, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, int heads) -> Tensor");
  m.def(
      "decode_q8(Tensor q, Tensor k_buf, Tensor v_buf, Tensor k_scale, Tensor v_scale, "
      "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
  m.def("prompt(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, float scale) -> Tensor");
  m.def(
      "prompt_q8(Tensor q, Tensor k_buf, Tensor v_buf, Tensor k_scale, Tensor v_scale, "
      "Tensor slots, float scale) -> Tensor");
  m.def(
      "prompt_bf16(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, float scale) -> Tensor");
  m.def("prompt_bf16_runs() -> bool", &prompt_bf16_runs);
  m.def("paths() -> int", &paths);
  m.def("use_path(int code) -> ()", &use_path);
  m.def(
      "rope_store_q8(Tensor qkv, Tensor positions, Tensor out_loc, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, "
      "int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_attention, CPU, m) {
  m.impl("decode", &decode);
  m.impl("rope_store", &rope_store);
  m.impl("decode_q8", &decode_q8);
  m.impl("rope_store_q8", &rope_store_q8);
  m.impl("prompt", &prompt);
  m.impl("prompt_q8", &prompt_q8);
  m.impl("prompt_bf16", &prompt_bf16);
}
