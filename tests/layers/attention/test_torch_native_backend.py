"""TorchNativeAttnBackend against attention written out per request in float64, on
ragged paged batches: prefill with and without a cached prefix, decode and MIXED rounds,
one-row requests that share a cached prefix (gathered once, merged by log-sum-exp) and
chunks of padded one-row requests."""

from __future__ import annotations

import pytest
import torch

from sglite.layers.attention import torch_native_backend as tn
from benchmarks.paged_batch import make_paged_case, run_attention
from sglite.model_executor.forward_batch_info import ForwardMode


def share_prefix(case, groups: list[tuple[list[int], int]]) -> None:
    """Make the requests of each group read the same KV slots for their first positions
    (what the radix cache does for a shared system prompt)."""
    rt = case.forward_batch.req_to_token_pool.req_to_token
    idx = case.forward_batch.req_pool_indices
    for members, length in groups:
        for j in members[1:]:
            rt[idx[j], :length] = rt[idx[members[0]], :length]


def dense_reference(case) -> torch.Tensor:
    fb, layer = case.forward_batch, case.layer
    pool = fb.token_to_kv_pool
    k_buf, v_buf = pool.get_key_buffer(0).double(), pool.get_value_buffer(0).double()
    rt = fb.req_to_token_pool.req_to_token
    if fb.forward_mode.is_decode():
        q_lens, starts = [1] * fb.batch_size, list(range(fb.batch_size))
    else:
        q_lens, starts = fb.extend_seq_lens_cpu, fb.extend_start_loc.tolist()
    group = layer.tp_q_head_num // layer.tp_k_head_num
    out = torch.empty(case.q.shape, dtype=torch.float64)
    for i, (idx, seq_len) in enumerate(zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu)):
        slots = rt[idx, :seq_len]
        k = k_buf[slots].repeat_interleave(group, dim=1)  # [seq, H, D]
        v = v_buf[slots].repeat_interleave(group, dim=1)
        for r in range(q_lens[i]):
            pos = seq_len - q_lens[i] + r
            q = case.q[starts[i] + r].double()  # [H, D]
            scores = torch.einsum("hd,shd->hs", q, k[: pos + 1]) * layer.scaling
            out[starts[i] + r] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[: pos + 1])
    return out


def check(case) -> None:
    got = run_attention(tn.TorchNativeAttnBackend(), case)
    torch.testing.assert_close(got.double(), dense_reference(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_prefill_with_and_without_prefix(heads, kv_heads):
    check(make_paged_case([0, 7, 0, 30], [5, 4, 1, 9], heads, kv_heads, 16, seed=1))


@pytest.mark.parametrize("chunk_tokens", [64, 4096])
def test_decode_without_sharing(monkeypatch, chunk_tokens):
    monkeypatch.setattr(tn, "CHUNK_TOKENS", chunk_tokens)
    case = make_paged_case([3, 40, 17, 90, 1, 55, 8], [1] * 7, 9, 3, 16, decode=True, seed=2)
    backend = tn.TorchNativeAttnBackend()
    backend.init_forward_metadata(case.forward_batch)
    chunks = [c.q_rows.tolist() for c in backend._chunks]
    # sorted by length (seq_len = prefix + 1), padded to the longest of each chunk
    assert sorted(r for c in chunks for r in c) == list(range(7)) and not backend._views
    assert [r for c in chunks for r in c] == [4, 0, 6, 2, 1, 5, 3]
    assert len(chunks) == (1 if chunk_tokens == 4096 else 5)  # 64: [2, 4, 9] then one each
    check(case)


@pytest.mark.parametrize("chunk_tokens", [64, 4096])
def test_decode_with_shared_prefixes(monkeypatch, chunk_tokens):
    monkeypatch.setattr(tn, "MIN_SHARED_ROWS_SAVED", 1)
    monkeypatch.setattr(tn, "CHUNK_TOKENS", chunk_tokens)
    prefixes = [40, 41, 45, 60, 33, 20, 50, 50]
    case = make_paged_case(prefixes, [1] * 8, 9, 3, 16, decode=True, seed=3)
    # two groups: 0-3 share 30 positions, 4 and 6 share 20; 5 and 7 share nothing
    share_prefix(case, [([0, 1, 2, 3], 30), ([4, 6], 20)])
    backend = tn.TorchNativeAttnBackend()
    case.forward_batch.attn_backend = backend
    backend.init_forward_metadata(case.forward_batch)
    groups = sorted((g.q_rows.tolist(), g.prefix_slots.numel()) for g in backend._groups)
    assert groups == [([0, 1, 2, 3], 30), ([4, 6], 20)]
    assert [r for c in backend._chunks for r in c.q_rows.tolist()] == [5, 7] and not backend._views
    check(case)


def test_shared_prefix_as_long_as_a_whole_request(monkeypatch):
    """A request whose every cached position is shared keeps its newest row for itself."""
    monkeypatch.setattr(tn, "MIN_SHARED_ROWS_SAVED", 1)
    case = make_paged_case([12, 12, 30], [1] * 3, 4, 2, 8, decode=True, seed=4)
    share_prefix(case, [([0, 1, 2], 12)])
    check(case)


def test_short_shared_prefixes_are_not_grouped():
    case = make_paged_case([40, 40, 40], [1] * 3, 4, 2, 8, decode=True, seed=5)
    share_prefix(case, [([0, 1, 2], 30)])  # spares 60 rows a layer: under MIN_SHARED_ROWS_SAVED
    backend = tn.TorchNativeAttnBackend()
    case.forward_batch.attn_backend = backend
    backend.init_forward_metadata(case.forward_batch)
    assert backend._groups == []
    check(case)


def test_mixed_batch_of_prefill_and_one_row_requests(monkeypatch):
    """A MIXED round: chunks of prefill beside running requests that extend by one row,
    two of which share a prefix."""
    monkeypatch.setattr(tn, "MIN_SHARED_ROWS_SAVED", 1)
    case = make_paged_case([0, 25, 30, 31, 6], [6, 1, 1, 1, 3], 9, 3, 16, seed=6)
    case.forward_batch.forward_mode = ForwardMode.MIXED
    share_prefix(case, [([1, 2, 3], 24)])
    check(case)


def test_large_scores_do_not_overflow():
    """The merge works on shifted exponents: scores far beyond exp's float32 range."""
    case = make_paged_case([300, 300], [1, 1], 4, 2, 8, decode=True, seed=7)
    share_prefix(case, [([0, 1], 299)])
    case.q.mul_(200.0)
    got = run_attention(tn.TorchNativeAttnBackend(), case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_reference(case), rtol=1e-4, atol=1e-4)
