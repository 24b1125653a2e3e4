// What sglite's CPU kernels export (sglite/layers/cpu_ops/__init__.py binds them in
// bindings.cpp). None of them touches Python: the bindings release the GIL around each
// call, as torch's own ops do, and DecodeGraph::run calls the others without it.
#pragma once

#include <torch/extension.h>

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

// decode_attention.cpp
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                      const torch::Tensor& req_to_token, const torch::Tensor& q_rows,
                      const torch::Tensor& pool_idx, const torch::Tensor& seq_lens, torch::Tensor& out,
                      double scale);

// fused_ops.cpp
void rmsnorm(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps);
void fused_add_rmsnorm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                       torch::Tensor& sum, torch::Tensor& out, double eps);
void silu_and_mul(const torch::Tensor& x, torch::Tensor& out);
void rope_neox(const torch::Tensor& positions, const torch::Tensor& x, const torch::Tensor& cos_sin,
               torch::Tensor& out);

// gemm.cpp: bfloat16 linear layers with prepacked weights
bool cpu_has_avx512_bf16();
torch::Tensor convert_weight_packed(const torch::Tensor& weight);
torch::Tensor weight_packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                   const std::optional<torch::Tensor>& bias, int64_t n, bool out_f32);

// decode_graph.cpp: a Llama-family model's decode forward in one call
class DecodeGraph {
 public:
  DecodeGraph(torch::Tensor embed, torch::Tensor final_norm, torch::Tensor lm_head, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps, double scaling, bool packed);
  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, std::optional<torch::Tensor> qkv_bias,
                 torch::Tensor o, torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down,
                 torch::Tensor cos_sin, torch::Tensor k_buf, torch::Tensor v_buf, int64_t intermediate);
  torch::Tensor run(const torch::Tensor& input_ids, const torch::Tensor& positions,
                    const torch::Tensor& out_cache_loc, const torch::Tensor& req_to_token,
                    const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // time per category over the runs since set_profiling(true) (the bench's split of a
  // decode forward): linear_ms, lm_head_ms, attention_ms, norm_rope_act_ms, other_ms, runs
  void set_profiling(bool on);
  std::map<std::string, double> profile() const;

 private:
  struct Layer {
    torch::Tensor input_norm, qkv;
    std::optional<torch::Tensor> qkv_bias;
    torch::Tensor o, post_norm, gate_up, down, cos_sin, k_buf, v_buf;
    int64_t intermediate;
  };
  // a weight's expected shape: [n, k], or its packed [n rounded up to 16, k rounded up to 2]
  std::vector<int64_t> weight_shape(int64_t n, int64_t k) const;
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& b,
                       int64_t n) const;
  torch::Tensor embed_, final_norm_, lm_head_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_ = 0, vocab_ = 0;
  double eps_, scaling_;
  bool packed_;  // bfloat16 with packed linear weights (gemm.cpp)
  enum Phase { kLinear, kLmHead, kAttention, kPointwise, kOther, kRuns };
  bool profiling_ = false;
  mutable std::array<double, 6> profile_ms_{};  // by Phase; kRuns counts calls
  std::vector<Layer> layers_;
};
