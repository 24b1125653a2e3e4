"""What the TUI shows, as plain data: taken from the scheduler after each iteration, so
the screen never reads engine state while the engine is changing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class View:
    iteration: int = 0
    forward_mode: str = "IDLE"
    waiting: list[tuple] = field(default_factory=list)  # rid, prompt tokens, cached prefix, rounds waited
    running: list[tuple] = field(default_factory=list)  # rid, seq_len, "out/max"
    plan: list[tuple] = field(default_factory=list)  # rid, prefix_len, extend_len, seq_len, loc range
    plan_rows: int = 0
    pool_total: int = 0
    pool_free: int = 0
    pool_evictable: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    new_token_ratio: float = 0.0
    retractions: int = 0
    admission_stop: str = ""
    tree: list[dict[str, Any]] = field(default_factory=list)
    policy: str = ""
    throughput: float = 0.0
    finished: int = 0
    log: list[str] = field(default_factory=list)  # the last 200 lines
    log_total: int = 0  # lines ever logged, so the screen can append only new ones


def _loc_range(locs: list[int]) -> str:
    if not locs:
        return "-"
    return f"{min(locs)}..{max(locs)}" if len(locs) > 1 else str(locs[0])


def take(engine: Any, log_lines: list[str], throughput: float = 0.0, finished: int = 0,
         queued_at: dict[str, int] | None = None) -> View:
    """``queued_at``: the iteration each request (re-)entered the waiting queue."""
    s = engine.scheduler
    queued_at = queued_at or {}
    batch = s.cur_batch
    plan, rows = [], 0
    if batch is not None:
        locs = batch.out_cache_loc.tolist()
        off = 0
        for r, pre, ext, seq in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.seq_lens):
            plan.append((r.rid, pre, ext, seq, _loc_range(locs[off:off + ext])))
            off += ext
        rows = len(batch.input_ids)
    running = [(r.rid, r.seqlen, f"{len(r.output_ids)}/{r.sampling_params.max_new_tokens}")
               for r in s.running_reqs()]
    return View(
        iteration=s.iteration,
        forward_mode=batch.forward_mode.name if batch is not None else "IDLE",
        waiting=[(r.rid, len(r.origin_input_ids), len(r.prefix_indices), s.iteration - queued_at.get(r.rid, s.iteration))
                 for r in s.waiting_queue],
        running=running,
        plan=plan,
        plan_rows=rows,
        pool_total=s.max_total_num_tokens,
        pool_free=s.token_to_kv_pool_allocator.available_size(),
        pool_evictable=s.tree_cache.evictable_size(),
        token_usage=s.token_usage(),
        cache_hit_rate=s.cache_hit_rate(),
        new_token_ratio=s.new_token_ratio,
        retractions=s.num_retracted_reqs,
        admission_stop=s.last_admission_stop,
        tree=s.tree_cache.snapshot(),
        policy=s.server_args.schedule_policy,
        throughput=throughput,
        finished=finished,
        log=list(log_lines[-200:]),
        log_total=len(log_lines),
    )
