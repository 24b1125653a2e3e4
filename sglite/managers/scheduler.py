"""The Scheduler: waiting_queue -> PrefillAdder -> ScheduleBatch -> worker -> results
(SGLang: managers/scheduler.py). docs/seeds.md §B4: one iteration of event_loop_normal
does six things — receive, get_next_batch_to_run, run_batch, process_batch_result, the
idle self-check, last_batch = batch; event_loop_overlap (§B6) runs round N's forward
while round N+1 is planned. Watching is SchedulerObserver's job, self-checks are
SchedulerRuntimeChecker's, text is DetokenizerManager's (docs/architecture.md)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Iterator

from sglite import events as ev
from sglite.constrained.base_grammar_backend import BaseGrammarObject
from sglite.constrained.grammar_manager import GrammarManager, create_grammar_backend
from sglite.distributed.parallel_state import TpRankDiedError
from sglite.managers.io_struct import (HEALTH_CHECK_RID_PREFIX, AbortReq, BatchTokenIDOut, ExplainReq,
                                      ExplainReqOutput, FlushCacheReqInput, FlushCacheReqOutput, GetInternalStateReq,
                                      GetInternalStateReqOutput, TokenizedGenerateReqInput)
from sglite.managers.schedule_batch import FINISH_ABORT, Req, ReqLogprobs, ScheduleBatch
from sglite.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy, holds_of_round
from sglite.managers.scheduler_observer import SchedulerObserver
from sglite.managers.scheduler_output_processor import SchedulerOutputProcessor
from sglite.managers.scheduler_recovery import SchedulerRecovery
from sglite.managers.scheduler_runtime_checker import KVAccountingError, SchedulerRuntimeChecker
from sglite.managers.tp_worker import GenerationBatchResult, TpModelWorker
from sglite.managers.tp_worker_overlap_thread import TpModelWorkerClient
from sglite.mem_cache.chunk_cache import ChunkCache
from sglite.mem_cache.memory_pool import KVDoubleFreeError
from sglite.mem_cache.radix_cache import RadixCache
from sglite.server_args import ServerArgs

# SGLang's global_config: the new-token reservation ratio starts at 0.7 (scaled by
# schedule_conservativeness), decays to 0.14 of that over 600 decode rounds.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600

RecvItem = TokenizedGenerateReqInput | AbortReq | FlushCacheReqInput | GetInternalStateReq | ExplainReq
ControlOutput = FlushCacheReqOutput | GetInternalStateReqOutput | ExplainReqOutput

logger = logging.getLogger("sglite")


class Scheduler:
    def __init__(self, server_args: ServerArgs, event_bus: ev.EventBus | None = None,
                 tp_worker: TpModelWorker | None = None):
        self.server_args = server_args
        worker = tp_worker or TpModelWorker(server_args)
        self.tokenizer = worker.tokenizer
        self.model_config = worker.model_config
        self.eos_token_ids = set(self.model_config.eos_token_ids) | set(
            self.tokenizer.eos_token_ids if self.tokenizer is not None else ())
        self.device = worker.device
        self.req_to_token_pool, self.token_to_kv_pool_allocator = worker.get_memory_pool()
        self.max_total_num_tokens = worker.max_total_num_tokens
        self.max_running_requests = worker.max_running_requests
        self.max_req_len, self.max_req_input_len = worker.max_req_len, worker.max_req_input_len
        self.page_size = server_args.page_size
        self.event_bus = event_bus or ev.EventBus()
        # event_loop_overlap: forwards run on the client's thread, one round ahead
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.tp_worker: TpModelWorker | TpModelWorkerClient = (
            TpModelWorkerClient(worker) if self.enable_overlap else worker)

        if server_args.disable_radix_cache:
            self.tree_cache: RadixCache | ChunkCache = ChunkCache(
                self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size)
        else:
            self.tree_cache = RadixCache(self.req_to_token_pool, self.token_to_kv_pool_allocator,
                                         self.page_size, event_bus=self.event_bus)
        self.set_schedule_policy(server_args.schedule_policy)

        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch = self.make_batch([])
        self.last_batch: ScheduleBatch | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None
        # requests whose grammar compiles in the background (constrained/grammar_manager.py)
        self.grammar_manager = GrammarManager(create_grammar_backend(
            server_args, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids))
        self.result_queue: deque[tuple[ScheduleBatch, GenerationBatchResult]] = deque()  # overlap only

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        self.request_queue: queue.Queue[RecvItem] = queue.Queue()
        self.forward_ct = 0  # batches launched; the next one's bid is forward_ct + 1
        self.iteration = 0
        self.num_reqs_received = 0  # also seeds requests that bring no seed of their own
        # where each request's new tokens go (the Engine: its DetokenizerManager)
        self.send_to_detokenizer: Callable[[BatchTokenIDOut], None] = lambda out: None
        # answers to control requests (sglite serve: the TokenizerManager's socket)
        self.send_to_tokenizer: Callable[[ControlOutput], None] = lambda out: None
        self.observer = SchedulerObserver(self, self.event_bus)
        self.runtime_checker = SchedulerRuntimeChecker(self)
        self.recovery = SchedulerRecovery(self)
        self.output_processor = SchedulerOutputProcessor(self)

    def make_batch(self, reqs: list[Req], chunked_req: Req | None = None) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.token_to_kv_pool_allocator,
                                      self.tree_cache, self.model_config.vocab_size, self.device, chunked_req)

    def live_reqs(self) -> list[Req]:
        """Every request that is not finished: compiling its grammar, waiting, chunked,
        running or just prefilled."""
        seen: dict[int, Req] = {}
        groups = [self.grammar_manager.grammar_queue, self.waiting_queue,
                  [self.chunked_req] if self.chunked_req else [], self.running_batch.reqs]
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            groups.append(self.last_batch.reqs)
        for group in groups:
            for r in group:
                if not r.finished():
                    seen[id(r)] = r
        return list(seen.values())

    def running_reqs(self) -> list[Req]:
        """Requests past admission and not finished (the running batch, plus a batch
        just prefilled that merges into it next round)."""
        waiting = set(map(id, self.waiting_queue + self.grammar_manager.grammar_queue))
        return [r for r in self.live_reqs() if id(r) not in waiting and r is not self.chunked_req]

    def has_work(self) -> bool:
        return bool(self.live_reqs()) or not self.request_queue.empty() or bool(self.result_queue)

    # --- the loops --------------------------------------------------------------------

    def event_loop(self) -> Iterator[None]:
        """The loop ServerArgs chose; each ``next()`` runs one iteration. A round that
        raises fails the request that caused it (SchedulerRecovery.fail_round), not the
        loop; broken KV accounting is the engine's own fault and is raised."""
        while True:
            try:
                yield from (self.event_loop_overlap() if self.enable_overlap else self.event_loop_normal())
            except (KVAccountingError, KVDoubleFreeError, TpRankDiedError):
                raise  # the engine's own state is broken (or a tp rank is gone): no request can fix it
            except Exception as e:  # noqa: BLE001 - any error of one round
                self.recovery.fail_round(e)
                self._end_iteration(None)
                yield

    def event_loop_normal(self) -> Iterator[None]:
        """docs/seeds.md §B4: plan a round, run it, process its tokens, repeat."""
        while True:
            self._begin_iteration()
            self.process_input_requests(self.recv_requests())
            batch = self.get_next_batch_to_run()
            self.cur_batch = batch
            if batch is not None:
                result = self.run_batch(batch)
                self.process_batch_result(batch, result)
            else:
                self.self_check_during_idle()
            self.last_batch = batch
            self._end_iteration(batch)
            yield

    def event_loop_overlap(self) -> Iterator[None]:
        """docs/seeds.md §B6: launch round N, then process round N-1's tokens while N
        runs. Round N was planned from N-1's future token ids."""
        while True:
            self._begin_iteration()
            self.process_input_requests(self.recv_requests())
            batch = self.get_next_batch_to_run()
            self.cur_batch = batch
            if batch is not None:
                result = self.run_batch(batch)
                self.result_queue.append((batch.copy(), result))
            try:
                if self.last_batch is not None:
                    self.process_batch_result(*self.result_queue.popleft())
                elif batch is None:
                    self.self_check_during_idle()
            finally:
                self.set_next_batch_sampling_info_done(batch)
            self.last_batch = batch
            self._end_iteration(batch)
            yield

    def _begin_iteration(self) -> None:
        self.iteration += 1
        self.observer.on_iteration_start()

    def _end_iteration(self, batch: ScheduleBatch | None) -> None:
        if self.server_args.enable_busy_self_check:
            self.runtime_checker.self_check_during_busy()
        self.observer.on_iteration_end(batch)

    # --- 1. receive -------------------------------------------------------------------

    def send(self, item: RecvItem) -> None:
        """Thread-safe: hand a request (or an abort) to the next iteration."""
        self.request_queue.put(item)

    def recv_requests(self) -> list[RecvItem]:
        items: list[RecvItem] = []
        while not self.request_queue.empty():  # this loop is the queue's only reader
            items.append(self.request_queue.get_nowait())
        return items

    def process_input_requests(self, recv_reqs: list[RecvItem]) -> None:
        for item in recv_reqs:
            if isinstance(item, AbortReq):
                self.abort_request(item)
            elif isinstance(item, FlushCacheReqInput):
                self.send_to_tokenizer(self.flush_cache())
            elif isinstance(item, GetInternalStateReq):
                self.send_to_tokenizer(GetInternalStateReqOutput(self.observer.internal_state()))
            elif isinstance(item, ExplainReq):
                self.send_to_tokenizer(self.observer.explain(item.rid))
            elif item.rid.startswith(HEALTH_CHECK_RID_PREFIX) and self.has_work():
                self.output_processor.send_health_check_passed(item.rid)  # (SGLang skips it too)
            else:
                self.handle_generate_request(item)

    def flush_cache(self) -> FlushCacheReqOutput:
        """Empty the radix cache and give every KV slot back; only when nothing runs
        (SGLang refuses too: running requests hold tree nodes)."""
        if self.live_reqs():
            return FlushCacheReqOutput(False, "cannot flush the cache while requests run")
        self.finish_round_in_flight()
        self.grammar_manager.reset()
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        return FlushCacheReqOutput(True)

    def _validate(self, recv_req: TokenizedGenerateReqInput) -> str | None:
        """The TokenizerManager checked every field; what only the scheduler can see is
        whether the rid is taken."""
        if recv_req.error:
            return recv_req.error
        if any(r.rid == recv_req.rid for r in self.live_reqs()):
            return f"Duplicate request ID detected: {recv_req.rid!r} is already in use by an unfinished request"
        return None

    def handle_generate_request(self, recv_req: TokenizedGenerateReqInput) -> None:
        error = self._validate(recv_req)
        if error is not None:
            self.output_processor.send_rejected(recv_req.rid, len(recv_req.input_ids or []), error)
            return
        params = recv_req.sampling_params
        temperature = params.temperature  # before normalize() turns 0 into greedy top_k=1
        params.normalize()
        # like SGLang: the output may use whatever the prompt leaves of max_req_len
        params.max_new_tokens = min(params.max_new_tokens, self.max_req_len - len(recv_req.input_ids))
        req = Req(recv_req.rid, recv_req.input_text, list(recv_req.input_ids), params, self.eos_token_ids,
                  seed=self.server_args.random_seed + self.num_reqs_received, stream=recv_req.stream,
                  tokenizer=self.tokenizer, extra_key=recv_req.extra_key, logprobs=req_logprobs(recv_req))
        req.trace_parent = recv_req.trace_parent
        self.num_reqs_received += 1
        self.observer.on_req_arrived(req, temperature)
        error = self.grammar_manager.process_req_with_grammar(req)
        if error is not None:
            self.abort_now(req, error, is_error=True, status_code=400)  # (SGLang's 400: the request's grammar)
        elif self.grammar_manager.is_queued(req):
            self.observer.on_grammar_queued(req)
        else:
            self.waiting_queue.append(req)

    def abort_request(self, abort: AbortReq) -> None:
        for req in self.live_reqs():
            if req.rid == abort.rid:
                # SGLang's lines (at info here, so that a default server shows them)
                logger.info("Abort %s request. rid=%s", "queued" if req in self.waiting_queue else "running", req.rid)
                self.abort_now(req, abort.message, by_client=True)
                return

    def abort_now(self, req: Req, message: str, is_error: bool = False, by_client: bool = False,
                  status_code: int | None = None) -> None:
        """Finish a request at once and free everything it holds."""
        req.to_abort, req.to_abort_message = True, message
        req.finished_reason = FINISH_ABORT(message, is_error=is_error, status_code=status_code)
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        self.grammar_manager.remove(req)
        if isinstance(req.grammar, BaseGrammarObject):
            req.grammar.finished = True  # a round already planned leaves its row unmasked
        req.grammar = None
        if req is self.chunked_req:
            self.chunked_req = None
            if req.req_pool_idx is not None:
                # the state between chunks: its computed part becomes prefix_indices
                self.tree_cache.cache_unfinished_req(req)
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        self.observer.on_req_aborted(req.rid, message, by_client)
        self.output_processor.stream_output(req)

    def _abort_on_timeouts(self) -> None:
        wt, rt = self.server_args.waiting_timeout, self.server_args.running_timeout
        if wt is None and rt is None:
            return  # the usual case: no walk over every request each round
        now = time.perf_counter()
        for req in self.live_reqs():
            # SGLang's words and status (503: the server is too busy for it, not the request bad)
            if wt is not None and req.forward_entry_time is None and now - req.wait_queue_entry_time > wt:
                self.abort_now(req, f"Request waiting timeout reached. (waited longer than waiting_timeout={wt}s)",
                               status_code=503)
            elif rt is not None and req.forward_entry_time is not None and now - req.forward_entry_time > rt:
                self.abort_now(req, f"Request running timeout reached. (ran longer than running_timeout={rt}s)",
                               status_code=503)

    # --- 2. get_next_batch_to_run -------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self._abort_on_timeouts()
        if self.chunked_req is not None:
            # its computed part goes into the cache; the next chunk starts from there
            self.tree_cache.cache_unfinished_req(self.chunked_req)
            self.req_to_token_pool.free(self.chunked_req.req_pool_idx)
            self.chunked_req.req_pool_idx = None

        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            self._cache_prefilled(self.last_batch)
            self.last_batch.filter_batch(chunked_req_to_exclude=self.chunked_req)
            if not self.last_batch.is_empty():
                self.running_batch.merge_batch(self.last_batch)

        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            self.running_batch = self.update_running_batch(self.running_batch)
            return None if self.running_batch.is_empty() else self.running_batch
        return None

    def _cache_prefilled(self, batch: ScheduleBatch) -> None:
        """Put the prompts the last round prefilled into the tree, so this round's
        admissions can hit them. SGLang does this in process_batch_result; sglite does it
        here, where the batch merges into running_batch, because in the overlap loop that
        is before the round's results are back: forwards run in launch order, so any
        later round reads the KV this one writes."""
        decoding = set(map(id, batch.decoding_reqs))
        for req in batch.reqs:
            if not req.finished() and req is not self.chunked_req and id(req) not in decoding:
                self.tree_cache.cache_unfinished_req(req)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """Admit waiting requests (the chunked one first) under PrefillAdder's budgets."""
        self.running_batch.filter_batch()
        running_bs = self.running_batch.batch_size()
        if self.grammar_manager.has_waiting_grammars():
            self.move_ready_grammar_requests(block=running_bs == 0 and not self.waiting_queue and not self.chunked_req)
        if not self.waiting_queue and self.chunked_req is None:
            self.observer.on_admission_stopped("EMPTY_QUEUE")
            return None
        if running_bs >= self.max_running_requests:
            self.running_batch.batch_is_full = True
            self.observer.on_admission_stopped("MAX_RUNNING_REQUESTS")
            self.observer.on_reqs_held(holds_of_round(self.waiting_queue, "MAX_RUNNING_REQUESTS", None, None,
                                                      running_bs, self.max_running_requests))
            return None

        self.policy.calc_priority(self.waiting_queue)
        mixed = self.server_args.enable_mixed_chunk and running_bs > 0
        adder = PrefillAdder(
            self.page_size, self.tree_cache, self.token_to_kv_pool_allocator, self.running_batch,
            self.new_token_ratio, self.server_args.max_prefill_tokens, self.server_args.chunked_prefill_size,
            running_bs if mixed else 0, deprioritized=self.policy.temporary_deprioritized,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        stop, stopped_at = self._add_waiting_reqs(adder, running_bs)
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1

        can_run = adder.can_run_list
        admitted = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.observer.on_reqs_held(holds_of_round(self.waiting_queue, stop, stopped_at, adder, running_bs,
                                                  self.max_running_requests))
        deferred = any(r.rid in self.policy.temporary_deprioritized for r in self.waiting_queue)
        self.observer.on_admission_stopped(stop or ("IN_BATCH_PREFIX_WAIT" if deferred else
                                                    "EMPTY_QUEUE" if not self.waiting_queue else "OTHER"), adder)
        if not can_run:
            return None
        new_batch = self.make_batch(can_run, self.chunked_req)
        self.cur_batch = new_batch  # if preparing it raises, SchedulerRecovery finds its requests here
        new_batch.prepare_for_extend()
        self.observer.on_prefill_batch(can_run, adder, running_bs)
        if mixed:
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty():
                self.running_batch.prepare_for_decode()
                new_batch.mix_with_running(self.running_batch)
                self.running_batch = self.make_batch([])
        return new_batch

    def _add_waiting_reqs(self, adder: PrefillAdder, running_bs: int) -> tuple[str, Req | None]:
        """Offer the waiting requests in queue order until a budget runs out. Returns
        why admission stopped ('' when the queue ran out first) and the request it
        stopped at (refused, or the first not offered), for holds_of_round."""
        result = adder.budget_state()
        if result != AddReqResult.CONTINUE:
            return result.name, None
        candidates = self.recovery.admission_candidates(running_bs)
        if candidates is None:
            return "FAILED_ROUND_TRIAL", None
        for req in candidates:
            if running_bs + len(adder.can_run_list) >= self.max_running_requests:
                self.running_batch.batch_is_full = True
                return "MAX_RUNNING_REQUESTS", req
            req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(req)
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    self.running_batch.batch_is_full = True
                admitted = bool(adder.can_run_list) and adder.can_run_list[-1] is req
                return result.name, (None if admitted else req)
        return "", None

    def move_ready_grammar_requests(self, block: bool) -> None:
        """Requests whose grammar compiled join the waiting_queue; those whose compile
        failed or timed out finish with its error (SGLang's 400). ``block``: nothing
        else can run this round, so wait a poll interval for a compile."""
        ready, failed = self.grammar_manager.get_ready_grammar_requests(block)
        for req in ready:
            req.wait_queue_entry_time = time.perf_counter()
            self.waiting_queue.append(req)
            self.observer.on_grammar_ready(req)
        for req, error in failed:
            self.abort_now(req, error, is_error=True, status_code=400)

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        """The decode round: retract requests when the pool cannot hold one more token
        each, else relax the new-token reservation ratio."""
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            old_ratio = self.new_token_ratio
            retracted, self.new_token_ratio = batch.retract_decode()
            self.observer.on_retract(retracted, old_ratio, self.new_token_ratio)
            self.waiting_queue.extend(retracted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        batch.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    # --- 3. run_batch -----------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Hand the round to the worker. The normal worker returns with the tokens; the
        overlap worker at once, with a future id per request for the token it will
        sample (the next round's decode input until process_batch_result resolves it)."""
        self.forward_ct += 1
        if self.enable_overlap and batch.sampling_info is not None and batch.sampling_info.grammars is not None:
            # its masks need the tokens of the round in flight: filled after that round is
            # processed (set_next_batch_sampling_info_done); the forward runs meanwhile
            batch.sampling_info.sampling_info_done = threading.Event()
        worker_batch = batch.get_model_worker_batch(self.forward_ct, self.iteration)
        self.observer.on_batch_planned(batch, worker_batch)
        self.req_to_token_pool.forward_launched = self.forward_ct
        result = self.tp_worker.forward_batch_generation(worker_batch)
        for req, future in zip(batch.reqs, result.future_token_ids):
            if req is not batch.chunked_req:  # a non-final chunk samples nothing real
                req.future_token_id = future
        self.observer.on_batch_launched()
        return result

    # --- 4. process_batch_result --------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """docs/seeds.md §B7: each request's new token, its finish check, its stream
        (SchedulerOutputProcessor: SGLang's scheduler_output_processor_mixin.py)."""
        self.output_processor.process_batch_result(batch, result)

    def set_next_batch_sampling_info_done(self, batch: ScheduleBatch | None) -> None:
        """The overlap loop, after the last round's tokens are accepted by their grammars:
        fill the mask of the round just launched and let its sampling go on (SGLang:
        next_batch_sampling_info). Set even if filling fails: a forward never waits forever."""
        info = batch.sampling_info if batch is not None else None
        if info is None or info.sampling_info_done is None:
            return
        try:
            info.update_regex_vocab_mask()
        finally:
            info.sampling_info_done.set()

    # --- 5. idle ----------------------------------------------------------------------

    def self_check_during_idle(self) -> None:
        """Nothing ran this round: with no request left, reset the reservation ratio and
        check every KV slot is accounted for (the page-by-page walk with --enable-self-check)."""
        if self.live_reqs():
            return
        self.new_token_ratio = self.init_new_token_ratio
        self.runtime_checker.self_check_during_idle(full=self.server_args.enable_self_check)

    # --- control ----------------------------------------------------------------------

    def set_schedule_policy(self, name: str) -> None:
        """Order the waiting_queue by ``name`` from the next admission on (the TUI's policy key)."""
        self.server_args.schedule_policy = name
        self.policy = SchedulePolicy(name, self.tree_cache, self.server_args.random_seed)

    def finish_round_in_flight(self) -> None:
        """The overlap loop launches a round before it knows the last one finished its
        requests: with none left, resolve that round (its tokens are dropped) so no
        forward still writes the pool, and start the next iteration with none pending."""
        while self.result_queue:
            self.process_batch_result(*self.result_queue.popleft())
        self.last_batch = None

    def shutdown(self) -> None:
        """Finish the round in flight (overlap) and stop the forward worker."""
        self.finish_round_in_flight()
        self.grammar_manager.shutdown()
        self.tp_worker.shutdown()


def req_logprobs(recv_req: TokenizedGenerateReqInput) -> ReqLogprobs | None:
    """A Req's logprob state from the request's fields (the gate checked them)."""
    lp = recv_req.logprob
    if lp is None or not lp.return_logprob:
        return None
    ids = list(recv_req.input_ids)
    return ReqLogprobs(ids, lp.start_for(len(ids)), lp.top_logprobs_num, lp.token_ids_logprob or None)
