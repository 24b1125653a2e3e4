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
// float32 or bfloat16. The linear layers' weights come packed (convert_weight_packed;
// gemm.cpp runs them, as the modules' linear layers do) and the logits are float32 sums
// of the packed LM head.
//
// The graph holds the model's parameters and the KV pool's per-layer buffers (the same
// storage, not copies), handed over once by add_layer.
#include <chrono>

#include "common.h"
#include "kernels.h"

namespace {

void check_weight(const torch::Tensor& t, const char* name, const torch::Tensor& like, std::vector<int64_t> shape) {
  sglite::check_cpu_float(t, name);
  sglite::check_same_dtype(t, like, name);
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), name, " has shape ", t.sizes(), ", expected ",
              at::IntArrayRef(shape));
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

DecodeGraph::DecodeGraph(torch::Tensor embed, torch::Tensor final_norm, torch::Tensor lm_head, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps, double scaling, bool packed)
    : embed_(std::move(embed)),
      final_norm_(std::move(final_norm)),
      lm_head_(std::move(lm_head)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      eps_(rms_norm_eps),
      scaling_(scaling),
      packed_(packed) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
              "DecodeGraph: bad head counts");
  sglite::check_cpu_float(embed_, "embed");
  TORCH_CHECK(embed_.dim() == 2, "embed must be [vocab, hidden]");
  hidden_ = embed_.size(1);
  vocab_ = embed_.size(0);
  check_weight(final_norm_, "final_norm", embed_, {hidden_});
  check_weight(lm_head_, "lm_head", embed_, weight_shape(vocab_, hidden_));
}

std::vector<int64_t> DecodeGraph::weight_shape(int64_t n, int64_t k) const {
  return packed_ ? std::vector<int64_t>{round_up(n, 16), round_up(k, 2)} : std::vector<int64_t>{n, k};
}

torch::Tensor DecodeGraph::linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& b,
                                  int64_t n) const {
  return packed_ ? weight_packed_linear(x, w, b, n, false) : at::linear(x, w, b);
}

void DecodeGraph::add_layer(torch::Tensor input_norm, torch::Tensor qkv, std::optional<torch::Tensor> qkv_bias,
                            torch::Tensor o, torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down,
                            torch::Tensor cos_sin, torch::Tensor k_buf, torch::Tensor v_buf, int64_t intermediate) {
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  check_weight(input_norm, "input_norm", embed_, {hidden_});
  check_weight(qkv, "qkv", embed_, weight_shape(q_size + 2 * kv_size, hidden_));
  if (qkv_bias) check_weight(*qkv_bias, "qkv_bias", embed_, {q_size + 2 * kv_size});
  check_weight(o, "o", embed_, weight_shape(hidden_, q_size));
  check_weight(post_norm, "post_norm", embed_, {hidden_});
  TORCH_CHECK(intermediate > 0, "DecodeGraph.add_layer: intermediate must be positive");
  check_weight(gate_up, "gate_up", embed_, weight_shape(2 * intermediate, hidden_));
  check_weight(down, "down", embed_, weight_shape(hidden_, intermediate));
  sglite::check_cpu_f32(cos_sin, "cos_sin_cache");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == head_dim_, "cos_sin_cache must be [positions, head_dim]");
  for (const auto& [t, name] : {std::pair{&k_buf, "k_buf"}, {&v_buf, "v_buf"}}) {
    sglite::check_cpu_float(*t, name);
    sglite::check_same_dtype(*t, embed_, name);
  }
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.size(1) == num_kv_heads_ && k_buf.size(2) == head_dim_ &&
                  v_buf.sizes() == k_buf.sizes(),
              "k_buf and v_buf must be [slots, kv_heads, head_dim]");
  layers_.push_back(Layer{std::move(input_norm), std::move(qkv), std::move(qkv_bias), std::move(o),
                          std::move(post_norm), std::move(gate_up), std::move(down), std::move(cos_sin),
                          std::move(k_buf), std::move(v_buf), intermediate});
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
  // with profiling on, the time since the last lap goes to the category named: the
  // categories add up to the whole call
  auto last = std::chrono::steady_clock::now();
  auto lap = [&](Phase phase) {
    if (!profiling_) return;
    const auto now = std::chrono::steady_clock::now();
    profile_ms_[phase] += std::chrono::duration<double, std::milli>(now - last).count();
    last = now;
  };
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const torch::Tensor q_rows = torch::arange(n, input_ids.options());

  torch::Tensor hidden = at::embedding(embed_, input_ids);
  lap(kOther);
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
    lap(kPointwise);
    // attention: qkv projection, RoPE on q and k, K/V into the pool, paged decode attention
    const torch::Tensor qkv = linear(x, L.qkv, L.qkv_bias, q_size + 2 * kv_size);
    lap(kLinear);
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
    const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
    torch::Tensor q_rot = torch::empty({n, num_heads_, head_dim_}, hidden.options());
    torch::Tensor k_rot = torch::empty({n, num_kv_heads_, head_dim_}, hidden.options());
    rope_neox(positions, q, L.cos_sin, q_rot);
    rope_neox(positions, k, L.cos_sin, k_rot);
    lap(kPointwise);
    torch::Tensor k_buf = L.k_buf, v_buf = L.v_buf;  // handles to the pool's storage
    k_buf.index_put_({out_cache_loc}, k_rot);
    v_buf.index_put_({out_cache_loc}, v);
    torch::Tensor attn = torch::empty({n, num_heads_, head_dim_}, hidden.options());
    lap(kOther);
    decode_attention(q_rot, L.k_buf, L.v_buf, req_to_token, q_rows, req_pool_indices, seq_lens, attn, scaling_);
    lap(kAttention);
    hidden = linear(attn.view({n, q_size}), L.o, std::nullopt, hidden_);
    lap(kLinear);
    // MLP
    torch::Tensor sum = torch::empty_like(hidden);
    x = torch::empty_like(hidden);
    fused_add_rmsnorm(hidden, residual, L.post_norm, sum, x, eps_);
    residual = sum;
    lap(kPointwise);
    const torch::Tensor gate_up = linear(x, L.gate_up, std::nullopt, 2 * L.intermediate);
    lap(kLinear);
    torch::Tensor act = torch::empty({n, L.intermediate}, hidden.options());
    silu_and_mul(gate_up, act);
    lap(kPointwise);
    hidden = linear(act, L.down, std::nullopt, hidden_);
    lap(kLinear);
  }
  torch::Tensor sum = torch::empty_like(hidden), x = torch::empty_like(hidden);
  fused_add_rmsnorm(hidden, residual, final_norm_, sum, x, eps_);
  lap(kPointwise);
  torch::Tensor logits = packed_ ? weight_packed_linear(x, lm_head_, std::nullopt, vocab_, true)
                                 : at::matmul(x, lm_head_.t()).to(torch::kFloat32);
  lap(kLmHead);
  if (profiling_) profile_ms_[kRuns] += 1;
  return logits;
}

void DecodeGraph::set_profiling(bool on) {
  profiling_ = on;
  profile_ms_.fill(0.0);
}

std::map<std::string, double> DecodeGraph::profile() const {
  return {{"linear_ms", profile_ms_[kLinear]},   {"lm_head_ms", profile_ms_[kLmHead]},
          {"attention_ms", profile_ms_[kAttention]}, {"norm_rope_act_ms", profile_ms_[kPointwise]},
          {"other_ms", profile_ms_[kOther]},     {"runs", profile_ms_[kRuns]}};
}
