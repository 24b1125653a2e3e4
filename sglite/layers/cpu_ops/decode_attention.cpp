// Paged decode attention on a CPU (sglite: layers/attention/cpu_backend.py).
//
// Each one-row request (a decode row) attends to its K/V where req_to_token says they
// live, read straight from the pool: no gathered copy, no padding. For every (request,
// KV head) pair, in parallel over torch's intra-op threads: the scores of that KV head's
// query heads (GQA) against positions 0..seq_len-1, their softmax, and the weighted sum
// of V. Two passes over the request's slots; the scores wait in a per-thread buffer.
// With fewer pairs than a few per thread (a batch of one), each request's positions are
// split into ranges attended in parallel, their softmaxes merged after (split-KV).
// A head_dim known at compile time (64, 128) lets the compiler unroll and vectorize the
// inner loops fully; others take the same code with a runtime head_dim. q, the pool and
// out are float32 or bfloat16 (one type); scores, softmax and sums are float32.
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

constexpr int64_t kMaxSplits = 8;      // position ranges per (request, KV head), at most
constexpr int64_t kMinSplitLen = 64;   // positions per range, at least

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
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * to_f32(kp[d]);
      s *= scale;
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
    float total = 0.f;
    const float m = top[g];
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = sglite::exp_vec(sg[t] - m);
      total += sg[t];
    }
    sum[g] = total;
  }
  std::fill(acc, acc + G * D, 0.f);
  if constexpr (kVector) {
    values_avx512<kD>(scores.data(), p.v_buf + kh * D, slots, slot_stride, L, G, acc);
  } else {
    values_generic<kD>(scores.data(), p.v_buf + kh * D, slots, slot_stride, L, G, D, acc);
  }
}

// out rows of one (request, KV head) from S partial results over consecutive position
// ranges (S = 1: just the normalization): softmax merged by the ranges' maxima and sums
template <class T>
void write_merged(const Problem<T>& p, int64_t D, int64_t r, int64_t kh, int64_t S, const float* top,
                  const float* sum, const float* acc) {
  const int64_t G = p.H / p.KVH;
  T* oh = p.out + p.q_rows[r] * p.H * D + kh * G * D;
  for (int64_t g = 0; g < G; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < S; ++s) m = std::max(m, top[s * G + g]);
    float total = 0.f, w[kMaxSplits];
    for (int64_t s = 0; s < S; ++s) {
      w[s] = sum[s * G + g] > 0.f ? sglite::exp_vec(top[s * G + g] - m) : 0.f;
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

// kD > 0: head_dim fixed at compile time; kD == 0: head_dim = d_runtime.
// Work items are (request, KV head) pairs; when there are fewer than a few per thread (a
// batch of one or two), each request's positions are split into up to kMaxSplits ranges
// of at least kMinSplitLen, attended in parallel and merged (split-KV, as flash-decoding):
// otherwise one thread would do two KV heads while the other waits.
template <int64_t kD, class T>
void decode_attention_impl(const Problem<T>& p, int64_t d_runtime) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  const int64_t G = p.H / p.KVH, pairs = p.n * p.KVH;
  const int64_t want = 4 * at::get_num_threads();
  const int64_t S = pairs >= want ? 1 : std::min<int64_t>(kMaxSplits, (want + pairs - 1) / pairs);
  std::vector<float> top(pairs * S * G), sum(pairs * S * G), acc(pairs * S * G * D);
  at::parallel_for(0, pairs * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / S, s = item % S, r = pair / p.KVH, kh = pair % p.KVH;
      const int64_t L = p.seq_lens[r];
      // a short request uses fewer ranges; an empty range leaves sum = 0 (weight 0 when merged)
      const int64_t len = std::max<int64_t>(kMinSplitLen, (L + S - 1) / S);
      const int64_t t0 = std::min(L, s * len), t1 = std::min(L, t0 + len);
      float* tp = top.data() + item * G;
      float* sp = sum.data() + item * G;
      if (t0 == t1) {
        std::fill(tp, tp + G, -std::numeric_limits<float>::infinity());
        std::fill(sp, sp + G, 0.f);
        continue;
      }
      attend_range<kD>(p, D, r, kh, t0, t1, qf, scores, tp, sp, acc.data() + item * G * D);
    }
  });
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      write_merged(p, D, pair / p.KVH, pair % p.KVH, S, top.data() + pair * S * G, sum.data() + pair * S * G,
                   acc.data() + pair * S * G * D);
    }
  });
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
