"""Constrained output through the engine (docs/structured_output.md): SmolLM2's outputs
parse and match their schemas, regexes and grammars; under batching, retraction,
chunked prefill and either loop they are the solo runs' tokens; the grammar_queue's
requests wait, fail or abort alone."""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache

import jsonschema
import pytest

from sglite import events as ev
from sglite.engine import Engine

NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
    "name": {"type": "string", "maxLength": 16},
    "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
        "city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}}
ARRAYS = {"type": "object", "additionalProperties": False, "required": ["primes"], "properties": {
    "primes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
               "minItems": 2, "maxItems": 4}}}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"
YES_NO = 'root ::= answer "."\nanswer ::= "Yes" | "No"'
ASKS = [  # (question, the grammar's sampling parameter, the check of the output text)
    ("Describe a person who lives in Paris as JSON.", {"json_schema": json.dumps(NESTED)},
     lambda t: jsonschema.validate(json.loads(t), NESTED)),
    ("Pick a T-shirt color and size.", {"json_schema": json.dumps(ENUMS)},
     lambda t: jsonschema.validate(json.loads(t), ENUMS)),
    ("List some prime numbers.", {"json_schema": json.dumps(ARRAYS)},
     lambda t: jsonschema.validate(json.loads(t), ARRAYS)),
    ("What is the phone number of the White House?", {"regex": PHONE}, lambda t: re.fullmatch(PHONE, t) or 1 / 0),
    ("What is the IP address of Google's DNS?", {"regex": IPV4}, lambda t: re.fullmatch(IPV4, t) or 1 / 0),
    ("Is Paris the capital of France?", {"ebnf": YES_NO}, lambda t: t in ("Yes.", "No.") or 1 / 0),
]


@lru_cache(maxsize=None)
def smollm2() -> Engine:
    return Engine("smollm2-135m", dtype="bfloat16", log_level="error")


def chat(engine: Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


@pytest.mark.real_model
def test_smollm2_outputs_parse_and_match_their_grammars():
    engine = smollm2()
    outs = engine.generate([chat(engine, q) for q, _, _ in ASKS],
                           [{"temperature": 0, "max_new_tokens": 96, **g} for _, g, _ in ASKS])
    for (question, _, check), out in zip(ASKS, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (question, out["text"])
        check(out["text"])
    # the same schema again is a cache hit: no grammar_queue wait
    seen: list[type] = []
    engine.event_bus.subscribe(lambda e: seen.append(type(e)))
    again = engine.generate(chat(engine, ASKS[1][0]), {"temperature": 0, "max_new_tokens": 96, **ASKS[1][1]})
    assert again["text"] == outs[1]["text"] and ev.GrammarQueued not in seen


@pytest.mark.real_model
def test_smollm2_grammar_requests_batched_chunked_and_mixed_are_their_solo_runs():
    """bfloat16, all six at once, in chunks of 16 with the decodes riding along (MIXED).
    (Retraction with grammars: the tiny-random test below; SmolLM2's JSON ends too soon
    for PrefillAdder's reservation to be outgrown.)"""
    params = [{"temperature": 0, "max_new_tokens": 96, **g} for _, g, _ in ASKS]
    engine = smollm2()
    prompts = [chat(engine, q) for q, _, _ in ASKS]
    solo = [engine.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params)]
    seen: set[type] = set()
    with Engine("smollm2-135m", dtype="bfloat16", log_level="error", chunked_prefill_size=16,
                enable_mixed_chunk=True) as engine:
        engine.event_bus.subscribe(lambda e: seen.add(type(e)))
        together = [o["output_ids"] for o in engine.generate(prompts, params)]
    assert ev.ReqChunked in seen
    assert together == solo


@pytest.mark.real_model
def test_json_object_mode_gives_an_object_that_parses():
    engine = smollm2()
    out = engine.generate(chat(engine, "Return a JSON object with the keys city and country for Paris."),
                          {"temperature": 0, "max_new_tokens": 200, "json_schema": '{"type": "object"}'})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
    assert json.loads(out["text"]) == {"city": "Paris", "country": "France"}


def workload(vocab_words: list[str]) -> tuple[list[str], list[dict]]:
    """Grammar requests of every kind beside plain ones, greedy and seeded."""
    prompts = [f"Tell me about {w} and the scheduler." for w in vocab_words]
    grammars = [{"json_schema": json.dumps(ENUMS)}, {"regex": "[a-z ]{3,24}\\."}, {"ebnf": 'root ::= "x" root | "y"'},
                {"json_schema": json.dumps(ARRAYS)}, {}, {"regex": "(ab|cd)+e"}]
    params = [{"max_new_tokens": 24, **grammars[i % len(grammars)],
               **({"temperature": 0} if i % 3 else {"temperature": 0.8, "seed": i})} for i in range(len(prompts))]
    return prompts, params


WORDS = ["cache", "queue", "batch", "prefix", "chunk", "token", "round", "page", "pool", "tree", "radix", "slot"]
PRESSURE = {"max_total_tokens": 160, "schedule_conservativeness": 0.05, "chunked_prefill_size": 16}


@lru_cache(maxsize=None)
def solo_tiny() -> tuple[tuple[int, ...], ...]:
    prompts, params = workload(WORDS)
    with Engine("tiny-random", dtype="bfloat16", log_level="error") as engine:
        return tuple(tuple(engine.generate(p, sp)["output_ids"]) for p, sp in zip(prompts, params))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal-loop", "overlap-loop"])
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_grammar_requests_under_pressure_are_their_solo_runs(overlap, mixed):
    prompts, params = workload(WORDS)
    seen: set[type] = set()
    with Engine("tiny-random", dtype="bfloat16", log_level="error", disable_overlap_schedule=not overlap,
                enable_mixed_chunk=mixed, **PRESSURE) as engine:
        engine.event_bus.subscribe(lambda e: seen.add(type(e)))
        outs = engine.generate(prompts, params)
        sched = engine.scheduler
        assert sched.token_to_kv_pool_allocator.available_size() + sched.tree_cache.evictable_size() == \
            sched.max_total_num_tokens  # no KV slot leaked
    assert {ev.ReqRetracted, ev.ReqChunked, ev.GrammarQueued, ev.GrammarReady, ev.GrammarMasked} <= seen
    assert [tuple(o["output_ids"]) for o in outs] == list(solo_tiny())
    for out, p in zip(outs, params):
        if "regex" in p and out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(p["regex"], out["text"])


def test_twenty_grammar_requests_at_once_on_a_small_pool_all_finish_valid():
    schema = {"type": "object", "required": ["k"], "additionalProperties": False,
              "properties": {"k": {"type": "string", "pattern": "^[a-z ]{0,24}$"}}}
    with Engine("tiny-random", log_level="error", max_total_tokens=120, chunked_prefill_size=8,
                schedule_conservativeness=0.05, constrained_json_disable_any_whitespace=True) as engine:
        outs = engine.generate([f"request {i} of twenty" for i in range(20)],
                               {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)})
        assert engine.scheduler.observer.num_retracted_reqs > 0
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_bad_grammars_are_refused_at_the_gate_and_the_rest_runs():
    with Engine("tiny-random", log_level="error") as engine:
        outs = engine.generate(["a", "b", "c", "d", "e"], [
            {"max_new_tokens": 4, "json_schema": '{"type": "nope"}'}, {"max_new_tokens": 4, "regex": "(["},
            {"max_new_tokens": 4, "ebnf": "root ::= x"}, {"max_new_tokens": 4, "regex": "a", "ebnf": 'root ::= "a"'},
            {"max_new_tokens": 4}])
    errors = [o["meta_info"].get("error", "") for o in outs]
    assert errors[0].startswith("invalid json_schema: ") and errors[1].startswith("invalid regex: ")
    assert errors[2].startswith("invalid ebnf: ") and errors[3].startswith("Only one of regex, json_schema")
    assert errors[4] == "" and outs[4]["meta_info"]["completion_tokens"] == 4


def test_grammar_backend_none_refuses_grammar_requests():
    with Engine("tiny-random", log_level="error", grammar_backend="none") as engine:
        out = engine.generate("a", {"max_new_tokens": 4, "regex": "a+"})
    assert "--grammar-backend none" in out["meta_info"]["error"]


def test_a_compile_failure_in_the_background_fails_that_request_alone(monkeypatch):
    import sglite.managers.tokenizer_manager as tm

    monkeypatch.setattr(tm, "check_grammar_key", lambda key: None)  # past the gate: the compile fails
    with Engine("tiny-random", log_level="error") as engine:
        outs = engine.generate(["a", "b"], [{"max_new_tokens": 4, "regex": "(["}, {"max_new_tokens": 4, "regex": "b{4}"}])
    assert outs[0]["meta_info"]["error"].startswith("Failed to compile regex grammar: ")
    assert outs[1]["text"] == "bbbb"


def test_a_request_waits_in_the_grammar_queue_and_can_be_aborted_there():
    with Engine("tiny-random", log_level="error") as engine:
        backend = engine.scheduler.grammar_manager.grammar_backend
        release = threading.Event()
        dispatch = backend.dispatch
        backend.dispatch = lambda key: release.wait(30) and dispatch(key)
        waits = engine.submit("a", sampling_params={"max_new_tokens": 3, "regex": "w{3}"})
        gone = engine.submit("b", sampling_params={"max_new_tokens": 3, "regex": "g+"})
        plain = engine.submit("c", sampling_params={"max_new_tokens": 3})
        for _ in range(8):
            engine.step()
        assert [r.rid for r in engine.scheduler.grammar_manager.grammar_queue] == [waits, gone]
        assert engine.is_finished(plain)  # it did not wait for their compiles
        engine.abort(gone)
        engine.step()
        release.set()
        while not engine.is_finished(waits):
            engine.step()
        assert engine.result(waits)["text"] == "www"
        assert engine.result(gone)["meta_info"]["finish_reason"]["type"] == "abort"
        assert "waited" in engine.explain(waits) and "grammar" in engine.explain(waits)


def test_explain_tells_the_grammar_wait_and_what_the_mask_refused():
    with Engine("tiny-random", log_level="error") as engine:
        rid = engine.submit("scheduler", sampling_params={"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{8}"})
        while not engine.is_finished(rid):
            engine.step()
        text = engine.explain(rid)
    assert "its regex grammar is not compiled yet: it waits in the grammar_queue" in text
    assert re.search(r"waited \d+ iterations \(\d+ ms\) for its grammar to compile, then joined the waiting_queue", text)
    # tiny-random never prefers a digit on its own: the mask refused its first choice at every token
    assert "its grammar refused the model's first choice at 8 of 8 output tokens" in text
