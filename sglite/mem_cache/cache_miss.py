"""Why an admitted request's prompt was not all served from the radix cache
(docs/why.md). Its tokens split into: matched (from the cache), evicted (they were
cached, and LRU eviction took them), page tail (a last partial page: the tree matches
whole pages), the last token (always computed: its logits are sampled), and the rest,
which no cached sequence continues (past token k, or from the start: new)."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from sglite.mem_cache.memory_pool import page_align_down

# how many evicted leaves the cache remembers (their full keys), to tell evicted from new
EVICTED_MEMORY = 256


class EvictedKey(NamedTuple):
    key: tuple[int, ...]  # the evicted leaf's whole path from the root
    start: int  # where the leaf began: tokens before it stayed cached
    iteration: int  # when it was evicted
    lru_rank: int  # its place in that eviction's least-recently-used order (0: first out)
    extra_key: str | None = None  # the cache key it was stored under (RadixCache's extra_key)


class CacheMiss(NamedTuple):
    """One admission's prompt tokens, by why they were or were not cached. The counts
    add up to the request's fill length (prompt + output so far)."""

    matched: int
    evicted: int = 0
    evicted_at: int = 0  # the iteration of the latest eviction that took some of them
    page_tail: int = 0
    last_token: int = 0
    diverged_at: int = -1  # the cache held its first k tokens and nothing continuing them; -1: k = 0
    rest: int = 0  # past token k (or new)
    radix_off: bool = False

    @property
    def reason(self) -> str:
        """The main reason the computed tokens were computed, in words."""
        if self.radix_off:
            return "radix cache off (--disable-radix-cache)"
        parts = []
        if self.evicted:
            parts.append(f"{self.evicted} evicted at iteration {self.evicted_at}")
        if self.rest:
            parts.append(f"{self.rest} past token {self.diverged_at}, where nothing cached continues like it"
                         if self.diverged_at > 0 else f"{self.rest} new: nothing cached starts like it")
        if self.page_tail:
            parts.append(f"{self.page_tail} in a last partial page")
        if self.last_token:
            parts.append("the last token (always computed)")
        return "; ".join(parts) or "all cached"


class EvictionMemory:
    """The keys of recently evicted leaves (RadixCache.evict records them)."""

    def __init__(self, size: int = EVICTED_MEMORY):
        self.keys: deque[EvictedKey] = deque(maxlen=size)

    def record(self, key: tuple[int, ...], start: int, iteration: int, lru_rank: int,
               extra_key: str | None = None) -> None:
        self.keys.append(EvictedKey(key, start, iteration, lru_rank, extra_key))

    def longest(self, key: list[int], matched: int, extra_key: str | None = None) -> tuple[int, int]:
        """How far ``key`` runs along an evicted leaf past ``matched``, and when that
        leaf was evicted: (length, iteration); (matched, 0) when none does. Only leaves
        of the same ``extra_key`` count: a request could never have matched another
        key's tokens, and naming them would tell it what another client sent."""
        best, when = matched, 0
        for e in self.keys:
            if e.extra_key != extra_key:
                continue
            if e.start > matched or len(e.key) <= best or e.key[matched: matched + 1] != tuple(key[matched: matched + 1]):
                continue
            n = matched
            limit = min(len(e.key), len(key))
            while n < limit and e.key[n] == key[n]:
                n += 1
            if n > best or (n == best and e.iteration > when):
                best, when = n, e.iteration
        return best, when


def classify(fill_ids: list[int], matched: int, page_size: int, evicted: EvictionMemory | None,
             extra_key: str | None = None) -> CacheMiss:
    """``matched``: tokens the cache served (page-aligned, as match_prefix returns
    them); ``evicted``: the cache's EvictionMemory, None when the radix cache is off;
    ``extra_key``: the request's cache key (only its own key's evictions explain it)."""
    n = len(fill_ids)
    if evicted is None:
        return CacheMiss(matched=0, rest=n, radix_off=True)
    matchable = page_align_down(n - 1, page_size)  # the last token is never looked up
    reached, when = evicted.longest(fill_ids[:matchable], matched, extra_key)
    reached = min(reached, matchable)
    page_tail = (n - 1) - matchable if reached == matchable else 0
    rest = n - 1 - reached - page_tail
    return CacheMiss(matched, reached - matched, when if reached > matched else 0, page_tail, 1,
                     reached if reached > 0 else -1, rest)
