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

// a float32 or bfloat16 CPU tensor whose last dimension is contiguous (rows may be strided views)
inline void check_rows_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16) &&
                  t.stride(-1) == 1,
              name, " must be a float32 or bfloat16 CPU tensor with a contiguous last dimension");
}

// bfloat16 <-> float32 on the raw 16 bits (c10::BFloat16's operators do the same, but
// these inline into loops the compiler vectorizes). A bf16 is a float32's top half;
// rounding to it is to nearest, ties to even, as torch rounds; NaN stays NaN.
inline float bf16_to_f32(uint16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// the element types the kernels store: float32, or bfloat16 as its raw 16 bits; the
// arithmetic is float32 for both (to_f32 / from_f32 are the identity for float32)
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }
template <class T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline uint16_t from_f32<uint16_t>(float v) { return f32_to_bf16(v); }

// a float32 or bfloat16 contiguous CPU tensor (the activations' and the KV pool's types)
inline void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16) &&
                  t.is_contiguous(),
              name, " must be a contiguous float32 or bfloat16 CPU tensor");
}

// `t` has `like`'s dtype (the kernels take one element type per call)
inline void check_same_dtype(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(), ", not ", t.scalar_type());
}

// the raw pointer of a float32 (T = float) or bfloat16 (T = uint16_t) tensor
template <class T>
inline T* data(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

// f(0) + ... + f(n - 1) added in one order whatever n, the data's address or the batch
// the row came in (batch invariance, docs/kernels.md): lane l adds the terms j = l mod 16
// in increasing j, then the 16 lanes are added pairwise (l + 8, + 4, + 2, + 1). The
// compiler vectorizes the lanes without reordering them; `#pragma omp simd reduction`
// would let it choose the order (peeling to align the data, unrolling by the trip count).
template <class F>
inline float ordered_sum(int64_t n, F f) {
  float lanes[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int64_t l = 0; l < 16; ++l) lanes[l] += f(j + l);
  }
  for (int64_t l = 0; j + l < n; ++l) lanes[l] += f(j + l);
  for (int64_t w = 8; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  }
  return lanes[0];
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
