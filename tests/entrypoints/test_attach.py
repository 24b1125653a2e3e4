"""`sglite tui --attach`: the screen on a live server under load from real clients. A
small pool forces retractions; the screen must see one, with the queues and the plan
of the server's own scheduler; pause and step act on the server only when it allows it."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from tests.entrypoints.test_http_server import Server
from tui.app import LiveFeed, SchedulerApp
from tui.remote import RemoteConnection
from tui.state import short_rid
from tui.workloads import QUESTIONS


def load(url: str, n: int, done: list) -> None:
    """n chat clients at once, each decoding 400 tokens (EOS ignored)."""
    def one(q: str) -> None:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "system", "content": "You are a helpful assistant. " * 8},
                         {"role": "user", "content": q}], "max_tokens": 400, "ignore_eos": True, "temperature": 0})
        done.append(r.status_code)

    for i in range(n):
        threading.Thread(target=one, args=(QUESTIONS[i % len(QUESTIONS)],), daemon=True).start()


def control(url: str, cmd: str) -> dict:
    return httpx.post(f"{url}/debug/control", json={"cmd": cmd}, timeout=30).json()


def test_attached_screen_sees_a_retract_and_steps_the_server():
    server = Server("--max-total-tokens", "1024", "--schedule-conservativeness", "0.3", "--enable-debug-control",
                    "--enable-debug-events")

    async def scenario():
        conn = RemoteConnection(server.url)
        info = conn.wait_ready()
        assert info["model"] == "tiny-random" and info["pool"] == 1024
        app = SchedulerApp(LiveFeed(conn, info), title=f"tiny-random · attached to {server.url}")
        done: list[int] = []
        async with app.run_test(size=(200, 50)) as pilot:
            await pilot.pause(1.0)  # the event stream is open before the load starts
            load(server.url, 12, done)
            seen_running = 0
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and app.feed.builder.retractions == 0:
                await pilot.pause(0.05)
                if app.last_view is not None:
                    seen_running = max(seen_running, len(app.last_view.running))
            assert app.feed.builder.retractions > 0, "no retraction seen"
            assert seen_running >= 2 and app.last_view.pool_total == 1024
            assert any("retract" in line for line in app.feed.builder.log)
            # tokens are counted (tok/s, out/max) and the detail has text, though the
            # server's detokenizer is another process
            assert max(app.last_view.throughput_history) > 0
            assert any(r.tokens_at(app.last_view.iteration) > 0 and r.text for r in app.requests.values())
            rid = app.last_view.running[0][0]
            assert len(rid) > 30 and short_rid(rid) in app.query_one("#running").plain  # uuid rids shortened
            await pilot.press("space")  # pause the server's scheduler
            await pilot.pause(0.5)
            before = control(server.url, "status")
            assert before["paused"] and app.paused
            state = httpx.get(f"{server.url}/get_server_info", timeout=10).json()["internal_states"][0]
            assert state["iteration"] == before["iteration"]  # answered while paused
            await pilot.pause(0.5)
            assert control(server.url, "status")["iteration"] == before["iteration"]  # nothing runs
            await pilot.press("n")
            for _ in range(40):
                await pilot.pause(0.05)
                if app.last_view.iteration == before["iteration"] + 1:
                    break
            assert control(server.url, "status")["iteration"] == before["iteration"] + 1
            assert app.last_view.iteration == before["iteration"] + 1  # the screen shows the stepped one
            await pilot.press("space")  # run
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(done) < 12:
                await pilot.pause(0.1)
            assert done == [200] * 12
            await pilot.pause(0.5)
            assert app.feed.builder.finished >= 12 and app.last_view.running == []
            await pilot.press("q")

    try:
        asyncio.run(scenario())
    finally:
        rc, err = server.stop()
    assert rc == 0, err


def test_without_debug_control_the_server_cannot_be_paused():
    server = Server("--enable-debug-events")
    try:
        r = httpx.post(f"{server.url}/debug/control", json={"cmd": "pause"}, timeout=30)
        assert r.status_code == 403 and "--enable-debug-control" in r.json()["error"]["message"]
        conn = RemoteConnection(server.url)
        conn.wait_ready()
        conn.send("pause")
        deadline = time.monotonic() + 30
        msgs: list = []
        while time.monotonic() < deadline and ("paused", False) not in msgs:
            msgs += conn.drain()
            time.sleep(0.05)
        assert ("paused", False) in msgs  # the screen is told the server runs on
        conn.close()
    finally:
        server.stop()


def test_attach_to_nothing_is_one_line():
    from tests.entrypoints.test_http_server import free_port

    conn = RemoteConnection(f"http://127.0.0.1:{free_port()}")
    try:
        conn.wait_ready(timeout=2)
    except RuntimeError as e:
        assert str(e).startswith("no sglite server answers at http://127.0.0.1:")
    else:
        raise AssertionError("attached to nothing")
