"""Attention on a CPU with one C++ kernel for decode rows (SGLang's CPU counterpart is
``intel_amx_backend.py`` over sgl-kernel's ``decode_attention_cpu``).

The torch_native backend, except for one-row requests (decode rows; the running
requests of a MIXED batch): instead of gathering each one's whole K/V history into a
padded tensor and running SDPA over the copy, the kernel in
``sglite/layers/cpu_ops/decode_attention.cpp`` reads K and V once, straight from the pool
through ``req_to_token``. Prefill rows stay on SDPA (their work is matmul-shaped).

Requests that share a cached prefix go through the kernel too: torch_native's
attend-the-prefix-once groups exist to spare it gathering the prefix per request, and
the kernel gathers nothing; it reads the shared slots per request from the cache and
measured 1.6-4x faster per layer than the grouped path (``python
benchmarks/cpu_attention.py --shared-prefix 300``). So every decode forward on this
backend attends with the kernel alone, which lets ``model_executor/cpu_graph_runner.py``
run all of them.

float32 or bfloat16 pools (the kernel computes in float32 either way);
``resolve_attention_backend`` picks this backend for ``--attention-backend auto`` on a
CPU when the kernel builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglite.layers.cpu_ops import load_cpu_ops
from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention


class CpuAttnBackend(TorchNativeAttnBackend):
    name = "cpu"
    attend_shared_prefixes_once = False

    def __init__(self) -> None:
        super().__init__()
        self._ops = load_cpu_ops()
        self._req_to_token = torch.empty(0, 0, dtype=torch.int64)
        self._rows = self._pool_indices = self._seq_lens = torch.empty(0, dtype=torch.int64)

    def _plan_one_row(self, req_to_token: torch.Tensor, q_rows: list[int], pool_indices: list[int],
                      seq_lens: list[int], device: torch.device) -> None:
        self._chunks = []
        self._req_to_token = req_to_token

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._rows, self._pool_indices, self._seq_lens = tensor(q_rows), tensor(pool_indices), tensor(seq_lens)

    def _attend_one_row(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: "RadixAttention",
                        out: torch.Tensor) -> None:
        if self._rows.numel():
            self._ops.decode_attention(q.contiguous(), k_buf, v_buf, self._req_to_token, self._rows,
                                       self._pool_indices, self._seq_lens, out, layer.scaling)
