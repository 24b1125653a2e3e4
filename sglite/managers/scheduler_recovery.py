"""What the scheduler does when a round raises (docs/reliability.md). SGLang lets the
scheduler process die; sglite fails only the request that caused it: the round's
requests are retracted and re-run one at a time, alone (on trial), and the one that
fails alone gets the error while the others finish as if nothing had happened."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import Req
    from sglite.managers.scheduler import Scheduler

# a request of a failed round is on trial (runs alone) until it has this many more tokens
TRIAL_TOKENS = 2
logger = logging.getLogger("sglite")


class SchedulerRecovery:
    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler
        # requests of a failed round, each with the output length that ends its trial
        self.on_trial: list[tuple[Req, int]] = []

    def admission_candidates(self, running_bs: int) -> list[Req] | None:
        """The waiting requests admission may offer; None: none may run this round.
        While requests of a failed round are on trial (fail_round), one of them runs at a
        time, alone: nothing else is admitted until the last one passes."""
        s = self.scheduler
        self.on_trial = [(r, n) for r, n in self.on_trial if not r.finished() and len(r.output_ids) < n]
        if not self.on_trial:
            return s.waiting_queue
        waiting = set(map(id, s.waiting_queue))
        if running_bs or s.chunked_req is not None:
            return None
        return [r for r, _ in self.on_trial if id(r) in waiting][:1] or None

    def fail_round(self, error: Exception) -> None:
        """A round raised. With one request in it, that request gets the error. With
        more, any of them may be the culprit and the rest innocent batch-mates: all go
        back to the waiting queue and re-run one at a time (on trial); whichever fails
        alone gets the error, the others run on (tests/managers/test_reliability.py)."""
        s = self.scheduler
        logger.error("iteration %d failed", s.iteration, exc_info=error)
        for _, result in s.result_queue:
            result.done.wait()  # (overlap) no forward may still write KV slots freed below
        batches = [b for b in (s.cur_batch, s.last_batch, s.running_batch) if b is not None]
        batches += [b for b, _ in s.result_queue]
        s.result_queue.clear()
        s.req_to_token_pool.mark_forward_done(s.forward_ct)
        in_round = [r for b in batches for r in b.reqs] + ([s.chunked_req] if s.chunked_req else [])
        suspects = list({id(r): r for r in in_round if not r.finished()}.values())
        message = f"internal error in iteration {s.iteration}: " + " ".join(f"{type(error).__name__}: {error}".split())
        if len(suspects) > 1:
            self._retract_all_for_trial(suspects, message)
        elif suspects:
            suspects[0].future_token_id = None
            s.abort_now(suspects[0], message[:300], is_error=True)
        s.running_batch.filter_batch()
        s.cur_batch = s.last_batch = None
        s.runtime_checker.reclaim_leaked()

    def _retract_all_for_trial(self, suspects: list[Req], message: str) -> None:
        """Retract every request that holds KV and empty the cache and pools (the failed
        round may have left KV half written); the suspects go first in the queue, each
        on trial until it has TRIAL_TOKENS more tokens."""
        s = self.scheduler
        waiting = set(map(id, s.waiting_queue))
        held = [r for r in {id(r): r for r in suspects + s.live_reqs()}.values() if id(r) not in waiting]
        for req in held:
            req.reset_for_retract()
            req.req_pool_idx, req.is_chunked = None, 0
            req.retract_kept_tokens = 0  # the cache is emptied below
        s.chunked_req = None
        s.running_batch = s.make_batch([])
        s.flush_cache(force=True)
        on_trial = set(map(id, suspects))
        s.waiting_queue = suspects + [r for r in held + s.waiting_queue if id(r) not in on_trial]
        self.on_trial += [(r, len(r.output_ids) + TRIAL_TOKENS) for r in suspects]
        s.observer.on_retract(held, s.new_token_ratio, s.new_token_ratio,
                              reason=f"{message[:200]}; its requests re-run one at a time")
