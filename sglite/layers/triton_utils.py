"""When the Triton kernels can run, and the one error that says why not.

Triton 3.x decides interpreter mode when ``@triton.jit`` decorates a function, that is
when a kernel module is first imported; so on a CPU ``TRITON_INTERPRET=1`` must be in
the environment before sglite imports its kernels (they are imported lazily, the first
time a Triton path is chosen)."""

from __future__ import annotations

import os

import torch

TRITON_ON_CPU_HELP = "set TRITON_INTERPRET=1 (Triton's CPU interpreter, slow, for tests) or use --attention-backend torch_native"


def triton_interpret_enabled() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 has no knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_triton_usable(device: str | torch.device) -> None:
    """Raise a one-line ValueError unless sglite's Triton kernels can run on ``device``."""
    if str(device).startswith("cuda"):
        return
    if not triton_interpret_enabled():
        raise ValueError(f"the Triton kernels need a CUDA device; on CPU {TRITON_ON_CPU_HELP}")
    from triton.runtime.interpreter import InterpretedFunction

    from sglite.layers.attention.triton_ops.decode_attention import _decode_grouped_stage1

    if not isinstance(_decode_grouped_stage1, InterpretedFunction):
        raise ValueError("sglite's Triton kernels were imported before TRITON_INTERPRET=1 was set; "
                         "set it in the environment before starting Python")
