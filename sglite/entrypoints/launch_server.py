"""``sglite serve``: SGLang's process layout (SGLang: entrypoints/http_server.py
``launch_server``, entrypoints/engine.py ``_launch_subprocesses``).

    main process:  uvicorn + FastAPI + ServerTokenizerManager (asyncio)
        │ ZMQ TokenizedGenerateReqInput / AbortReq / control requests
        ▼
    scheduler process: Scheduler.event_loop, the model (sglite::scheduler_TP0)
        │ ╰─ --tp-size N: gloo/NCCL to the ranks 1..N-1 (sglite::tp_worker_TP<r>),
        │    which run each batch it sends on their shard of the model
        │ ZMQ [BatchTokenIDOut, ...] per iteration
        ▼
    detokenizer process: DetokenizerManager (sglite::detokenizer)
        │ ZMQ [BatchStrOut, ...]
        ▼
    main process (handle_loop wakes each request's handler)

The scheduler reports ready (pool size, longest prompt, its tokenizer) over a pipe
before the server accepts traffic. A child that dies makes the server exit; the server
stops its children when it stops (SIGTERM, SIGINT), so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from sglite.entrypoints.http_security import DEFAULT_MAX_BODY_SIZE, SecurityPolicy
from sglite.server_args import PortArgs, ServerArgs

logger = logging.getLogger("sglite")
READY_TIMEOUT = 1800.0  # seconds the scheduler may take to load (a first run downloads and converts)
WATCHDOG_INTERVAL = 1.0  # seconds between checks that the children are alive
GRACEFUL_SHUTDOWN = 5.0  # seconds uvicorn waits for the requests in flight when the server stops
DEFAULT_HEALTH_CHECK_TIMEOUT = 20.0  # seconds a health probe may wait for the scheduler (SGLang's default)


@dataclass
class ServeArgs:
    """The HTTP side's options (SGLang keeps them in ServerArgs). docs/serving.md,
    "Security", says what each of the last five guards against."""

    host: str = "127.0.0.1"
    port: int = 30000
    enable_metrics: bool = False
    served_model_name: str | None = None
    enable_debug_control: bool = False  # /debug/control may pause and step the scheduler
    api_key: str | None = None  # every route but /health* (and /metrics) needs "Authorization: Bearer KEY"
    enable_debug_events: bool = False  # /debug/events may stream every request's prompt and output
    max_body_size: int = DEFAULT_MAX_BODY_SIZE  # bytes; a larger request body is a 413
    allowed_hosts: tuple[str, ...] = ()  # Host / Origin names accepted besides IPs and localhost ("*": any)
    metrics_require_api_key: bool = False  # /metrics needs the key too
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT  # seconds (SGLANG_HEALTH_CHECK_TIMEOUT)

    def security_policy(self) -> SecurityPolicy:
        return SecurityPolicy(self.api_key or None, self.host.lower(), frozenset(h.lower() for h in self.allowed_hosts),
                              self.max_body_size, self.metrics_require_api_key)


class ServerStartError(RuntimeError):
    """The scheduler could not start (a model that fails to load, ...)."""


def launch_server(server_args: ServerArgs, serve_args: ServeArgs, viewer_args: Any = None) -> int:
    """Start the processes, serve until stopped, stop them. Returns an exit status.
    ``viewer_args``: the CLI's options for the viewers (--record, tracing), which attach
    in the scheduler's process (and, for tracing, the HTTP side)."""
    from sglite.engine import setup_logging

    setup_logging(server_args.log_level)  # this process's lines: uvicorn's, the ready line, errors
    if server_args.node_rank > 0:
        return _serve_other_node(server_args)
    _remove_stale_folders()
    folder = tempfile.mkdtemp(prefix="sglite-serve-")
    with open(os.path.join(folder, "pid"), "w") as f:
        f.write(str(os.getpid()))  # (a later server removes the folder if this process died without doing so)
    if serve_args.enable_metrics:  # before prometheus_client is imported in any process
        os.makedirs(f"{folder}/metrics")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = f"{folder}/metrics"
    children: list[Any] = []
    try:
        return _serve(server_args, serve_args, PortArgs.init_new(folder), children, viewer_args)
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop(children)
        shutil.rmtree(folder, ignore_errors=True)


def _serve(server_args: ServerArgs, serve_args: ServeArgs, port_args: PortArgs, children: list[Any],
           viewer_args: Any) -> int:
    import uvicorn

    from sglite.entrypoints.http_server import ServerInfo, build_app

    _Server = _uvicorn_server_class()
    from sglite.managers.tokenizer_manager import ServerTokenizerManager, TokenizerManager

    model_name = serve_args.served_model_name or server_args.model_path
    labels = _metric_labels(model_name) if serve_args.enable_metrics else None
    _check_port(serve_args.host, serve_args.port)  # before the model loads, not after
    ready = _launch_subprocesses(server_args, port_args, labels, children, viewer_args)
    metrics = None
    if labels is not None:
        from sglite.metrics.collector import TokenizerMetricsCollector, tokenizer_labels

        metrics = TokenizerMetricsCollector(tokenizer_labels(labels))
    gate = TokenizerManager(ready["tokenizer"], ready["vocab_size"], ready["max_req_input_len"],
                            ready["context_len"], ready["max_total_num_tokens"], server_args.grammar_backend)
    manager = ServerTokenizerManager(gate, port_args, metrics)
    http_spans, close_tracer = _http_spans(viewer_args, model_name)
    info = ServerInfo(server_args, model_name, ready["max_total_num_tokens"], ready["max_req_input_len"],
                      serve_args.enable_metrics, http_spans, port_args.events_ipc_name, serve_args.enable_debug_control,
                      serve_args.enable_debug_events, health_check_timeout=serve_args.health_check_timeout)
    app = build_app(manager, info, serve_args.security_policy())
    config = uvicorn.Config(app, host=serve_args.host, port=serve_args.port, log_level=server_args.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN)
    server = _Server(config)
    # requests in flight finish within 3 s, or end as aborted 2 s before uvicorn would cancel them

    async def drain() -> None:
        info.status = "shutting_down"  # /health answers 503 from now on
        await manager.drain(GRACEFUL_SHUTDOWN - 2)

    server.drain = drain

    async def main() -> None:
        watchdog = asyncio.create_task(_watchdog(children, server))
        tp = f", tp {server_args.tp_size}" if server_args.tp_size > 1 else ""
        print(f"sglite serve: {model_name} on http://{serve_args.host}:{serve_args.port} "
              f"({ready.get('dtype', '?')}{tp}, pool {info.max_total_num_tokens} tokens; Ctrl-C stops)", file=sys.stderr,
              flush=True)
        await server.serve()
        watchdog.cancel()

    try:
        asyncio.run(main())
    finally:
        close_tracer()
    return 1 if getattr(server, "sglite_child_died", False) else 0


def health_check_timeout() -> float:
    """SGLANG_HEALTH_CHECK_TIMEOUT (seconds, SGLang's variable), default 20."""
    text = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "")
    try:
        value = float(text) if text else DEFAULT_HEALTH_CHECK_TIMEOUT
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"SGLANG_HEALTH_CHECK_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value


def _remove_stale_folders() -> None:
    """Remove the IPC folders of servers that died without removing them (kill -9): a
    folder whose recorded process is gone. One without a pid file is left alone."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "sglite-serve-*")):
        try:
            with open(os.path.join(folder, "pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _http_spans(viewer_args: Any, model_name: str) -> tuple[Any, Callable[[], None]]:
    """The tracing plugin's spans for the HTTP side, when tracing is on."""
    from sglite.cli import plugins

    for plugin in plugins() if viewer_args is not None else []:
        if hasattr(plugin, "attach_http"):
            got = plugin.attach_http(viewer_args, model_name)
            if got is not None:
                return got
    return None, lambda: None


def _check_port(host: str, port: int) -> None:
    """ServerStartError, at once, if ``host:port`` cannot be listened on (another server
    there): not after the model has loaded. (A port taken in between still fails later.)"""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not count
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServerStartError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server there? "
                                   "--port picks another)") from None


def _uvicorn_server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM / SIGINT once it has shut down, which would end this
        process before it stops its children: a signal here only asks uvicorn to stop.
        ``drain``, if set, runs beside uvicorn's shutdown (which waits for the requests in
        flight, then cancels their handlers): it gets each one answered before that."""

        drain: Callable[[], Awaitable[None]] | None = None

        async def shutdown(self, sockets: Any = None) -> None:
            drain = asyncio.ensure_future(self.drain()) if self.drain is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if drain is not None:
                    drain.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def _metric_labels(model_name: str) -> dict[str, str]:
    from sglite.metrics.collector import labels_for

    return labels_for(model_name)


def _launch_subprocesses(server_args: ServerArgs, port_args: PortArgs, labels: dict[str, str] | None,
                         children: list[Any], viewer_args: Any = None) -> dict[str, Any]:
    """The scheduler first (it loads the model and brings the tokenizer), then the
    detokenizer with that tokenizer; returns the scheduler's ready message."""
    from sglite.managers.detokenizer_manager import run_detokenizer_process
    from sglite.managers.scheduler_process import run_scheduler_process
    from sglite.managers.tp_worker import launch_tp_followers, set_dist_init_addr

    ctx = multiprocessing.get_context("spawn")
    # the scheduler's OpenMP threads share the cores with this process, the detokenizer
    # and often the clients: threads that sleep rather than spin while they wait lose
    # less to them (+4-8 % at 32 in flight on 2 cores, benchmarks/results/serving-*.md);
    # the children read it when they start (OMP_WAIT_POLICY set by the user wins)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    set_dist_init_addr(server_args)  # --tp-size > 1 on one machine: a free loopback port
    children.extend(launch_tp_followers(server_args))  # first: the watchdog names a dead one before rank 0
    reader, writer = ctx.Pipe(duplex=False)
    scheduler = ctx.Process(target=run_scheduler_process, args=(server_args, port_args, writer, labels, viewer_args),
                            name="sglite::scheduler", daemon=True)
    scheduler.start()
    children.append(scheduler)
    print(f"sglite serve: loading {server_args.model_path} in the scheduler process ...", file=sys.stderr, flush=True)
    waited = 0.0
    while not reader.poll(0.5):
        waited += 0.5
        dead = next((c for c in children if not c.is_alive()), None)
        if dead is not None:
            raise ServerStartError(f"{dead.name} exited while loading (exit code {dead.exitcode})")
        if waited > READY_TIMEOUT:
            raise ServerStartError(f"the scheduler was not ready after {READY_TIMEOUT:.0f} s")
    ready = reader.recv()
    if ready["status"] != "ready":
        raise ServerStartError(ready["message"])
    detokenizer = ctx.Process(target=run_detokenizer_process, args=(ready["tokenizer"], port_args),
                              name="sglite::detokenizer", daemon=True)
    detokenizer.start()
    children.append(detokenizer)
    return ready


def _serve_other_node(server_args: ServerArgs) -> int:
    """--node-rank N > 0: run this machine's tp ranks for node 0's scheduler until they
    stop (rank 0 stops them) or this process is stopped."""
    from sglite.managers.tp_worker import launch_tp_followers, node_tp_ranks

    procs = launch_tp_followers(server_args)
    ranks = node_tp_ranks(server_args)
    print(f"sglite serve: node {server_args.node_rank} runs tp ranks {ranks.start}..{ranks.stop - 1} for the "
          f"scheduler at {server_args.dist_init_addr} (Ctrl-C stops)", file=sys.stderr, flush=True)
    stop = lambda signum, frame: _stop(procs)  # noqa: E731
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(procs)
    if all(p.exitcode == 0 for p in procs):
        print(f"sglite serve: node {server_args.node_rank}: rank 0 stopped the ranks", file=sys.stderr, flush=True)
        return 0
    return 1


async def _watchdog(children: list[Any], server: Any) -> None:
    """A child that dies takes the server down with it (SGLang does the same)."""
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL)
        dead = [c for c in children if not c.is_alive()]
        if dead:
            logger.error("%s exited (code %s): stopping the server", dead[0].name, dead[0].exitcode)
            print(f"error: {dead[0].name} exited (exit code {dead[0].exitcode}); the server stops",
                  file=sys.stderr, flush=True)
            server.sglite_child_died = True
            server.should_exit = True
            return


def _stop(children: list[Any]) -> None:
    """The scheduler first, and waited for: with --tp-size N it tells the other ranks
    to stop as it leaves; then the rest at once."""
    first = [c for c in children if c.name == "sglite::scheduler"]
    for group in (first, [c for c in children if c not in first]):
        for c in group:
            if c.is_alive():
                c.terminate()
        for c in group:
            c.join(timeout=10)
            if c.is_alive():
                os.kill(c.pid, signal.SIGKILL)
                c.join(timeout=5)
