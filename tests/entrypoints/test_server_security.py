"""The attacks on a real `sglite serve` (three processes, tiny-random), as tests: a reader
without the key sees nothing, no route shows one client's prompt to another, health
fails within its bound when the scheduler is stopped, a bad stop string leaves the cache
alone, a huge body is refused without tokenizing, racing rids never hang. The exact
HTTP decisions are tests/entrypoints/test_http_security.py's."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.entrypoints.test_http_server import Server, children_of
from tui.remote import RemoteConnection

KEY = "k-" + "7" * 30
SECRET = "My card number is 4111 1111 1111 1111 and my PIN is 2468"
GET_ROUTES = ["/health", "/health_generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info",
              "/v1/models", "/v1/models/tiny-random", "/metrics", "/explain?rid=x", "/openapi.json"]


@pytest.fixture(scope="module")
def server():
    """A server with the defaults, shared by the tests that need no flag of their own."""
    s = Server()
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def _secret_in_flight(url: str, headers: dict[str, str]) -> tuple[httpx.Response, str]:
    """Start a long streamed request with the secret prompt; its open response and rid."""
    client = httpx.Client(headers=headers, timeout=60)
    body = {"text": SECRET, "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    r = client.send(client.build_request("POST", f"{url}/generate", json=body), stream=True)
    assert r.status_code == 200
    first = next(line for line in r.iter_lines() if line.startswith("data: "))
    return r, json.loads(first[6:])["meta_info"]["id"]


def test_with_an_api_key_a_client_without_it_reads_nothing():
    server = Server("--enable-debug-events", "--enable-metrics", env={"SGLITE_API_KEY": KEY})
    try:
        stream, _ = _secret_in_flight(server.url, {"Authorization": f"Bearer {KEY}"})
        for route in GET_ROUTES + ["/debug/events"]:
            r = httpx.get(f"{server.url}{route}", timeout=60)
            assert SECRET[:20] not in r.text and "4111" not in r.text, route
            if not route.startswith(("/health", "/metrics")):
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, route
        stream.close()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        got = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=4, temperature=0)
        assert got.usage.completion_tokens == 4
        with pytest.raises(RuntimeError, match="needs an API key: pass the server's with --api-key"):
            RemoteConnection(server.url).wait_ready()
        attached = RemoteConnection(server.url, KEY)
        assert attached.wait_ready()["model"] == "tiny-random"  # the TUI attaches with the key
        attached.close()
    finally:
        rc, err = server.stop()
    assert rc == 0 and KEY not in err


def test_the_help_never_prints_the_key_from_the_environment():
    out = subprocess.run([sys.executable, "-m", "sglite.cli", "serve", "--help"], capture_output=True, text=True,
                         env={**os.environ, "SGLITE_API_KEY": KEY}, timeout=60)
    assert out.returncode == 0 and KEY not in out.stdout and "--api-key" in out.stdout


def test_without_debug_events_no_route_shows_one_clients_prompt_to_another(server):
    stream, rid = _secret_in_flight(server.url, {})
    try:
        for route in GET_ROUTES + ["/debug/events", f"/explain?rid={rid}"]:
            r = httpx.get(f"{server.url}{route}", timeout=60)
            assert SECRET[:20] not in r.text and "4111" not in r.text, route
        assert httpx.get(f"{server.url}/debug/events", timeout=60).status_code == 403
    finally:
        stream.close()


def test_a_stopped_scheduler_makes_health_fail_within_its_bound():
    server = Server(env={"SGLANG_HEALTH_CHECK_TIMEOUT": "3"})
    scheduler = next(p for p in children_of(server.proc.pid) if _title(p) == "sglite::scheduler_TP0")
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        os.kill(scheduler, signal.SIGSTOP)
        for route in ("/health", "/health_generate"):
            tic = time.monotonic()
            assert httpx.get(f"{server.url}{route}", timeout=60).status_code == 503
            assert time.monotonic() - tic < 3 + 5  # the bound (3 s) and some slack: never a hang
        os.kill(scheduler, signal.SIGCONT)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    finally:
        os.kill(scheduler, signal.SIGCONT)
        rc, err = server.stop()
    assert rc == 0, err


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def test_a_surrogate_stop_string_is_a_400_and_the_cache_keeps_its_tokens(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    def cached() -> int:
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        return r.json()["meta_info"]["cached_tokens"]

    cached()
    before = cached()
    assert before > 100
    bad = json.dumps({"text": "hi", "sampling_params": {"stop": ["\ud800"], "max_new_tokens": 4}})
    r = httpx.post(f"{server.url}/generate", content=bad, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "stop is not valid UTF-8" in r.json()["error"]["message"]
    assert cached() == before


def test_a_25_mb_prompt_is_refused_before_it_is_tokenized_and_others_are_served(server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=120,
                          json={"model": "tiny-random", "prompt": "word " * 5_000_000, "max_tokens": 1})
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        r = big.result()
    assert r.status_code == 400 and "characters, more than the" in r.json()["message"]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"model": "tiny-random", "prompt": "Hi",
                                                                      "max_tokens": 2})
    assert r.status_code == 200


def test_racing_rids_never_hang_and_one_of_a_pair_is_told_it_is_a_duplicate(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}

    def post(rid: str) -> httpx.Response:
        return httpx.post(f"{server.url}/generate", json=body | {"rid": rid}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for i in range(50):
            answers = list(pool.map(post, [f"r{i}", f"r{i}"]))
            codes = sorted(a.status_code for a in answers)
            assert codes in ([200, 200], [200, 400]), [a.text for a in answers]
            if codes == [200, 400]:
                assert "Duplicate request ID" in answers[[a.status_code for a in answers].index(400)].text
    assert server.state()["num_running_reqs"] == 0


def test_clients_with_different_cache_salts_cannot_probe_each_others_prefixes(server):
    """The prefix-cache oracle: cached_tokens told one client how much of its prompt
    another had sent. With cache_salt (vLLM) / extra_key (SGLang) a client's prompts are
    cached, and reported, only within its own salt."""
    secret = "Alice's PIN is 4096. Alice's PIN is 4096. Alice's PIN is 4096. Alice's PIN is"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    def cached(**extra) -> int:
        got = client.completions.create(model="tiny-random", prompt=secret, max_tokens=1, temperature=0,
                                        extra_body=extra)
        return got.usage.prompt_tokens_details.cached_tokens

    def native(**extra) -> int:
        r = httpx.post(f"{server.url}/generate", timeout=60, json={"text": secret, **extra,
                                                                    "sampling_params": {"max_new_tokens": 1}})
        return r.json()["meta_info"]["cached_tokens"]

    assert cached(cache_salt="alice") == 0
    hit = cached(cache_salt="alice")
    assert hit > 20  # alice's own prompt is cached for alice
    assert cached(cache_salt="mallory") == 0  # another salt probes nothing
    assert cached() == 0 and native() == hit  # nor does a client without one (its own tree)
    assert native(extra_key="alice") == hit  # SGLang's name reaches alice's cache too
    assert native(cache_salt="al", extra_key="ice") == hit  # both given: joined, as SGLang does
