"""Span trees from real engine runs on the tiny model, exported in memory."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sglite.engine import Engine
from tracing import setup_tracing

GREEDY = {"temperature": 0, "ignore_eos": True}


def traced(level=2, **kw):
    engine = Engine("tiny-random", max_total_tokens=kw.pop("max_total_tokens", 2048), **kw)
    mem = InMemorySpanExporter()
    tr = setup_tracing(engine.event_bus, level, exporters=[mem], batch=False, model="tiny-random")
    return engine, mem, tr


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def children(spans, parent):
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_seed_example_span_tree():
    engine, mem, tr = traced()
    engine.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 1, **GREEDY}, rid="warm")
    engine.submit(input_ids=[21, 22, 23, 24, 25, 26], sampling_params={"max_new_tokens": 3, **GREEDY}, rid="R1")
    engine.submit(input_ids=[11, 12, 13, 31, 32, 33], sampling_params={"max_new_tokens": 3, **GREEDY}, rid="R2")
    while engine.scheduler.has_work():
        engine.step()
    tr.shutdown()
    spans = mem.get_finished_spans()

    (r2,) = by_name(spans, "req R2")
    assert r2.parent is None and r2.resource.attributes["service.name"] == "sglite"
    stages = sorted(children(spans, r2), key=lambda s: s.start_time)
    assert [s.name for s in stages] == ["waiting", "prefill", "decode"]
    prefill = stages[1]
    assert prefill.attributes["sglite.prefix_len"] == 3 and prefill.attributes["sglite.extend_len"] == 3
    assert r2.attributes["gen_ai.usage.input_tokens"] == 6
    assert r2.attributes["gen_ai.usage.output_tokens"] == 3
    assert r2.attributes["gen_ai.request.max_tokens"] == 3
    assert r2.attributes["sglite.cached_tokens"] == 3
    assert list(r2.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert [e.name for e in r2.events] == ["cache_hit"] and r2.events[0].attributes["sglite.matched_len"] == 3
    assert all(s.context.trace_id == r2.context.trace_id for s in stages)

    forwards = by_name(spans, "forward")
    prefill_fwd = [f for f in forwards if f.attributes["sglite.num_rows"] == 9]
    assert len(prefill_fwd) == 1 and prefill_fwd[0].attributes["sglite.forward_mode"] == "EXTEND"
    assert prefill_fwd[0].attributes["sglite.batch_size"] == 2
    # (the overlap loop also decodes the warm-up request once more: its extra token is dropped)
    decode_fwd = [f for f in forwards if f.attributes["sglite.forward_mode"] == "DECODE"
                  and f.attributes["sglite.batch_size"] == 2]
    assert decode_fwd[0].attributes["sglite.num_rows"] == 2
    assert decode_fwd[0].attributes["sglite.attention_backend"] == "cpu"  # auto on a CPU

    # forward <- run_batch <- ScheduleBatch, with its siblings, linked to R1 and R2
    (run,) = [s for s in spans if s.context.span_id == prefill_fwd[0].parent.span_id]
    assert run.name == "run_batch"
    (it,) = [s for s in spans if s.context.span_id == run.parent.span_id]
    assert it.name == "ScheduleBatch" and it.parent is None
    assert [c.name for c in sorted(children(spans, it), key=lambda s: s.start_time)] == [
        "get_next_batch_to_run", "run_batch", "process_batch_result"]
    plan = by_name(children(spans, it), "get_next_batch_to_run")[0]
    assert list(plan.attributes["sglite.prefix_lens"]) == [0, 3]
    assert list(plan.attributes["sglite.extend_lens"]) == [6, 3]
    linked = {link.context.span_id for link in it.links}
    (r1,) = by_name(spans, "req R1")
    assert linked == {r1.context.span_id, r2.context.span_id}


def test_retracted_request_has_retract_event_and_second_waiting():
    engine, mem, tr = traced(max_total_tokens=400, schedule_conservativeness=0.05, chunked_prefill_size=64)
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(10, 60))] for _ in range(36)]
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 20, **GREEDY})
    tr.shutdown()
    spans = mem.get_finished_spans()
    retracted = [s for s in spans if s.name.startswith("req ") and any(e.name == "retract" for e in s.events)]
    assert retracted, "expected a retraction"
    root = retracted[0]
    ev = next(e for e in root.events if e.name == "retract")
    assert ev.attributes["sglite.new_token_ratio"] > ev.attributes["sglite.new_token_ratio.before"]
    names = [s.name for s in sorted(children(spans, root), key=lambda s: s.start_time)]
    assert names.count("waiting") >= 2 and names[0] == "waiting"
    second_wait = [s for s in children(spans, root) if s.name == "waiting"][1:]
    assert any(s.attributes.get("sglite.after_retract") for s in second_wait)


def test_a_held_request_has_held_events_on_its_waiting_span():
    engine, mem, tr = traced(max_total_tokens=400, disable_overlap_schedule=True)
    engine.generate(input_ids=[[7] * 50, [8] * 50, [9] * 50], sampling_params={"max_new_tokens": 100, **GREEDY})
    tr.shutdown()
    spans = mem.get_finished_spans()
    (root,) = by_name(spans, "req r2")
    waiting = min((s for s in children(spans, root) if s.name == "waiting"), key=lambda s: s.start_time)
    (held,) = [e for e in waiting.events if e.name == "held"]
    assert dict(held.attributes) == {"sglite.budget": "rem_total_tokens", "sglite.need": 150, "sglite.have": 100,
                                     "sglite.detail": held.attributes["sglite.detail"]}
    assert held.attributes["sglite.detail"].startswith("needs 50 tokens to prefill + 100 reserved new tokens = 150")


def test_chunked_request_has_one_span_per_chunk():
    engine, mem, tr = traced(level=1, chunked_prefill_size=16)
    engine.generate(input_ids=list(range(3, 53)), sampling_params={"max_new_tokens": 2, **GREEDY}, rid="long")
    tr.shutdown()
    spans = mem.get_finished_spans()
    assert not by_name(spans, "ScheduleBatch")  # level 1: request stages only
    (root,) = by_name(spans, "req long")
    stages = [s.name for s in sorted(children(spans, root), key=lambda s: s.start_time)]
    assert stages == ["waiting", "prefill.chunk[0]", "prefill.chunk[1]", "prefill.chunk[2]", "prefill.chunk[3]",
                      "decode"]
    extends = [s.attributes["sglite.extend_len"] for s in children(spans, root) if s.name.startswith("prefill")]
    assert sorted(extends) == [2, 16, 16, 16]


def test_abort_and_rejection_are_recorded():
    engine, mem, tr = traced()
    engine.submit(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 50, **GREEDY}, rid="victim")
    engine.step()
    engine.step()
    engine.abort("victim")
    engine.generate("", sampling_params={"max_new_tokens": 3}, rid="empty")
    tr.shutdown()
    spans = mem.get_finished_spans()
    (victim,) = by_name(spans, "req victim")
    assert list(victim.attributes["gen_ai.response.finish_reasons"]) == ["abort"]
    assert victim.status.status_code.name == "ERROR" and any(e.name == "abort" for e in victim.events)
    (empty,) = by_name(spans, "req empty")
    assert empty.status.status_code.name == "ERROR" and "empty" in empty.status.description


def test_level_3_adds_token_events():
    engine, mem, tr = traced(level=3)
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, **GREEDY}, rid="t")
    tr.shutdown()
    spans = mem.get_finished_spans()
    (root,) = by_name(spans, "req t")
    tokens = [e for s in [root, *children(spans, root)] for e in s.events if e.name == "token"]
    assert len(tokens) == 4


@pytest.mark.parametrize("level", [0])
def test_level_0_is_off(level):
    engine = Engine("tiny-random", max_total_tokens=256)
    assert setup_tracing(engine.event_bus, level) is None
    assert not engine.event_bus.active


def test_tp2_forward_spans_have_one_child_per_rank_with_its_all_reduce_time():
    engine, mem, tr = traced(tp_size=2, max_total_tokens=512)
    try:
        engine.generate(["Hello there", "The sky"], sampling_params={"max_new_tokens": 4, **GREEDY})
        tr.shutdown()
    finally:
        engine.shutdown()
    spans = mem.get_finished_spans()
    forwards = by_name(spans, "forward")
    assert forwards and all(f.attributes["sglite.tp_size"] == 2 for f in forwards)
    for f in forwards:
        ranks = sorted(children(spans, f), key=lambda s: s.attributes["sglite.tp_rank"])
        assert [s.name for s in ranks] == ["forward TP0", "forward TP1"]
        for s in ranks:
            assert s.start_time == f.start_time and s.end_time > s.start_time
            assert 0 < s.attributes["sglite.all_reduce_ms"] * 1e6 < s.end_time - s.start_time


def test_a_logprob_request_s_span_carries_its_closest_call():
    engine, mem, tr = traced()
    out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 6, **GREEDY}, rid="lp",
                          return_logprob=True, top_logprobs_num=2)
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, **GREEDY}, rid="plain")
    tr.shutdown()
    spans = mem.get_finished_spans()
    (lp,) = by_name(spans, "req lp")
    tops = out["meta_info"]["output_top_logprobs"]
    i = min(range(6), key=lambda k: tops[k][0][0] - tops[k][1][0])
    assert lp.attributes["sglite.closest_call.index"] == i
    assert lp.attributes["sglite.closest_call.margin"] == tops[i][0][0] - tops[i][1][0]
    assert list(lp.attributes["sglite.closest_call.tokens"]) == [tops[i][0][1], tops[i][1][1]]
    assert "sglite.closest_call.index" not in by_name(spans, "req plain")[0].attributes


def test_a_grammar_request_has_a_grammar_queue_stage_and_a_compile_event():
    engine, mem, tr = traced(level=1)
    engine.generate("the scheduler", {"max_new_tokens": 4, "temperature": 0, "regex": "[0-9]{4}"}, rid="g")
    engine.generate("the scheduler", {"max_new_tokens": 4, "temperature": 0, "regex": "[0-9]{4}"}, rid="hit")
    tr.shutdown()
    spans = mem.get_finished_spans()
    (root,) = by_name(spans, "req g")
    stages = [s.name for s in sorted(children(spans, root), key=lambda s: s.start_time)]
    assert stages == ["waiting", "grammar_queue", "waiting", "prefill", "decode"]  # (the first: arrival to lookup)
    (queue,) = [s for s in children(spans, root) if s.name == "grammar_queue"]
    assert queue.attributes["sglite.grammar"] == "regex"
    (compiled,) = [e for e in root.events if e.name == "grammar_compiled"]
    assert compiled.attributes["sglite.grammar"] == "regex" and compiled.attributes["sglite.waited_iterations"] >= 0
    (hit,) = by_name(spans, "req hit")  # a cached grammar: no wait
    assert [s.name for s in sorted(children(spans, hit), key=lambda s: s.start_time)][0] == "waiting"
