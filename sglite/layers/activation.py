"""SiluAndMul: the SwiGLU gate on a fused gate_up projection (SGLang: layers/activation.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglite.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from sglite.layers.fused_kernels import silu_and_mul

        return silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        from sglite.layers.cpu_ops import load_cpu_ops

        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
        load_cpu_ops().silu_and_mul(x.contiguous(), out)
        return out
