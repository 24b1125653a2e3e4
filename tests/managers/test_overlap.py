"""The overlap loop (docs/seeds.md §B6): round N+1 is planned while round N runs, with future
token ids; results lag one iteration; a request finished by round N but already planned
into N+1 loses that extra token and frees its memory exactly once."""

from __future__ import annotations

import random

import pytest

from sglite import events as ev
from sglite.engine import Engine
from sglite.mem_cache.memory_pool import ReqToTokenPool
from sglite.model_executor.forward_batch_info import ForwardMode

GREEDY = {"temperature": 0, "ignore_eos": True}


def make_engine(overlap: bool = True, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 64)
    kw.setdefault("enable_self_check", True)  # the idle rounds walk every page
    return Engine("tiny-random", disable_overlap_schedule=not overlap, **kw)


def spy_forward_inputs(engine: Engine) -> list[tuple[ForwardMode, list[int], list[int]]]:
    """(mode, input_ids, positions) of every forward, as the model saw them."""
    seen = []
    runner = engine.scheduler.tp_worker.model_runner
    real = runner.forward

    def forward(fb):
        seen.append((fb.forward_mode, fb.input_ids.tolist(), fb.positions.tolist()))
        return real(fb)

    runner.forward = forward
    return seen


def run_to_idle(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.scheduler.has_work():
            engine.step()  # idle round: self_check_during_idle raises on a leak
            return
        engine.step()
        engine.scheduler.runtime_checker.self_check_during_busy()
    raise AssertionError("did not finish")


def test_seed_example_through_the_overlap_loop():
    engine = make_engine()
    sched = engine.scheduler
    engine.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 1, **GREEDY})
    run_to_idle(engine)
    seen = spy_forward_inputs(engine)
    engine.submit(input_ids=[21, 22, 23, 24, 25, 26], sampling_params={"max_new_tokens": 4, **GREEDY}, rid="R1")
    engine.submit(input_ids=[11, 12, 13, 31, 32, 33], sampling_params={"max_new_tokens": 4, **GREEDY}, rid="R2")

    engine.step()  # plan and launch the prefill; nothing to process yet
    b = sched.cur_batch
    assert (b.forward_mode, b.prefix_lens, b.extend_lens, b.seq_lens) == (ForwardMode.EXTEND, [0, 3], [6, 3], [6, 6])
    assert len(b.input_ids) == 9 and len(b.out_cache_loc) == 9
    r1, r2 = b.reqs
    assert r1.output_ids == [] and r2.output_ids == []  # T1, T2 are still futures
    f1, f2 = r1.future_token_id, r2.future_token_id
    assert f1 < 0 and f2 < 0 and f1 != f2

    engine.step()  # plan the decode from the futures, launch it, then process the prefill
    b = sched.cur_batch
    assert b.forward_mode == ForwardMode.DECODE
    assert b.input_ids == [f1, f2]  # placeholders, not tokens
    assert b.seq_lens == [7, 7]  # 6 + the token being sampled
    t1, t2 = r1.output_ids[0], r2.output_ids[0]  # the prefill's results, processed while the decode ran
    engine.step()
    assert seen[0][0] == ForwardMode.EXTEND and len(seen[0][1]) == 9
    mode, ids, positions = seen[1]
    assert mode == ForwardMode.DECODE and ids == [t1, t2] and positions == [6, 6]  # resolved on the worker
    run_to_idle(engine)

    normal = make_engine(overlap=False)
    normal.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 1, **GREEDY})
    outs = normal.generate(input_ids=[[21, 22, 23, 24, 25, 26], [11, 12, 13, 31, 32, 33]],
                           sampling_params={"max_new_tokens": 4, **GREEDY})
    assert [engine.result("R1")["output_ids"], engine.result("R2")["output_ids"]] == [o["output_ids"] for o in outs]
    assert engine.result("R2")["meta_info"]["cached_tokens"] == 3


def test_a_request_finished_by_round_n_drops_its_extra_token_in_round_n_plus_1():
    engine = make_engine()
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    lengths = {"a": 1, "b": 3, "c": 6}
    for rid, n in lengths.items():
        engine.submit(input_ids=[5, 6, 7, len(rid) + n], sampling_params={"max_new_tokens": n, **GREEDY}, rid=rid)
    run_to_idle(engine)
    for rid, n in lengths.items():
        emitted = [t for e in log.of(ev.TokensEmitted) if e.rid == rid for t in e.token_ids]
        assert len(emitted) == n == len(engine.result(rid)["output_ids"])  # the extra token is never streamed
        rounds = [e for e in log.of(ev.BatchPlanned) if rid in e.rids]
        # the normal loop runs a request in n rounds (prefill + n-1 decodes); the overlap
        # loop has already planned it once more when round n's result says it is done
        assert len(rounds) == n + 1
        (finished,) = [e for e in log.of(ev.ReqFinished) if e.rid == rid]
        assert finished.ts > rounds[-1].ts
    sched = engine.scheduler
    assert sched.token_to_kv_pool_allocator.available_size() + sched.tree_cache.total_size() == sched.max_total_num_tokens
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def test_penalties_count_the_token_that_was_a_future():
    """Penalties count the output so far. In the overlap loop a decode batch is built
    while its input token is still a future; the worker counts it before sampling. With
    every prompt 8 tokens long, a decode row at position p has p - 7 output tokens."""
    engine = make_engine()
    runner = engine.scheduler.tp_worker.model_runner
    real_sample, checked = runner.sample, []

    def sample(logits, fb):
        if fb.forward_mode.is_decode():
            counts = fb.sampling_info.output_token_counts.sum(dim=1).tolist()
            assert counts == [p - 7 for p in fb.positions.tolist()]
            checked.append(len(counts))
        return real_sample(logits, fb)

    runner.sample = sample
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 60) for _ in range(8)] for _ in range(6)]
    penalized = {"max_new_tokens": 12, "frequency_penalty": 0.5, "repetition_penalty": 1.2, **GREEDY}
    outs = engine.generate(input_ids=prompts, sampling_params=penalized)
    assert sum(checked) >= 6 * 10
    normal = make_engine(overlap=False).generate(input_ids=prompts, sampling_params=penalized)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in normal]


def test_seeded_sampling_equals_the_normal_loop():
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    params = [{"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": i, "ignore_eos": True}
              for i in range(len(prompts))]
    outs = [[o["output_ids"] for o in make_engine(overlap=ov).generate(input_ids=prompts, sampling_params=params)]
            for ov in (True, False)]
    assert outs[0] == outs[1]


def test_abort_while_the_round_is_in_flight_frees_everything():
    engine = make_engine(chunked_prefill_size=8)
    params = {"max_new_tokens": 30, **GREEDY}
    engine.submit(input_ids=[9, 8, 7, 6], sampling_params=params, rid="run")
    engine.submit(input_ids=list(range(3, 40)), sampling_params=params, rid="chunk")
    engine.step()
    engine.step()
    engine.abort("run")
    engine.abort("chunk")
    run_to_idle(engine)
    for rid in ("run", "chunk"):
        assert engine.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    sched = engine.scheduler
    assert sched.token_to_kv_pool_allocator.available_size() + sched.tree_cache.total_size() == sched.max_total_num_tokens
    assert sched.tree_cache.protected_size() == 0


def test_a_failing_forward_fails_its_requests_not_the_engine():
    engine = make_engine()
    runner = engine.scheduler.tp_worker.model_runner
    forward = runner.forward

    def broken(fb):
        raise ValueError("boom")

    runner.forward = broken
    rid = engine.submit(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2, **GREEDY})
    engine.step()  # launched; the error surfaces when the result is collected
    engine.step()
    res = engine.result(rid)
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert "forward of batch 1 failed" in res["error"] and "boom" in res["error"]
    runner.forward = forward
    out = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2, **GREEDY})
    assert "error" not in out and len(out["output_ids"]) == 2
    engine.step()  # idle: the page walk finds nothing leaked


def test_a_row_freed_under_a_running_forward_is_held_back():
    pool = ReqToTokenPool(3, 8)
    a, b, c = pool.alloc(3)
    pool.forward_launched = 5  # batch 5 is running and may read row a
    pool.free(a)
    assert pool.available_size() == 1 and pool.alloc(1) is None
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)
    pool.mark_forward_done(5)
    assert pool.alloc(1) == [a]
    pool.free([b, c])  # no forward in flight: free at once
    assert sorted(pool.alloc(2)) == [b, c]
