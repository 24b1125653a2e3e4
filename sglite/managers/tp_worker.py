"""The model worker of the normal loop (SGLang: managers/tp_worker.py, ``TpModelWorker``).

It owns the ModelRunner (the model, the KV pools, the attention backend) and turns a
``ModelWorkerBatch`` into sampled token ids. The overlap loop wraps it in a
``TpModelWorkerClient`` (tp_worker_overlap_thread.py) with the same interface, so the
scheduler calls ``forward_batch_generation`` then ``resolve_last_batch_result`` in
both loops and never asks which worker it has.

With ``--tp-size N`` the scheduler's worker is rank 0's; ranks 1..N-1 are processes of
their own (``launch_tp_followers``, ``run_tp_follower_process``: sglite::tp_worker_TP<r>)
that hold a ModelRunner with their shard and run every forward rank 0 sends them
(ModelRunner.follow). Unlike SGLang, whose every rank runs a Scheduler that receives
the broadcast requests and makes the same decisions, sglite's other ranks receive the
decided batch: one scheduler, so no decision can differ between ranks
(docs/tensor_parallel.md says why).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglite.layers.logits_processor import PositionLogprobs, add_position_logprobs
from sglite.model_executor.forward_batch_info import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner
from sglite.sampling.sampling_batch_info import GrammarStep
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
    # tp > 1: per rank, [its forward's seconds, of which in all-reduce / all-gather]
    tp_timings: list[list[float]] = field(default_factory=list)
    # per request of the batch, when one asked for logprobs: its prompt positions'
    # (extend rounds; None: none this round) and its sampled token's
    input_logprobs: list[PositionLogprobs] | None = None
    output_logprobs: list[PositionLogprobs] | None = None
    # per request of the batch, when one has a grammar: what its mask did (None: no mask)
    grammar_stats: list[GrammarStep | None] | None = None

    @property
    def forward_time(self) -> float:
        return self.forward_finished - self.forward_started


def run_forward(model_runner: ModelRunner, forward_batch: ForwardBatch, result: GenerationBatchResult) -> torch.Tensor:
    """Forward and sample one batch, stamping the result's times; the sampled ids."""
    result.forward_started = time.monotonic()
    logits = model_runner.forward(forward_batch)
    next_token_ids, logprobs = model_runner.sample(logits, forward_batch)
    result.next_token_ids = next_token_ids.tolist()
    if logprobs is not None:
        meta = forward_batch.logprob
        assert meta is not None
        result.output_logprobs = [PositionLogprobs(top=[] if k else None, token_ids=[] if ids else None)
                                  for k, ids in zip(meta.top_logprobs_nums, meta.token_ids_logprobs)]
        add_position_logprobs(result.output_logprobs, list(range(len(result.next_token_ids))), logprobs,
                              result.next_token_ids, meta)
        result.input_logprobs = forward_batch.input_logprobs
    result.grammar_stats = forward_batch.sampling_info.grammar_stats if forward_batch.sampling_info else None
    result.forward_finished = time.monotonic()
    result.tp_timings = model_runner.last_tp_timings
    return next_token_ids


class TpModelWorker:
    """Rank 0's model worker: the whole model at tp 1, its shard at tp N (the other
    ranks follow in their own processes)."""

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
        """Nothing runs in the background of the normal worker; with tp > 1 the other
        ranks are told to stop."""
        self.model_runner.shutdown()


# --- the other tensor-parallel ranks ---------------------------------------------------

PARENT_POLL = 1.0  # seconds between a follower's checks that the process that started it is alive


def node_tp_ranks(server_args: ServerArgs) -> range:
    """The tp ranks this machine runs (--nnodes, --node-rank)."""
    per_node = server_args.tp_size // server_args.nnodes
    return range(server_args.node_rank * per_node, (server_args.node_rank + 1) * per_node)


def set_dist_init_addr(server_args: ServerArgs) -> None:
    """One machine and no --dist-init-addr: a free loopback port for rank 0 to listen on."""
    if server_args.tp_size > 1 and server_args.dist_init_addr is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            server_args.dist_init_addr = f"127.0.0.1:{s.getsockname()[1]}"


def check_tp_split(server_args: ServerArgs) -> None:
    """ValueError if the model's heads cannot be cut --tp-size ways (ModelLoadError if
    the model cannot be found or read): once, from the config alone, before any rank
    starts; else every rank would load the model and say the same."""
    if server_args.tp_size == 1:
        return
    from sglite.distributed.utils import head_shard
    from sglite.model_loader import load_model_config

    config = load_model_config(server_args.model_path)
    head_shard(config.num_attention_heads, config.num_key_value_heads, server_args.tp_size, 0)


def launch_tp_followers(server_args: ServerArgs) -> list[Any]:
    """Start this machine's tp ranks other than rank 0, as processes that stop when
    their parent does (after check_tp_split). Call set_dist_init_addr first."""
    check_tp_split(server_args)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in node_tp_ranks(server_args):
        if rank == 0:
            continue
        p = ctx.Process(target=run_tp_follower_process, args=(server_args, rank), name=f"sglite::tp_worker_TP{rank}",
                        daemon=True)
        p.start()
        procs.append(p)
    return procs


def describe_dead_followers(procs: list[Any]) -> str:
    """'tp rank 1 (pid 123) exited with code -9' for each that stopped; '' if none did."""
    dead = [p for p in procs if not p.is_alive()]
    return "; ".join(f"tp rank {p.name.rsplit('TP', 1)[1]} (pid {p.pid}) exited with code {p.exitcode}" for p in dead)


def stop_tp_followers(procs: list[Any], timeout: float = 10.0) -> None:
    """Wait for followers told to stop (rank 0's shutdown); kill those that do not."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_tp_follower_process(server_args: ServerArgs, tp_rank: int) -> None:
    """Rank ``tp_rank``: load its shard, then run rank 0's forwards until told to stop.
    Exits 1 with a one-line error if rank 0 goes away or the load fails."""
    import setproctitle

    from sglite.distributed.parallel_state import TpRankDiedError
    from sglite.engine import setup_logging

    setproctitle.setproctitle(f"sglite::tp_worker_TP{tp_rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 stops this rank, or it exits with its parent
    setup_logging(server_args.log_level)
    exit_with_parent(os.getppid())
    try:
        runner = ModelRunner(server_args, tp_rank=tp_rank)
        runner.follow()
        runner.shutdown()
    except TpRankDiedError as e:
        print(f"sglite tp rank {tp_rank}: rank 0 went away, stopping ({e})", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - rank 0 reports the engine's failure; this is the rank's
        print(f"error: sglite tp rank {tp_rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    # stopped as asked: leave now. The interpreter's own exit runs the C++ destructors of
    # torch.distributed's gloo threads, which sometimes abort ("terminate called without
    # an active exception": exit code -6 about one stop in five here)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_with_parent(parent: int) -> None:
    """A follower blocked in a collective cannot look at its parent: a thread does, and
    ends the process when the parent is gone (nothing is left behind a killed engine)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="sglite-parent-watch").start()
