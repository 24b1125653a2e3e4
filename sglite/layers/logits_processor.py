"""LogitsProcessor: hidden states -> logits, only for the rows that are sampled
(SGLang: layers/logits_processor.py). In an extend batch that is each request's last
row: tutorial A's 9 prefill rows (docs/seeds.md §A3) give 2 rows of logits.

The head is the LM head's weight [vocab, hidden] (logits = hidden @ weight.T, in the
model's dtype, then float32), or a packed ``ReplicatedLinear`` (a model on the cpu
backend), whose float32 sums are the logits without a bfloat16 rounding between.

Under tensor parallelism each rank's head holds a shard of the vocabulary
(layers/vocab_parallel_embedding.py): the ranks' logits are all-gathered, side by side
in rank order, and the padding of the last shard is dropped, so every rank returns the
full [rows, vocab] logits.

Prompt logprobs (``return_logprob`` with a ``logprob_start_len`` before the last prompt
token): a request's rows from its ``extend_logprob_start_lens`` entry on, each giving
the log-softmax of its raw logits at the next input token (and its top tokens, and
the tokens it asked about). They are computed here, ``INPUT_LOGPROB_BLOCK`` rows at a
time (a chunk of 8192 rows would be 1.6 GB of float32 logits at SmolLM2's vocabulary),
and left on the ForwardBatch (``input_logprobs``); the model returns the sampled rows'
logits as before, so the graph runners (decode only: no prompt rows) are unchanged.
SGLang returns both in a LogitsProcessorOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglite.distributed.parallel_state import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

if TYPE_CHECKING:
    from sglite.layers.linear import ReplicatedLinear
    from sglite.model_executor.forward_batch_info import ForwardBatch

INPUT_LOGPROB_BLOCK = 256  # prompt rows whose logits exist at once

# a position's top tokens or asked-about tokens: (logprobs, token ids), best first
Candidates = tuple[list[float], list[int]]


@dataclass
class LogprobMetadata:
    """What one round returns of logprobs, per request of the batch (SGLang keeps these
    as fields of ModelWorkerBatch / ForwardBatch / LogitsMetadata). A batch in which no
    request asked for logprobs has none, and costs nothing."""

    return_logprob: list[bool]
    top_logprobs_nums: list[int]
    token_ids_logprobs: list[list[int] | None]
    # extend rounds: the request's first row (counted within its extend rows) whose next
    # input token's logprob is wanted, how many rows from there, and those tokens
    extend_logprob_start_lens: list[int] = field(default_factory=list)
    extend_logprob_pruned_lens: list[int] = field(default_factory=list)
    extend_input_logprob_token_ids: list[int] = field(default_factory=list)

    @property
    def has_input_rows(self) -> bool:
        return any(self.extend_logprob_pruned_lens)


@dataclass
class PositionLogprobs:
    """Logprobs at consecutive positions of one request: the logprob of the token that
    came next, and per position its top tokens and the asked-about tokens (None: not
    asked for)."""

    token_logprobs: list[float] = field(default_factory=list)
    top: list[Candidates] | None = None
    token_ids: list[Candidates] | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tensor_model_parallel_world_size()

    def forward(
        self, hidden_states: torch.Tensor, lm_head: "torch.Tensor | ReplicatedLinear", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        meta = forward_batch.logprob
        if forward_batch.forward_mode.is_extend() and meta is not None and meta.has_input_rows:
            forward_batch.input_logprobs = self._input_logprobs(hidden_states, lm_head, forward_batch, meta)
        if forward_batch.forward_mode.is_extend() and not forward_batch.return_all_logits:
            last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            hidden_states = hidden_states[last]
        return self._logits(hidden_states, lm_head)

    def _logits(self, hidden_states: torch.Tensor, lm_head: "torch.Tensor | ReplicatedLinear") -> torch.Tensor:
        if isinstance(lm_head, torch.Tensor):
            logits = torch.matmul(hidden_states, lm_head.t()).float()
        else:
            logits = lm_head(hidden_states, out_float32=True)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits)[:, : self.vocab_size]

    def _input_logprobs(self, hidden_states: torch.Tensor, lm_head: "torch.Tensor | ReplicatedLinear",
                        fb: "ForwardBatch", meta: LogprobMetadata) -> list[PositionLogprobs]:
        """Per request, its prompt rows' logprobs (raw logits: no temperature, no
        penalties, as SGLang's), block by block. Every tp rank runs the blocks (their
        all-gathers); only rank 0, which samples, keeps the values."""
        starts = fb.extend_start_loc_cpu()
        rows = [starts[i] + s + j for i, (s, n) in enumerate(zip(meta.extend_logprob_start_lens,
                                                                  meta.extend_logprob_pruned_lens)) for j in range(n)]
        owner = [i for i, n in enumerate(meta.extend_logprob_pruned_lens) for _ in range(n)]
        out = [PositionLogprobs(top=[] if k else None, token_ids=[] if ids else None)
               for k, ids in zip(meta.top_logprobs_nums, meta.token_ids_logprobs)]
        for b in range(0, len(rows), INPUT_LOGPROB_BLOCK):
            block = rows[b : b + INPUT_LOGPROB_BLOCK]
            logits = self._logits(hidden_states[torch.tensor(block, device=hidden_states.device)], lm_head)
            if fb.sampling_info is None:
                continue  # a tp follower: it ran the collectives, rank 0 keeps the values
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = meta.extend_input_logprob_token_ids[b : b + len(block)]
            add_position_logprobs(out, owner[b : b + len(block)], logprobs, targets, meta)
        return out


def add_position_logprobs(out: list[PositionLogprobs], owner: list[int], logprobs: torch.Tensor,
                          targets: list[int], meta: LogprobMetadata) -> None:
    """Append, for each row r of ``logprobs`` (a position of request ``owner[r]``), the
    logprob of ``targets[r]``, its top tokens and the asked-about tokens. Each row is
    read alone, so a row's values never depend on the other rows (batch invariance)."""
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)  # no -inf in JSON
    picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).view(-1, 1)).view(-1).tolist()
    max_k = max((meta.top_logprobs_nums[i] for i in set(owner)), default=0)
    top_vals, top_ids = (logprobs.topk(max_k, dim=-1) if max_k else (None, None))
    for r, i in enumerate(owner):
        o = out[i]
        o.token_logprobs.append(picked[r])
        k = meta.top_logprobs_nums[i]
        if k and top_vals is not None and o.top is not None:
            o.top.append((top_vals[r, :k].tolist(), top_ids[r, :k].tolist()))
        ids = meta.token_ids_logprobs[i]
        if ids and o.token_ids is not None:
            o.token_ids.append((logprobs[r, ids].tolist(), list(ids)))
