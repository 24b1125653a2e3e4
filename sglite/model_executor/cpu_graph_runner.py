"""Decode forwards on a CPU as one C++ call (SGLang: model_executor/cpu_graph_runner.py,
``CPUGraphRunner``, which follows ``CudaGraphRunner``).

On a GPU a CUDA graph replays a decode forward's few hundred kernel launches with one
call; SGLang's CPU counterpart compiles the decode forward with torch.compile. sglite's
CPU "graph" is ``DecodeGraph`` in ``sglite/layers/cpu_ops/decode_graph.cpp``: the model's
decode forward written out once in C++ over the same ATen ops and the same C++ kernels
that the modules run with the cpu attention backend, holding the model's parameters and
the KV pool's buffers (shared, not copied). ``replay`` is one call for the whole forward.

Two things it buys on a CPU:

- no Python between the ops: a decode forward of the modules is about 100 torch calls
  on the tiny test model (1,500 on SmolLM2), most of them small enough that issuing
  them from Python costs more than running them;
- no GIL for the whole forward: the modules take the GIL back between every two ops,
  so in the overlap loop the scheduler's Python and the forward's Python take turns on
  it (benchmarks/results/overlap-2026-12-03.md); this call leaves it from start to end.

Same rule as the CUDA graph runner: DECODE batches only (an extend's rows vary per
request and go through SDPA). The cpu backend attends every decode row with its decode
kernel (it forms no shared-prefix groups), which is what the graph runs, so its logits
and the K/V it writes equal the modules' bit for bit (tested), and no per-forward
metadata is planned for it. ``--disable-cpu-graph`` turns it off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sglite.layers.cpu_ops import load_cpu_ops
from sglite.model_executor.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from sglite.model_executor.model_runner import ModelRunner

logger = logging.getLogger("sglite")


class CpuGraphRunner:
    def __init__(self, model_runner: "ModelRunner"):
        self.model_runner = model_runner
        model, config = model_runner.model, model_runner.model_config
        pool = model_runner.token_to_kv_pool
        first = model.model.layers[0].self_attn
        packed = model.packed_lm_head is not None  # every linear's weight is packed (the cpu backend)
        self.graph = load_cpu_ops().DecodeGraph(
            model.model.embed_tokens.weight, model.model.norm.weight,
            model.packed_lm_head.weight if packed else model.lm_head_weight,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            model.model.norm.variance_epsilon, first.attn.scaling, packed)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self.graph.add_layer(
                layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
                layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
                attn.rotary_emb.cos_sin_cache, pool.get_key_buffer(i), pool.get_value_buffer(i),
                config.intermediate_size)
        logger.info("CPU graph: decode forwards of %d layers run as one C++ call%s", self.graph.num_layers,
                    f" ({str(model.model.embed_tokens.weight.dtype).removeprefix('torch.')}, packed linears)"
                    if packed else "")

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and forward_batch.batch_size > 0

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] of a decode batch (``can_run`` must hold)."""
        fb = forward_batch
        return self.graph.run(fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_to_token_pool.req_to_token,
                              fb.req_pool_indices, fb.seq_lens)
