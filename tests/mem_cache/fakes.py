"""A stand-in for managers.schedule_batch.Req with only the fields the caches use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    req_pool_idx: int | None = None
    kv_committed_len: int = 0  # positions with a slot in its req_to_token row (the tests' helpers keep it, as Req)
    extra_key: str | None = None  # its cache key (None: the shared, unkeyed tree)
