"""The model worker of the normal loop (SGLang: managers/tp_worker.py, ``TpModelWorker``).

It owns the ModelRunner (the model, the KV pools, the attention backend) and turns a
``ModelWorkerBatch`` into sampled token ids. The overlap loop wraps it in a
``TpModelWorkerClient`` (tp_worker_overlap_thread.py) with the same interface, so the
scheduler calls ``forward_batch_generation`` then ``resolve_last_batch_result`` in
both loops and never asks which worker it has.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglite.model_executor.forward_batch_info import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner
from sglite.server_args import ServerArgs

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import ModelWorkerBatch
    from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


@dataclass
class GenerationBatchResult:
    """What ``forward_batch_generation`` returns. The normal worker fills
    ``next_token_ids`` at once; the overlap worker's thread fills it later and sets
    ``done``, and ``future_token_ids`` holds the placeholders meanwhile."""

    bid: int = 0  # the batch id (Scheduler.forward_ct at launch)
    iteration: int = 0  # the scheduler iteration that launched it
    next_token_ids: list[int] | None = None
    forward_started: float = 0.0  # time.monotonic() when the forward began
    forward_finished: float = 0.0
    resolved: float = 0.0  # when the scheduler had the tokens (overlap: it may have waited)
    future_token_ids: list[int] = field(default_factory=list)  # overlap: the placeholders
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    @property
    def forward_time(self) -> float:
        return self.forward_finished - self.forward_started


def run_forward(model_runner: ModelRunner, forward_batch: ForwardBatch, result: GenerationBatchResult) -> torch.Tensor:
    """Forward and sample one batch, stamping the result's times; the sampled ids."""
    result.forward_started = time.monotonic()
    logits = model_runner.forward(forward_batch)
    next_token_ids = model_runner.sample(logits, forward_batch)
    result.next_token_ids = next_token_ids.tolist()
    result.forward_finished = time.monotonic()
    return next_token_ids


class TpModelWorker:
    """One model replica (sglite runs tensor-parallel size 1)."""

    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None):
        self.server_args = server_args
        self.model_runner = model_runner or ModelRunner(server_args)
        self.tokenizer = self.model_runner.tokenizer
        self.model_config = self.model_runner.model_config
        self.device = self.model_runner.device
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.max_running_requests = self.model_runner.max_running_requests
        # a request (prompt + output) must fit the context and the whole pool; SGLang
        # keeps 5 tokens of the context for the output (max_req_input_len)
        self.max_req_len = min(self.model_runner.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5

    def get_memory_pool(self) -> tuple["ReqToTokenPool", "TokenToKVPoolAllocator"]:
        return self.model_runner.req_to_token_pool, self.model_runner.token_to_kv_pool_allocator

    def forward_batch_generation(self, model_worker_batch: "ModelWorkerBatch") -> GenerationBatchResult:
        """Run the forward and sample, now."""
        result = GenerationBatchResult(bid=model_worker_batch.bid, iteration=model_worker_batch.iteration)
        forward_batch = ForwardBatch.init_new(model_worker_batch, self.model_runner)
        run_forward(self.model_runner, forward_batch, result)
        result.done.set()
        return result

    def resolve_last_batch_result(self, result: GenerationBatchResult) -> list[int]:
        """The batch's sampled token ids (the normal worker has them already)."""
        result.resolved = time.monotonic()
        assert result.next_token_ids is not None
        return result.next_token_ids

    def shutdown(self) -> None:
        """Nothing runs in the background of the normal worker."""
