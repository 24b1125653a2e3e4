// The Python module of sglite's CPU kernels (sglite/layers/cpu_ops/__init__.py).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // every call leaves the GIL while it runs, as torch's own ops do: other Python threads
  // (the scheduler, in the overlap loop) go on meanwhile. Argument errors are raised
  // after the GIL is back.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("decode_attention", &decode_attention, "paged decode attention over a float32 or bfloat16 KV pool", release());
  m.def("rmsnorm", &rmsnorm, "out = RMSNorm(x) * weight", release());
  m.def("fused_add_rmsnorm", &fused_add_rmsnorm, "sum = x + residual; out = RMSNorm(sum) * weight", release());
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]", release());
  m.def("rope_neox", &rope_neox, "out = neox rotary embedding of x at positions", release());
  m.def("cpu_has_avx512_bf16", &cpu_has_avx512_bf16, "whether the kernels were built with AVX512-BF16 dot products");
  m.def("convert_weight_packed", &convert_weight_packed, "a [N, K] weight in bf16 blocks of 16 rows, K in pairs",
        py::arg("weight"), release());
  m.def("weight_packed_linear", &weight_packed_linear, "x @ W.T + bias over a packed bf16 weight (float32 sums)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"), py::arg("out_f32") = false, release());
  py::class_<DecodeGraph>(m, "DecodeGraph", "a Llama-family model's decode forward as one call")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, double, bool>(),
           py::arg("embed"), py::arg("final_norm"), py::arg("lm_head"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rms_norm_eps"), py::arg("scaling"),
           py::arg("packed") = false)
      .def("add_layer", &DecodeGraph::add_layer, py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("post_norm"), py::arg("gate_up"), py::arg("down"), py::arg("cos_sin"),
           py::arg("k_buf"), py::arg("v_buf"), py::arg("intermediate"))
      .def("run", &DecodeGraph::run, "logits [bs, vocab] of one decode row per request", py::arg("input_ids"),
           py::arg("positions"), py::arg("out_cache_loc"), py::arg("req_to_token"), py::arg("req_pool_indices"),
           py::arg("seq_lens"), release())
      .def("set_profiling", &DecodeGraph::set_profiling, "time every run by category from now on (True), or stop",
           py::arg("on"))
      .def("profile", &DecodeGraph::profile, "ms per category since set_profiling(True), and the runs counted")
      .def_property_readonly("num_layers", &DecodeGraph::num_layers);
}
