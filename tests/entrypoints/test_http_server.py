"""`sglite serve` for real: the three processes on a free loopback port (tiny-random),
driven with the official `openai` client and raw HTTP. Outputs must equal the offline
Engine's greedy outputs; bad bodies get 400s; a client that goes away frees its KV;
/metrics parses and counts what was served; SIGTERM leaves no process behind."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglite.engine import Engine

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4", "Why is the sky blue?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.started = int(time.time())  # (whole seconds, as /v1/models' created)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # stdout and stderr to a file: at SGLang's default log level (info) the server logs
        # every prefill round and (uvicorn, on stdout) every request, and a pipe nobody
        # reads until the end would fill and stall it
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "sglite.cli", "serve", "--model-path", "tiny-random",
                                      "--port", str(self.port), *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.ready = int(time.time())
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.terminate()  # (no server left behind by a failed start: it stops its children)
        self.proc.wait(timeout=60)
        raise AssertionError(f"the server did not come up: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        """What the server has written (stderr and stdout) so far."""
        self.log.seek(0)
        return self.log.read()

    def wait(self) -> str:
        """Its stderr, once it exited."""
        self.proc.wait(timeout=60)
        return self.stderr()

    def state(self) -> dict:
        return httpx.get(f"{self.url}/get_server_info", timeout=30).json()["internal_states"][0]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stop(self) -> tuple[int, str]:
        kids = children_of(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        err = self.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{k}") for k in kids):
            time.sleep(0.1)
        left = [k for k in kids if os.path.exists(f"/proc/{k}") and "Z" not in _proc_state(k)]
        assert kids and not left, f"processes left after SIGTERM: {left}"
        return self.proc.returncode, err


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2]
    except OSError:
        return "gone"


@pytest.fixture(scope="module")
def server():
    s = Server("--enable-metrics")
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def engine():
    e = Engine("tiny-random", log_level="error")
    yield e
    e.shutdown()


def greedy(engine: Engine, n: int = 12, **kw) -> dict:
    return engine.generate(**kw, sampling_params={"max_new_tokens": n, "temperature": 0})


def test_native_generate_equals_the_offline_engine(server, engine):
    for prompt in PROMPTS:
        want = greedy(engine, prompt=prompt)
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        got = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["text"] == want["text"]  # cumulative, as SGLang streams it
        assert all(want["text"].startswith(c["text"]) for c in chunks)
    ids = httpx.post(f"{server.url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0}}, timeout=60).json()
    assert ids["output_ids"] == greedy(engine, 5, input_ids=[5, 6, 7])["output_ids"]


def test_a_native_batch_answers_each_request_in_order(server, engine):
    """SGLang's batch form of /generate: a list of texts (or of token-id lists) gives a
    list of results; streamed, each event carries its request's index."""
    want = [greedy(engine, prompt=p) for p in PROMPTS]
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    got = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True, "rid": list("abcd")},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    last = {}
    for e in map(json.loads, events[:-1]):
        last[e["index"]] = e
    assert [last[i]["text"] for i in range(4)] == [w["text"] for w in want]  # cumulative, per request
    assert [last[i]["meta_info"]["id"] for i in range(4)] == list("abcd")
    ids = httpx.post(f"{server.url}/generate", timeout=60, json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [
        {"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}]}).json()
    assert [len(r["output_ids"]) for r in ids] == [3, 5]
    assert ids[1]["output_ids"] == greedy(engine, 5, input_ids=[8, 9])["output_ids"]


def test_openai_client_completions_and_chat_equal_the_offline_engine(server, engine):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    (model,) = [m.id for m in client.models.list().data]
    assert model == "tiny-random"
    for prompt in PROMPTS:
        want = greedy(engine, prompt=prompt)
        got = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want["text"] and got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want["text"]
        messages = [{"role": "user", "content": prompt}]
        want = greedy(engine, messages=messages)
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == want["text"] and chat.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        parts = list(stream)
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == want["text"]
        assert parts[-1].usage.completion_tokens == 12
    many = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, n=3,
                                     stop=["zz"], seed=1)
    assert [c.index for c in many.choices] == [0, 1, 2] and len({c.text for c in many.choices}) == 1


def test_64_concurrent_streams_all_complete_with_the_right_tokens(server, engine):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    want = {p: greedy(engine, 16, prompt=p)["text"] for p in prompts}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

    def run(prompt: str) -> str:
        stream = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=16, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in stream)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        got = dict(zip(prompts, pool.map(run, prompts)))
    assert got == want
    assert server.state()["num_running_reqs"] == 0


def test_logprobs_in_sglang_s_shapes_native_and_openai(server, engine):
    """SGLang's fields and shapes; the values are the offline engine's, bit for bit."""
    ids, k = [5, 6, 7, 8, 9, 10, 11, 12], 3
    lp = {"return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": k, "token_ids_logprob": [1, 2],
          "return_text_in_logprobs": True}
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **lp}
    got = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    want = engine.generate(input_ids=ids, sampling_params=body["sampling_params"], **lp)
    meta = got["meta_info"]
    assert json.loads(json.dumps(want["meta_info"]))["output_token_logprobs"] == meta["output_token_logprobs"]
    assert len(meta["input_token_logprobs"]) == len(ids) - 2 and meta["input_token_logprobs"][0] == [None, 7, "%"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[2:]
    assert meta["input_top_logprobs"][0] is None and all(len(p) == k for p in meta["input_top_logprobs"][1:])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == got["output_ids"]
    assert "".join(text for _, _, text in meta["output_token_logprobs"]) == got["text"]
    assert all(top[0] == tok for top, tok in zip(meta["output_top_logprobs"], meta["output_token_logprobs"]))
    assert all([t for _, t, _ in p] == [1, 2] for p in meta["output_token_ids_logprobs"])
    with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]  # cumulative
    plain = httpx.post(f"{server.url}/generate", json={"input_ids": ids, "return_logprob": False,  # SGLang's defaults
                                                      "top_logprobs_num": 0, "logprob_start_len": 0,
                                                      "return_text_in_logprobs": False,
                                                      "sampling_params": {"n": 1, "max_new_tokens": 2}}, timeout=60)
    assert plain.status_code == 200 and "input_token_logprobs" not in plain.json()["meta_info"]

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    chat = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)
    offline = engine.generate(messages=[{"role": "user", "content": "Hello"}], return_logprob=True,
                              sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert [c.logprob for c in content] == [v for v, _, _ in offline["meta_info"]["output_token_logprobs"]]
    echo = client.completions.create(model="tiny-random", prompt="1 2 3 4", max_tokens=3, temperature=0,
                                     logprobs=2, echo=True)
    choice = echo.choices[0]
    assert choice.text.startswith("1 2 3 4") and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    chunks = list(client.completions.create(model="tiny-random", prompt="1 2 3 4", max_tokens=3, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    two = client.completions.create(model="tiny-random", prompt=["1 2 3 4", "1 2 3 4"], max_tokens=2)
    assert two.usage.prompt_tokens == 2 * echo.usage.prompt_tokens  # SGLang sums the prompts


def test_sglang_s_fields_and_length_errors(server):
    """The fields SGLang's clients read (reasoning_content, matched_stop, max_model_len),
    logit_bias and min_tokens applied, and SGLang's 400 for a max_tokens that cannot fit."""
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == 2048 and card["parent"] is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    got = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    assert got["message"]["reasoning_content"] is None and got["message"]["tool_calls"] is None
    assert got["finish_reason"] == "length" and got["matched_stop"] is None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat | {"stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("reasoning_content" in e["choices"][0]["delta"] for e in events)
    biased = httpx.post(f"{server.url}/v1/completions", json={"prompt": "1 2 3", "max_tokens": 4, "temperature": 0,
                                                              "logit_bias": {"9": 100}}, timeout=60).json()
    ids = httpx.post(f"{server.url}/generate", json={"text": "1 2 3", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "logit_bias": {"9": 100}}}, timeout=60).json()["output_ids"]
    assert ids == [9, 9, 9, 9] and biased["choices"][0]["text"] == httpx.post(
        f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["text"]
    stopped = httpx.post(f"{server.url}/v1/completions", json={"prompt": "1 2 3", "max_tokens": 8, "temperature": 0,
                                                               "stop_token_ids": [9], "logit_bias": {"9": 100},
                                                               "min_tokens": 3}, timeout=60).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["matched_stop"] == 9
    too_long = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5] * 1500, "max_tokens": 600}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 2048 tokens. You requested a total of "
        "2100 tokens: 1500 tokens from the input messages and 600 tokens for the completion.")
    unlimited = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "max_tokens": None}, timeout=60)
    assert unlimited.status_code == 200  # no max_tokens: runs to what the context leaves


def test_skip_tokenizer_init_answers_ids_without_a_text_key():
    """As SGLang's: a server without a tokenizer answers /generate with output_ids and
    meta_info, no "text" (streamed or not), and refuses a grammar (it needs the vocabulary)."""
    s = Server("--skip-tokenizer-init")
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        out = httpx.post(f"{s.url}/generate", json=body, timeout=60).json()
        assert set(out) == {"output_ids", "meta_info"} and len(out["output_ids"]) == 3
        with httpx.stream("POST", f"{s.url}/generate", json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events and all("text" not in e for e in events) and events[-1]["output_ids"] == out["output_ids"]
        r = httpx.post(f"{s.url}/generate", timeout=60, json={**body, "sampling_params": {"regex": "a+"}})
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.text
    finally:
        s.stop()


def test_timeouts_answer_503_as_sglang():
    """SGLANG_REQ_RUNNING_TIMEOUT honored; a timed-out request is SGLang's 503 error, and
    a stream ends with an error event typed SERVICE_UNAVAILABLE."""
    s = Server(env={"SGLANG_REQ_RUNNING_TIMEOUT": "0.001"})
    try:
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        r = httpx.post(f"{s.url}/generate", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["code"] == 503 and r.json()["message"].startswith("Request running timeout reached.")
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 200, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 503 and r.json()["object"] == "error"
        with httpx.stream("POST", f"{s.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 200,
                                                                    "ignore_eos": True, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == 503 and error["type"] == "SERVICE_UNAVAILABLE"
    finally:
        rc, err = s.stop()
    assert rc == 0, err


def test_a_client_that_disconnects_frees_its_kv_at_once(server):
    before = server.metrics()
    body = {"input_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the client goes away (2000 tokens would take seconds)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = server.state()
        if state["num_running_reqs"] == 0 and state["num_used_tokens"] == 0:
            break
        time.sleep(0.05)
    assert state["num_running_reqs"] == 0 and state["num_used_tokens"] == 0, state
    after = server.metrics()
    key = "sglang:num_aborted_requests_total"
    assert after[key] == before.get(key, 0) + 1
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] < 2000


BAD = [
    ("/generate", b"not json", "the body is not JSON"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature must be"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ("/generate", {"text": ""}, "the prompt is empty"),
    ("/generate", {"input_ids": [10 ** 9]}, "outside the vocabulary"),
    ("/generate", {"text": "hi", "bogus": 1}, "unknown field(s): 'bogus'"),
    ("/generate", {"input_ids": [1] * 3000}, "at most 2042 fit"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens must be a positive integer, got -1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature must be >= 0"),
    ("/v1/completions", {"prompt": 5}, "prompt must be"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs must be an integer from 0 to 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": -1}, "top_logprobs must be an integer from 0 to 20"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1},
     "logprobs must be true or false"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2},
     "is higher than the number of input tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 17}}, "n must be 1 here"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, "schema_ is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "regex": "(["}, "invalid regex"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "unknown parameter 'frobnicate'"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "'role' and 'content'"),
    ("/abort_request", {}, "give {\"rid\""),
    ("/generate", {"text": []}, "a batch holds 1 to 1024 requests, got 0"),
    ("/generate", {"text": ["a", "b"], "rid": "x"}, "rid must be a list of 2 strings for a batch of 2"),
    ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, "the rids of a batch must differ"),
    ("/generate", {"text": ["a", ""]}, "request 1 of the batch: the prompt is empty"),
    ("/generate", {"input_ids": [[5], [6]], "sampling_params": [{}]}, "a list of 2, for a batch of 2"),
]


@pytest.mark.parametrize("route,body,message", BAD, ids=[f"{r} {m}" for r, _, m in BAD])
def test_bad_bodies_get_400_with_the_reason(server, route, body, message):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(f"{server.url}{route}", timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()
    if route.startswith("/v1/"):
        assert err["object"] == "error" and err["code"] == 400 and message in err["message"], err
    else:
        assert message in err["error"]["message"], err


@pytest.mark.parametrize("body, param, message", [
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be a positive integer, got -1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be a positive integer, got 0"),
    ({"min_tokens": -2}, "min_tokens", "min_tokens must be a non-negative integer, got -2"),
    ({"temperature": -1}, "temperature", "temperature must be >= 0, got -1"),
    ({"top_p": 2}, "top_p", "top_p must be in (0, 1], got 2"),
    ({"regex": "(["}, "regex", "invalid regex: "),
])
def test_an_openai_error_names_the_parameter_the_client_sent(server, body, param, message):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and r.json()["param"] == param and r.json()["message"].startswith(message), r.text


def test_native_routes(server):
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    assert httpx.get(f"{server.url}/get_model_info").json()["model_path"] == "tiny-random"
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert info["model_path"] == "tiny-random" and info["max_total_num_tokens"] > 0
    assert httpx.get(f"{server.url}/v1/models/nope").status_code == 404
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    state = server.state()
    assert state["evictable_tokens"] == 0 and state["available_tokens"] == state["max_total_num_tokens"]
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "no-such-request"}).status_code == 200
    titles = set()
    for pid in children_of(server.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            titles.add(f.read().split(b"\0")[0].decode())
    assert {"sglite::scheduler_TP0", "sglite::detokenizer"} <= titles, titles  # SGLang's, as ps shows them
    created = httpx.get(f"{server.url}/v1/models").json()["data"][0]["created"]
    assert server.started <= created <= server.ready  # the server's start


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(server):
    """As SGLang's: no max_tokens on a chat is no limit but the context (completions: 16)."""
    info = httpx.get(f"{server.url}/get_server_info").json()
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}).json()
    usage = r["usage"]
    assert r["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == info["max_req_input_len"] + 5 - usage["prompt_tokens"]
    short = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "ignore_eos": True}, timeout=60).json()
    assert short["usage"]["completion_tokens"] == 16


def test_explain_tells_a_served_request_s_history(server):
    r = httpx.post(f"{server.url}/generate", json={"text": PROMPTS[0], "rid": "why-1", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.get(f"{server.url}/explain", params={"rid": "why-1"}, timeout=30).text
    assert text.startswith("why-1\n  iteration ") and "arrived" in text and "radix cache:" in text
    assert "finished (length), 5 output tokens" in text
    missing = httpx.get(f"{server.url}/explain", params={"rid": "nope"}, timeout=30)
    assert missing.status_code == 404 and "no request 'nope'" in missing.json()["error"]["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 3}, timeout=60).json()
    text = httpx.get(f"{server.url}/explain", params={"rid": chat["id"]}, timeout=30).text  # the id it got back
    assert text.startswith(f"(the OpenAI id {chat['id']}: its first choice ran as {chat['id']}-0-0")
    assert "finished (length), 3 output tokens" in text


def test_metrics_parse_and_count_what_was_served(server):
    before = server.metrics()
    total = 0
    for prompt in PROMPTS:
        r = httpx.post(f"{server.url}/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 7, "temperature": 0}}, timeout=60).json()
        total += r["meta_info"]["completion_tokens"]
    after = server.metrics()
    labels_ok = 'model_name="tiny-random"' in httpx.get(f"{server.url}/metrics").text
    assert labels_ok and total == 28
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == len(PROMPTS)
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == total
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:gen_throughput", "sglang:num_retracted_reqs", "sglang:max_total_num_tokens",
                 "sglang:time_to_first_token_seconds_count", "sglang:e2e_request_latency_seconds_count",
                 "sglang:inter_token_latency_seconds_count", "sglang:prompt_tokens_total"):
        assert name in after, name
    # a histogram's _count: how many requests it observed (one per request), not a time
    assert after["sglang:e2e_request_latency_seconds_count"] - before["sglang:e2e_request_latency_seconds_count"] == len(PROMPTS)
    for name in ("sglang:queue_time_seconds_count", "sglang:num_retractions_count"):
        assert after[name] - before.get(name, 0) == len(PROMPTS), name


def labeled(server: Server) -> dict[tuple[str, str], float]:
    """(sample name, its mode label or "") -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, s.labels.get("mode", "")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_metrics_have_sglang_s_families_and_labels_and_pass_promtool(server, engine):
    """realtime_tokens_total by mode (prompt rows computed, served from the cache, decoded),
    the retraction counters, SGLang's labels (the scheduler's with tp_rank and pp_rank,
    the tokenizer's without); `promtool check metrics` finds nothing but SGLang's colon."""
    before = labeled(server)
    prompt = engine.tokenizer.encode("Once upon a time there was")
    for _ in range(2):  # the second finds the prompt cached, all but its last token
        httpx.post(f"{server.url}/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}, timeout=60)
    after = labeled(server)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    mode = {m: delta[("sglang:realtime_tokens_total", m)] for m in ("prefill_compute", "prefill_cache", "decode")}
    assert mode == {"prefill_compute": len(prompt) + 1, "prefill_cache": len(prompt) - 1, "decode": 8}
    for name in ("sglang:num_retracted_requests_total", "sglang:num_retracted_input_tokens_total",
                 "sglang:num_retracted_output_tokens_total"):
        assert (name, "") in after, name
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="tiny-random",pp_rank="0",tp_rank="0"}' in text
    assert 'sglang:num_requests_total{engine_type="unified",model_name="tiny-random"}' in text
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (.ci/run installs Debian's prometheus)")
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    findings = [line for line in (lint.stdout + lint.stderr).splitlines() if line.strip()]
    # the one finding promtool has is SGLang's own naming: "sglang:" (a colon, which
    # Prometheus' convention keeps for recording rules) starts every family
    assert findings and all(f.endswith("metric names should not contain ':'") for f in findings), findings


def test_a_model_that_fails_to_load_is_one_line_and_no_server(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf")
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "serve", "--model-path", str(bad), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_traceparent_header_makes_one_trace_across_the_processes():
    """A client's W3C traceparent: the server's span for the HTTP request is its child,
    and the request's spans in the scheduler process are children of that, all in the
    client's trace, at a real OTLP receiver."""
    from http.server import ThreadingHTTPServer
    import threading

    from tests.tracing.test_otlp import Receiver

    Receiver.requests = []
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        server = Server("--otlp-traces-endpoint", f"127.0.0.1:{receiver.server_address[1]}",
                        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        r = httpx.post(f"{server.url}/generate", headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                       json={"text": "Hello", "rid": "traced", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 200
        rc, err = server.stop()  # flushes both processes' spans
        assert rc == 0, err
    finally:
        receiver.shutdown()
    spans = {}
    for req in Receiver.requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans[span.name] = span
    http, root = spans["POST /generate"], spans["req traced"]
    assert http.trace_id.hex() == trace_id and http.parent_span_id.hex() == client_span
    assert root.trace_id.hex() == trace_id and root.parent_span_id == http.span_id
    assert spans["waiting"].trace_id.hex() == trace_id and spans["waiting"].parent_span_id == root.span_id


@pytest.mark.parametrize("backend", ["sglite", "openai", "openai-chat"])
def test_bench_serving_loads_every_backend_and_counts_the_tokens(server, backend):
    import asyncio

    from benchmarks.bench_serving import Request, report, run_load, summarize

    reqs = [Request(prompt=[3 + i, 4, 5, 6], output_len=8 + i, prompt_len=4) for i in range(6)]
    if backend == "openai-chat":
        reqs = [Request(messages=[{"role": "user", "content": p}], output_len=5) for p in PROMPTS]
    results, duration = asyncio.run(run_load(server.url, backend, reqs, "tiny-random", float("inf"), 3))
    summary = summarize(results, duration)
    assert summary["failed_requests"] == 0 and summary["successful_requests"] == len(reqs)
    assert [r.output_len for r in results] == [r.output_len for r in reqs]  # ignore_eos: exactly the length
    assert all(r.ttft > 0 and r.e2e >= r.ttft and len(r.itl) >= 1 for r in results)
    assert "Serving Benchmark Result" in report(summary, backend)


def test_a_served_recording_reruns_offline_event_for_event(tmp_path):
    """A server's --record holds what an offline rerun needs (docs/why.md): the same
    batches, events (TokensEmitted and its text included) and tokens, under retraction
    and chunking, with requests arriving over many iterations."""
    from sglite import events as ev
    from sglite.replay import first_difference, load, rerun, summarize

    path = tmp_path / "served.jsonl"
    new_tokens = 40
    srv = Server("--record", str(path), "--max-total-tokens", "300", "--chunked-prefill-size", "32",
                 "--schedule-conservativeness", "0.05")
    try:
        def params(i: int) -> dict:
            return {"max_new_tokens": new_tokens, "temperature": 0.0 if i % 2 else 0.7, "ignore_eos": True}

        def text(i: int) -> str:
            return f"{PROMPTS[i % 4]} " * (1 + i % 5) + str(i)

        def run(ids: list[int]) -> list[str]:
            # 12 requests of 6-49 prompt tokens + 40 new ones: about 2.4x the 300-token pool.
            # Requests 0-5 come as one batch, so that at least six run at once and some are
            # retracted however the other six's arrivals spread over the iterations.
            body = ({"text": [text(i) for i in ids], "sampling_params": [params(i) for i in ids]} if len(ids) > 1
                    else {"text": text(ids[0]), "sampling_params": params(ids[0])})
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            return [o["text"] for o in out] if len(ids) > 1 else [out["text"]]

        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            served = [t for texts in pool.map(run, [list(range(6))] + [[i] for i in range(6, 12)]) for t in texts]
    finally:
        srv.stop()
    rec = load(str(path))
    assert len(rec.arrivals) > 1 and any(isinstance(e, ev.ReqRetracted) for e in rec.events)
    again = rerun(rec)
    assert first_difference(rec.events, again) is None
    # (the server's health probes ran too: one token each, kept apart here)
    texts = {e.rid: "" for e in again if isinstance(e, ev.ReqArrived) and not e.rid.startswith("HEALTH_CHECK_")}
    for e in again:
        if isinstance(e, ev.TokensEmitted) and e.rid in texts:
            texts[e.rid] += e.text
    assert sorted(texts.values()) == sorted(served)
    assert all(len(r.output) == new_tokens for rid, r in summarize(again).items() if rid in texts)


def test_tp2_serves_the_offline_engine_s_tokens_and_stops_when_a_rank_dies(engine):
    """`sglite serve --tp-size 2`: rank 1 is a process of its own beside the scheduler
    (rank 0); the answers are tp 1's; killing rank 1 stops the whole server with a line
    that names it, and leaves no process behind."""
    s = Server("--tp-size", "2")
    kids = children_of(s.proc.pid)
    names = {open(f"/proc/{k}/cmdline").read().split("\0")[0] for k in kids}
    assert {"sglite::scheduler_TP0", "sglite::tp_worker_TP1"} <= names, names
    for prompt in PROMPTS:
        got = httpx.post(f"{s.url}/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 12, "temperature": 0}}, timeout=60).json()
        assert got["output_ids"] == greedy(engine, prompt=prompt)["output_ids"]
    rank1 = next(k for k in kids if open(f"/proc/{k}/cmdline").read().startswith("sglite::tp_worker_TP1"))
    os.kill(rank1, signal.SIGKILL)
    err = s.wait()
    assert s.proc.returncode == 1 and "sglite::tp_worker_TP1 exited (exit code -9)" in err, err
    assert "(float32, tp 2, pool" in err and "Traceback" not in err, err
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{k}") and "Z" not in _proc_state(k) for k in kids):
        time.sleep(0.1)
    assert not [k for k in kids if os.path.exists(f"/proc/{k}") and "Z" not in _proc_state(k)]


def test_two_nodes_on_one_machine_serve_tp2_over_gloo(engine):
    """--nnodes 2: node 1 runs rank 1 only (no HTTP), node 0 serves; over gloo (shared
    memory is for one machine's ranks); node 0's stop stops node 1's rank, which exits 0."""
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen([sys.executable, "-m", "sglite.cli", "serve", "--model-path", "tiny-random", "--tp-size",
                              "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        s = Server("--tp-size", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr)
        got = httpx.post(f"{s.url}/generate", json={"text": PROMPTS[1], "sampling_params": {
            "max_new_tokens": 12, "temperature": 0}}, timeout=60).json()
        assert got["output_ids"] == greedy(engine, prompt=PROMPTS[1])["output_ids"]
        s.stop()
        _, err = node1.communicate(timeout=60)
        assert "node 1 runs tp ranks 1..1" in err and "node 1: rank 0 stopped the ranks" in err, err
        assert node1.returncode == 0, err
        assert "Traceback" not in err, err
    finally:
        if node1.poll() is None:
            node1.kill()


def test_stopping_the_server_answers_the_requests_in_flight():
    """SIGTERM with requests in flight, one running at a time: a short one finishes as
    it would; the long ones (14 of 2000 tokens, several seconds each here), running or queued
    when the grace period ends, come back as aborted with their tokens so far (native
    and streamed OpenAI), and no handler is cancelled into a traceback (as uvicorn did
    5 s after the signal)."""
    s = Server("--max-running-requests", "1")
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}

    def native(text: str, params: dict) -> dict:
        return httpx.post(f"{s.url}/generate", json={"text": text, "sampling_params": params}, timeout=60).json()

    def streamed() -> list[str]:
        with httpx.stream("POST", f"{s.url}/v1/completions", json={"model": "m", "prompt": "c", "max_tokens": 2000,
                                                                    "stream": True}, timeout=60) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = []
        for fn, *args in ((native, "b", {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}),
                          (native, "a", long), (streamed,), *[(native, f"d{i}", long) for i in range(12)]):
            futures.append(pool.submit(fn, *args))
            time.sleep(0.1)  # (in this order)
        time.sleep(0.5)
        rc, err = s.stop()
        results = [f.result() for f in futures]
    assert rc == 0 and "Traceback" not in err and "CancelledError" not in err, err
    assert results[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert results[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "the server is shutting down"}
    assert results[-1]["meta_info"]["completion_tokens"] == len(results[-1]["output_ids"]) < 2000
    assert all(r["meta_info"]["finish_reason"]["type"] in ("length", "abort") for r in results[1:2] + results[3:])
    lines = results[2]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("abort", "length")


def test_requests_in_flight_when_the_scheduler_dies_are_answered():
    """The scheduler process killed mid-request: the watchdog stops the server, and the
    waiting request is answered as aborted (nobody is left to abort it but the HTTP
    side) rather than cancelled into a traceback."""
    s = Server()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: httpx.post(f"{s.url}/generate", json={"text": "a", "sampling_params": {
            "max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}, timeout=60).json())
        time.sleep(0.5)
        scheduler = next(k for k in children_of(s.proc.pid)
                         if open(f"/proc/{k}/cmdline").read().startswith("sglite::scheduler"))
        os.kill(scheduler, signal.SIGKILL)
        err = s.wait()
        got = future.result()
    assert s.proc.returncode == 1 and "sglite::scheduler exited (exit code -9)" in err, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert got["meta_info"]["finish_reason"] == {"type": "abort", "message": "the server is shutting down"}


def test_tokenize_and_detokenize_round_trip(server, engine):
    for route in ("/tokenize", "/v1/tokenize"):
        one = httpx.post(f"{server.url}{route}", json={"prompt": "Hello world"}, timeout=30).json()
        assert one["tokens"] == engine.tokenizer.encode("Hello world") and one["count"] == len(one["tokens"])
        assert one["max_model_len"] == 2048
    two = httpx.post(f"{server.url}/tokenize", json={"prompt": ["a b", "c"]}, timeout=30).json()
    assert two["count"] == [len(t) for t in two["tokens"]]
    back = httpx.post(f"{server.url}/v1/detokenize", json={"tokens": two["tokens"]}, timeout=30).json()
    assert back["text"] == ["a b", "c"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1.5]}, timeout=30)
    assert bad.status_code == 400 and "'tokens' must be a list of integers" in bad.json()["error"]["message"]


def test_generate_with_n_gives_sglang_s_order(server):
    """n samples of each prompt, batch outer and sample inner (a0, a1, b0, b1), as a
    list; streamed, each event's index is its place in that order."""
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 2}
    sampled = {**params, "n": 4, "max_new_tokens": 12, "temperature": 1.5}
    one = httpx.post(f"{server.url}/generate", json={"text": "Hello", "sampling_params": sampled}, timeout=60).json()
    assert isinstance(one, list) and len(one) == 4 and len({r["meta_info"]["id"] for r in one}) == 4
    assert len({tuple(r["output_ids"]) for r in one}) > 1  # each its own seed
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {**params, "temperature": 0}}
    both = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert [r["meta_info"]["prompt_tokens"] for r in both] == [3, 3, 2, 2]
    assert both[0]["output_ids"] == both[1]["output_ids"] != both[2]["output_ids"]  # greedy: a0 == a1
    with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = {e["index"]: e["output_ids"] for e in events}
    assert [last[i] for i in range(4)] == [r["output_ids"] for r in both]


def test_continue_final_message_continues_the_assistant_s_text(server, engine):
    """SGLang's continue_final_message: the prompt is the chat before the last (assistant)
    message with the generation prompt, then that message's text as it is."""
    chat = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1 2 3"}]
    prompt = engine.tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True) + "1 2 3"
    want = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0})
    body = {"model": "m", "messages": chat, "max_tokens": 4, "temperature": 0, "continue_final_message": True}
    got = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert got["choices"][0]["message"]["content"] == want["text"]
    assert got["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt))


def test_score_gives_the_label_tokens_probabilities_after_query_and_item(server, engine):
    """SGLang's /v1/score: per item, exp(logprob) of each label token as the next token
    after query + item (or, with apply_softmax, renormalized over the labels)."""
    labels = [5, 9, 12]
    body = {"query": [5, 6, 7], "items": [[8], [9, 10]], "label_token_ids": labels}
    got = httpx.post(f"{server.url}/v1/score", json=body, timeout=60).json()
    assert got["object"] == "scoring" and len(got["scores"]) == 2
    for item, row in zip(body["items"], got["scores"]):
        ref = engine.generate(input_ids=[5, 6, 7] + item, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, token_ids_logprob=labels)["meta_info"]["output_token_ids_logprobs"][0]
        assert row == pytest.approx([math.exp(v) for v, _, _ in ref], rel=1e-6)
    soft = httpx.post(f"{server.url}/v1/score", json=body | {"apply_softmax": True}, timeout=60).json()["scores"]
    assert all(sum(row) == pytest.approx(1.0) for row in soft)
    texts = httpx.post(f"{server.url}/v1/score", json={"query": "1 2", "items": [" 3", " 4"], "item_first": True,
                                                       "label_token_ids": labels}, timeout=60).json()["scores"]
    assert len(texts) == 2 and texts[0] != texts[1]
    bad = httpx.post(f"{server.url}/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [10 ** 6]},
                     timeout=30)
    assert bad.status_code == 400 and "Token ID 1000000 is out of vocabulary" in bad.json()["message"]


def test_logs_are_sglang_s_at_info_by_default(server):
    """SGLang's default level: uvicorn's start, the ready line, Prefill batch / Decode
    batch lines, an abort (the module's server logs at info: its stderr so far)."""
    rid = "to-abort"
    with httpx.stream("POST", f"{server.url}/generate", json={"text": "Hi", "rid": rid, "stream": True,
                                                              "sampling_params": {"max_new_tokens": 500,
                                                                                  "ignore_eos": True}},
                      timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        httpx.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=30)
        list(lines)
    deadline = time.monotonic() + 10
    while "Abort running request. rid=to-abort" not in server.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    err = server.stderr()
    for line in ("Uvicorn running on", "The server is fired up and ready to roll!", "Prefill batch. #new-seq:",
                 "Decode batch. #running-req:", "Abort running request. rid=to-abort"):
        assert line in err, (line, err[-3000:])


def test_responses_api_for_plain_text_with_the_openai_client(server, engine):
    """/v1/responses: the openai client's responses.create, non-streamed and streamed
    (SGLang's event order), equal to the same chat through the engine."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = engine.generate(messages=chat, sampling_params={"max_new_tokens": 5, "temperature": 0})
    got = client.responses.create(model="m", instructions="Be brief.", input="Hello", max_output_tokens=5,
                                  temperature=0, store=False)
    assert got.output_text == want["text"] and got.status == "incomplete"
    assert got.incomplete_details.reason == "max_output_tokens" and got.usage.output_tokens == 5
    events = list(client.responses.create(model="m", instructions="Be brief.", max_output_tokens=5, temperature=0,
                                          input=[{"role": "user", "content": [{"type": "input_text",
                                                                               "text": "Hello"}]}],
                                          stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want["text"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    bad = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"}, timeout=30)
    assert bad.status_code == 400 and "previous_response_id is not supported" in bad.json()["message"]


def test_incremental_streaming_output_sends_only_what_is_new():
    """--incremental-streaming-output (SGLang's --stream-output): each event's text,
    output_ids and output logprobs are new ones; joined, they are the whole answer."""
    s = Server("--stream-output")
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                "return_logprob": True, "stream": True}
        whole = httpx.post(f"{s.url}/generate", json=body | {"stream": False}, timeout=60).json()
        with httpx.stream("POST", f"{s.url}/generate", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert len(events) > 1 and "".join(e["text"] for e in events) == whole["text"]
        assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
        joined = [x for e in events for x in e["meta_info"]["output_token_logprobs"]]
        assert joined == whole["meta_info"]["output_token_logprobs"]
    finally:
        rc, err = s.stop()
    assert rc == 0, err


def test_a_busy_port_is_one_line_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "sglite.cli", "serve", "--model-path", "tiny-random", "--port",
                               str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"error: cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "loading tiny-random" not in proc.stderr and "Traceback" not in proc.stderr  # nothing loaded first


def test_ctrl_c_stops_the_server_without_a_traceback():
    """Ctrl-C in a terminal signals the whole process group: every process of the
    server gets SIGINT; the server stops them all and exits 0, with no traceback, also
    with a stream in flight."""
    log = tempfile.TemporaryFile(mode="w+")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglite.cli", "serve", "--model-path", "tiny-random", "--port",
                             str(port), "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        os.killpg(proc.pid, signal.SIGINT)
        list(lines)
    proc.wait(timeout=60)
    log.seek(0)
    out = log.read()
    assert proc.returncode == 0 and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
