// bfloat16 linear layers on a CPU with prepacked weights (sglite: layers/linear.py;
// SGLang's counterparts are sgl-kernel's convert_weight_packed and weight_packed_linear).
//
// Layout. convert_weight_packed turns a weight [N, K] into blocks of 16 output rows; in a
// block, K runs in pairs and each pair holds the 16 rows' two values side by side:
//   packed[b][p][r][j] = W[16 b + r][2 p + j]          (zeros past N and K)
// stored as a [Np, Kp] tensor (Np = N rounded up to 16, Kp = K rounded up to 2). One
// pair step of a block is 64 bytes: one AVX512-BF16 vdpbf16ps adds x[2p] W[.,2p] +
// x[2p+1] W[.,2p+1] into 16 float32 accumulators, one per output row. A whole block is
// one sequential stream, and so is the whole weight.
//
// Compute. Output tiles of MR input rows by NB blocks (16 NB columns) keep MR x NB
// accumulators in registers; each 64-byte weight load serves MR rows. Batch 1 (a GEMV)
// is bound by reading the weight once: MR = 1, NB = 4 keeps four dependency chains in
// flight. Large batches are bound by the dot products: MR = 8, NB = 2 does 16 of them
// per 2 weight loads and 8 broadcasts. Threads split the columns; each runs every row
// tile over a chunk of its columns before the next chunk, so the chunk's weights stay in
// its caches. Sums are float32; the output is float32 or rounded to bfloat16 (round to
// nearest even, as torch).
//
// Without AVX512-BF16 (built for a CPU that lacks it) the same layout runs a portable
// loop: correct, not fast; sglite picks float32 on such CPUs by default.
//
// float32 weights pack the same way without the pairs (packed[b][k][r] = W[16 b + r][k],
// still a [Np, Kp] tensor) and run the same tiles with one FMA per k (AVX-512F).
//
// Batch invariance (docs/kernels.md): every output is one accumulator that adds its K
// products in increasing k, whatever the tile, the batch or the thread: a row's result
// is the same bits alone or among 64 (torch's float32 F.linear is not: its GEMV and GEMM
// kernels sum in other orders).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SGLITE_HAVE_AVX512BF16 1
#endif

#include "common.h"
#include "kernels.h"

namespace {

constexpr int64_t kBlock = 16;  // output rows per packed block

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

struct Gemm {
  const uint16_t* x;  // [M, K] bf16 bits, row stride ldx
  int64_t ldx;
  const uint16_t* w;  // packed [Np / 16][Kp / 2][16][2]
  const float* bias;  // [N] or nullptr
  void* out;          // [M, N], float32 or bf16, row stride N
  bool out_f32;
  int64_t M, N, K, Kp;
  static constexpr int64_t kElemBytes = 2;
};

struct GemmF32 {
  const float* x;  // [M, K], row stride ldx
  int64_t ldx;
  const float* w;     // packed [Np / 16][Kp][16]
  const float* bias;  // [N] or nullptr
  float* out;         // [M, N]
  int64_t M, N, K, Kp;
  static constexpr int64_t kElemBytes = 4;
};

inline void store_row(const GemmF32& g, int64_t m, int64_t col, const float* v, int64_t count) {
  float* o = g.out + m * g.N + col;
  for (int64_t i = 0; i < count; ++i) o[i] = v[i] + (g.bias ? g.bias[col + i] : 0.f);
}

inline void store_row(const Gemm& g, int64_t m, int64_t col, const float* v, int64_t count) {
  if (g.out_f32) {
    float* o = static_cast<float*>(g.out) + m * g.N + col;
    for (int64_t i = 0; i < count; ++i) o[i] = v[i] + (g.bias ? g.bias[col + i] : 0.f);
  } else {
    uint16_t* o = static_cast<uint16_t*>(g.out) + m * g.N + col;
    for (int64_t i = 0; i < count; ++i) o[i] = sglite::f32_to_bf16(v[i] + (g.bias ? g.bias[col + i] : 0.f));
  }
}

#ifdef SGLITE_HAVE_AVX512BF16

// rows m0..m0+MR-1, blocks b0..b0+NB-1 (all inside the packed weight)
template <int MR, int NB>
void tile(const Gemm& g, int64_t m0, int64_t b0) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = g.Kp / 2, block_elems = g.Kp * kBlock;
  const uint16_t* wb = g.w + b0 * block_elems;
  const int64_t K2 = g.K / 2;  // pairs fully inside x's row; an odd K's last one is padded
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wb + j * block_elems + p * 2 * kBlock);
    for (int i = 0; i < MR; ++i) {
      const uint16_t* xr = g.x + (m0 + i) * g.ldx + 2 * p;
      int32_t pair;
      if (p < K2) {
        std::memcpy(&pair, xr, 4);
      } else {
        pair = xr[0];  // the last of an odd K: its partner is zero
      }
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
    }
  }
  alignas(64) float buf[kBlock];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b0 + j) * kBlock;
      const int64_t count = std::min<int64_t>(kBlock, g.N - col);
      if (count <= 0) continue;
      if (count == kBlock && !g.bias) {
        if (g.out_f32) {
          _mm512_storeu_ps(static_cast<float*>(g.out) + (m0 + i) * g.N + col, acc[i][j]);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(g.out) + (m0 + i) * g.N + col),
                              (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
        }
        continue;
      }
      _mm512_store_ps(buf, acc[i][j]);
      store_row(g, m0 + i, col, buf, count);
    }
  }
}

// float32: rows m0..m0+MR-1, blocks b0..b0+NB-1; each sum adds its products in k order
template <int MR, int NB>
void tile(const GemmF32& g, int64_t m0, int64_t b0) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block_elems = g.Kp * kBlock;
  const float* wb = g.w + b0 * block_elems;
  for (int64_t k = 0; k < g.K; ++k) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(wb + j * block_elems + k * kBlock);
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(g.x[(m0 + i) * g.ldx + k]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
    }
  }
  alignas(64) float buf[kBlock];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b0 + j) * kBlock;
      const int64_t count = std::min<int64_t>(kBlock, g.N - col);
      if (count <= 0) continue;
      _mm512_store_ps(buf, acc[i][j]);
      store_row(g, m0 + i, col, buf, count);
    }
  }
}

template <int MR, int NB, class G>
void run_rows(const G& g, int64_t m0, int64_t b_begin, int64_t b_end) {
  int64_t b = b_begin;
  for (; b + NB <= b_end; b += NB) tile<MR, NB>(g, m0, b);
  for (; b < b_end; ++b) tile<MR, 1>(g, m0, b);
}

// the remaining rows (fewer than 8) of a batch, as one tile
template <class G>
void run_tail_rows(const G& g, int64_t m, int64_t b_begin, int64_t b_end) {
  switch (g.M - m) {
    case 7: run_rows<7, 2>(g, m, b_begin, b_end); break;
    case 6: run_rows<6, 2>(g, m, b_begin, b_end); break;
    case 5: run_rows<5, 2>(g, m, b_begin, b_end); break;
    case 4: run_rows<4, 2>(g, m, b_begin, b_end); break;
    case 3: run_rows<3, 4>(g, m, b_begin, b_end); break;
    case 2: run_rows<2, 4>(g, m, b_begin, b_end); break;
    case 1: run_rows<1, 4>(g, m, b_begin, b_end); break;
    default: break;
  }
}

// every row tile over blocks [b_begin, b_end), a chunk of blocks at a time: the chunk's
// weights (about kChunkBytes) stay in the core's L2 while every row tile reads them, so
// a weight larger than the caches (the LM head's 57 MB) is read from memory once, not
// once per row tile
constexpr int64_t kChunkBytes = 256 << 10;

template <class G>
void run_blocks(const G& g, int64_t b_begin, int64_t b_end) {
  if (g.M == 1) {
    run_rows<1, 4>(g, 0, b_begin, b_end);
    return;
  }
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (g.Kp * kBlock * G::kElemBytes) / 2 * 2);  // even: NB = 2
  for (int64_t c = b_begin; c < b_end; c += chunk) {
    const int64_t c_end = std::min(b_end, c + chunk);
    int64_t m = 0;
    for (; m + 8 <= g.M; m += 8) run_rows<8, 2>(g, m, c, c_end);
    run_tail_rows(g, m, c, c_end);
  }
}

#else  // portable: the same layout, float32 arithmetic

// element k of row m of x, and element k of output row r of block b of the packed weight
inline float x_at(const Gemm& g, int64_t m, int64_t k) { return sglite::bf16_to_f32(g.x[m * g.ldx + k]); }
inline float x_at(const GemmF32& g, int64_t m, int64_t k) { return g.x[m * g.ldx + k]; }
inline float w_at(const Gemm& g, int64_t b, int64_t k, int64_t r) {
  return sglite::bf16_to_f32(g.w[b * g.Kp * kBlock + (k / 2) * 2 * kBlock + 2 * r + k % 2]);
}
inline float w_at(const GemmF32& g, int64_t b, int64_t k, int64_t r) { return g.w[(b * g.Kp + k) * kBlock + r]; }

template <class G>
void run_blocks(const G& g, int64_t b_begin, int64_t b_end) {
  float acc[kBlock];
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      std::fill(acc, acc + kBlock, 0.f);
      for (int64_t k = 0; k < g.K; ++k) {
        const float xv = x_at(g, m, k);
#pragma omp simd
        for (int64_t r = 0; r < kBlock; ++r) acc[r] += xv * w_at(g, b, k, r);
      }
      store_row(g, m, b * kBlock, acc, std::min<int64_t>(kBlock, g.N - b * kBlock));
    }
  }
}

#endif

}  // namespace

bool cpu_has_avx512_bf16() {
#ifdef SGLITE_HAVE_AVX512BF16
  return true;
#else
  return false;
#endif
}

// a bfloat16 weight (or any other but float32, rounded to bfloat16) in bf16 blocks of K
// pairs; a float32 weight in float32 blocks of single k (see the top of this file)
torch::Tensor convert_weight_packed(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "convert_weight_packed: weight must be a 2-D CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = round_up(N, kBlock), Kp = round_up(K, 2);
  const bool f32 = weight.scalar_type() == torch::kFloat32;
  torch::Tensor w = torch::zeros({Np, Kp}, weight.options().dtype(f32 ? torch::kFloat32 : torch::kBFloat16));
  w.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);  // padded (rounded to bf16 unless float32)
  if (f32) {  // [Np/16, 16, Kp] -> [Np/16, Kp, 16]
    return w.view({Np / kBlock, kBlock, Kp}).permute({0, 2, 1}).contiguous().view({Np, Kp});
  }
  // [Np/16, 16, Kp/2, 2] -> [Np/16, Kp/2, 16, 2]
  return w.view({Np / kBlock, kBlock, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({Np, Kp});
}

// x: [..., K] bf16 or float32 (rows may be strided); packed: convert_weight_packed of a [N, K]
// weight of x's type; bias: [N] float32 or bf16 (added in float32). Returns [..., N] in x's
// type (bf16 with out_f32: float32).
torch::Tensor weight_packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                   const std::optional<torch::Tensor>& bias, int64_t n, bool out_f32) {
  const bool f32 = x.scalar_type() == torch::kFloat32;
  TORCH_CHECK(x.device().is_cpu() && (f32 || x.scalar_type() == torch::kBFloat16),
              "weight_packed_linear: x must be a bfloat16 or float32 CPU tensor");
  if (f32) {
    sglite::check_cpu(packed, "packed", torch::kFloat32, "float32 (x is float32)");
  } else {
    sglite::check_cpu(packed, "packed", torch::kBFloat16, "bfloat16");
  }
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) % kBlock == 0 && packed.size(1) % 2 == 0 && n > 0 &&
                  n <= packed.size(0) && packed.size(0) - n < kBlock,
              "weight_packed_linear: packed must come from convert_weight_packed of an [n, K] weight");
  const int64_t K = x.size(-1);
  TORCH_CHECK(round_up(K, 2) == packed.size(1), "weight_packed_linear: x has ", K, " columns; the weight has ",
              packed.size(1));
  torch::Tensor x2 = x.reshape({-1, K});
  if (x2.stride(-1) != 1 || (x2.size(0) > 1 && x2.stride(0) < K)) x2 = x2.contiguous();
  torch::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "weight_packed_linear: bias must have ", n, " values");
    b32 = bias->to(torch::kFloat32).contiguous();
  }
  const int64_t M = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor out = torch::empty(shape, x.options().dtype(out_f32 || f32 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0) return out;
  const int64_t ldx = M > 1 ? x2.stride(0) : K, blocks = packed.size(0) / kBlock;
  // a thread's share is at least 64 KB of weight (waking a thread costs microseconds)
  const int64_t grain = std::max<int64_t>(1, 65536 / (packed.size(1) * kBlock * (f32 ? 4 : 2)));
  const float* b = bias ? b32.data_ptr<float>() : nullptr;
  if (f32) {
    const GemmF32 g{x2.data_ptr<float>(), ldx, packed.data_ptr<float>(), b, out.data_ptr<float>(), M, n, K,
                    packed.size(1)};
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t e) { run_blocks(g, b0, e); });
    return out;
  }
  const Gemm g{reinterpret_cast<const uint16_t*>(x2.data_ptr()), ldx, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
               b, out.data_ptr(), out_f32, M, n, K, packed.size(1)};
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t e) { run_blocks(g, b0, e); });
  return out;
}
