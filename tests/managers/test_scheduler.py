"""The scheduler on the tiny random model: the seed's worked example, finish reasons,
aborts, bad requests, and that scheduling never changes results."""

from __future__ import annotations

import pytest

import random


from sglite import events as ev
from sglite.engine import Engine
from sglite.model_executor.forward_batch_info import ForwardMode


def make_engine(**kw) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 64)
    kw.setdefault("enable_self_check", True)  # the idle rounds walk every page
    return Engine("tiny-random", **kw)


def spy_forwards(engine: Engine) -> list:
    """Record every ForwardBatch the model runner receives."""
    seen = []
    runner = engine.scheduler.tp_worker.model_runner
    real = runner.forward

    def forward(fb):
        seen.append(fb)
        return real(fb)

    runner.forward = forward
    return seen


def run_to_idle(engine: Engine, check_busy: bool = True, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not engine.scheduler.has_work():
            engine.step()  # the idle round runs self_check_during_idle
            return
        engine.step()
        if check_busy:
            engine.scheduler.runtime_checker.self_check_during_busy()
    raise AssertionError("did not finish")


def test_seed_worked_example_r1_r2():
    """docs/seeds.md §A3-§A4: R2 reuses a 3-token cached prefix. One prefill round: prefix_lens
    [0, 3], extend_lens [6, 3], seq_lens [6, 6], 9 rows and 9 out_cache_loc slots; the
    next round decodes 2 rows at positions [6, 6]. (event_loop_normal, as in the seed;
    tests/managers/test_overlap.py follows the same example through the overlap loop.)"""
    engine = make_engine(disable_overlap_schedule=True)
    forwards = spy_forwards(engine)
    shared = [11, 12, 13]
    warm = engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert warm["meta_info"]["completion_tokens"] == 1
    forwards.clear()

    r1 = [21, 22, 23, 24, 25, 26]
    r2 = shared + [31, 32, 33]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    engine.submit(input_ids=r1, sampling_params=greedy, rid="R1")
    engine.submit(input_ids=r2, sampling_params=greedy, rid="R2")
    engine.step()
    batch = engine.scheduler.cur_batch
    assert batch.forward_mode == ForwardMode.EXTEND
    assert [r.rid for r in batch.reqs] == ["R1", "R2"]
    assert batch.prefix_lens == [0, 3]
    assert batch.extend_lens == [6, 3]
    assert batch.seq_lens == [6, 6]
    assert len(batch.input_ids) == 9 and batch.input_ids == r1 + r2[3:]
    assert len(batch.out_cache_loc) == 9
    fb = forwards[-1]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert fb.extend_start_loc.tolist() == [0, 6]

    engine.step()
    fb = forwards[-1]
    assert fb.forward_mode == ForwardMode.DECODE
    assert fb.batch_size == 2 and fb.input_ids.numel() == 2
    assert fb.positions.tolist() == [6, 6]
    t1, t2 = (r.output_ids[0] for r in engine.scheduler.running_batch.reqs)
    assert fb.input_ids.tolist() == [t1, t2]
    run_to_idle(engine)
    assert engine.result("R2")["meta_info"]["cached_tokens"] == 3


def test_finish_reasons_and_stop_conditions():
    engine = make_engine()
    base = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                    "ignore_eos": True})
    ids = base["output_ids"]
    assert len(ids) == 12 and base["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

    stop_tok = ids[4]
    first = ids.index(stop_tok)
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_tok], "ignore_eos": True})
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}

    text = base["text"]
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "stop": [stop_str], "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert out["text"] == text[: text.index(stop_str)]
    run_to_idle(engine)


def test_stream_equals_non_stream():
    engine = make_engine()
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    full = engine.generate("hello world, the quick brown fox", sampling_params=params)
    chunks = list(engine.generate("hello world, the quick brown fox", sampling_params=params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["completion_tokens"] == 20


def test_bad_requests_get_errors_and_others_still_run():
    engine = make_engine(max_total_tokens=512)
    vocab = engine.scheduler.model_config.vocab_size
    good = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    cases = [
        ("", good, "empty"),
        ("hi", {"max_new_tokens": -1}, "max_new_tokens"),
        ("hi", {"max_new_tokens": 5, "temperature": -1}, "temperature"),
        ("hi", {"max_new_tokens": 5, "top_p": 0}, "top_p"),
        ("hi", {"max_new_tokens": 5, "top_p": 1.5}, "top_p"),
        ("hi", {"max_new_tokens": 5, "bogus": 1}, "bogus"),
    ]
    prompts = [c[0] for c in cases] + ["fine one", "fine two"]
    params = [c[1] for c in cases] + [good, good]
    outs = engine.generate(prompts, sampling_params=params)
    for (_, _, word), out in zip(cases, outs):
        assert word in out["error"], out
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert all("error" not in o and len(o["output_ids"]) == 5 for o in outs[-2:])

    out = engine.generate(input_ids=[1, vocab + 5], sampling_params=good)
    assert "outside the vocabulary" in out["error"]
    out = engine.generate(input_ids=[7] * 600, sampling_params=good)
    assert "at most" in out["error"] and "KV pool" in out["error"]
    run_to_idle(engine)


def test_abort_waiting_chunked_and_running_frees_everything():
    engine = make_engine(max_total_tokens=4096, chunked_prefill_size=16)
    long_prompt = [random.Random(0).randrange(3, 200) for _ in range(60)]
    params = {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}
    engine.submit(input_ids=[9, 8, 7, 6], sampling_params=params, rid="running")
    engine.step()  # prefill "running"
    engine.submit(input_ids=long_prompt, sampling_params=params, rid="chunked")
    engine.step()  # first chunk of "chunked"
    assert engine.scheduler.chunked_req is not None and engine.scheduler.chunked_req.rid == "chunked"
    engine.submit(input_ids=[4, 4, 4, 4, 4], sampling_params=params, rid="waiting")
    engine.scheduler.process_input_requests(engine.scheduler.recv_requests())
    assert [r.rid for r in engine.scheduler.waiting_queue] == ["waiting"]
    for rid in ("waiting", "chunked", "running"):
        engine.abort(rid)
    run_to_idle(engine)
    for rid in ("waiting", "chunked", "running"):
        assert engine.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    sched = engine.scheduler
    assert sched.token_to_kv_pool_allocator.available_size() + sched.tree_cache.total_size() == sched.max_total_num_tokens
    assert sched.tree_cache.protected_size() == 0
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def test_shared_system_prompt_is_computed_once():
    """16 requests sharing a 200-token system prompt: with lpm's in-batch prefix caching
    the prompt is computed by the first and hit by the other 15."""
    engine = make_engine(schedule_policy="lpm", max_total_tokens=8192)
    rng = random.Random(1)
    system = [rng.randrange(3, 250) for _ in range(200)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 20))] for _ in range(16)]
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 15 * 200
    run_to_idle(engine)


def test_chunked_prefill_events():
    engine = make_engine(chunked_prefill_size=16)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    engine.generate(input_ids=list(range(3, 53)), sampling_params={"max_new_tokens": 3, "temperature": 0})
    admitted = [e for e in log.of(ev.ReqAdmitted)]
    assert [e.extend_len for e in admitted] == [16, 16, 16, 2]
    assert [e.prefix_len for e in admitted] == [0, 16, 32, 48]
    assert [e.chunk_index for e in log.of(ev.ReqChunked)] == [0, 1, 2]


def test_waiting_timeout_aborts_a_request_that_never_started():
    engine = make_engine(max_running_requests=1)
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    engine.submit(input_ids=[3, 4, 5], sampling_params=params, rid="first")
    engine.step()  # "first" is running; from now on any wait is too long
    engine.scheduler.server_args.waiting_timeout = 0.0
    engine.submit(input_ids=[6, 7, 8], sampling_params=params, rid="second")
    run_to_idle(engine)
    assert engine.result("first")["meta_info"]["finish_reason"]["type"] == "length"
    reason = engine.result("second")["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "waiting_timeout" in reason["message"]


def test_sglang_log_lines(caplog):
    engine = make_engine(max_total_tokens=400, schedule_conservativeness=0.05, decode_log_interval=5,
                         log_level="info")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(10, 40))] for _ in range(24)]
    with caplog.at_level("INFO", logger="sglite"):
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    text = caplog.text
    assert "Prefill batch. #new-seq: " in text and "#cached-token: " in text and "#queue-req: " in text
    assert "Decode batch. #running-req: " in text and "gen throughput (token/s): " in text
    assert "KV cache pool is full. Retract requests. #retracted_reqs: " in text and "#new_token_ratio: " in text


def test_rid_reuse_only_refused_while_the_first_is_alive():
    engine = make_engine()
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert "error" not in engine.generate(input_ids=[3, 4, 5], sampling_params=params, rid="x")
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    engine.submit(input_ids=[3, 4, 5], sampling_params=params, rid="y")
    engine.step()
    with pytest.raises(ValueError, match="'y' is already in use"):  # refused before it is queued
        engine.submit(input_ids=[6, 7], sampling_params=params, rid="y")
    run_to_idle(engine)
    assert not log.of(ev.ReqAborted) and len(log.of(ev.ReqFinished)) == 1  # the first "y" ran to the end
    assert engine.result("y")["output_ids"] and engine.result("y")["meta_info"]["prompt_tokens"] == 3
    assert "error" not in engine.generate(input_ids=[3, 4, 5], sampling_params=params, rid="x")


def test_freeze_gc_keeps_outputs_and_shutdown_gives_the_heap_back():
    import gc

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = {"max_new_tokens": 6, "temperature": 0}
    engine = make_engine()
    before = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.scheduler.tree_cache.evict(10**9)  # the same requests again compute everything again
    assert engine.freeze_gc() == gc.get_freeze_count() > 1000  # torch, the model, the scheduler
    after = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert after == before
    engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_stream_interval_sends_the_first_every_nth_and_the_last_token():
    """SGLang's --stream-interval: fewer, larger chunks; the same tokens."""
    from sglite.engine import Engine

    solo = Engine("tiny-random", log_level="error").generate(
        input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 10, "temperature": 0})
    engine = Engine("tiny-random", stream_interval=4, log_level="error")
    chunks = list(engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 10, "temperature": 0},
                                  stream=True))
    assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 1]
    assert sum((c["output_ids"] for c in chunks), []) == solo["output_ids"]
    assert "".join(c["text"] for c in chunks) == solo["text"]


@pytest.mark.parametrize("overlap", [True, False])
def test_flush_cache_right_after_generate_empties_the_pool(overlap):
    """generate returns once its requests finished; the overlap loop still has the round
    it launched for them in flight. flush_cache resolves that round and empties the
    cache (it refused before: 'while requests run'), and the next run computes the
    whole prompt again with the same tokens."""
    engine = make_engine(disable_overlap_schedule=not overlap)
    prompts = [[7] * 40 + [i] for i in range(3, 7)]
    params = {"max_new_tokens": 6, "temperature": 0}
    first = engine.generate(input_ids=prompts, sampling_params=params)
    out = engine.scheduler.flush_cache()
    assert out.success, out.message
    s = engine.scheduler
    assert not s.has_work() and s.tree_cache.evictable_size() == 0
    assert s.token_to_kv_pool_allocator.available_size() == s.max_total_num_tokens
    again = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    assert again[0]["meta_info"]["cached_tokens"] == 0
    run_to_idle(engine)
