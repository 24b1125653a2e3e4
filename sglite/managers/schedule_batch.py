"""Req, ScheduleBatch and finish reasons (SGLang: managers/schedule_batch.py).

docs/seeds.md §A2-§A4: a ``Req`` lives for the whole request; a ``ScheduleBatch`` is one
round's plan. sglite simplification: the per-round arrays (``input_ids``,
``seq_lens``, ...) are rebuilt from the requests by ``prepare_for_extend`` /
``prepare_for_decode`` instead of being filtered and merged tensor by tensor, so
``filter_batch`` and ``merge_batch`` only edit the request list.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglite.constrained.base_grammar_backend import BaseGrammarObject
from sglite.layers.logits_processor import Candidates, LogprobMetadata, PositionLogprobs
from sglite.mem_cache.memory_pool import num_pages
from sglite.model_executor.forward_batch_info import ForwardMode
from sglite.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglite.managers.schedule_policy import Hold
    from sglite.mem_cache.base_prefix_cache import BasePrefixCache
    from sglite.model_loader.tokenizer import Tokenizer
    from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

# Retraction keeps room for this many decode steps of the requests that stay.
RETRACT_DECODE_STEPS = 20


class BaseFinishReason:
    def __init__(self, is_error: bool = False):
        self.is_error = is_error

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_json()})"


class FINISH_MATCHED_TOKEN(BaseFinishReason):
    def __init__(self, matched: int):
        super().__init__()
        self.matched = matched

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_STR(BaseFinishReason):
    def __init__(self, matched: str):
        super().__init__()
        self.matched = matched

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason):
    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    """``status_code``: SGLang's HTTP status for an abort the server answers as an error
    (503 for the waiting and running timeouts); None: an abort that is a finish reason."""

    def __init__(self, message: str = "Unknown error", is_error: bool = False, status_code: int | None = None):
        super().__init__(is_error=is_error)
        self.message = message
        self.status_code = status_code

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


@dataclass
class ReqLogprobs:
    """What one request asked of logprobs and what it has collected (SGLang keeps these
    as Req fields). Prompt positions from ``start_len`` on: the first has no logprob
    (None, as SGLang's), each later one the logprob of its token given the tokens before
    it; then one entry per output token. Entries are ``(logprob, token id)``; a
    position's top tokens and asked-about tokens are lists of those (None at the first
    prompt position)."""

    input_ids: list[int]
    start_len: int  # resolved: 0 <= start_len < len(input_ids)
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_sent: bool = False  # the prompt's entries went out (with the first token)

    def __post_init__(self) -> None:
        self.input_token_logprobs.append((None, self.input_ids[self.start_len]))
        self.input_top_logprobs.append(None)
        self.input_token_ids_logprobs.append(None)

    def next_input(self) -> int:
        """The prompt index whose logprob comes next (len(input_ids): all are in)."""
        return self.start_len + len(self.input_token_logprobs)

    def rows(self, prefix_len: int, extend_len: int) -> tuple[int, list[int]]:
        """Of a round computing positions [prefix_len, prefix_len + extend_len): the first
        row (counted from prefix_len) whose next prompt token's logprob is due, and those
        tokens. A position predicts the token after it; the last prompt position predicts
        the first output token, whose logprob the sampler gives."""
        first = max(prefix_len, self.next_input() - 1)
        end = min(prefix_len + extend_len, len(self.input_ids) - 1)
        if end <= first:
            return 0, []
        return first - prefix_len, self.input_ids[first + 1 : end + 1]

    def add_input(self, first_index: int, got: PositionLogprobs) -> None:
        """Prompt entries from index ``first_index`` on; those already in are skipped."""
        for j, value in enumerate(got.token_logprobs):
            index = first_index + j
            if index != self.next_input():
                continue
            self.input_token_logprobs.append((value, self.input_ids[index]))
            self.input_top_logprobs.append(_pairs(got.top[j]) if got.top is not None else None)
            self.input_token_ids_logprobs.append(_pairs(got.token_ids[j]) if got.token_ids is not None else None)

    def add_output(self, token_id: int, got: PositionLogprobs) -> None:
        self.output_token_logprobs.append((got.token_logprobs[0], token_id))
        self.output_top_logprobs.append(_pairs(got.top[0]) if got.top else [])
        self.output_token_ids_logprobs.append(_pairs(got.token_ids[0]) if got.token_ids else [])

    def take(self, output_from: int) -> dict[str, list[Any]]:
        """What goes out with the output tokens from ``output_from`` on: their entries and,
        the first time, the prompt's."""
        out: dict[str, list[Any]] = {
            "output_token_logprobs": self.output_token_logprobs[output_from:],
            "output_top_logprobs": self.output_top_logprobs[output_from:],
            "output_token_ids_logprobs": self.output_token_ids_logprobs[output_from:]}
        if not self.input_sent:
            self.input_sent = True
            out.update(input_token_logprobs=self.input_token_logprobs, input_top_logprobs=self.input_top_logprobs,
                       input_token_ids_logprobs=self.input_token_ids_logprobs)
        return out


def _pairs(c: Candidates) -> list[tuple[float, int]]:
    return list(zip(*c))


class Req:
    """One request, from arrival to finish."""

    def __init__(self, rid: str, origin_input_text: str | None, origin_input_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: set[int] | None = None, seed: int = 0,
                 stream: bool = False, tokenizer: "Tokenizer | None" = None, extra_key: str | None = None,
                 logprobs: ReqLogprobs | None = None):
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = origin_input_ids
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids or set()
        self.stream = stream
        self.trace_parent = ""  # W3C traceparent of the HTTP request's span (sglite serve)
        self.tokenizer = tokenizer  # decodes the output's tail to check stop strings
        self.extra_key = extra_key  # (cache_salt) prefixes are shared only within one key; None: the plain tree
        self.logprobs = logprobs  # None: return_logprob was not asked for
        # constrained output: its grammar state (a Future while it compiles in the
        # grammar_queue; then its own matcher, which has accepted exactly output_ids)
        self.grammar: BaseGrammarObject | Future | None = None
        self.grammar_key: tuple[str, str] | None = None
        self.grammar_wait_ct = 0  # grammar_queue polls that found its compile not done
        self.grammar_queued_iteration = 0  # the scheduler iteration it entered the grammar_queue
        self.grammar_steps = self.grammar_refused = 0  # tokens sampled under its mask; of those, argmax refused
        # the random draw for output token n depends only on (sampling_seed, n): a seeded
        # request samples the same tokens however it is batched, chunked or retracted
        self.sampling_seed = sampling_params.seed if sampling_params.seed is not None else seed

        # memory
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.extend_input_len = 0
        self.last_node: Any = None
        self.kv_committed_len = 0  # positions with a KV slot in req_to_token[req_pool_idx]
        # overlap loop: the placeholder (-index into the future map) of the token the
        # in-flight forward samples for this request; None once it is in output_ids
        self.future_token_id: int | None = None

        # state
        self.finished_reason: BaseFinishReason | None = None
        self.to_abort = False
        self.to_abort_message = ""
        self.is_chunked = 0  # chunks scheduled whose result is not processed yet
        self.chunk_index = 0
        self.is_retracted = False
        self.retraction_count = 0
        self.retract_kept_tokens = 0  # at the last retraction: KV tokens left in the radix cache
        self.hold: Hold | None = None  # why admission left it waiting, last round (holds_of_round)
        self.cached_tokens = 0
        self.already_computed = 0
        self.send_token_offset = 0  # output_ids[:send_token_offset] went to the DetokenizerManager already

        # time stamps (time.perf_counter)
        self.created_time = time.perf_counter()
        self.wait_queue_entry_time = self.created_time
        self.forward_entry_time: float | None = None
        self.first_token_time: float | None = None
        self.completion_time: float | None = None

    # --- round input ------------------------------------------------------------------

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seqlen(self) -> int:
        """Tokens in the sequence, counting one still being sampled (overlap loop)."""
        return len(self.origin_input_ids) + len(self.output_ids) + (self.future_token_id is not None)

    def init_next_round_input(self, tree_cache: "BasePrefixCache | None" = None) -> None:
        """fill_ids = prompt + output so far; reuse the longest cached prefix, but
        always compute at least one token so there are logits to sample from, and (as
        SGLang) every position whose logits give a prompt logprob still due."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            limit = len(self.fill_ids) - 1
            if self.logprobs is not None and self.logprobs.next_input() < len(self.origin_input_ids):
                limit = min(limit, self.logprobs.next_input() - 1)
            match = tree_cache.match_prefix(self.fill_ids[:limit], self.extra_key)
            self.prefix_indices, self.last_node = match.device_indices, match.last_device_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        """Back to waiting: output_ids stay, the KV is gone (a cached prefix may stay in
        the radix tree and be matched again on re-admission)."""
        # the tree part of its KV (inserted after its prefill) stays cached, unlocked
        self.retract_kept_tokens = len(self.prefix_indices)
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.extend_input_len = 0
        self.fill_ids = []
        self.kv_committed_len = 0
        self.already_computed = 0
        self.future_token_id = None  # overlap: the in-flight token is dropped, recomputed later
        if isinstance(self.grammar, BaseGrammarObject):
            self.grammar.rollback_to(len(self.output_ids))  # the grammar keeps what output_ids keeps
        self.is_retracted = True
        self.retraction_count += 1
        self.wait_queue_entry_time = time.perf_counter()

    # --- finishing --------------------------------------------------------------------

    def check_finished(self) -> None:
        if self.finished():
            return
        if self.to_abort:
            self.finished_reason = FINISH_ABORT(self.to_abort_message or "aborted")
            return
        if len(self.output_ids) >= self.sampling_params.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(self.sampling_params.max_new_tokens)
            return
        last = self.output_ids[-1] if self.output_ids else None
        if last is not None:
            if (not self.sampling_params.ignore_eos and last in self.eos_token_ids) or (
                last in (self.sampling_params.stop_token_ids or ())
            ):
                self.finished_reason = FINISH_MATCHED_TOKEN(last)
                return
            if isinstance(self.grammar, BaseGrammarObject) and self.grammar.is_terminated():
                self.finished_reason = FINISH_MATCHED_TOKEN(last)  # its stop token, even with ignore_eos

    def check_stop_str(self) -> None:
        """Finish when the output's text now contains a stop string. Only the tail is
        decoded: an occurrence ending in the newest token starts at most ``max_len - 1``
        bytes before it, and every token before it gives at least one byte unless it is
        a special token that decoding skips. The DetokenizerManager trims the stop."""
        stops = self.sampling_params.stop_strs
        if self.finished() or not stops or self.tokenizer is None or not self.output_ids:
            return
        max_len = max(len(stop.encode()) for stop in stops)
        ids, skip = self.output_ids, self.sampling_params.skip_special_tokens
        skipped = self.tokenizer.special_ids if skip else frozenset()
        start, counted = len(ids) - 1, 0
        while start > 0 and counted < max_len - 1:
            start -= 1
            counted += ids[start] not in skipped
        tail = self.tokenizer.decode(ids[start:], skip_special_tokens=skip)
        for stop in stops:
            if stop in tail:
                self.finished_reason = FINISH_MATCHED_STR(stop)
                return

    def meta_info(self) -> dict[str, Any]:
        """What a finished request reports (SGLang's meta_info keys)."""
        now = time.perf_counter()
        return {
            "id": self.rid,
            "prompt_tokens": len(self.origin_input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason.to_json() if self.finished_reason else None,
            "e2e_latency": (self.completion_time or now) - self.created_time,
            "time_to_first_token": (self.first_token_time - self.created_time) if self.first_token_time else None,
            "queue_time": ((self.forward_entry_time or now) - self.created_time),
            "retraction_count": self.retraction_count,
            **({"error": self.finished_reason.message}
               if isinstance(self.finished_reason, FINISH_ABORT) and self.finished_reason.is_error else {}),
        }

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input_len={len(self.origin_input_ids)}, output_len={len(self.output_ids)})"


@dataclass
class ModelWorkerBatch:
    """The scheduler-to-worker snapshot of one round (SGLang's ``ModelWorkerBatch``):
    plain lists and the KV slots to write; no requests, no pools. The worker turns it
    into a ForwardBatch of device tensors (ForwardBatch.init_new)."""

    bid: int  # the batch id (Scheduler.forward_ct)
    iteration: int  # the scheduler iteration that launched it
    forward_mode: ForwardMode
    input_ids: list[int]  # one per row; the overlap loop may put future ids (< 0) here
    req_pool_indices: list[int]
    seq_lens: list[int]  # lengths after this forward
    out_cache_loc: torch.Tensor  # [rows] the KV slot each row writes
    prefix_lens: list[int] = field(default_factory=list)  # extend: tokens already cached
    extend_lens: list[int] = field(default_factory=list)  # extend: rows per request
    extend_num_tokens: int = 0
    sampling_info: SamplingBatchInfo | None = None
    return_all_logits: bool = False
    logprob: LogprobMetadata | None = None


@dataclass
class ScheduleBatch:
    """The plan of one round: which requests, which rows, which KV slots."""

    reqs: list[Req]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool_allocator: "TokenToKVPoolAllocator"
    tree_cache: "BasePrefixCache"
    vocab_size: int = 0
    device: str = "cpu"
    forward_mode: ForwardMode = ForwardMode.IDLE
    input_ids: list[int] = field(default_factory=list)
    req_pool_indices: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    out_cache_loc: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    extend_num_tokens: int = 0
    decoding_reqs: list[Req] = field(default_factory=list)  # the decode tail of a MIXED batch
    chunked_req: Req | None = None
    batch_is_full: bool = False
    sampling_info: SamplingBatchInfo | None = None
    return_all_logits: bool = False
    logprob: LogprobMetadata | None = None  # None: no request of the round asked for logprobs

    @classmethod
    def init_new(cls, reqs: list[Req], req_to_token_pool, token_to_kv_pool_allocator, tree_cache,
                 vocab_size: int, device: str = "cpu", chunked_req: Req | None = None) -> "ScheduleBatch":
        return cls(reqs=reqs, req_to_token_pool=req_to_token_pool,
                   token_to_kv_pool_allocator=token_to_kv_pool_allocator, tree_cache=tree_cache,
                   vocab_size=vocab_size, device=device, chunked_req=chunked_req)

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # --- memory -----------------------------------------------------------------------

    def _evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.token_to_kv_pool_allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def alloc_token_slots(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor:
        page = self.token_to_kv_pool_allocator.page_size
        need = sum(num_pages(s, page) - num_pages(p, page) for p, s in zip(prefix_lens, seq_lens)) * page
        self._evict_for(need)
        loc = self.token_to_kv_pool_allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if loc is None:
            raise RuntimeError(
                f"KV pool out of memory: need {need} slots, "
                f"{self.token_to_kv_pool_allocator.available_size()} free, "
                f"{self.tree_cache.evictable_size()} evictable (the admission budget should prevent this)"
            )
        return loc

    def _last_loc(self, req: Req, pos: int) -> int:
        if pos <= 0:
            return -1
        return int(self.req_to_token_pool.req_to_token[req.req_pool_idx, pos - 1])

    # --- round preparation ------------------------------------------------------------

    def prepare_for_extend(self) -> None:
        """docs/seeds.md §A3: each request computes fill_ids[len(prefix_indices):]."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        slots = self.req_to_token_pool.alloc(len(reqs))
        if slots is None:
            raise RuntimeError("req_to_token_pool is full (max_running_requests should prevent this)")
        for req, idx in zip(reqs, slots):
            req.req_pool_idx = idx
            pre = len(req.prefix_indices)
            if pre:
                self.req_to_token_pool.write(idx, 0, req.prefix_indices)
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        self.extend_lens = [r.extend_input_len for r in reqs]
        self.seq_lens = [len(r.fill_ids) for r in reqs]
        self.req_pool_indices = [r.req_pool_idx for r in reqs]
        self.input_ids = [t for r in reqs for t in r.fill_ids[len(r.prefix_indices):]]
        self.extend_num_tokens = len(self.input_ids)
        last_locs = [self._last_loc(r, p) for r, p in zip(reqs, self.prefix_lens)]
        self.out_cache_loc = self.alloc_token_slots(self.prefix_lens, self.seq_lens, last_locs)
        off = 0
        now = time.perf_counter()
        for req, pre, ext in zip(reqs, self.prefix_lens, self.extend_lens):
            self.req_to_token_pool.write(req.req_pool_idx, pre, self.out_cache_loc[off : off + ext])
            off += ext
            req.kv_committed_len = pre + ext
            req.cached_tokens += max(0, pre - req.already_computed)
            req.already_computed = pre + ext
            req.is_retracted = False
            if req.forward_entry_time is None:
                req.forward_entry_time = now
        self.sampling_info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device)
        self.logprob = logprob_metadata(reqs, self.prefix_lens, self.extend_lens)

    def prepare_for_decode(self) -> None:
        """docs/seeds.md §A4: one new row per request, the token sampled last round (in the
        overlap loop, its future id when that round is still running)."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        self.input_ids = [r.output_ids[-1] if r.future_token_id is None else r.future_token_id for r in reqs]
        self.seq_lens = [r.seqlen for r in reqs]
        self.req_pool_indices = [r.req_pool_idx for r in reqs]
        self.prefix_lens = [s - 1 for s in self.seq_lens]
        self.extend_lens = [1] * len(reqs)
        self.extend_num_tokens = len(reqs)
        last_locs = [self._last_loc(r, s - 1) for r, s in zip(reqs, self.seq_lens)]
        self.out_cache_loc = self.alloc_token_slots(self.prefix_lens, self.seq_lens, last_locs)
        for j, req in enumerate(reqs):
            self.req_to_token_pool.write(req.req_pool_idx, self.seq_lens[j] - 1, self.out_cache_loc[j : j + 1])
            req.kv_committed_len = self.seq_lens[j]
        self.sampling_info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device)
        self.logprob = logprob_metadata(reqs)

    def mix_with_running(self, running_batch: "ScheduleBatch") -> None:
        """ForwardMode.MIXED: the decode tail rides along as 1-token extends after the
        new prefill rows (call running_batch.prepare_for_decode() first). In the overlap
        loop the tail's last tokens may not exist yet: prepare_for_decode gave them
        future ids and counted them in seq_lens (SGLang's ``delta`` of 0 vs -1)."""
        self.forward_mode = ForwardMode.MIXED
        self.decoding_reqs = list(running_batch.reqs)
        self.reqs = self.reqs + running_batch.reqs
        self.input_ids = self.input_ids + running_batch.input_ids
        self.out_cache_loc = torch.cat([self.out_cache_loc, running_batch.out_cache_loc])
        self.req_pool_indices = self.req_pool_indices + running_batch.req_pool_indices
        self.seq_lens = self.seq_lens + running_batch.seq_lens
        self.prefix_lens = self.prefix_lens + [s - 1 for s in running_batch.seq_lens]
        self.extend_lens = self.extend_lens + [1] * running_batch.batch_size()
        self.extend_num_tokens += running_batch.batch_size()
        self.sampling_info = SamplingBatchInfo.from_reqs(self.reqs, self.vocab_size, self.device)
        self.logprob = logprob_metadata(self.reqs, self.prefix_lens, self.extend_lens)

    def get_model_worker_batch(self, bid: int, iteration: int) -> "ModelWorkerBatch":
        """What the model worker needs of this round. The lists are copied: the overlap
        loop plans the next round (editing this batch) while the forward is queued."""
        return ModelWorkerBatch(
            bid=bid, iteration=iteration, forward_mode=self.forward_mode, input_ids=list(self.input_ids),
            req_pool_indices=list(self.req_pool_indices), seq_lens=list(self.seq_lens),
            out_cache_loc=self.out_cache_loc, prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens), extend_num_tokens=self.extend_num_tokens,
            sampling_info=self.sampling_info, return_all_logits=self.return_all_logits, logprob=self.logprob)

    def copy(self) -> "ScheduleBatch":
        """What process_batch_result needs of this round, kept apart from the running
        batch that the next round's planning edits in place."""
        return ScheduleBatch(
            reqs=list(self.reqs), req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, tree_cache=self.tree_cache,
            vocab_size=self.vocab_size, device=self.device, forward_mode=self.forward_mode,
            seq_lens=list(self.seq_lens), out_cache_loc=self.out_cache_loc, prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens), extend_num_tokens=self.extend_num_tokens,
            decoding_reqs=list(self.decoding_reqs), chunked_req=self.chunked_req, logprob=self.logprob,
        )

    def filter_batch(self, chunked_req_to_exclude: Req | None = None) -> None:
        self.reqs = [r for r in self.reqs if not r.finished() and r is not chunked_req_to_exclude]
        self.decoding_reqs = []

    def merge_batch(self, other: "ScheduleBatch") -> None:
        self.reqs = self.reqs + [r for r in other.reqs if r not in self.reqs]

    # --- memory pressure ----------------------------------------------------------------

    def _decode_tokens_needed(self, num_reqs: int) -> int:
        page = self.token_to_kv_pool_allocator.page_size
        return num_reqs * page  # worst case: every request opens a new page

    def check_decode_mem(self, buf_multiplier: int = 1) -> bool:
        need = self._decode_tokens_needed(len(self.reqs)) * buf_multiplier
        if self.token_to_kv_pool_allocator.available_size() >= need:
            return True
        self._evict_for(need)
        return self.token_to_kv_pool_allocator.available_size() >= need

    def retract_decode(self) -> tuple[list[Req], float]:
        """Free KV by sending requests back to the waiting queue: the one with the fewest
        decoded tokens first, ties to the longest prompt; until the rest can decode
        RETRACT_DECODE_STEPS more steps. Returns (retracted, new_token_ratio)."""
        order = sorted(
            range(len(self.reqs)),
            key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []

        def fits() -> bool:
            need = self._decode_tokens_needed(len(order)) * RETRACT_DECODE_STEPS
            return self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() >= need

        while not fits() and len(order) > 1:
            req = self.reqs[order.pop()]
            self.tree_cache.cache_finished_req(req, is_insert=False)
            req.reset_for_retract()
            retracted.append(req)
        kept = [self.reqs[i] for i in sorted(order)]
        self.reqs = kept
        self._evict_for(self._decode_tokens_needed(len(kept)))
        decoded = sum(len(r.output_ids) for r in kept)
        max_new = sum(r.sampling_params.max_new_tokens for r in kept)
        new_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (max_new + 1))
        return retracted, new_ratio


def logprob_metadata(reqs: list[Req], prefix_lens: list[int] | None = None,
                     extend_lens: list[int] | None = None) -> LogprobMetadata | None:
    """The round's logprob asks (None if no request has any); with ``prefix_lens`` and
    ``extend_lens`` (an extend round) the prompt rows each request's due logprobs need."""
    if all(r.logprobs is None for r in reqs):
        return None
    meta = LogprobMetadata([r.logprobs is not None for r in reqs],
                           [r.logprobs.top_logprobs_num if r.logprobs else 0 for r in reqs],
                           [r.logprobs.token_ids_logprob if r.logprobs else None for r in reqs])
    if prefix_lens is None or extend_lens is None:
        return meta
    for r, pre, ext in zip(reqs, prefix_lens, extend_lens):
        start, targets = r.logprobs.rows(pre, ext) if r.logprobs is not None else (0, [])
        meta.extend_logprob_start_lens.append(start)
        meta.extend_logprob_pruned_lens.append(len(targets))
        meta.extend_input_logprob_token_ids += targets
    return meta
