"""The prefix cache used with ``--disable-radix-cache``: same interface, reuses nothing.

It still serves chunked prefill: between chunks a request keeps the KV it has computed
in ``prefix_indices``, so the next chunk extends it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sglite.events import EventBus
from sglite.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult

if TYPE_CHECKING:
    from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from sglite.mem_cache.radix_cache import TreeNode


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        event_bus: EventBus | None = None,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.event_bus = event_bus
        self.device = token_to_kv_pool_allocator.device

    def reset(self) -> None:
        pass

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(self._empty(), None)

    def _kv_len(self, req: Any) -> int:
        # same rule as RadixCache: the last sampled token has no KV yet
        if req.output_ids:
            return len(req.origin_input_ids) + len(req.output_ids) - 1
        return len(req.prefix_indices)

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        n = self._kv_len(req)
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n]
        self.token_to_kv_pool_allocator.free(kv_indices.clone())
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any) -> None:
        req.prefix_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)].clone()

    def evict(self, num_tokens: int) -> None:
        pass

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def all_values_flatten(self) -> torch.Tensor:
        return self._empty()
