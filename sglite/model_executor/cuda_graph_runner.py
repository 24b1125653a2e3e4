"""Decode forwards replayed from CUDA graphs (SGLang:
model_executor/cuda_graph_runner.py, ``CudaGraphRunner``).

A decode step of a small batch is a few hundred short kernel launches whose CPU cost
exceeds their GPU time. A CUDA graph records the launches of one forward once and
replays them with a single call. A graph is fixed: the same kernels, shapes and
pointers every time. So:

- graphs are captured for a list of batch sizes (1, 2, 4, 8, then every 8 up to
  ``cuda_graph_max_bs``); a batch runs in the graph of the nearest size at or above
  it, its extra rows padded;
- inputs live in static buffers; ``replay`` copies a batch into them first. A padded
  row is a 1-token request in req slot 0 that writes its K/V into slot 0 (the padding
  slot the allocator never hands out) and whose logits are dropped;
- only DECODE is captured: extend batches vary in row count and in the Python-side
  ``max_len_extend``. Only backends that read nothing but tensors in a decode forward
  can be captured (``supports_cuda_graph``: the triton backend; torch_native loops
  over requests in Python).

Untested on a GPU in the session that wrote it (no GPU was available). The CPU tests
run everything but the capture itself: the batch sizes, the static buffers, padding
and replay, with an eager stand-in for the graph; benchmarks/gpu.py runs real graphs.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sglite.model_executor.model_runner import ModelRunner

logger = logging.getLogger("sglite")

DEFAULT_CUDA_GRAPH_MAX_BS = 128


def get_batch_sizes_to_capture(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_bs, always ending at max_bs."""
    sizes = [s for s in [1, 2, 4, 8, *range(16, max_bs + 1, 8)] if s <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(capture_bs: list[int], bs: int) -> int:
    """The smallest captured size that holds ``bs`` rows (``bs`` <= capture_bs[-1])."""
    return capture_bs[bisect.bisect_left(capture_bs, bs)]


class CudaGraphRunner:
    def __init__(self, model_runner: "ModelRunner"):
        self.model_runner = model_runner
        sa = model_runner.server_args
        max_bs = min(sa.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, model_runner.max_running_requests)
        self.capture_bs = get_batch_sizes_to_capture(max_bs)
        self.max_bs = self.capture_bs[-1]
        device = model_runner.device

        # static inputs; the fill values are what a padding row reads
        def buf(fill: int) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=device)

        self.input_ids = buf(0)
        self.req_pool_indices = buf(0)
        self.seq_lens = buf(1)
        self.out_cache_loc = buf(0)
        self.positions = buf(0)

        self.graphs: dict[int, Any] = {}  # torch.cuda.CUDAGraph
        self.output_buffers: dict[int, torch.Tensor] = {}
        self.forward_batches: dict[int, ForwardBatch] = {}
        self.graph_memory_pool = None
        self.capture()

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and 0 < forward_batch.batch_size <= self.max_bs

    def _static_forward_batch(self, bs: int) -> ForwardBatch:
        mr = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_sum=bs,
            positions=self.positions[:bs],
            seq_lens_cpu=[1] * bs,  # read by nothing a captured backend runs
            req_to_token_pool=mr.req_to_token_pool,
            token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=mr.attn_backend,
        )

    def capture(self) -> None:
        # largest first, all sharing one memory pool: the smaller graphs reuse its blocks
        for bs in reversed(self.capture_bs):
            self.capture_one_batch_size(bs)
        logger.info("CUDA graphs captured for decode batch sizes %s", self.capture_bs)

    def capture_one_batch_size(self, bs: int) -> None:
        mr = self.model_runner
        fb = self._static_forward_batch(bs)
        mr.attn_backend.init_forward_metadata_capture_cuda_graph(fb)

        def run_once() -> torch.Tensor:
            return mr.model(fb.input_ids, fb.positions, fb)

        self.graphs[bs], self.output_buffers[bs] = self._capture_graph(run_once)
        self.forward_batches[bs] = fb

    def _capture_graph(self, run_once: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """(graph, its output buffer). The CPU tests swap this for an eager stand-in."""
        # warm up on a side stream: Triton compiles and cuBLAS picks its kernels here,
        # not during capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run_once()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_memory_pool):
            out = run_once()
        self.graph_memory_pool = graph.pool()
        return graph, out

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] of a decode batch (``can_run`` must hold)."""
        raw_bs = forward_batch.batch_size
        bs = padded_batch_size(self.capture_bs, raw_bs)
        if bs != raw_bs:
            # rows left over from a larger batch become padding rows again
            self.req_pool_indices[raw_bs:bs].zero_()
            self.seq_lens[raw_bs:bs].fill_(1)
            self.out_cache_loc[raw_bs:bs].zero_()
            self.positions[raw_bs:bs].zero_()
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(self.forward_batches[bs])
        self.graphs[bs].replay()
        # a copy: the buffer is overwritten by the next replay
        return self.output_buffers[bs][:raw_bs].clone()
