"""The batch's sampling parameters as tensors (SGLang: sampling/sampling_batch_info.py).

sglite simplification: it is rebuilt from the requests every round instead of being
filtered and merged alongside the ScheduleBatch, and penalties are computed from the
requests' token lists rather than SGLang's incremental penalizer orchestrator.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

if TYPE_CHECKING:
    from sglite.constrained.base_grammar_backend import BaseGrammarObject
    from sglite.managers.schedule_batch import Req


_MASK64 = (1 << 64) - 1


def uniform_draw(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, position) alone: splitmix64 of the pair,
    53 bits. Counter-based, so a draw never depends on how many draws came before (a
    dropped chunk row, a retracted round, another batch)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class GrammarStep(NamedTuple):
    """What a grammar's mask did to one row: how many tokens it allowed, the token the
    model preferred before the mask (argmax of the penalized logits) and whether the
    mask refused it."""

    allowed: int
    preferred: int
    refused: bool


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1]
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_all_greedy: bool
    need_min_p_sampling: bool
    uniforms: torch.Tensor  # [bs] one draw in [0, 1) per row: (seed, output position) hashed
    # penalties, None when no request in the batch uses any
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None  # [bs, vocab]
    seen_tokens_mask: torch.Tensor | None = None  # [bs, vocab], prompt + output
    # min_new_tokens: [bs, vocab] the EOS and stop tokens of rows still short of their
    # minimum (their logits become -inf); logit_bias: [bs, vocab] added to the logits
    stop_tokens_mask: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    # constrained output (SGLang's names): each row's grammar (None: unconstrained; None
    # for the whole batch when no row has one), the batch's bitmask filled from them by
    # update_regex_vocab_mask, and the grammar's function that applies it
    grammars: "list[BaseGrammarObject | None] | None" = None
    vocab_size: int = 0
    vocab_mask: torch.Tensor | None = None
    apply_mask_func: Callable[..., None] | None = None
    # the overlap loop: set once the previous round's tokens are accepted and vocab_mask
    # is filled (the forward runs meanwhile; sampling waits for it)
    sampling_info_done: threading.Event | None = None
    grammar_stats: list[GrammarStep | None] | None = None  # per row, after sampling

    @classmethod
    def from_reqs(cls, reqs: Sequence["Req"], vocab_size: int, device: str | torch.device) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).view(-1, 1)

        info = cls(
            temperatures=col([p.temperature for p in params], torch.float32),
            top_ps=col([p.top_p for p in params], torch.float32),
            top_ks=col([p.top_k for p in params], torch.int64),
            min_ps=col([p.min_p for p in params], torch.float32),
            is_all_greedy=all(p.is_greedy for p in params),
            need_min_p_sampling=any(p.min_p > 0 for p in params),
            uniforms=torch.tensor([uniform_draw(r.sampling_seed, r.seqlen - len(r.origin_input_ids)) for r in reqs],
                                  dtype=torch.float64).to(device),
        )
        if any(p.has_penalties for p in params):
            bs = len(reqs)
            counts = torch.zeros((bs, vocab_size), dtype=torch.float32)
            seen = torch.zeros((bs, vocab_size), dtype=torch.bool)
            for i, r in enumerate(reqs):
                if r.output_ids:
                    out = torch.tensor(r.output_ids, dtype=torch.int64)
                    counts[i].index_add_(0, out, torch.ones(len(out)))
                    seen[i, out] = True
                seen[i, torch.tensor(r.origin_input_ids, dtype=torch.int64)] = True
            info.output_token_counts = counts.to(device)
            info.seen_tokens_mask = seen.to(device)
            info.frequency_penalties = col([p.frequency_penalty for p in params], torch.float32)
            info.presence_penalties = col([p.presence_penalty for p in params], torch.float32)
            info.repetition_penalties = col([p.repetition_penalty for p in params], torch.float32)
        info.stop_tokens_mask = _stop_tokens_mask(reqs, vocab_size, device)
        info.logit_bias = _logit_bias(reqs, vocab_size, device)
        info.vocab_size = vocab_size
        if any(r.grammar is not None for r in reqs):
            info.grammars = [r.grammar for r in reqs]  # (compiled: queued requests are never in a batch)
        return info

    def update_regex_vocab_mask(self) -> None:
        """Fill vocab_mask from the rows' grammars, as they stand now (every token the
        request has so far accepted). A finished grammar's row stays all-allowed."""
        if not self.grammars:
            self.vocab_mask = self.apply_mask_func = None
            return
        first = next(g for g in self.grammars if g is not None)
        mask = first.allocate_vocab_mask(self.vocab_size, len(self.grammars), self.temperatures.device)
        for i, grammar in enumerate(self.grammars):
            if grammar is not None and not grammar.finished and not grammar.is_terminated():
                grammar.fill_vocab_mask(mask, i)
        self.vocab_mask = first.move_vocab_mask(mask, self.temperatures.device)
        self.apply_mask_func = first.apply_vocab_mask

    def apply_vocab_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The grammar rows' refused tokens to -inf, in place (these float32 logits are the
        sampler's own: nothing reads the model's after sampling), and what that did
        (grammar_stats). Row by row: the same bits alone or batched."""
        if self.vocab_mask is None or self.apply_mask_func is None or not self.grammars:
            return logits
        rows = [i for i, g in enumerate(self.grammars) if g is not None and not g.finished]
        # the model's own choice, before the mask (over every row when most have a grammar)
        preferred = (logits.argmax(dim=-1)[rows] if 2 * len(rows) >= len(self.grammars)
                     else logits[rows].argmax(dim=-1)) if rows else torch.empty(0, dtype=torch.int64)
        self.apply_mask_func(logits, self.vocab_mask)
        self.grammar_stats = [None] * len(self.grammars)
        if rows:
            allowed, refused = mask_stats(self.vocab_mask[rows].cpu(), preferred.cpu(), self.vocab_size)
            for row, a, p, r in zip(rows, allowed, preferred.tolist(), refused):
                self.grammar_stats[row] = GrammarStep(a, p, r)
        return logits

    def cumulate_output_tokens(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count tokens sampled after this batch was built (the overlap loop's inputs)."""
        if self.output_token_counts is None or rows.numel() == 0:
            return
        self.output_token_counts[rows, token_ids] += 1
        self.seen_tokens_mask[rows, token_ids] = True

    def apply_logits_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the sampler draws from (SGLang's order): penalties, then
        min_new_tokens' mask, then the grammars' vocab_mask, then logit_bias. Row by
        row: no row reads another."""
        logits = self.apply_penalties(logits)
        if self.stop_tokens_mask is not None:
            logits = logits.masked_fill(self.stop_tokens_mask, float("-inf"))
        logits = self.apply_vocab_mask(logits)
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        return logits

    def apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        if self.output_token_counts is None:
            return logits
        counts = self.output_token_counts
        logits = logits - self.frequency_penalties * counts
        logits = logits - self.presence_penalties * (counts > 0)
        # repetition penalty (CTRL / HF style) on every token seen in prompt or output
        rep = self.repetition_penalties.expand_as(logits)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        return torch.where(self.seen_tokens_mask, penalized, logits)


_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int32)


def mask_stats(bitmask: torch.Tensor, preferred: torch.Tensor, vocab_size: int) -> tuple[list[int], list[bool]]:
    """From xgrammar's bitmask rows (int32, bit t of word t // 32 set: token t allowed):
    how many of the vocabulary's tokens each row allows, and whether each row's
    ``preferred`` token is refused. Counted on the bitmask (a byte table), not on the
    masked logits: 64 rows of 49,152 logits took 6.5 ms to count, their bitmask ~0.1 ms."""
    words = (vocab_size + 31) // 32
    bits = bitmask[:, :words].clone()
    if vocab_size % 32:  # the last word's bits past the vocabulary do not count
        bits[:, -1] &= (1 << (vocab_size % 32)) - 1
    allowed = _POPCOUNT[bits.contiguous().view(torch.uint8).long()].sum(dim=-1)
    word = bits.gather(1, (preferred // 32).view(-1, 1)).view(-1)
    refused = ((word >> (preferred % 32)) & 1) == 0
    return allowed.tolist(), refused.tolist()


def _stop_tokens_mask(reqs: Sequence["Req"], vocab_size: int, device: str | torch.device) -> torch.Tensor | None:
    """[bs, vocab]: True at the EOS and stop token ids of each request that has fewer
    output tokens than its min_new_tokens (counting one still being sampled); None if none has.
    A request with a grammar is not masked: its grammar decides where the output may end
    (where it allows only the stop token, both masks together would allow nothing)."""
    short = [i for i, r in enumerate(reqs)
             if r.seqlen - len(r.origin_input_ids) < r.sampling_params.min_new_tokens and r.grammar is None]
    if not short:
        return None
    mask = torch.zeros((len(reqs), vocab_size), dtype=torch.bool)
    for i in short:
        ids = set(reqs[i].eos_token_ids) | set(reqs[i].sampling_params.stop_token_ids or ())
        mask[i, [t for t in ids if 0 <= t < vocab_size]] = True
    return mask.to(device)


def _logit_bias(reqs: Sequence["Req"], vocab_size: int, device: str | torch.device) -> torch.Tensor | None:
    """[bs, vocab] of each request's logit_bias (zeros elsewhere); None if none has one."""
    if not any(r.sampling_params.logit_bias for r in reqs):
        return None
    bias = torch.zeros((len(reqs), vocab_size), dtype=torch.float32)
    for i, r in enumerate(reqs):
        for token, value in r.sampling_params.bias_ids.items():
            bias[i, token] = value
    return bias.to(device)
