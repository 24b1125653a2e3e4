"""Per-request cache isolation (SGLang's extra_key, OpenAI's cache_salt) through the
scheduler on the tiny random model: a request shares cached prefixes only with
requests of its own key, so ``cached_tokens`` tells a client nothing about prompts
another key sent; outputs do not depend on the key; every KV slot comes back."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from sglite import events as ev
from sglite.engine import Engine
from sglite.replay import first_difference, header_for, load, rerun

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
PROMPT = [random.Random(7).randrange(3, 250) for _ in range(40)]


def make_engine(**kw) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("enable_self_check", True)  # the idle rounds walk every page
    return Engine("tiny-random", log_level="error", **kw)


def send(engine: Engine, rid: str, ids: list[int], extra_key: str | None = None) -> None:
    engine.scheduler.send(engine.tokenizer_manager.tokenize(rid, input_ids=ids, sampling_params=GREEDY,
                                                            extra_key=extra_key))


def run(engine: Engine) -> dict[str, tuple[list[int], dict]]:
    """Step until idle (then one idle round, which self-checks the pool); each finished
    request's output tokens and meta_info."""
    tokens: dict[str, list[int]] = defaultdict(list)
    meta: dict[str, dict] = {}
    for _ in range(1000):
        if not engine.scheduler.has_work():
            engine.step()
            return {rid: (tokens[rid], meta[rid]) for rid in meta}
        for out in engine.step():
            tokens[out.rid] += out.new_token_ids
            if out.finished:
                meta[out.rid] = out.meta_info
    raise AssertionError("did not finish")


def one(engine: Engine, rid: str, extra_key: str | None, ids: list[int] = PROMPT) -> tuple[list[int], int]:
    """Run one request alone: its output tokens and cached_tokens."""
    send(engine, rid, ids, extra_key)
    out_ids, meta = run(engine)[rid]
    assert "error" not in meta
    return out_ids, meta["cached_tokens"]


def assert_no_leak(engine: Engine) -> None:
    s = engine.scheduler
    assert s.token_to_kv_pool_allocator.available_size() + s.tree_cache.total_size() == s.max_total_num_tokens
    assert s.tree_cache.protected_size() == 0
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size


@pytest.mark.parametrize("extra", [{}, {"page_size": 4}, {"disable_overlap_schedule": False}])
def test_a_prefix_is_shared_only_within_its_key(extra):
    engine = make_engine(**extra)
    hit = (len(PROMPT) - 1) // engine.scheduler.page_size * engine.scheduler.page_size
    first, cached = one(engine, "alice-1", "alice")
    assert cached == 0
    runs = {"bob": one(engine, "bob-1", "bob"),  # the same prompt, another key: a miss
            "alice": one(engine, "alice-2", "alice"),  # the same key: a hit
            "plain": one(engine, "plain-1", None),  # unkeyed after keyed: a miss
            "plain again": one(engine, "plain-2", None),  # unkeyed after unkeyed: a hit
            "carol": one(engine, "carol-1", "carol")}  # keyed after unkeyed: a miss
    assert {k: c for k, (_, c) in runs.items()} == {"bob": 0, "alice": hit, "plain": 0, "plain again": hit,
                                                   "carol": 0}
    assert all(out == first for out, _ in runs.values())  # greedy tokens do not depend on the key
    assert_no_leak(engine)
    root_keys = {c.extra_key for c in engine.scheduler.tree_cache.root_node.children.values()}
    assert root_keys == {"alice", "bob", None, "carol"}


def test_the_radix_cache_off_takes_a_key_and_hits_nothing():
    engine = make_engine(disable_radix_cache=True)
    first, _ = one(engine, "a", "alice")
    assert one(engine, "b", "alice") == (first, 0)
    assert_no_leak(engine)


@pytest.mark.parametrize("chunk", [None, 16])
def test_requests_of_different_keys_in_one_batch(chunk):
    """lpm's in-batch prefix caching holds back a request that shares a long prefix
    with one admitted in the same round, so it hits the cache next round; it must
    not hold back a request of another key, which could never hit that prefix. In
    chunks, lpm ranks a2 (32 tokens of a1's first two chunks cached under its key)
    before b1 (nothing cached under "b")."""
    engine = make_engine(schedule_policy="lpm", chunked_prefill_size=chunk, disable_overlap_schedule=True)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    for rid, key in (("a1", "a"), ("b1", "b"), ("a2", "a")):
        send(engine, rid, PROMPT + [1], key)
    outs = run(engine)
    admitted: dict[str, int] = {}
    for e in log.of(ev.ReqAdmitted):
        admitted.setdefault(e.rid, e.iteration)
    if chunk is None:
        assert admitted["a1"] == admitted["b1"] < admitted["a2"]
    else:
        assert (admitted["a1"], admitted["a2"], admitted["b1"]) == (1, 3, 4)
    a2_hit = len(PROMPT) if chunk is None else 2 * chunk
    assert {rid: meta["cached_tokens"] for rid, (_, meta) in outs.items()} == {"a1": 0, "b1": 0, "a2": a2_hit}
    assert outs["a1"][0] == outs["b1"][0] == outs["a2"][0]
    assert_no_leak(engine)


def test_a_miss_is_not_explained_by_another_keys_eviction():
    """After alice's prefix was evicted, bob's request with the same prompt is new
    tokens to bob: naming them evicted would say what alice sent."""
    engine = make_engine()
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    one(engine, "alice-1", "alice")
    engine.scheduler.tree_cache.evict(10**6)
    one(engine, "bob-1", "bob")
    one(engine, "alice-2", "alice")
    matched = {e.rid: e for e in log.of(ev.CacheMatched)}
    assert (matched["bob-1"].evicted_len, matched["bob-1"].rest_len) == (0, len(PROMPT) - 1)
    assert (matched["alice-2"].evicted_len, matched["alice-2"].rest_len) == (len(PROMPT) - 1, 0)
    assert_no_leak(engine)


def test_req_arrived_carries_the_key_and_old_recordings_load():
    engine = make_engine()
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    one(engine, "k", "alice")
    one(engine, "p", None)
    arrived = {e.rid: e for e in log.of(ev.ReqArrived)}
    assert (arrived["k"].extra_key, arrived["p"].extra_key) == ("alice", None)
    d = arrived["k"].to_dict()
    assert ev.event_from_dict(d) == arrived["k"]
    del d["extra_key"]  # a recording made before the field existed
    assert ev.event_from_dict(d).extra_key is None


def record_keyed(path) -> None:
    engine = make_engine()
    recorder = ev.EventRecorder(str(path), header_for(engine))
    engine.event_bus.subscribe(recorder, snapshots=True)
    for rid, key in (("a1", "alice"), ("p1", None), ("b1", "bob"), ("a2", "alice")):
        send(engine, rid, PROMPT, key)
        while engine.scheduler.has_work():  # no idle round: a rerun stops when the work does
            engine.step()
    engine.shutdown()
    recorder.close()


def test_rerun_resubmits_the_key_only_when_set(tmp_path, monkeypatch):
    """Unkeyed arrivals are submitted exactly as before the field existed, so they rerun
    on an Engine.submit with or without an extra_key keyword."""
    record_keyed(tmp_path / "a.jsonl")
    submitted: dict[str, str | None] = {}
    real = Engine.submit

    def submit(self, *args, **kw):
        submitted[kw["rid"]] = kw.pop("extra_key", "<absent>")
        return real(self, *args, **kw)

    monkeypatch.setattr(Engine, "submit", submit)
    rerun(load(str(tmp_path / "a.jsonl")))
    assert submitted == {"a1": "alice", "p1": "<absent>", "b1": "bob", "a2": "alice"}


def test_a_keyed_recording_reruns_to_the_same_events(tmp_path):
    record_keyed(tmp_path / "a.jsonl")
    rec = load(str(tmp_path / "a.jsonl"))
    events = rerun(rec)
    assert first_difference(rec.events, events) is None
    done = {e.rid: e.cached_tokens for e in events if isinstance(e, ev.ReqFinished)}
    assert done == {"a1": 0, "p1": 0, "b1": 0, "a2": len(PROMPT) - 1}
