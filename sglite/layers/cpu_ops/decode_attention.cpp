// Paged attention on a CPU, one query row at a time (sglite: layers/attention/cpu_backend.py):
// a decode row, or any row of a prefill (its seq_len is its position + 1).
//
// Each row attends to its K/V where req_to_token says they live, read straight from the
// pool: no gathered copy, no padding. Its positions are cut into ranges of kRange that
// start at multiples of kRange, whatever the batch; every (row, KV head, range) is
// attended in parallel over torch's intra-op threads (the scores of that KV head's query
// heads (GQA) against the range, their softmax, the weighted sum of V), then each (row,
// KV head)'s ranges are merged in order (split-KV, as flash-decoding). So a row's bits
// depend on its own query, its K/V and its position alone: the same whether it comes
// alone, in a batch of 64, in a prefill, a prefill chunk or a decode step (batch
// invariance, docs/kernels.md). A head_dim known at compile time (64, 128) lets the
// compiler unroll and vectorize the inner loops fully; others take the same code with a
// runtime head_dim. q, the pool and out are float32 or bfloat16 (one type); scores,
// softmax and sums are float32, every sum in one fixed order.
#include <ATen/Parallel.h>

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using sglite::to_f32;

constexpr int64_t kRange = 128;            // positions per range; ranges start at multiples of it
constexpr int64_t kBlockFloats = 1 << 22;  // partial results held at once (16 MB): rows go in blocks

int64_t ranges_of(int64_t seq_len) { return (seq_len + kRange - 1) / kRange; }

template <class T>
struct Problem {
  const T* q;                   // [bs, H, D]
  const T* k_buf;               // [slots, KVH, D]
  const T* v_buf;               // [slots, KVH, D]
  const int64_t* req_to_token;  // [max_reqs, r2t_stride]
  int64_t r2t_stride;
  const int64_t* q_rows;    // [n]: the row of q (and out) of each request
  const int64_t* pool_idx;  // [n]: its row of req_to_token
  const int64_t* seq_lens;  // [n]: positions 0..seq_len-1 are attended
  T* out;                   // [bs, H, D]
  int64_t n, H, KVH;
  float scale;
};

#ifdef __AVX512F__
// 16 elements as float32: loaded, or widened from bfloat16 (its bits are a float's top half)
inline __m512 load16(const float* v) { return _mm512_loadu_ps(v); }
inline __m512 load16(const uint16_t* v) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// scores[g * L + t] = scale * q_g . k_t for the G query heads (float32 in qf) of one KV
// head: each K row is read and widened once for all G heads; returns nothing, fills top
template <int64_t kD, class T>
void scores_avx512(const float* qf, const T* k_buf, const int64_t* slots, int64_t slot_stride, int64_t L,
                   int64_t G, float scale, float* scores, float* top) {
  constexpr int64_t C = kD / 16;
  for (int64_t t = 0; t < L; ++t) {
    const T* kp = k_buf + slots[t] * slot_stride;
    __m512 k[C];
    for (int64_t c = 0; c < C; ++c) k[c] = load16(kp + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + g * kD), k[0]);
      for (int64_t c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * kD + 16 * c), k[c], acc);
      const float s = _mm512_reduce_add_ps(acc) * scale;
      scores[g * L + t] = s;
      top[g] = std::max(top[g], s);
    }
  }
}

// acc[g] += sum_t w[g, t] v_t: each V row read and widened once for all G heads
template <int64_t kD, class T>
void values_avx512(const float* scores, const T* v_buf, const int64_t* slots, int64_t slot_stride, int64_t L,
                   int64_t G, float* acc) {
  constexpr int64_t C = kD / 16;
  for (int64_t t = 0; t < L; ++t) {
    const T* vp = v_buf + slots[t] * slot_stride;
    __m512 v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = load16(vp + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * L + t]);
      float* a = acc + g * kD;
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, v[c], _mm512_loadu_ps(a + 16 * c)));
    }
  }
}
#endif

// the same two passes in plain loops (any head_dim; a CPU without AVX-512)
template <int64_t kD, class T>
void scores_generic(const float* qf, const T* k_buf, const int64_t* slots, int64_t slot_stride, int64_t L,
                    int64_t G, int64_t d_runtime, float scale, float* scores, float* top) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  for (int64_t t = 0; t < L; ++t) {
    const T* kp = k_buf + slots[t] * slot_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      const float s = sglite::ordered_sum(D, [qg, kp](int64_t d) { return qg[d] * to_f32(kp[d]); }) * scale;
      scores[g * L + t] = s;
      top[g] = std::max(top[g], s);
    }
  }
}

template <int64_t kD, class T>
void values_generic(const float* scores, const T* v_buf, const int64_t* slots, int64_t slot_stride, int64_t L,
                    int64_t G, int64_t d_runtime, float* acc) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  for (int64_t t = 0; t < L; ++t) {
    const T* vp = v_buf + slots[t] * slot_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * L + t];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += w * to_f32(vp[d]);
    }
  }
}

// One (request, KV head)'s attention over positions [t0, t1) of its request: for each of
// its G query heads, the scores' maximum (top), the sum of exp(score - top) (sum) and
// the unnormalized weighted sum of V (acc, G x D). Scratch vectors are the caller's.
template <int64_t kD, class T>
void attend_range(const Problem<T>& p, int64_t D, int64_t r, int64_t kh, int64_t t0, int64_t t1,
                  std::vector<float>& qf, std::vector<float>& scores, float* top, float* sum, float* acc) {
  const int64_t G = p.H / p.KVH, L = t1 - t0;
  const int64_t slot_stride = p.KVH * D;
  const int64_t* slots = p.req_to_token + p.pool_idx[r] * p.r2t_stride + t0;
  const T* qh = p.q + p.q_rows[r] * p.H * D + kh * G * D;  // this KV head's G query heads
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f32(qh[i]);
  scores.resize(G * L);
  std::fill(top, top + G, -std::numeric_limits<float>::infinity());
#ifdef __AVX512F__
  constexpr bool kVector = kD > 0 && kD % 16 == 0;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
    scores_avx512<kD>(qf.data(), p.k_buf + kh * D, slots, slot_stride, L, G, p.scale, scores.data(), top);
  } else {
    scores_generic<kD>(qf.data(), p.k_buf + kh * D, slots, slot_stride, L, G, D, p.scale, scores.data(), top);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * L;
    const float m = top[g];
    sum[g] = sglite::ordered_sum(L, [sg, m](int64_t t) { return sg[t] = sglite::exp_vec(sg[t] - m); });
  }
  std::fill(acc, acc + G * D, 0.f);
  if constexpr (kVector) {
    values_avx512<kD>(scores.data(), p.v_buf + kh * D, slots, slot_stride, L, G, acc);
  } else {
    values_generic<kD>(scores.data(), p.v_buf + kh * D, slots, slot_stride, L, G, D, acc);
  }
}

// out rows of one (row, KV head) from its S ranges' partial results, merged in range
// order: softmax rescaled by the ranges' maxima and sums (S = 1: the normalization)
template <class T>
void write_merged(const Problem<T>& p, int64_t D, int64_t r, int64_t kh, int64_t S, const float* top,
                  const float* sum, const float* acc, std::vector<float>& w) {
  const int64_t G = p.H / p.KVH;
  T* oh = p.out + p.q_rows[r] * p.H * D + kh * G * D;
  w.resize(S);
  for (int64_t g = 0; g < G; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < S; ++s) m = std::max(m, top[s * G + g]);
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      w[s] = sglite::exp_vec(top[s * G + g] - m);
      total += w[s] * sum[s * G + g];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) {
      float v = 0.f;
      for (int64_t s = 0; s < S; ++s) v += w[s] * acc[(s * G + g) * D + d];
      oh[g * D + d] = sglite::from_f32<T>(v * inv);
    }
  }
}

// Rows r0..r1-1: every (row, KV head, range) attended in parallel, each row's items
// together (base[i]: the first item of row r0 + i; a row has KVH x its ranges), then
// every (row, KV head)'s ranges merged. Which thread takes which item changes nothing.
template <int64_t kD, class T>
void attend_rows(const Problem<T>& p, int64_t D, int64_t r0, int64_t r1) {
  const int64_t G = p.H / p.KVH;
  std::vector<int64_t> base(r1 - r0 + 1, 0);
  for (int64_t r = r0; r < r1; ++r) base[r - r0 + 1] = base[r - r0] + p.KVH * ranges_of(p.seq_lens[r]);
  const int64_t items = base.back();
  std::vector<float> top(items * G), sum(items * G), acc(items * G * D);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(G * D);
    int64_t i = std::upper_bound(base.begin(), base.end(), begin) - base.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (base[i + 1] <= item) ++i;
      const int64_t r = r0 + i, L = p.seq_lens[r], S = ranges_of(L), local = item - base[i];
      const int64_t kh = local / S, t0 = (local % S) * kRange, t1 = std::min(L, t0 + kRange);
      attend_range<kD>(p, D, r, kh, t0, t1, qf, scores, top.data() + item * G, sum.data() + item * G,
                       acc.data() + item * G * D);
    }
  });
  at::parallel_for(r0, r1, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t S = ranges_of(p.seq_lens[r]);
      for (int64_t kh = 0; kh < p.KVH; ++kh) {
        const int64_t first = base[r - r0] + kh * S;
        write_merged(p, D, r, kh, S, top.data() + first * G, sum.data() + first * G, acc.data() + first * G * D, w);
      }
    }
  });
}

// kD > 0: head_dim fixed at compile time; kD == 0: head_dim = d_runtime. Rows go in
// blocks whose partial results fit kBlockFloats (a long prefill has many rows of many
// ranges; at least one row a block).
template <int64_t kD, class T>
void decode_attention_impl(const Problem<T>& p, int64_t d_runtime) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  const int64_t per_range = p.H * D;  // floats of one range's sums over every KV head's G query heads
  for (int64_t r0 = 0; r0 < p.n;) {
    int64_t r1 = r0 + 1, floats = ranges_of(p.seq_lens[r0]) * per_range;
    while (r1 < p.n && floats + ranges_of(p.seq_lens[r1]) * per_range <= kBlockFloats) {
      floats += ranges_of(p.seq_lens[r1++]) * per_range;
    }
    attend_rows<kD>(p, D, r0, r1);
    r0 = r1;
  }
}

template <class T>
void run(const Problem<T>& p, int64_t D) {
  switch (D) {
    case 64: decode_attention_impl<64>(p, D); break;
    case 128: decode_attention_impl<128>(p, D); break;
    default: decode_attention_impl<0>(p, D);
  }
}

}  // namespace

// q, out: [bs, H, D]; k_buf, v_buf: [slots, KVH, D]; req_to_token: [reqs, context] int64;
// q_rows, pool_idx, seq_lens: [n] int64. Writes rows q_rows of out and no others.
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                      const torch::Tensor& req_to_token, const torch::Tensor& q_rows,
                      const torch::Tensor& pool_idx, const torch::Tensor& seq_lens, torch::Tensor& out,
                      double scale) {
  sglite::check_cpu_float(q, "q");
  for (const auto& [t, name] : {std::pair{&k_buf, "k_buf"}, {&v_buf, "v_buf"}, {&out, "out"}}) {
    sglite::check_cpu_float(*t, name);
    sglite::check_same_dtype(*t, q, name);
  }
  sglite::check_cpu_i64(req_to_token, "req_to_token");
  sglite::check_cpu_i64(q_rows, "q_rows");
  sglite::check_cpu_i64(pool_idx, "pool_idx");
  sglite::check_cpu_i64(seq_lens, "seq_lens");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [rows, heads, head_dim]");
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(), "k_buf and v_buf must be [slots, kv_heads, head_dim]");
  TORCH_CHECK(req_to_token.dim() == 2, "req_to_token must be [reqs, context]");
  const int64_t n = q_rows.numel();
  TORCH_CHECK(pool_idx.numel() == n && seq_lens.numel() == n, "q_rows, pool_idx and seq_lens must have one length");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D, "q and the KV pool must have one head_dim");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of KV heads");
  if (n == 0) return;
  // indices come from the scheduler; a bad one would read outside the pool, so check them
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  const int64_t* pidx = pool_idx.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(rows[r] >= 0 && rows[r] < q.size(0), "q_rows out of range");
    TORCH_CHECK(pidx[r] >= 0 && pidx[r] < req_to_token.size(0), "pool_idx out of range");
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= req_to_token.size(1), "seq_lens out of range");
    const int64_t* slots = req_to_token.data_ptr<int64_t>() + pidx[r] * req_to_token.size(1);
    for (int64_t t = 0; t < lens[r]; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < k_buf.size(0), "req_to_token holds a slot outside the KV pool");
    }
  }
  if (sglite::is_bf16(q)) {
    using T = uint16_t;
    run(Problem<T>{sglite::data<T>(q), sglite::data<T>(k_buf), sglite::data<T>(v_buf), req_to_token.data_ptr<int64_t>(),
                   req_to_token.size(1), rows, pidx, lens, sglite::data<T>(out), n, H, KVH, static_cast<float>(scale)},
        D);
  } else {
    run(Problem<float>{q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(),
                       req_to_token.data_ptr<int64_t>(), req_to_token.size(1), rows, pidx, lens, out.data_ptr<float>(),
                       n, H, KVH, static_cast<float>(scale)},
        D);
  }
}
