"""SchedulePolicy (the waiting_queue's order) and PrefillAdder (admission under token
budgets) (SGLang: managers/schedule_policy.py). docs/seeds.md §A3."""

from __future__ import annotations

import random
from collections import defaultdict
from contextlib import contextmanager
from enum import Enum, auto
from typing import TYPE_CHECKING, Iterator

import torch

from sglite.mem_cache.memory_pool import TokenToKVPoolAllocator, page_align_down, page_align_up
from sglite.mem_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import Req, ScheduleBatch
    from sglite.mem_cache.base_prefix_cache import BasePrefixCache

# A running request's future tokens are reserved as min(remaining, CLIP) * ratio, so a
# huge max_new_tokens does not make the scheduler absurdly conservative.
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096
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
            in_batch = self.waiting_queue_radix_tree.match_prefix(ids).device_indices
            if len(in_batch) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                self.temporary_deprioritized.add(req.rid)
            else:
                self.waiting_queue_radix_tree.insert(ids, torch.zeros(len(ids), dtype=torch.int64))

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
        self.can_run_list: list["Req"] = []
        self.new_chunked_req: "Req | None" = None
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

    @staticmethod
    def _future_tokens(req: "Req") -> int:
        """The tokens a request may still generate, clipped: what admission reserves."""
        return min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATION)

    def add_chunked_req(self, req: "Req") -> "Req | None":
        """The request being chunked goes first; returns it while more chunks remain."""
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
            return AddReqResult.NO_TOKEN
        if input_tokens > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
                self.can_run_list.append(req)
                self.tree_cache.inc_lock_ref(req.last_node)
                self._update_prefill_budget(prefix_len, input_tokens, future_tokens)
            else:
                trunc_len = page_align_down(self.rem_chunk_tokens, self.page_size)
                if trunc_len <= 0:
                    return AddReqResult.OTHER
                req.extend_input_len = trunc_len
                req.fill_ids = req.fill_ids[: prefix_len + trunc_len]
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self.tree_cache.inc_lock_ref(req.last_node)
                self._update_prefill_budget(prefix_len, trunc_len, 0)
        return self.budget_state()
