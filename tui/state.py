"""What the TUI shows, built from the engine's events alone.

``ViewBuilder`` folds the event stream into one ``View`` per scheduler iteration. The
live screen and ``--replay`` feed it the same events (live from the engine process, or
from a recording), so the panels at iteration k are the same either way. The scheduler's
state comes from ``SchedulerSnapshot`` (emitted for subscribers that ask for it); the
rest (plan, log, counters, request timelines) from the ordinary events.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sglite import events as ev

HISTORY = 120  # points kept for the hit-rate and throughput sparklines
LOG_KEEP = 200
# why admission stopped (AdmissionStopped.reason) in plain words
ADMISSION_WORDS = {"EMPTY_QUEUE": "queue empty", "NO_TOKEN": "KV pool full", "OTHER": "prefill budget spent",
                   "MAX_RUNNING_REQUESTS": "max running reqs", "IN_BATCH_PREFIX_WAIT": "waits on a shared prefix",
                   "FAILED_ROUND_TRIAL": "a failed round's requests re-run one at a time",
                   # (sglite's, not an AddReqResult) the queue was empty at admission, then the
                   # round's decode retracted requests into it
                   "EMPTY_QUEUE_THEN_RETRACT": "queue was empty; then retraction refilled it"}
# the budget that held a waiting request (ReqHeld.budget), as the waiting_queue shows it
HELD_WORDS = {"rem_total_tokens": "pool", "rem_input_tokens": "prefill", "rem_chunk_tokens": "chunk",
              "max_running_requests": "max run", "in_batch_prefix": "prefix", "not_reached": "order",
              "failed_round_trial": "trial", "grammar": "grammar"}
RID_WIDTH = 16  # longer rids (a server's are uuids) show as their head and tail
THROUGHPUT_WINDOW = 2.0  # seconds of output tokens the tok/s figure averages over


def short_rid(rid: str, width: int = RID_WIDTH) -> str:
    """``cmpl-7f388f…-0-0`` for a long rid; short ones as they are."""
    if len(rid) <= width:
        return rid
    tail = min(6, width // 3)
    return f"{rid[: width - tail - 1]}…{rid[-tail:]}"


@dataclass
class ReqInfo:
    """One request's story, for the detail screen: text and stages, each stamped with
    the iteration it happened in (so a replay can show it as of any iteration)."""

    rid: str
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    ignore_eos: bool = False
    text: list[tuple[int, str]] = field(default_factory=list)
    output_tokens: list[tuple[int, int]] = field(default_factory=list)  # (iteration, tokens so far)
    timeline: list[tuple[int, str]] = field(default_factory=list)
    retracted: list[int] = field(default_factory=list)  # iterations it was retracted in
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (iteration, computed, total)
    holds: list[tuple[int, ev.ReqHeld]] = field(default_factory=list)  # (iteration, why it was left waiting)
    ended: tuple[int, str] | None = None  # (iteration, "finished: length" / "aborted: why")
    # a request that asked for logprobs: (iteration, output index, token, logprob, top (id, logprob)s)
    logprobs: list[tuple[int, int, int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    # a request with a grammar: (iteration, output index, tokens allowed, the model's
    # unmasked argmax, whether the mask refused it, the token sampled)
    grammar_steps: list[tuple[int, int, int, int, bool, int]] = field(default_factory=list)

    def text_at(self, iteration: int) -> str:
        return "".join(t for it, t in self.text if it <= iteration)

    def logprob_lines(self, iteration: int, last: int = 8) -> list[str]:
        """Its output tokens' logprobs as of ``iteration``: the closest call (the smallest
        margin between the two best tokens, where another rounding could have chosen the
        other) and the last ``last`` tokens."""
        rows = [r for r in self.logprobs if r[0] <= iteration]
        two = [r for r in rows if len(r[4]) >= 2]
        out = []
        if two:
            _, i, _, _, top = min(two, key=lambda r: r[4][0][1] - r[4][1][1])
            out.append(f"closest call: output token {i}: {top[0][0]} ({top[0][1]:.4f}) over {top[1][0]} "
                       f"({top[1][1]:.4f}), margin {top[0][1] - top[1][1]:.4f}")
        for _, i, token, value, top in rows[-last:]:
            rest = "  ".join(f"{t} {v:.3f}" for t, v in top[:3])
            out.append(f"  token {i:>4}: {token} {value:.4f}" + (f"   top: {rest}" if rest else ""))
        return out

    def grammar_lines(self, iteration: int, last: int = 8) -> list[str]:
        """What its grammar's mask did, as of ``iteration``: how often it refused the
        model's first choice, and the last ``last`` tokens' steps."""
        rows = [r for r in self.grammar_steps if r[0] <= iteration]
        if not rows:
            return []
        out = [f"the mask refused the model's first choice at {sum(r[4] for r in rows)} of {len(rows)} tokens"]
        for _, i, allowed, preferred, refused, token in rows[-last:]:
            said = f"preferred {preferred}, refused -> {token}" if refused else f"took its first choice {token}"
            out.append(f"  token {i:>4}: {allowed:>6} allowed; {said}")
        return out

    def tokens_at(self, iteration: int) -> int:
        return next((n for it, n in reversed(self.output_tokens) if it <= iteration), 0)

    def hold_at(self, iteration: int) -> str:
        """Why admission last left it waiting, as of ``iteration`` ('' if it never did)."""
        h = next((h for it, h in reversed(self.holds) if it <= iteration), None)
        if h is None:
            return ""
        numbers = f": needs {h.need}, has {h.have}" if h.need else ""
        return f"\nheld by {h.budget} since iter {h.iteration}{numbers} ({h.detail})"

    def timeline_at(self, iteration: int) -> list[tuple[int, str]]:
        return [(it, what) for it, what in self.timeline if it <= iteration]

    def state_at(self, view: "View") -> str:
        """Where the request is after ``view``'s iteration, in the scheduler's words,
        with the counts that go with it."""
        it, rid = view.iteration, self.rid
        if not self.timeline_at(it):
            return "not arrived yet at this iteration"
        out = f"{self.tokens_at(it)}/{self.max_new_tokens} output tokens"
        retracts = sum(1 for r in self.retracted if r <= it)
        again = f", retracted {retracts}x" if retracts else ""
        if self.ended is not None and self.ended[0] <= it:
            return f"{self.ended[1]} at iter {self.ended[0]}, {out}{again}"
        if not view.has_snapshots:
            return f"in the scheduler (this recording has no snapshots), {out}{again}"
        if view.chunked_rid == rid:
            done = next(((c, t) for i, c, t in reversed(self.chunks) if i <= it), None)
            part = f" {done[0]}/{done[1]} prompt tokens computed" if done else ""
            return f"chunked (chunked_req: prefill continues next round;{part}){again}"
        if any(r[0] == rid for r in view.running):
            return f"running (running_batch), {out}{again}"
        if any(w[0] == rid for w in view.waiting):
            why = "retracted: back in waiting_queue, output kept, KV recomputed" if retracts else "waiting (waiting_queue)"
            return f"{why}, {out}{again}{self.hold_at(it)}"
        return f"between queues, {out}{again}"


@dataclass
class View:
    iteration: int = 0
    forward_mode: str = "IDLE"  # of the batch launched this iteration
    bid: int = 0  # that batch's id (0: none)
    processed_bid: int = 0  # the batch whose results this iteration processed
    overlap: bool = False
    waiting: list[tuple] = field(default_factory=list)  # rid, prompt tokens, cached prefix, iterations waited, held by
    running: list[tuple] = field(default_factory=list)  # rid, seq_len, "out/max"
    plan: list[tuple] = field(default_factory=list)  # rid, prefix_len, extend_len, seq_len, loc range
    plan_rows: int = 0
    chunked_rid: str = ""
    pool_total: int = 0
    pool_free: int = 0
    pool_evictable: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    new_token_ratio: float = 0.0
    retractions: int = 0
    cache_miss: dict[str, int] = field(default_factory=dict)  # computed prompt tokens by why (CacheMatched)
    admission_stop: str = ""
    tree: tuple[ev.TreeNodeRow, ...] = ()  # SchedulerSnapshot.tree rows
    matched_path: frozenset[int] = frozenset()  # node ids from the root to the last match
    policy: str = ""
    throughput: float = 0.0  # output tokens/s over the last iterations
    finished: int = 0
    hit_rate_history: list[float] = field(default_factory=list)
    throughput_history: list[float] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # the last LOG_KEEP lines
    log_total: int = 0  # lines logged so far, so the screen can append only new ones
    has_snapshots: bool = True  # False for a recording made without them
    # --tp-size N: per rank, (forward s, all-reduce s) of the newest forward (ForwardFinished)
    tp_timings: tuple[tuple[float, float], ...] = ()

    def panels(self) -> dict[str, Any]:
        """What each panel shows, as plain data (replay tests compare these)."""
        return {"waiting": self.waiting, "running": self.running, "plan": (self.forward_mode, self.plan_rows, self.plan),
                "pool": (self.pool_total, self.pool_free, self.pool_evictable, self.retractions, self.admission_stop),
                "tree": (self.tree, self.matched_path), "log": self.log[-50:], "flight": (self.bid, self.processed_bid)}


def _loc_range(locs: tuple[int, ...]) -> str:
    if not locs:
        return "-"
    return f"{min(locs)}..{max(locs)}" if len(locs) > 1 else str(locs[0])


class ViewBuilder:
    """Feed it events in order; it returns a View at the end of each iteration."""

    def __init__(self) -> None:
        self.requests: dict[str, ReqInfo] = {}
        self.log: list[str] = []
        self.queued_at: dict[str, int] = {}
        self.finished = 0
        self.retractions = 0
        self.cache_miss: dict[str, int] = {"evicted": 0, "new": 0, "past": 0, "page": 0}
        self.admission_stop = ""
        self._last_stop_logged = ""
        self._snapshot: ev.SchedulerSnapshot | None = None
        self._tree: tuple[ev.TreeNodeRow, ...] = ()
        self._plan: ev.BatchPlanned | None = None
        self._tp_timings: tuple[tuple[float, float], ...] = ()
        self._tokens = 0  # output tokens emitted this iteration
        self._first_ts: float | None = None
        self._rate: deque[tuple[float, int]] = deque()  # (end ts, output tokens) of recent iterations
        self.last_ts: float | None = None  # when the newest iteration ended (monotonic)
        self.hit_rate_history: list[float] = []
        self.throughput_history: list[float] = []

    def add_log(self, iteration: int | str, line: str) -> None:
        self.log.append(f"{iteration:>5} {line}")

    def _req(self, rid: str) -> ReqInfo:
        if rid not in self.requests:
            self.requests[rid] = ReqInfo(rid)
        return self.requests[rid]

    def apply(self, e: ev.Event) -> View | None:
        it = e.iteration
        if isinstance(e, (ev.ReqArrived, ev.ReqHeld, ev.ReqAdmitted, ev.ReqChunked, ev.ReqRetracted,
                          ev.ReqFinished, ev.ReqAborted, ev.TokensEmitted, ev.TokenLogprobs, ev.GrammarQueued,
                          ev.GrammarReady, ev.GrammarMasked)):
            self._apply_req(e, self._req(e.rid))
        elif isinstance(e, ev.CacheMatched) and e.reason:
            self._count_miss(e)
        elif isinstance(e, ev.CacheEvicted):
            self.add_log(it, f"[yellow]evict[/] {e.num_tokens} tok, {e.num_nodes} nodes")
        elif isinstance(e, ev.AdmissionStopped):
            self.admission_stop = e.reason
            shown = e.reason if e.waiting else ""
            if shown != self._last_stop_logged and shown not in ("", "EMPTY_QUEUE"):
                self.add_log(it, f"admission stops: {ADMISSION_WORDS.get(shown, shown)} ({shown}), {e.waiting} waiting")
            self._last_stop_logged = shown
        elif isinstance(e, ev.BatchPlanned):
            self._plan = e
        elif isinstance(e, ev.ForwardFinished):
            self._tp_timings = e.tp_timings
        elif isinstance(e, ev.SchedulerSnapshot):
            self._snapshot = e
            if e.tree is not None:
                self._tree = e.tree
        elif isinstance(e, ev.IterationFinished):
            return self._finish_iteration(e)
        return None

    def _count_miss(self, e: ev.CacheMatched) -> None:
        """The prompt tokens an admission computed, by why the cache did not serve them."""
        m = self.cache_miss
        m["evicted"] += e.evicted_len
        m["past" if e.diverged_at > 0 else "new"] += e.rest_len
        m["page"] += e.page_tail
        if e.evicted_len:
            self.add_log(e.iteration, f"[yellow]recompute[/] {short_rid(e.rid)}: {e.evicted_len} tok evicted "
                                      f"at iter {e.evicted_at}")

    def _apply_req(self, e: Any, r: ReqInfo) -> None:
        """One request's event: its story (detail screen), the log, the counters."""
        it = e.iteration
        if isinstance(e, ev.ReqArrived):
            r.prompt_tokens, r.max_new_tokens, r.ignore_eos = e.prompt_tokens, e.max_new_tokens, e.ignore_eos
            r.timeline.append((it, f"arrived, {e.prompt_tokens} prompt tokens"
                                   + (", ignore_eos (decodes all max_new_tokens)" if e.ignore_eos else "")))
            self.queued_at[e.rid] = it
        elif isinstance(e, ev.ReqHeld):
            r.holds.append((it, e))
            r.timeline.append((it, f"held by {HELD_WORDS.get(e.budget, e.budget)} ({e.budget})"))
        elif isinstance(e, ev.ReqAdmitted):
            what = f"admitted: prefix {e.prefix_len} cached, +{e.extend_len} computed" + (" (chunk)" if e.chunked else "")
            r.timeline.append((it, what))
            if e.prefix_len:
                self.add_log(it, f"[green]hit[/] {short_rid(e.rid)}: {e.prefix_len} cached + {e.extend_len} new")
        elif isinstance(e, ev.ReqChunked):
            r.chunks.append((it, e.computed_len, e.total_len))
            r.timeline.append((it, f"chunk {e.chunk_index} done, {e.computed_len}/{e.total_len}"))
            self.add_log(it, f"[cyan]chunk[/] {short_rid(e.rid)} #{e.chunk_index} {e.computed_len}/{e.total_len}")
        elif isinstance(e, ev.ReqRetracted):
            self.retractions += 1
            if self.admission_stop == "EMPTY_QUEUE":  # (admission ran before this round's retraction)
                self.admission_stop = "EMPTY_QUEUE_THEN_RETRACT"
            self.queued_at[e.rid] = it
            r.retracted.append(it)
            r.timeline.append((it, f"retracted at {e.output_tokens} tokens ({e.kept_tokens} stay cached, "
                                   f"{e.recompute_tokens} to prefill again)"))
            self.add_log(it, f"[red]retract[/] {short_rid(e.rid)} at {e.output_tokens} tok, "
                             f"new_token_ratio {e.old_new_token_ratio:.3f}->{e.new_token_ratio:.3f}")
        elif isinstance(e, ev.ReqFinished):
            self.finished += 1
            r.ended = (it, f"finished: {e.reason}")
            r.timeline.append((it, f"finished: {e.reason}, {e.completion_tokens} tokens"))
            self.add_log(it, f"done {short_rid(e.rid)} {e.reason} {e.completion_tokens} tok")
        elif isinstance(e, ev.TokenLogprobs):
            r.logprobs.append((it, e.index, e.token_id, e.logprob, e.top))
        elif isinstance(e, (ev.GrammarQueued, ev.GrammarReady, ev.GrammarMasked)):
            self._apply_grammar(e, r)
        elif isinstance(e, ev.ReqAborted):
            r.ended = (it, f"aborted: {e.reason}")
            r.timeline.append((it, f"aborted: {e.reason}"))
            self.add_log(it, f"[red]abort[/] {short_rid(e.rid)}: {e.reason}")
        else:  # TokensEmitted
            if not r.output_tokens:
                r.timeline.append((it, "first token"))
            r.output_tokens.append((it, (r.output_tokens[-1][1] if r.output_tokens else 0) + len(e.token_ids)))
            if e.text:
                r.text.append((it, e.text))
            self._tokens += len(e.token_ids)

    def _apply_grammar(self, e: Any, r: ReqInfo) -> None:
        it = e.iteration
        if isinstance(e, ev.GrammarMasked):
            r.grammar_steps.append((it, e.index, e.allowed, e.preferred, e.refused, e.token_id))
        elif isinstance(e, ev.GrammarQueued):
            r.timeline.append((it, f"grammar_queue: its {e.kind} grammar compiles"))
            self.add_log(it, f"[magenta]grammar[/] {short_rid(e.rid)} {e.kind} compiling")
        else:
            r.timeline.append((it, f"grammar compiled after {e.waited_iterations} iterations: to the waiting_queue"))
            self.queued_at[e.rid] = it

    def throughput_at(self, now: float) -> float:
        """Output tokens a second over the THROUGHPUT_WINDOW seconds before ``now`` (less
        at the very start): 0 once nothing has run for a whole window."""
        span = min(THROUGHPUT_WINDOW, now - self._first_ts) if self._first_ts is not None else 0.0
        return sum(n for ts, n in self._rate if ts > now - THROUGHPUT_WINDOW) / span if span > 0 else 0.0

    def _finish_iteration(self, e: ev.IterationFinished) -> View:
        it = e.iteration
        if self._first_ts is None:
            self._first_ts = e.ts
        self._rate.append((e.ts, self._tokens))
        while self._rate[0][0] <= e.ts - THROUGHPUT_WINDOW:  # (the newest always stays)
            self._rate.popleft()
        self.last_ts, self._tokens = e.ts, 0
        throughput = self.throughput_at(e.ts)
        self.hit_rate_history = (self.hit_rate_history + [e.cache_hit_rate])[-HISTORY:]
        self.throughput_history = (self.throughput_history + [throughput])[-HISTORY:]
        plan, rows = [], 0
        if e.bid and self._plan is not None and self._plan.bid == e.bid:
            p, off = self._plan, 0
            for rid, pre, ext, seq in zip(p.rids, p.prefix_lens, p.extend_lens, p.seq_lens):
                plan.append((rid, pre, ext, seq, _loc_range(p.out_cache_loc[off:off + ext])))
                off += ext
            rows = p.num_rows
        s = self._snapshot
        self._snapshot = None
        view = View(
            iteration=it, forward_mode=e.forward_mode or "IDLE", bid=e.bid, processed_bid=e.processed_bid,
            plan=plan, plan_rows=rows, token_usage=e.token_usage, cache_hit_rate=e.cache_hit_rate,
            new_token_ratio=e.new_token_ratio, retractions=self.retractions, admission_stop=self.admission_stop,
            cache_miss=dict(self.cache_miss),
            throughput=throughput, finished=self.finished, hit_rate_history=list(self.hit_rate_history),
            throughput_history=list(self.throughput_history), log=self.log[-LOG_KEEP:], log_total=len(self.log),
            has_snapshots=s is not None, tp_timings=self._tp_timings,
        )
        if s is not None:
            view.waiting = [(w.rid, w.prompt_tokens, w.prefix_len, it - self.queued_at.get(w.rid, it),
                             HELD_WORDS.get(w.held, w.held)) for w in s.waiting]
            view.running = [(r.rid, r.seq_len, f"{r.output_tokens}/{r.max_new_tokens}") for r in s.running]
            view.chunked_rid, view.overlap, view.policy = s.chunked_rid, s.overlap, s.policy
            view.pool_total, view.pool_free, view.pool_evictable = s.pool_total, s.pool_free, s.pool_evictable
            view.tree, view.matched_path = self._tree, _path_to(self._tree, s.matched_node)
        return view


def _path_to(tree: tuple[ev.TreeNodeRow, ...], node_id: int) -> frozenset[int]:
    parent = {row.id: row.parent_id for row in tree}
    path = set()
    while node_id in parent and node_id not in path:
        path.add(node_id)
        node_id = parent[node_id]
    return frozenset(path)


def build_views(events: list[ev.Event]) -> tuple[list[View], ViewBuilder]:
    """Every iteration's View of a recording, in order (for --replay)."""
    builder = ViewBuilder()
    views = [v for v in map(builder.apply, events) if v is not None]
    return views, builder
