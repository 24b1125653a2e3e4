"""RMSNorm with an optional fused residual add (SGLang: layers/layernorm.py)."""

from __future__ import annotations

import torch
from torch import nn

from sglite.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # With a residual, return (norm(x + residual), x + residual): the decoder layer
        # carries the un-normed sum forward, saving one add per layer.
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * h.to(orig_dtype)
        return out if residual is None else (out, residual)

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from sglite.layers.fused_kernels import rmsnorm

        return rmsnorm(x, self.weight, self.variance_epsilon, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from sglite.layers.cpu_ops import load_cpu_ops

        x = x.contiguous()
        out = torch.empty_like(x)
        if residual is None:
            load_cpu_ops().rmsnorm(x, self.weight, out, self.variance_epsilon)
            return out
        summed = torch.empty_like(x)
        load_cpu_ops().fused_add_rmsnorm(x, residual.contiguous(), self.weight, summed, out, self.variance_epsilon)
        return out, summed
