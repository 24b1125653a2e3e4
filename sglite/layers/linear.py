"""Linear layers (SGLang: layers/linear.py). One class today, ``ReplicatedLinear``: the
whole weight on this process (tensor parallelism, issue 26, adds the column and row
parallel ones beside it).

On a CPU in bfloat16 with sglite's C++ kernels, ``pack()`` (called once after the
weights load, as SGLang's ``process_weights_after_loading`` does) replaces the weight
by its packed form (``convert_weight_packed``: blocks of 16 output rows, K in pairs, the
layout AVX512-BF16's dot product reads) and ``forward`` runs ``weight_packed_linear``:
float32 sums, one pass over the weight for a batch of one. Everywhere else it is
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # packed: weight is [output_size rounded up to 16, input_size rounded up to 2]
        self.packed = False

    @classmethod
    def packed_from(cls, weight: torch.Tensor) -> "ReplicatedLinear":
        """A packed layer over a copy of ``weight`` [out, in] (a tied LM head's embedding)."""
        layer = cls(weight.shape[1], weight.shape[0])
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        layer.pack()
        return layer

    def pack(self) -> None:
        """Pack a bfloat16 CPU weight for ``weight_packed_linear`` (once; the C++ kernels
        must load)."""
        if self.packed:
            return
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.bfloat16:
            raise ValueError(f"packing needs a bfloat16 CPU weight, not {self.weight.dtype} on {self.weight.device}")
        from sglite.layers.cpu_ops import load_cpu_ops

        self.weight = nn.Parameter(load_cpu_ops().convert_weight_packed(self.weight.data), requires_grad=False)
        self.packed = True

    def forward(self, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
        """x @ W.T + b; ``out_float32`` returns the float32 sums (logits) instead of x's dtype."""
        if self.packed:
            from sglite.layers.cpu_ops import load_cpu_ops

            return load_cpu_ops().weight_packed_linear(x, self.weight, self.bias, self.output_size, out_float32)
        out = F.linear(x, self.weight, self.bias)
        return out.float() if out_float32 else out

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
                + (", packed bf16" if self.packed else ""))
