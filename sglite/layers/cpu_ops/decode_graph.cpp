// A Llama-family model's whole decode forward as one call (sglite:
// model_executor/cpu_graph_runner.py; SGLang's CPUGraphRunner gets its CPU decode graph
// from torch.compile instead).
//
// The call runs, layer by layer, exactly what LlamaForCausalLM.forward runs for a DECODE
// batch with the cpu attention backend and forward_cpu custom ops: the same ATen ops on
// the same tensors (embedding, linear, matmul, index_put_) and the same kernels
// (rmsnorm, fused_add_rmsnorm, rope_neox, decode_attention, silu_and_mul), so its logits
// equal the module's bit for bit. What it leaves out is Python: a decode forward of the
// modules is about 100 torch calls on the tiny test model (1,500 on SmolLM2), most of
// them small enough that issuing them from Python takes longer than running them. It also runs without the GIL from start to end, where the module
// takes the GIL back between every two ops: in the overlap loop the scheduler's Python
// runs beside the whole forward instead of taking turns with it.
//
// The graph holds the model's parameters and the KV pool's per-layer buffers (the same
// storage, not copies), handed over once by add_layer.
#include "common.h"
#include "kernels.h"

namespace {

void check_weight(const torch::Tensor& t, const char* name, std::vector<int64_t> shape) {
  sglite::check_cpu_f32(t, name);
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), name, " has shape ", t.sizes(), ", expected ",
              at::IntArrayRef(shape));
}

}  // namespace

DecodeGraph::DecodeGraph(torch::Tensor embed, torch::Tensor final_norm, torch::Tensor lm_head, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps, double scaling)
    : embed_(std::move(embed)),
      final_norm_(std::move(final_norm)),
      lm_head_(std::move(lm_head)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      eps_(rms_norm_eps),
      scaling_(scaling) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
              "DecodeGraph: bad head counts");
  sglite::check_cpu_f32(embed_, "embed");
  TORCH_CHECK(embed_.dim() == 2, "embed must be [vocab, hidden]");
  hidden_ = embed_.size(1);
  check_weight(final_norm_, "final_norm", {hidden_});
  sglite::check_cpu_f32(lm_head_, "lm_head");
  TORCH_CHECK(lm_head_.dim() == 2 && lm_head_.size(1) == hidden_, "lm_head must be [vocab, hidden]");
}

void DecodeGraph::add_layer(torch::Tensor input_norm, torch::Tensor qkv, std::optional<torch::Tensor> qkv_bias,
                            torch::Tensor o, torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down,
                            torch::Tensor cos_sin, torch::Tensor k_buf, torch::Tensor v_buf) {
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  check_weight(input_norm, "input_norm", {hidden_});
  check_weight(qkv, "qkv", {q_size + 2 * kv_size, hidden_});
  if (qkv_bias) check_weight(*qkv_bias, "qkv_bias", {q_size + 2 * kv_size});
  check_weight(o, "o", {hidden_, q_size});
  check_weight(post_norm, "post_norm", {hidden_});
  sglite::check_cpu_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == hidden_ && gate_up.size(0) % 2 == 0,
              "gate_up must be [2 * intermediate, hidden]");
  check_weight(down, "down", {hidden_, gate_up.size(0) / 2});
  sglite::check_cpu_f32(cos_sin, "cos_sin_cache");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == head_dim_, "cos_sin_cache must be [positions, head_dim]");
  sglite::check_cpu_f32(k_buf, "k_buf");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.size(1) == num_kv_heads_ && k_buf.size(2) == head_dim_ &&
                  v_buf.sizes() == k_buf.sizes(),
              "k_buf and v_buf must be [slots, kv_heads, head_dim]");
  sglite::check_cpu_f32(v_buf, "v_buf");
  layers_.push_back(Layer{std::move(input_norm), std::move(qkv), std::move(qkv_bias), std::move(o),
                          std::move(post_norm), std::move(gate_up), std::move(down), std::move(cos_sin),
                          std::move(k_buf), std::move(v_buf)});
}

// input_ids, positions, out_cache_loc, req_pool_indices, seq_lens: [bs] int64; one row per
// request. Returns float32 logits [bs, vocab]. The kernels check every index they read.
torch::Tensor DecodeGraph::run(const torch::Tensor& input_ids, const torch::Tensor& positions,
                               const torch::Tensor& out_cache_loc, const torch::Tensor& req_to_token,
                               const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens) const {
  sglite::check_cpu_i64(input_ids, "input_ids");
  sglite::check_cpu_i64(positions, "positions");
  sglite::check_cpu_i64(out_cache_loc, "out_cache_loc");
  const int64_t n = input_ids.numel();
  TORCH_CHECK(input_ids.dim() == 1 && positions.numel() == n && out_cache_loc.numel() == n &&
                  req_pool_indices.numel() == n && seq_lens.numel() == n,
              "DecodeGraph.run: one row per request: input_ids, positions, out_cache_loc, req_pool_indices and "
              "seq_lens must have one length");
  TORCH_CHECK(!layers_.empty(), "DecodeGraph.run: no layers added");
  const int64_t slots = layers_[0].k_buf.size(0);
  const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(loc[i] >= 0 && loc[i] < slots, "out_cache_loc holds a slot outside the KV pool");
  }
  at::NoGradGuard no_grad;  // the parameters require grad; nothing here may record a graph
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const torch::Tensor q_rows = torch::arange(n, input_ids.options());

  torch::Tensor hidden = at::embedding(embed_, input_ids);
  torch::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& L = layers_[i];
    torch::Tensor x = torch::empty_like(hidden);
    if (i == 0) {
      residual = hidden;
      rmsnorm(hidden, L.input_norm, x, eps_);
    } else {
      torch::Tensor sum = torch::empty_like(hidden);
      fused_add_rmsnorm(hidden, residual, L.input_norm, sum, x, eps_);
      residual = sum;
    }
    // attention: qkv projection, RoPE on q and k, K/V into the pool, paged decode attention
    const torch::Tensor qkv = at::linear(x, L.qkv, L.qkv_bias);
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
    const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
    torch::Tensor q_rot = torch::empty({n, num_heads_, head_dim_}, hidden.options());
    torch::Tensor k_rot = torch::empty({n, num_kv_heads_, head_dim_}, hidden.options());
    rope_neox(positions, q, L.cos_sin, q_rot);
    rope_neox(positions, k, L.cos_sin, k_rot);
    torch::Tensor k_buf = L.k_buf, v_buf = L.v_buf;  // handles to the pool's storage
    k_buf.index_put_({out_cache_loc}, k_rot);
    v_buf.index_put_({out_cache_loc}, v);
    torch::Tensor attn = torch::empty({n, num_heads_, head_dim_}, hidden.options());
    decode_attention(q_rot, L.k_buf, L.v_buf, req_to_token, q_rows, req_pool_indices, seq_lens, attn, scaling_);
    hidden = at::linear(attn.view({n, q_size}), L.o);
    // MLP
    torch::Tensor sum = torch::empty_like(hidden);
    x = torch::empty_like(hidden);
    fused_add_rmsnorm(hidden, residual, L.post_norm, sum, x, eps_);
    residual = sum;
    const torch::Tensor gate_up = at::linear(x, L.gate_up);
    torch::Tensor act = torch::empty({n, gate_up.size(1) / 2}, hidden.options());
    silu_and_mul(gate_up, act);
    hidden = at::linear(act, L.down);
  }
  torch::Tensor sum = torch::empty_like(hidden), x = torch::empty_like(hidden);
  fused_add_rmsnorm(hidden, residual, final_norm_, sum, x, eps_);
  return at::matmul(x, lm_head_.t()).to(torch::kFloat32);
}
