"""The engine side of the TUI: a loop that steps the engine, ships each iteration's
events to the screen, and takes the screen's commands (pause, step, submit, policy,
workload). ``sglite tui`` runs it in a process of its own, as SGLang runs its
scheduler, so drawing never competes with the engine for the interpreter; tests run the
same loop on a thread, or call ``step()`` by hand.

Messages to the screen: ``("events", [Event, ...])``, ``("log", text)``, ``("state",
HostState)`` whenever what the host holds changes (requests submitted but not yet
received by the scheduler, workloads with work left, running/paused/idle), ``("ready",
info)`` once the model is loaded, ``("error", text)``.
Commands from it: ``("run",)``, ``("pause",)``, ``("step",)``, ``("submit", kwargs)``,
``("policy", name)``, ``("workload", name_or_path)``, ``("quit",)``.

While running, the host ships the events of every iteration, but at most every
``SHIP_INTERVAL`` seconds, and builds a ``SchedulerSnapshot`` only for the newest
iteration of each shipment: the screen draws only the newest view, and on a fast engine
(tiny-random makes hundreds of iterations a second) a snapshot pickled to the screen
every iteration cost the engine more than the rest of its events. A step while paused,
a pause, any command and running out of work ship at once. A recording (``--record``)
still gets a snapshot every iteration: the scheduler emits those to it, and the host
passes them on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from sglite import events as ev
from tui.workloads import Arrival, Workload, load

IDLE_POLL = 0.05  # seconds to wait for a command while paused or idle
SHIP_INTERVAL = 0.05  # seconds between shipments while running: at most 20 screen updates a second
SCREEN_NICE = 10  # how much the screen lowers its CPU priority below the engine's (see yield_cpu_to_engine)


@dataclass(frozen=True)
class HostState:
    """What the screen cannot learn from the scheduler's events: what the host holds."""

    idle: bool  # no request in the scheduler and no arrival to come
    arriving: tuple[str, ...]  # submitted, not yet taken in by recv_requests
    workloads: tuple[str, ...]  # workloads with arrivals to come or requests unfinished
    last_workload: str  # the workload started last
    next_arrival: tuple[int, int] | None  # (requests, iteration) of the next workload arrival


class EngineHost:
    def __init__(self, engine: Any, workload: Workload, outbox: Any, paused: bool = False):
        self.engine = engine
        self.outbox = outbox
        self.pending: list[Arrival] = sorted(workload.shifted(0, source=workload.name), key=lambda a: a.at)
        self.running = not paused
        self.last_workload = workload.name
        self.started: list[str] = [workload.name]  # workloads (and "typed prompt") in the order they began
        self.arriving: list[str] = []  # rids submitted and not yet received by the scheduler
        self.unfinished: dict[str, str] = {}  # rid -> the workload (or "prompt") it came from
        self._events: list[ev.Event] = []
        self._shipped_at = time.monotonic()
        self._state_sent: HostState | None = None
        engine.event_bus.subscribe(self._events.append)

    def _log(self, text: str) -> None:
        self.outbox.put(("log", text))

    def idle(self) -> bool:
        return not self.pending and not self.engine.scheduler.has_work()

    def submit_arrivals(self) -> None:
        it = self.engine.scheduler.iteration
        while self.pending and self.pending[0].at <= it:
            a = self.pending.pop(0)
            rid = self.engine.submit(a.prompt, input_ids=a.input_ids, messages=a.messages,
                                     sampling_params={"max_new_tokens": a.max_new_tokens, "temperature": 0,
                                                      "ignore_eos": a.ignore_eos})
            self.arriving.append(rid)
            self.unfinished[rid] = a.source

    def step(self) -> None:
        """One scheduler iteration, shipped to the screen at once."""
        self._iterate()
        self.ship()

    def _iterate(self) -> None:
        self.submit_arrivals()
        self.engine.step()

    def ship(self) -> None:
        """Send the events since the last shipment as one message, the newest iteration
        with a snapshot of the scheduler (built now, between iterations, when the scheduler
        did not emit one: the state after an iteration is the state until the next)."""
        self._shipped_at = time.monotonic()
        if not self._events:
            self.send_state()
            return
        events, self._events[:] = list(self._events), []
        self._track(events)
        self.outbox.put(("events", self.engine.scheduler.observer.with_snapshot(events)))
        self.send_state()

    def _track(self, events: list[ev.Event]) -> None:
        """Requests the scheduler took in, and those that ended."""
        for e in events:
            if isinstance(e, (ev.ReqArrived, ev.ReqAborted)) and e.rid in self.arriving:
                self.arriving.remove(e.rid)
            if isinstance(e, (ev.ReqFinished, ev.ReqAborted)):
                self.unfinished.pop(e.rid, None)

    def state(self) -> HostState:
        active = {a.source for a in self.pending} | set(self.unfinished.values())
        names = [n for n in dict.fromkeys(self.started) if n in active]
        nxt = [a for a in self.pending if a.at == self.pending[0].at] if self.pending else []
        return HostState(self.idle(), tuple(self.arriving), tuple(names), self.last_workload,
                         (len(nxt), nxt[0].at) if nxt else None)

    def send_state(self) -> None:
        """Tell the screen what the host holds, when it changed."""
        state = self.state()
        if state != self._state_sent:
            self._state_sent = state
            self.outbox.put(("state", state))

    def handle(self, cmd: tuple) -> bool:
        """Apply a command; False means quit."""
        kind = cmd[0]
        if kind == "quit":
            return False
        if kind == "run":
            self.running = True
        elif kind == "pause":
            self.running = False
        elif kind == "step":
            self.running = False
            self.step()
        elif kind == "submit":
            self._submit(cmd[1])
        elif kind == "policy":
            self._set_policy(cmd[1])
        elif kind == "workload":
            self._add_workload(cmd[1])
        self.send_state()
        return True

    def _submit(self, kwargs: dict[str, Any]) -> None:
        try:
            rid = self.engine.submit(**kwargs)
        except ValueError as e:  # (bad input otherwise comes back as the request's own error)
            self._log(f"[red]error[/] {e}")
            return
        self.arriving.append(rid)
        self.unfinished[rid] = "typed prompt"
        self.started.append("typed prompt")
        self._log(f"submitted {rid}")

    def _set_policy(self, name: str) -> None:
        self.engine.scheduler.set_schedule_policy(name)
        self._log(f"policy -> {name}")

    def _add_workload(self, name: str) -> None:
        try:
            wl = load(name)
        except ValueError as e:
            self._log(f"[red]error[/] {e}")
            return
        now = self.engine.scheduler.iteration
        arrivals = wl.shifted(now, source=wl.name)
        self.pending = sorted(self.pending + arrivals, key=lambda a: a.at)
        self.last_workload = wl.name
        self.started.append(wl.name)
        self._log(f"workload {wl.name}: {len(arrivals)} requests")

    def serve(self, inbox: Any) -> None:
        """Run until told to quit: step while running and there is work, else wait for
        a command."""
        while True:
            wait = not self.running or self.idle()
            try:
                cmd = inbox.get(timeout=IDLE_POLL) if wait else inbox.get_nowait()
            except queue.Empty:
                cmd = None
            if cmd is not None:
                self.ship()  # what ran before the command, as it was
                if not self.handle(cmd):
                    return
                continue
            if self.running and not self.idle():
                self._iterate()
                if self.idle() or time.monotonic() - self._shipped_at >= SHIP_INTERVAL:
                    self.ship()


class HostConnection:
    """The screen's end: send commands, drain messages."""

    def __init__(self, inbox: Any, outbox: Any, worker: Any = None):
        self.inbox, self.outbox, self.worker = inbox, outbox, worker

    def send(self, *cmd: Any) -> None:
        self.inbox.put(cmd)

    def drain(self, limit: int = 10_000) -> list[tuple]:
        out = []
        for _ in range(limit):
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                break
        return out

    def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        """Block until the engine is loaded; raises RuntimeError with its error, when its
        process dies without one (killed, out of memory), or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.outbox.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                break
            except queue.Empty:
                alive = getattr(self.worker, "is_alive", None)
                if alive is not None and not alive():
                    code = getattr(self.worker, "exitcode", None)
                    raise RuntimeError("the engine process exited before it was ready"
                                       + (f" (exit code {code})" if code is not None else "")) from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the engine was not ready after {timeout:.0f} s") from None
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        assert msg[0] == "ready", msg
        return msg[1]

    def close(self) -> None:
        self.send("quit")
        if self.worker is None:  # a host stepped by hand
            return
        self.worker.join(timeout=10)
        if isinstance(self.worker, multiprocessing.process.BaseProcess) and self.worker.is_alive():
            self.worker.terminate()


def _ready_info(engine: Any, workload: Workload) -> dict[str, Any]:
    s = engine.scheduler
    return {"model": engine.server_args.model_path, "workload": workload.name, "overlap": s.enable_overlap,
            "pool": s.max_total_num_tokens, "policy": engine.server_args.schedule_policy}


def serve_in_thread(engine: Any, workload: Workload, paused: bool = False) -> HostConnection:
    """The host loop on a thread of this process (tests)."""
    inbox: queue.Queue = queue.Queue()
    outbox: queue.Queue = queue.Queue()
    host = EngineHost(engine, workload, outbox, paused)
    outbox.put(("ready", _ready_info(engine, workload)))
    thread = threading.Thread(target=host.serve, args=(inbox,), daemon=True, name="sglite-tui-host")
    thread.start()
    return HostConnection(inbox, outbox, thread)


def serve_in_process(engine_kwargs: dict[str, Any], workload: str | Workload, paused: bool,
                     viewer_args: Any = None) -> HostConnection:
    """The host loop in a new process that loads the model itself. ``workload``: a name
    or file for ``tui.workloads.load``, or a Workload."""
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    # a daemon cannot start processes: with --tp-size N the engine starts its other ranks,
    # so it is not one then, and ends itself if this process goes away (exit_with_parent)
    daemon = engine_kwargs.get("tp_size", 1) == 1
    proc = ctx.Process(target=_process_main, args=(engine_kwargs, workload, paused, viewer_args, inbox, outbox),
                       daemon=daemon, name="sglite-engine")
    proc.start()
    return HostConnection(inbox, outbox, proc)


class _ToScreen(logging.Handler):
    def __init__(self, outbox: Any):
        super().__init__(logging.WARNING)
        self.outbox = outbox

    def emit(self, record: logging.LogRecord) -> None:
        self.outbox.put(("log", f"[yellow]{record.getMessage()}[/]"))


def engine_threads() -> int:
    """Torch intra-op threads for an engine that shares the machine with the screen: all
    of torch's, as the engine alone has. Before decode forwards ran as the CPU graph, a
    core was left to the screen (each frame stalled a forward on every core at its next
    OpenMP barrier: 0.6x on 2 cores). With the CPU graph, the engine makes far more of a
    second core than the screen costs: on smollm2, pool-pressure, 2 cores, engine + TUI
    with 2 threads ran at 0.90x of the engine alone, with 1 thread at 0.64x (measured with
    the overlap loop, then the CPU default: benchmarks/results/tui-overhead-2026-12-04.md).
    OMP_NUM_THREADS, when set, wins."""
    import torch

    return torch.get_num_threads()


def yield_cpu_to_engine(connection: HostConnection) -> None:
    """Lower this process's (the screen's) CPU priority by ``SCREEN_NICE``, so that when
    the screen and the engine want the same core the engine gets it: on 2 cores the
    screen's ~11 ms a frame otherwise preempts a torch thread, and every thread of the
    forward waits for it at the next OpenMP barrier. The screen still gets what it needs
    (10 updates a second on smollm2 either way; benchmarks/tui_overhead.py measures
    both). Call it after the engine's process started: a process started later would
    inherit the lower priority. Where the platform has no nice(2), nothing changes."""
    if connection.worker is None or not isinstance(connection.worker, multiprocessing.process.BaseProcess):
        return  # the engine runs in this process (tests): lowering it would lower the engine too
    try:
        os.nice(SCREEN_NICE)
    except (AttributeError, OSError):
        pass


def _process_main(engine_kwargs: dict[str, Any], workload: str | Workload, paused: bool, viewer_args: Any,
                  inbox: Any, outbox: Any) -> None:
    close = None
    try:
        import torch

        torch.set_num_threads(engine_threads())
        from sglite.engine import Engine
        from sglite.managers.tp_worker import exit_with_parent

        if engine_kwargs.get("tp_size", 1) > 1:
            exit_with_parent(os.getppid())

        if isinstance(workload, str):
            workload = load(workload)
        engine = Engine(**engine_kwargs)
        if viewer_args is not None:
            from sglite.cli import attach_viewers

            close = attach_viewers(engine, viewer_args)
        host = EngineHost(engine, workload, outbox, paused)
        # from here on the terminal belongs to the screen: warnings go to its events panel
        for name in ("sglite", "sglite.tracing"):
            logging.getLogger(name).handlers[:] = [_ToScreen(outbox)]
        devnull = os.open(os.devnull, os.O_WRONLY)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        outbox.put(("ready", _ready_info(engine, workload)))
        host.serve(inbox)
    except BaseException as e:  # the screen shows it; a traceback here would tear it
        from sglite.model_loader import ModelLoadError

        known = isinstance(e, (ModelLoadError, ValueError, OSError))
        outbox.put(("error", str(e) if known else traceback.format_exc()))
    finally:
        if close is not None:
            close()
