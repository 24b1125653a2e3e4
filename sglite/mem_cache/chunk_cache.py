"""The prefix cache used with ``--disable-radix-cache``: same interface, reuses nothing.

It still serves chunked prefill: between chunks a request keeps the KV it has computed
in ``prefix_indices``, so the next chunk extends it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglite.mem_cache.base_prefix_cache import BasePrefixCache, CachedReq, MatchResult

if TYPE_CHECKING:
    from sglite.mem_cache.radix_cache import TreeNode


class ChunkCache(BasePrefixCache):
    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(self._empty(), None)

    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None:
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : self._allocated_len(req)]
        self.token_to_kv_pool_allocator.free(kv_indices.clone())
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: CachedReq) -> None:
        req.prefix_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)].clone()

    def evict(self, num_tokens: int) -> None:
        pass

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def all_values_flatten(self) -> torch.Tensor:
        return self._empty()
