"""Why a request waits (docs/why.md): a workload built to hold a request on each of
PrefillAdder's budgets in the first admission round, where the numbers are exact, and
Engine.explain naming that budget with those numbers."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from sglite import events as ev
from sglite.engine import Engine
from sglite.explain import RequestHistory, explain

NO_EOS = {"ignore_eos": True, "temperature": 0}


def first_round(prompts: list[list[int]], max_new: int, **server_args) -> tuple[Engine, dict[str, ev.ReqHeld]]:
    """Submit every prompt, run one iteration; the ReqHeld of each request left waiting."""
    engine = Engine("tiny-random", log_level="error", disable_overlap_schedule=True, **server_args)
    for p in prompts:
        engine.submit(input_ids=p, sampling_params={**NO_EOS, "max_new_tokens": max_new})
    engine.step()
    held = {e.rid: e for rid in engine.history._by_rid for e in engine.history.events(rid) if isinstance(e, ev.ReqHeld)}
    assert set(held) == {r.rid for r in engine.scheduler.waiting_queue}
    return engine, held


def test_held_by_the_kv_pool_with_its_numbers():
    # 400 tokens; each request needs 50 prompt + 100 reserved: r0, r1 fit (150 + 150), r2 finds 100
    engine, held = first_round([[7] * 50, [8] * 50, [9] * 50, [10] * 50], 100, max_total_tokens=400)
    assert (held["r2"].budget, held["r2"].need, held["r2"].have) == ("rem_total_tokens", 150, 100)
    assert "needs 50 tokens to prefill + 100 reserved new tokens = 150" in held["r2"].detail
    assert (held["r3"].budget, held["r3"].detail) == ("not_reached", "admission stopped at r2 (rem_total_tokens)")
    text = engine.explain("r2")
    assert "iteration 1: held by the KV pool (rem_total_tokens): needs 150, has 100" in text
    while engine.scheduler.has_work():
        engine.step()
    text = engine.explain("r3")
    assert text.startswith("r3\n  iteration 1: arrived, 50 prompt tokens, max_new_tokens 100")
    assert "held by an earlier request in the queue" in text and "finished (length), 100 output tokens" in text
    assert "held by the KV pool (rem_total_tokens)" in text  # once r2 went, r3 waited on the pool itself


def test_held_by_the_prefill_token_budget():
    _, held = first_round([[7] * 100, [8] * 100], 8, max_prefill_tokens=128)
    h = held["r1"]
    assert (h.budget, h.need, h.have) == ("rem_input_tokens", 100, 28)
    assert h.detail == "100 tokens to prefill > 28 left of max_prefill_tokens"


def test_held_by_the_chunk_budget():
    _, held = first_round([[7] * 100, [8] * 10], 8, chunked_prefill_size=64)
    h = held["r1"]
    assert (h.budget, h.have) == ("rem_chunk_tokens", 0)
    assert h.detail == "the chunk budget is spent this round (by r0)"


def test_held_by_max_running_requests():
    _, held = first_round([[7] * 10, [8] * 10, [9] * 10], 8, max_running_requests=2)
    h = held["r2"]
    assert (h.budget, h.need, h.have) == ("max_running_requests", 3, 2)
    assert h.detail == "0 running + 2 admitted this round = max_running_requests 2"


def test_held_for_in_batch_prefix_caching():
    shared = list(range(100, 140))  # 40 tokens: past the 32-token threshold
    _, held = first_round([shared + [1, 2], shared + [3, 4]], 8, schedule_policy="lpm")
    assert held["r1"].budget == "in_batch_prefix"


def test_an_admitted_request_has_no_hold_and_a_reason_changes_once():
    engine, held = first_round([[7] * 50, [8] * 50, [9] * 50], 100, max_total_tokens=400)
    assert set(held) == {"r2"}
    for _ in range(5):
        engine.step()
    kinds = [type(e).__name__ for e in engine.history.events("r2")]
    assert kinds.count("ReqHeld") == 1  # the same budget every round: one event


def test_explain_reads_a_recording_and_refuses_an_unknown_rid(tmp_path):
    log = ev.EventLog()
    bus = ev.EventBus()
    bus.subscribe(log)
    engine = Engine("tiny-random", log_level="error", event_bus=bus, max_total_tokens=400)
    engine.generate(input_ids=[[7] * 50, [8] * 50, [9] * 50], sampling_params={**NO_EOS, "max_new_tokens": 100})
    assert explain(log.events, "r2") == engine.explain("r2")
    with pytest.raises(KeyError, match="no request 'nope'"):
        engine.explain("nope")


def test_the_history_keeps_the_newest_requests_and_a_reused_rid_starts_over():
    history = RequestHistory(keep=2)
    for rid in ("a", "b", "c"):
        history(ev.ReqArrived(rid=rid, prompt_tokens=1))
    assert history.events("a") == [] and len(history.events("c")) == 1
    history(ev.ReqFinished(rid="c", reason="length"))
    history(ev.ReqArrived(rid="c", prompt_tokens=2))
    assert [type(e) for e in history.events("c")] == [ev.ReqArrived]


def test_the_example_in_docs_why_md_is_what_explain_prints():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs/why.md").read_text()
    shown = doc.split("print(e.explain(\"r3\"))\n```\n\n```\n", 1)[1].split("\n```", 1)[0]
    e = Engine("tiny-random", max_total_tokens=400, max_prefill_tokens=128, log_level="error")
    e.generate(input_ids=[[7] * 50, [8] * 50, [9] * 50, [10] * 100], sampling_params={
        "max_new_tokens": 100, "temperature": 0, "ignore_eos": True})
    def no_times(text: str) -> str:  # forward times differ from run to run
        return re.sub(r"~?\d+\.\d ms", "T ms", text)

    assert no_times(e.explain("r3")) == no_times(shown)


def test_a_retraction_says_what_stays_cached_and_what_is_prefilled_again():
    engine = Engine("tiny-random", log_level="error", max_total_tokens=400, disable_overlap_schedule=True)
    engine.generate(input_ids=[[7] * 50, [8] * 50, [9] * 50], sampling_params={**NO_EOS, "max_new_tokens": 100})
    events = engine.history.events("r2")
    (retract,) = [e for e in events if isinstance(e, ev.ReqRetracted)]
    # its prompt was inserted after its prefill: it stays; its output is prefilled again
    assert (retract.kept_tokens, retract.recompute_tokens) == (50, retract.output_tokens)
    readmitted = [e for e in events if isinstance(e, ev.CacheMatched) and e.iteration > retract.iteration][0]
    assert readmitted.matched_len == retract.kept_tokens  # nothing was evicted in between
    assert readmitted.key_len - readmitted.matched_len == retract.recompute_tokens
    text = engine.explain("r2")
    assert (f"after {retract.output_tokens} output tokens: 50 tokens stay in the radix cache, "
            f"{retract.output_tokens} to prefill again") in text
    assert "the request with the fewest output tokens goes first, ties to the longest prompt" in text
    # and what the recompute cost in time: its rows' share of the re-admission's prefill forward
    assert re.search(rf"forward #\d+ \(EXTEND, \d+ rows\) took [\d.]+ ms; its {retract.output_tokens} rows ~", text)
    assert "recomputing what its retractions dropped took ~" in text


def long_requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """n 256-token prompts, each with its own 4096-entry stop_token_ids list."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(256)] for _ in range(n)]
    params = [{**NO_EOS, "max_new_tokens": 2, "stop_token_ids": [rng.randrange(3, 500) for _ in range(4096)]}
              for _ in range(n)]
    return prompts, params


def test_the_history_keeps_a_slim_arrival_and_explains_as_the_whole_events_do():
    log = ev.EventLog()
    bus = ev.EventBus()
    bus.subscribe(log)  # what every other subscriber (the recorder) gets
    engine = Engine("tiny-random", log_level="error", event_bus=bus, max_total_tokens=2048, chunked_prefill_size=128)
    prompts, params = long_requests(2)
    engine.generate(input_ids=prompts + [[7] * 50], sampling_params=params + [{**NO_EOS, "max_new_tokens": 4}])
    (whole,) = [e for e in log.events if isinstance(e, ev.ReqArrived) and e.rid == "r0"]
    assert len(whole.input_ids) == 256 and len(whole.sampling_params["stop_token_ids"]) == 4096
    kept = engine.history.events("r0")[0]
    assert isinstance(kept, ev.ReqArrived) and kept.input_ids == ()
    assert kept.sampling_params["stop_token_ids"] == "<list of 4096>"
    assert {k: v for k, v in kept.sampling_params.items() if k != "stop_token_ids"} == {
        k: v for k, v in whole.sampling_params.items() if k != "stop_token_ids"}  # the scalars as they were
    assert len(pickle.dumps(kept)) < 1000 < len(pickle.dumps(whole)) // 10
    planned = [e for e in engine.history.events("r0") if isinstance(e, ev.BatchPlanned)]
    assert planned and all(e.out_cache_loc == () for e in planned)
    for rid in ("r0", "r1", "r2"):  # chunked, held, ordinary: the same words from the slim copies
        assert engine.explain(rid) == explain(log.events, rid)


def test_200_long_requests_keep_a_small_history():
    engine = Engine("tiny-random", log_level="error", max_total_tokens=200 * 300)
    prompts, params = long_requests(200)
    engine.generate(input_ids=prompts, sampling_params=params)
    kept = [engine.history.events(f"r{i}") for i in range(200)]
    assert all(k and isinstance(k[0], ev.ReqArrived) for k in kept)
    # ~700 bytes a request (each prompt and stop list alone pickles to ~13 KB)
    assert len(pickle.dumps(engine.history._by_rid)) < 200 * 1500


def held_every_round(rounds: int) -> list[ev.Event]:
    """A request held anew each round (the stopper changes), then admitted and finished."""
    out: list[ev.Event] = [ev.ReqArrived(rid="w", prompt_tokens=10, max_new_tokens=4, iteration=1)]
    for i in range(rounds):
        budget = "not_reached" if i % 3 else "rem_total_tokens"
        out.append(ev.ReqHeld(rid="w", budget=budget, need=i, have=1, detail=f"stopped at r{i}", iteration=1 + i))
    it = 1 + rounds
    out += [ev.CacheMatched(rid="w", matched_len=0, key_len=10, reason="new", iteration=it),
            ev.ReqAdmitted(rid="w", prefix_len=0, extend_len=10, iteration=it),
            ev.ReqFinished(rid="w", reason="length", prompt_tokens=10, completion_tokens=4, iteration=it + 4)]
    return out


def test_a_request_held_many_rounds_keeps_its_first_and_last_holds_and_every_round_counted():
    from sglite.explain import KEPT_PER_KIND

    events = held_every_round(100)
    history = RequestHistory()
    for e in events:
        history(e)
    holds = [e for e in history.events("w") if isinstance(e, ev.ReqHeld)]
    assert [e.need for e in holds] == list(range(KEPT_PER_KIND)) + list(range(100 - KEPT_PER_KIND, 100))
    (gap,) = history.gaps("w")
    assert (gap.kind, gap.count, gap.iteration, gap.last_iteration) == ("ReqHeld", 100 - 2 * KEPT_PER_KIND,
                                                                        1 + KEPT_PER_KIND, 100 - KEPT_PER_KIND)
    whole = explain(events, "w").splitlines()
    kept = explain(history.events("w"), "w", history.gaps("w")).splitlines()
    first, last = 2 + KEPT_PER_KIND, 2 + 100 - KEPT_PER_KIND  # (after the rid and the arrival lines)
    assert kept[:first] == whole[:first] and kept[first + 1:] == whole[last:]  # each kept line as it was
    assert kept[first].startswith(f"  iterations {1 + KEPT_PER_KIND}-{100 - KEPT_PER_KIND}: "
                                  f"{100 - 2 * KEPT_PER_KIND} more ReqHeld events not kept")
    assert kept[-1] == whole[-1] == "  held 100 rounds in all, by budget: not_reached 66, rem_total_tokens 34"
    assert len(pickle.dumps(history._by_rid)) < 20_000  # the same for 10,000 rounds


def test_a_long_chunked_prompt_keeps_its_first_and_last_chunks():
    engine = Engine("tiny-random", log_level="error", chunked_prefill_size=8, disable_overlap_schedule=True)
    engine.generate(input_ids=[7] * 400, sampling_params={**NO_EOS, "max_new_tokens": 2})
    kinds = [type(e).__name__ for e in engine.history.events("r0")]
    assert kinds.count("ReqChunked") == 32 and kinds.count("ForwardFinished") == 32
    assert {g.kind: g.count for g in engine.history.gaps("r0")} == {
        "CacheMatched": 18, "ReqAdmitted": 18, "ReqChunked": 17, "BatchPlanned": 18, "ForwardFinished": 18}
    text = engine.explain("r0")
    assert "17 more ReqChunked events not kept" in text and "chunk 49 prefilled, 392/400 tokens" in text
    assert text.splitlines()[-1].startswith("  iteration 51: finished (length), 2 output tokens")


def test_the_history_keeps_at_most_max_events_the_oldest_requests_going_first():
    history = RequestHistory(max_events=50)
    for n in range(20):
        for e in held_every_round(3):
            history(dataclasses.replace(e, rid=f"q{n}"))  # 7 events a request
    assert history.num_events == sum(len(history.events(f"q{n}")) for n in range(20)) <= 50
    assert [n for n in range(20) if history.events(f"q{n}")] == list(range(13, 20))


def test_one_row_is_one_row():
    from sglite.engine import Engine

    with Engine("tiny-random", log_level="error") as engine:
        engine.generate(input_ids=[7], sampling_params={"max_new_tokens": 2}, rid="one")
        text = engine.explain("one")
    assert "(EXTEND, 1 row) took" in text and "its 1 row ~" in text and "1 rows" not in text
