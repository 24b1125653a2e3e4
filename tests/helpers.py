"""Shared test helpers: hand-built batches over a ModelRunner's real pools."""

from __future__ import annotations

import torch

from sglite.managers.schedule_batch import ModelWorkerBatch
from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def hand_batch(forward_mode: ForwardMode, input_ids: list[int], req_pool_indices: list[int], seq_lens: list[int],
               out_cache_loc: torch.Tensor, prefix_lens: list[int] | None = None,
               extend_lens: list[int] | None = None) -> ModelWorkerBatch:
    """A ModelWorkerBatch filled by hand, asking for the logits of every row."""
    return ModelWorkerBatch(0, 0, forward_mode, input_ids, req_pool_indices, seq_lens, out_cache_loc,
                            prefix_lens or [], extend_lens or [], sum(extend_lens or []), return_all_logits=True)


class HandScheduler:
    """Minimal bookkeeping to drive a ModelRunner directly: one req slot per sequence."""

    def __init__(self, runner):
        self.runner = runner
        self.tokens: dict[int, list[int]] = {}  # req_pool_idx -> tokens whose KV is cached

    def new_seq(self) -> int:
        (idx,) = self.runner.req_to_token_pool.alloc(1)
        self.tokens[idx] = []
        return idx

    def share_prefix(self, src: int, dst: int, n: int) -> None:
        """Let ``dst`` reuse the first n KV slots of ``src`` (what a radix hit does)."""
        r2t = self.runner.req_to_token_pool.req_to_token
        r2t[dst, :n] = r2t[src, :n]
        self.tokens[dst] = list(self.tokens[src][:n])

    def extend(self, seqs: list[tuple[int, list[int]]], mode: ForwardMode = ForwardMode.EXTEND) -> torch.Tensor:
        """Each (req_pool_idx, new_tokens) computes its new tokens on top of its cache."""
        pool = self.runner.req_to_token_pool
        prefix = [len(self.tokens[i]) for i, _ in seqs]
        ext = [len(t) for _, t in seqs]
        loc = self.runner.token_to_kv_pool_allocator.alloc(sum(ext))
        off = 0
        for (idx, toks), p in zip(seqs, prefix):
            pool.write(idx, p, loc[off : off + len(toks)])
            off += len(toks)
            self.tokens[idx] += toks
        batch = hand_batch(
            forward_mode=mode,
            input_ids=[t for _, toks in seqs for t in toks],
            req_pool_indices=[i for i, _ in seqs],
            seq_lens=[p + e for p, e in zip(prefix, ext)],
            out_cache_loc=loc,
            prefix_lens=prefix,
            extend_lens=ext,
        )
        fb = ForwardBatch.init_new(batch, self.runner)
        return self.runner.forward(fb)

    def decode(self, seqs: list[tuple[int, int]]) -> torch.Tensor:
        pool = self.runner.req_to_token_pool
        loc = self.runner.token_to_kv_pool_allocator.alloc(len(seqs))
        for j, (idx, tok) in enumerate(seqs):
            pool.write(idx, len(self.tokens[idx]), loc[j : j + 1])
            self.tokens[idx].append(tok)
        batch = hand_batch(
            forward_mode=ForwardMode.DECODE,
            input_ids=[t for _, t in seqs],
            req_pool_indices=[i for i, _ in seqs],
            seq_lens=[len(self.tokens[i]) for i, _ in seqs],
            out_cache_loc=loc,
        )
        return self.runner.forward(ForwardBatch.init_new(batch, self.runner))
