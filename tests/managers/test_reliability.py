"""Bad input never breaks the engine (docs/reliability.md). Every case of BAD_REQUESTS
comes back at once as that request's one-line error (finish_reason abort) while a good
request in the same batch runs on; BAD_SERVER_ARGS fail Engine construction with a
ValueError naming the argument; rids, streams and seeds hold under interleaving."""

from __future__ import annotations

import math
import threading

import pytest

from sglite.engine import Engine
from sglite.managers.tokenizer_manager import LOGPROB_FIELDS, logprob_params_each

GOOD = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

# (what was tried, generate() keyword arguments, a fragment of the error it gets)
BAD_REQUESTS: list[tuple[str, dict, str]] = [
    ("stop holds an int", {"prompt": "hi", "sampling_params": {"stop": [5]}}, "stop must be"),
    ("stop holds None", {"prompt": "hi", "sampling_params": {"stop": [None]}}, "stop must be"),
    ("stop is an int", {"prompt": "hi", "sampling_params": {"stop": 5}}, "stop must be"),
    ("stop is an empty string", {"prompt": "hi", "sampling_params": {"stop": ""}}, "stop must be"),
    ("stop is a dict", {"prompt": "hi", "sampling_params": {"stop": {"a": 1}}}, "stop must be"),
    ("stop_token_ids is a string", {"prompt": "hi", "sampling_params": {"stop_token_ids": "abc"}}, "stop_token_ids must be"),
    ("stop_token_ids holds a float", {"prompt": "hi", "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids must be"),
    ("stop_token_ids outside the vocabulary", {"prompt": "hi", "sampling_params": {"stop_token_ids": [10**9]}}, "outside the vocabulary"),
    ("stop_token_ids negative", {"prompt": "hi", "sampling_params": {"stop_token_ids": [-1]}}, "outside the vocabulary"),
    ("temperature is a string", {"prompt": "hi", "sampling_params": {"temperature": "hot"}}, "temperature must be a finite number"),
    ("temperature is NaN", {"prompt": "hi", "sampling_params": {"temperature": math.nan}}, "temperature must be a finite number"),
    ("temperature is inf", {"prompt": "hi", "sampling_params": {"temperature": math.inf}}, "temperature must be a finite number"),
    ("temperature negative", {"prompt": "hi", "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
    ("temperature is a bool", {"prompt": "hi", "sampling_params": {"temperature": True}}, "temperature must be a finite number"),
    ("top_p is 0", {"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p must be in"),
    ("top_p above 1", {"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p must be in"),
    ("top_p is NaN", {"prompt": "hi", "sampling_params": {"top_p": math.nan}}, "top_p must be a finite number"),
    ("top_k is a float", {"prompt": "hi", "sampling_params": {"top_k": 2.5}}, "top_k must be an integer"),
    ("top_k is 0", {"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k must be -1"),
    ("top_k is -5", {"prompt": "hi", "sampling_params": {"top_k": -5}}, "top_k must be -1"),
    ("top_k is a string", {"prompt": "hi", "sampling_params": {"top_k": "5"}}, "top_k must be an integer"),
    ("min_p above 1", {"prompt": "hi", "sampling_params": {"min_p": 2}}, "min_p must be in"),
    ("min_p is -inf", {"prompt": "hi", "sampling_params": {"min_p": -math.inf}}, "min_p must be a finite number"),
    ("presence_penalty is a string", {"prompt": "hi", "sampling_params": {"presence_penalty": "x"}}, "presence_penalty must be a finite number"),
    ("presence_penalty out of range", {"prompt": "hi", "sampling_params": {"presence_penalty": 3}}, "presence_penalty must be in"),
    ("frequency_penalty out of range", {"prompt": "hi", "sampling_params": {"frequency_penalty": -2.5}}, "frequency_penalty must be in"),
    ("repetition_penalty is 0", {"prompt": "hi", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty must be in"),
    ("repetition_penalty is NaN", {"prompt": "hi", "sampling_params": {"repetition_penalty": math.nan}}, "repetition_penalty must be a finite number"),
    ("max_new_tokens is -1", {"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be a non-negative"),
    ("max_new_tokens negative", {"prompt": "hi", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens must be a non-negative"),
    ("max_new_tokens is True", {"prompt": "hi", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens must be an integer"),
    ("max_new_tokens is a float", {"prompt": "hi", "sampling_params": {"max_new_tokens": 4.0}}, "max_new_tokens must be an integer"),
    ("max_new_tokens is a string", {"prompt": "hi", "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens must be an integer"),
    ("seed is a string", {"prompt": "hi", "sampling_params": {"seed": "abc"}}, "seed must be an integer"),
    ("seed is 2**70", {"prompt": "hi", "sampling_params": {"seed": 2**70}}, "seed must be in"),
    ("seed negative", {"prompt": "hi", "sampling_params": {"seed": -1}}, "seed must be in"),
    ("ignore_eos is a string", {"prompt": "hi", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos must be true or false"),
    ("skip_special_tokens is 1", {"prompt": "hi", "sampling_params": {"skip_special_tokens": 1}}, "skip_special_tokens must be"),
    ("no_stop_trim is None", {"prompt": "hi", "sampling_params": {"no_stop_trim": None}}, "no_stop_trim must be"),
    ("an unknown sampling parameter", {"prompt": "hi", "sampling_params": {"bogus": 1}}, "unknown sampling parameter"),
    ("sampling_params is a list", {"prompt": "hi", "sampling_params": [[1]]}, "sampling_params must be a dict"),
    ("sampling_params is a string", {"prompt": "hi", "sampling_params": "greedy"}, "sampling_params must be a dict"),
    ("an empty prompt", {"prompt": ""}, "the prompt is empty"),
    ("no prompt at all", {}, "give a prompt"),
    ("a prompt and input_ids", {"prompt": "hi", "input_ids": [1, 2]}, "give only one"),
    ("the prompt is an int", {"prompt": 5}, "the prompt must be a string"),
    ("the prompt is bytes", {"prompt": b"hi"}, "the prompt must be a string"),
    ("empty input_ids", {"input_ids": []}, "the prompt is empty"),
    ("input_ids holds a float", {"input_ids": [1.7]}, "input_ids must be integers"),
    ("input_ids holds a bool", {"input_ids": [True, 3]}, "input_ids must be integers"),
    ("input_ids holds a string", {"input_ids": ["3"]}, "input_ids must be integers"),
    ("input_ids is a string", {"input_ids": "3 4 5"}, "input_ids must be a list"),
    ("input_ids outside the vocabulary", {"input_ids": [10**9]}, "outside the vocabulary"),
    ("input_ids negative", {"input_ids": [-1, 3]}, "outside the vocabulary"),
    ("a prompt longer than the context", {"input_ids": [3] * 5000},
     "The input (5000 tokens) is longer than the model's context length (2048 tokens)"),
    ("a prompt that fits the context but not beside the output", {"input_ids": [3] * 2045}, "tokens; at most 2042"),
    ("max_new_tokens past the context", {"input_ids": [3] * 2000, "sampling_params": {"max_new_tokens": 100}},
     "Requested token count exceeds the model's maximum context length of 2048 tokens"),
    ("min_new_tokens above max_new_tokens", {"prompt": "hi", "sampling_params": {"max_new_tokens": 2,
                                                                                 "min_new_tokens": 3}},
     "min_new_tokens must be in [0, max_new_tokens(2)], got 3"),
    ("logit_bias of a token outside the vocabulary", {"prompt": "hi", "sampling_params": {"logit_bias": {"999999": 1}}},
     "logit_bias has token 999999, outside the vocabulary"),
    ("logit_bias of 500", {"prompt": "hi", "sampling_params": {"logit_bias": {"5": 500}}},
     "logit_bias[5] must be in [-100, 100], got 500"),
    ("json_schema that is not JSON", {"prompt": "hi", "sampling_params": {"json_schema": "{not json"}},
     "invalid json_schema: not JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("a regex that does not parse", {"prompt": "hi", "sampling_params": {"regex": "(["}},
     "invalid regex: Regex parsing error at position 3: Unclosed '['"),
    ("an ebnf naming an undefined rule", {"prompt": "hi", "sampling_params": {"ebnf": "root ::= x"}},
     'invalid ebnf: EBNF parser error at line 1, column 10: Rule "x" is not defined'),
    ("two grammars at once", {"prompt": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
     "Only one of regex, json_schema, ebnf or structural_tag can be set."),
    ("a regex of 65537 characters", {"prompt": "hi", "sampling_params": {"regex": "a" * 65537}},
     "regex has 65537 characters; at most 65536"),
    ("messages is a string", {"messages": "hi"}, "messages must be"),
    ("messages is empty", {"messages": []}, "messages must be"),
    ("a message without content", {"messages": [{"role": "user"}]}, "each message must be"),
    ("a message whose content is a list", {"messages": [{"role": "user", "content": ["x"]}]}, "each message must be"),
    ("a message that is a string", {"messages": ["hello"]}, "each message must be"),
    ("stop holds a lone surrogate", {"prompt": "hi", "sampling_params": {"stop": ["\ud800"]}},
     "stop is not valid UTF-8 text"),
    ("65 stop strings", {"prompt": "hi", "sampling_params": {"stop": ["x"] * 65}}, "stop has 65 strings; at most 64"),
    ("a stop string of 513 characters", {"prompt": "hi", "sampling_params": {"stop": "y" * 513}},
     "a stop string has 513 characters; at most 512"),
    ("4097 stop_token_ids", {"prompt": "hi", "sampling_params": {"stop_token_ids": [1] * 4097}},
     "stop_token_ids has 4097 ids; at most 4096"),
    ("top_p is 5e-324", {"prompt": "hi", "sampling_params": {"top_p": 5e-324}}, "top_p 5e-324 is too small"),
    ("repetition_penalty is 5e-324", {"prompt": "hi", "sampling_params": {"repetition_penalty": 5e-324}},
     "repetition_penalty 5e-324 is too small"),
    ("min_p is 1e-40", {"prompt": "hi", "sampling_params": {"min_p": 1e-40}}, "min_p 1e-40 is too small"),
    ("a prompt with a lone surrogate", {"prompt": "hi \udc00"}, "the prompt is not valid UTF-8 text"),
    ("a message with a lone surrogate", {"messages": [{"role": "user", "content": "\ud800"}]},
     "a message's content is not valid UTF-8 text"),
    ("a prompt of a million characters", {"prompt": "a" * 10**6}, "characters, more than the 2042 tokens that fit"),
    ("extra_key is an int", {"prompt": "hi", "extra_key": 5}, "cache_salt / extra_key must be a non-empty string"),
    ("extra_key is empty", {"prompt": "hi", "extra_key": ""}, "cache_salt / extra_key must be a non-empty string"),
    ("n is 2 in sampling_params", {"prompt": "hi", "sampling_params": {"n": 2}}, "n must be 1 here"),
    ("return_logprob is a string", {"prompt": "hi", "return_logprob": "yes"}, "return_logprob must be true or false"),
    ("logprob_start_len past the prompt", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2},
     "logprob_start_len=2 is higher than the number of input tokens (2)"),
    ("logprob_start_len is -2", {"prompt": "hi", "return_logprob": True, "logprob_start_len": -2},
     "logprob_start_len must be -1"),
    ("top_logprobs_num is 21", {"prompt": "hi", "return_logprob": True, "top_logprobs_num": 21},
     "top_logprobs_num must be in [0, 20], got 21"),
    ("token_ids_logprob outside the vocabulary", {"prompt": "hi", "return_logprob": True,
                                                  "token_ids_logprob": [10**9]}, "token_ids_logprob has 1000000000"),
]

# (what was tried, Engine keyword arguments, a fragment of the ValueError)
BAD_SERVER_ARGS: list[tuple[str, dict, str]] = [
    ("max_running_requests=-1", {"max_running_requests": -1}, "max_running_requests must be positive"),
    ("max_running_requests=0", {"max_running_requests": 0}, "max_running_requests must be positive"),
    ("max_prefill_tokens=0", {"max_prefill_tokens": 0}, "max_prefill_tokens must be positive"),
    ("max_prefill_tokens=-1", {"max_prefill_tokens": -1}, "max_prefill_tokens must be positive"),
    ("decode_log_interval=0", {"decode_log_interval": 0}, "decode_log_interval must be positive"),
    ("context_length=-5", {"context_length": -5}, "context_length must be positive"),
    ("device='tpu'", {"device": "tpu"}, "device must be"),
    ("max_total_tokens=0", {"max_total_tokens": 0}, "max_total_tokens must be positive"),
    ("max_total_tokens='big'", {"max_total_tokens": "big"}, "max_total_tokens must be an integer"),
    ("page_size=0", {"page_size": 0}, "page_size must be positive"),
    ("mem_fraction_static=1.5", {"mem_fraction_static": 1.5}, "mem_fraction_static must be in"),
    ("schedule_conservativeness=nan", {"schedule_conservativeness": math.nan}, "schedule_conservativeness must be a finite"),
    ("schedule_policy='sjf'", {"schedule_policy": "sjf"}, "schedule_policy must be one of"),
    ("dtype='int8'", {"dtype": "int8"}, "dtype must be one of"),
    ("random_seed=-1", {"random_seed": -1}, "random_seed must be in"),
    ("waiting_timeout=0", {"waiting_timeout": 0}, "waiting_timeout must be positive"),
    ("enable_mixed_chunk='yes'", {"enable_mixed_chunk": "yes"}, "enable_mixed_chunk must be true or false"),
    ("triton_attention_split_tile_size=100", {"triton_attention_split_tile_size": 100},
     "triton_attention_split_tile_size must be a multiple of 64"),
    ("an unknown server argument", {"max_batch": 4}, "unknown server argument"),
]


@pytest.fixture(scope="module")
def engine():
    e = Engine("tiny-random", max_total_tokens=2048, max_running_requests=16, enable_self_check=True)
    yield e
    e.shutdown()


@pytest.mark.parametrize("what,kwargs,message", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_gets_its_error_and_its_batch_mate_runs(engine, what, kwargs, message):
    alone = engine.generate(input_ids=[5, 6, 7], sampling_params=GOOD)
    bad = {"prompt": None, "input_ids": None, "messages": None, "sampling_params": GOOD, "extra_key": None, **kwargs}
    logprob = logprob_params_each(1, **{k: v for k, v in kwargs.items() if k in LOGPROB_FIELDS})[0]
    rid_bad = engine.submit(bad["prompt"], input_ids=bad["input_ids"], messages=bad["messages"],
                            sampling_params=bad["sampling_params"], extra_key=bad["extra_key"], logprob=logprob)
    good = engine.generate(input_ids=[5, 6, 7], sampling_params=GOOD)
    assert engine.is_finished(rid_bad)
    res = engine.result(rid_bad)
    assert message in res["error"] and "\n" not in res["error"], res["error"]
    assert res["meta_info"]["finish_reason"]["type"] == "abort" and res["output_ids"] == []
    assert good["output_ids"] == alone["output_ids"]
    engine.step()  # idle: the page walk finds nothing leaked


@pytest.mark.parametrize("what,kwargs,message", BAD_SERVER_ARGS, ids=[c[0] for c in BAD_SERVER_ARGS])
def test_bad_server_args_are_a_clear_error(what, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(")):
        Engine("tiny-random", **kwargs)


def test_huge_top_k_means_all_tokens_and_leaks_nothing(engine):
    params = {"max_new_tokens": 4, "top_k": 2**63, "seed": 3, "ignore_eos": True}
    out = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[params, GOOD])
    assert all("error" not in o and len(o["output_ids"]) == 4 for o in out)
    assert out[0]["output_ids"] == engine.generate(input_ids=[5, 6, 7], sampling_params={**params, "top_k": -1})["output_ids"]
    engine.step()


def test_duplicate_rids_are_refused_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="must differ"):
        engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=GOOD, rid=["same", "same"])
    with pytest.raises(ValueError, match="as many sampling_params and rids"):
        engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=GOOD, rid=["only-one"])
    assert not engine.scheduler.has_work()
    stream = engine.generate(input_ids=[5, 6, 7], sampling_params=GOOD, rid="busy", stream=True)
    next(stream)
    with pytest.raises(ValueError, match="'busy' is already in use"):
        engine.generate(input_ids=[8, 9], sampling_params=GOOD, rid="busy")
    rest = list(stream)
    assert rest[-1]["finished"]
    assert "error" not in engine.generate(input_ids=[8, 9], sampling_params=GOOD, rid="busy")  # free again


def test_streams_and_generate_interleave_in_one_thread(engine):
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want_a = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    want_b = engine.generate(input_ids=[9, 10], sampling_params=params)["output_ids"]
    a = engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=True)
    b = engine.generate(input_ids=[9, 10], sampling_params=params, stream=True)
    got_a, got_b = list(next(a)["output_ids"]), list(next(b)["output_ids"])
    mid = engine.generate(input_ids=[5, 6, 7], sampling_params=params)  # while both streams are open
    for chunk_a, chunk_b in zip(a, b):
        got_a += chunk_a["output_ids"]
        got_b += chunk_b["output_ids"]
    got_a += [t for c in a for t in c["output_ids"]]
    got_b += [t for c in b for t in c["output_ids"]]
    assert (got_a, got_b, mid["output_ids"]) == (want_a, want_b, want_a)


def test_four_threads_of_streams_lose_nothing(engine):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompts = [[3 + (i % 7), 4 + (i % 5), 5] for i in range(8)]
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    errors: list[str] = []

    def worker(k: int) -> None:
        for j in range(30):
            i = (k + j) % len(prompts)
            got = [t for c in engine.generate(input_ids=prompts[i], sampling_params=params, stream=True)
                   for t in c["output_ids"]]
            if got != want[i]:
                errors.append(f"thread {k} request {j}: {got} != {want[i]}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)


def test_seeded_sampling_does_not_depend_on_chunking_or_batching():
    prompts = [[3 + (i * 7 + j) % 40 for j in range(5 + i % 30)] for i in range(60)]
    params = [{"max_new_tokens": 6, "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True} for i in range(60)]
    solo_engine = Engine("tiny-random", max_total_tokens=4096, disable_overlap_schedule=True)
    want = [solo_engine.generate(input_ids=p, sampling_params=q)["output_ids"] for p, q in zip(prompts, params)]
    chunked = Engine("tiny-random", max_total_tokens=4096, chunked_prefill_size=8, disable_overlap_schedule=True)
    got = [o["output_ids"] for o in chunked.generate(input_ids=prompts, sampling_params=params)]
    assert got == want


def test_seeded_sampling_survives_retraction_in_the_overlap_loop():
    prompts = [[3 + (i * 5 + j) % 30 for j in range(6)] for i in range(12)]
    params = [{"max_new_tokens": 30, "temperature": 1.0, "seed": 7 + i, "ignore_eos": True} for i in range(12)]
    solo_engine = Engine("tiny-random", max_total_tokens=4096, disable_overlap_schedule=True)
    want = [solo_engine.generate(input_ids=p, sampling_params=q)["output_ids"] for p, q in zip(prompts, params)]
    tight = Engine("tiny-random", max_total_tokens=160, disable_overlap_schedule=False, enable_self_check=True)
    got = [o["output_ids"] for o in tight.generate(input_ids=prompts, sampling_params=params)]
    assert tight.scheduler.observer.num_retracted_reqs > 0
    assert got == want


def test_a_batch_of_chats():
    engine = Engine("tiny-random", max_total_tokens=2048)
    chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello there"}]]
    out = engine.generate(messages=chats, sampling_params=GOOD)
    assert [o["output_ids"] for o in out] == [engine.generate(messages=c, sampling_params=GOOD)["output_ids"]
                                              for c in chats]


def _fail_in_from_reqs(monkeypatch, should_fail) -> None:
    """Make building a batch's sampling info raise whenever should_fail(reqs) says so."""
    from sglite.managers import schedule_batch

    real = schedule_batch.SamplingBatchInfo.from_reqs

    def from_reqs(reqs, *args, **kw):
        if should_fail(reqs):
            raise OverflowError("a value no tensor can hold")
        return real(reqs, *args, **kw)

    monkeypatch.setattr(schedule_batch.SamplingBatchInfo, "from_reqs", from_reqs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_round_that_raises_once_is_retried_and_every_request_finishes(overlap, monkeypatch):
    engine = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=not overlap, enable_self_check=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = {**GOOD, "max_new_tokens": 8}
    want = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    calls = {"n": 0}

    def third_batch(reqs) -> bool:  # the third batch built: both requests hold KV by then
        calls["n"] += 1
        return calls["n"] == 3

    _fail_in_from_reqs(monkeypatch, third_batch)
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in out] == want
    assert [o["meta_info"]["retraction_count"] for o in out] == [1, 1]
    engine.step()  # idle: the page walk finds nothing leaked or free twice


POISON = 99  # a prompt starting with this token breaks any round once it has 3 output tokens


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("extra", [{}, {"chunked_prefill_size": 8, "enable_mixed_chunk": True}])
def test_a_request_that_breaks_its_rounds_fails_alone(overlap, extra, monkeypatch):
    engine = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=not overlap,
                    enable_self_check=True, **extra)
    prompts = [[5, 6, 7], [POISON, 1, 2], list(range(10, 30)), [8, 9, 10, 11]]
    params = {**GOOD, "max_new_tokens": 8}
    want = {i: engine.generate(input_ids=p, sampling_params=params)["output_ids"]
            for i, p in enumerate(prompts) if p[0] != POISON}
    _fail_in_from_reqs(monkeypatch, lambda reqs: any(
        r.origin_input_ids[0] == POISON and len(r.output_ids) >= 3 for r in reqs))
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert {i: o["output_ids"] for i, o in enumerate(out) if i in want} == want
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for i, o in enumerate(out) if i in want)
    bad = out[1]
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "internal error" in bad["error"] and "OverflowError: a value no tensor can hold" in bad["error"]
    assert len(bad["output_ids"]) == 3  # its tokens before the failure were kept
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"] == want[0]
    engine.step()  # idle: the page walk finds nothing leaked or free twice


@pytest.mark.parametrize("template,message", [
    ("{{ raise_exception('only user turns, please') }}", "the chat template failed: ValueError: chat template: "
                                                          "only user turns, please"),
    ("{{ 1 // 0 }}", "the chat template failed: ZeroDivisionError"),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "the chat template failed"),
])
def test_a_chat_template_that_raises_fails_only_its_request(template, message, monkeypatch):
    """The template is code from the model's files: whatever it raises is that request's
    error; the engine and the other requests run on."""
    engine = Engine("tiny-random", log_level="error")
    # monkeypatch: the loaded tokenizer is shared by every Engine of this process
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    monkeypatch.setattr(engine.tokenizer, "_template", None)
    out = engine.generate(messages=[[{"role": "user", "content": "hi"}]], sampling_params={"max_new_tokens": 2})
    assert message in out[0]["error"] and out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    ok = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert "error" not in ok and len(ok["output_ids"]) == 2
    engine.shutdown()


# --- a failed round keeps the radix cache and the requests outside it ---------------------

P = list(range(100, 140))  # a prompt an earlier, finished request left in the radix cache
FAILING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _fail_rounds(monkeypatch, engine, how: str, should_fail) -> list[str | None]:
    """Make every round whose requests should_fail(reqs) picks raise: while it is planned
    ("plan": building its sampling info), launched ("launch": handing it to the worker,
    on the scheduler's thread) or in its forward ("forward": the model raises before
    writing any KV; in the overlap loop on the forward thread, so the scheduler learns of
    it a round later, after it has cached that round's prompt or chunk). Returns the rid
    of the chunked request at each failure (None: there was none)."""
    s = engine.scheduler
    chunked_at_failure: list[str | None] = []

    def fails(reqs) -> bool:
        if should_fail(reqs):
            chunked_at_failure.append(s.chunked_req.rid if s.chunked_req is not None else None)
            return True
        return False

    if how == "plan":
        _fail_in_from_reqs(monkeypatch, fails)
        return chunked_at_failure
    from sglite.managers import tp_worker, tp_worker_overlap_thread

    failing: set[tuple[int, int]] = set()  # (model runner, bid): only this engine's forwards fail
    launch = s.tp_worker.forward_batch_generation

    def forward_batch_generation(worker_batch):
        if fails(s.cur_batch.reqs):  # cur_batch: the batch run_batch was given
            if how == "launch":
                raise ValueError("boom")
            failing.add((id(s.tp_worker.model_runner), worker_batch.bid))
        return launch(worker_batch)

    run_forward = tp_worker.run_forward

    def failing_run_forward(model_runner, forward_batch, result):
        if (id(model_runner), result.bid) in failing:
            raise ValueError("boom")
        return run_forward(model_runner, forward_batch, result)

    monkeypatch.setattr(s.tp_worker, "forward_batch_generation", forward_batch_generation)
    monkeypatch.setattr(tp_worker, "run_forward", failing_run_forward)
    monkeypatch.setattr(tp_worker_overlap_thread, "run_forward", failing_run_forward)
    return chunked_at_failure


def _lock_problems(s) -> list[str]:
    """Every node's lock_ref is the number of running requests (and the chunked one) whose
    prefix runs through it, and protected_size counts exactly the locked tokens."""
    tree = s.tree_cache
    if not hasattr(tree, "root_node"):
        return []  # ChunkCache: no tree, no locks
    want: dict[int, int] = {}
    for req in s.running_reqs() + ([s.chunked_req] if s.chunked_req is not None else []):
        node = req.last_node
        while node is not None and node is not tree.root_node:
            want[id(node)] = want.get(id(node), 0) + 1
            node = node.parent
    problems, locked = [], 0
    for node in tree._iter_nodes():
        if node is not tree.root_node:
            if node.lock_ref != want.get(id(node), 0):
                problems.append(f"{node!r} has lock_ref {node.lock_ref}, {want.get(id(node), 0)} holders")
            locked += len(node.value) if node.lock_ref else 0
    if tree.protected_size() != locked:
        problems.append(f"protected_size {tree.protected_size()} != {locked} locked tokens")
    return problems


def _watched_engine(monkeypatch, overlap: bool, **kwargs) -> tuple[Engine, list[int]]:
    """An engine that walks every KV page and checks every lock after each iteration;
    also returns what each failed round's SchedulerRuntimeChecker.reclaim_leaked found
    (recovery must give every slot back itself: each entry 0)."""
    engine = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=not overlap,
                    enable_self_check=True, enable_busy_self_check=True, chunked_prefill_size=8, **kwargs)
    checker = engine.scheduler.runtime_checker
    busy_check, reclaim = checker.self_check_during_busy, checker.reclaim_leaked
    reclaimed: list[int] = []

    def self_check_during_busy() -> None:
        busy_check()
        assert not _lock_problems(engine.scheduler), _lock_problems(engine.scheduler)

    monkeypatch.setattr(checker, "self_check_during_busy", self_check_during_busy)
    monkeypatch.setattr(checker, "reclaim_leaked", lambda: reclaimed.append(reclaim()) or reclaimed[-1])
    return engine, reclaimed


def _solo(prompts: list[list[int]]) -> list[list[int]]:
    solo = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=True)
    return [solo.generate(input_ids=p, sampling_params=FAILING)["output_ids"] for p in prompts]


def _cache_p(engine: Engine) -> int:
    """Run P to the end (its prompt and output stay in the radix cache); the cached_tokens
    a later request with prompt P reports."""
    engine.generate(input_ids=P, sampling_params=FAILING)
    cached = engine.generate(input_ids=P, sampling_params=FAILING)["meta_info"]["cached_tokens"]
    assert cached == len(P) - 1
    return cached


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("how", ["plan", "launch", "forward"])
def test_a_failed_round_of_several_requests_keeps_the_cache(overlap, how, monkeypatch):
    """A mixed round (a chunk of a long prompt + decodes) fails because of one request; the
    trial finds it. The cache keeps P (an earlier request's), and the re-run requests,
    the chunked one included, equal their solo runs: no node still holds KV that the
    failed forward should have written (in the overlap loop, the chunk cached before its
    forward was known to fail)."""
    engine, reclaimed = _watched_engine(monkeypatch, overlap, enable_mixed_chunk=True)
    prompts = [[5, 6, 7], [POISON, 1, 2], list(range(10, 50)), [8, 9, 10, 11]]
    want = dict(enumerate(_solo(prompts)))
    del want[1]
    cached = _cache_p(engine)
    chunked = _fail_rounds(monkeypatch, engine, how, lambda reqs: any(
        r.origin_input_ids[0] == POISON and len(r.output_ids) >= 3 for r in reqs))
    out = engine.generate(input_ids=prompts, sampling_params=FAILING, rid=["a", "bad", "long", "d"])
    assert chunked and chunked[0] == "long"  # the first failed round had a chunk of "long"
    assert {i: o["output_ids"] for i, o in enumerate(out) if i in want} == want
    assert out[2]["meta_info"]["retraction_count"] >= 1  # it was in the failed round
    bad = out[1]
    assert bad["meta_info"]["finish_reason"]["type"] == "abort" and len(bad["output_ids"]) >= 3
    assert ("OverflowError" if how == "plan" else "boom") in bad["error"]
    assert engine.generate(input_ids=P, sampling_params=FAILING)["meta_info"]["cached_tokens"] == cached
    assert reclaimed and not any(reclaimed)
    engine.step()  # idle: the page walk finds nothing leaked or free twice


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("how", ["plan", "launch", "forward"])
def test_a_failed_round_of_one_request_fails_it_alone_and_keeps_the_cache(overlap, how, monkeypatch):
    """A long prompt fails at its third chunk while two requests wait, decoding, outside
    that round: it alone gets the error; they are not retracted and equal their solo runs;
    P stays cached, and so do the first two chunks (their forwards finished), but not the
    third (in the overlap loop it was cached before its forward failed)."""
    engine, reclaimed = _watched_engine(monkeypatch, overlap)
    innocents = [[5, 6, 7], [8, 9, 10, 11]]
    long_prompt = [POISON] + list(range(200, 239))  # 40 tokens: 5 chunks of 8
    want = _solo(innocents + [long_prompt])
    cached = _cache_p(engine)
    chunked = _fail_rounds(monkeypatch, engine, how, lambda reqs: any(
        r.rid == "bad" and len(r.prefix_indices) >= 16 for r in reqs))
    rids = [engine.submit(input_ids=p, sampling_params=FAILING) for p in innocents]
    while len(engine.scheduler.running_reqs()) < 2:  # both decoding when the long prompt comes
        engine.step()
    engine.submit(input_ids=long_prompt, sampling_params=FAILING, rid="bad")
    while not all(engine.is_finished(r) for r in rids + ["bad"]):
        engine.step()
    assert chunked and chunked[0] == "bad"
    bad = engine.result("bad")
    assert bad["meta_info"]["finish_reason"]["type"] == "abort" and bad["output_ids"] == []
    assert ("OverflowError" if how == "plan" else "boom") in bad["error"]
    for rid, tokens in zip(rids, want):
        assert engine.result(rid)["output_ids"] == tokens
        assert engine.result(rid)["meta_info"]["retraction_count"] == 0
    assert engine.generate(input_ids=P, sampling_params=FAILING)["meta_info"]["cached_tokens"] == cached
    again = engine.generate(input_ids=long_prompt, sampling_params=FAILING)
    assert (again["output_ids"], again["meta_info"]["cached_tokens"]) == (want[2], 16)
    assert reclaimed and not any(reclaimed)
    engine.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_trial_request_prefilled_in_chunks_runs_alone_to_its_last_chunk(overlap, monkeypatch):
    """On trial, the culprit re-prefills its prompt and tokens in two chunks and fails at
    the last. That chunk leaves chunked_req None before admission runs: the next request
    on trial must still wait, or the two fail together, go on trial again, and so on
    forever (no radix cache, so no cached prefix shortens the re-prefill)."""
    engine, reclaimed = _watched_engine(monkeypatch, overlap, disable_radix_cache=True)
    prompts = [[POISON] + list(range(1, 7)), [5, 6, 7], [8, 9, 10]]  # 7 + 3 tokens > a chunk of 8
    want = _solo(prompts[1:])
    _fail_in_from_reqs(monkeypatch, lambda reqs: any(
        r.origin_input_ids[0] == POISON and len(r.output_ids) >= 3 and len(r.prefix_indices) > 0 for r in reqs))
    rids = [engine.submit(input_ids=p, sampling_params=FAILING) for p in prompts]
    for _ in range(200):
        if all(engine.is_finished(r) for r in rids):
            break
        engine.step()
    assert all(engine.is_finished(r) for r in rids), "the trial never ends"
    bad = engine.result(rids[0])
    assert bad["meta_info"]["finish_reason"]["type"] == "abort" and len(bad["output_ids"]) == 3
    assert [engine.result(r)["output_ids"] for r in rids[1:]] == want
    assert not any(reclaimed)
    engine.step()
