"""What happens to a round's results (SGLang: managers/scheduler_output_processor_mixin.py,
process_batch_result_prefill/decode and stream_output): each request's sampled token is
appended, its finish checked, and its new tokens sent to the DetokenizerManager. An
object the Scheduler holds, like its observer, rather than a mixin (docs/architecture.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sglite.constrained.base_grammar_backend import BaseGrammarObject
from sglite.managers.io_struct import BatchTokenIDOut
from sglite.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import Req, ScheduleBatch
    from sglite.managers.scheduler import Scheduler
    from sglite.managers.tp_worker import GenerationBatchResult


class SchedulerOutputProcessor:
    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler

    def process_batch_result(self, batch: "ScheduleBatch", result: "GenerationBatchResult") -> None:
        """Append each request's sampled token (a non-final chunk's is dropped), check
        its finish, cache a finished request, and stream per --stream-interval."""
        s = self.scheduler
        next_token_ids = s.tp_worker.resolve_last_batch_result(result)
        s.req_to_token_pool.mark_forward_done(result.bid)
        s.observer.on_batch_result(batch, result)
        decoding = set(map(id, batch.decoding_reqs))
        for i, (req, token_id) in enumerate(zip(batch.reqs, next_token_ids)):
            if result.future_token_ids and req.future_token_id == result.future_token_ids[i]:
                req.future_token_id = None  # no later round of this request is in flight
            if req.finished():
                # aborted while its batch ran, or (overlap) finished by the previous
                # round after this one was planned: the token is dropped, never streamed
                continue
            if req.is_retracted:
                continue  # overlap: retracted while this round ran; recomputed after re-admission
            if req.logprobs is not None:
                add_input_logprobs(req, batch, result, i)
            if batch.forward_mode.is_extend() and id(req) not in decoding and req.is_chunked > 0:
                # a non-final chunk: its sampled token is meaningless
                req.is_chunked -= 1
                req.chunk_index += 1
                s.observer.on_req_chunked(req, batch.seq_lens[i])
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FINISH_LENGTH(0)  # SGLang's scoring request: its prompt, no output token
            else:
                req.output_ids.append(token_id)
                if req.logprobs is not None and result.output_logprobs is not None:
                    req.logprobs.add_output(token_id, result.output_logprobs[i])
                    s.observer.on_token_logprobs(req)
                if isinstance(req.grammar, BaseGrammarObject) and not self.accept_grammar_token(req, result, i):
                    continue  # the grammar refused it: the request failed alone (abort_now answered it)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            req.check_finished()
            req.check_stop_str()
            if isinstance(req.grammar, BaseGrammarObject):
                req.grammar.finished = req.finished()
            if req.finished():
                req.completion_time = time.perf_counter()
                s.tree_cache.cache_finished_req(req)
            # SGLang's stream_interval: the first token, every Nth, and the last
            unsent = len(req.output_ids) - req.send_token_offset
            if req.finished() or req.send_token_offset == 0 or unsent >= s.server_args.stream_interval:
                self.stream_output(req)

    def accept_grammar_token(self, req: "Req", result: "GenerationBatchResult", i: int) -> bool:
        """Advance the request's grammar by its new token (the mask allowed it, so a
        refusal is the engine's fault: that request fails alone, with SGLang's words;
        False then)."""
        s = self.scheduler
        token_id = req.output_ids[-1]
        assert isinstance(req.grammar, BaseGrammarObject)
        try:
            req.grammar.accept_token(token_id)
        except ValueError as e:
            s.abort_now(req, f"Grammar accept_token failed for req {req.rid} with token {token_id}: {e}",
                        is_error=True, status_code=500)
            return False
        step = result.grammar_stats[i] if result.grammar_stats is not None else None
        if step is not None:
            s.observer.on_grammar_step(req, step, token_id)
        return True

    def stream_output(self, req: "Req") -> None:
        """Send the request's new tokens to the detokenizer (and, once finished, what it
        reports)."""
        s = self.scheduler
        new_ids = req.output_ids[req.send_token_offset :]
        logprobs = req.logprobs.take(req.send_token_offset) if req.logprobs is not None else None
        req.send_token_offset = len(req.output_ids)
        finished = req.finished()
        reason = req.finished_reason
        matched = reason.matched if isinstance(reason, FINISH_MATCHED_STR) else None
        params = req.sampling_params
        s.send_to_detokenizer(BatchTokenIDOut(
            req.rid, new_ids, finished, req.meta_info() if finished else {"id": req.rid},
            params.skip_special_tokens, tuple(params.stop_strs), None if params.no_stop_trim else matched, logprobs))
        if finished and not isinstance(reason, FINISH_ABORT):
            s.observer.on_req_finished(req)

    def send_rejected(self, rid: str, prompt_tokens: int, error: str) -> None:
        """A request the entry checks refused: its one finished output, with the error."""
        s = self.scheduler
        s.send_to_detokenizer(BatchTokenIDOut(rid, [], True, {
            "id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": FINISH_ABORT(error, is_error=True).to_json(), "error": error}))
        s.observer.on_req_aborted(rid, error)

    def send_health_check_passed(self, rid: str) -> None:
        """A health probe that came while requests run: answered at once, not run (the
        iteration that read it is proof enough that the scheduler is alive)."""
        self.scheduler.send_to_detokenizer(BatchTokenIDOut(rid, [], True, {
            "id": rid, "prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": None}, "health_check": "answered while busy"}))


def add_input_logprobs(req: "Req", batch: "ScheduleBatch", result: "GenerationBatchResult", i: int) -> None:
    """The prompt logprobs request ``i`` of an extend round computed (none in decode)."""
    got = result.input_logprobs[i] if result.input_logprobs is not None else None
    if got is None or not got.token_logprobs or batch.logprob is None or not batch.forward_mode.is_extend():
        return
    # its first logprob row is prefix + start; the token that row predicts is one later
    assert req.logprobs is not None
    req.logprobs.add_input(batch.prefix_lens[i] + batch.logprob.extend_logprob_start_lens[i] + 1, got)
