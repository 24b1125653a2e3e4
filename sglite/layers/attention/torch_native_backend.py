"""Attention in plain PyTorch over the paged KV pool (SGLang:
layers/attention/torch_native_backend.py).

Each request is handled on its own: its K/V are gathered through
``req_to_token[req_pool_idx, :seq_len]``, so one batch can mix requests with any
prefix and extend lengths. A new row at position p sees keys 0..p (its cached prefix
plus the new rows before it). Per-request computation also keeps the result of a
request independent of what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglite.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _ReqView:
    q_start: int
    q_len: int
    slots: torch.Tensor  # KV slots of positions 0..seq_len-1
    mask: torch.Tensor | None  # [q_len, seq_len] causal mask, None for a single row


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self) -> None:
        self._views: list[_ReqView] = []

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Slots and masks once per forward, shared by every layer."""
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        device = forward_batch.input_ids.device
        if forward_batch.forward_mode.is_decode():
            bs = forward_batch.batch_size
            q_starts, q_lens = list(range(bs)), [1] * bs
            prefixes = [s - 1 for s in forward_batch.seq_lens_cpu]
        else:
            q_lens = forward_batch.extend_seq_lens_cpu
            q_starts = forward_batch.extend_start_loc.tolist()
            prefixes = forward_batch.extend_prefix_lens_cpu
        views = []
        for i, (idx, seq_len) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens_cpu)):
            n, prefix = q_lens[i], prefixes[i]
            mask = None
            if n > 1:
                rows = torch.arange(n, device=device)[:, None] + prefix
                mask = torch.arange(seq_len, device=device)[None, :] <= rows
            views.append(_ReqView(q_starts[i], n, req_to_token[idx, :seq_len], mask))
        self._views = views

    def _attend(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        out = torch.empty_like(q)
        for view in self._views:
            start, n = view.q_start, view.q_len
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_buf[view.slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, seq, D]
            vi = v_buf[view.slots].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi.to(ki.dtype), ki, vi, attn_mask=view.mask, scale=layer.scaling,
                                                enable_gqa=gqa)
            out[start : start + n] = oi.squeeze(0).transpose(0, 1).to(q.dtype)
        return out

    def forward_extend(self, q, k, v, layer, forward_batch):  # noqa: ANN001
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return self._attend(q, layer, forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch):  # noqa: ANN001
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return self._attend(q, layer, forward_batch)
