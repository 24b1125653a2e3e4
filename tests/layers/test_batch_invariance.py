"""Batch invariance, operator by operator (docs/kernels.md, "Batch invariance"): a row's
output is bitwise the same computed alone and inside batches of 2..64 random other rows,
in bfloat16 and float32; attention gives a query row the same bits in a whole prefill,
in every chunking of it, as a decode row alone, and among other requests' rows. The
engine-level promise (a request's tokens equal its solo run) is
tests/managers/test_batch_invariance.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from sglite.layers.sampler import Sampler

from sglite.layers.cpu_ops import load_cpu_ops

DTYPES = [torch.bfloat16, torch.float32]
SIZES = [2, 3, 7, 8, 9, 16, 17, 33, 64]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def same_row_in_every_batch(fn: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype) -> None:
    """``fn`` of one row alone, and of that row at every place of batches of random rows."""
    row = torch.randn(1, width, generator=gen(1)).to(dtype)
    alone = fn(row)[0]
    for n in SIZES:
        for at in (0, n // 2, n - 1):
            batch = torch.randn(n, width, generator=gen(n * 100 + at)).to(dtype)
            batch[at] = row[0]
            assert torch.equal(fn(batch)[at], alone), (n, at)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1728, 576), (49, 33), (16, 64), (1, 7)])
def test_packed_linear(dtype, n, k):
    ops = load_cpu_ops()
    weight = torch.randn(n, k, generator=gen(2)).to(dtype)
    packed = ops.convert_weight_packed(weight)
    bias = torch.randn(n, generator=gen(3))
    same_row_in_every_batch(lambda x: ops.weight_packed_linear(x, packed, bias, n, True), k, dtype)
    same_row_in_every_batch(lambda x: ops.weight_packed_linear(x, packed, None, n, False), k, dtype)


def test_torch_float32_linear_is_not_batch_invariant():
    """Why float32 linears are packed too: torch's F.linear sums a row alone (a GEMV)
    and inside a batch (a GEMM) in other orders."""
    weight = torch.randn(1728, 576, generator=gen(4))
    row = torch.randn(1, 576, generator=gen(5))
    batch = torch.cat([row, torch.randn(15, 576, generator=gen(6))])
    assert not torch.equal(torch.nn.functional.linear(row, weight)[0], torch.nn.functional.linear(batch, weight)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_rmsnorm_and_silu(dtype, hidden):
    ops = load_cpu_ops()
    weight = torch.randn(hidden, generator=gen(7)).to(dtype)

    def rmsnorm(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.rmsnorm(x, weight, out, 1e-5)
        return out

    def silu(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
        ops.silu_and_mul(x, out)
        return out

    same_row_in_every_batch(rmsnorm, hidden, dtype)
    same_row_in_every_batch(silu, 2 * hidden, dtype)


def test_logprobs_log_softmax_and_top_tokens():
    """A row's logprobs (Sampler.logprobs: penalized logits over its temperature) and its
    top tokens, over a vocabulary of SmolLM2's size (the logits are float32)."""
    vocab = 49152

    def logprobs(x: torch.Tensor) -> torch.Tensor:
        temperatures = torch.full((x.shape[0], 1), 0.7)
        temperatures[0] = 1.3  # (a row's own temperature: the others' must not matter)
        info = SimpleNamespace(temperatures=temperatures)
        out = Sampler.logprobs(x, info)  # type: ignore[arg-type]
        values, ids = out.topk(20, dim=-1)
        return torch.cat([out, values, ids.float()], dim=-1)

    row = torch.randn(1, vocab, generator=gen(1)) * 8
    alone = logprobs(row)[0]
    for n in SIZES:
        batch = torch.randn(n, vocab, generator=gen(n)) * 8
        batch[0] = row[0]
        assert torch.equal(logprobs(batch)[0], alone), n


H, KVH, D = 9, 3, 64
SEQ = 300  # more than two of the kernel's 128-position ranges


class Pool:
    """A KV pool with one long request (req_to_token row 0) and seven others."""

    def __init__(self, dtype: torch.dtype, head_dim: int = D):
        slots = 8 * 512
        self.k = torch.randn(slots, KVH, head_dim, generator=gen(8)).to(dtype)
        self.v = torch.randn(slots, KVH, head_dim, generator=gen(9)).to(dtype)
        self.req_to_token = torch.randperm(slots, generator=gen(10))[: 8 * 512].view(8, 512).to(torch.int64)
        self.q = torch.randn(SEQ, H, head_dim, generator=gen(11)).to(dtype)

    def attend(self, q: torch.Tensor, pool_idx: list[int], seq_lens: list[int]) -> torch.Tensor:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        load_cpu_ops().decode_attention(q.contiguous(), self.k, self.v, self.req_to_token, torch.arange(len(q)),
                                        torch.tensor(pool_idx), torch.tensor(seq_lens), out, 0.125)
        return out

    def prefill(self, start: int, end: int) -> torch.Tensor:
        """Rows start..end-1 of the long request as one prefill (positions 0..start-1 cached)."""
        return self.attend(self.q[start:end], [0] * (end - start), list(range(start + 1, end + 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 7, 32, 127, 128, 129, 300])
def test_attention_gives_a_row_the_same_bits_however_its_prompt_is_chunked(dtype, chunk):
    pool = Pool(dtype)
    whole = pool.prefill(0, SEQ)
    chunked = torch.cat([pool.prefill(s, min(SEQ, s + chunk)) for s in range(0, SEQ, chunk)])
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_gives_a_decode_row_the_bits_of_its_prefill_row_whatever_its_batch(dtype):
    pool = Pool(dtype)
    whole = pool.prefill(0, SEQ)
    for pos in (0, 1, 127, 128, 255, 256, SEQ - 1):
        assert torch.equal(pool.attend(pool.q[pos : pos + 1], [0], [pos + 1])[0], whole[pos]), pos
    lens = torch.randint(1, 500, (64,), generator=gen(12)).tolist()
    for n in SIZES:
        for at in (0, n // 2, n - 1):
            q = torch.randn(n, H, D, generator=gen(n + at)).to(dtype)
            q[at] = pool.q[SEQ - 1]
            pool_idx = [1 + i % 7 for i in range(n)]
            seq_lens = lens[:n]
            pool_idx[at], seq_lens[at] = 0, SEQ
            assert torch.equal(pool.attend(q, pool_idx, seq_lens)[at], whole[SEQ - 1]), (n, at)


@pytest.mark.parametrize("head_dim", [16, 48, 128])
def test_attention_invariance_holds_for_every_head_dim(head_dim):
    """64 and 128 run code specialised at compile time; others the generic loops."""
    pool = Pool(torch.bfloat16, head_dim)
    whole = pool.prefill(0, SEQ)
    assert torch.equal(torch.cat([pool.prefill(s, min(SEQ, s + 50)) for s in range(0, SEQ, 50)]), whole)
    assert torch.equal(pool.attend(pool.q[200:201], [0], [201])[0], whole[200])


def test_attention_of_a_row_does_not_depend_on_the_thread_count():
    pool = Pool(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pool.prefill(0, SEQ)
        torch.set_num_threads(max(2, before))
        assert torch.equal(pool.prefill(0, SEQ), one)
    finally:
        torch.set_num_threads(before)
