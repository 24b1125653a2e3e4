"""Attention on a CPU with one C++ kernel for decode rows (SGLang's CPU counterpart is
``intel_amx_backend.py`` over sgl-kernel's ``decode_attention_cpu``).

The torch_native backend, except for one-row requests outside a shared-prefix group
(decode rows; the running requests of a MIXED batch): instead of gathering each one's
whole K/V history into a padded tensor and running SDPA over the copy, the kernel in
``sglite/layers/cpu_ops/decode_attention.cpp`` reads K and V once, straight from the pool through
``req_to_token``. Prefill rows stay on SDPA (their work is matmul-shaped), and groups of
requests sharing a cached prefix keep torch_native's attend-the-prefix-once path.

float32 pools only (what a CPU engine runs by default); ``resolve_attention_backend``
picks this backend for ``--attention-backend auto`` on a CPU when the kernel builds.
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
