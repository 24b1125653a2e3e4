"""Engine.generate(stream=True): a stream gives its rids back and aborts what it left
unfinished however it ends (read to the end, closed, or dropped unread or half read),
and a rid it held can be used again at once. Also extra_key passed through."""

from __future__ import annotations

import gc
import threading

import pytest

from sglite import events as ev
from sglite.engine import Engine

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}


def make_engine(**kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("enable_self_check", True)  # the idle rounds walk every page
    return Engine("tiny-random", log_level="error", **kw)


@pytest.fixture(scope="module")
def engine():
    e = make_engine()
    yield e
    e.shutdown()


def assert_nothing_held(engine: Engine) -> None:
    """Run to idle: every KV slot and req slot is free or evictable cache, no request runs."""
    for _ in range(1000):
        if not engine.scheduler.has_work():
            break
        engine.step()
    engine.step()  # an idle round: self_check_during_idle walks every page
    s = engine.scheduler
    assert not s.has_work()
    assert s.token_to_kv_pool_allocator.available_size() + s.tree_cache.total_size() == s.max_total_num_tokens
    assert s.tree_cache.protected_size() == 0
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size


def test_200_streams_dropped_unread_give_their_rids_back(engine):
    want = engine.generate(input_ids=[5, 6, 7], sampling_params=PARAMS)["output_ids"]
    rids = [f"dropped-{i}" for i in range(200)]
    streams = [engine.generate(input_ids=[5, 6, 7], sampling_params=LONG, rid=r, stream=True) for r in rids]
    assert all(r in engine._results for r in rids)
    del streams
    gc.collect()
    assert engine._results == {}  # (the generator kept 200 claims: "200 abandoned streams left 201 entries")
    again = engine.generate(input_ids=[[5, 6, 7]] * 200, sampling_params=PARAMS, rid=rids)  # every rid, at once
    assert [o["output_ids"] for o in again] == [want] * 200  # none got a dropped request's abort
    assert engine._results == {}
    assert_nothing_held(engine)  # the 200 dropped requests were aborted, not run to the end
    kinds = {type(e) for e in engine.history.events(rids[0])}
    assert ev.ReqFinished in kinds and ev.ReqAborted not in kinds  # its history: the new request's


@pytest.mark.parametrize("read", [0, 1])
def test_a_stream_closed_early_aborts_its_request_and_frees_its_kv(engine, read):
    rid = f"closed-{read}"
    stream = engine.generate(input_ids=[9, 10, 11], sampling_params=LONG, rid=rid, stream=True)
    chunks = [next(stream) for _ in range(read)]
    assert [c["finished"] for c in chunks] == [False] * read
    stream.close()
    assert rid not in engine._results
    assert list(stream) == []  # closed: nothing more
    assert_nothing_held(engine)
    events = engine.history.events(rid)
    (aborted,) = [e for e in events if isinstance(e, ev.ReqAborted)]
    assert aborted.by_client and not any(isinstance(e, ev.ReqFinished) for e in events)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("read", [0, 1])
def test_the_rid_of_a_dropped_stream_can_be_used_again_at_once(overlap, read):
    engine = make_engine(disable_overlap_schedule=not overlap)
    want = engine.generate(input_ids=[5, 6, 7], sampling_params=LONG)["output_ids"]
    stream = engine.generate(input_ids=[8, 9], sampling_params=LONG, rid="mine", stream=True)
    for _ in range(read):
        next(stream)  # (read: the request is running, holding KV)
    del stream
    gc.collect()
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=LONG, rid="mine")
    # the dropped request's abort reached neither the new request nor its result
    assert "error" not in out and out["output_ids"] == want
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert_nothing_held(engine)
    assert engine._stale == {}


def test_a_stream_dropped_inside_the_engines_locked_code_is_released_by_the_next_call(engine):
    """Garbage collection may drop a stream while this thread holds the engine's lock
    (in the middle of its bookkeeping) or while another thread holds it: the finalizer
    neither touches the engine's state then nor waits for the lock."""
    with engine._lock:
        stream = engine.generate(input_ids=[5, 6], sampling_params=LONG, rid="held-here", stream=True)
        del stream
        gc.collect()
        assert "held-here" in engine._results  # left for the lock's next holder
    box = [engine.generate(input_ids=[5, 6], sampling_params=LONG, rid="held-there", stream=True)]
    with engine._lock:
        dropper = threading.Thread(target=box.clear)  # the last reference goes on that thread
        dropper.start()
        dropper.join(timeout=30)
        assert not dropper.is_alive()  # it did not wait for the lock
        assert "held-there" in engine._results
    engine.generate(input_ids=[5, 6], sampling_params=PARAMS, rid="held-here")  # free again
    assert "held-there" not in engine._results
    assert engine._results == {}
    assert_nothing_held(engine)


def test_streams_read_to_the_end_are_as_before(engine):
    prompts = [[5, 6, 7], [9, 10], [3] * 12]
    want = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    rids = ["a", "b", "c", "bad"]
    stream = engine.generate(input_ids=prompts + [[10**9]], sampling_params=PARAMS, rid=rids, stream=True)
    chunks = []
    while sum(c["finished"] for c in chunks) < len(rids):
        chunks.append(next(stream))
    # the rids are free once the last chunk is handed out, before StopIteration
    assert not any(r in engine._results for r in rids)
    assert list(stream) == []
    for i, w in enumerate(want):
        mine = [c for c in chunks if c["index"] == i]
        assert sum((c["output_ids"] for c in mine), []) == w["output_ids"]
        assert "".join(c["text"] for c in mine) == w["text"]
        assert [c["finished"] for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1]["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
    (bad,) = [c for c in chunks if c["index"] == 3]
    assert bad["finished"] and "error" in bad and bad["output_ids"] == []
    single = list(engine.generate(input_ids=[5, 6, 7], sampling_params=PARAMS, stream=True))
    assert all("index" not in c for c in single)
    assert sum((c["output_ids"] for c in single), []) == want[0]["output_ids"]
    assert_nothing_held(engine)


def test_extra_key_goes_to_the_tokenizer_manager_and_a_bad_one_is_the_requests_error(engine):
    plain = engine.generate(input_ids=[5, 6, 7], sampling_params=PARAMS)
    salted = engine.generate(input_ids=[5, 6, 7], sampling_params=PARAMS, extra_key="tenant-a")
    assert "error" not in salted and salted["output_ids"] == plain["output_ids"]
    for bad in (5, ""):
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=PARAMS, extra_key=bad)
        assert "extra_key" in out["error"] and out["output_ids"] == []
    batch = engine.generate(input_ids=[[5, 6, 7], [5, 6, 7]], sampling_params=PARAMS, extra_key=["tenant-a", ""])
    assert "error" not in batch[0] and "extra_key" in batch[1]["error"]
    (chunk,) = engine.generate(input_ids=[5, 6, 7], sampling_params=PARAMS, extra_key=5, stream=True)
    assert "extra_key" in chunk["error"]
    rid = engine.submit(input_ids=[5, 6, 7], sampling_params=PARAMS, extra_key="")
    assert_nothing_held(engine)
    assert "extra_key" in engine.result(rid)["error"]
    with pytest.raises(ValueError, match="need one extra_key or as many"):
        engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=PARAMS, extra_key=["only-one"])
    assert not engine.scheduler.has_work()  # refused before anything was queued
