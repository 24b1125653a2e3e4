"""The triton backend's batch invariance (--enable-deterministic-inference, the default;
docs/kernels.md, "Batch invariance"): with a fixed split tile, a query row of one long
request gets the same bits in a whole prefill, in every chunking of it, as a decode row
alone, among other requests' rows (extend and decode batches of 2..16), and mixed
with decode rows. Through TritonAttnBackend, so the per-row metadata it builds for
extend batches is checked too. On CPU under TRITON_INTERPRET=1; CUDA when present."""

from __future__ import annotations

import pytest
import torch

from sglite.layers.attention.triton_backend import TritonAttnBackend
from sglite.layers.radix_attention import RadixAttention
from sglite.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, KVH, D = 2, 1, 64
SEQ, CONTEXT, TILE = 100, 128, 64  # the long request crosses a tile boundary
ROWS = 8  # requests in the pool: row 0 the long one, 1..7 others


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Pool:
    """Every position's K/V is in the pool from the start, so a forward's store of the
    new rows' K/V writes what is already there: chunkings share one sequence."""

    def __init__(self, dtype: torch.dtype):
        slots = ROWS * CONTEXT
        self.kv = MHATokenToKVPool(slots, 1, dtype, KVH, D, 1, DEVICE)  # (and the padding slot 0)
        shape = self.kv.k_buffer[0].shape
        self.kv.k_buffer[0].copy_(torch.randn(*shape, generator=gen(1)).to(dtype))
        self.kv.v_buffer[0].copy_(torch.randn(*shape, generator=gen(2)).to(dtype))
        self.req = ReqToTokenPool(ROWS, CONTEXT, DEVICE)
        self.req.req_to_token.copy_((1 + torch.randperm(slots, generator=gen(3))).view(ROWS, CONTEXT))
        self.q = torch.randn(ROWS, CONTEXT, H, D, generator=gen(4)).to(dtype)
        self.layer = RadixAttention(H, D, D**-0.5, KVH, layer_id=0)
        self.backend = TritonAttnBackend(DEVICE, KVH, split_tile=TILE, context_len=CONTEXT)

    def run(self, parts: list[tuple[int, int, int]], decode: bool = False) -> list[torch.Tensor]:
        """One forward over ``parts`` = (pool row, first position, end position): each
        part's rows attend causally; returns each part's output rows."""
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
        r2t = self.req.req_to_token
        rows = [(r, p) for r, s, e in parts for p in range(s, e)]
        loc = torch.stack([r2t[r, p] for r, p in rows])
        q = torch.stack([self.q[r, p] for r, p in rows]).to(DEVICE)
        k, v = self.kv.k_buffer[0][loc].clone(), self.kv.v_buffer[0][loc].clone()
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=len(parts),
                          input_ids=t([0] * len(rows)), req_pool_indices=t([r for r, _, _ in parts]),
                          seq_lens=t([e for _, _, e in parts]), out_cache_loc=loc,
                          seq_lens_sum=sum(e for _, _, e in parts), positions=t([p for _, p in rows]),
                          seq_lens_cpu=[e for _, _, e in parts], req_to_token_pool=self.req, token_to_kv_pool=self.kv)
        if not decode:
            lens = [e - s for _, s, e in parts]
            fb.extend_num_tokens, fb.extend_seq_lens_cpu = len(rows), lens
            fb.extend_prefix_lens_cpu = [s for _, s, _ in parts]
            fb.extend_prefix_lens, fb.extend_seq_lens = t(fb.extend_prefix_lens_cpu), t(lens)
            fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        out = self.backend.forward(q, k, v, self.layer, fb).cpu()
        return list(torch.split(out, [e - s for _, s, e in parts]))


# the interpreter runs a program at a time, and its bfloat16 tl.dot is wrong (docs/kernels.md):
# float32 only on a CPU
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_however_its_prompt_is_chunked(dtype):
    pool = Pool(dtype)
    whole = pool.run([(0, 0, SEQ)])[0]
    for chunk in (1, 7, 65):
        if chunk == 1:  # every row a one-row extend: as many forwards as rows, so a few
            starts = [0, 63, 64, SEQ - 1]
            assert all(torch.equal(pool.run([(0, s, s + 1)])[0][0], whole[s]) for s in starts)
            continue
        chunked = torch.cat([pool.run([(0, s, min(SEQ, s + chunk))])[0] for s in range(0, SEQ, chunk)])
        assert torch.equal(chunked, whole), chunk


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_alone_as_decode_and_among_other_requests(dtype):
    pool = Pool(dtype)
    whole = pool.run([(0, 0, SEQ)])[0]
    for pos in (0, 63, 64, SEQ - 1):
        assert torch.equal(pool.run([(0, pos, pos + 1)], decode=True)[0][0], whole[pos]), pos
    lens = torch.randint(1, CONTEXT, (16,), generator=gen(5)).tolist()
    for n in (2, 5, 9):
        others = [(1 + i % (ROWS - 1), lens[i] - 1, lens[i]) for i in range(n - 1)]
        at = n // 2
        decode = pool.run(others[:at] + [(0, SEQ - 1, SEQ)] + others[at:], decode=True)
        assert torch.equal(decode[at][0], whole[SEQ - 1]), n
    # an extend batch: other prefills around a chunk of the long request, decode rows
    # among them as a MIXED round has them (one-row extends)
    mixed = pool.run([(1, 0, 9), (0, 50, 80), (2, 119, 120), (3, 10, 30), (4, 63, 64)])
    assert torch.equal(mixed[1], whole[50:80])

