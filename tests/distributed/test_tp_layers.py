"""The tensor-parallel cut, checked without processes: each rank's layers are built
with that rank's view of the group (no collective runs), loaded from the same full
weights, and their partial results combined by hand as the all-reduce / all-gather
would. The sum (or the concatenation) must equal the unsharded layer's output."""

from __future__ import annotations

import pytest
import torch

import sglite.distributed.parallel_state as ps
from sglite.distributed.utils import head_shard, split_range, valid_tp_sizes
from sglite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from sglite.layers.vocab_parallel_embedding import VocabParallelEmbedding


@pytest.fixture
def as_rank(monkeypatch):
    """Build layers as rank ``r`` of ``tp`` sees them (the group's rank and size only)."""

    def set_rank(r: int, tp: int) -> None:
        monkeypatch.setattr(ps, "_TP", ps.GroupCoordinator(rank=r, world_size=tp))

    yield set_rank


def test_split_range_cuts_contiguous_pieces_that_cover_everything():
    for total in range(0, 20):
        for parts in range(1, 6):
            pieces = [split_range(total, parts, i) for i in range(parts)]
            assert [s for s, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(parts)]
            assert sum(n for _, n in pieces) == total and max(n for _, n in pieces) - min(n for _, n in pieces) <= 1


def test_smollm2_heads_split_by_kv_group_at_tp_2_and_3():
    # 9 query heads in 3 GQA groups of 3: tp 2 puts KV heads 0-1 (q 0-5) on rank 0, KV 2 (q 6-8) on rank 1
    assert [head_shard(9, 3, 2, r) for r in (0, 1)] == [ps_shard(0, 6, 0, 2), ps_shard(6, 3, 2, 1)]
    assert [head_shard(9, 3, 3, r) for r in range(3)] == [ps_shard(3 * r, 3, r, 1) for r in range(3)]
    # more ranks than KV heads: one KV head each, replicated (tiny-random's 4 heads, 2 KV heads at tp 4)
    assert [head_shard(4, 2, 4, r) for r in range(4)] == [ps_shard(r, 1, r // 2, 1) for r in range(4)]
    assert valid_tp_sizes(9, 3) == [1, 2, 3, 9] and valid_tp_sizes(4, 2) == [1, 2, 4]
    with pytest.raises(ValueError, match="cannot split 9 attention heads over 3 KV heads; sizes that can: 1, 2, 3, 9"):
        head_shard(9, 3, 4, 0)


def ps_shard(q_start: int, heads: int, kv_start: int, kv_heads: int):
    from sglite.distributed.utils import HeadShard

    return HeadShard(q_start, heads, kv_start, kv_heads)


@pytest.mark.parametrize("tp", [2, 3])
def test_qkv_then_o_proj_partials_sum_to_the_full_layer(as_rank, tp):
    """SmolLM2's attention shapes (9 heads, 3 KV heads) with head_dim 4; the heads'
    outputs stand in for attention (q itself): o_proj's partial sums over the ranks
    equal o_proj of all heads, and each rank's k/v rows are its KV heads'."""
    g = torch.Generator().manual_seed(0)
    hidden, d, heads, kv_heads = 16, 4, 9, 3
    wq, wk, wv = (torch.randn(n * d, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    wo = torch.randn(hidden, heads * d, generator=g)
    x = torch.randn(5, hidden, generator=g)
    full = (x @ wq.T) @ wo.T
    partial = torch.zeros_like(full)
    for r in range(tp):
        as_rank(r, tp)
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight_loader("weight", w, shard)
        h = qkv.heads
        o = RowParallelLinear(heads * d, hidden, input_shard=(h.q_start * d, h.num_heads * d))
        o.weight_loader("weight", wo)
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        kv_rows = slice(h.kv_start * d, (h.kv_start + h.num_kv_heads) * d)
        torch.testing.assert_close(k, x @ wk[kv_rows].T)
        torch.testing.assert_close(v, x @ wv[kv_rows].T)
        partial += o.matmul(q, None)  # before the all-reduce
    torch.testing.assert_close(partial, full, rtol=1e-5, atol=1e-4)


def test_gate_up_then_down_partials_sum_to_the_full_mlp(as_rank):
    g = torch.Generator().manual_seed(1)
    hidden, inter, tp = 12, 15, 2  # 15 does not divide by 2: ranks hold 8 and 7 features
    wg, wu, wd = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g), torch.randn(hidden, inter, generator=g)
    x = torch.randn(3, hidden, generator=g)
    full = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    partial = torch.zeros_like(full)
    for r in range(tp):
        as_rank(r, tp)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
        gate_up.weight_loader("weight", wg, 0)
        gate_up.weight_loader("weight", wu, 1)
        down = RowParallelLinear(inter, hidden)
        down.weight_loader("weight", wd)
        gate, up = gate_up(x).chunk(2, dim=-1)
        partial += down.matmul(torch.nn.functional.silu(gate) * up, None)
    torch.testing.assert_close(partial, full, rtol=1e-5, atol=1e-4)


def test_vocab_shards_sum_to_the_embedding_and_concatenate_to_the_logits(as_rank):
    g = torch.Generator().manual_seed(2)
    vocab, hidden, tp = 11, 6, 3  # shards of 4 rows; the last holds 3 and a zero row
    table = torch.randn(vocab, hidden, generator=g)
    ids = torch.tensor([0, 3, 4, 10, 7, 7])
    h = torch.randn(2, hidden, generator=g)
    embedded, logits = torch.zeros(len(ids), hidden), []
    for r in range(tp):
        as_rank(r, tp)
        emb = VocabParallelEmbedding(vocab, hidden)
        emb.weight_loader("weight", table)
        mine = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        rows = torch.nn.functional.embedding(torch.where(mine, ids - emb.vocab_start, 0), emb.weight)
        embedded += rows * mine.unsqueeze(-1)  # what each rank adds to the all-reduce
        logits.append(h @ emb.weight.T)  # the LM head's shard of the logits
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], h @ table.T)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_named(as_rank):
    as_rank(1, 2)
    qkv = QKVParallelLinear(16, 4, 9, 3)
    with pytest.raises(ValueError, match=r"weight \(part k\): shape \(8, 16\) does not have the 12 rows"):
        qkv.weight_loader("weight", torch.zeros(8, 16), "k")
    row = RowParallelLinear(36, 16)
    with pytest.raises(ValueError, match="does not have the 36 columns"):
        row.weight_loader("weight", torch.zeros(16, 30))
    assert ReplicatedLinear(4, 4).tp_size == 2  # every layer reads the group it is built in
