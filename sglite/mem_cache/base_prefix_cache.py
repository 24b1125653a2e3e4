"""The interface the scheduler uses for prefix reuse, whether or not the radix cache is on.

``RadixCache`` shares KV slots between requests with a common prefix; ``ChunkCache``
(cache disabled) keeps the same methods and reuses nothing, so the scheduler never
branches on which one it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from sglite.mem_cache.cache_miss import EvictionMemory
    from sglite.events import EventBus, TreeNodeRow
    from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


class MatchResult(NamedTuple):
    """``device_indices``: KV slots (int64) of the matched prefix, in token order.
    ``last_device_node``: the node the match ended in (root when nothing matched;
    ``None`` from ``ChunkCache``). A request locks this node while it uses the slots."""

    device_indices: torch.Tensor
    last_device_node: Any  # RadixCache's TreeNode, or None (typed Any as in SGLang: no import of radix_cache)


class CachedReq(Protocol):
    """What a cache reads and writes of a request (managers/schedule_batch.py's Req
    has it; tests may pass anything shaped the same)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int | None
    prefix_indices: torch.Tensor
    last_node: Any  # the TreeNode it locks (RadixCache), or None
    kv_committed_len: int
    extra_key: str | None  # its cache key: shares prefixes only with requests of the same key


class BasePrefixCache(ABC):
    def __init__(
        self,
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        page_size: int = 1,
        event_bus: "EventBus | None" = None,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.event_bus = event_bus
        self.device = token_to_kv_pool_allocator.device
        # what eviction took (RadixCache); None: no prefix matching, every token is computed
        self.evicted_keys: EvictionMemory | None = None

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    @staticmethod
    def _kv_len(req: CachedReq) -> int:
        """Positions of ``req`` that have KV. The last sampled token has none yet; a
        request with no output (aborted between prefill chunks) holds exactly its
        ``prefix_indices``; one retracted and re-prefilled in chunks holds only the
        chunks computed so far (``kv_committed_len``: its output alone said more, and
        freeing that many slots freed other requests' pages)."""
        if req.output_ids:
            return min(len(req.origin_input_ids) + len(req.output_ids) - 1, req.kv_committed_len)
        return len(req.prefix_indices)

    @classmethod
    def _allocated_len(cls, req: CachedReq) -> int:
        """Positions holding a KV slot: ``_kv_len``, and in the overlap loop also the
        slot of a round still running for a request that has already finished."""
        return max(cls._kv_len(req), req.kv_committed_len)

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """The longest cached prefix of ``key`` among those stored under ``extra_key``
        (SGLang's RadixKey.extra_key); None matches only what was stored with None."""

    @abstractmethod
    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: CachedReq) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> None: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int: ...

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    @abstractmethod
    def all_values_flatten(self) -> torch.Tensor: ...

    def snapshot(self) -> list["TreeNodeRow"]:
        return []

    def pretty_print(self) -> str:
        return ""
