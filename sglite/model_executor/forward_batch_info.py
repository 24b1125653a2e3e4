"""ForwardMode and ForwardBatch: one forward's input snapshot (SGLang:
model_executor/forward_batch_info.py). docs/seeds.md §A5: the ScheduleBatch is the round's
plan; ForwardBatch.init_new turns it into what the model reads."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglite.layers.logits_processor import LogprobMetadata, PositionLogprobs
    from sglite.managers.schedule_batch import ModelWorkerBatch
    from sglite.model_executor.model_runner import ModelRunner
    from sglite.layers.attention.base_attn_backend import AttentionBackend
    from sglite.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglite.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly on top of a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # prefill rows plus the running requests as 1-token extends
    IDLE = auto()  # nothing to run

    def __str__(self) -> str:  # IntEnum would print a bare number
        return f"ForwardMode.{self.name}"

    __format__ = object.__format__

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens]
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs], lengths after this forward
    out_cache_loc: torch.Tensor  # [num_tokens], KV slot written by each row
    seq_lens_sum: int
    positions: torch.Tensor  # [num_tokens]
    seq_lens_cpu: list[int]
    extend_num_tokens: int | None = None
    extend_seq_lens: torch.Tensor | None = None  # [bs]
    extend_prefix_lens: torch.Tensor | None = None  # [bs]
    extend_start_loc: torch.Tensor | None = None  # [bs], exclusive cumsum of extend_seq_lens
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    sampling_info: "SamplingBatchInfo | None" = None
    req_to_token_pool: "ReqToTokenPool | None" = None
    token_to_kv_pool: "MHATokenToKVPool | None" = None
    attn_backend: "AttentionBackend | None" = None
    # sglite: return logits for every row, not only each request's last (tests)
    return_all_logits: bool = False
    # the logprobs the round returns (None: no request asked); the LogitsProcessor leaves
    # the prompt positions' here, per request
    logprob: "LogprobMetadata | None" = None
    input_logprobs: "list[PositionLogprobs] | None" = None

    def extend_start_loc_cpu(self) -> list[int]:
        """Each request's first row in an extend batch."""
        starts, at = [], 0
        for n in self.extend_seq_lens_cpu or []:
            starts.append(at)
            at += n
        return starts

    @classmethod
    def init_new(cls, batch: "ModelWorkerBatch", model_runner: "ModelRunner") -> "ForwardBatch":
        """The round's lists as tensors on the model's device, plus positions and the
        extend offsets the attention backends read."""
        device = model_runner.device
        seq_lens_cpu = [int(x) for x in batch.seq_lens]
        bs = len(seq_lens_cpu)
        fb = cls(
            forward_mode=batch.forward_mode,
            batch_size=bs,
            input_ids=torch.as_tensor(batch.input_ids, dtype=torch.int64).to(device),
            req_pool_indices=torch.as_tensor(batch.req_pool_indices, dtype=torch.int64).to(device),
            seq_lens=torch.as_tensor(seq_lens_cpu, dtype=torch.int64).to(device),
            out_cache_loc=torch.as_tensor(batch.out_cache_loc, dtype=torch.int64).to(device),
            seq_lens_sum=sum(seq_lens_cpu),
            positions=torch.empty(0),
            seq_lens_cpu=seq_lens_cpu,
            sampling_info=batch.sampling_info,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
            return_all_logits=batch.return_all_logits,
            logprob=batch.logprob,
        )
        if fb.forward_mode.is_decode():
            # seq_lens already count the token being decoded
            fb.positions = fb.seq_lens - 1
        else:
            prefix = [int(x) for x in batch.prefix_lens]
            extend = [int(x) for x in batch.extend_lens]
            fb.extend_prefix_lens_cpu = prefix
            fb.extend_seq_lens_cpu = extend
            fb.extend_num_tokens = sum(extend)
            fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int64, device=device)
            fb.extend_seq_lens = torch.tensor(extend, dtype=torch.int64, device=device)
            fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
            fb.positions = torch.cat(
                [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix, extend)]
            ).to(device) if bs else torch.empty(0, dtype=torch.int64, device=device)
        return fb


@dataclass
class ForwardBatchBroadcast:
    """What tensor-parallel rank 0 sends the other ranks before each forward
    (ModelRunner.forward; docs/tensor_parallel.md). Only rank 0 schedules: the others
    have no requests, no allocator and no radix tree, only a KV pool for their heads at
    the same slot indices and a req_to_token table that this message keeps equal to
    rank 0's for the rows the forward reads. Its fields are the ModelWorkerBatch's
    that ForwardBatch.init_new reads, plus ``prefix_slots``: the KV slots of each
    extend row's cached prefix (the radix tree's match, or its own earlier chunks),
    which only rank 0's table has. A decode row's earlier slots were sent when it was
    prefilled, its new slot is its out_cache_loc; and ``rewrites`` carries what rank 0
    changed in live rows since the last forward (the radix cache pointing a request's
    positions at its own copy of a prefix, after freeing the duplicate slots: without
    it a later decode on the other ranks read slots that another request then
    overwrote)."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # on the CPU
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    prefix_slots: torch.Tensor  # extend: req_to_token[idx, :prefix_len] of each row, one after another
    return_all_logits: bool = False
    # which rows give prompt logprobs: every rank computes their logits (all-gathers)
    logprob: "LogprobMetadata | None" = None
    rewrites: list[tuple[int, list[int], list[int]]] | None = None  # (row, positions, slots)
    sampling_info: None = None  # the other ranks do not sample

    @classmethod
    def of(cls, fb: ForwardBatch) -> "ForwardBatchBroadcast":
        assert fb.req_to_token_pool is not None
        table = fb.req_to_token_pool.req_to_token
        prefix = fb.extend_prefix_lens_cpu or []
        slots = [table[idx, :p] for idx, p in zip(fb.req_pool_indices.tolist(), prefix)]
        return cls(fb.forward_mode, fb.input_ids.cpu(), fb.req_pool_indices.tolist(), list(fb.seq_lens_cpu),
                   fb.out_cache_loc.cpu(), prefix, fb.extend_seq_lens_cpu or [],
                   torch.cat(slots).cpu() if slots else torch.empty(0, dtype=torch.int64), fb.return_all_logits,
                   fb.logprob, fb.req_to_token_pool.take_rewrites())

    def to_forward_batch(self, model_runner: "ModelRunner") -> ForwardBatch:
        """Write the rows' slots into this rank's req_to_token, then the ForwardBatch."""
        table = model_runner.req_to_token_pool.req_to_token
        rows = torch.as_tensor(self.req_pool_indices, dtype=torch.int64)
        if self.forward_mode.is_decode():
            table[rows.to(table.device), torch.as_tensor(self.seq_lens, device=table.device) - 1] = \
                self.out_cache_loc.to(table.device)
        else:
            done, row_start = 0, 0
            for idx, p, e in zip(self.req_pool_indices, self.prefix_lens, self.extend_lens):
                table[idx, :p] = self.prefix_slots[done : done + p].to(table.device)
                table[idx, p : p + e] = self.out_cache_loc[row_start : row_start + e].to(table.device)
                done, row_start = done + p, row_start + e
        for idx, positions, slots in self.rewrites or []:  # (the latest: after the round's writes)
            table[idx, torch.as_tensor(positions, device=table.device)] = torch.as_tensor(slots, device=table.device)
        return ForwardBatch.init_new(self, model_runner)  # type: ignore[arg-type]
