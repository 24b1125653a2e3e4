from __future__ import annotations

import pytest
import torch

from sglite.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator


def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.alloc(2) == [0, 1]
    assert pool.available_size() == 1
    assert pool.alloc(2) is None
    pool.write(1, 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[1, :6].tolist() == [0, 0, 7, 8, 9, 0]
    pool.free(0)
    assert pool.available_size() == 2
    with pytest.raises(RuntimeError):
        pool.free(0)
    with pytest.raises(RuntimeError):
        pool.free(5)
    pool.clear()
    assert pool.available_size() == 3


def test_allocator_page1_reserves_slot_zero():
    a = TokenToKVPoolAllocator(size=4, page_size=1)
    out = a.alloc(4)
    assert out.tolist() == [1, 2, 3, 4]
    assert out.dtype == torch.int64
    assert a.alloc(1) is None
    a.free(out[1:3])
    assert a.available_size() == 2
    assert a.debug_free_slots() == {2, 3}
    assert a.alloc_extend([3], [5], [9]).tolist() == [2, 3]


def test_allocator_rejects_bad_sizes():
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(size=6, page_size=4)
    a = TokenToKVPoolAllocator(size=8, page_size=4)
    with pytest.raises(ValueError):
        a.alloc(3)


def test_alloc_extend_paged_continues_last_page():
    ps = 4
    a = TokenToKVPoolAllocator(size=16, page_size=ps)
    first = a.alloc_extend([0], [5], [-1])
    # two pages: the first full, the second holding position 4
    assert first.tolist() == [4, 5, 6, 7, 8]
    assert a.available_size() == 8
    # positions 5, 6 land in the rest of page 2: no new page
    more = a.alloc_extend([5], [7], [int(first[-1])])
    assert more.tolist() == [9, 10]
    assert a.available_size() == 8
    # decode of position 7 fills the page; position 8 needs a new one
    d = a.alloc_decode([8], [10])
    assert d.tolist() == [11]
    assert a.available_size() == 8
    d2 = a.alloc_decode([9], [11])
    assert d2.tolist() == [12]
    assert a.available_size() == 4


def test_alloc_extend_paged_batch_of_requests():
    ps = 2
    a = TokenToKVPoolAllocator(size=16, page_size=ps)
    base = a.alloc(2)  # page 1 -> slots 2, 3
    assert base.tolist() == [2, 3]
    # req0: prefix 0 -> 3 tokens (2 pages); req1: prefix 1 ending at slot 2 -> 4 tokens
    out = a.alloc_extend([0, 1], [3, 4], [-1, 2])
    # req0 gets pages 2, 3 (slots 4,5,6); req1 continues slot 3 then page 4 (slots 8, 9)
    assert out.tolist() == [4, 5, 6, 3, 8, 9]
    assert a.available_size() == 16 - 2 - 6


def test_alloc_extend_paged_fails_without_side_effects():
    a = TokenToKVPoolAllocator(size=8, page_size=4)
    assert a.alloc_extend([0], [9], [-1]) is None
    assert a.available_size() == 8
    assert a.alloc_decode([1], [-1]).tolist() == [4]


def test_free_paged_frees_whole_pages():
    a = TokenToKVPoolAllocator(size=8, page_size=4)
    out = a.alloc_extend([0], [6], [-1])
    a.free(out[4:])  # one slot of page 2 frees all of it
    assert a.available_size() == 4
    assert a.debug_free_slots() == {8, 9, 10, 11}
    a.free(out[:4])
    assert a.available_size() == 8
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == 8


def test_mha_kv_pool_set_get():
    pool = MHATokenToKVPool(size=8, page_size=4, dtype=torch.float32, head_num=2, head_dim=3, layer_num=2)
    assert pool.get_key_buffer(0).shape == (12, 2, 3)
    loc = torch.tensor([4, 11])
    k = torch.ones(2, 2, 3)
    v = torch.full((2, 2, 3), 2.0)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k)
    assert torch.equal(pool.get_value_buffer(1)[loc], v)
    assert pool.get_key_buffer(0).abs().sum() == 0
    assert MHATokenToKVPool.cell_size(2, 3, 2, torch.float16) == 2 * 2 * 3 * 2 * 2
