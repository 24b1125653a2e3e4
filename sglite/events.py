"""Typed events: the one stream that viewers (tracing, TUI, recorder, walkthroughs) read.

The engine core emits; it never imports a viewer. ``EventBus.emit`` is a single branch
when nobody subscribed, so an unwatched engine pays almost nothing. Call sites that
would build an expensive payload check ``bus.active`` first.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, NamedTuple

Subscriber = Callable[["Event"], None]
EVENT_TYPES: dict[str, type["Event"]] = {}


@dataclass(frozen=True)
class Event:
    """Base: every event carries a monotonic timestamp (seconds) and the iteration."""

    kind: ClassVar[str] = "Event"
    iteration: int = -1
    ts: float = field(default_factory=time.monotonic)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.kind = cls.__name__
        EVENT_TYPES[cls.__name__] = cls

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        d["kind"] = self.kind
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if hasattr(v, "value") and hasattr(v, "name"):  # enums
        return v.name
    return v


def event_from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    cls = EVENT_TYPES[d.pop("kind")]
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: _tuples(v) for k, v in d.items() if k in names}
    return cls(**kwargs)


def _tuples(v: Any) -> Any:
    """JSON arrays back into the tuples the events hold (nested ones too)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def load_events(path: str) -> Iterator[Event]:
    """Read a recording written by ``EventRecorder``."""
    with open(path) as f:
        for line in f:
            if line.strip():
                yield event_from_dict(json.loads(line))


class EventBus:
    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._snapshot_subscribers: list[Subscriber] = []
        self._by_kind: dict[type[Event], list[Subscriber]] = {}  # subscribers of some kinds only
        self.active = False  # someone takes every event: build even the costly ones
        self.wants_snapshots = False  # build a SchedulerSnapshot each iteration
        self.iteration = 0

    def subscribe(self, fn: Subscriber, snapshots: bool = False,
                  kinds: tuple[type[Event], ...] | None = None) -> Callable[[], None]:
        """``snapshots``: this subscriber shows state (the TUI, a recording to replay),
        so the scheduler also emits a SchedulerSnapshot after every iteration.
        ``kinds``: only these event classes (the bus stays inactive for the rest)."""
        for group in ([self._subscribers] if kinds is None else
                      [self._by_kind.setdefault(k, []) for k in kinds]):
            group.append(fn)
        if snapshots:
            self._snapshot_subscribers.append(fn)
        self._update()

        def unsubscribe() -> None:
            for group in (self._subscribers, self._snapshot_subscribers, *self._by_kind.values()):
                if fn in group:
                    group.remove(fn)
            self._update()

        return unsubscribe

    def _update(self) -> None:
        self.active = bool(self._subscribers)
        self.wants_snapshots = bool(self._snapshot_subscribers)

    def emit(self, event_cls: type["Event"], **fields: Any) -> None:
        """``iteration`` defaults to the current one; ``ts`` to now."""
        if not self.active and not self._by_kind.get(event_cls):
            return
        fields.setdefault("iteration", self.iteration)
        self.publish(event_cls(**fields))

    def wants(self, event_cls: type["Event"]) -> bool:
        """Does any subscriber take this kind? (Check before building a costly event.)"""
        return self.active or bool(self._by_kind.get(event_cls))

    def publish(self, event: "Event") -> None:
        """Hand a built event to every subscriber that takes its kind."""
        for fn in tuple(self._subscribers) + tuple(self._by_kind.get(type(event), ())):
            fn(event)


class EventRecorder:
    """Subscriber writing one JSON object per line (``--record PATH``). ``header``: an
    event written first (RecordingStarted: what `sglite replay --rerun` needs)."""

    def __init__(self, path: str, header: "Event | None" = None):
        self._f = open(path, "w")
        if header is not None:
            self(header)

    def __call__(self, event: Event) -> None:
        self._f.write(event.to_json() + "\n")

    def close(self) -> None:
        self._f.close()


class EventLog:
    """Subscriber keeping events in memory (tests, walkthroughs)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, *kinds: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, kinds)]


# --- requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordingStarted(Event):
    """The first line of a recording: the engine's server arguments, so that
    `sglite replay --rerun` can build the same engine."""

    server_args: dict[str, Any] = field(default_factory=dict)
    version: str = ""


@dataclass(frozen=True)
class ReqArrived(Event):
    rid: str = ""
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False  # decodes past the model's end of turn (SamplingParams.ignore_eos)
    trace_parent: str = ""  # W3C traceparent the request's spans continue (sglite serve), "" for none
    # what `sglite replay --rerun` submits again: the prompt's token ids and the sampling
    # parameters as the scheduler ran them (seed included)
    input_ids: tuple[int, ...] = ()
    sampling_params: dict[str, Any] = field(default_factory=dict)
    # its cache key (SGLang's extra_key, cache_salt), None for the shared tree; absent
    # from older recordings, which load with None
    extra_key: str | None = None


@dataclass(frozen=True)
class ReqAdmitted(Event):
    rid: str = ""
    prefix_len: int = 0
    extend_len: int = 0
    chunked: bool = False


@dataclass(frozen=True)
class ReqHeld(Event):
    """Admission left a waiting request in the queue, and why (PrefillAdder's budgets,
    docs/why.md): emitted when the reason changes, not every round it holds."""

    rid: str = ""
    budget: str = ""  # rem_total_tokens, rem_input_tokens, rem_chunk_tokens, max_running_requests,
    #                   in_batch_prefix, not_reached, failed_round_trial
    need: int = 0
    have: int = 0
    detail: str = ""


@dataclass(frozen=True)
class ReqChunked(Event):
    rid: str = ""
    chunk_index: int = 0
    computed_len: int = 0
    total_len: int = 0


@dataclass(frozen=True)
class ReqRetracted(Event):
    rid: str = ""
    reason: str = ""
    old_new_token_ratio: float = 0.0
    new_token_ratio: float = 0.0
    output_tokens: int = 0
    kept_tokens: int = 0  # of its sequence, left in the radix cache (hit again unless evicted first)
    recompute_tokens: int = 0  # the rest, prefilled again on re-admission


@dataclass(frozen=True)
class ReqAborted(Event):
    rid: str = ""
    reason: str = ""
    by_client: bool = False  # an AbortReq (a client, Engine.abort): `sglite replay --rerun` sends it again


@dataclass(frozen=True)
class ReqFinished(Event):
    rid: str = ""
    reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # a request that asked for top logprobs (2 or more): its nearest tie, the output
    # token whose top-2 margin was smallest: (index, chosen id, its logprob, runner-up
    # id, its logprob); None otherwise
    closest_call: tuple[int, int, float, int, float] | None = None
    # a request with a grammar: (output tokens whose unmasked argmax the mask refused,
    # output tokens sampled under its mask); None otherwise
    grammar_refused: tuple[int, int] | None = None


@dataclass(frozen=True)
class TokenLogprobs(Event):
    """One output token of a request that asked for logprobs: its logprob and its top
    tokens (id, logprob), best first (the TUI's request detail shows them)."""

    rid: str = ""
    index: int = 0  # its place in the output
    token_id: int = 0
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GrammarQueued(Event):
    """A request's grammar (json_schema, regex, ebnf, structural_tag) is not compiled
    yet: it waits in the grammar_queue while a pool thread compiles it."""

    rid: str = ""
    kind: str = ""  # SGLang's dispatch type: json, regex, ebnf, structural_tag


@dataclass(frozen=True)
class GrammarReady(Event):
    """A queued request's grammar compiled: it moves to the waiting_queue
    (move_ready_grammar_requests)."""

    rid: str = ""
    kind: str = ""
    waited_iterations: int = 0  # scheduler iterations it spent in the grammar_queue
    waited_s: float = 0.0


@dataclass(frozen=True)
class GrammarMasked(Event):
    """One output token of a request with a grammar: what the vocabulary mask did."""

    rid: str = ""
    index: int = 0  # the token's place in the output
    allowed: int = 0  # tokens the grammar allowed at this step
    preferred: int = 0  # the model's own choice: argmax of the logits before the mask
    refused: bool = False  # the mask refused it
    token_id: int = 0  # the token sampled (after the mask)


@dataclass(frozen=True)
class TokensEmitted(Event):
    rid: str = ""
    token_ids: tuple[int, ...] = ()
    text: str = ""


# --- batches --------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchPlanned(Event):
    bid: int = 0  # batch id: Scheduler.forward_ct, 1 for the first forward
    forward_mode: str = ""
    rids: tuple[str, ...] = ()
    seq_lens: tuple[int, ...] = ()
    prefix_lens: tuple[int, ...] = ()
    extend_lens: tuple[int, ...] = ()
    out_cache_loc: tuple[int, ...] = ()
    num_rows: int = 0


@dataclass(frozen=True)
class AdmissionStopped(Event):
    reason: str = ""  # NO_TOKEN, OTHER, MAX_RUNNING_REQUESTS, EMPTY_QUEUE, ...
    waiting: int = 0
    rem_total_tokens: int = 0
    rem_input_tokens: int = 0


@dataclass(frozen=True)
class ForwardStarted(Event):
    """In the overlap loop both forward events are emitted when the scheduler collects
    the result, with ``ts`` set to when the worker really started / finished and
    ``iteration`` to the iteration that launched the batch."""

    bid: int = 0
    forward_mode: str = ""
    batch_size: int = 0
    num_tokens: int = 0
    backend: str = ""


@dataclass(frozen=True)
class ForwardFinished(Event):
    """``tp_timings``: with --tp-size N, per rank (rank order) the seconds of its forward
    and of the all-reduces / all-gathers in it (ModelRunner.last_tp_timings)."""

    bid: int = 0
    forward_mode: str = ""
    batch_size: int = 0
    num_tokens: int = 0
    backend: str = ""
    duration: float = 0.0
    tp_timings: tuple[tuple[float, float], ...] = ()


# --- cache ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheMatched(Event):
    """An admission's prefix match, and why the rest of the prompt was computed
    (sglite/mem_cache/cache_miss.py; left at the defaults for a chunked request's next
    chunk, whose prefix is its own earlier chunks)."""

    rid: str = ""
    matched_len: int = 0
    key_len: int = 0
    evicted_len: int = 0  # computed because eviction took them
    evicted_at: int = 0  # the iteration of that eviction
    page_tail: int = 0  # a last partial page (the tree matches whole pages)
    diverged_at: int = -1  # the cache held the first k tokens and nothing continuing them
    rest_len: int = 0  # computed: past token k, or new
    reason: str = ""  # all of it in words ("" for a next chunk)


@dataclass(frozen=True)
class CacheInserted(Event):
    rid: str = ""
    inserted_len: int = 0
    already_cached_len: int = 0


@dataclass(frozen=True)
class CacheEvicted(Event):
    num_tokens: int = 0
    num_nodes: int = 0


class WaitingRow(NamedTuple):
    """A request in the waiting_queue, in queue order; then those in the grammar_queue
    (held "grammar": their grammar still compiles)."""

    rid: str
    prompt_tokens: int
    prefix_len: int  # cached prefix matched at the last admission attempt
    held: str = ""  # the budget that held it at the last admission round (ReqHeld.budget)


class RunningRow(NamedTuple):
    """A request past admission and not finished."""

    rid: str
    seq_len: int
    output_tokens: int
    max_new_tokens: int


class TreeNodeRow(NamedTuple):
    """One radix-tree node (RadixCache.snapshot)."""

    id: int
    parent_id: int  # -1 for the root
    key_len: int
    key_head: tuple[int, ...]  # its first tokens
    lock_ref: int
    access_seq: int  # rank in LRU order: 0 is evicted first (of the unlocked leaves)
    hit_count: int
    key_text: str = ""  # key_head decoded (the scheduler's tokenizer; "" without one)


@dataclass(frozen=True)
class SchedulerSnapshot(Event):
    """What the scheduler holds after an iteration, for viewers that show state rather
    than changes (the TUI, a recording to replay). Emitted just before
    IterationFinished, only when a subscriber asked for it."""

    waiting: tuple[WaitingRow, ...] = ()
    running: tuple[RunningRow, ...] = ()
    chunked_rid: str = ""
    pool_total: int = 0
    pool_free: int = 0
    pool_evictable: int = 0
    tree: tuple[TreeNodeRow, ...] | None = None  # None when unchanged since the previous snapshot
    matched_node: int = 0  # where the last prefix match ended (its path is highlighted)
    policy: str = ""
    overlap: bool = False

    def __post_init__(self) -> None:
        # a recording read back from JSON holds plain tuples: make them rows again
        set_ = object.__setattr__
        set_(self, "waiting", tuple(WaitingRow(*r) for r in self.waiting))
        set_(self, "running", tuple(RunningRow(*r) for r in self.running))
        if self.tree is not None:
            set_(self, "tree", tuple(TreeNodeRow(n[0], n[1], n[2], tuple(n[3]), *n[4:]) for n in self.tree))


@dataclass(frozen=True)
class IterationFinished(Event):
    """End of one scheduler iteration, with when each of its phases ended (monotonic
    seconds): started -> scheduled (get_next_batch_to_run) -> forwarded (run_batch)
    -> ts (process_batch_result). ``bid`` is the batch planned and launched in this
    iteration (0: idle), ``processed_bid`` the batch whose results were processed: the
    same one in the normal loop, the previous one in the overlap loop."""

    started: float = 0.0
    scheduled: float = 0.0
    forwarded: float = 0.0
    resolved: float = 0.0  # overlap: when the processed batch's tokens were back (waited from forwarded)
    bid: int = 0
    processed_bid: int = 0
    forward_mode: str = ""  # of batch ``bid``; "" when none was launched
    rids: tuple[str, ...] = ()
    num_waiting: int = 0
    num_running: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    new_token_ratio: float = 0.0
