"""Attention in plain PyTorch over the paged KV pool (SGLang:
layers/attention/torch_native_backend.py).

Each request is handled on its own: its K/V are gathered through
``req_to_token[req_pool_idx, :seq_len]``, so one batch can mix requests with any
prefix and extend lengths. A new row at position p sees keys 0..p (its cached prefix
plus the new rows before it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglite.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch_info import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def _attend(
        self,
        q: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        q_starts: list[int],
        q_lens: list[int],
        prefix_lens: list[int],
    ) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        out = torch.empty_like(q)
        req_pool_indices = forward_batch.req_pool_indices.tolist()
        for i, seq_len in enumerate(forward_batch.seq_lens_cpu):
            start, n, prefix = q_starts[i], q_lens[i], prefix_lens[i]
            slots = req_to_token[req_pool_indices[i], :seq_len]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_buf[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, seq, D]
            vi = v_buf[slots].transpose(0, 1).unsqueeze(0)
            mask = None
            if n > 1:
                # row r is position prefix + r; it may see keys at positions <= that
                rows = torch.arange(n, device=q.device)[:, None] + prefix
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            oi = F.scaled_dot_product_attention(
                qi.to(ki.dtype), ki, vi, attn_mask=mask, scale=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
            out[start : start + n] = oi.squeeze(0).transpose(0, 1).to(q.dtype)
        return out

    def forward_extend(self, q, k, v, layer, forward_batch):  # noqa: ANN001
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        starts = forward_batch.extend_start_loc.tolist()
        return self._attend(
            q, layer, forward_batch, starts, forward_batch.extend_seq_lens_cpu,
            forward_batch.extend_prefix_lens_cpu,
        )

    def forward_decode(self, q, k, v, layer, forward_batch):  # noqa: ANN001
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        bs = forward_batch.batch_size
        return self._attend(
            q, layer, forward_batch, list(range(bs)), [1] * bs,
            [s - 1 for s in forward_batch.seq_lens_cpu],
        )
