// The Python module of sglite's CPU kernels (sglite/layers/cpu_ops/__init__.py).
#include <torch/extension.h>

void decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                      const torch::Tensor& req_to_token, const torch::Tensor& q_rows,
                      const torch::Tensor& pool_idx, const torch::Tensor& seq_lens, torch::Tensor& out,
                      double scale);
void rmsnorm(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps);
void fused_add_rmsnorm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                       torch::Tensor& sum, torch::Tensor& out, double eps);
void silu_and_mul(const torch::Tensor& x, torch::Tensor& out);
void rope_neox(const torch::Tensor& positions, const torch::Tensor& x, const torch::Tensor& cos_sin,
               torch::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over a float32 KV pool");
  m.def("rmsnorm", &rmsnorm, "out = RMSNorm(x) * weight");
  m.def("fused_add_rmsnorm", &fused_add_rmsnorm, "sum = x + residual; out = RMSNorm(sum) * weight");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]");
  m.def("rope_neox", &rope_neox, "out = neox rotary embedding of x at positions");
}
