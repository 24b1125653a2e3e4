// RMSNorm (with the residual add fused in), SiLU-and-mul and neox RoPE on a CPU, one
// pass over the data each (sglite: layers/layernorm.py, activation.py,
// rotary_embedding.py, forward_cpu; SGLang's counterparts are sgl-kernel's
// fused_add_rmsnorm_cpu, silu_and_mul_cpu and rotary_embedding_cpu). In plain PyTorch
// each is five to twenty small ops, each a pass over memory and an allocation; in a
// decode round those cost more than the arithmetic.
//
// float32 or bfloat16 tensors (one type per call; RoPE's cos/sin table is float32).
// The arithmetic is float32; with bfloat16 the results are rounded where the
// forward_native ops round them (the residual sum; the normed row before the weight's
// product; silu(gate) before the product with up), so both paths agree closely.
#include <ATen/Parallel.h>

#include <cmath>

#include "common.h"
#include "kernels.h"

namespace {

// rows of a small tensor go to one thread: waking a second costs more than the work
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

using sglite::from_f32;
using sglite::to_f32;

template <class T>
void rmsnorm_rows(const T* x, const T* w, T* out, int64_t n, int64_t hidden, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * hidden;
    const float ss = sglite::ordered_sum(hidden, [xi](int64_t j) { return to_f32(xi[j]) * to_f32(xi[j]); });
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    T* oi = out + i * hidden;
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) oi[j] = from_f32<T>(to_f32(w[j]) * to_f32(from_f32<T>(to_f32(xi[j]) * inv)));
  }
}

template <class T>
void rmsnorm_impl(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, float eps) {
  const int64_t hidden = x.size(-1), n = x.numel() / std::max<int64_t>(1, hidden);
  const T* xp = sglite::data<T>(x);
  const T* wp = sglite::data<T>(weight);
  T* op = sglite::data<T>(out);
  at::parallel_for(0, n, grain_rows(hidden), [&](int64_t b, int64_t e) {
    rmsnorm_rows(xp + b * hidden, wp, op + b * hidden, e - b, hidden, eps);
  });
}

template <class T>
void fused_add_rmsnorm_impl(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                            torch::Tensor& sum, torch::Tensor& out, float eps) {
  const int64_t hidden = x.size(-1), n = x.numel() / std::max<int64_t>(1, hidden);
  const T* xp = sglite::data<T>(x);
  const T* rp = sglite::data<T>(residual);
  const T* wp = sglite::data<T>(weight);
  T* sp = sglite::data<T>(sum);
  T* op = sglite::data<T>(out);
  at::parallel_for(0, n, grain_rows(hidden), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) {
        sp[i * hidden + j] = from_f32<T>(to_f32(xp[i * hidden + j]) + to_f32(rp[i * hidden + j]));
      }
    }
    rmsnorm_rows(sp + b * hidden, wp, op + b * hidden, e - b, hidden, eps);
  });
}

template <class T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out, int64_t n, int64_t d) {
  const T* xp = sglite::data<T>(x);
  T* op = sglite::data<T>(out);
  at::parallel_for(0, n, grain_rows(2 * d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* __restrict g = xp + i * 2 * d;
      const T* __restrict u = g + d;
      T* __restrict o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const float gj = to_f32(g[j]);
        o[j] = from_f32<T>(to_f32(from_f32<T>(gj / (1.f + sglite::exp_vec(-gj)))) * to_f32(u[j]));
      }
    }
  });
}

template <class T>
void rope_impl(const int64_t* pos, const torch::Tensor& x, const float* cs, torch::Tensor& out) {
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T* xp = sglite::data<T>(x);
  T* op = sglite::data<T>(out);
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, n, grain_rows(heads * dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cs + pos[t] * dim;
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x1 = xp + t * st + h * sh;
        const T* x2 = x1 + half;
        T* o = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_f32(x1[j]), bb = to_f32(x2[j]);
          o[j] = from_f32<T>(a * c[j] - bb * s[j]);
          o[half + j] = from_f32<T>(bb * c[j] + a * s[j]);
        }
      }
    }
  });
}

}  // namespace

// out = weight * x / sqrt(mean(x^2) + eps), per row; with residual: sum = x + residual
// first, and out is the norm of sum. x, residual, sum, out: [n, hidden]; weight: [hidden].
void rmsnorm(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps) {
  sglite::check_cpu_float(x, "x");
  sglite::check_same_dtype(weight, x, "weight");
  sglite::check_cpu_float(weight, "weight");
  sglite::check_same_dtype(out, x, "out");
  sglite::check_cpu_float(out, "out");
  TORCH_CHECK(weight.numel() == x.size(-1) && out.sizes() == x.sizes(), "rmsnorm: shapes do not match");
  if (sglite::is_bf16(x)) {
    rmsnorm_impl<uint16_t>(x, weight, out, static_cast<float>(eps));
  } else {
    rmsnorm_impl<float>(x, weight, out, static_cast<float>(eps));
  }
}

void fused_add_rmsnorm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                       torch::Tensor& sum, torch::Tensor& out, double eps) {
  sglite::check_cpu_float(x, "x");
  for (const auto& [t, name] : {std::pair{&residual, "residual"}, {&weight, "weight"}, {&sum, "sum"}, {&out, "out"}}) {
    sglite::check_cpu_float(*t, name);
    sglite::check_same_dtype(*t, x, name);
  }
  TORCH_CHECK(weight.numel() == x.size(-1) && residual.sizes() == x.sizes() && sum.sizes() == x.sizes() &&
                  out.sizes() == x.sizes(),
              "fused_add_rmsnorm: shapes do not match");
  if (sglite::is_bf16(x)) {
    fused_add_rmsnorm_impl<uint16_t>(x, residual, weight, sum, out, static_cast<float>(eps));
  } else {
    fused_add_rmsnorm_impl<float>(x, residual, weight, sum, out, static_cast<float>(eps));
  }
}

// x: [n, 2d] (gate, up) -> out: [n, d] = silu(gate) * up
void silu_and_mul(const torch::Tensor& x, torch::Tensor& out) {
  sglite::check_cpu_float(x, "x");
  sglite::check_cpu_float(out, "out");
  sglite::check_same_dtype(out, x, "out");
  const int64_t d = x.size(-1) / 2, n = x.numel() / std::max<int64_t>(1, x.size(-1));
  TORCH_CHECK(x.size(-1) == 2 * d && out.numel() == n * d && out.size(-1) == d, "silu_and_mul: shapes do not match");
  if (sglite::is_bf16(x)) {
    silu_and_mul_impl<uint16_t>(x, out, n, d);
  } else {
    silu_and_mul_impl<float>(x, out, n, d);
  }
}

// neox RoPE: for each row t and head h, with c, s the first and second halves of
// cos_sin[positions[t]]: out[:half] = x1 c - x2 s, out[half:] = x2 c + x1 s.
// x: [n, heads, head_dim] (rows and heads may be strided), out: [n, heads, head_dim] contiguous.
void rope_neox(const torch::Tensor& positions, const torch::Tensor& x, const torch::Tensor& cos_sin,
               torch::Tensor& out) {
  sglite::check_cpu_i64(positions, "positions");
  sglite::check_rows_float(x, "x");
  sglite::check_cpu_f32(cos_sin, "cos_sin_cache");
  sglite::check_cpu_float(out, "out");
  sglite::check_same_dtype(out, x, "out");
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes() && positions.numel() == x.size(0), "rope: shapes do not match");
  const int64_t n = x.size(0), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(1) == dim, "rope: cos_sin_cache must be [positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "rope: a position is beyond the cos/sin cache");
  }
  if (sglite::is_bf16(x)) {
    rope_impl<uint16_t>(pos, x, cos_sin.data_ptr<float>(), out);
  } else {
    rope_impl<float>(pos, x, cos_sin.data_ptr<float>(), out);
  }
}
