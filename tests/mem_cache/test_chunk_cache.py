from __future__ import annotations


import pytest
import torch

from tests.mem_cache.fakes import FakeReq
from sglite.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from sglite.mem_cache.chunk_cache import ChunkCache
from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator




def make(ps: int = 1):
    req_pool = ReqToTokenPool(size=4, max_context_len=32)
    alloc = TokenToKVPoolAllocator(size=32, page_size=ps)
    return ChunkCache(req_pool, alloc, page_size=ps), req_pool, alloc


def extend(req_pool, alloc, req: FakeReq, end: int) -> None:
    start = len(req.prefix_indices)
    last = int(req_pool.req_to_token[req.req_pool_idx, start - 1]) if start else -1
    req_pool.write(req.req_pool_idx, start, alloc.alloc_extend([start], [end], [last]))
    req.kv_committed_len = end
    req.fill_ids = req.origin_input_ids[:end]


def test_interface_reuses_nothing():
    cache, _, _ = make()
    assert isinstance(cache, BasePrefixCache)
    res = cache.match_prefix([1, 2, 3])
    assert isinstance(res, MatchResult)
    assert res.device_indices.numel() == 0 and res.device_indices.dtype == torch.int64
    assert res.last_device_node is None
    assert cache.inc_lock_ref(None) == 0 and cache.dec_lock_ref(None) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    cache.evict(100)
    assert cache.all_values_flatten().numel() == 0
    assert cache.snapshot() == []
    cache.reset()


@pytest.mark.parametrize("ps", [1, 2, 4])
@pytest.mark.parametrize("is_insert", [True, False])
def test_chunked_then_finished_frees_everything(ps, is_insert):
    cache, req_pool, alloc = make(ps)
    req = FakeReq("r", list(range(1, 10)))
    req.req_pool_idx = req_pool.alloc(1)[0]
    extend(req_pool, alloc, req, 5)
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == req_pool.req_to_token[req.req_pool_idx, :5].tolist()
    assert req.req_pool_idx is not None
    extend(req_pool, alloc, req, 9)
    assert len(req.prefix_indices) == 5
    req.output_ids.append(7)
    seq_len = 10
    last = int(req_pool.req_to_token[req.req_pool_idx, seq_len - 2])
    req_pool.write(req.req_pool_idx, seq_len - 1, alloc.alloc_decode([seq_len], [last]))
    req.kv_committed_len = seq_len
    req.output_ids.append(8)  # KV for 10 positions; the token 8 has none
    cache.cache_finished_req(req, is_insert=is_insert)
    assert req.req_pool_idx is None
    assert alloc.available_size() == alloc.size
    assert len(set(alloc.free_pages)) == len(alloc.free_pages)
    assert req_pool.available_size() == req_pool.size


def test_abort_between_chunks_frees_computed_prefix():
    cache, req_pool, alloc = make(2)
    req = FakeReq("r", list(range(1, 10)))
    req.req_pool_idx = req_pool.alloc(1)[0]
    extend(req_pool, alloc, req, 3)
    cache.cache_unfinished_req(req)
    cache.cache_finished_req(req)
    assert alloc.available_size() == alloc.size
