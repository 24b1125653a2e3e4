// RMSNorm (with the residual add fused in), SiLU-and-mul and neox RoPE on a CPU, one
// pass over the data each (sglite: layers/layernorm.py, activation.py,
// rotary_embedding.py, forward_cpu; SGLang's counterparts are sgl-kernel's
// fused_add_rmsnorm_cpu, silu_and_mul_cpu and rotary_embedding_cpu). In plain PyTorch
// each is five to twenty small ops, each a pass over memory and an allocation; in a
// decode round those cost more than the arithmetic. float32 only.
#include <ATen/Parallel.h>

#include <cmath>

#include "common.h"
#include "kernels.h"

namespace {

// rows of a small tensor go to one thread: waking a second costs more than the work
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

void rmsnorm_rows(const float* x, const float* w, float* out, int64_t n, int64_t hidden, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * hidden;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < hidden; ++j) ss += xi[j] * xi[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    float* oi = out + i * hidden;
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) oi[j] = w[j] * (xi[j] * inv);
  }
}

}  // namespace

// out = weight * x / sqrt(mean(x^2) + eps), per row; with residual: sum = x + residual
// first, and out is the norm of sum. x, residual, sum, out: [n, hidden]; weight: [hidden].
void rmsnorm(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps) {
  sglite::check_cpu_f32(x, "x");
  sglite::check_cpu_f32(weight, "weight");
  sglite::check_cpu_f32(out, "out");
  const int64_t hidden = x.size(-1), n = x.numel() / std::max<int64_t>(1, hidden);
  TORCH_CHECK(weight.numel() == hidden && out.sizes() == x.sizes(), "rmsnorm: shapes do not match");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain_rows(hidden), [&](int64_t b, int64_t e) {
    rmsnorm_rows(xp + b * hidden, wp, op + b * hidden, e - b, hidden, static_cast<float>(eps));
  });
}

void fused_add_rmsnorm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                       torch::Tensor& sum, torch::Tensor& out, double eps) {
  sglite::check_cpu_f32(x, "x");
  sglite::check_cpu_f32(residual, "residual");
  sglite::check_cpu_f32(weight, "weight");
  sglite::check_cpu_f32(sum, "sum");
  sglite::check_cpu_f32(out, "out");
  const int64_t hidden = x.size(-1), n = x.numel() / std::max<int64_t>(1, hidden);
  TORCH_CHECK(weight.numel() == hidden && residual.sizes() == x.sizes() && sum.sizes() == x.sizes() &&
                  out.sizes() == x.sizes(),
              "fused_add_rmsnorm: shapes do not match");
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain_rows(hidden), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) sp[i * hidden + j] = xp[i * hidden + j] + rp[i * hidden + j];
    }
    rmsnorm_rows(sp + b * hidden, wp, op + b * hidden, e - b, hidden, static_cast<float>(eps));
  });
}

// x: [n, 2d] (gate, up) -> out: [n, d] = silu(gate) * up
void silu_and_mul(const torch::Tensor& x, torch::Tensor& out) {
  sglite::check_cpu_f32(x, "x");
  sglite::check_cpu_f32(out, "out");
  const int64_t d = x.size(-1) / 2, n = x.numel() / std::max<int64_t>(1, x.size(-1));
  TORCH_CHECK(x.size(-1) == 2 * d && out.numel() == n * d && out.size(-1) == d, "silu_and_mul: shapes do not match");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain_rows(2 * d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* __restrict g = xp + i * 2 * d;
      const float* __restrict u = g + d;
      float* __restrict o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] = g[j] / (1.f + sglite::exp_vec(-g[j])) * u[j];
    }
  });
}

// neox RoPE: for each row t and head h, with c, s the first and second halves of
// cos_sin[positions[t]]: out[:half] = x1 c - x2 s, out[half:] = x2 c + x1 s.
// x: [n, heads, head_dim] (rows and heads may be strided), out: [n, heads, head_dim] contiguous.
void rope_neox(const torch::Tensor& positions, const torch::Tensor& x, const torch::Tensor& cos_sin,
               torch::Tensor& out) {
  sglite::check_cpu_i64(positions, "positions");
  sglite::check_rows_f32(x, "x");
  sglite::check_cpu_f32(cos_sin, "cos_sin_cache");
  sglite::check_cpu_f32(out, "out");
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes() && positions.numel() == x.size(0), "rope: shapes do not match");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(1) == dim, "rope: cos_sin_cache must be [positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "rope: a position is beyond the cos/sin cache");
  }
  const float* xp = x.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, n, grain_rows(heads * dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cs + pos[t] * dim;
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = xp + t * st + h * sh;
        const float* x2 = x1 + half;
        float* o = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          o[j] = x1[j] * c[j] - x2[j] * s[j];
          o[half + j] = x2[j] * c[j] + x1[j] * s[j];
        }
      }
    }
  });
}
