"""Why a request waits (docs/why.md): a workload built to hold a request on each of
PrefillAdder's budgets in the first admission round, where the numbers are exact, and
Engine.explain naming that budget with those numbers."""

from __future__ import annotations

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
