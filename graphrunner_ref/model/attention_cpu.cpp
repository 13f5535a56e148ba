// Decode attention over each row's live KV slots, float32, AVX2/FMA
// (graphrunner_attention::decode; attention_cpu.py builds this file and
// attention_live.py holds the torch reference it must equal):
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
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

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
inline void scores8(const float* q, const float* const (&keys)[8], int n, int64_t dim,
                    float scale, float* scores) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[i] + d), acc[i]);
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sum8x8(acc));
  for (int i = 0; i < n; ++i) {
    float s = sums[i];
    for (int64_t e = d; e < dim; ++e) s = std::fma(q[e], keys[i][e], s);  // a head size not of 8s
    scores[i] = s * scale;
  }
}

// e^x for x <= 0, 8 lanes (x = n ln2 + f, |f| <= ln2 / 2; e^f by its degree-6
// Taylor polynomial, 2^n put into the exponent): within 2 ulp of expf; below
// -87 (past float's normal range) 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
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
template <int NV>
inline void weigh_values(const float* const* values, const float* p, int64_t n, int64_t c,
                         float* out) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pv = _mm256_set1_ps(p[t]);
    for (int j = 0; j < NV; ++j)
      acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(values[t] + c + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + c + 8 * j, acc[j]);
}

using WeighFn = void (*)(const float* const*, const float*, int64_t, int64_t, float*);
constexpr WeighFn kWeigh[9] = {nullptr,          weigh_values<1>, weigh_values<2>,
                               weigh_values<3>,  weigh_values<4>, weigh_values<5>,
                               weigh_values<6>,  weigh_values<7>, weigh_values<8>};

// out[0 .. dim) = sum_t p[t] * values[t]: 64 floats at a time in registers,
// a head size not of 8s finished one float at a time.
inline void weigh(const float* const* values, const float* p, int64_t n, int64_t dim, float* out) {
  const int64_t whole = dim / 8 * 8;
  for (int64_t c = 0; c < whole; c += 64)
    kWeigh[std::min<int64_t>(8, (whole - c) / 8)](values, p, n, c, out);
  for (int64_t e = whole; e < dim; ++e) {
    float acc = 0.0f;
    for (int64_t t = 0; t < n; ++t) acc = std::fma(p[t], values[t][e], acc);
    out[e] = acc;
  }
}

struct Shapes {
  int64_t heads, group, dim, slots, capacity;
};

// Scratch of one thread: a row's key and value rows of one KV head, and scores.
struct Scratch {
  std::vector<const float*> keys, values;
  std::vector<float> scores;
};

// One (row, KV head): its R query heads against the row's `len` live slots.
void attend_head(const float* q, const float* k, const float* v, const int32_t* slot_row,
                 int64_t len, int64_t h, const Shapes& s, float scale, float* out,
                 Scratch& scratch) {
  scratch.keys.resize(static_cast<size_t>(len));
  scratch.values.resize(static_cast<size_t>(len));
  scratch.scores.resize(static_cast<size_t>(s.group * len));
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = slot_row[t];
    TORCH_CHECK(slot >= 0 && slot < s.slots, "graphrunner_attention::decode: KV slot ", slot,
                " out of range [0, ", s.slots, ")");
    scratch.keys[t] = k + (slot * s.heads + h) * s.dim;
    scratch.values[t] = v + (slot * s.heads + h) * s.dim;
  }
  for (int64_t r = 0; r < s.group; ++r) {
    float* scores = scratch.scores.data() + r * len;
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, len - t0));
      const float* keys[8];
      for (int i = 0; i < 8; ++i) keys[i] = scratch.keys[t0 + std::min(i, n - 1)];
      scores8(q + r * s.dim, keys, n, s.dim, scale, scores + t0);
    }
    softmax(scores, len);
    weigh(scratch.values.data(), scores, len, s.dim, out + r * s.dim);
  }
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                  const at::Tensor& seq_lens, double scale) {
  const char* op = "graphrunner_attention::decode";
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.device().is_cpu(), op,
              ": q must be a float32 CPU tensor [B, H_kv, R, D], got ", q.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  for (const at::Tensor* buf : {&k_buf, &v_buf})
    TORCH_CHECK(buf->dim() == 3 && buf->scalar_type() == at::kFloat && buf->is_contiguous() &&
                    buf->size(1) == heads && buf->size(2) == dim,
                op, ": k_buf and v_buf must be contiguous float32 [slots, ", heads, ", ", dim,
                "], got ", buf->sizes());
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
  const float* kp = k_buf.data_ptr<float>();
  const float* vp = v_buf.data_ptr<float>();
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
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, at = i * group * dim;
      attend_head(qp + at, kp, vp, table + pool[b] * s.capacity, len[b], h, s,
                  static_cast<float>(scale), op_out + at, scratch);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(graphrunner_attention, m) {
  m.def(
      "decode(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrunner_attention, CPU, m) { m.impl("decode", &decode); }
