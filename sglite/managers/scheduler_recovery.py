"""What the scheduler does when a round raises (docs/reliability.md). SGLang lets the
scheduler process die; sglite fails only the request that caused it: the round's
requests are retracted and re-run one at a time, alone (on trial), and the one that
fails alone gets the error while the others finish as if nothing had happened.

Recovery keeps everything the failure cannot have touched: the requests outside the
failed round(s) run on, and the radix cache keeps every node except those holding a KV
slot that a failed (or unprocessed, later) forward wrote. Only the overlap loop can
have such nodes: it caches a prefilled prompt or chunk (Scheduler._cache_prefilled,
cache_unfinished_req of the chunked request, an abort's cache_finished_req) one round
before that round's result says whether its forward succeeded."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sglite.managers.scheduler_runtime_checker import KVAccountingError
from sglite.mem_cache.memory_pool import page_align_down
from sglite.mem_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import Req, ScheduleBatch
    from sglite.managers.scheduler import Scheduler
    from sglite.mem_cache.radix_cache import TreeNode

# a request of a failed round is on trial (runs alone) until it has this many more tokens
TRIAL_TOKENS = 2
logger = logging.getLogger("sglite")


def _settled(req: Req) -> bool:
    """Its KV and tokens are exactly what processed forwards gave it: no round of it is
    planned or in flight (all but its last sampled token have KV, and nothing more)."""
    return (req.req_pool_idx is not None and req.future_token_id is None and bool(req.output_ids)
            and req.kv_committed_len == len(req.origin_input_ids) + len(req.output_ids) - 1)


def _unique(reqs: list[Req]) -> list[Req]:
    return list({id(r): r for r in reqs}.values())


class SchedulerRecovery:
    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler
        # requests of a failed round, each with the output length that ends its trial
        self.on_trial: list[tuple[Req, int]] = []

    def admission_candidates(self, running_bs: int) -> list[Req] | None:
        """The waiting requests admission may offer; None: none may run this round.
        While requests of a failed round are on trial (fail_round), one of them runs at a
        time, alone: nothing else is admitted until the last one passes. One past
        admission counts as running even before it joins the running batch: its last
        chunk, added this round, leaves chunked_req None."""
        s = self.scheduler
        self.on_trial = [(r, n) for r, n in self.on_trial if not r.finished() and len(r.output_ids) < n]
        if not self.on_trial:
            return s.waiting_queue
        waiting = set(map(id, s.waiting_queue))
        if running_bs or s.chunked_req is not None or any(id(r) not in waiting for r, _ in self.on_trial):
            return None
        return [r for r, _ in self.on_trial if id(r) in waiting][:1] or None

    def fail_round(self, error: Exception) -> None:
        """A round raised. With one request in it, that request gets the error. With
        more, any of them may be the culprit and the rest innocent batch-mates: all go
        back to the waiting queue and re-run one at a time (on trial); whichever fails
        alone gets the error, the others run on (tests/managers/test_reliability.py).
        Requests outside the round keep running, and the radix cache keeps all but the
        nodes a failed forward may have written."""
        s = self.scheduler
        logger.error("iteration %d failed", s.iteration, exc_info=error)
        for _, result in s.result_queue:
            result.done.wait()  # (overlap) no forward may still write KV slots freed below
        broken = self._broken_nodes(self._half_written_slots())
        suspects, round_size = self._round_reqs()
        s.result_queue.clear()
        s.req_to_token_pool.mark_forward_done(s.forward_ct)
        message = f"internal error in iteration {s.iteration}: " + " ".join(f"{type(error).__name__}: {error}".split())
        in_round = set(map(id, suspects))
        running = [r for r in s.running_batch.reqs if not r.finished() and id(r) not in in_round]
        # outside the round, but its prefix runs through a broken node: it cannot go on
        stranded = [r for r in running if self._path_hits(r.last_node, broken)]
        # alone in its round(s): the culprit. With a batch-mate, even one that finished
        # (the overlap loop's in-flight round keeps its row), the trial decides.
        culprit = suspects[0] if len(suspects) == 1 and round_size == 1 else None
        trial = [] if culprit else suspects
        if culprit is not None:
            culprit.future_token_id = None
            self._free_held(culprit)
        self._retract(trial + stranded, broken)
        self._remove_nodes(broken)
        s.running_batch = s.make_batch([r for r in running if r not in stranded])
        if culprit is not None:
            s.abort_now(culprit, message[:300], is_error=True)
        self._requeue(trial, stranded)
        if trial or stranded:
            s.observer.on_retract(trial + stranded, s.new_token_ratio, s.new_token_ratio,
                                  reason=f"{message[:200]}; its requests re-run one at a time")
        s.cur_batch = s.last_batch = None
        leaked = s.runtime_checker.reclaim_leaked()
        if leaked:
            logger.error("recovery from iteration %d left %d KV pages unowned; reclaimed", s.iteration, leaked)

    def _round_reqs(self) -> tuple[list[Req], int]:
        """The unfinished requests of the failed round(s), and how many requests the
        round(s) had in all: the batch planned or run this iteration (cur_batch; before
        this iteration sets it, the last one, which is conservative), in the overlap loop
        also the round launched before it and not yet processed (last_batch,
        result_queue), the chunked request, and the whole running batch if any of it had
        a round planned (it is that round)."""
        s = self.scheduler
        batches: list[ScheduleBatch | None] = [s.cur_batch] + [b for b, _ in s.result_queue]
        if s.enable_overlap:
            batches.append(s.last_batch)
        reqs = [r for b in batches if b is not None for r in b.reqs]
        reqs += [s.chunked_req] if s.chunked_req is not None else []
        if not all(_settled(r) for r in s.running_batch.reqs if not r.finished()):
            reqs += s.running_batch.reqs
        reqs = _unique(reqs)
        return [r for r in reqs if not r.finished()], len(reqs)

    def _half_written_slots(self) -> torch.Tensor:
        """The KV slots a forward may have left half written: those of every forward
        launched and not processed (bid above forward_done) from the first one that failed
        on; a later one read that one's KV. One that finished without error before any
        failed wrote all of its slots."""
        s = self.scheduler
        done = s.req_to_token_pool.forward_done
        queued = [(b, r) for b, r in s.result_queue if r.bid > done]
        first = next((i for i, (_, r) in enumerate(queued) if r.error is not None), len(queued))
        broken: list[ScheduleBatch | None] = [b for b, _ in queued[first:]]
        if s.forward_ct - done > len(queued):  # a launched forward left no result queued
            if queued and queued[0][1].bid == done + 1:
                broken.append(s.cur_batch)  # this round's, newest: it raised in run_batch
            else:  # (overlap) the last round's, oldest: taken off the queue, its result raised
                lost = s.last_batch if s.enable_overlap and s.last_batch is not None else s.cur_batch
                broken = [lost] + [b for b, _ in queued]
        locs = [b.out_cache_loc.reshape(-1) for b in broken if b is not None]
        return torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64)

    def _broken_nodes(self, slots: torch.Tensor) -> list[TreeNode]:
        """The radix tree's nodes holding any of ``slots``, with everything below them
        (computed over their KV), parents before children."""
        tree = self.scheduler.tree_cache
        if not isinstance(tree, RadixCache) or not len(slots):
            return []
        broken: list[TreeNode] = []
        stack = list(tree.root_node.children.values())
        while stack:
            node = stack.pop()
            if bool(torch.isin(node.value, slots.to(node.value.device)).any()):
                below = [node]
                for n in below:  # grows while it is walked: the whole subtree, top down
                    below.extend(n.children.values())
                broken += below
            else:
                stack.extend(node.children.values())
        return broken

    def _path_hits(self, node: TreeNode | None, nodes: list[TreeNode]) -> bool:
        ids = set(map(id, nodes))
        while node is not None:
            if id(node) in ids:
                return True
            node = node.parent
        return False

    def _kept_len(self, req: Req, broken: list[TreeNode]) -> int:
        """Tokens of the request's cached prefix that stay in the tree (down to the first
        broken node)."""
        path: list[TreeNode] = []
        node = req.last_node if isinstance(self.scheduler.tree_cache, RadixCache) else None
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        ids, kept = set(map(id, broken)), 0
        for node in reversed(path):
            if id(node) in ids:
                break
            kept += len(node.key)
        return kept

    def _retract(self, reqs: list[Req], broken: list[TreeNode]) -> None:
        """Back to waiting, each with its tokens and none of its KV cached (what it wrote
        past its tree prefix may be half written)."""
        for req in reqs:
            kept = self._kept_len(req, broken)
            if self._free_held(req):
                req.reset_for_retract()
                req.is_chunked = 0
                req.retract_kept_tokens = kept

    def _free_held(self, req: Req) -> bool:
        """Release what the request holds; False if it holds nothing (it is waiting:
        retracted this round already)."""
        s = self.scheduler
        if req in s.waiting_queue:
            return False
        self._release(req)
        if req is s.chunked_req:
            s.chunked_req = None
        return True

    def _release(self, req: Req) -> None:
        """Free the request's own KV slots (past the page-aligned part of prefix_indices,
        which the tree owns; with ChunkCache all of them), its req_to_token row and its
        lock on the prefix, which stays cached."""
        s = self.scheduler
        owned_from = len(req.prefix_indices) if isinstance(s.tree_cache, RadixCache) else 0
        owned_from = page_align_down(owned_from, s.page_size)
        if req.req_pool_idx is not None:
            own = s.req_to_token_pool.req_to_token[req.req_pool_idx, owned_from:req.kv_committed_len].clone()
            s.req_to_token_pool.free(req.req_pool_idx)
        else:  # the chunked request between chunks: its unaligned tail (cache_unfinished_req)
            own = req.prefix_indices[owned_from:]
        s.token_to_kv_pool_allocator.free(own)
        s.tree_cache.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.last_node = None, None

    def _remove_nodes(self, broken: list[TreeNode]) -> None:
        """Delete the broken nodes (children first) and free their slots; every request
        that locked one was retracted above, so none may be locked now."""
        s = self.scheduler
        for node in reversed(broken):
            if node.lock_ref:
                raise KVAccountingError(f"{node!r} holds half-written KV and is still locked after recovery")
            s.token_to_kv_pool_allocator.free(node.value)
            s.tree_cache._delete_leaf(node)
        if broken:
            logger.warning("dropped %d cached tokens (%d nodes) that a failed forward may have written",
                           sum(len(n.value) for n in broken), len(broken))

    def _requeue(self, trial: list[Req], others: list[Req]) -> None:
        """The requests on trial go first in the waiting queue, each until it has
        TRIAL_TOKENS more tokens; the others retracted go next."""
        s = self.scheduler
        first = set(map(id, trial))
        s.waiting_queue = trial + [r for r in _unique(others + s.waiting_queue) if id(r) not in first]
        self.on_trial += [(r, len(r.output_ids) + TRIAL_TOKENS) for r in trial]
