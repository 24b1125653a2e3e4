"""Engine: the in-process API, mirroring SGLang's offline engine (SGLang: entrypoints/engine.py).

``generate`` drives the scheduler until its requests finish; ``submit`` + ``step`` run
exactly one scheduler iteration at a time, for the TUI, the walkthroughs and tests.
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from sglite.distributed.parallel_state import TpRankDiedError, destroy_model_parallel, set_rank_watch
from sglite.events import EventBus
from sglite.managers.detokenizer_manager import DetokenizerManager
from sglite.managers.io_struct import AbortReq, BatchStrOut, BatchTokenIDOut, LogprobParams
from sglite.managers.scheduler import Scheduler
from sglite.managers.tokenizer_manager import LogprobOutput, TokenizerManager, check_rid, logprob_params_each
from sglite.server_args import DEFAULT_MODEL, ServerArgs

Prompt = str | list[str] | None
MAX_KEPT_RESULTS = 4096  # finished results that submit() callers have not read


@dataclass
class ReqState:
    """What the Engine has collected of one request (SGLang's TokenizerManager keeps a
    ReqState per rid too). Outputs are routed here by rid, whichever caller's step()
    produced them, so streams and generate calls can interleave."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    waiter: bool = False  # a generate() or stream will read it, then drop it
    pending: deque[BatchStrOut] = field(default_factory=deque)  # a stream's unread outputs
    stream: bool = False
    logprob: LogprobOutput | None = None  # return_logprob: what came of it

    def add(self, out: BatchStrOut) -> None:
        self.text += out.new_text
        self.output_ids += out.new_token_ids
        if self.logprob is not None:
            self.logprob.add(out.logprobs)
        if out.finished:
            self.finished, self.meta_info = True, out.meta_info
        if self.stream:
            self.pending.append(out)

    def to_dict(self) -> dict[str, Any]:
        """The result as ``generate`` returns it (plus ``error`` for a rejected request)."""
        meta = dict(self.meta_info, **(self.logprob.meta_info() if self.logprob is not None else {}))
        out = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        if "error" in self.meta_info:
            out["error"] = self.meta_info["error"]
        return out


class Engine:
    def __init__(self, model_path: str = DEFAULT_MODEL, event_bus: EventBus | None = None, **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        setup_logging(self.server_args.log_level)
        self.event_bus = event_bus or EventBus()
        self._tp_followers = self._start_tp_ranks()  # tp > 1: ranks 1..N-1 of this machine
        self._tp_failed = False  # a rank died: no forward can run any more
        try:
            self.scheduler = Scheduler(self.server_args, event_bus=self.event_bus)
        except BaseException:
            self._tp_failed = True
            self._stop_tp_ranks()
            raise
        finally:
            set_rank_watch(None)
        self.history = self.scheduler.observer.history  # the lifecycle events explain() reads
        self.tokenizer = self.scheduler.tokenizer
        s = self.scheduler
        self.tokenizer_manager = TokenizerManager(self.tokenizer, s.model_config.vocab_size, s.max_req_input_len,
                                                  s.tp_worker.model_runner.context_len, s.max_total_num_tokens,
                                                  self.server_args.grammar_backend)
        # in-process here; its own process under `sglite serve`
        self.detokenizer = DetokenizerManager(self.tokenizer, self.event_bus)
        self.scheduler.send_to_detokenizer = self._detokenize
        self._event_loop = self.scheduler.event_loop()
        self._outputs: list[BatchStrOut] = []  # this iteration's, from the detokenizer
        self._rid_counter = itertools.count()
        self._results: dict[str, ReqState] = {}
        self._lock = threading.RLock()
        # streams dropped unread: garbage collection hands their (rids, states) over here
        # (deque.append takes no lock); whoever holds the lock next releases them
        self._dropped: deque[tuple[list[str], list[ReqState]]] = deque()
        self._unsent_aborts: list[str] = []  # released by a finalizer, which sends nothing
        # rid -> released unfinished requests still to send their last output: the rid may
        # be claimed again, and what they send must not reach the new request (an abort is
        # queued before any later request of the rid, and answered at once: see step())
        self._stale: Counter[str] = Counter()
        self._froze_gc = False  # freeze_gc was called: shutdown gives the heap back

    def _start_tp_ranks(self) -> list[Any]:
        """--tp-size N: this process is rank 0 (it schedules); the others start here."""
        from sglite.managers.tp_worker import describe_dead_followers, launch_tp_followers, set_dist_init_addr

        if self.server_args.tp_size == 1:
            return []
        if self.server_args.node_rank != 0:
            raise ValueError("an Engine is tp rank 0 (--node-rank 0); start the other nodes' ranks with "
                             "`sglite serve --node-rank N`")
        set_dist_init_addr(self.server_args)
        followers = launch_tp_followers(self.server_args)
        set_rank_watch(lambda: describe_dead_followers(followers))  # while rank 0 waits for them to start
        return followers

    def _stop_tp_ranks(self) -> None:
        from sglite.managers.tp_worker import stop_tp_followers

        if self._tp_followers:
            if hasattr(self, "scheduler"):  # (a runner that failed to build has left already)
                self.scheduler.tp_worker.model_runner.leave_group()
            destroy_model_parallel()
            stop_tp_followers(self._tp_followers, timeout=0 if self._tp_failed else 10)
            self._tp_followers = []

    def _rank_died(self, e: TpRankDiedError) -> TpRankDiedError:
        """The engine's error when a tp rank stops: which one and how."""
        from sglite.managers.tp_worker import describe_dead_followers

        self._tp_failed = True
        deadline = time.monotonic() + 2.0  # its socket closes before the process is reaped
        while not describe_dead_followers(self._tp_followers) and time.monotonic() < deadline:
            time.sleep(0.05)
        who = describe_dead_followers(self._tp_followers)
        return TpRankDiedError(f"the tensor-parallel engine cannot go on: {who}. ({e})" if who else
                               f"the tensor-parallel engine cannot go on: {e}")

    # --- requests ---------------------------------------------------------------------

    def submit(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               messages: list[dict] | None = None, sampling_params: dict[str, Any] | None = None,
               rid: str | None = None, stream: bool = False, extra_key: str | None = None,
               logprob: LogprobParams | None = None, _waiter: bool = False) -> str:
        """Queue one request for the next iteration; returns its rid. Raises ValueError
        for a rid already in use; any other bad input comes back as the request's error.
        ``extra_key`` (SGLang's name; OpenAI's cache_salt): the request shares cached
        prefixes only with requests of the same key. ``logprob``: SGLang's logprob fields
        (their results come in meta_info)."""
        with self._lock:
            rid = self._claim_rid(rid, stream, _waiter)
            if logprob is not None and logprob.return_logprob:
                self._results[rid].logprob = LogprobOutput(logprob, self.tokenizer_manager.tokenizer)
        self.scheduler.send(self.tokenizer_manager.tokenize(rid, prompt, input_ids, messages, sampling_params, stream,
                                                            extra_key=extra_key, logprob=logprob))
        return rid

    def _claim_rid(self, rid: Any, stream: bool, waiter: bool) -> str:
        """A fresh rid, or the caller's if no unfinished request (or unread result) has it."""
        self._release_dropped()  # a dropped stream's abort goes before a new request of its rid
        if rid is None:
            rid = f"r{next(self._rid_counter)}"
            while rid in self._results:
                rid = f"r{next(self._rid_counter)}"
        check_rid(rid)  # (a RequestError is a ValueError)
        old = self._results.get(rid)
        if old is not None and (not old.finished or old.waiter):
            raise ValueError(f"Duplicate request ID detected: {rid!r} is already in use by an unfinished request")
        self._results.pop(rid, None)
        self._results[rid] = ReqState(waiter=waiter, stream=stream)
        self._forget_old_results()
        return rid

    def _forget_old_results(self) -> None:
        """submit() callers may never read a result: keep the newest MAX_KEPT_RESULTS."""
        excess = len(self._results) - MAX_KEPT_RESULTS
        for rid in [r for r, st in self._results.items() if st.finished and not st.waiter][:max(0, excess)]:
            del self._results[rid]

    def step(self) -> list[BatchStrOut]:
        """Run exactly one scheduler iteration; what the requests produced in it."""
        with self._lock:
            if self._tp_failed:
                raise TpRankDiedError("the tensor-parallel engine stopped after a rank died; start a new one")
            self._release_dropped()
            try:
                next(self._event_loop)
            except TpRankDiedError as e:
                raise self._rank_died(e) from e
            except BaseException:
                self._event_loop = self.scheduler.event_loop()  # the failed one is closed
                raise
            outputs, self._outputs = self._outputs, []
            for out in outputs:
                if out.rid in self._stale:  # a released request's: its rid may be in use again
                    if out.finished:
                        self._stale[out.rid] -= 1
                        if not self._stale[out.rid]:
                            del self._stale[out.rid]
                    continue
                state = self._results.get(out.rid)
                if state is not None:  # None: its caller stopped reading and dropped it
                    state.add(out)
            if self._stale and not self.scheduler.has_work():
                self._stale.clear()  # nothing runs: no released request has anything left to send
            return outputs

    def _detokenize(self, out: BatchTokenIDOut) -> None:
        self._outputs.append(self.detokenizer.handle_batch_token_id_out(out))

    def result(self, rid: str) -> dict[str, Any]:
        return self._results[rid].to_dict()

    def is_finished(self, rid: str) -> bool:
        return self._results[rid].finished

    def explain(self, rid: str) -> str:
        """Request ``rid``'s history in words and numbers: which budget held it in the
        waiting_queue and for how many rounds, its cache hit, chunks, retractions, finish
        (docs/why.md). Raises KeyError for a rid this engine has not seen (or forgot:
        it keeps the last 10,000, fewer when their histories are long; RequestHistory)."""
        with self._lock:
            out = self.scheduler.observer.explain(rid)
        if out.error:
            raise KeyError(out.error)
        return out.text

    # --- generate ---------------------------------------------------------------------

    def generate(self, prompt: Prompt = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, messages: list | None = None,
                 stream: bool = False, rid: str | list[str] | None = None,
                 extra_key: str | list[str | None] | None = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] | None = None, top_logprobs_num: int | list[int] | None = None,
                 token_ids_logprob: list[int] | list[list[int]] | None = None,
                 return_text_in_logprobs: bool = False) -> Any:
        """Returns a dict (or a list of dicts for a batch) with text, output_ids and
        meta_info; with stream=True, a GenerateStream of increments. A batch is a list of
        prompts, of input_ids lists, or of chats (lists of messages); sampling_params,
        rid and extra_key (see submit) are one for all of it or a list of one per prompt.
        The logprob fields are SGLang's (one for all, or a list of one per prompt); their
        results come in meta_info (docs/serving.md, "Logprobs")."""
        reqs, is_batch = _split_batch(prompt, input_ids, messages)
        n = len(reqs)
        logprobs = logprob_params_each(n, return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
                                       return_text_in_logprobs)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n if not is_batch else [None] * n
        keys = extra_key if isinstance(extra_key, list) else [extra_key] * n
        if len(params) != n or len(rids) != n:
            raise ValueError(f"{n} prompts need as many sampling_params and rids (got {len(params)}, {len(rids)})")
        if len(keys) != n:
            raise ValueError(f"{n} prompts need one extra_key or as many (got {len(keys)})")
        named = [r for r in rids if r is not None]
        if len(set(named)) != len(named):
            raise ValueError("the rids of one batch must differ")
        with self._lock:  # all rids claimed, or none
            self._release_dropped()
            busy = [r for r in named if r in self._results and (not self._results[r].finished or self._results[r].waiter)]
            if busy:
                raise ValueError(f"Duplicate request ID detected: {busy[0]!r} is already in use by an unfinished "
                                 "request")
            rids = self._submit_all([dict(req, sampling_params=p, rid=r, extra_key=k, logprob=lp)
                                     for req, p, r, k, lp in zip(reqs, params, rids, keys, logprobs)], stream)
            states = [self._results[r] for r in rids]
        if stream:
            return GenerateStream(self, rids, states, is_batch)
        try:
            self._run_until_finished(rids)
            results = [self._results[r].to_dict() for r in rids]
        finally:
            self._release(rids, states)  # (on an error: aborts the unfinished)
        return results if is_batch else results[0]

    def _submit_all(self, reqs: list[dict[str, Any]], stream: bool) -> list[str]:
        """Submit each request (the caller holds the lock); if one cannot be, release
        and abort those already submitted."""
        rids: list[str] = []
        try:
            for req in reqs:
                rids.append(self.submit(**req, stream=stream, _waiter=True))
        except BaseException:
            self._release(rids, [self._results[r] for r in rids])
            raise
        return rids

    def _run_until_finished(self, rids: list[str]) -> None:
        while True:
            with self._lock:
                if all(self._results[r].finished for r in rids):
                    return
                had_work = self.scheduler.has_work()
                self.step()
                if not had_work and not all(self._results[r].finished for r in rids):
                    raise RuntimeError("scheduler went idle with unfinished requests: " + ", ".join(
                        r for r in rids if not self._results[r].finished))

    def _stream_outputs(self, states: dict[str, ReqState]) -> list[tuple[str, BatchStrOut]]:
        """The next outputs of a stream's unfinished requests (rid -> its state, in the
        stream's order), running iterations until there are some."""
        while True:
            with self._lock:
                outs = [(r, st.pending.popleft()) for r, st in states.items() if st.pending]
                if outs:
                    return outs
                had_work = self.scheduler.has_work()
                self.step()
                if not had_work and not any(st.pending for st in states.values()):
                    raise RuntimeError("scheduler went idle with unfinished requests")

    def _release(self, rids: list[str], states: list[ReqState], step: bool = False) -> None:
        """Give the rids back (each if still held by its state) and abort their requests
        not finished; ``step``: then run one iteration, so the aborts free their KV now."""
        with self._lock:
            self._release_dropped()
            aborted = self._release_states(rids, states)
            for r in aborted:
                self.abort(r)
            if aborted and step and not self._tp_failed:
                self.step()

    def _release_states(self, rids: list[str], states: list[ReqState]) -> list[str]:
        """Drop the states from _results (the caller holds the lock); the rids of those
        not finished, whose last output is now stale. Sends nothing."""
        unfinished = []
        for r, st in zip(rids, states):
            if self._results.get(r) is st:
                del self._results[r]
                if not st.finished:
                    self._stale[r] += 1
                    unfinished.append(r)
        return unfinished

    def _stream_dropped(self, rids: list[str], states: list[ReqState]) -> None:
        """A GenerateStream's finalizer: garbage collection calls it on any thread, maybe
        inside this engine's own locked code of this thread (a dict being iterated), or
        inside the scheduler's queue.put: it only hands the rids over, released here if
        no thread holds the lock, else by the next holder (_release_dropped). It never
        steps or sends."""
        self._dropped.append((rids, states))
        # (_is_owned: RLock's own check, the one threading.Condition uses)
        if not self._lock._is_owned() and self._lock.acquire(blocking=False):
            try:
                self._release_dropped(send=False)
            finally:
                self._lock.release()

    def _release_dropped(self, send: bool = True) -> None:
        """Release the streams garbage collection dropped (the caller holds the lock) and,
        unless called from a finalizer, send their aborts: before any later request of a
        released rid can be queued (_claim_rid) and before the next iteration (step)."""
        while self._dropped:
            self._unsent_aborts += self._release_states(*self._dropped.popleft())
        if send and self._unsent_aborts:
            aborts, self._unsent_aborts = self._unsent_aborts, []
            for r in aborts:
                self.abort(r)

    def abort(self, rid: str) -> None:
        self.scheduler.send(AbortReq(rid))

    def freeze_gc(self) -> int:
        """Move every object alive now out of the cyclic garbage collector's reach, as
        SGLang's ``Engine.freeze_gc`` does: call it after loading and a warm-up, when
        what exists (torch's modules, the model, the pools, the scheduler) lives as long
        as the engine. Full collections otherwise walk all of it: on tiny-random they took
        up to 120 ms each, holding the GIL, a tenth of a short run. Objects made later
        are collected as usual; ``shutdown`` (or ``gc.unfreeze()``) undoes it. Returns
        how many objects were frozen."""
        gc.collect()
        gc.freeze()
        self._froze_gc = True
        frozen = gc.get_freeze_count()
        logging.getLogger(__name__).info("froze %d objects out of garbage collection", frozen)
        return frozen

    def shutdown(self) -> None:
        with self._lock:
            self._release_dropped()
            for rid, state in list(self._results.items()):
                if not state.finished:
                    self.abort(rid)
            if self.scheduler.has_work() and not self._tp_failed:
                self.step()
            if not self._tp_failed:
                self.scheduler.shutdown()  # with tp > 1, rank 0 tells the others to stop
            self._stop_tp_ranks()
        if self._froze_gc:
            self._froze_gc = False
            gc.unfreeze()  # frozen objects would outlive the interpreter's last collection

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class GenerateStream:
    """What ``Engine.generate(..., stream=True)`` returns: an iterator of chunks (dicts,
    with ``index`` for a batch). Its rids go back to the engine, and its requests not
    finished are aborted, when it is read to the end, closed, raises, or is garbage
    collected unread or half read (a generator dropped before its first ``next()``
    never ran its ``finally``: its rids stayed claimed and its requests ran on)."""

    def __init__(self, engine: Engine, rids: list[str], states: list[ReqState], is_batch: bool):
        self._engine = engine
        self._rids, self._states = rids, states
        self._index = {r: i for i, r in enumerate(rids)} if is_batch else None
        self._pending = dict(zip(rids, states))  # requests whose finished chunk has not been taken
        self._by_rid = dict(zip(rids, states))
        self._ready: deque[dict[str, Any]] = deque()  # chunks taken, not handed out yet
        # holds the engine and the states, not this stream; at exit there is nothing to free
        self._finalizer = weakref.finalize(self, engine._stream_dropped, rids, states)
        self._finalizer.atexit = False

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._ready:
            if not self._pending:
                raise StopIteration
            self._take()
        return self._ready.popleft()

    def _take(self) -> None:
        try:
            outs = self._engine._stream_outputs(self._pending)
        except BaseException:
            self._pending.clear()
            self._give_back(step=False)  # (the error came from a step: abort, run nothing)
            raise
        for r, out in outs:
            if out.finished:
                del self._pending[r]
            index = self._index[r] if self._index is not None else None
            self._ready.append(_chunk(out, index, self._by_rid[r].logprob))
        if not self._pending:
            self._give_back(step=False)  # read to the end: nothing left to abort

    def close(self) -> None:
        """Stop reading: the rids go back, the requests not finished are aborted, and one
        iteration runs so that they free their KV now. Later ``next()`` raises StopIteration."""
        self._pending.clear()
        self._ready.clear()
        self._give_back(step=True)

    def _give_back(self, step: bool) -> None:
        if self._finalizer.detach() is not None:  # None: given back already
            self._engine._release(self._rids, self._states, step=step)


def setup_logging(level: str) -> None:
    """The "sglite" logger at ``level``, to stderr, "[time] message" (each process once)."""
    logger = logging.getLogger("sglite")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def _split_batch(prompt: Any, input_ids: Any, messages: Any) -> tuple[list[dict[str, Any]], bool]:
    """One request's inputs per batch entry, and whether a batch was given."""
    if isinstance(prompt, list):
        return [{"prompt": p} for p in prompt], True
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return [{"input_ids": ids} for ids in input_ids], True
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        return [{"messages": m} for m in messages], True
    return [{"prompt": prompt, "input_ids": input_ids, "messages": messages}], False


def _chunk(out: BatchStrOut, index: int | None, logprob: LogprobOutput | None) -> dict[str, Any]:
    """A stream's increment; with logprobs, those of its new tokens (and, first, the prompt's)."""
    meta = out.meta_info if logprob is None else dict(out.meta_info, **logprob.meta_info(out.logprobs or {}))
    chunk = {"text": out.new_text, "output_ids": out.new_token_ids, "finished": out.finished, "meta_info": meta}
    if index is not None:
        chunk["index"] = index
    if out.finished and "error" in out.meta_info:
        chunk["error"] = out.meta_info["error"]
    return chunk
