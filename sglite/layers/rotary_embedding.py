"""Rotary position embedding, neox (rotate-half) layout, with llama3 frequency scaling
(SGLang: layers/rotary_embedding.py). Positions come from ForwardBatch.positions."""

from __future__ import annotations

import math
from typing import Any

import torch

from sglite.layers.custom_op import CustomOp


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out)


class RotaryEmbedding(CustomOp):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.rope_scaling = rope_scaling
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        dim, scaling = self.head_dim, self.rope_scaling
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]  # type: ignore[index]
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float64), inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_triton(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from sglite.layers.fused_kernels import rotary_embedding_neox

        return rotary_embedding_neox(positions, q, k, self.cos_sin_cache)

    def forward_cpu(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from sglite.layers.cpu_ops import load_cpu_ops

        ops, positions = load_cpu_ops(), positions.contiguous()
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        ops.rope_neox(positions, q, self.cos_sin_cache, q_out)
        ops.rope_neox(positions, k, self.cos_sin_cache, k_out)
        return q_out, k_out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def get_rope(
    head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling)
