"""The Scheduler: waiting_queue -> PrefillAdder -> ScheduleBatch -> forward -> results
(SGLang: managers/scheduler.py). Seed 004 §4: one iteration of event_loop_normal does
six things — receive, get_next_batch_to_run, run_batch, process_batch_result, the idle
self-check, and last_batch = batch. ``step()`` is exactly one such iteration."""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Any


from sglite import events as ev
from sglite.managers.io_struct import AbortReq, BatchStrOut, TokenizedGenerateReqInput
from sglite.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from sglite.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from sglite.managers.tp_worker_overlap_thread import GenerationBatchResult, TpModelWorkerClient
from sglite.mem_cache.chunk_cache import ChunkCache
from sglite.mem_cache.radix_cache import RadixCache
from sglite.model_executor.forward_batch_info import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner
from sglite.server_args import ServerArgs

logger = logging.getLogger("sglite")

# SGLang's global_config: the new-token reservation ratio starts at 0.7 (scaled by
# schedule_conservativeness), decays to 0.14 of that over 600 decode rounds.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None,
                 event_bus: ev.EventBus | None = None):
        self.server_args = server_args
        self.model_runner = model_runner or ModelRunner(server_args)
        self.tokenizer = self.model_runner.tokenizer
        self.model_config = self.model_runner.model_config
        self.device = self.model_runner.device
        self.req_to_token_pool = self.model_runner.req_to_token_pool
        self.token_to_kv_pool_allocator = self.model_runner.token_to_kv_pool_allocator
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.max_running_requests = self.model_runner.max_running_requests
        self.page_size = server_args.page_size
        # a request (prompt + output) must fit the context and the whole pool
        self.max_req_len = min(self.model_runner.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.event_bus = event_bus or ev.EventBus()

        if server_args.disable_radix_cache:
            self.tree_cache: RadixCache | ChunkCache = ChunkCache(
                self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size)
        else:
            self.tree_cache = RadixCache(self.req_to_token_pool, self.token_to_kv_pool_allocator,
                                         self.page_size, event_bus=self.event_bus)
        self.set_schedule_policy(server_args.schedule_policy)

        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch = self._new_batch([])
        self.last_batch: ScheduleBatch | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        self.request_queue: queue.Queue[TokenizedGenerateReqInput | AbortReq] = queue.Queue()
        self.forward_ct = 0
        self.forward_ct_decode = 0
        self.iteration = 0
        self.num_retracted_reqs = 0
        self.total_hit_tokens = 0
        self.total_input_tokens = 0
        self.num_generated_tokens = 0
        self.last_decode_stats_tic = time.perf_counter()
        self.last_admission_stop = ""
        self.last_matched_node_id = 0  # radix node where the latest admission's prefix match ended
        self._last_tree_snapshot: tuple | None = None
        self.num_reqs_received = 0  # also seeds requests that bring no seed of their own
        self._outputs: list[BatchStrOut] = []

        # event_loop_overlap: forwards run on a worker; a round's results are processed
        # one iteration later, while the next round runs
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.tp_worker = TpModelWorkerClient(self.model_runner, self.max_running_requests) if self.enable_overlap else None
        self.result_queue: deque[tuple[ScheduleBatch, GenerationBatchResult]] = deque()

    # --- helpers ----------------------------------------------------------------------

    def _new_batch(self, reqs: list[Req], chunked_req: Req | None = None) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.token_to_kv_pool_allocator,
                                      self.tree_cache, self.model_config.vocab_size, self.device, chunked_req)

    @property
    def bus(self) -> ev.EventBus:
        return self.event_bus

    def token_usage(self) -> float:
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        return (self.max_total_num_tokens - free) / self.max_total_num_tokens

    def cache_hit_rate(self) -> float:
        total = self.total_hit_tokens + self.total_input_tokens
        return self.total_hit_tokens / total if total else 0.0

    def live_reqs(self) -> list[Req]:
        """Every request that is not finished: waiting, chunked, running or just prefilled."""
        seen: dict[int, Req] = {}
        groups = [self.waiting_queue, [self.chunked_req] if self.chunked_req else [], self.running_batch.reqs]
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            groups.append(self.last_batch.reqs)
        for group in groups:
            for r in group:
                if not r.finished():
                    seen[id(r)] = r
        return list(seen.values())

    def has_work(self) -> bool:
        return bool(self.live_reqs()) or not self.request_queue.empty() or bool(self.result_queue)

    # --- 1. receive -------------------------------------------------------------------

    def send(self, item: TokenizedGenerateReqInput | AbortReq) -> None:
        """Thread-safe: hand a request (or an abort) to the next iteration."""
        self.request_queue.put(item)

    def recv_requests(self) -> list[TokenizedGenerateReqInput | AbortReq]:
        items = []
        while True:
            try:
                items.append(self.request_queue.get_nowait())
            except queue.Empty:
                return items

    def process_input_requests(self, recv_reqs: list[TokenizedGenerateReqInput | AbortReq]) -> None:
        for item in recv_reqs:
            if isinstance(item, AbortReq):
                self.abort_request(item)
            else:
                self.handle_generate_request(item)

    def _validate(self, recv_req: TokenizedGenerateReqInput) -> str | None:
        if recv_req.error:
            return recv_req.error
        if any(r.rid == recv_req.rid for r in self.live_reqs()):
            return f"request id {recv_req.rid!r} is already in use by an unfinished request"
        ids = recv_req.input_ids
        if not ids:
            return "the prompt is empty"
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (0..{vocab - 1})"
        if len(ids) > self.max_req_input_len:
            return (f"the prompt has {len(ids)} tokens; at most {self.max_req_input_len} fit "
                    f"(context length {self.model_runner.context_len}, KV pool {self.max_total_num_tokens} tokens)")
        try:
            recv_req.sampling_params.verify(vocab)
        except ValueError as e:
            return str(e)
        return None

    def handle_generate_request(self, recv_req: TokenizedGenerateReqInput) -> None:
        error = self._validate(recv_req)
        if error is not None:
            self._reject(recv_req, error)
            return
        params = recv_req.sampling_params
        recv_req_temperature = params.temperature  # before normalize() turns 0 into greedy top_k=1
        params.normalize()
        # like SGLang: the output may use whatever the prompt leaves of max_req_len
        params.max_new_tokens = min(params.max_new_tokens, self.max_req_len - len(recv_req.input_ids))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        req = Req(recv_req.rid, recv_req.input_text, list(recv_req.input_ids), params, eos,
                  seed=self.server_args.random_seed + self.num_reqs_received, stream=recv_req.stream)
        self.num_reqs_received += 1
        self.waiting_queue.append(req)
        self.bus.emit(ev.ReqArrived, rid=req.rid, prompt_tokens=len(req.origin_input_ids),
                      max_new_tokens=params.max_new_tokens, temperature=recv_req_temperature,
                      top_p=params.top_p, top_k=params.top_k if params.top_k < (1 << 30) else -1)

    def _reject(self, recv_req: TokenizedGenerateReqInput, error: str) -> None:
        reason = FINISH_ABORT(error, is_error=True)
        self._outputs.append(BatchStrOut(recv_req.rid, "", [], True, {
            "id": recv_req.rid, "prompt_tokens": len(recv_req.input_ids or []), "completion_tokens": 0,
            "cached_tokens": 0, "finish_reason": reason.to_json(), "error": error,
        }))
        self.bus.emit(ev.ReqAborted, rid=recv_req.rid, reason=error)

    def abort_request(self, abort: AbortReq) -> None:
        for req in self.live_reqs():
            if req.rid == abort.rid:
                self._abort_now(req, abort.message)
                return

    def _abort_now(self, req: Req, message: str) -> None:
        """Finish a request at once and free everything it holds."""
        req.to_abort, req.to_abort_message = True, message
        req.finished_reason = FINISH_ABORT(message)
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
            if req.req_pool_idx is not None:
                # the state between chunks: its computed part becomes prefix_indices
                self.tree_cache.cache_unfinished_req(req)
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        self.bus.emit(ev.ReqAborted, rid=req.rid, reason=message)
        self._stream_req(req)

    def _abort_on_timeouts(self) -> None:
        wt, rt = self.server_args.waiting_timeout, self.server_args.running_timeout
        if wt is None and rt is None:
            return  # the usual case: no walk over every request each round
        now = time.perf_counter()
        for req in self.live_reqs():
            if wt is not None and req.forward_entry_time is None and now - req.wait_queue_entry_time > wt:
                self._abort_now(req, f"waited longer than waiting_timeout={wt}s")
            elif rt is not None and req.forward_entry_time is not None and now - req.forward_entry_time > rt:
                self._abort_now(req, f"ran longer than running_timeout={rt}s")

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

    def _stop_admission(self, reason: str, adder: PrefillAdder | None = None) -> None:
        self.last_admission_stop = reason
        if self.bus.active:
            self.bus.emit(ev.AdmissionStopped, reason=reason, waiting=len(self.waiting_queue),
                          rem_total_tokens=int(adder.rem_total_tokens) if adder else 0,
                          rem_input_tokens=int(adder.rem_input_tokens) if adder else 0)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        self.running_batch.filter_batch()
        running_bs = self.running_batch.batch_size()
        if not self.waiting_queue and self.chunked_req is None:
            self._stop_admission("EMPTY_QUEUE")
            return None
        if running_bs >= self.max_running_requests:
            self.running_batch.batch_is_full = True
            self._stop_admission("MAX_RUNNING_REQUESTS")
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

        result = adder.budget_state()
        stop = "" if result == AddReqResult.CONTINUE else result.name
        if result == AddReqResult.CONTINUE:
            for req in self.waiting_queue:
                if running_bs + len(adder.can_run_list) >= self.max_running_requests:
                    stop = "MAX_RUNNING_REQUESTS"
                    self.running_batch.batch_is_full = True
                    break
                req.init_next_round_input(self.tree_cache)
                result = adder.add_one_req(req)
                if result != AddReqResult.CONTINUE:
                    stop = result.name
                    if result == AddReqResult.NO_TOKEN:
                        self.running_batch.batch_is_full = True
                    break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1

        can_run = adder.can_run_list
        admitted = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        deferred = [r for r in self.waiting_queue if r.rid in self.policy.temporary_deprioritized]
        self._stop_admission(stop or ("IN_BATCH_PREFIX_WAIT" if deferred else
                                      "EMPTY_QUEUE" if not self.waiting_queue else "OTHER"), adder)
        if not can_run:
            return None

        self.total_hit_tokens += adder.log_hit_tokens
        self.total_input_tokens += adder.log_input_tokens
        new_batch = self._new_batch(can_run, self.chunked_req)
        new_batch.prepare_for_extend()
        for req in can_run:
            if req.last_node is not None:
                self.last_matched_node_id = req.last_node.id
            self.bus.emit(ev.CacheMatched, rid=req.rid, matched_len=len(req.prefix_indices), key_len=len(req.fill_ids))
            self.bus.emit(ev.ReqAdmitted, rid=req.rid, prefix_len=len(req.prefix_indices),
                          extend_len=req.extend_input_len, chunked=req is self.chunked_req)

        if mixed:
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty():
                self.running_batch.prepare_for_decode()
                new_batch.mix_with_running(self.running_batch)
                self.running_batch = self._new_batch([])

        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(can_run), adder.log_input_tokens, adder.log_hit_tokens, self.token_usage(),
            running_bs, len(self.waiting_queue),
        )
        return new_batch

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            old_ratio = self.new_token_ratio
            retracted, new_ratio = batch.retract_decode()
            self.new_token_ratio = new_ratio
            self.num_retracted_reqs += len(retracted)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                len(retracted), old_ratio, new_ratio,
            )
            for req in retracted:
                self.bus.emit(ev.ReqRetracted, rid=req.rid, reason="KV cache pool is full",
                              old_new_token_ratio=old_ratio, new_token_ratio=new_ratio,
                              output_tokens=len(req.output_ids))
            self.waiting_queue.extend(retracted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        batch.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    # --- 3. run_batch -----------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Normal loop: run the forward and sample. Overlap loop: hand the forward to the
        worker and return at once; each request's next token is a future id until
        process_batch_result resolves it."""
        self.forward_ct += 1
        bid = self.forward_ct
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        if self.bus.active:
            self.bus.emit(ev.BatchPlanned, bid=bid, forward_mode=batch.forward_mode.name,
                          rids=tuple(r.rid for r in batch.reqs), seq_lens=tuple(batch.seq_lens),
                          prefix_lens=tuple(batch.prefix_lens), extend_lens=tuple(batch.extend_lens),
                          out_cache_loc=tuple(batch.out_cache_loc.tolist()), num_rows=len(batch.input_ids))
        if self.tp_worker is not None:
            self.req_to_token_pool.forward_launched = bid
            result = self.tp_worker.forward_batch_generation(forward_batch, bid, self.iteration)
            for req, future in zip(batch.reqs, result.future_token_ids):
                if req is not batch.chunked_req:  # a non-final chunk samples nothing real
                    req.future_token_id = future
            return result
        result = GenerationBatchResult(bid=bid, iteration=self.iteration, forward_started=time.monotonic())
        self._emit_forward(ev.ForwardStarted, batch, result)
        logits = self.model_runner.forward(forward_batch)
        result.next_token_ids = self.model_runner.sample(logits, forward_batch).tolist()
        result.forward_finished = time.monotonic()
        self._emit_forward(ev.ForwardFinished, batch, result)
        return result

    def _emit_forward(self, event_cls: type[ev.Event], batch: ScheduleBatch, result: GenerationBatchResult,
                      iteration: int | None = None) -> None:
        if not self.bus.active:
            return
        fields: dict[str, Any] = dict(bid=result.bid, forward_mode=batch.forward_mode.name,
                                      batch_size=batch.batch_size(), num_tokens=batch.extend_num_tokens,
                                      backend=self.model_runner.attn_backend.name)
        if event_cls is ev.ForwardFinished:
            fields.update(duration=result.forward_time, ts=result.forward_finished)
        else:
            fields.update(ts=result.forward_started)
        if iteration is not None:
            fields["iteration"] = iteration
        self.bus.emit(event_cls, **fields)

    # --- 4. process_batch_result --------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        if self.tp_worker is not None:
            self.tp_worker.resolve_batch_result(result)
            self.req_to_token_pool.mark_forward_done(result.bid)
            # the forward ran while the scheduler went on: report it with its own times,
            # under the iteration that launched it
            self._emit_forward(ev.ForwardStarted, batch, result, iteration=result.iteration)
            self._emit_forward(ev.ForwardFinished, batch, result, iteration=result.iteration)
        decoding = set(map(id, batch.decoding_reqs))
        assert result.next_token_ids is not None
        for i, (req, token_id) in enumerate(zip(batch.reqs, result.next_token_ids)):
            if result.future_token_ids and req.future_token_id == result.future_token_ids[i]:
                req.future_token_id = None  # no later round of this request is in flight
            if req.finished():
                # aborted while its batch ran, or (overlap) finished by the previous
                # round after this one was planned: the token is dropped, never streamed
                continue
            if req.is_retracted:
                continue  # overlap: retracted while this round ran; recomputed after re-admission
            if batch.forward_mode.is_extend() and id(req) not in decoding and req.is_chunked > 0:
                # a non-final chunk: its sampled token is meaningless
                req.is_chunked -= 1
                req.chunk_index += 1
                self.bus.emit(ev.ReqChunked, rid=req.rid, chunk_index=req.chunk_index - 1,
                              computed_len=batch.seq_lens[i],
                              total_len=len(req.origin_input_ids) + len(req.output_ids))
                continue
            self._append_token(req, token_id)
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            self._stream_req(req)
        if batch.forward_mode.is_decode():
            self.forward_ct_decode += 1
            if self.forward_ct_decode % self.server_args.decode_log_interval == 0:
                self._log_decode_stats(batch)

    def _append_token(self, req: Req, token_id: int) -> None:
        req.output_ids.append(token_id)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.check_finished()
        self._detokenize(req, flush=req.finished())
        req.check_stop_str()
        if req.finished():
            req.completion_time = time.perf_counter()

    def _detokenize(self, req: Req, flush: bool) -> None:
        """Incremental detokenization with SGLang's surr/read offsets: only append text
        once the bytes form whole characters."""
        if self.tokenizer is None:
            return
        ids, skip = req.output_ids, req.sampling_params.skip_special_tokens
        surr_text = self.tokenizer.decode(ids[req.surr_offset : req.read_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(ids[req.surr_offset :], skip_special_tokens=skip)
        if flush or (len(new_text) > len(surr_text) and not new_text.endswith("\ufffd")):
            req.decoded_text += new_text[len(surr_text):]
            req.surr_offset, req.read_offset = req.read_offset, len(ids)

    def _stream_req(self, req: Req) -> None:
        finished = req.finished()
        end = len(req.decoded_text) if finished else len(req.decoded_text) - req.stream_holdback()
        new_text = req.decoded_text[req.sent_text_len : end] if end > req.sent_text_len else ""
        req.sent_text_len = max(req.sent_text_len, end)
        new_ids = req.output_ids[req.sent_ids_len :]
        req.sent_ids_len = len(req.output_ids)
        if new_ids and self.bus.active:
            self.bus.emit(ev.TokensEmitted, rid=req.rid, token_ids=tuple(new_ids), text=new_text)
        meta: dict[str, Any] = {"id": req.rid}
        if finished:
            meta.update(self._meta_info(req))
            if not isinstance(req.finished_reason, FINISH_ABORT):
                self.bus.emit(ev.ReqFinished, rid=req.rid, reason=req.finished_reason.to_json()["type"],
                              prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
                              cached_tokens=req.cached_tokens)
        self._outputs.append(BatchStrOut(req.rid, new_text, new_ids, finished, meta))

    def _meta_info(self, req: Req) -> dict[str, Any]:
        now = time.perf_counter()
        return {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason.to_json() if req.finished_reason else None,
            "e2e_latency": (req.completion_time or now) - req.created_time,
            "time_to_first_token": (req.first_token_time - req.created_time) if req.first_token_time else None,
            "queue_time": ((req.forward_entry_time or now) - req.created_time),
            "retraction_count": req.retraction_count,
        }

    def _log_decode_stats(self, batch: ScheduleBatch) -> None:
        now = time.perf_counter()
        gap = max(now - self.last_decode_stats_tic, 1e-9)
        throughput = self.num_generated_tokens / gap
        self.num_generated_tokens, self.last_decode_stats_tic = 0, now
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            batch.batch_size(),
            self.max_total_num_tokens - self.token_to_kv_pool_allocator.available_size() - self.tree_cache.evictable_size(),
            self.token_usage(), throughput, len(self.waiting_queue),
        )

    # --- 5. idle self-check -----------------------------------------------------------

    def self_check_during_idle(self) -> None:
        """With nothing running, every KV slot is free or cached in the tree, no node is
        locked and no request slot is taken."""
        if self.live_reqs():
            return
        self.new_token_ratio = self.init_new_token_ratio
        if not self.server_args.enable_self_check:
            return
        free = self.token_to_kv_pool_allocator.available_size()
        cached = self.tree_cache.total_size()
        problems = []
        if free + cached != self.max_total_num_tokens:
            problems.append(f"free {free} + cached {cached} != pool {self.max_total_num_tokens}")
        if self.tree_cache.protected_size() != 0:
            problems.append(f"protected_size {self.tree_cache.protected_size()} != 0")
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            problems.append(f"{self.req_to_token_pool.size - self.req_to_token_pool.available_size()} req slots held")
        problems += self._slot_ownership_problems()
        if problems:
            raise RuntimeError("KV memory leak detected when idle: " + "; ".join(problems))

    def self_check_during_busy(self) -> None:
        """Every page is free, in the tree, or held by a live request; none is both free
        and used (SGLang's strict busy check; the tests call it every iteration)."""
        problems = self._slot_ownership_problems()
        if problems:
            raise RuntimeError("KV memory accounting broken: " + "; ".join(problems))

    def _slot_ownership_problems(self) -> list[str]:
        page = self.page_size
        alloc = self.token_to_kv_pool_allocator
        free_pages = list(alloc.free_pages)
        free = set(free_pages)
        problems = []
        if len(free) != len(free_pages):
            problems.append("a page is free twice")
        tree = set((self.tree_cache.all_values_flatten() // page).tolist())
        held: set[int] = set()
        for req in self.live_reqs():
            if req.req_pool_idx is not None:
                slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]
                held |= set((slots // page).tolist())
            elif len(req.prefix_indices) and req is self.chunked_req:
                held |= set((req.prefix_indices // page).tolist())
        if free & tree:
            problems.append(f"{len(free & tree)} pages both free and cached")
        if free & held:
            problems.append(f"{len(free & held)} pages both free and held by a request")
        all_pages = set(range(1, self.max_total_num_tokens // page + 1))
        missing = all_pages - free - tree - held
        if missing:
            problems.append(f"{len(missing)} pages leaked (neither free, cached nor held)")
        return problems

    # --- the loop ---------------------------------------------------------------------

    def step(self) -> list[BatchStrOut]:
        """One iteration of event_loop_normal, or of event_loop_overlap (seed 004 §6):
        there, this round is launched and the previous round's results are processed
        while it runs. Returns what the requests produced."""
        self.iteration += 1
        self.bus.iteration = self.iteration
        started = time.monotonic()
        self.process_input_requests(self.recv_requests())
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        scheduled = launched = time.monotonic()
        if batch is not None:
            self.result_queue.append((batch.copy(), self.run_batch(batch)))
            launched = time.monotonic()
        processed_bid, resolved = 0, launched
        # normal: this round's results; overlap: the previous round's, or the last one
        # when nothing new was launched
        if self.result_queue and (self.tp_worker is None or batch is None or len(self.result_queue) > 1):
            done_batch, result = self.result_queue.popleft()
            self.process_batch_result(done_batch, result)
            processed_bid, resolved = result.bid, max(result.resolved, launched)
        elif batch is None:
            self.self_check_during_idle()
        self.last_batch = batch
        if self.bus.wants_snapshots:
            self.bus.publish(self.snapshot(full_tree=False))
        else:
            self._last_tree_snapshot = None  # a later snapshot subscriber gets the whole tree
        if self.bus.active:
            self.bus.emit(
                ev.IterationFinished, started=started, scheduled=scheduled, forwarded=launched, resolved=resolved,
                bid=self.forward_ct if batch is not None else 0, processed_bid=processed_bid,
                forward_mode=batch.forward_mode.name if batch is not None else "",
                rids=tuple(r.rid for r in batch.reqs) if batch is not None else (),
                num_waiting=len(self.waiting_queue), num_running=len(self.running_reqs()),
                token_usage=self.token_usage(), cache_hit_rate=self.cache_hit_rate(),
                new_token_ratio=self.new_token_ratio,
            )
        outputs, self._outputs = self._outputs, []
        return outputs

    def set_schedule_policy(self, name: str) -> None:
        """Order the waiting_queue by ``name`` from the next admission on (the TUI's policy key)."""
        self.server_args.schedule_policy = name
        self.policy = SchedulePolicy(name, self.tree_cache, self.server_args.random_seed)

    def snapshot(self, full_tree: bool = True) -> ev.SchedulerSnapshot:
        """A SchedulerSnapshot of the state now (between iterations it is the state after
        the last one). ``full_tree=False`` leaves the tree out when it has not changed since
        the previous such snapshot (the per-iteration stream does that)."""
        waiting = tuple((r.rid, len(r.origin_input_ids), len(r.prefix_indices)) for r in self.waiting_queue)
        running = tuple((r.rid, r.seqlen, len(r.output_ids), r.sampling_params.max_new_tokens)
                        for r in self.running_reqs())
        tree = tuple((n["id"], -1 if n["parent_id"] is None else n["parent_id"], n["key_len"], tuple(n["key_head"]),
                      n["lock_ref"], n["access_seq"], n["hit_count"]) for n in self.tree_cache.snapshot())
        if not full_tree:
            changed = tree != self._last_tree_snapshot
            self._last_tree_snapshot = tree
            tree = tree if changed else None
        return ev.SchedulerSnapshot(
            iteration=self.iteration, waiting=waiting, running=running,
            chunked_rid=self.chunked_req.rid if self.chunked_req is not None else "",
            pool_total=self.max_total_num_tokens, pool_free=self.token_to_kv_pool_allocator.available_size(),
            pool_evictable=self.tree_cache.evictable_size(), tree=tree, matched_node=self.last_matched_node_id,
            policy=self.server_args.schedule_policy, overlap=self.enable_overlap)

    def shutdown(self) -> None:
        """Finish the round in flight (overlap) and stop the forward worker."""
        while self.result_queue:
            self.process_batch_result(*self.result_queue.popleft())
        if self.tp_worker is not None:
            self.tp_worker.shutdown()

    def running_reqs(self) -> list[Req]:
        """Requests past admission and not finished (the running batch, plus a batch
        just prefilled that merges into it next round)."""
        waiting = set(map(id, self.waiting_queue))
        return [r for r in self.live_reqs() if id(r) not in waiting and r is not self.chunked_req]

    def event_loop_normal(self, stop: Any = None, on_outputs: Any = None) -> None:
        """Run until ``stop()`` is true; block on the request queue while idle."""
        while stop is None or not stop():
            if not self.has_work():
                try:
                    self.request_queue.put(self.request_queue.get(timeout=0.05))
                except queue.Empty:
                    continue
            outputs = self.step()
            if on_outputs is not None and outputs:
                on_outputs(outputs)
