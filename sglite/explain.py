"""A request's history in words and numbers, read from the event stream: when it
arrived, which budget held it in the waiting_queue and for how many rounds, when it was
admitted (cache hit, chunking), retracted and finished. ``Engine.explain(rid)`` and a
server's ``/explain`` read the events the scheduler's RequestHistory kept
(SchedulerObserver.history); ``explain`` also reads a recording (``--record``).
docs/why.md lists every budget a request can wait on."""

from __future__ import annotations

from collections import Counter, OrderedDict

from sglite import events as ev
from sglite.managers.schedule_batch import RETRACT_DECODE_STEPS

# the events that make up one request's history
LIFECYCLE: tuple[type[ev.Event], ...] = (ev.ReqArrived, ev.ReqHeld, ev.CacheMatched, ev.ReqAdmitted, ev.ReqChunked,
                                         ev.ReqRetracted, ev.ReqAborted, ev.ReqFinished)
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


class RequestHistory:
    """Subscriber (kinds=LIFECYCLE + BATCHES) keeping the lifecycle events of the last
    ``keep`` requests, and the prefill batches each was in; the oldest request's
    history goes first."""

    def __init__(self, keep: int = 10_000):
        self.keep = keep
        self._by_rid: OrderedDict[str, list[ev.Event]] = OrderedDict()
        self._batch_rids: OrderedDict[int, list[str]] = OrderedDict()  # bid -> its requests we keep

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.BatchPlanned):
            if event.forward_mode != "DECODE":
                self._batch_rids[event.bid] = rids = [r for r in event.rids if r in self._by_rid]
                if len(self._batch_rids) > BATCHES_KEPT:
                    self._batch_rids.popitem(last=False)
                for r in rids:
                    self._by_rid[r].append(event)
            return
        if isinstance(event, ev.ForwardFinished):
            for r in self._batch_rids.pop(event.bid, ()):
                if r in self._by_rid:
                    self._by_rid[r].append(event)
            return
        rid = getattr(event, "rid", "")
        if isinstance(event, ev.ReqArrived):
            self._by_rid.pop(rid, None)  # a reused rid: a new request, a new history
        if rid not in self._by_rid:
            if len(self._by_rid) >= self.keep:
                self._by_rid.popitem(last=False)
            self._by_rid[rid] = []
        self._by_rid[rid].append(event)

    def events(self, rid: str) -> list[ev.Event]:
        return list(self._by_rid.get(rid, ()))


def explain(events: list[ev.Event], rid: str) -> str:
    """The history of request ``rid`` from ``events`` (any stream; other requests' and
    other kinds are skipped). Raises KeyError when the stream holds nothing of it."""
    mine = _events_of(events, rid)
    if not mine:
        raise KeyError(f"no request {rid!r} in this history (an unknown rid, or one older than the history)")
    lines: list[str] = []
    held_rounds: Counter[str] = Counter()
    admitted = False  # a ReqAdmitted while admitted is the next chunk of its prompt
    planned: dict[int, ev.BatchPlanned] = {}
    recompute_ms, retracted = 0.0, False
    for i, e in enumerate(mine):
        until = mine[i + 1].iteration if i + 1 < len(mine) else None
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
    matches = [e for e in mine if isinstance(e, ev.CacheMatched) and e.reason]
    if len(matches) > 1:
        lines.append(f"the radix cache served {sum(e.matched_len for e in matches)} of "
                     f"{sum(e.key_len for e in matches)} tokens over its {len(matches)} admissions")
    if retracted:
        lines.append(f"recomputing what its retractions dropped took ~{recompute_ms:.1f} ms of prefill forwards "
                     "(its rows' share)")
    if held_rounds:
        parts = ", ".join(f"{b} {n}" for b, n in held_rounds.most_common())
        lines.append(f"held {sum(held_rounds.values())} rounds in all, by budget: {parts}")
    return f"{rid}\n" + "\n".join("  " + ln for ln in lines)


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
    return (f"iteration {e.iteration}: forward #{e.bid} ({e.forward_mode}, {plan.num_rows} rows) took {ms:.1f} ms; "
            f"its {rows} rows ~{share:.1f} ms"), share


def _describe(e: ev.Event, until: int | None, held_rounds: Counter[str]) -> str:
    """One line for one event; ``until``: the iteration of the request's next event."""
    at = f"iteration {e.iteration}"
    if isinstance(e, ev.ReqArrived):
        return f"{at}: arrived, {e.prompt_tokens} prompt tokens, max_new_tokens {e.max_new_tokens}"
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
    return (f"{at}: finished ({e.reason}), {e.completion_tokens} output tokens, "
            f"{e.cached_tokens} of {e.prompt_tokens} prompt tokens from the cache")
