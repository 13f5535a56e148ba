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
// exponential a polynomial within 2 ulp of expf).
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

// a . b over d floats: 16 lanes at a time in two chains (an FMA's latency
// hidden), then 8, then the tail one at a time.
inline float dot(const float* a, const float* b, int64_t d) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
  }
  for (; i + 8 <= d; i += 8)
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
  float s = sum8(_mm256_add_ps(even, odd));
  for (; i < d; ++i) s = std::fma(a[i], b[i], s);
  return s;
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

// out += p * v over d floats.
inline void add_scaled(float* out, const float* v, float p, int64_t d) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < d; ++i) out[i] = std::fma(p, v[i], out[i]);
}

struct Shapes {
  int64_t heads, group, dim, slots, capacity;
};

// One (row, KV head): its R query heads against the row's `len` live slots.
void attend_head(const float* q, const float* k, const float* v, const int32_t* slot_row,
                 int64_t len, int64_t h, const Shapes& s, float scale, float* out,
                 std::vector<float>& scores) {
  scores.resize(static_cast<size_t>(s.group * len));
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = slot_row[t];
    TORCH_CHECK(slot >= 0 && slot < s.slots, "graphrunner_attention::decode: KV slot ", slot,
                " out of range [0, ", s.slots, ")");
    const float* kt = k + (slot * s.heads + h) * s.dim;
    for (int64_t r = 0; r < s.group; ++r) scores[r * len + t] = dot(q + r * s.dim, kt, s.dim) * scale;
  }
  for (int64_t r = 0; r < s.group; ++r) softmax(scores.data() + r * len, len);
  std::fill(out, out + s.group * s.dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {  // each value row read once for the R query heads
    const float* vt = v + (int64_t{slot_row[t]} * s.heads + h) * s.dim;
    for (int64_t r = 0; r < s.group; ++r) add_scaled(out + r * s.dim, vt, scores[r * len + t], s.dim);
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
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, at = i * group * dim;
      attend_head(qp + at, kp, vp, table + pool[b] * s.capacity, len[b], h, s,
                  static_cast<float>(scale), op_out + at, scores);
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
