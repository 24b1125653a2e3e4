"""Constrained output through `sglite serve` (SmolLM2): OpenAI's response_format from the
official client (a pydantic model, json_schema with strict, json_object), SGLang's
sampling params on /generate, bad grammars as 400s before anything runs, and the
grammar queue's gauge on /metrics."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.test_http_server import Server

pytestmark = pytest.mark.real_model


class City(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def server():
    s = Server("--model-path", "smollm2-135m", "--enable-metrics")
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Return a JSON object with the keys city and country for Paris."}]


def test_the_openai_clients_parse_gets_its_pydantic_model(server):
    done = client(server).chat.completions.parse(model="x", messages=ASK, response_format=City, temperature=0)
    assert done.choices[0].message.parsed == City(city="Paris", country="France")
    assert done.choices[0].finish_reason == "stop"


def test_json_schema_and_json_object_on_chat_and_completions(server):
    c = client(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "digit", "schema": schema, "strict": True}}
    chat = c.chat.completions.create(model="x", temperature=0, response_format=fmt, max_tokens=40,
                                     messages=[{"role": "user", "content": "Pick a digit."}])
    assert 1 <= json.loads(chat.choices[0].message.content)["n"] <= 9
    done = c.completions.create(model="x", prompt="A JSON object about Paris:", temperature=0, max_tokens=60,
                                extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text), dict)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="x", temperature=0, response_format=fmt, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": "Pick a digit."}]))
    assert streamed == chat.choices[0].message.content


def test_generate_takes_sglangs_grammar_params(server):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    out = httpx.post(f"{server.url}/generate", timeout=120, json={
        "text": ["The White House phone number is ", "Answer yes or no: is the sky blue? "],
        "sampling_params": [{"temperature": 0, "max_new_tokens": 30, "regex": phone},
                            {"temperature": 0, "max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"'}]}).json()
    assert re.fullmatch(phone, out[0]["text"]) and out[1]["text"] in ("yes", "no")
    again = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": ASK, "temperature": 0, "max_tokens": 20, "regex": "(Paris|London)"}).json()
    assert again["choices"][0]["message"]["content"] in ("Paris", "London")


@pytest.mark.parametrize("route, body, message", [
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": 5}'}}, "invalid json_schema: "),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(["}}, "invalid regex: Regex parsing error"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= x"}}, "invalid ebnf: "),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "Only one of regex"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema"}},
     "schema_ is required for json_schema response format request."),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, "invalid json_schema: "),
])
def test_a_bad_grammar_is_a_400_naming_it(server, route, body, message):
    r = httpx.post(f"{server.url}{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    text = r.json().get("message") or r.json().get("error", {}).get("message", "")
    assert message in text, text


def test_metrics_has_the_grammar_queue_gauge(server):
    assert server.metrics()["sglang:num_grammar_queue_reqs"] == 0
