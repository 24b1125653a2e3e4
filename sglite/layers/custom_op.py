"""CustomOp: a layer with a torch implementation and a Triton one, and the one place
that chooses between them (SGLang: layers/custom_op.py, where the kernel path is
``forward_cuda``; sglite's kernels are Triton, so it is ``forward_triton``).

``forward_native`` is plain PyTorch: the reference, and the path on CPU.
``forward_triton`` runs the fused Triton kernels: on CUDA, or on CPU under
``TRITON_INTERPRET=1`` in tests. ModelRunner turns it on for the whole model with
``enable_triton_ops`` when the attention backend is ``triton``."""

from __future__ import annotations

from typing import Any

from torch import nn


class CustomOp(nn.Module):
    use_triton: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.use_triton:
            return self.forward_triton(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_triton(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def enable_triton_ops(model: nn.Module, enabled: bool = True) -> None:
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.use_triton = enabled
