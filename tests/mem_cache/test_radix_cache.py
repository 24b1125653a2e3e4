from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglite.events import CacheEvicted, CacheInserted, EventBus, EventLog
from tests.mem_cache.fakes import FakeReq
from sglite.mem_cache.cache_miss import classify
from sglite.mem_cache.chunk_cache import ChunkCache
from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sglite.mem_cache.radix_cache import RadixCache, TreeNode




def make_cache(page_size: int = 1, pool_size: int = 64, bus: EventBus | None = None):
    req_pool = ReqToTokenPool(size=8, max_context_len=64)
    alloc = TokenToKVPoolAllocator(size=pool_size, page_size=page_size)
    return RadixCache(req_pool, alloc, page_size=page_size, event_bus=bus), req_pool, alloc


def insert_fresh(cache: RadixCache, key: list[int], extra_key: str | None = None) -> tuple[int, torch.Tensor]:
    """Insert ``key`` with newly allocated slots, freeing the duplicates as a caller must."""
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    assert slots is not None
    already = cache.insert(key, slots, extra_key)
    cache.token_to_kv_pool_allocator.free(slots[:already])
    return already, slots


def path_to(node: TreeNode) -> list[TreeNode]:
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


def path_key(node: TreeNode | None) -> tuple[int, ...]:
    return tuple(t for n in path_to(node) for t in n.key) if node is not None else ()


def path_value(node: TreeNode | None) -> list[int]:
    return [s for n in path_to(node) for s in n.value.tolist()] if node is not None else []


def iter_nodes(cache: RadixCache):
    stack = [cache.root_node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def check_tree(cache: RadixCache) -> set[int]:
    """Structural invariants; returns the set of slots the tree holds."""
    ps = cache.page_size
    root = cache.root_node
    assert root.parent is None and root.key == [] and root.lock_ref == 1
    slots: list[int] = []
    evictable = protected = 0
    for node in iter_nodes(cache):
        for ck, child in node.children.items():
            assert child.parent is node
            expected_ck = child.key[0] if ps == 1 else tuple(child.key[:ps])
            if child.extra_key is not None:
                expected_ck = (child.extra_key, expected_ck)
            assert ck == expected_ck
        if node is root:
            continue
        if node.parent is not root:
            assert node.extra_key == node.parent.extra_key, "a subtree holds one extra_key"
        assert len(node.key) > 0 and len(node.key) % ps == 0
        assert len(node.value) == len(node.key) and node.value.dtype == torch.int64
        assert node.lock_ref >= 0
        if node.parent is not root:
            assert node.parent.lock_ref >= node.lock_ref
        vals = node.value.tolist()
        # the tree holds whole allocator pages
        for i in range(0, len(vals), ps):
            assert vals[i] % ps == 0 and vals[i : i + ps] == list(range(vals[i], vals[i] + ps))
        slots += vals
        if node.lock_ref == 0:
            evictable += len(vals)
        else:
            protected += len(vals)
    assert len(slots) == len(set(slots)), "a slot held by two tree nodes"
    assert cache.evictable_size() == evictable
    assert cache.protected_size() == protected
    assert cache.total_size() == evictable + protected == len(slots)
    assert sorted(cache.all_values_flatten().tolist()) == sorted(slots)
    return set(slots)


def check_free_list(alloc: TokenToKVPoolAllocator) -> set[int]:
    assert len(alloc.free_pages) == len(set(alloc.free_pages)), "double free"
    return alloc.debug_free_slots()


def all_slots(alloc: TokenToKVPoolAllocator) -> set[int]:
    return set(range(alloc.page_size, alloc.size + alloc.page_size))


# --- examples -------------------------------------------------------------------------


def test_match_splits_node():
    cache, _, alloc = make_cache()
    _, slots = insert_fresh(cache, [1, 2, 3, 4, 5])
    res = cache.match_prefix([1, 2, 3, 9])
    assert res.device_indices.tolist() == slots[:3].tolist()
    assert res.device_indices.dtype == torch.int64
    node = res.last_device_node
    assert node.key == [1, 2, 3] and node.parent is cache.root_node
    assert list(node.children) == [4]
    assert node.children[4].key == [4, 5]
    assert node.children[4].value.tolist() == slots[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == slots.tolist()
    check_tree(cache)


def test_match_nothing_returns_root():
    cache, _, _ = make_cache()
    insert_fresh(cache, [1, 2])
    for key in ([], [7], [2, 1]):
        res = cache.match_prefix(key)
        assert res.device_indices.numel() == 0
        assert res.last_device_node is cache.root_node


def test_insert_returns_already_present_len():
    cache, _, alloc = make_cache()
    assert insert_fresh(cache, [1, 2, 3, 4, 5])[0] == 0
    assert insert_fresh(cache, [1, 2, 3, 6, 7])[0] == 3
    assert insert_fresh(cache, [1, 2, 3, 4, 5, 8])[0] == 5
    assert insert_fresh(cache, [1, 2])[0] == 2  # splits [1,2,3] into [1,2] + [3]
    assert insert_fresh(cache, [1, 2, 3, 4, 5])[0] == 5
    assert cache.total_size() == 8  # 1,2,3 | 4,5 | 8 | 6,7
    check_tree(cache)
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)


def test_insert_keeps_its_own_copy_of_value():
    cache, _, _ = make_cache()
    buf = torch.tensor([10, 11, 12])
    cache.insert([1, 2, 3], buf)
    buf[:] = 0
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == [10, 11, 12]


def test_evict_lru_order_and_event():
    bus = EventBus()
    log = EventLog()
    bus.subscribe(log)
    cache, _, alloc = make_cache(bus=bus)
    _, a = insert_fresh(cache, [1, 1])
    _, b = insert_fresh(cache, [2, 2])
    _, c = insert_fresh(cache, [3, 3])
    cache.match_prefix([1, 1])  # A becomes the most recent
    cache.evict(1)
    assert cache.match_prefix([2, 2]).device_indices.numel() == 0
    assert b.tolist()[0] in alloc.debug_free_slots()
    cache.evict(2)
    assert cache.match_prefix([3, 3]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1]).device_indices.tolist() == a.tolist()
    ev = log.of(CacheEvicted)
    assert [(e.num_tokens, e.num_nodes) for e in ev] == [(2, 1), (2, 1)]
    cache.evict(100)
    assert cache.total_size() == 0
    assert alloc.available_size() == alloc.size
    cache.evict(100)  # nothing left: no event
    assert len(log.of(CacheEvicted)) == 3


def test_evict_reaches_parent_after_children():
    cache, _, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 3, 5])
    insert_fresh(cache, [9])
    cache.match_prefix([9])  # [9] is newest, so the [1,2,3] subtree goes first
    cache.evict(3)
    assert cache.total_size() == 1
    assert list(cache.root_node.children) == [9]
    check_tree(cache)


def test_locked_nodes_never_evicted():
    cache, _, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7])
    node = cache.match_prefix([1, 2, 3, 4]).last_device_node
    assert cache.inc_lock_ref(node) == -4  # [1,2] and [3,4] move to protected
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert cache.inc_lock_ref(node) == 0
    cache.evict(100)
    assert cache.total_size() == 4
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.numel() == 4
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    cache.evict(100)
    assert cache.total_size() == 0
    assert alloc.available_size() == alloc.size


def test_split_of_locked_node_keeps_lock():
    cache, _, _ = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_device_node
    cache.inc_lock_ref(node)
    upper = cache.match_prefix([1, 2, 9]).last_device_node
    assert upper.key == [1, 2] and upper.lock_ref == 1 and node.parent is upper
    insert_fresh(cache, [1, 2, 5])
    check_tree(cache)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 5
    check_tree(cache)


def test_lock_root_and_none_is_noop():
    cache, _, _ = make_cache()
    assert cache.inc_lock_ref(cache.root_node) == 0
    assert cache.dec_lock_ref(cache.root_node) == 0
    assert cache.inc_lock_ref(None) == 0
    assert cache.root_node.lock_ref == 1


@pytest.mark.parametrize("ps", [2, 4])
def test_paged_match_and_insert_alignment(ps):
    cache, _, alloc = make_cache(page_size=ps)
    key = list(range(1, 2 * ps + 2))  # two pages and one extra token
    slots = alloc.alloc(2 * ps)
    assert cache.insert(key, slots) == 0  # the extra token is dropped
    assert cache.total_size() == 2 * ps
    assert cache.match_prefix(key).device_indices.tolist() == slots.tolist()
    # a partial page never matches
    assert cache.match_prefix(key[: 2 * ps - 1]).device_indices.tolist() == slots[:ps].tolist()
    assert cache.match_prefix(key[: ps - 1]).last_device_node is cache.root_node
    # a mismatch inside page 2 splits at the page boundary
    res = cache.match_prefix(key[:ps] + [99] * ps)
    assert res.device_indices.tolist() == slots[:ps].tolist()
    upper = res.last_device_node
    assert upper.key == key[:ps]
    assert list(upper.children) == [tuple(key[ps : 2 * ps])]
    assert list(cache.root_node.children) == [tuple(key[:ps])]
    # sharing the first token of page 2 but not the whole page shares nothing there
    other = key[:ps] + [key[ps]] + [99] * (ps - 1)
    assert insert_fresh(cache, other)[0] == ps
    assert len(upper.children) == 2
    check_tree(cache)
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)


def test_snapshot_and_reset():
    cache, _, _ = make_cache()
    insert_fresh(cache, [1, 2, 3, 4, 5])
    res = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(res.last_device_node)
    snap = cache.snapshot()
    by_id = {d.id: d for d in snap}
    assert snap[0].id == 0 and snap[0].parent_id == -1
    upper = by_id[res.last_device_node.id]
    # access_seq breaks last_access_time ties: the matched node was touched after its child
    lower_id = next(d.id for d in snap if d.parent_id == upper.id)
    assert upper.access_seq > by_id[lower_id].access_seq
    assert upper.key_head == (1, 2, 3) and upper.lock_ref == 1 and upper.hit_count == 1
    lower = [d for d in snap if d.parent_id == upper.id]
    assert len(lower) == 1 and lower[0].key_len == 2 and lower[0].lock_ref == 0
    assert "#tokens: 5" in cache.pretty_print()
    cache.reset()
    assert cache.total_size() == 0 and cache.snapshot()[0].id == 0 and len(cache.snapshot()) == 1


# --- request level --------------------------------------------------------------------


def run_prefill(cache, req_pool, alloc, req: FakeReq, upto: int | None = None) -> None:
    """Admit (match + lock) if new, then compute positions up to ``upto`` (default all)."""
    if req.req_pool_idx is None:
        req.req_pool_idx = req_pool.alloc(1)[0]
        req.fill_ids = req.origin_input_ids + req.output_ids
        res = cache.match_prefix(req.fill_ids[:-1], req.extra_key)
        req.prefix_indices, req.last_node = res.device_indices, res.last_device_node
        cache.inc_lock_ref(req.last_node)
        req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        req.kv_committed_len = len(req.prefix_indices)
    start = len(req.prefix_indices)
    end = len(req.origin_input_ids) if upto is None else upto
    last = int(req_pool.req_to_token[req.req_pool_idx, start - 1]) if start else -1
    out = alloc.alloc_extend([start], [end], [last])
    req_pool.write(req.req_pool_idx, start, out)
    req.kv_committed_len = end
    req.fill_ids = req.origin_input_ids[:end]


def run_decode(req_pool, alloc, req: FakeReq, token: int) -> None:
    seq_len = len(req.origin_input_ids) + len(req.output_ids)
    last = int(req_pool.req_to_token[req.req_pool_idx, seq_len - 2])
    out = alloc.alloc_decode([seq_len], [last])
    req_pool.write(req.req_pool_idx, seq_len - 1, out)
    req.kv_committed_len = seq_len
    req.output_ids.append(token)


def test_cache_finished_req_inserts_and_frees_duplicates():
    bus = EventBus()
    log = EventLog()
    bus.subscribe(log)
    cache, req_pool, alloc = make_cache(bus=bus)
    r1 = FakeReq("r1", [1, 2, 3, 4])
    run_prefill(cache, req_pool, alloc, r1)
    r1.output_ids.append(5)
    run_decode(req_pool, alloc, r1, 6)  # KV for [1,2,3,4,5]; 6 has none yet
    cache.cache_finished_req(r1)
    assert r1.req_pool_idx is None and req_pool.available_size() == req_pool.size
    assert cache.total_size() == 5 and alloc.available_size() == alloc.size - 5
    # r2 computes [1,2,3] itself (it arrived before r1 finished) and shares them
    r2 = FakeReq("r2", [1, 2, 3, 4, 7])
    r2.req_pool_idx = req_pool.alloc(1)[0]
    r2.fill_ids = list(r2.origin_input_ids)
    run_prefill(cache, req_pool, alloc, r2)
    r2.output_ids.append(8)
    cache.cache_finished_req(r2)
    assert cache.total_size() == 6
    assert alloc.available_size() == alloc.size - 6
    assert [(e.rid, e.inserted_len, e.already_cached_len) for e in log.of(CacheInserted)] == [
        ("r1", 5, 0),
        ("r2", 1, 4),
    ]
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)


def test_cache_finished_req_with_hit_and_lock():
    cache, req_pool, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3])
    r = FakeReq("r", [1, 2, 3, 4])
    run_prefill(cache, req_pool, alloc, r)
    assert len(r.prefix_indices) == 3 and r.last_node.lock_ref == 1
    assert cache.protected_size() == 3
    r.output_ids.append(9)
    cache.cache_finished_req(r)
    assert cache.protected_size() == 0 and cache.total_size() == 4
    assert alloc.available_size() == alloc.size - 4


def test_cache_finished_req_without_insert_frees_own_slots():
    cache, req_pool, alloc = make_cache()
    insert_fresh(cache, [1, 2])
    r = FakeReq("r", [1, 2, 3, 4])
    run_prefill(cache, req_pool, alloc, r)
    r.output_ids.append(9)
    run_decode(req_pool, alloc, r, 10)
    cache.cache_finished_req(r, is_insert=False)
    assert cache.total_size() == 2 and cache.protected_size() == 0
    assert alloc.available_size() == alloc.size - 2


def test_cache_finished_req_paged_frees_unaligned_tail():
    cache, req_pool, alloc = make_cache(page_size=4, pool_size=32)
    r = FakeReq("r", list(range(1, 7)))  # 6 prompt tokens
    run_prefill(cache, req_pool, alloc, r)
    r.output_ids.append(50)
    run_decode(req_pool, alloc, r, 51)  # KV for 7 tokens: one page + 3
    assert alloc.available_size() == 32 - 8
    cache.cache_finished_req(r)
    assert cache.total_size() == 4
    assert alloc.available_size() == 32 - 4
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)


@pytest.mark.parametrize("ps", [1, 2, 4])
def test_cache_unfinished_req_chunks(ps):
    cache, req_pool, alloc = make_cache(page_size=ps, pool_size=64)
    prompt = list(range(1, 12))
    r = FakeReq("r", prompt)
    run_prefill(cache, req_pool, alloc, r, upto=5)
    cache.cache_unfinished_req(r)
    aligned = 5 // ps * ps
    assert len(r.prefix_indices) == 5
    assert r.req_pool_idx is not None
    assert cache.total_size() == aligned
    assert r.prefix_indices.tolist() == req_pool.req_to_token[r.req_pool_idx, :5].tolist()
    if aligned:
        assert path_key(r.last_node) == tuple(prompt[:aligned]) and r.last_node.lock_ref == 1
    run_prefill(cache, req_pool, alloc, r, upto=9)
    cache.cache_unfinished_req(r)
    assert len(r.prefix_indices) == 9 and cache.total_size() == 9 // ps * ps
    assert cache.protected_size() == 9 // ps * ps
    run_prefill(cache, req_pool, alloc, r)
    r.output_ids.append(99)
    cache.cache_finished_req(r)
    assert cache.protected_size() == 0 and cache.total_size() == 11 // ps * ps
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)
    cache.evict(1000)
    assert alloc.available_size() == alloc.size


def test_cache_unfinished_req_rewrites_duplicates_to_tree_slots():
    """A chunked request whose next chunk was meanwhile cached by another request must
    point req_to_token at the tree's slots, since its own copies are freed."""
    ps = 2
    cache, req_pool, alloc = make_cache(page_size=ps)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    r = FakeReq("r", prompt)
    run_prefill(cache, req_pool, alloc, r, upto=3)
    cache.cache_unfinished_req(r)  # tree: [1,2]; r owns position 2
    other = FakeReq("o", prompt[:6])
    run_prefill(cache, req_pool, alloc, other)
    other.output_ids.append(0)
    cache.cache_finished_req(other)  # tree: [1,2,3,4,5,6]
    run_prefill(cache, req_pool, alloc, r, upto=6)
    cache.cache_unfinished_req(r)
    tree_slots = cache.match_prefix(prompt[:6]).device_indices.tolist()
    assert req_pool.req_to_token[r.req_pool_idx, :6].tolist() == tree_slots
    assert r.prefix_indices.tolist() == tree_slots
    free = check_free_list(alloc)
    assert not set(tree_slots) & free
    run_prefill(cache, req_pool, alloc, r)
    r.output_ids.append(0)
    cache.cache_finished_req(r)
    cache.evict(1000)
    assert alloc.available_size() == alloc.size


# --- property tests -------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=12)


EXTRA_KEYS = st.sampled_from([None, "a", "b"])


class TreeMachine(RuleBasedStateMachine):
    """insert / match / lock / unlock / evict, each under one of a few extra keys (None:
    the plain tree), against a model of the stored prefixes that keeps each key's apart."""

    @initialize(ps=st.sampled_from([1, 2, 4]))
    def setup(self, ps: int) -> None:
        self.ps = ps
        self.cache, _, self.alloc = make_cache(page_size=ps, pool_size=48)
        # (extra_key, stored page-aligned prefix) -> the slots of its last page
        self.stored: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}
        self.locked: list[TreeNode] = []

    def _expected_match(self, key: list[int], ek: str | None) -> tuple[int, list[int]]:
        key = key[: len(key) // self.ps * self.ps]
        j = 0
        while j + self.ps <= len(key) and (ek, tuple(key[: j + self.ps])) in self.stored:
            j += self.ps
        return j, [s for i in range(self.ps, j + 1, self.ps) for s in self.stored[(ek, tuple(key[:i]))]]

    @rule(key=TOKENS, ek=EXTRA_KEYS)
    def insert(self, key: list[int], ek: str | None) -> None:
        key = key[: len(key) // self.ps * self.ps]
        slots = self.alloc.alloc(len(key))
        if slots is None:
            return
        expected_already, _ = self._expected_match(key, ek)
        already = self.cache.insert(key, slots, ek)
        assert already == expected_already
        self.alloc.free(slots[:already])
        for i in range(already + self.ps, len(key) + 1, self.ps):
            self.stored[(ek, tuple(key[:i]))] = slots[i - self.ps : i].tolist()

    @rule(key=TOKENS, ek=EXTRA_KEYS)
    def match(self, key: list[int], ek: str | None) -> None:
        j, slots = self._expected_match(key, ek)
        res = self.cache.match_prefix(key, ek)
        assert res.device_indices.tolist() == slots
        node = res.last_device_node
        assert path_key(node) == tuple(key[:j])
        assert node is self.cache.root_node or node.extra_key == ek

    @rule(key=TOKENS, ek=EXTRA_KEYS)
    def lock(self, key: list[int], ek: str | None) -> None:
        node = self.cache.match_prefix(key, ek).last_device_node
        before = self.cache.evictable_size()
        delta = self.cache.inc_lock_ref(node)
        assert self.cache.evictable_size() == before + delta
        self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node = self.locked.pop(i % len(self.locked))
        before = self.cache.evictable_size()
        delta = self.cache.dec_lock_ref(node)
        assert self.cache.evictable_size() == before + delta

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before_free, before_total = self.alloc.available_size(), self.cache.total_size()
        self.cache.evict(n)
        evicted = before_total - self.cache.total_size()
        assert self.alloc.available_size() == before_free + evicted
        if evicted < n:
            assert self.cache.evictable_size() == 0
        for node in self.locked:
            assert node.parent is not None or node is self.cache.root_node, "locked node evicted"
        # evicted prefixes are gone together with all their extensions
        remaining = [(node.extra_key, path_key(node)) for node in iter_nodes(self.cache)]
        self.stored = {k: v for k, v in self.stored.items()
                       if any(ek == k[0] and p[: len(k[1])] == k[1] for ek, p in remaining)}
        assert sum(len(v) for v in self.stored.values()) == self.cache.total_size()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        tree_slots = check_tree(self.cache)
        free = check_free_list(self.alloc)
        assert not tree_slots & free and tree_slots | free == all_slots(self.alloc)
        # lock_ref is exactly the number of locks taken through each node
        expected: dict[int, int] = {}
        for node in self.locked:
            for n in path_to(node):
                expected[n.id] = expected.get(n.id, 0) + 1
        for n in iter_nodes(self.cache):
            if n is not self.cache.root_node:
                assert n.lock_ref == expected.get(n.id, 0)


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


@dataclass
class SimReq:
    req: FakeReq
    kv_len: int = 0
    decoding: bool = False


class RequestMachine(RuleBasedStateMachine):
    """Requests flowing through a cache the way the scheduler drives it."""

    @initialize(ps=st.sampled_from([1, 2, 4]), radix=st.booleans())
    def setup(self, ps: int, radix: bool) -> None:
        self.ps = ps
        self.req_pool = ReqToTokenPool(size=6, max_context_len=32)
        self.alloc = TokenToKVPoolAllocator(size=48, page_size=ps)
        cls = RadixCache if radix else ChunkCache
        self.cache = cls(self.req_pool, self.alloc, page_size=ps)
        self.radix = radix
        self.live: list[SimReq] = []
        self.counter = 0

    def _alloc_with_evict(self, fn, need: int):
        out = fn()
        if out is None:
            self.cache.evict(need + self.ps)
            out = fn()
        return out

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def arrive(self, prompt: list[int]) -> None:
        if self.req_pool.available_size() == 0:
            return
        self.counter += 1
        req = FakeReq(f"r{self.counter}", prompt)
        req.req_pool_idx = self.req_pool.alloc(1)[0]
        req.fill_ids = list(prompt)
        res = self.cache.match_prefix(req.fill_ids[:-1])
        req.prefix_indices, req.last_node = res.device_indices, res.last_device_node
        self.cache.inc_lock_ref(req.last_node)
        self.req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        req.kv_committed_len = len(req.prefix_indices)
        self.live.append(SimReq(req, kv_len=len(req.prefix_indices)))

    def _pick(self, i: int, decoding: bool) -> SimReq | None:
        cands = [s for s in self.live if s.decoding == decoding]
        return cands[i % len(cands)] if cands else None

    @rule(i=st.integers(0, 100), chunk=st.integers(1, 8))
    def prefill_chunk(self, i: int, chunk: int) -> None:
        s = self._pick(i, decoding=False)
        if s is None:
            return
        req, idx = s.req, s.req.req_pool_idx
        start = s.kv_len
        end = min(start + chunk, len(req.origin_input_ids))
        last = int(self.req_pool.req_to_token[idx, start - 1]) if start else -1
        out = self._alloc_with_evict(lambda: self.alloc.alloc_extend([start], [end], [last]), end - start)
        if out is None:
            return
        assert len(out) == end - start
        self.req_pool.write(idx, start, out)
        s.kv_len = req.kv_committed_len = end
        if end < len(req.origin_input_ids):
            req.fill_ids = req.origin_input_ids[:end]
            self.cache.cache_unfinished_req(req)
            assert len(req.prefix_indices) == end
        else:
            req.output_ids.append(end % 3)
            req.fill_ids = req.origin_input_ids + req.output_ids
            s.decoding = True

    @rule(i=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, i: int, token: int) -> None:
        s = self._pick(i, decoding=True)
        if s is None or len(s.req.output_ids) >= 6:
            return
        req, idx = s.req, s.req.req_pool_idx
        seq_len = len(req.origin_input_ids) + len(req.output_ids)
        last = int(self.req_pool.req_to_token[idx, seq_len - 2])
        out = self._alloc_with_evict(lambda: self.alloc.alloc_decode([seq_len], [last]), 1)
        if out is None:
            return
        self.req_pool.write(idx, seq_len - 1, out)
        req.output_ids.append(token)
        s.kv_len = req.kv_committed_len = seq_len

    @rule(i=st.integers(0, 100), insert=st.booleans())
    def finish(self, i: int, insert: bool) -> None:
        s = self._pick(i, decoding=True)
        if s is not None:
            self._release(s, insert)

    @rule(i=st.integers(0, 100), insert=st.booleans())
    def abort_prefilling(self, i: int, insert: bool) -> None:
        s = self._pick(i, decoding=False)
        if s is not None:
            self._release(s, insert)

    def _release(self, s: SimReq, insert: bool) -> None:
        self.cache.cache_finished_req(s.req, is_insert=insert)
        assert s.req.req_pool_idx is None
        self.live.remove(s)

    @rule(n=st.integers(0, 48))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @invariant()
    def no_leak_no_double_ownership(self) -> None:
        if not hasattr(self, "cache"):
            return
        ps = self.ps
        tree_slots = check_tree(self.cache) if self.radix else set()
        assert self.cache.all_values_flatten().numel() == len(tree_slots)
        free_pages = set(self.alloc.free_pages)
        assert len(free_pages) == len(self.alloc.free_pages)
        tree_pages = {s // ps for s in tree_slots}
        owners: dict[int, str] = {p: "free" for p in free_pages}
        for p in tree_pages:
            assert p not in owners, f"page {p} both {owners[p]} and in the tree"
            owners[p] = "tree"
        expected_locks: dict[int, int] = {}
        for s in self.live:
            req = s.req
            if s.decoding:
                assert s.kv_len == len(req.origin_input_ids) + len(req.output_ids) - 1
            else:
                assert s.kv_len == len(req.prefix_indices)
            row = self.req_pool.req_to_token[req.req_pool_idx, : s.kv_len].tolist()
            assert req.prefix_indices.tolist() == row[: len(req.prefix_indices)]
            shared = path_value(req.last_node) if self.radix else []
            if self.radix:
                assert len(shared) == len(req.prefix_indices) // ps * ps
                assert path_key(req.last_node) == tuple(req.origin_input_ids[: len(shared)])
                for n in path_to(req.last_node):
                    expected_locks[n.id] = expected_locks.get(n.id, 0) + 1
            else:
                assert req.last_node is None
            assert row[: len(shared)] == shared
            own = row[len(shared) :]
            assert not set(own) & tree_slots
            for p in {x // ps for x in own}:
                assert p not in owners, f"page {p} both {owners[p]} and owned by {req.rid}"
                owners[p] = req.rid
        all_pages = set(range(1, self.alloc.size // ps + 1))
        assert set(owners) == all_pages, f"leaked pages {all_pages - set(owners)}"
        if self.radix:
            for n in iter_nodes(self.cache):
                if n is not self.cache.root_node:
                    assert n.lock_ref == expected_locks.get(n.id, 0)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for s in list(self.live):
            self._release(s, insert=bool(len(s.req.origin_input_ids) % 2))
        self.no_leak_no_double_ownership()
        assert self.cache.protected_size() == 0
        self.cache.evict(10**9)
        assert self.cache.total_size() == 0
        assert self.alloc.available_size() == self.alloc.size
        assert len(set(self.alloc.free_pages)) == len(self.alloc.free_pages)
        assert self.req_pool.available_size() == self.req_pool.size


TestRequestMachine = RequestMachine.TestCase
TestRequestMachine.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- extra_key (cache_salt): isolated subtrees ----------------------------------------


def test_the_same_tokens_under_two_keys_never_match_each_other():
    cache, _, alloc = make_cache()
    _, a = insert_fresh(cache, [1, 2, 3, 4], "alice")
    for other in ("bob", None):
        res = cache.match_prefix([1, 2, 3, 4], other)
        assert res.device_indices.numel() == 0 and res.last_device_node is cache.root_node
    assert cache.match_prefix([1, 2, 3, 4], "alice").device_indices.tolist() == a.tolist()
    # bob's copy is stored apart, in slots of its own
    already, b = insert_fresh(cache, [1, 2, 3, 4], "bob")
    assert already == 0 and not set(a.tolist()) & set(b.tolist())
    assert cache.match_prefix([1, 2, 3, 9], "bob").device_indices.tolist() == b[:3].tolist()
    assert cache.match_prefix([1, 2, 3, 4], "alice").device_indices.tolist() == a.tolist()
    assert set(cache.root_node.children) == {("alice", 1), ("bob", 1)}
    assert cache.total_size() == 8
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)


def test_an_unkeyed_prefix_and_a_keyed_one_never_share():
    cache, _, alloc = make_cache()
    _, plain = insert_fresh(cache, [5, 6, 7])
    assert cache.match_prefix([5, 6, 7], "k").device_indices.numel() == 0
    assert insert_fresh(cache, [5, 6, 7, 8], "k")[0] == 0
    assert insert_fresh(cache, [5, 6, 7, 8])[0] == 3  # the plain tree is as it was
    assert cache.match_prefix([5, 6, 7]).device_indices.tolist() == plain.tolist()
    assert list(cache.root_node.children) == [5, ("k", 5)]
    assert "extra_key='k'" in cache.pretty_print() and cache.pretty_print().count("extra_key") == 1
    assert check_free_list(alloc) | check_tree(cache) == all_slots(alloc)


@pytest.mark.parametrize("ps", [1, 2])
def test_a_split_stays_in_its_keys_subtree(ps):
    cache, _, _ = make_cache(page_size=ps)
    key = list(range(1, 4 * ps + 1))
    insert_fresh(cache, key, "a")
    insert_fresh(cache, key)
    res = cache.match_prefix(key[: 2 * ps] + [99] * ps, "a")
    upper = res.last_device_node
    assert len(res.device_indices) == 2 * ps and upper.extra_key == "a" and upper.key == key[: 2 * ps]
    assert [c.extra_key for c in upper.children.values()] == ["a"]
    plain = cache.match_prefix(key).last_device_node
    assert plain.key == key and plain.parent is cache.root_node  # the unkeyed node was not split
    check_tree(cache)


def test_locks_and_eviction_with_mixed_keys_are_exact():
    cache, _, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3, 4], "a")
    insert_fresh(cache, [1, 2, 3, 4], "b")
    insert_fresh(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4], "a").last_device_node
    assert cache.inc_lock_ref(node) == -4
    assert (cache.protected_size(), cache.evictable_size()) == (4, 8)
    cache.evict(100)  # b's copy and the plain one go; a's stays
    assert (cache.protected_size(), cache.evictable_size(), cache.total_size()) == (4, 0, 4)
    assert cache.match_prefix([1, 2, 3, 4], "b").device_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3, 4], "a").device_indices.numel() == 4
    assert list(cache.root_node.children) == [("a", 1)]
    assert cache.dec_lock_ref(node) == 4
    cache.evict(100)
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_a_miss_is_explained_only_by_evictions_of_its_own_key():
    cache, _, _ = make_cache()
    insert_fresh(cache, [1, 2, 3, 4, 5], "a")
    cache.evict(100)
    fill = [1, 2, 3, 4, 5, 6]
    own = classify(fill, 0, 1, cache.evicted_keys, "a")
    assert (own.evicted, own.rest) == (5, 0)
    for other in ("b", None):  # another client's eviction tells nothing of it
        m = classify(fill, 0, 1, cache.evicted_keys, other)
        assert (m.evicted, m.diverged_at, m.rest) == (0, -1, 5)


def test_requests_cache_under_their_own_key():
    cache, req_pool, alloc = make_cache()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = FakeReq("a", prompt, extra_key="a")
    run_prefill(cache, req_pool, alloc, first, upto=5)
    cache.cache_unfinished_req(first)  # a chunk boundary: the 5 tokens go under "a"
    assert first.last_node.extra_key == "a" and path_key(first.last_node) == tuple(prompt[:5])
    assert cache.match_prefix(prompt, None).device_indices.numel() == 0
    run_prefill(cache, req_pool, alloc, first)
    first.output_ids.append(7)
    cache.cache_finished_req(first)
    second = FakeReq("b", prompt, extra_key="b")
    run_prefill(cache, req_pool, alloc, second)
    assert len(second.prefix_indices) == 0 and second.last_node is cache.root_node
    third = FakeReq("a2", prompt, extra_key="a")
    run_prefill(cache, req_pool, alloc, third)
    assert len(third.prefix_indices) == len(prompt) - 1
    for r in (second, third):
        r.output_ids.append(7)
        cache.cache_finished_req(r)
    assert cache.protected_size() == 0 and cache.total_size() == 2 * len(prompt)
    cache.evict(1000)
    assert alloc.available_size() == alloc.size and req_pool.available_size() == req_pool.size


def test_chunk_cache_takes_an_extra_key_and_reuses_nothing():
    req_pool = ReqToTokenPool(size=2, max_context_len=8)
    cache = ChunkCache(req_pool, TokenToKVPoolAllocator(size=16), page_size=1)
    res = cache.match_prefix([1, 2, 3], "a")
    assert res.device_indices.numel() == 0 and res.last_device_node is None


class KeyedRequestMachine(RequestMachine):
    """RequestMachine with each arriving request under one of a few extra keys: its
    match, lock, chunk caching and finish stay inside its key's subtree, and every
    page is still free, in the tree, or owned by exactly one live request."""

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), ek=EXTRA_KEYS)
    def arrive(self, prompt: list[int], ek: str | None) -> None:
        if self.req_pool.available_size() == 0:
            return
        self.counter += 1
        req = FakeReq(f"r{self.counter}", prompt, extra_key=ek)
        req.req_pool_idx = self.req_pool.alloc(1)[0]
        req.fill_ids = list(prompt)
        res = self.cache.match_prefix(req.fill_ids[:-1], ek)
        req.prefix_indices, req.last_node = res.device_indices, res.last_device_node
        self.cache.inc_lock_ref(req.last_node)
        self.req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        req.kv_committed_len = len(req.prefix_indices)
        self.live.append(SimReq(req, kv_len=len(req.prefix_indices)))

    @invariant()
    def each_request_holds_its_own_keys_nodes(self) -> None:
        if not hasattr(self, "cache") or not self.radix:
            return
        for s in self.live:
            for n in path_to(s.req.last_node):
                assert n.extra_key == s.req.extra_key


TestKeyedRequestMachine = KeyedRequestMachine.TestCase
TestKeyedRequestMachine.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
