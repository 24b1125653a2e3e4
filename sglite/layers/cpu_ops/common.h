// Shared by sglite's CPU kernels: argument checks that raise a Python RuntimeError
// with one readable line instead of reading memory the tensors do not own.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace sglite {

inline void check_cpu(const torch::Tensor& t, const char* name, c10::ScalarType dtype, const char* dtype_name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), name, " must be a contiguous ",
              dtype_name, " CPU tensor");
}

inline void check_cpu_f32(const torch::Tensor& t, const char* name) { check_cpu(t, name, torch::kFloat32, "float32"); }

inline void check_cpu_i64(const torch::Tensor& t, const char* name) { check_cpu(t, name, torch::kInt64, "int64"); }

// a float32 CPU tensor whose last dimension is contiguous (rows may be strided views)
inline void check_rows_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.stride(-1) == 1, name,
              " must be a float32 CPU tensor with a contiguous last dimension");
}

// exp(x) in a form the compiler vectorizes (std::exp stays a scalar call): x = k ln2 + r
// with |r| <= ln2/2 (ln2 split in two for exactness), exp(r) by Cephes' degree-7
// polynomial, 2^k put into the exponent bits. Relative error about 2e-7 (float32's
// rounding); inputs are clamped to [-87, 88], where float32's exp stays normal.
// (The clamps vectorize only under -fno-trapping-math, one of cpu_ops' CFLAGS.)
inline float exp_vec(float x) {
  x = x < 88.f ? x : 88.f;
  x = x > -87.f ? x : -87.f;
  const int32_t k = static_cast<int32_t>(x * 1.44269504088896341f + 128.5f) - 128;  // round(x / ln2)
  const float kf = static_cast<float>(k);
  const float r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r * r + r + 1.f) * __builtin_bit_cast(float, (k + 127) << 23);
}

}  // namespace sglite
