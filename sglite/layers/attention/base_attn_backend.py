"""The attention backend interface (SGLang: layers/attention/base_attn_backend.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend:
    name = "base"
    # True when a decode forward reads only tensors (no Python-side per-request state),
    # so model_executor/cuda_graph_runner.py can capture it
    supports_cuda_graph = False

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Per-forward precomputation shared by all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch) -> torch.Tensor:  # noqa: ANN001
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, forward_batch) -> torch.Tensor:  # noqa: ANN001
        raise NotImplementedError
