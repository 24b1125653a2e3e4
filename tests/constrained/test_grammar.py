"""The grammar pieces on their own (sglite/constrained/): compile once per key, a matcher
per request, the grammar_queue's ready / failed / timed-out requests, rollback on
retraction, and the vocab mask's bits alone and batched. Over tiny-random's real
byte-level tokenizer; the model's outputs are tests/managers/test_structured_output.py's."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest
import torch

from sglite.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammarObject, grammar_key
from sglite.constrained.grammar_manager import GrammarManager
from sglite.constrained.xgrammar_backend import XGrammarGrammarBackend, build_grammar
from sglite.managers.schedule_batch import Req
from sglite.model_loader.tiny_random import build_tokenizer
from sglite.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.sampling.sampling_params import SamplingParams

TOKENIZER = build_tokenizer()
VOCAB = TOKENIZER.vocab_size
EOS = TOKENIZER.eos_token_ids[0]


def backend() -> XGrammarGrammarBackend:
    return XGrammarGrammarBackend(TOKENIZER, VOCAB, [EOS])


def req(rid: str, **params) -> Req:
    sp = SamplingParams.from_dict({"max_new_tokens": 32, **params})
    sp.normalize()
    return Req(rid, None, [5, 6, 7], sp, {EOS})


def tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def compiled(manager: GrammarManager, *reqs: Req) -> list[Req]:
    for r in reqs:
        assert manager.process_req_with_grammar(r) is None  # queued, or a cache hit
    ready: list[Req] = []
    while manager.has_waiting_grammars():
        got, failed = manager.get_ready_grammar_requests(block=True)
        assert failed == []
        ready += got
    assert sorted(map(id, ready)) == sorted(map(id, reqs))
    return list(reqs)  # (in the order given: compiles may finish in any order)


def test_one_compile_per_key_and_a_matcher_per_request():
    b = backend()
    calls = []
    dispatch = b.dispatch
    b.dispatch = lambda key: calls.append(key) or dispatch(key)
    manager = GrammarManager(b)
    a, c = req("a", regex="ab+"), req("c", regex="ab+")
    assert compiled(manager, a, c) == [a, c] and a.grammar is not c.grammar
    assert calls == [("regex", "ab+")]  # both waited on one compile
    third = req("d", regex="ab+")
    assert manager.process_req_with_grammar(third) is None and not manager.is_queued(third)  # a cache hit
    assert calls == [("regex", "ab+")]
    for t in tokens("ab"):
        a.grammar.accept_token(t)
    assert a.grammar.num_accepted == 2 and c.grammar.num_accepted == 0 and third.grammar.num_accepted == 0


def test_a_grammar_that_fails_to_compile_fails_its_requests_with_sglangs_words():
    manager = GrammarManager(backend())
    bad = req("bad", regex="([")  # the gate would refuse it; here the compile does
    assert manager.process_req_with_grammar(bad) is None and manager.is_queued(bad)
    failed: list = []
    while manager.has_waiting_grammars():
        failed += manager.get_ready_grammar_requests(block=True)[1]
    assert [(r.rid, msg.split(":")[0]) for r, msg in failed] == [("bad", "Failed to compile regex grammar")]
    assert "Unclosed '['" in failed[0][1]
    again = req("again", regex="([")
    assert manager.process_req_with_grammar(again).startswith("Failed to compile regex grammar")  # cached


class NeverDone(BaseGrammarBackend):
    def get_cached_or_future_value(self, key):
        return Future(), False


def test_a_compile_that_never_ends_times_out_after_the_poll_budget(monkeypatch):
    monkeypatch.setenv("SGLANG_GRAMMAR_MAX_POLL_ITERATIONS", "3")
    monkeypatch.setenv("SGLANG_GRAMMAR_POLL_INTERVAL", "0.001")
    manager = GrammarManager(NeverDone())
    slow = req("slow", regex="a")
    assert manager.process_req_with_grammar(slow) is None and manager.is_queued(slow)
    assert manager.get_ready_grammar_requests(block=True) == ([], [])
    assert manager.get_ready_grammar_requests(block=False) == ([], [])
    ready, failed = manager.get_ready_grammar_requests(block=False)
    assert ready == [] and [(r.rid, m) for r, m in failed] == [
        ("slow", "Grammar preprocessing timed out: grammar_key=('regex', 'a')")]
    assert not manager.has_waiting_grammars() and slow.grammar is None


def test_an_aborted_request_leaves_the_queue_and_drops_its_grammar():
    manager = GrammarManager(NeverDone())
    r = req("r", json_schema='{"type": "object"}')
    manager.process_req_with_grammar(r)
    assert manager.remove(r) and r.grammar is None and not manager.has_waiting_grammars()
    assert not manager.remove(r)


def test_no_backend_refuses_grammar_requests_and_passes_the_rest():
    manager = GrammarManager(None)
    assert "--grammar-backend none" in manager.process_req_with_grammar(req("g", ebnf='root ::= "a"'))
    assert manager.process_req_with_grammar(req("plain")) is None


def test_retraction_rolls_the_matcher_back_to_the_tokens_it_keeps():
    r = req("r", regex="abab")
    (r,) = compiled(GrammarManager(backend()), r)
    ab = tokens("ab")
    r.output_ids = list(ab)
    for t in ab + ab[:1]:  # one token more than output_ids: a round whose result was dropped
        r.grammar.accept_token(t)
    r.reset_for_retract()
    assert r.grammar.num_accepted == len(ab)
    r.grammar.accept_token(ab[0])  # it continues from "ab" again
    r.grammar.accept_token(ab[1])
    with pytest.raises(ValueError, match="does not allow"):
        r.grammar.accept_token(ab[0])


def test_the_mask_allows_the_stop_token_only_where_the_grammar_may_end():
    r = req("r", regex="ab")
    (r,) = compiled(GrammarManager(backend()), r)
    info = SamplingBatchInfo.from_reqs([r], VOCAB, "cpu")
    allowed = []
    for t in tokens("ab"):
        info.update_regex_vocab_mask()
        masked = info.apply_vocab_mask(torch.zeros(1, VOCAB))
        allowed.append(set(torch.isfinite(masked[0]).nonzero().view(-1).tolist()))
        r.grammar.accept_token(t)
    info.update_regex_vocab_mask()
    end = set(torch.isfinite(info.apply_vocab_mask(torch.zeros(1, VOCAB))[0]).nonzero().view(-1).tolist())
    assert EOS not in allowed[0] and EOS not in allowed[1]
    assert end == {EOS}
    r.grammar.accept_token(EOS)
    assert r.grammar.is_terminated()


def test_the_masked_logits_are_the_same_bits_alone_or_batched():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    reqs = compiled(GrammarManager(backend()), req("a", json_schema=schema), req("b", regex="[0-9]+"),
                    req("c", ebnf='root ::= "x" root | "y"'))
    plain = req("plain")
    for t in tokens('{"n'):
        reqs[0].grammar.accept_token(t)
    batch = reqs + [plain]
    logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(0))
    info = SamplingBatchInfo.from_reqs(batch, VOCAB, "cpu")
    info.update_regex_vocab_mask()
    together = info.apply_logits_bias(logits.clone())
    for i, r in enumerate(batch):
        alone = SamplingBatchInfo.from_reqs([r], VOCAB, "cpu")
        alone.update_regex_vocab_mask()
        assert torch.equal(alone.apply_logits_bias(logits[i : i + 1].clone())[0], together[i])
    assert torch.equal(together[3], logits[3])  # the request without a grammar is untouched
    steps = info.grammar_stats
    assert steps[3] is None and all(s.allowed == int(torch.isfinite(together[i]).sum()) for i, s in enumerate(steps[:3]))
    assert all(s.refused == bool(torch.isinf(together[i, s.preferred])) for i, s in enumerate(steps[:3]))


@pytest.mark.parametrize("key, message", [
    (("json", '{"type": 5}'), "invalid json_schema: Type should be a string"),
    (("json", "{not json"), "invalid json_schema: not JSON (Expecting property name enclosed in double quotes"),
    (("structural_tag", "[]"), "invalid structural_tag: "),
    (("regex", "(["), "invalid regex: Regex parsing error at position 3: Unclosed '['"),
    (("ebnf", "root ::= x"), 'invalid ebnf: EBNF parser error at line 1, column 10: Rule "x" is not defined'),
])
def test_the_gates_check_names_the_parameter_and_the_fault(key, message):
    with pytest.raises(ValueError) as e:
        build_grammar(key)
    assert str(e.value).startswith(message) and "/project/cpp" not in str(e.value)


def test_grammar_keys_are_sglangs_dispatch_types():
    assert grammar_key(SamplingParams(json_schema="{}")) == ("json", "{}")
    assert grammar_key(SamplingParams(regex="a")) == ("regex", "a")
    assert grammar_key(SamplingParams(ebnf='root ::= "a"')) == ("ebnf", 'root ::= "a"')
    assert grammar_key(SamplingParams()) is None
    with pytest.raises(ValueError, match="Only one of regex, json_schema, ebnf or structural_tag"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})
    assert SamplingParams.from_dict({"json_schema": {"type": "object"}}).json_schema == '{"type": "object"}'


def test_compiles_run_off_the_calling_thread():
    b = backend()
    seen = []
    dispatch = b.dispatch
    b.dispatch = lambda key: seen.append(threading.current_thread().name) or dispatch(key)
    compiled(GrammarManager(b), req("a", regex="x"))
    assert seen and seen[0].startswith("sglite-grammar")
    assert isinstance(InvalidGrammarObject("x").copy(), InvalidGrammarObject)


STRUCTURAL_TAG = json.dumps({"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]})


def test_a_structural_tag_holds_the_text_after_its_trigger_to_the_schema():
    """SGLang's structural_tag (xgrammar's structures + triggers): free text, but once the
    trigger is written what follows is the tag's begin, JSON of its schema, and its end."""
    build_grammar(("structural_tag", STRUCTURAL_TAG))  # the gate's check passes
    (r,) = compiled(GrammarManager(backend()), req("r", structural_tag=STRUCTURAL_TAG))
    for t in tokens('I will look. <function=get_weather>{"city": "Paris"}</function>'):
        r.grammar.accept_token(t)
    (bad,) = compiled(GrammarManager(backend()), req("bad", structural_tag=STRUCTURAL_TAG))
    with pytest.raises(ValueError, match="does not allow"):
        for t in tokens('<function=get_weather>{"town": 1}'):
            bad.grammar.accept_token(t)


def test_mask_stats_count_the_vocabulary_s_bits_only():
    from sglite.sampling.sampling_batch_info import mask_stats

    row = torch.zeros(1, 2, dtype=torch.int32)
    row[0, 0] = 1  # token 0
    # tokens 33 and 39; bits 20 and 31 (tokens 52, 63) lie past a vocabulary of 40 (int32: bit 31 is the sign)
    row[0, 1] = ((1 << 1) | (1 << 7) | (1 << 20) | (1 << 31)) - (1 << 32)
    allowed, refused = mask_stats(torch.cat([row, row]), torch.tensor([33, 34]), 40)
    assert allowed == [3, 3] and refused == [False, True]
