"""The scheduler's memory self-checks (SGLang: the idle and busy checks of
managers/scheduler.py and its runtime-checker mixin). sglite keeps them in an object
the Scheduler holds, so the scheduling code reads without them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglite.managers.scheduler import Scheduler


class KVAccountingError(RuntimeError):
    """The KV pools' accounting is broken: the engine itself is wrong, not one request
    (KVDoubleFreeError, raised by the allocator, is the other such error)."""


class SchedulerRuntimeChecker:
    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler

    def self_check_during_idle(self, full: bool = False) -> None:
        """With nothing running, every KV slot is free or cached in the tree, no node is
        locked and no request slot is taken: O(1) sums. ``full`` also walks every page
        (--enable-self-check; slow on a big pool). Raises RuntimeError naming what is wrong."""
        s = self.scheduler
        free = s.token_to_kv_pool_allocator.available_size()
        cached = s.tree_cache.evictable_size() + s.tree_cache.protected_size()
        problems = []
        if free + cached != s.max_total_num_tokens:
            problems.append(f"free {free} + cached {cached} != pool {s.max_total_num_tokens}")
        if s.tree_cache.protected_size() != 0:
            problems.append(f"protected_size {s.tree_cache.protected_size()} != 0")
        pool = s.req_to_token_pool
        if pool.available_size() != pool.size:
            problems.append(f"{pool.size - pool.available_size()} req slots held")
        if full:
            problems += self.slot_ownership_problems()
        if problems:
            raise KVAccountingError("KV memory leak detected when idle: " + "; ".join(problems))

    def self_check_during_busy(self) -> None:
        """Every page is free, in the tree, or held by a live request; none is both free
        and used (SGLang's strict busy check; the tests call it every iteration)."""
        problems = self.slot_ownership_problems()
        if problems:
            raise KVAccountingError("KV memory accounting broken: " + "; ".join(problems))

    def reclaim_leaked(self) -> int:
        """After a failed round: KV pages and request rows that nothing owns (neither free,
        cached nor held by a live request) go back to their pools. Returns pages reclaimed."""
        s = self.scheduler
        missing = self._owned_pages()[3]
        if missing:
            pages = torch.tensor(sorted(missing), dtype=torch.int64)
            s.token_to_kv_pool_allocator.free(pages * s.page_size)
        pool = s.req_to_token_pool
        live = {r.req_pool_idx for r in s.live_reqs() if r.req_pool_idx is not None}
        unowned = set(range(pool.size)) - set(pool.free_slots) - {i for i, _ in pool._held} - live
        pool.free_slots.extend(sorted(unowned))
        return len(missing)

    def _owned_pages(self) -> tuple[set[int], set[int], set[int], set[int]]:
        """(free, cached in the tree, held by a live request, none of these) page ids."""
        s = self.scheduler
        page = s.page_size
        free = set(s.token_to_kv_pool_allocator.free_pages)
        tree = set((s.tree_cache.all_values_flatten() // page).tolist())
        held: set[int] = set()
        for req in s.live_reqs():
            if req.req_pool_idx is not None:
                slots = s.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]
                held |= set((slots // page).tolist())
            elif len(req.prefix_indices) and req is s.chunked_req:
                held |= set((req.prefix_indices // page).tolist())
        missing = set(range(1, s.max_total_num_tokens // page + 1)) - free - tree - held
        return free, tree, held, missing

    def slot_ownership_problems(self) -> list[str]:
        s = self.scheduler
        free, tree, held, missing = self._owned_pages()
        problems = []
        if len(free) != len(s.token_to_kv_pool_allocator.free_pages):
            problems.append("a page is free twice")
        if free & tree:
            problems.append(f"{len(free & tree)} pages both free and cached")
        if free & held:
            problems.append(f"{len(free & held)} pages both free and held by a request")
        if missing:
            problems.append(f"{len(missing)} pages leaked (neither free, cached nor held)")
        return problems
