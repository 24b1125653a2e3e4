"""Radix tree over token ids whose values are KV slot indices (SGLang's RadixCache).

A node's ``key`` is a run of token ids and its ``value`` the KV slots holding them, so
the path from the root spells a cached prefix and the concatenated values are its KV.
With ``page_size > 1`` every key is a whole number of pages: KV is allocated and freed
by page, so a half page can never be shared.

Ownership: a slot is either free in the allocator, held by exactly one tree node, or
held by exactly one live request (the part of its KV not in the tree). ``insert``
transfers slots from a request to the tree; the caller frees whatever duplicated
slots were already present.

Isolation (SGLang's ``extra_key``, OpenAI's ``cache_salt``): a request with a key lives in
its own subtrees. Every node remembers the key it was inserted under, and a child's key
in ``children`` is ``(extra_key, first token or page)`` when the key is set, the plain
token or page otherwise, so a lookup under one key never enters another key's nodes
(nor the unkeyed ones). Requests without a key (None) share the plain tree.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from sglite.events import CacheEvicted, CacheInserted, EventBus, TreeNodeRow
from sglite.mem_cache.base_prefix_cache import BasePrefixCache, CachedReq, MatchResult
from sglite.mem_cache.cache_miss import EvictionMemory
from sglite.mem_cache.memory_pool import page_align_down

if TYPE_CHECKING:
    from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

# time.monotonic() can return the same value for back-to-back touches; this counter
# breaks those ties so eviction order depends only on the order of accesses.
_access_counter = itertools.count()
_node_id_counter = itertools.count()

SNAPSHOT_KEY_HEAD = 8


class TreeNode:
    def __init__(self, id: int | None = None):
        self.children: dict[Any, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        # the extra_key of every request that reaches this node; the same on the whole
        # path below the root (the root, shared by all keys, has None)
        self.extra_key: str | None = None
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = 0.0
        self.access_seq = 0
        self.hit_count = 0
        self.id = next(_node_id_counter) if id is None else id
        self.touch()

    def touch(self) -> None:
        self.last_access_time = time.monotonic()
        self.access_seq = next(_access_counter)

    @property
    def lru_key(self) -> tuple[float, int]:
        return (self.last_access_time, self.access_seq)

    def __lt__(self, other: TreeNode) -> bool:
        return self.lru_key < other.lru_key

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, key_len={len(self.key)}, lock_ref={self.lock_ref})"


def get_child_key(key: list[int], page_size: int, extra_key: str | None = None) -> Any:
    """The key of the child that ``key`` continues into. A plain token (page) when
    ``extra_key`` is None, so the unkeyed tree is exactly what it was without keys; a
    tuple (str, ...) otherwise, which no plain token or page of ints can equal."""
    plain = key[0] if page_size == 1 else tuple(key[:page_size])
    return plain if extra_key is None else (extra_key, plain)


def _key_match_page_size1(key0: list[int], key1: list[int]) -> int:
    i = 0
    for a, b in zip(key0, key1):
        if a != b:
            break
        i += 1
    return i


def _key_match_paged(key0: list[int], key1: list[int], page_size: int) -> int:
    min_len = min(len(key0), len(key1)) // page_size * page_size
    i = 0
    while i < min_len:
        if key0[i : i + page_size] != key1[i : i + page_size]:
            break
        i += page_size
    return i


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        event_bus: EventBus | None = None,
    ):
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, event_bus)
        self.key_match_fn: Callable[[list[int], list[int]], int]
        self.get_child_key_fn: Callable[[list[int], str | None], Any]
        if page_size == 1:
            self.key_match_fn = _key_match_page_size1
        else:
            self.key_match_fn = lambda k0, k1: _key_match_paged(k0, k1, page_size)
        self.get_child_key_fn = lambda key, extra_key=None: get_child_key(key, page_size, extra_key)
        # what eviction took, so an admission can tell evicted tokens from new ones
        self.evicted_keys = EvictionMemory()
        self.reset()

    # --- tree -----------------------------------------------------------------------

    def reset(self) -> None:
        # per-cache ids (root is 0) keep snapshots and diagrams stable across runs
        self._next_id = itertools.count()
        self.root_node = self._new_node()
        # the root's permanent lock keeps it out of every eviction heap
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def _new_node(self) -> TreeNode:
        return TreeNode(id=next(self._next_id))

    def _page_aligned(self, n: int) -> int:
        return page_align_down(n, self.page_size)

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """The longest cached prefix of ``key`` stored under ``extra_key`` (None: the
        unkeyed tree); an empty match ends at the root whatever the key."""
        key = list(key[: self._page_aligned(len(key))])
        if not key:
            return MatchResult(self._empty(), self.root_node)
        values, last_node = self._match_prefix_helper(self.root_node, key, extra_key)
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(indices, last_node)

    def _match_prefix_helper(self, node: TreeNode, key: list[int],
                             extra_key: str | None) -> tuple[list[torch.Tensor], TreeNode]:
        node.touch()
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self.get_child_key_fn(key, extra_key))
            if child is None:
                break
            assert child.extra_key == extra_key, "a child key names its node's extra_key"
            child.touch()
            prefix_len = self.key_match_fn(child.key, key)
            if prefix_len < len(child.key):
                new_node = self._split_node(child, prefix_len)
                new_node.hit_count += 1
                values.append(new_node.value)
                node = new_node
                break
            child.hit_count += 1
            values.append(child.value)
            node = child
            key = key[prefix_len:]
        return values, node

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; returns the new upper node. Both
        halves keep the lock count, since every lock through the child ran through
        its whole key."""
        assert child.parent is not None and 0 < split_len < len(child.key)
        parent = child.parent
        new_node = self._new_node()
        new_node.parent = parent
        new_node.key = child.key[:split_len]
        new_node.extra_key = child.extra_key
        new_node.value = child.value[:split_len]
        new_node.lock_ref = child.lock_ref
        new_node.hit_count = child.hit_count
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = new_node
        new_node.children = {self.get_child_key_fn(child.key, child.extra_key): child}
        parent.children[self.get_child_key_fn(new_node.key, new_node.extra_key)] = new_node
        return new_node

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Store ``key`` -> ``value`` under ``extra_key``; returns how many leading tokens
        were already present under that key. Their slots in ``value`` are duplicates
        the caller must free; the rest now belong to the tree."""
        aligned = self._page_aligned(len(key))
        key = list(key[:aligned])
        # the tree must not alias a caller's buffer (e.g. a req_to_token row reused later)
        value = value[:aligned].to(device=self.device, dtype=torch.int64).clone()
        if len(value) != len(key):
            raise ValueError(f"insert: key has {len(key)} tokens but value {len(value)} slots")
        return self._insert_helper(self.root_node, key, value, extra_key)

    def _insert_helper(self, node: TreeNode, key: list[int], value: torch.Tensor, extra_key: str | None) -> int:
        node.touch()
        total_prefix_len = 0
        while key:
            child = node.children.get(self.get_child_key_fn(key, extra_key))
            if child is None:
                break
            child.touch()
            prefix_len = self.key_match_fn(child.key, key)
            total_prefix_len += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            node = self._split_node(child, prefix_len) if prefix_len < len(child.key) else child
        if key:
            new_node = self._new_node()
            new_node.parent = node
            new_node.key = key
            new_node.extra_key = extra_key
            new_node.value = value
            node.children[self.get_child_key_fn(key, extra_key)] = new_node
            self.evictable_size_ += len(value)
        return total_prefix_len

    def evict(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        leaves = [n for n in self._collect_leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        num_evicted = 0
        num_nodes = 0
        while num_evicted < num_tokens and leaves:
            x = heapq.heappop(leaves)
            self._remember_evicted(x, num_nodes)
            self.token_to_kv_pool_allocator.free(x.value)
            num_evicted += len(x.value)
            num_nodes += 1
            parent = self._delete_leaf(x)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        if num_nodes and self.event_bus is not None:
            self.event_bus.emit(CacheEvicted, num_tokens=num_evicted, num_nodes=num_nodes)

    def _remember_evicted(self, leaf: TreeNode, lru_rank: int) -> None:
        path: list[list[int]] = []
        node: TreeNode | None = leaf
        while node is not None and node is not self.root_node:
            path.append(node.key)
            node = node.parent
        key = tuple(t for k in reversed(path) for t in k)
        iteration = self.event_bus.iteration if self.event_bus is not None else 0
        self.evicted_keys.record(key, len(key) - len(leaf.key), iteration, lru_rank, leaf.extra_key)

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self.get_child_key_fn(node.key, node.extra_key)]
        node.parent = None
        self.evictable_size_ -= len(node.value)
        return parent

    def _collect_leaves(self) -> list[TreeNode]:
        return [n for n in self._iter_nodes() if not n.children and n is not self.root_node]

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Pre-order, children in insertion order (deterministic for snapshots)."""
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock ``node`` and its ancestors; returns the change in evictable size."""
        delta = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.value)
                self.protected_size_ += len(node.value)
                delta -= len(node.value)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        delta = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.value)
                self.protected_size_ -= len(node.value)
                delta += len(node.value)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return sum(len(n.value) for n in self._iter_nodes() if n is not self.root_node)

    def all_values_flatten(self) -> torch.Tensor:
        values = [n.value for n in self._iter_nodes() if n is not self.root_node]
        return torch.cat(values) if values else self._empty()

    def snapshot(self) -> list[TreeNodeRow]:
        """One row per node; ``access_seq`` as the node's rank in LRU order (0: least
        recently used), so two runs of the same requests give the same rows."""
        nodes = list(self._iter_nodes())
        rank = {n.id: r for r, n in enumerate(sorted(nodes, key=lambda n: n.access_seq))}
        return [TreeNodeRow(n.id, -1 if n.parent is None else n.parent.id, len(n.key),
                            tuple(n.key[:SNAPSHOT_KEY_HEAD]), n.lock_ref, rank[n.id], n.hit_count)
                for n in nodes]

    def pretty_print(self) -> str:
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                head = f"{'  ' * depth}{child.key[:SNAPSHOT_KEY_HEAD]} len={len(child.key)} r={child.lock_ref}"
                lines.append(head if child.extra_key is None else f"{head} extra_key={child.extra_key!r}")
                walk(child, depth + 1)

        walk(self.root_node, 0)
        lines.append(f"#tokens: {self.total_size()}")
        return "\n".join(lines)

    # --- requests -------------------------------------------------------------------

    def _owned_start(self, req: CachedReq) -> int:
        # prefix_indices is tree-owned only up to its last whole page; a chunked
        # request's unaligned tail (see cache_unfinished_req) is still its own
        return self._page_aligned(len(req.prefix_indices))

    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None:
        n = self._kv_len(req)
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : self._allocated_len(req)].clone()
        start = self._owned_start(req)
        free = self.token_to_kv_pool_allocator.free
        if is_insert:
            token_ids = (req.origin_input_ids + req.output_ids)[:n]
            aligned = self._page_aligned(n)
            already = self.insert(token_ids[:aligned], kv_indices[:aligned], req.extra_key)
            if already > start:
                free(kv_indices[start:already])
            free(kv_indices[aligned:])
            if self.event_bus is not None:
                self.event_bus.emit(
                    CacheInserted, rid=req.rid, inserted_len=aligned - already, already_cached_len=already
                )
        else:
            free(kv_indices[start:])
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CachedReq) -> None:
        token_ids = list(req.fill_ids)
        n = len(token_ids)
        idx = req.req_pool_idx
        kv_indices = self.req_to_token_pool.req_to_token[idx, :n].clone()
        aligned = self._page_aligned(n)
        start = self._owned_start(req)
        already = self.insert(token_ids[:aligned], kv_indices[:aligned], req.extra_key)
        if already > start:
            self.token_to_kv_pool_allocator.free(kv_indices[start:already])
        new_indices, new_last_node = self.match_prefix(token_ids[:aligned], req.extra_key)
        assert len(new_indices) == aligned, "a just-inserted prefix must match in full"
        # the freed duplicates must not stay in req_to_token: point those positions at
        # the tree's copy (from the page boundary, so no freed page is left behind)
        self.req_to_token_pool.rewrite(idx, start, new_indices[start:])
        self.inc_lock_ref(new_last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([new_indices, kv_indices[aligned:]])
        req.last_node = new_last_node
        if self.event_bus is not None:
            self.event_bus.emit(CacheInserted, rid=req.rid, inserted_len=aligned - already, already_cached_len=already)
