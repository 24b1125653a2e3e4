"""RadixAttention: the model's attention layer; the backend does the work
(SGLang: layers/radix_attention.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        """q, k, v: [tokens, heads * head_dim] -> [tokens, heads * head_dim]."""
        n = q.shape[0]
        q = q.view(n, self.tp_q_head_num, self.head_dim)
        k = k.view(n, self.tp_k_head_num, self.head_dim)
        v = v.view(n, self.tp_v_head_num, self.head_dim)
        out = forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
        return out.reshape(n, self.tp_q_head_num * self.head_dim)
