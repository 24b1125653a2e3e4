"""SchedulePolicy (the waiting_queue's order) and PrefillAdder (admission under token
budgets) (SGLang: managers/schedule_policy.py). docs/seeds.md §A3."""

from __future__ import annotations

import random
from collections import defaultdict
from contextlib import contextmanager
from enum import Enum, auto
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch

from sglite.mem_cache.memory_pool import TokenToKVPoolAllocator, page_align_down, page_align_up
from sglite.mem_cache.radix_cache import RadixCache

from sglite.server_args import env_knob

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import Req, ScheduleBatch
    from sglite.mem_cache.base_prefix_cache import BasePrefixCache

# A running request's future tokens are reserved as min(remaining, CLIP) * ratio, so a
# huge max_new_tokens does not make the scheduler absurdly conservative.
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096  # SGLang's default of SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
# In-batch prefix caching: a request whose real cache match is this short or shorter...
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
# ...but which shares at least this many tokens with another waiting request waits.
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32
# Above this many waiting requests, prefix matching costs too much: LPM becomes FCFS.
LPM_FALLBACK_QUEUE_LEN = 128


class CacheAwarePolicy(Enum):
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"


class CacheAgnosticPolicy(Enum):
    FCFS = "fcfs"
    LOF = "lof"
    RANDOM = "random"


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: "BasePrefixCache", seed: int = 0):
        self.policy = self._validate_and_adjust_policy(policy, tree_cache)
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        # a radix tree of the waiting prompts (values unused), for in-batch prefix caching
        self.waiting_queue_radix_tree = RadixCache(None, TokenToKVPoolAllocator(1), page_size=1)
        self.temporary_deprioritized: set[str] = set()

    @staticmethod
    def _validate_and_adjust_policy(policy: str, tree_cache: "BasePrefixCache") -> CacheAwarePolicy | CacheAgnosticPolicy:
        try:
            p: CacheAwarePolicy | CacheAgnosticPolicy = CacheAwarePolicy(policy)
        except ValueError:
            p = CacheAgnosticPolicy(policy)
        if isinstance(p, CacheAwarePolicy) and not isinstance(tree_cache, RadixCache):
            return CacheAgnosticPolicy.FCFS  # nothing to be aware of without a cache
        return p

    def calc_priority(self, waiting_queue: list["Req"]) -> None:
        """Reorder waiting_queue in place (a cache-aware policy matches every prefix)."""
        policy = self.policy
        if isinstance(policy, CacheAwarePolicy) and len(waiting_queue) > LPM_FALLBACK_QUEUE_LEN:
            policy = CacheAgnosticPolicy.FCFS
        self.temporary_deprioritized = set()
        if isinstance(policy, CacheAwarePolicy):
            self._compute_prefix_matches(waiting_queue)
            if policy == CacheAwarePolicy.LPM:
                waiting_queue.sort(key=lambda r: (r.rid in self.temporary_deprioritized, -len(r.prefix_indices)))
            else:
                self._sort_by_dfs_weight(waiting_queue)
            return
        if policy == CacheAgnosticPolicy.LOF:
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == CacheAgnosticPolicy.RANDOM:
            self.rng.shuffle(waiting_queue)

    def _compute_prefix_matches(self, waiting_queue: list["Req"]) -> None:
        self.waiting_queue_radix_tree.reset()
        for req in waiting_queue:
            req.init_next_round_input(self.tree_cache)
            if len(req.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                continue
            ids = req.fill_ids
            # keyed like the real cache: waiting for a request of another key would not
            # give a hit, since the two can never share a prefix
            in_batch = self.waiting_queue_radix_tree.match_prefix(ids, req.extra_key).device_indices
            if len(in_batch) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                self.temporary_deprioritized.add(req.rid)
            else:
                self.waiting_queue_radix_tree.insert(ids, torch.zeros(len(ids), dtype=torch.int64), req.extra_key)

    def _sort_by_dfs_weight(self, waiting_queue: list["Req"]) -> None:
        """Walk the radix tree depth first, heavier subtrees (more waiting requests
        below) first, so requests sharing a prefix run next to each other."""
        node_to_reqs: dict[int, list["Req"]] = defaultdict(list)
        for req in waiting_queue:
            node_to_reqs[id(req.last_node)].append(req)
        weight: dict[int, int] = {}

        def calc_weight(node) -> int:  # noqa: ANN001
            w = len(node_to_reqs.get(id(node), ()))
            for child in node.children.values():
                w += calc_weight(child)
            weight[id(node)] = w
            return w

        root = self.tree_cache.root_node
        calc_weight(root)
        out: list["Req"] = []

        def visit(node) -> None:  # noqa: ANN001
            out.extend(node_to_reqs.get(id(node), ()))
            for child in sorted(node.children.values(), key=lambda c: -weight[id(c)]):
                if weight[id(child)]:
                    visit(child)

        visit(root)
        waiting_queue[:] = out


class AddReqResult(Enum):
    CONTINUE = auto()  # admitted; more may fit
    NO_TOKEN = auto()  # the KV pool cannot take it (or anything more)
    OTHER = auto()  # another budget (prefill tokens, chunk) is spent


class Hold(NamedTuple):
    """Why admission left a waiting request in the queue this round: the budget that
    stopped it, what the request needed of it and what was left (tokens; requests for
    max_running_requests). docs/why.md lists every budget."""

    budget: str  # rem_total_tokens, rem_input_tokens, rem_chunk_tokens, max_running_requests,
    #              in_batch_prefix, not_reached, failed_round_trial
    need: int = 0
    have: int = 0
    detail: str = ""  # the numbers behind need and have, in words


# a request passed over for in-batch prefix caching (SchedulePolicy.temporary_deprioritized)
PREFIX_WAIT = Hold("in_batch_prefix", detail="shares a prefix with a request admitted this round: "
                                             "waits one round to hit its cache")


class PrefillAdder:
    """Admits waiting requests into one prefill batch under three budgets:
    rem_total_tokens (KV pool minus what running requests will still need),
    rem_input_tokens (max_prefill_tokens) and rem_chunk_tokens (chunked_prefill_size)."""

    def __init__(
        self,
        page_size: int,
        tree_cache: "BasePrefixCache",
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        running_batch: "ScheduleBatch | None",
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        mixed_with_decode_tokens: int = 0,
        deprioritized: set[str] | None = None,
    ):
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.running_batch = running_batch
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = rem_input_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if rem_chunk_tokens is None else rem_chunk_tokens - mixed_with_decode_tokens
        self.rem_total_token_offset = mixed_with_decode_tokens
        self.cur_rem_token_offset = mixed_with_decode_tokens
        self.deprioritized = deprioritized or set()
        # checked when the engine started (ServerArgs)
        self.clip_max_new_tokens = env_knob("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", CLIP_MAX_NEW_TOKENS_ESTIMATION, int)
        self.can_run_list: list["Req"] = []
        self.new_chunked_req: "Req | None" = None
        self.hold: Hold | None = None  # why the last request offered was not admitted
        self.continued: "Req | None" = None  # the chunked request whose next chunk runs
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        if running_batch is not None:
            self.rem_total_token_offset += sum(self._future_tokens(r) * new_token_ratio for r in running_batch.reqs)

    @property
    def rem_total_tokens(self) -> float:
        return (self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
                - self.rem_total_token_offset)

    @property
    def cur_rem_tokens(self) -> float:
        return (self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
                - self.cur_rem_token_offset)

    def ceil_paged_tokens(self, n: int) -> int:
        return page_align_up(n, self.page_size)

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        extend_input_len = self.ceil_paged_tokens(extend_input_len)
        self.rem_total_token_offset += extend_input_len + max_new_tokens
        self.cur_rem_token_offset += extend_input_len
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    @contextmanager
    def _lock_node(self, node) -> Iterator[None]:  # noqa: ANN001
        # lock while deciding, so that counting this prefix as evictable cannot happen
        self.tree_cache.inc_lock_ref(node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(node)

    def _future_tokens(self, req: "Req") -> int:
        """The tokens a request may still generate, clipped: what admission reserves."""
        return min(req.sampling_params.max_new_tokens - len(req.output_ids), self.clip_max_new_tokens)

    def add_chunked_req(self, req: "Req") -> "Req | None":
        """The request being chunked goes first; returns it while more chunks remain."""
        self.continued = req
        chunk = self.rem_chunk_tokens if self.rem_chunk_tokens is not None else req.extend_input_len
        truncated = req.extend_input_len > chunk
        req.extend_input_len = min(req.extend_input_len, chunk)
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_prefill_budget(0, req.extend_input_len, 0 if truncated else self._future_tokens(req))
        return req if truncated else None

    def add_one_req(self, req: "Req") -> AddReqResult:
        if req.rid in self.deprioritized and self.can_run_list:
            # in-batch prefix caching: let the request sharing its prefix fill the cache
            # this round; this one hits it next round
            return AddReqResult.CONTINUE
        future_tokens = self._future_tokens(req)
        total_tokens = req.extend_input_len + future_tokens
        input_tokens = self.ceil_paged_tokens(req.extend_input_len)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return self._held_by_pool(req, future_tokens)
        if input_tokens > self.rem_input_tokens and self.can_run_list:
            self.hold = Hold("rem_input_tokens", input_tokens, self.rem_input_tokens,
                             f"{input_tokens} tokens to prefill > {self.rem_input_tokens} left of max_prefill_tokens")
            return AddReqResult.OTHER
        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:
                return self._held_by_pool(req, future_tokens)
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
                self.can_run_list.append(req)
                self.tree_cache.inc_lock_ref(req.last_node)
                self._update_prefill_budget(prefix_len, input_tokens, future_tokens)
            else:
                trunc_len = page_align_down(self.rem_chunk_tokens, self.page_size)
                if trunc_len <= 0:
                    self.hold = Hold("rem_chunk_tokens", self.page_size, self.rem_chunk_tokens,
                                     f"{self.rem_chunk_tokens} left of chunked_prefill_size, less than a page")
                    return AddReqResult.OTHER
                req.extend_input_len = trunc_len
                req.fill_ids = req.fill_ids[: prefix_len + trunc_len]
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self.tree_cache.inc_lock_ref(req.last_node)
                self._update_prefill_budget(prefix_len, trunc_len, 0)
        return self.budget_state()

    def _held_by_pool(self, req: "Req", future_tokens: int) -> AddReqResult:
        """NO_TOKEN: the KV pool, less what running requests may still need, cannot
        take this request's prompt plus its reserve of new tokens."""
        pool = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        need, have = req.extend_input_len + future_tokens, int(self.rem_total_tokens)
        self.hold = Hold("rem_total_tokens", need, have, (
            f"needs {req.extend_input_len} tokens to prefill + {future_tokens} reserved new tokens = {need}; "
            f"pool free+evictable {pool} - running requests' reserve and this round's admissions "
            f"{int(self.rem_total_token_offset)} (new_token_ratio {self.new_token_ratio:.3f}) = {have}"))
        return AddReqResult.NO_TOKEN


def holds_of_round(waiting: list["Req"], stop: str, stopped_at: "Req | None", adder: "PrefillAdder | None",
                   running: int, max_running: int) -> list[tuple["Req", Hold]]:
    """Why each request still waiting after an admission round was not admitted.
    ``stop``: why admission stopped (AddReqResult name, MAX_RUNNING_REQUESTS, ...);
    ``stopped_at``: the request it stopped at: refused by the adder (NO_TOKEN, OTHER) or
    the first one not offered (MAX_RUNNING_REQUESTS); None when it stopped before
    offering any, or after admitting the last one it offered."""
    admitted = len(adder.can_run_list) if adder else 0
    refused = stopped_at is not None and stop in ("NO_TOKEN", "OTHER")
    if stop == "MAX_RUNNING_REQUESTS":
        first = Hold("max_running_requests", running + admitted + 1, max_running,
                     f"{running} running + {admitted} admitted this round = max_running_requests {max_running}")
    elif stop == "FAILED_ROUND_TRIAL":
        first = Hold("failed_round_trial", detail="a failed round's requests re-run one at a time, alone")
    elif refused and adder is not None and adder.hold is not None:
        first = adder.hold
    elif adder is not None and stop in ("NO_TOKEN", "OTHER"):
        first = _spent_budget(adder)
    else:  # the queue ran out: only in-batch-prefix waits
        return [(r, PREFIX_WAIT) for r in waiting if adder is not None and r.rid in adder.deprioritized]
    past_stop = stopped_at is None  # stopped before offering any: every request held by `first`
    # behind a refused request: one Hold for them all (this runs every round, over the whole queue)
    behind = Hold("not_reached", detail=f"admission stopped at {stopped_at.rid} ({first.budget})") if (
        refused and stopped_at is not None) else first
    holds: list[tuple["Req", Hold]] = []
    for req in waiting:
        if req is stopped_at:
            past_stop = True
            holds.append((req, first))
        elif past_stop:
            holds.append((req, behind))
        elif adder is not None and req.rid in adder.deprioritized:
            holds.append((req, PREFIX_WAIT))
    return holds


def _spent_budget(adder: "PrefillAdder") -> Hold:
    """A budget ran out before this request was offered: spent by the requests admitted
    before it (the chunked request's next chunk, the decode rows of a mixed batch)."""
    by = ", ".join(r.rid for r in adder.can_run_list) or "the running requests"
    if adder.rem_total_tokens <= 0 or adder.cur_rem_tokens <= 0:
        return Hold("rem_total_tokens", 0, int(adder.rem_total_tokens), f"the KV pool is spent this round (by {by})")
    if adder.rem_chunk_tokens is not None and adder.rem_chunk_tokens <= 0:
        return Hold("rem_chunk_tokens", 0, adder.rem_chunk_tokens, f"the chunk budget is spent this round (by {by})")
    return Hold("rem_input_tokens", 0, adder.rem_input_tokens, f"max_prefill_tokens is spent this round (by {by})")
