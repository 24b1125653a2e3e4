"""``sglite tui --attach URL``: the screen on a running ``sglite serve``.

``RemoteConnection`` has the interface of the engine host's connection (send, drain,
wait_ready, close), so the same app and the same ViewBuilder draw a server's scheduler:
a thread reads the server's ``/debug/events`` stream (every iteration's events, the
newest of each shipment with a SchedulerSnapshot) into the screen's queue; commands go
over HTTP on another thread. Pause and step need a server started with
``--enable-debug-control``, the event stream ``--enable-debug-events``, and a server
started with ``--api-key`` the same key here (``sglite tui --attach URL --api-key KEY``,
or SGLITE_API_KEY); a prompt typed with ``a`` is a real client request
(``/v1/chat/completions``); the policy and workload keys act on an engine the screen
owns, so attached they say that they do not apply.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

from sglite import events as ev
from tui.host import HostConnection

CONNECT_TIMEOUT = 10.0  # seconds to reach the server


class RemoteConnection(HostConnection):
    """The commands queue is the connection's inbox; no worker of the screen's own."""

    def __init__(self, url: str, api_key: str | None = None):
        super().__init__(queue.Queue(), queue.Queue(), worker=None)
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read_events, daemon=True, name="sglite-attach-events"),
                         threading.Thread(target=self._run_commands, daemon=True, name="sglite-attach-commands")]

    # --- the screen's side ------------------------------------------------------------

    def wait_ready(self, timeout: float = CONNECT_TIMEOUT) -> dict[str, Any]:
        """The server's model and scheduler settings; raises RuntimeError (one line) when
        nothing answers at the URL."""
        import httpx

        try:
            r = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=timeout)
            if r.status_code == 401:
                raise RuntimeError(f"{self.url} needs an API key: pass the server's with --api-key KEY "
                                   "(or SGLITE_API_KEY)" if not self.headers else
                                   f"{self.url} refused the API key given (--api-key / SGLITE_API_KEY)")
            info = r.json()
            self._check_event_stream(httpx, timeout)
        except (httpx.HTTPError, ValueError) as e:
            raise RuntimeError(f"no sglite server answers at {self.url} ({type(e).__name__})") from None
        if "internal_states" not in info:
            raise RuntimeError(f"{self.url} is not an sglite server (its /get_server_info has no scheduler state)")
        for t in self._threads:
            t.start()
        return {"model": info.get("model_path", "?"), "workload": f"attached to {self.url}",
                "overlap": not info.get("disable_overlap_schedule", False),
                "pool": info.get("max_total_num_tokens", 0), "policy": info.get("schedule_policy", "")}

    def _check_event_stream(self, httpx: Any, timeout: float) -> None:
        """The server streams its events only when started with --enable-debug-events."""
        with httpx.stream("GET", f"{self.url}/debug/events", headers=self.headers, timeout=timeout) as r:
            if r.status_code == 403:
                raise RuntimeError(f"{self.url} does not show its scheduler's events: start it with "
                                   "--enable-debug-events (they hold every client's prompts and outputs)")

    def close(self) -> None:
        self._stop.set()
        super().close()  # ("quit",) ends the command thread

    # --- the threads ------------------------------------------------------------------

    def _read_events(self) -> None:
        import httpx

        try:
            with httpx.stream("GET", f"{self.url}/debug/events", headers=self.headers,
                              timeout=httpx.Timeout(10.0, read=None)) as r:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("data: "):
                        self.outbox.put(("events", [ev.event_from_dict(d) for d in json.loads(line[6:])]))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            if not self._stop.is_set():
                self.outbox.put(("error", f"the server's event stream ended: {type(e).__name__}: {e}"))
            return
        if not self._stop.is_set():
            self.outbox.put(("error", "the server closed its event stream (it stopped?)"))

    def _run_commands(self) -> None:
        while True:
            cmd = self.inbox.get()
            if cmd[0] == "quit":
                return
            try:
                self._command(cmd)
            except Exception as e:  # noqa: BLE001 - the screen shows it; the connection lives on
                self.outbox.put(("log", f"[red]error[/] {cmd[0]}: {type(e).__name__}: {e}"))

    def _command(self, cmd: tuple) -> None:
        import httpx

        kind = cmd[0]
        if kind in ("pause", "run", "step"):
            r = httpx.post(f"{self.url}/debug/control", json={"cmd": kind}, headers=self.headers, timeout=30)
            if r.status_code != 200:
                self.outbox.put(("log", f"[yellow]{kind}: {r.json()['error']['message']}[/]"))
                self.outbox.put(("paused", False))  # the server runs on: the screen must not say paused
            else:
                self.outbox.put(("paused", r.json()["paused"]))
        elif kind == "submit":
            threading.Thread(target=self._submit, args=(cmd[1],), daemon=True).start()
        else:  # policy, workload: they change an engine the screen owns
            self.outbox.put(("log", f"[yellow]{kind}: not available when attached to a server[/]"))

    def _submit(self, kwargs: dict[str, Any]) -> None:
        """A typed prompt, as a client of the server (the answer shows in the panels)."""
        import httpx

        params = kwargs.get("sampling_params", {})
        body = {"messages": kwargs["messages"], "max_tokens": params.get("max_new_tokens", 64),
                "temperature": params.get("temperature", 0)}
        self.outbox.put(("log", "submitted a prompt to the server"))
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers, timeout=None)
        if r.status_code != 200:
            self.outbox.put(("log", f"[red]error[/] {r.json().get('message', r.text)}"))
