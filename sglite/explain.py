"""A request's history in words and numbers, read from the event stream: when it
arrived, which budget held it in the waiting_queue and for how many rounds, when it was
admitted (cache hit, chunking), retracted and finished. ``Engine.explain(rid)`` and a
server's ``/explain`` read the events the scheduler's RequestHistory kept
(SchedulerObserver.history); ``explain`` also reads a recording (``--record``).
docs/why.md lists every budget a request can wait on."""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sglite import events as ev
from sglite.managers.schedule_batch import RETRACT_DECODE_STEPS

# the events that make up one request's history
LIFECYCLE: tuple[type[ev.Event], ...] = (ev.ReqArrived, ev.GrammarQueued, ev.GrammarReady, ev.ReqHeld,
                                         ev.CacheMatched, ev.ReqAdmitted, ev.ReqChunked, ev.ReqRetracted,
                                         ev.ReqAborted, ev.ReqFinished)
POOL_FULL = "KV cache pool is full"
# ScheduleBatch.retract_decode's order (SGLang's): who goes first
RETRACT_RULE = ("; SGLang's order: the request with the fewest output tokens goes first, ties to the longest "
                f"prompt, until the rest can decode {RETRACT_DECODE_STEPS} more steps")
BUDGET_WORDS = {
    "rem_total_tokens": "the KV pool (rem_total_tokens)",
    "rem_input_tokens": "the prefill token budget (max_prefill_tokens, rem_input_tokens)",
    "rem_chunk_tokens": "the chunk budget (chunked_prefill_size, rem_chunk_tokens)",
    "max_running_requests": "max_running_requests",
    "in_batch_prefix": "in-batch prefix caching (a request sharing its prefix goes first)",
    "not_reached": "an earlier request in the queue (admission stopped before reaching it)",
    "failed_round_trial": "a failed round's requests re-running one at a time",
}


# the forwards of the batches a request was prefilled in: what its prefill (and the
# recompute after a retraction) cost in time
BATCHES: tuple[type[ev.Event], ...] = (ev.BatchPlanned, ev.ForwardFinished)
BATCHES_KEPT = 1024  # prefill batches whose forward has not been reported yet
# a request's first and last KEPT_PER_KIND events of each kind are kept: a request
# waiting many rounds can be held anew each round (ReqHeld comes when the budget or the
# request that stopped admission changes), and a long prompt is chunked hundreds of times
KEPT_PER_KIND = 16
MAX_EVENTS = 100_000  # kept over all requests: ~10,000 ordinary requests' histories


class RequestHistory:
    """Subscriber (kinds=LIFECYCLE + BATCHES) keeping, for ``Engine.explain`` and
    ``/explain``, the lifecycle events of the last ``keep`` requests and the prefill
    batches each was in; the oldest request's history goes first. Only what explain
    reads is kept: an arrival without its prompt's ids and with each list or string
    sampling parameter as its size (slim_arrival), a batch without its per-row lists
    (slim_batch); every other subscriber (the recorder, replay) gets the events whole.

    Bounds: a request keeps its first and last KEPT_PER_KIND events of each kind (a Gap
    counts the rest), so at most 3 + 7 * 32 = 227 events, ~200 KB at the very most
    (long hold details, batches of 64 requests), ~3.5 KB for an ordinary request (~9
    events, whatever its prompt or stop_token_ids). All requests together keep at most
    ``max_events`` events, the oldest requests' going first: with MAX_EVENTS, ~40 MB of
    ordinary events (~400 bytes each), ~100 MB at the very most."""

    def __init__(self, keep: int = 10_000, max_events: int = MAX_EVENTS):
        self.keep = keep
        self.max_events = max_events
        self.num_events = 0  # kept over all requests (a BatchPlanned once per request it holds)
        self._by_rid: OrderedDict[str, _Kept] = OrderedDict()
        self._batch_rids: OrderedDict[int, list[str]] = OrderedDict()  # bid -> its requests we keep

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.BatchPlanned):
            if event.forward_mode != "DECODE":
                self._batch_rids[event.bid] = rids = [r for r in event.rids if r in self._by_rid]
                if len(self._batch_rids) > BATCHES_KEPT:
                    self._batch_rids.popitem(last=False)
                if rids:
                    slim = slim_batch(event)  # one copy, shared by the batch's requests
                    for r in rids:
                        self._add(r, slim)
        elif isinstance(event, ev.ForwardFinished):
            for r in self._batch_rids.pop(event.bid, ()):
                if r in self._by_rid:
                    self._add(r, event)
        else:
            rid = getattr(event, "rid", "")
            if isinstance(event, ev.ReqArrived):
                self._forget(rid)  # a reused rid: a new request, a new history
                event = slim_arrival(event)
            if rid not in self._by_rid:
                if len(self._by_rid) >= self.keep:
                    self._forget(next(iter(self._by_rid)))
                self._by_rid[rid] = _Kept()
            self._add(rid, event)
        while self.num_events > self.max_events and self._by_rid:
            self._forget(next(iter(self._by_rid)))

    def _add(self, rid: str, event: ev.Event) -> None:
        """Append to the request's events; past 2 * KEPT_PER_KIND of a kind, the oldest
        of its last KEPT_PER_KIND goes into that kind's Gap."""
        kept = self._by_rid[rid]
        if kept.open_hold is not None and not isinstance(event, ev.ForwardFinished):
            # explain counts a hold's rounds up to the request's next event (a forward is
            # reported late, under the iteration that launched it)
            kept.hold_ends[id(kept.open_hold)] = event.iteration
            kept.open_hold = None
        if isinstance(event, ev.ReqHeld):
            kept.open_hold = event
        kind = type(event)
        kept.seen[kind] += 1
        kept.events.append(event)
        self.num_events += 1
        if kept.seen[kind] > 2 * KEPT_PER_KIND:
            kept.leave_out(kind)
            self.num_events -= 1

    def _forget(self, rid: str) -> None:
        kept = self._by_rid.pop(rid, None)
        if kept is not None:
            self.num_events -= len(kept.events)

    def events(self, rid: str) -> list[ev.Event]:
        """The events kept of request ``rid`` (arrival order); [] for one not kept."""
        kept = self._by_rid.get(rid)
        return list(kept.events) if kept is not None else []

    def gaps(self, rid: str) -> list[Gap]:
        """What the history left out of request ``rid``'s events, one Gap per kind."""
        kept = self._by_rid.get(rid)
        return list(kept.gaps.values()) if kept is not None else []


@dataclass
class Gap:
    """A request's events of one kind that its history left out: those between its
    first and its last KEPT_PER_KIND of the kind (explain says so at their place)."""

    kind: str
    count: int = 0
    iteration: int = -1  # the earliest left out
    last_iteration: int = -1  # the latest left out
    held_rounds: Counter[str] = field(default_factory=Counter)  # ReqHeld: their rounds by budget


@dataclass
class _Kept:
    """One request's kept events, in arrival order, and what was left out."""

    events: list[ev.Event] = field(default_factory=list)
    seen: Counter[type[ev.Event]] = field(default_factory=Counter)  # events received, by kind
    gaps: dict[str, Gap] = field(default_factory=dict)  # kind name -> what was left out
    open_hold: ev.ReqHeld | None = None  # the latest ReqHeld, before the request's next event
    hold_ends: dict[int, int] = field(default_factory=dict)  # id(kept ReqHeld) -> next event's iteration

    def leave_out(self, kind: type[ev.Event]) -> None:
        """Move the oldest of the kind's last KEPT_PER_KIND (its KEPT_PER_KIND-th kept
        event, 0-based) into the kind's Gap."""
        nth = -1
        for i, e in enumerate(self.events):
            nth += type(e) is kind
            if nth == KEPT_PER_KIND:
                break
        old = self.events.pop(i)
        gap = self.gaps.get(kind.__name__)
        if gap is None:
            gap = self.gaps[kind.__name__] = Gap(kind.__name__, iteration=old.iteration)
        gap.count += 1
        gap.iteration = min(gap.iteration, old.iteration)
        gap.last_iteration = max(gap.last_iteration, old.iteration)
        if isinstance(old, ev.ReqHeld):
            # a newer ReqHeld came, so the request's next event after this one did too
            end = self.hold_ends.pop(id(old), old.iteration + 1)
            gap.held_rounds[old.budget] += end - old.iteration


def slim_arrival(e: ev.ReqArrived) -> ev.ReqArrived:
    """The arrival as the history keeps it: explain prints its prompt_tokens and
    max_new_tokens; the prompt's ids go, and each sampling parameter that is not a
    number, a flag or None becomes its size (a 4096-entry stop_token_ids: '<list of 4096>')."""
    return dataclasses.replace(e, input_ids=(), sampling_params={k: _summary(v) for k, v in e.sampling_params.items()})


def slim_batch(e: ev.BatchPlanned) -> ev.BatchPlanned:
    """A prefill batch as the history keeps it: explain reads its rids, extend_lens and
    num_rows; the per-row out_cache_loc (a long prompt's length) and the lens go."""
    return dataclasses.replace(e, seq_lens=(), prefix_lens=(), out_cache_loc=())


def _summary(value: Any) -> Any:
    """A sampling parameter as the history keeps it: a scalar as is, anything else its size."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (str, bytes)):
        return f"<{len(value)} chars>"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


def explain(events: list[ev.Event], rid: str, gaps: Iterable[Gap] = ()) -> str:
    """The history of request ``rid`` from ``events`` (any stream; other requests' and
    other kinds are skipped) and the ``gaps`` a RequestHistory left in it. Raises
    KeyError when the stream holds nothing of it."""
    mine = _events_of(events, rid)
    if not mine:
        raise KeyError(f"no request {rid!r} in this history (an unknown rid, or one older than the history)")
    gaps = list(gaps)
    # a gap stands where its first left-out event stood: a hold before it ends there
    items: list[ev.Event | Gap] = sorted([*mine, *gaps], key=lambda e: e.iteration)
    lines: list[str] = []
    held_rounds: Counter[str] = Counter()
    admitted = False  # a ReqAdmitted while admitted is the next chunk of its prompt
    planned: dict[int, ev.BatchPlanned] = {}
    recompute_ms, retracted = 0.0, False  # (a request's first retraction is always kept)
    for i, e in enumerate(items):
        until = items[i + 1].iteration if i + 1 < len(items) else None
        if isinstance(e, Gap):
            held_rounds.update(e.held_rounds)
            lines.append(f"iterations {e.iteration}-{e.last_iteration}: {e.count} more {e.kind} events not kept "
                         f"(the history keeps a request's first and last {KEPT_PER_KIND} of each kind)")
            continue
        if isinstance(e, ev.BatchPlanned):
            planned[e.bid] = e
            continue
        if isinstance(e, ev.ForwardFinished):
            line, share = _forward_line(e, planned.get(e.bid), rid)
            lines.append(line)
            recompute_ms += share if retracted else 0.0
            continue
        retracted = retracted or isinstance(e, ev.ReqRetracted)
        if isinstance(e, ev.CacheMatched) and not e.reason:
            continue  # a next chunk: its prefix is its own earlier chunks
        if isinstance(e, ev.ReqAdmitted) and admitted:
            lines.append(f"iteration {e.iteration}: next chunk, {e.prefix_len} tokens computed + {e.extend_len} to prefill")
        else:
            lines.append(_describe(e, until, held_rounds))
        admitted = isinstance(e, (ev.ReqAdmitted, ev.ReqChunked)) or (admitted and not isinstance(e, ev.ReqRetracted))
    lines += _summary_lines(mine, {g.kind for g in gaps}, retracted, recompute_ms, held_rounds)
    return f"{rid}\n" + "\n".join("  " + ln for ln in lines)


def _summary_lines(mine: list[ev.Event], gap_kinds: set[str], retracted: bool, recompute_ms: float,
                   held_rounds: Counter[str]) -> list[str]:
    """The totals after the request's lines; "of those kept" where a Gap left some out."""
    lines = []
    matches = [e for e in mine if isinstance(e, ev.CacheMatched) and e.reason]
    if len(matches) > 1:
        kept = " kept" if "CacheMatched" in gap_kinds else ""
        lines.append(f"the radix cache served {sum(e.matched_len for e in matches)} of "
                     f"{sum(e.key_len for e in matches)} tokens over its {len(matches)} admissions{kept}")
    if retracted:
        at_least = "at least " if "ForwardFinished" in gap_kinds else ""
        lines.append(f"recomputing what its retractions dropped took {at_least}~{recompute_ms:.1f} ms of prefill "
                     "forwards (its rows' share)")
    if held_rounds:
        parts = ", ".join(f"{b} {n}" for b, n in held_rounds.most_common())
        lines.append(f"held {sum(held_rounds.values())} rounds in all, by budget: {parts}")
    return lines


def _events_of(events: list[ev.Event], rid: str) -> list[ev.Event]:
    """The request's lifecycle events and the prefill batches it was in (BatchPlanned
    and the batch's ForwardFinished)."""
    mine: list[ev.Event] = []
    bids: set[int] = set()
    for e in events:
        if isinstance(e, ev.BatchPlanned):
            if e.forward_mode != "DECODE" and rid in e.rids:
                bids.add(e.bid)
                mine.append(e)
        elif isinstance(e, ev.ForwardFinished):
            if e.bid in bids:
                mine.append(e)
        elif isinstance(e, LIFECYCLE) and getattr(e, "rid", None) == rid:
            mine.append(e)
    # in iteration order: the overlap loop reports a forward one iteration after it launched
    return sorted(mine, key=lambda e: e.iteration)


def _forward_line(e: ev.ForwardFinished, plan: ev.BatchPlanned | None, rid: str) -> tuple[str, float]:
    """A prefill forward the request was in, and its rows' share of the time (ms)."""
    ms = e.duration * 1000
    if plan is None or rid not in plan.rids or not plan.num_rows:
        return f"iteration {e.iteration}: forward #{e.bid} ({e.forward_mode}) took {ms:.1f} ms", 0.0
    rows = plan.extend_lens[plan.rids.index(rid)]
    share = ms * rows / plan.num_rows
    return (f"iteration {e.iteration}: forward #{e.bid} ({e.forward_mode}, {_rows(plan.num_rows)}) took {ms:.1f} ms; "
            f"its {_rows(rows)} ~{share:.1f} ms"), share


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _describe(e: ev.Event, until: int | None, held_rounds: Counter[str]) -> str:
    """One line for one event; ``until``: the iteration of the request's next event."""
    at = f"iteration {e.iteration}"
    if isinstance(e, ev.ReqArrived):
        return f"{at}: arrived, {e.prompt_tokens} prompt tokens, max_new_tokens {e.max_new_tokens}"
    if isinstance(e, ev.GrammarQueued):
        return f"{at}: its {e.kind} grammar is not compiled yet: it waits in the grammar_queue while a thread compiles it"
    if isinstance(e, ev.GrammarReady):
        return (f"{at}: waited {e.waited_iterations} iterations ({e.waited_s * 1000:.0f} ms) for its grammar to "
                "compile, then joined the waiting_queue")
    if isinstance(e, ev.ReqHeld):
        rounds = (until - e.iteration) if until is not None else 1
        held_rounds[e.budget] += rounds
        span = at if rounds <= 1 else f"iterations {e.iteration}-{e.iteration + rounds - 1} ({rounds} rounds)"
        numbers = f": needs {e.need}, has {e.have}" if e.need else ""
        return f"{span}: held by {BUDGET_WORDS.get(e.budget, e.budget)}{numbers}; {e.detail}"
    if isinstance(e, ev.CacheMatched):
        return f"{at}: radix cache: {e.matched_len} of {e.key_len} tokens cached; computed: {e.reason}"
    if isinstance(e, ev.ReqAdmitted):
        chunked = ", the first chunk of its prompt" if e.chunked else ""
        return f"{at}: admitted, {e.prefix_len} tokens from the cache + {e.extend_len} to prefill{chunked}"
    if isinstance(e, ev.ReqChunked):
        return f"{at}: chunk {e.chunk_index + 1} prefilled, {e.computed_len}/{e.total_len} tokens"
    if isinstance(e, ev.ReqRetracted):
        rule = RETRACT_RULE if e.reason == POOL_FULL else ""
        return (f"{at}: retracted ({e.reason}{rule}) after {e.output_tokens} output tokens: "
                f"{e.kept_tokens} tokens stay in the radix cache, {e.recompute_tokens} to prefill again; "
                f"new_token_ratio {e.old_new_token_ratio:.3f} -> {e.new_token_ratio:.3f}")
    if isinstance(e, ev.ReqAborted):
        return f"{at}: aborted: {e.reason}"
    assert isinstance(e, ev.ReqFinished)
    close = ""
    if e.closest_call is not None:
        index, best, best_lp, second, second_lp = e.closest_call
        close = (f"; its closest call was output token {index}: {best} (logprob {best_lp:.4f}) over {second} "
                 f"({second_lp:.4f}), margin {best_lp - second_lp:.4f}")
    if e.grammar_refused is not None:
        refused, steps = e.grammar_refused
        close += f"; its grammar refused the model's first choice at {refused} of {steps} output tokens"
    return (f"{at}: finished ({e.reason}), {e.completion_tokens} output tokens, "
            f"{e.cached_tokens} of {e.prompt_tokens} prompt tokens from the cache{close}")
