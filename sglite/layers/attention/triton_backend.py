"""Attention with Triton kernels over the paged KV pool (SGLang:
layers/attention/triton_backend.py, ``TritonAttnBackend``).

The same contract as TorchNativeAttnBackend: store the new rows' K/V at
``out_cache_loc``, then attend through ``req_to_token``. The difference is that one
kernel launch covers the whole batch instead of a Python loop over requests:
extend (and MIXED) batches go to ``extend_attention_fwd``, decode batches to the
split-KV ``decode_attention_fwd``. Decode reads only tensors (no ``.tolist()``), so a
decode forward can be captured in a CUDA graph (model_executor/cuda_graph_runner.py).

Batch-invariant (``split_tile`` > 0, from ``--enable-deterministic-inference``, the
default): decode cuts every row's KV into fixed ``split_tile``-position splits, and
extend and MIXED rows go through the same decode kernel, one query row per program
over its own causal prefix (row i of a request with prefix p attends to p + i + 1
positions). A query row then gets the same bits in a prefill, a chunk, a mixed round
or a decode step, whatever else is batched with it (docs/kernels.md, "Batch
invariance"). The tiled extend kernel is faster on long prompts but sums a row's
KV in one pass whose blocks are not the decode kernel's splits: it runs only under
``--disable-deterministic-inference``.

On CPU it runs under ``TRITON_INTERPRET=1`` only, which is how the tests run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglite.layers.attention.base_attn_backend import AttentionBackend
from sglite.layers.triton_utils import check_triton_usable

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch_info import ForwardBatch


@dataclass
class ForwardMetadata:
    max_len_extend: int = 0  # grid size of the extend kernel (its longest request)
    # decode kernel: splits per row, fixed per batch size (with a split tile: per model)
    num_kv_splits: int = 1
    # batch-invariant extend: each query row as a decode row (its request's pool row and
    # the positions it may see, its own included)
    row_req_pool_indices: torch.Tensor | None = None
    row_seq_lens: torch.Tensor | None = None


class TritonAttnBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(self, device: str | torch.device, num_kv_heads: int, split_tile: int = 0, context_len: int = 0):
        """``split_tile`` > 0: batch-invariant (see the module's docstring); the decode
        kernel then runs enough splits for ``context_len`` positions."""
        check_triton_usable(device)
        from sglite.layers.attention.triton_ops.decode_attention import num_kv_splits_for

        self.device = device
        self.num_kv_heads = num_kv_heads
        self.split_tile = split_tile
        self.context_len = context_len
        self._num_kv_splits_for = num_kv_splits_for
        self.forward_metadata = ForwardMetadata()

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        if forward_batch.forward_mode.is_decode():
            self._init_decode_metadata(forward_batch.batch_size)
        elif self.split_tile:
            self._init_row_metadata(forward_batch)
        else:
            lens = forward_batch.extend_seq_lens_cpu or [0]
            self.forward_metadata = ForwardMetadata(max_len_extend=max(lens))

    def _init_decode_metadata(self, batch_size: int) -> None:
        self.forward_metadata = ForwardMetadata(num_kv_splits=self._num_kv_splits_for(
            batch_size, self.num_kv_heads, self.device, self.split_tile, self.context_len))

    def _init_row_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Each extend row's pool row and visible length: prefix + its index + 1."""
        lens = forward_batch.extend_seq_lens
        rows = int(sum(forward_batch.extend_seq_lens_cpu or [0]))
        row_req = torch.repeat_interleave(forward_batch.req_pool_indices, lens, output_size=rows)
        first_row = torch.repeat_interleave(forward_batch.extend_start_loc, lens, output_size=rows)
        prefix = torch.repeat_interleave(forward_batch.extend_prefix_lens, lens, output_size=rows)
        index = torch.arange(rows, device=lens.device, dtype=first_row.dtype) - first_row
        self.forward_metadata = ForwardMetadata(
            num_kv_splits=self._num_kv_splits_for(rows, self.num_kv_heads, self.device, self.split_tile,
                                                  self.context_len),
            row_req_pool_indices=row_req, row_seq_lens=(prefix + index + 1).to(forward_batch.seq_lens.dtype))

    # CUDA graphs (SGLang's names). Decode metadata depends on the batch size alone: the
    # graph bakes it in at capture; replay only puts the Python-side copy back in step
    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        self._init_decode_metadata(forward_batch.batch_size)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        self._init_decode_metadata(forward_batch.batch_size)

    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch"):  # noqa: ANN001
        from sglite.layers.attention.triton_ops.extend_attention import extend_attention_fwd
        from sglite.layers.attention.triton_ops.kv_store import store_kv_cache

        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        store_kv_cache(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        if self.split_tile:  # every row a decode row: the rows' K/V are in the pool now
            meta = self.forward_metadata
            return self._decode_rows(q, k_buf, v_buf, o, forward_batch, meta.row_req_pool_indices, meta.row_seq_lens,
                                     layer.scaling)
        extend_attention_fwd(
            q, k, v, o, k_buf, v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens,
            forward_batch.extend_start_loc,
            self.forward_metadata.max_len_extend,
            layer.scaling,
        )
        return o

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch"):  # noqa: ANN001
        from sglite.layers.attention.triton_ops.kv_store import store_kv_cache

        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        store_kv_cache(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        return self._decode_rows(q, k_buf, v_buf, o, forward_batch, forward_batch.req_pool_indices,
                                 forward_batch.seq_lens, layer.scaling)

    def _decode_rows(self, q, k_buf, v_buf, o, forward_batch: "ForwardBatch", req_pool_indices: torch.Tensor,  # noqa: ANN001
                     seq_lens: torch.Tensor, scaling: float) -> torch.Tensor:
        from sglite.layers.attention.triton_ops.decode_attention import decode_attention_fwd

        decode_attention_fwd(q, k_buf, v_buf, o, forward_batch.req_to_token_pool.req_to_token, req_pool_indices,
                             seq_lens, self.forward_metadata.num_kv_splits, scaling, split_tile=self.split_tile)
        return o
