"""Events -> a tree of timed intervals: one tree per request (its stages) and one per
scheduler iteration (its phases). Both the OpenTelemetry exporter and the Perfetto
converter are built on this, so a trace and a timeline always agree.

A node is *opened* when it starts (a request's root at arrival) and *closed* when it
ends; listeners get both calls. Times are the events' monotonic seconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from sglite import events as ev

TRACE_LEVEL_REQUESTS = 1  # request stages
TRACE_LEVEL_ITERATIONS = 2  # + scheduler iterations and forwards
TRACE_LEVEL_TOKENS = 3  # + one span event per emitted token

_ids = itertools.count(1)


@dataclass
class Node:
    name: str
    start: float
    kind: str  # "request", "stage", "iteration", "phase"
    track: str  # "req <rid>", "scheduler", "forward"
    parent: "Node | None" = None
    end: float | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    links: list["Node"] = field(default_factory=list)
    error: str | None = None
    id: int = field(default_factory=lambda: next(_ids))
    handle: Any = None  # the listener's object (an OTel span)
    remote_parent: str = ""  # a root's parent in another process (W3C traceparent), "" for none


class Listener:
    def on_open(self, node: Node) -> None: ...

    def on_close(self, node: Node) -> None: ...


@dataclass
class _BatchState:
    planned_in: ev.IterationFinished  # the iteration that planned and launched it
    links: list[Node]  # the requests it serves
    planned: ev.BatchPlanned | None
    stop: ev.AdmissionStopped | None


@dataclass
class _ReqState:
    root: Node
    stage: Node | None = None  # waiting or decode
    # prefill stages not yet done, oldest first: in the overlap loop chunk k+1 is
    # admitted before chunk k's result is processed, so two can be open at once
    prefills: list[Node] = field(default_factory=list)
    chunks: int = 0  # chunks admitted so far
    first_token_at: float | None = None  # decode starts here once a second token comes


class TimelineBuilder:
    """Subscribe it to an EventBus (or feed it a recording)."""

    def __init__(self, listener: Listener, level: int = TRACE_LEVEL_ITERATIONS, model: str = ""):
        self.listener = listener
        self.level = level
        self.model = model
        self.reqs: dict[str, _ReqState] = {}
        self._finished_roots: dict[str, Node] = {}  # finished this iteration: still linkable
        self._iteration: list[ev.Event] = []
        self._batches: dict[int, _BatchState] = {}  # launched, results not processed yet
        self._forwards: dict[int, dict[type, ev.Event]] = {}  # bid -> its forward events
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.ReqArrived: self._arrived, ev.ReqAdmitted: self._admitted, ev.ReqChunked: self._chunked,
            ev.TokensEmitted: self._tokens, ev.ReqRetracted: self._retracted, ev.ReqFinished: self._finished,
            ev.ReqAborted: self._aborted, ev.CacheMatched: self._cache_matched, ev.ReqHeld: self._held,
            ev.IterationFinished: self._iteration_finished, ev.GrammarQueued: self._grammar_queued,
            ev.GrammarReady: self._grammar_ready,
        }

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, (ev.BatchPlanned, ev.ForwardStarted, ev.ForwardFinished, ev.AdmissionStopped)):
            if self.level >= TRACE_LEVEL_ITERATIONS:
                self._iteration.append(event)
            return
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    # --- nodes ------------------------------------------------------------------------

    def _open(self, node: Node) -> Node:
        self.listener.on_open(node)
        return node

    def _close(self, node: Node, end: float) -> None:
        node.end = max(end, node.start)
        self.listener.on_close(node)

    def _stage(self, st: _ReqState, name: str, start: float, **attrs: Any) -> None:
        st.stage = self._open(Node(name, start, "stage", st.root.track, st.root, attributes=attrs))

    def _end_stage(self, st: _ReqState, end: float) -> None:
        if st.stage is not None:
            self._close(st.stage, end)
            st.stage = None

    def _end_prefills(self, st: _ReqState, end: float) -> None:
        for node in st.prefills:
            self._close(node, end)
        st.prefills = []

    # --- requests ---------------------------------------------------------------------

    def _arrived(self, e: ev.ReqArrived) -> None:
        attrs = {
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": e.max_new_tokens, "gen_ai.request.temperature": e.temperature,
            "gen_ai.request.top_p": e.top_p, "gen_ai.request.top_k": e.top_k, "gen_ai.response.id": e.rid,
            "gen_ai.usage.input_tokens": e.prompt_tokens,
        }
        root = self._open(Node(f"req {e.rid}", e.ts, "request", f"req {e.rid}", attributes=attrs,
                               remote_parent=e.trace_parent))
        st = self.reqs[e.rid] = _ReqState(root)
        self._stage(st, "waiting", e.ts)

    def _admitted(self, e: ev.ReqAdmitted) -> None:
        st = self.reqs.get(e.rid)
        if st is None:
            return
        self._end_stage(st, e.ts)
        name = "prefill"
        if e.chunked or st.chunks:
            name, st.chunks = f"prefill.chunk[{st.chunks}]", st.chunks + 1
        st.prefills.append(self._open(Node(name, e.ts, "stage", st.root.track, st.root, attributes={
            "sglite.prefix_len": e.prefix_len, "sglite.extend_len": e.extend_len})))

    def _grammar_queued(self, e: ev.GrammarQueued) -> None:
        """Its grammar compiles: a grammar_queue stage instead of waiting, until it is ready."""
        st = self.reqs.get(e.rid)
        if st is not None:
            self._end_stage(st, e.ts)
            self._stage(st, "grammar_queue", e.ts, **{"sglite.grammar": e.kind})

    def _grammar_ready(self, e: ev.GrammarReady) -> None:
        st = self.reqs.get(e.rid)
        if st is None:
            return
        self._end_stage(st, e.ts)
        st.root.events.append(("grammar_compiled", e.ts, {
            "sglite.grammar": e.kind, "sglite.waited_iterations": e.waited_iterations, "sglite.waited_s": e.waited_s}))
        self._stage(st, "waiting", e.ts)

    def _held(self, e: ev.ReqHeld) -> None:
        """Why admission left it waiting: a span event on its waiting span, each time the
        budget that holds it changes (docs/why.md)."""
        st = self.reqs.get(e.rid)
        if st is not None:
            (st.stage or st.root).events.append(("held", e.ts, {
                "sglite.budget": e.budget, "sglite.need": e.need, "sglite.have": e.have, "sglite.detail": e.detail}))

    def _cache_matched(self, e: ev.CacheMatched) -> None:
        st = self.reqs.get(e.rid)
        if st is not None and e.matched_len > 0:
            st.root.events.append(("cache_hit", e.ts, {"sglite.matched_len": e.matched_len, "sglite.key_len": e.key_len}))

    def _chunked(self, e: ev.ReqChunked) -> None:
        st = self.reqs.get(e.rid)
        if st is None or not st.prefills:
            return
        node = st.prefills.pop(0)
        node.attributes["sglite.computed_len"] = e.computed_len
        self._close(node, e.ts)

    def _tokens(self, e: ev.TokensEmitted) -> None:
        st = self.reqs.get(e.rid)
        if st is None:
            return
        if st.prefills:
            self._end_prefills(st, e.ts)
            st.first_token_at = e.ts
        elif st.stage is None and st.first_token_at is not None:
            self._stage(st, "decode", st.first_token_at)
        if self.level >= TRACE_LEVEL_TOKENS:
            target = st.stage or st.root
            target.events.append(("token", e.ts, {"sglite.token_ids": list(e.token_ids), "sglite.text": e.text}))

    def _retracted(self, e: ev.ReqRetracted) -> None:
        st = self.reqs.get(e.rid)
        if st is None:
            return
        self._end_stage(st, e.ts)
        self._end_prefills(st, e.ts)  # overlap: retracted before its prefill's result came back
        st.first_token_at = None
        st.root.events.append(("retract", e.ts, {
            "sglite.reason": e.reason, "sglite.output_tokens": e.output_tokens,
            "sglite.kept_tokens": e.kept_tokens, "sglite.recompute_tokens": e.recompute_tokens,
            "sglite.new_token_ratio.before": e.old_new_token_ratio, "sglite.new_token_ratio": e.new_token_ratio}))
        self._stage(st, "waiting", e.ts, **{"sglite.after_retract": True})

    def _end_request(self, rid: str, ts: float, reason: str, **attrs: Any) -> _ReqState | None:
        st = self.reqs.pop(rid, None)
        if st is None:
            return None
        self._end_stage(st, ts)
        self._end_prefills(st, ts)
        self._finished_roots[rid] = st.root
        st.root.attributes["gen_ai.response.finish_reasons"] = [reason]
        st.root.attributes.update(attrs)
        self._close(st.root, ts)
        return st

    def _finished(self, e: ev.ReqFinished) -> None:
        close = {} if e.closest_call is None else {  # a logprob request's nearest tie
            "sglite.closest_call.index": e.closest_call[0], "sglite.closest_call.margin":
                e.closest_call[2] - e.closest_call[4], "sglite.closest_call.tokens": [e.closest_call[1], e.closest_call[3]]}
        self._end_request(e.rid, e.ts, e.reason, **{
            "gen_ai.usage.output_tokens": e.completion_tokens, "sglite.cached_tokens": e.cached_tokens, **close})

    def _aborted(self, e: ev.ReqAborted) -> None:
        st = self.reqs.get(e.rid)
        if st is None:  # rejected before it became a Req
            node = self._open(Node(f"req {e.rid}", e.ts, "request", f"req {e.rid}", attributes={
                "gen_ai.response.id": e.rid, "gen_ai.response.finish_reasons": ["abort"]}))
            node.error = e.reason
            self._close(node, e.ts)
            return
        st.root.error = e.reason
        st.root.events.append(("abort", e.ts, {"sglite.reason": e.reason}))
        self._end_request(e.rid, e.ts, "abort")

    # --- iterations -------------------------------------------------------------------

    def _iteration_finished(self, e: ev.IterationFinished) -> None:
        """A batch's span runs from the start of the iteration that planned it to the end
        of the one that processed its results: the same iteration in the normal loop,
        the next one in the overlap loop (so consecutive batches overlap in time)."""
        buffered, self._iteration = self._iteration, []
        finished, self._finished_roots = self._finished_roots, {}
        if self.level < TRACE_LEVEL_ITERATIONS:
            return
        for x in buffered:
            if isinstance(x, (ev.ForwardStarted, ev.ForwardFinished)):
                self._forwards.setdefault(x.bid, {})[type(x)] = x
        if e.bid:
            roots = {**finished, **{rid: st.root for rid, st in self.reqs.items()}}
            self._batches[e.bid] = _BatchState(
                e, [roots[r] for r in e.rids if r in roots],
                next((x for x in buffered if isinstance(x, ev.BatchPlanned)), None),
                next((x for x in buffered if isinstance(x, ev.AdmissionStopped)), None))
        if e.processed_bid in self._batches:
            self._batch_spans(self._batches.pop(e.processed_bid), e)

    def _batch_spans(self, b: _BatchState, done: ev.IterationFinished) -> None:
        p = b.planned_in
        overlapped = done.processed_bid != done.bid
        track = "scheduler"
        planned = b.planned
        rows = planned.num_rows if planned else 0
        it = self._open(Node("ScheduleBatch", p.started, "iteration", track, links=b.links, attributes={
            "sglite.iteration": p.iteration, "sglite.bid": p.bid, "sglite.forward_mode": p.forward_mode,
            "sglite.batch_size": len(p.rids), "sglite.num_rows": rows, "sglite.num_waiting": p.num_waiting,
            "sglite.num_running": p.num_running, "sglite.token_usage": p.token_usage,
            "sglite.cache_hit_rate": p.cache_hit_rate, "sglite.new_token_ratio": p.new_token_ratio,
            "sglite.rids": list(p.rids), "sglite.overlap": overlapped}))
        plan_attrs: dict[str, Any] = {}
        if planned is not None:
            plan_attrs = {"sglite.prefix_lens": list(planned.prefix_lens), "sglite.extend_lens": list(planned.extend_lens),
                          "sglite.seq_lens": list(planned.seq_lens), "sglite.num_rows": planned.num_rows}
            if planned.out_cache_loc:
                plan_attrs["sglite.out_cache_loc"] = [min(planned.out_cache_loc), max(planned.out_cache_loc)]
        if b.stop is not None:
            plan_attrs["sglite.admission_stopped"] = b.stop.reason
        self._close(self._open(Node("get_next_batch_to_run", p.started, "phase", track, it,
                                    attributes=plan_attrs)), p.scheduled)
        run = self._open(Node("run_batch", p.scheduled, "phase", track, it))
        fwd = self._forwards.pop(p.bid, {})
        fwd_start, fwd_end = fwd.get(ev.ForwardStarted), fwd.get(ev.ForwardFinished)
        if fwd_start is not None and fwd_end is not None:
            node = self._open(Node("forward", fwd_start.ts, "phase", "forward", run, attributes={
                "sglite.bid": p.bid, "sglite.forward_mode": fwd_end.forward_mode,
                "sglite.batch_size": fwd_end.batch_size, "sglite.num_rows": fwd_end.num_tokens,
                "sglite.attention_backend": fwd_end.backend}))
            self._tp_rank_spans(node, fwd_start.ts, fwd_end)
            self._close(node, fwd_end.ts)
        # normal loop: run_batch includes the forward; overlap: it only launches it
        self._close(run, p.forwarded)
        process = self._open(Node("process_batch_result", done.forwarded, "phase", track, it))
        if overlapped and done.resolved > done.forwarded:
            # the scheduler had nothing left to do but wait for this batch's forward
            self._close(self._open(Node("resolve_batch_result", done.forwarded, "phase", track, process)),
                        done.resolved)
        self._close(process, done.ts)
        self._close(it, done.ts)

    def _tp_rank_spans(self, forward: Node, start: float, fwd_end: ev.ForwardFinished) -> None:
        """--tp-size N: one span per rank under the forward, as long as that rank's forward,
        with the seconds its all-reduces took. Each rank timed itself in its own process:
        the spans start with rank 0's forward (the others begin as its batch arrives)."""
        if not fwd_end.tp_timings:
            return
        forward.attributes["sglite.tp_size"] = len(fwd_end.tp_timings)
        for rank, (seconds, comm) in enumerate(fwd_end.tp_timings):
            span = self._open(Node(f"forward TP{rank}", start, "phase", f"forward TP{rank}", forward, attributes={
                "sglite.tp_rank": rank, "sglite.all_reduce_ms": round(comm * 1e3, 3)}))
            self._close(span, start + seconds)

    def close_open(self, ts: float) -> None:
        """End whatever is still open (an engine shut down mid-request)."""
        for rid in list(self.reqs):
            st = self.reqs[rid]
            st.root.error = "still running when tracing stopped"
            self._end_request(rid, ts, "unfinished")
