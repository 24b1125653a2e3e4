"""What watches the scheduler: its events, the per-iteration SchedulerSnapshot for the
TUI, the statistics, and SGLang's ``Prefill batch.`` / ``Decode batch.`` log lines
(SGLang keeps these in mixins of the Scheduler: scheduler_metrics_mixin.py and
friends). The Scheduler holds one and tells it what happened; none of this decides
anything, so the scheduling code reads without it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from sglite import events as ev
from sglite.explain import BATCHES, LIFECYCLE, RequestHistory, explain
from sglite.managers.io_struct import ExplainReqOutput
from sglite.mem_cache.cache_miss import classify
from sglite.sampling.sampling_params import TOP_K_ALL

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import ModelWorkerBatch, Req, ScheduleBatch
    from sglite.managers.schedule_policy import Hold, PrefillAdder
    from sglite.managers.scheduler import Scheduler
    from sglite.managers.tp_worker import GenerationBatchResult
    from sglite.sampling.sampling_batch_info import GrammarStep

logger = logging.getLogger("sglite")
KEY_TEXT_MEMO = 10_000  # decoded radix-node heads kept (then the memo starts again)


class SchedulerObserver:
    def __init__(self, scheduler: "Scheduler", event_bus: ev.EventBus):
        self.scheduler = scheduler
        self.event_bus = event_bus
        # every request's arrival, holds, admissions, retractions and finish, for explain()
        self.history = RequestHistory()
        event_bus.subscribe(self.history, kinds=LIFECYCLE + BATCHES)
        self.num_retracted_reqs = 0
        # computed prompt tokens by why the cache did not serve them (cache_miss.py)
        self.cache_miss_tokens: Counter[str] = Counter()
        self.total_hit_tokens = 0
        self.total_input_tokens = 0
        self.num_generated_tokens = 0  # since the last Decode batch. line
        self.last_gen_throughput = 0.0  # tokens/s as that line reported it (sglang:gen_throughput)
        self.forward_ct_decode = 0
        self.last_decode_stats_tic = time.perf_counter()
        self.last_matched_node_id = 0  # radix node where the latest admission's prefix match ended
        self._last_tree: tuple[ev.TreeNodeRow, ...] | None = None
        self._key_texts: dict[tuple[int, ...], str] = {}  # a radix node's key_head -> its text
        # the phases of the current iteration (time.monotonic), for IterationFinished
        self._started = self._scheduled = self._launched = self._resolved = 0.0
        self._processed_bid = 0

    # --- statistics -------------------------------------------------------------------

    def num_used_tokens(self) -> int:
        """KV slots held by requests: neither free nor evictable from the tree."""
        s = self.scheduler
        free = s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()
        return s.max_total_num_tokens - free

    def token_usage(self) -> float:
        return self.num_used_tokens() / self.scheduler.max_total_num_tokens

    def cache_hit_rate(self) -> float:
        total = self.total_hit_tokens + self.total_input_tokens
        return self.total_hit_tokens / total if total else 0.0

    # --- requests ---------------------------------------------------------------------

    def internal_state(self) -> dict:
        """What /get_server_info and /metrics report of the scheduler."""
        s = self.scheduler
        return {"iteration": s.iteration, "num_running_reqs": len(s.running_reqs()),
                "num_queue_reqs": len(s.waiting_queue), "num_grammar_queue_reqs": len(s.grammar_manager),
                "num_used_tokens": self.num_used_tokens(),
                "token_usage": self.token_usage(), "max_total_num_tokens": s.max_total_num_tokens,
                "available_tokens": s.token_to_kv_pool_allocator.available_size(),
                "evictable_tokens": s.tree_cache.evictable_size(), "cache_hit_rate": self.cache_hit_rate(),
                "num_retracted_reqs": self.num_retracted_reqs, "new_token_ratio": s.new_token_ratio,
                "last_gen_throughput": self.last_gen_throughput, "cache_miss_tokens": dict(self.cache_miss_tokens)}

    def explain(self, rid: str) -> ExplainReqOutput:
        """Request ``rid``'s history in words (sglite/explain.py), from the lifecycle
        events kept for the last 10,000 requests (Engine.explain, /explain?rid=)."""
        try:
            return ExplainReqOutput(explain(self.history.events(rid), rid, self.history.gaps(rid)))
        except KeyError as e:
            return ExplainReqOutput("", str(e.args[0]))

    def on_req_arrived(self, req: "Req", temperature: float) -> None:
        p = req.sampling_params
        self.event_bus.emit(ev.ReqArrived, rid=req.rid, prompt_tokens=len(req.origin_input_ids),
                            max_new_tokens=p.max_new_tokens, temperature=temperature, top_p=p.top_p,
                            top_k=p.top_k if p.top_k < TOP_K_ALL else -1, ignore_eos=p.ignore_eos,
                            trace_parent=req.trace_parent, input_ids=tuple(req.origin_input_ids),
                            extra_key=req.extra_key,
                            sampling_params={**p.to_dict(), "temperature": temperature, "seed": req.sampling_seed})

    def on_req_aborted(self, rid: str, reason: str, by_client: bool = False) -> None:
        self.event_bus.emit(ev.ReqAborted, rid=rid, reason=reason, by_client=by_client)

    def on_req_chunked(self, req: "Req", computed_len: int) -> None:
        self.event_bus.emit(ev.ReqChunked, rid=req.rid, chunk_index=req.chunk_index - 1, computed_len=computed_len,
                            total_len=len(req.origin_input_ids) + len(req.output_ids))

    def on_req_finished(self, req: "Req") -> None:
        assert req.finished_reason is not None
        self.event_bus.emit(ev.ReqFinished, rid=req.rid, reason=req.finished_reason.to_json()["type"],
                            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
                            cached_tokens=req.cached_tokens, closest_call=closest_call(req),
                            grammar_refused=(req.grammar_refused, req.grammar_steps) if req.grammar_steps else None)

    def on_token_logprobs(self, req: "Req") -> None:
        """The newest output token's logprob and top tokens (a request that asked)."""
        lp = req.logprobs
        if not self.event_bus.active or lp is None or not lp.output_token_logprobs:
            return
        value, token = lp.output_token_logprobs[-1]
        top = tuple((t, v) for v, t in lp.output_top_logprobs[-1])
        self.event_bus.emit(ev.TokenLogprobs, rid=req.rid, index=len(lp.output_token_logprobs) - 1, token_id=token,
                            logprob=value, top=top)

    def on_grammar_queued(self, req: "Req") -> None:
        req.grammar_queued_iteration = self.scheduler.iteration
        self.event_bus.emit(ev.GrammarQueued, rid=req.rid, kind=req.grammar_key[0] if req.grammar_key else "")

    def on_grammar_ready(self, req: "Req") -> None:
        waited = self.scheduler.iteration - req.grammar_queued_iteration
        self.event_bus.emit(ev.GrammarReady, rid=req.rid, kind=req.grammar_key[0] if req.grammar_key else "",
                            waited_iterations=waited, waited_s=time.perf_counter() - req.created_time)

    def on_grammar_step(self, req: "Req", step: "GrammarStep", token_id: int) -> None:
        """What the mask did to the request's newest token (a request with a grammar)."""
        req.grammar_steps += 1
        req.grammar_refused += step.refused
        if self.event_bus.active:
            self.event_bus.emit(ev.GrammarMasked, rid=req.rid, index=len(req.output_ids) - 1, allowed=step.allowed,
                                preferred=step.preferred, refused=step.refused, token_id=token_id)

    # --- scheduling -------------------------------------------------------------------

    def on_admission_stopped(self, reason: str, adder: "PrefillAdder | None" = None) -> None:
        if self.event_bus.active:
            self.event_bus.emit(ev.AdmissionStopped, reason=reason, waiting=len(self.scheduler.waiting_queue),
                                rem_total_tokens=int(adder.rem_total_tokens) if adder else 0,
                                rem_input_tokens=int(adder.rem_input_tokens) if adder else 0)

    def on_reqs_held(self, holds: list[tuple["Req", "Hold"]]) -> None:
        """Each waiting request's hold this round; a ReqHeld when its budget changed."""
        for req, hold in holds:
            old = req.hold
            # numbers change every round; the budget (or, not reached, the stopper) is news
            if old is None or old.budget != hold.budget or (hold.budget == "not_reached" and old.detail != hold.detail):
                self.event_bus.emit(ev.ReqHeld, rid=req.rid, budget=hold.budget, need=hold.need,
                                    have=hold.have, detail=hold.detail)
            req.hold = hold

    def on_prefill_batch(self, can_run: list["Req"], adder: "PrefillAdder", running_bs: int) -> None:
        """The admitted requests' events, the hit statistics, SGLang's Prefill batch. line."""
        self.total_hit_tokens += adder.log_hit_tokens
        self.total_input_tokens += adder.log_input_tokens
        chunked = self.scheduler.chunked_req
        for req in can_run:
            req.hold = None  # admitted: a later hold (after a retraction) is news again
            if req.last_node is not None:
                self.last_matched_node_id = req.last_node.id
            self._emit_cache_matched(req, continued=req is adder.continued)
            self.event_bus.emit(ev.ReqAdmitted, rid=req.rid, prefix_len=len(req.prefix_indices),
                                extend_len=req.extend_input_len, chunked=req is chunked)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(can_run), adder.log_input_tokens, adder.log_hit_tokens, self.token_usage(),
            running_bs, len(self.scheduler.waiting_queue),
        )

    def _emit_cache_matched(self, req: "Req", continued: bool) -> None:
        """The admission's prefix match and, for a first admission (not a next chunk),
        why the rest was computed; the tokens counted by reason in cache_miss_tokens."""
        if continued:
            self.event_bus.emit(ev.CacheMatched, rid=req.rid, matched_len=len(req.prefix_indices),
                                key_len=len(req.fill_ids))
            return
        s = self.scheduler
        fill = req.origin_input_ids + req.output_ids
        miss = classify(fill, len(req.prefix_indices), s.page_size, s.tree_cache.evicted_keys, req.extra_key)
        for reason, n in (("evicted", miss.evicted), ("page_tail", miss.page_tail), ("last_token", miss.last_token),
                          ("radix_off" if miss.radix_off else "past_shared" if miss.diverged_at > 0 else "new",
                           miss.rest)):
            self.cache_miss_tokens[reason] += n
        if self.event_bus.wants(ev.CacheMatched):
            self.event_bus.emit(ev.CacheMatched, rid=req.rid, matched_len=miss.matched, key_len=len(fill),
                                evicted_len=miss.evicted, evicted_at=miss.evicted_at, page_tail=miss.page_tail,
                                diverged_at=miss.diverged_at, rest_len=miss.rest, reason=miss.reason)

    def on_retract(self, retracted: list["Req"], old_ratio: float, new_ratio: float,
                   reason: str = "KV cache pool is full") -> None:
        self.num_retracted_reqs += len(retracted)
        logger.warning("%s. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                       reason, len(retracted), old_ratio, new_ratio)
        for req in retracted:
            kept = req.retract_kept_tokens
            self.event_bus.emit(ev.ReqRetracted, rid=req.rid, reason=reason,
                                old_new_token_ratio=old_ratio, new_token_ratio=new_ratio,
                                output_tokens=len(req.output_ids), kept_tokens=kept,
                                recompute_tokens=len(req.origin_input_ids) + len(req.output_ids) - kept)

    # --- forwards ---------------------------------------------------------------------

    def on_batch_planned(self, batch: "ScheduleBatch", worker_batch: "ModelWorkerBatch") -> None:
        self._scheduled = time.monotonic()
        # (explain's history takes the prefill batches only: a decode batch every round would cost)
        if self.event_bus.active or (not batch.forward_mode.is_decode() and self.event_bus.wants(ev.BatchPlanned)):
            self.event_bus.emit(ev.BatchPlanned, bid=worker_batch.bid, forward_mode=batch.forward_mode.name,
                                rids=tuple(r.rid for r in batch.reqs), seq_lens=tuple(batch.seq_lens),
                                prefix_lens=tuple(batch.prefix_lens), extend_lens=tuple(batch.extend_lens),
                                out_cache_loc=tuple(batch.out_cache_loc.tolist()), num_rows=len(batch.input_ids))

    def on_batch_launched(self) -> None:
        self._launched = time.monotonic()

    def on_batch_result(self, batch: "ScheduleBatch", result: "GenerationBatchResult") -> None:
        """The forward ran (in the overlap loop: while the scheduler went on): report it
        with its own times, under the iteration that launched it."""
        self._processed_bid = result.bid
        self._resolved = max(result.resolved, self._launched)
        if self.event_bus.active or (not batch.forward_mode.is_decode() and self.event_bus.wants(ev.ForwardFinished)):
            for event_cls, ts in ((ev.ForwardStarted, result.forward_started), (ev.ForwardFinished, result.forward_finished)):
                fields: dict[str, Any] = dict(bid=result.bid, forward_mode=batch.forward_mode.name, ts=ts,
                                              batch_size=batch.batch_size(), num_tokens=batch.extend_num_tokens,
                                              backend=self.scheduler.tp_worker.model_runner.attn_backend.name,
                                              iteration=result.iteration)
                if event_cls is ev.ForwardFinished:
                    fields["duration"] = result.forward_time
                    fields["tp_timings"] = tuple(tuple(t) for t in result.tp_timings)
                self.event_bus.emit(event_cls, **fields)
        if batch.forward_mode.is_decode():
            self.num_generated_tokens += batch.batch_size()  # as SGLang counts it: decode rows
            self.forward_ct_decode += 1
            if self.forward_ct_decode % self.scheduler.server_args.decode_log_interval == 0:
                self.log_decode_stats(batch)

    def log_decode_stats(self, batch: "ScheduleBatch") -> None:
        now = time.perf_counter()
        throughput = self.num_generated_tokens / max(now - self.last_decode_stats_tic, 1e-9)
        self.num_generated_tokens, self.last_decode_stats_tic = 0, now
        self.last_gen_throughput = throughput
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                    "#queue-req: %d", batch.batch_size(), self.num_used_tokens(), self.token_usage(), throughput,
                    len(self.scheduler.waiting_queue))

    # --- iterations -------------------------------------------------------------------

    def on_iteration_start(self) -> None:
        self.event_bus.iteration = self.scheduler.iteration
        self._started = time.monotonic()
        self._scheduled = self._launched = self._resolved = 0.0
        self._processed_bid = 0

    def on_iteration_end(self, batch: "ScheduleBatch | None") -> None:
        """Publish the snapshot (when a viewer wants state) and IterationFinished."""
        if self.event_bus.wants_snapshots:
            self.event_bus.publish(self.snapshot(full_tree=False))
        else:
            self._last_tree = None  # a later snapshot subscriber gets the whole tree
        if not self.event_bus.active:
            return
        s = self.scheduler
        scheduled = self._scheduled or time.monotonic()
        launched = self._launched or scheduled
        self.event_bus.emit(
            ev.IterationFinished, started=self._started, scheduled=scheduled, forwarded=launched,
            resolved=self._resolved or launched, bid=s.forward_ct if batch is not None else 0,
            processed_bid=self._processed_bid, forward_mode=batch.forward_mode.name if batch is not None else "",
            rids=tuple(r.rid for r in batch.reqs) if batch is not None else (),
            num_waiting=len(s.waiting_queue), num_running=len(s.running_reqs()), token_usage=self.token_usage(),
            cache_hit_rate=self.cache_hit_rate(), new_token_ratio=s.new_token_ratio,
        )

    def _key_text(self, key_head: tuple[int, ...]) -> str:
        """A node's first tokens as text, special tokens included (the TUI shows the
        tree as text; a node's key is fixed, so each is decoded once)."""
        text = self._key_texts.get(key_head)
        if text is None:
            if len(self._key_texts) > KEY_TEXT_MEMO:
                self._key_texts.clear()
            text = self.scheduler.tokenizer.decode(list(key_head), skip_special_tokens=False)
            self._key_texts[key_head] = text
        return text

    def with_snapshot(self, events: list[ev.Event], full_tree: bool = True) -> list[ev.Event]:
        """``events`` (a run of whole iterations) with a SchedulerSnapshot just before
        the newest IterationFinished, unless the scheduler emitted one: built now, between
        iterations, the state after an iteration being the state until the next. What
        ships events to a screen (the TUI's host, the server's event stream) sends only
        the newest iteration's state."""
        last = next((i for i in range(len(events) - 1, -1, -1) if isinstance(events[i], ev.IterationFinished)), None)
        if last is None:
            return events
        it = events[last].iteration
        if not any(isinstance(e, ev.SchedulerSnapshot) and e.iteration == it for e in events[:last]):
            events = events[:last] + [self.snapshot(full_tree)] + events[last:]
        return events

    def snapshot(self, full_tree: bool = True) -> ev.SchedulerSnapshot:
        """A SchedulerSnapshot of the state now (between iterations it is the state after
        the last one). ``full_tree=False`` leaves the tree out when it has not changed
        since the previous such snapshot (the per-iteration stream does that)."""
        s = self.scheduler
        waiting = tuple(ev.WaitingRow(r.rid, len(r.origin_input_ids), len(r.prefix_indices),
                                     r.hold.budget if r.hold else "") for r in s.waiting_queue)
        # then the grammar_queue: requests whose grammar still compiles (why: grammar)
        waiting += tuple(ev.WaitingRow(r.rid, len(r.origin_input_ids), 0, "grammar")
                         for r in s.grammar_manager.grammar_queue)
        # the running batch, and the request being chunk-prefilled (in neither queue: admitted,
        # its prompt not all computed yet; the help says it shows here)
        chunked = [s.chunked_req] if s.chunked_req is not None and not s.chunked_req.finished() else []
        running = tuple(ev.RunningRow(r.rid, r.seqlen, len(r.output_ids), r.sampling_params.max_new_tokens)
                        for r in s.running_reqs() + chunked)
        tree: tuple[ev.TreeNodeRow, ...] | None = tuple(s.tree_cache.snapshot())
        if not full_tree:
            changed = tree != self._last_tree
            self._last_tree = tree
            tree = tree if changed else None
        if tree is not None and s.tokenizer is not None:
            tree = tuple(row._replace(key_text=self._key_text(row.key_head)) for row in tree)
        return ev.SchedulerSnapshot(
            iteration=s.iteration, waiting=waiting, running=running,
            chunked_rid=s.chunked_req.rid if s.chunked_req is not None else "",
            pool_total=s.max_total_num_tokens, pool_free=s.token_to_kv_pool_allocator.available_size(),
            pool_evictable=s.tree_cache.evictable_size(), tree=tree, matched_node=self.last_matched_node_id,
            policy=s.server_args.schedule_policy, overlap=s.enable_overlap)


def closest_call(req: "Req") -> tuple[int, int, float, int, float] | None:
    """The output token whose two best candidates were nearest (a request that asked
    for 2 or more top logprobs): where another batch's rounding could have flipped it."""
    lp = req.logprobs
    if lp is None or lp.top_logprobs_num < 2 or not lp.output_top_logprobs:
        return None
    index = min(range(len(lp.output_top_logprobs)),
                key=lambda i: lp.output_top_logprobs[i][0][0] - lp.output_top_logprobs[i][1][0])
    (best, best_id), (second, second_id) = lp.output_top_logprobs[index][:2]
    return index, best_id, best, second_id, second
