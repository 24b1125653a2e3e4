"""How a tensor-parallel rank's shard is cut (SGLang: distributed/utils.py ``divide``;
sglite also cuts counts that do not divide, see ``head_shard``)."""

from __future__ import annotations

from dataclasses import dataclass


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``total`` items cut into ``parts`` contiguous pieces as equal as
    they can be (the first ``total % parts`` pieces one longer): (start, size)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes. Query heads of one KV head (a GQA group)
    always stay on the rank that holds that KV head."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 16) -> list[int]:
    return [tp for tp in range(1, limit + 1) if _fits(num_heads, num_kv_heads, tp)]


def _fits(num_heads: int, num_kv_heads: int, tp: int) -> bool:
    if tp <= num_kv_heads:
        return True
    return tp % num_kv_heads == 0 and num_heads % tp == 0


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """tp <= KV heads: the KV heads are cut into ``tp_size`` contiguous groups as equal as
    they can be (SmolLM2 at tp 2: 3 KV heads -> 2 + 1, query heads 6 + 3), each rank
    taking its KV heads' query heads. tp > KV heads (tp a multiple of them, the query
    heads a multiple of tp): each rank holds one KV head, replicated tp / KV times, and
    an equal share of the query heads, as SGLang does."""
    if not _fits(num_heads, num_kv_heads, tp_size):
        raise ValueError(f"--tp-size {tp_size} cannot split {num_heads} attention heads over {num_kv_heads} KV heads; "
                         f"sizes that can: {', '.join(map(str, valid_tp_sizes(num_heads, num_kv_heads)))}")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv = split_range(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv * group, kv_start, kv)
    per_rank = num_heads // tp_size
    return HeadShard(rank * per_rank, per_rank, rank * num_kv_heads // tp_size, 1)
