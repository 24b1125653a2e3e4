"""Attention on a CPU with one C++ kernel for every query row (SGLang's CPU counterpart
is ``intel_amx_backend.py`` over sgl-kernel's ``decode_attention_cpu`` and
``extend_attention_cpu``).

Every row of a forward, decode or prefill, goes to ``decode_attention`` in
``sglite/layers/cpu_ops/decode_attention.cpp`` with its request's KV slots and its own
position + 1 as its length: K and V are read once, straight from the pool through
``req_to_token`` (this backend stores a forward's new K/V before attending), nothing is
copied or padded, and requests sharing a cached prefix read its slots from the cache.
The kernel attends each row over fixed position ranges merged in one order, so a row's
result is the same bits whether it is a decode row alone or in a batch of 64, a row of a
whole prefill or of one chunk of it (batch invariance, docs/kernels.md): a request's
tokens do not depend on what it was batched with, how its prompt was chunked, whether
its prefix came from the cache or was computed, or whether it was retracted and
recomputed. The torch_native backend (SDPA over gathered K/V) gives no such promise.

float32 or bfloat16 pools (the kernel computes in float32 either way);
``resolve_attention_backend`` picks this backend for ``--attention-backend auto`` on a
CPU when the kernel builds, and ``model_executor/cpu_graph_runner.py`` runs the same
kernel inside its decode graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglite.layers.cpu_ops import load_cpu_ops
from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch_info import ForwardBatch


class CpuAttnBackend(TorchNativeAttnBackend):
    name = "cpu"
    attend_shared_prefixes_once = False

    def __init__(self) -> None:
        super().__init__()
        self._ops = load_cpu_ops()
        self._req_to_token = torch.empty(0, 0, dtype=torch.int64)
        self._rows = self._pool_indices = self._seq_lens = torch.empty(0, dtype=torch.int64)

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Each query row's request (its req_to_token row) and length (position + 1),
        once per forward for every layer."""
        self._req_to_token = forward_batch.req_to_token_pool.req_to_token
        pool_indices = forward_batch.req_pool_indices.to(torch.int64)
        if forward_batch.forward_mode.is_decode():
            self._pool_indices = pool_indices
            self._seq_lens = torch.as_tensor(forward_batch.seq_lens_cpu, dtype=torch.int64)
        else:
            q_lens = torch.as_tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
            prefixes = torch.as_tensor(forward_batch.extend_prefix_lens_cpu, dtype=torch.int64)
            starts = torch.cumsum(q_lens, 0) - q_lens
            within = torch.arange(int(q_lens.sum())) - starts.repeat_interleave(q_lens)
            self._pool_indices = pool_indices.repeat_interleave(q_lens)
            self._seq_lens = prefixes.repeat_interleave(q_lens) + within + 1
        self._rows = torch.arange(len(self._seq_lens), dtype=torch.int64)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                forward_batch: "ForwardBatch") -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        dtype = q.dtype
        q = q.to(k_buf.dtype).contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._ops.decode_attention(q, k_buf, v_buf, self._req_to_token, self._rows, self._pool_indices,
                                   self._seq_lens, out, layer.scaling)
        return out.to(dtype)
