"""What the HTTP side of `sglite serve` refuses, and what it never lets one client do to
another (issue: a server you can point real traffic at). The server's own app, guard and
TokenizerManager run here over a stand-in scheduler (fake_scheduler.py), so each case
is an exact exchange; the real processes are tests/entrypoints/test_http_server.py's."""

from __future__ import annotations

import asyncio
import gc
import json
import os
from typing import Any, Awaitable, Callable

import pytest

from sglite.entrypoints.http_security import SecurityPolicy, parse_size
from sglite.entrypoints.http_server import ClaimedStream
from sglite.managers.tokenizer_manager import ReqSpec
from tests.entrypoints.fake_scheduler import InProcessServer

KEY = "s3cret-key"


def run(scenario: Callable[[InProcessServer], Awaitable[None]], policy: SecurityPolicy | None = None,
        **info: Any) -> None:
    async def main() -> None:
        async with InProcessServer(policy, **info) as server:
            await scenario(server)

    asyncio.run(main())


JSON = {"content-type": "application/json"}


async def post(client: Any, route: str, body: Any) -> Any:
    """POST ``body`` as ASCII JSON (a lone surrogate travels as its \\ud800 escape, as any
    JSON client may send it)."""
    return await client.post(route, content=json.dumps(body).encode(), headers=JSON)


# --- 1. the API key ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/get_server_info", "/get_model_info", "/explain?rid=x",
                                  "/debug/events"])
def test_every_route_but_health_needs_the_key(path):
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            r = await c.get(path)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # SGLang's answer
            assert r.headers["www-authenticate"] == "Bearer"
        async with server.client(authorization="Bearer wrong") as c:
            assert (await c.get(path)).status_code == 401
        async with server.client(authorization=f"Bearer {KEY}") as c:
            assert (await c.get(path)).status_code != 401
        async with server.client() as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/health_generate")).status_code == 200
            for route in ("/generate", "/v1/completions", "/v1/chat/completions", "/flush_cache", "/abort_request",
                          "/debug/control"):
                assert (await c.post(route, json={})).status_code == 401, route
        assert server.scheduler.generate_rids() == [r for r in server.scheduler.generate_rids()
                                                     if r.startswith("HEALTH_CHECK_")]  # nothing else ran

    run(scenario, SecurityPolicy(api_key=KEY))


def test_metrics_stay_open_unless_closed():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            assert (await c.get("/metrics")).status_code == 404  # open (metrics are off here: 404, not 401)

    run(scenario, SecurityPolicy(api_key=KEY))

    async def closed(server: InProcessServer) -> None:
        async with server.client() as c:
            assert (await c.get("/metrics")).status_code == 401

    run(closed, SecurityPolicy(api_key=KEY, metrics_require_api_key=True))


def test_debug_events_need_their_flag_even_with_the_key():
    async def scenario(server: InProcessServer) -> None:
        async with server.client(authorization=f"Bearer {KEY}") as c:
            r = await c.get("/debug/events")
            assert r.status_code == 403 and "--enable-debug-events" in r.json()["error"]["message"]

    run(scenario, SecurityPolicy(api_key=KEY))


# --- 2. cross-site requests ------------------------------------------------------------


def test_a_post_body_must_be_json():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
                headers = {"content-type": media} if media else {}
                r = await c.post("/generate", content=b'{"text": "hi"}', headers=headers)
                assert r.status_code == 400, media
                assert r.json() == {"error": {"message": "Unsupported Media Type: Only 'application/json' is allowed"}}
            r = await c.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
            assert r.status_code == 400 and r.json()["object"] == "error"
            r = await c.post("/generate", content=b'{"text": "hi"}', headers={"content-type": "application/json; "
                                                                                             "charset=utf-8"})
            assert r.status_code == 200
        assert len(server.scheduler.generate_rids()) == 1

    run(scenario)


@pytest.mark.parametrize("host,ok", [("127.0.0.1:30000", True), ("localhost:30000", True), ("[::1]:30000", True),
                                     ("10.1.2.3", True), ("app.localhost", True), ("evil.example", False),
                                     ("evil.example:30000", False), ("127.0.0.1.nip.io", False)])
def test_dns_rebinding_host_header(host, ok):
    async def scenario(server: InProcessServer) -> None:
        async with server.client(host=host) as c:
            r = await c.get("/v1/models")
            assert (r.status_code == 200) == ok, r.text
            if not ok:
                assert r.status_code == 400 and "--allowed-hosts" in r.json()["message"]

    run(scenario)


def test_allowed_hosts_names_a_host():
    async def scenario(server: InProcessServer) -> None:
        async with server.client(host="gpu-box.lan:30000") as c:
            assert (await c.get("/v1/models")).status_code == 200
        async with server.client(host="other.lan") as c:
            assert (await c.get("/v1/models")).status_code == 400

    run(scenario, SecurityPolicy(allowed_hosts=frozenset({"gpu-box.lan"})))


@pytest.mark.parametrize("origin,ok", [("http://localhost:3000", True), ("http://127.0.0.1:8080", True),
                                       ("https://evil.example", False), ("http://10.0.0.7", False), ("null", False)])
def test_a_web_page_of_another_site_cannot_drive_the_server(origin, ok):
    async def scenario(server: InProcessServer) -> None:
        async with server.client(origin=origin) as c:
            for r in (await c.post("/flush_cache"), await c.post("/abort_request", json={"abort_all": True})):
                assert (r.status_code == 200) == ok, r.text
                if not ok:
                    assert r.status_code == 403 and origin in r.json()["error"]["message"]

    run(scenario)


def test_state_changing_routes_never_answer_get():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            for route in ("/flush_cache", "/abort_request", "/generate", "/debug/control", "/v1/completions"):
                assert (await c.get(route)).status_code == 405, route
        assert not any(type(m).__name__ == "FlushCacheReqInput" for m in server.scheduler.received)

    run(scenario)


@pytest.mark.parametrize("route,body,message", [
    ("/abort_request", {"abort_all": "no"}, "abort_all must be true or false"),
    ("/abort_request", {"abort_all": 1}, "abort_all must be true or false"),
    ("/generate", {"text": "hi", "stream": "false"}, "stream must be true or false"),
    ("/v1/completions", {"prompt": "hi", "stream": "false"}, "stream must be true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": 0},
     "stream must be true or false"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": "x"}, "stream_options must be an object"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "include_usage must be true or false"),
    ("/v1/completions", {"prompt": [[[1]]]}, "input_ids must be integers"),
    ("/v1/completions", {"prompt": [1, "a"]}, "input_ids must be integers"),
    ("/generate", {"text": False, "input_ids": [[1, 2]]}, "give only one of"),
    ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": "false"}}, "ignore_eos must be true or false"),
])
def test_loose_types_are_refused_not_guessed(route, body, message):
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            r = await c.post(route, json=body)
            assert r.status_code == 400, r.text
            text = r.json()["message"] if route.startswith("/v1/") else r.json()["error"]["message"]
            assert message in text, text
        assert server.scheduler.received == []  # nothing reached the scheduler, nothing was aborted

    run(scenario)


# --- 3. bounded work per body ----------------------------------------------------------


def test_a_body_over_the_limit_is_413_whether_or_not_its_length_is_announced():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            body = json.dumps({"text": "x" * 2000}).encode()
            r = await c.post("/generate", content=body, headers=JSON)
            assert r.status_code == 413 and "--max-body-size" in r.json()["error"]["message"]

            async def chunks():  # no Content-Length: chunked transfer encoding
                for _ in range(4):
                    yield b" " * 600
                yield b'{"text": "hi"}'

            r = await c.post("/v1/completions", content=chunks(), headers=JSON)
            assert r.status_code == 413 and r.json()["code"] == 413
            r = await c.post("/generate", content=json.dumps({"text": "x" * 100}).encode(), headers=JSON)
            assert r.status_code == 200
        assert len(server.scheduler.generate_rids()) == 1

    run(scenario, SecurityPolicy(max_body_size=1024))


def test_one_body_makes_at_most_1024_requests():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            r = await c.post("/v1/completions", json={"prompt": ["a"] * 600, "n": 2, "max_tokens": 1})
            assert r.status_code == 400 and "at most 1024" in r.json()["message"]
            r = await c.post("/v1/completions", json={"prompt": ["a"] * 5000, "max_tokens": 1})
            assert r.status_code == 400
            r = await c.post("/generate", json={"text": ["a"] * 1025})
            assert r.status_code == 400 and "1 to 1024" in r.json()["error"]["message"]
        assert server.scheduler.received == []

    run(scenario)


@pytest.mark.parametrize("params,message", [
    ({"stop": ["x"] * 65}, "stop has 65 strings; at most 64"),
    ({"stop": "y" * 513}, "a stop string has 513 characters; at most 512"),
    ({"stop_token_ids": [1] * 4097}, "stop_token_ids has 4097 ids; at most 4096"),
    ({"stop": "\ud800"}, "stop is not valid UTF-8 text"),
    ({"top_p": 5e-324}, "top_p 5e-324 is too small"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty 5e-324 is too small"),
    ({"min_p": 1e-40}, "min_p 1e-40 is too small"),
])
def test_what_the_scheduler_would_choke_on_is_refused_at_the_gate(params, message):
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            r = await post(c, "/generate", {"text": "hi", "sampling_params": params})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
            oai = {"stop": "stop", "stop_token_ids": "stop_token_ids", "top_p": "top_p", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty"}
            r = await post(c, "/v1/completions", {"prompt": "hi", **{oai[k]: v for k, v in params.items()}})
            assert r.status_code == 400 and message in r.json()["message"], r.text
        assert server.scheduler.received == []

    run(scenario)


def test_strings_that_are_not_utf8_are_refused():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            cases = [("/generate", {"text": "hi \ud800"}, "the prompt is not valid UTF-8"),
                     ("/generate", {"text": "hi", "rid": "\udfff"}, "rid is not valid UTF-8"),
                     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
                      "a message's content is not valid UTF-8"),
                     ("/v1/completions", {"prompt": "hi", "cache_salt": "\ud800"}, "extra_key is not valid UTF-8")]
            for route, body, message in cases:
                r = await post(c, route, body)
                assert r.status_code == 400, r.text
                text = r.json()["message"] if route.startswith("/v1/") else r.json()["error"]["message"]
                assert message in text, text
            r = await c.post("/generate", content=b'{"text": "\xff\xfe bad bytes"}', headers=JSON)
            assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
            r = await post(c, "/generate", {"text": "hi \ud83d\ude00"})  # a real pair: one emoji
            assert r.status_code == 200
        assert len(server.scheduler.generate_rids()) == 1

    run(scenario)


def test_json_nested_5000_deep_is_a_400():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            r = await c.post("/generate", content=b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}", headers=JSON)
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]

    run(scenario)


def test_a_big_body_is_parsed_off_the_event_loop_with_the_same_answers():
    async def scenario(server: InProcessServer) -> None:
        big = 2 << 20  # over INLINE_JSON_BYTES: parsed in the worker process
        async with server.client() as c:
            r = await c.post("/generate", content=b'{"text": "' + b"a" * big + b'"', headers=JSON)
            assert r.status_code == 400 and "the body is not JSON" in r.json()["error"]["message"]
            r = await c.post("/generate", content=b"[" * big + b"]" * big, headers=JSON)
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
            r = await post(c, "/v1/completions", {"prompt": "a" * big})
            assert r.status_code == 400 and "characters, more than the 2000 tokens" in r.json()["message"]
            r = await post(c, "/generate", {"input_ids": [1] * 500_000})
            assert r.status_code == 400 and "The input (500000 tokens) is longer than the model's context length" in r.text
            r = await post(c, "/generate", {"input_ids": [[1, 2, 3]] * 200_000})
            assert r.status_code == 400 and "a batch holds 1 to 1024 requests" in r.text
            r = await post(c, "/generate", {"input_ids": [[1, 2, 3]] * 2, "rid": ["a", "b"], "pad": "x" * big})
            assert r.status_code == 400 and "unknown field(s): 'pad'" in r.text
        assert server.scheduler.received == []
        assert server.app.state.json_pool is not None

    run(scenario, SecurityPolicy(max_body_size=64 << 20))


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing():
    async def scenario(server: InProcessServer) -> None:
        per_token = server.manager.gate.tokenizer.max_token_bytes
        async with server.client() as c:
            r = await c.post("/generate", json={"text": "a" * (2000 * per_token + 1)})
            assert r.status_code == 400
            assert f"more than the 2000 tokens that fit can hold (at most {per_token} characters a token" in \
                r.json()["error"]["message"]

    run(scenario)


# --- 4. rids ----------------------------------------------------------------------------


def test_two_requests_with_one_rid_at_once_one_wins_one_is_told():
    async def scenario(server: InProcessServer) -> None:
        server.scheduler.mode = "stuck"  # the winner stays in flight while the other comes
        async with server.client() as c:
            for i in range(50):
                body = {"text": "hi", "rid": f"same-{i}"}
                pair = [asyncio.create_task(c.post("/generate", json=body)) for _ in range(2)]
                done, _ = await asyncio.wait(pair, return_when=asyncio.FIRST_COMPLETED)
                loser = done.pop().result()
                assert loser.status_code == 400 and "Duplicate request ID" in loser.json()["error"]["message"]
                for _ in range(500):  # the winner's request on its way to the (stuck) scheduler
                    if body["rid"] in server.scheduler.generate_rids():
                        break
                    await asyncio.sleep(0.01)
                server.scheduler.answer_held()
                answers = await asyncio.wait_for(asyncio.gather(*pair), 10)  # no handler hangs
                assert sorted(r.status_code for r in answers) == [200, 400]
        assert server.manager.rid_to_state == {}
        assert server.scheduler.generate_rids() == [f"same-{i}" for i in range(50)]  # one of each pair ran

    run(scenario)


def test_a_stream_dropped_before_its_first_event_frees_its_rid_and_aborts():
    async def scenario(server: InProcessServer) -> None:
        server.scheduler.mode = "stuck"
        for i in range(20):
            spec = ReqSpec(f"dropped-{i}", input_ids=[1, 2, 3])
            claim = await server.manager.submit([spec])
            stream = ClaimedStream(_never_read(), claim)
            del stream, claim  # the client went away before the response started
            gc.collect()
        await asyncio.sleep(0.2)
        assert server.manager.rid_to_state == {}
        assert sorted(server.scheduler.aborted_rids()) == sorted(f"dropped-{i}" for i in range(20))

    run(scenario)


async def _never_read():
    yield b""


# --- 6. health ----------------------------------------------------------------------------


def test_health_fails_within_its_bound_when_the_scheduler_does_not_answer():
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            assert (await c.get("/health")).status_code == 200
            server.scheduler.mode = "stuck"
            loop = asyncio.get_running_loop()
            tic = loop.time()
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/health_generate")).status_code == 503
            assert loop.time() - tic < 5  # (two probes of 0.5 s each: the bound, not a speed target)
            server.scheduler.mode = "answer"
            assert (await c.get("/health")).status_code == 200
        assert server.manager.rid_to_state == {}  # the stuck probes were given up and aborted
        assert len(server.scheduler.aborted_rids()) == 2

    run(scenario, health_check_timeout=0.5)


def test_an_aborted_probe_is_not_health():
    async def scenario(server: InProcessServer) -> None:
        server.scheduler.mode = "abort"
        async with server.client() as c:
            assert (await c.get("/health_generate")).status_code == 503

    run(scenario)


@pytest.mark.parametrize("status", ["starting", "shutting_down"])
def test_health_is_503_while_starting_or_shutting_down(status):
    async def scenario(server: InProcessServer) -> None:
        async with server.client() as c:
            r = await c.get("/health")
            assert r.status_code == 503 and status.replace("_", " ") in r.text
        assert server.scheduler.received == []

    run(scenario, status=status)


def test_parse_size():
    assert parse_size("32M") == 32 << 20 and parse_size("512K") == 512 << 10 and parse_size("100") == 100
    assert parse_size("1GiB") == 1 << 30
    for bad in ("", "-1", "0", "12X", "M"):
        with pytest.raises(ValueError, match="--max-body-size"):
            parse_size(bad)


def test_a_killed_servers_folder_is_removed_by_the_next_server(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from sglite.entrypoints.launch_server import _remove_stale_folders

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folders = {name: tmp_path / f"sglite-serve-{name}" for name in ("dead", "alive", "no-pid")}
    for folder in folders.values():
        (folder / "metrics").mkdir(parents=True)
    (folders["dead"] / "pid").write_text(dead.stdout.strip())  # (that process has exited)
    (folders["alive"] / "pid").write_text(str(os.getppid()))
    _remove_stale_folders()
    assert not folders["dead"].exists() and folders["alive"].exists() and folders["no-pid"].exists()
