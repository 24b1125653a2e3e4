"""CustomOp: a layer with a plain PyTorch implementation and kernel ones, and the one
place that chooses between them (SGLang: layers/custom_op.py, which dispatches to
``forward_cuda`` / ``forward_cpu`` / ...; sglite's GPU kernels are Triton, so its GPU
path is ``forward_triton``).

``forward_native`` is plain PyTorch: the reference, and the fallback everywhere.
``forward_triton`` runs the fused Triton kernels: on CUDA, or on CPU under
``TRITON_INTERPRET=1`` in tests. ``forward_cpu`` runs sglite's C++ CPU kernels
(``sglite/layers/cpu_ops``), float32. ModelRunner picks one for the whole model with
``set_custom_op_impl``, after its attention backend: triton -> triton, cpu -> cpu,
torch_native -> native."""

from __future__ import annotations

from typing import Any

from torch import nn

IMPLS = ("native", "triton", "cpu")


class CustomOp(nn.Module):
    impl: str = "native"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.impl == "triton":
            return self.forward_triton(*args, **kwargs)
        if self.impl == "cpu":
            return self.forward_cpu(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_triton(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def set_custom_op_impl(model: nn.Module, impl: str) -> None:
    """Every CustomOp of ``model`` runs ``forward_<impl>`` from now on."""
    if impl not in IMPLS:
        raise ValueError(f"unknown custom op implementation {impl!r}; one of {', '.join(IMPLS)}")
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.impl = impl
