"""ForwardMode and ForwardBatch: one forward's input snapshot (SGLang:
model_executor/forward_batch_info.py). docs/seeds.md §A5: the ScheduleBatch is the round's
plan; ForwardBatch.init_new turns it into what the model reads."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
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
    # sglite: return logits for every row, not only each request's last (tests, logprobs)
    return_all_logits: bool = False

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
