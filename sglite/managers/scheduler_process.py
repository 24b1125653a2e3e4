"""The Scheduler as a process of its own under ``sglite serve`` (SGLang keeps
``run_scheduler_process`` at the end of managers/scheduler.py).

It loads the model, tells the parent it is ready (with what the TokenizerManager needs:
the pool size, the longest prompt, the tokenizer itself), then loops: take every request
that arrived on its ZMQ socket (blocking only while it has nothing to do), run one
iteration of the event loop, and push the iteration's token outputs to the
DetokenizerManager as one message. Control requests (flush the cache, report state)
are answered to the TokenizerManager directly.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from sglite.distributed.parallel_state import TpRankDiedError
from sglite.managers.detokenizer_manager import DetokenizerManager
from sglite.managers.io_struct import (BatchTokenIDOut, DebugControlReq, DebugControlReqOutput, ExplainReq,
                                      FlushCacheReqInput, GetInternalStateReq)
from sglite.server_args import PortArgs, ServerArgs

IDLE_POLL_MS = 500  # how long an idle scheduler waits for a request before looking at its parent
SHIP_INTERVAL = 0.05  # seconds between event shipments to /debug/events readers (as the TUI's host)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe: Connection,
                          metrics_labels: dict[str, str] | None = None, viewer_args: Any = None) -> None:
    """``viewer_args``: the CLI's viewer options (--record, tracing): they attach to
    this process's EventBus, as to an offline Engine's, and are closed (spans flushed,
    the recording ended) when the server stops this process with SIGTERM."""
    import setproctitle

    from sglite.engine import setup_logging
    from sglite.managers.scheduler import Scheduler

    setproctitle.setproctitle("sglite::scheduler_TP0")  # (ps, top, py-spy show which process is which)
    # Ctrl-C reaches every process of the terminal's group: the server stops this one
    # (SIGTERM), which must not die mid-iteration with a KeyboardInterrupt traceback first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(server_args.log_level)
    parent = os.getppid()
    try:
        scheduler = Scheduler(server_args)
    except BaseException as e:  # noqa: BLE001 - the parent prints it and exits
        pipe.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    close_viewers = _attach_viewers(scheduler, server_args, viewer_args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # (the loop, once made, stops between iterations)
    try:
        try:
            _serve(scheduler, server_args, port_args, pipe, metrics_labels, parent)
        except SystemExit:
            pass
        _stop_other_ranks(scheduler)  # (not after a failure: a rank may be inside a collective)
    except TpRankDiedError as e:  # the server's watchdog sees this process exit and stops
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        close_viewers()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _stop_other_ranks(scheduler: Any) -> None:
    """--tp-size N, stopped between iterations: tell the other ranks, this node's and
    other nodes', to stop (they exit 0 instead of finding rank 0 gone). One that is gone
    already needs no word."""
    if scheduler.server_args.tp_size == 1:
        return
    try:
        scheduler.shutdown()
    except TpRankDiedError:
        pass


def _attach_viewers(scheduler: Any, server_args: ServerArgs, viewer_args: Any) -> Callable[[], None]:
    if viewer_args is None:
        return lambda: None
    from types import SimpleNamespace

    from sglite.cli import attach_viewers

    return attach_viewers(SimpleNamespace(event_bus=scheduler.event_bus, server_args=server_args, scheduler=scheduler),
                          viewer_args)


def _serve(scheduler: Any, server_args: ServerArgs, port_args: PortArgs, pipe: Connection,
           metrics_labels: dict[str, str] | None, parent: int) -> None:
    loop = SchedulerProcessLoop(scheduler, port_args, metrics_labels)
    signal.signal(signal.SIGTERM, loop.on_sigterm)
    pipe.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens,
               "max_req_input_len": scheduler.max_req_input_len, "tokenizer": scheduler.tokenizer,
               "vocab_size": scheduler.model_config.vocab_size,
               "context_len": scheduler.tp_worker.model_runner.context_len, "pid": os.getpid(),
               "dtype": str(scheduler.tp_worker.model_runner.dtype).removeprefix("torch."),
               "tp_size": server_args.tp_size})
    loop.run(parent)


class SchedulerProcessLoop:
    """The scheduler process's sockets and its loop: receive, run one iteration when
    there is work (and, paused by ``DebugControlReq``, only when stepped), ship the
    outputs, the gauges and, while someone watches, the event stream."""

    def __init__(self, scheduler: Any, port_args: PortArgs, metrics_labels: dict[str, str] | None):
        import zmq

        from sglite.metrics.collector import SchedulerMetricsCollector

        self.scheduler = scheduler
        ctx = zmq.Context()
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(port_args.scheduler_input_ipc_name)
        self.to_detokenizer = ctx.socket(zmq.PUSH)
        self.to_detokenizer.connect(port_args.detokenizer_ipc_name)
        self.to_tokenizer = ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(port_args.tokenizer_ipc_name)
        self.outputs: list[BatchTokenIDOut] = []
        # TokensEmitted for this process's viewers (the TUI attached, tracing's per-token
        # events, a recording): the DetokenizerManager that emits it runs in another
        # process, so one here makes the events' text, as offline and at the same point
        # of the iteration (a recording made by a server reruns offline event for event)
        self.event_detokenizer = DetokenizerManager(scheduler.tokenizer, scheduler.event_bus)
        scheduler.send_to_detokenizer = self._to_detokenizer
        scheduler.send_to_tokenizer = self.to_tokenizer.send_pyobj
        self.metrics = SchedulerMetricsCollector(metrics_labels) if metrics_labels is not None else None
        if self.metrics is not None:  # its counters and queue-time histogram come from the events
            scheduler.event_bus.subscribe(self.metrics.on_event, kinds=self.metrics.kinds())
        self.publisher = EventPublisher(ctx, port_args.events_ipc_name, scheduler)
        self.paused, self.steps = False, 0  # steps: iterations asked for while paused
        self.in_iteration = self.stopping = False

    def runnable(self) -> bool:
        return self.scheduler.has_work() and (not self.paused or self.steps > 0)

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """Stop now when between iterations; inside one, after it: its forward may be in
        a collective with the other tp ranks, which would wait for rank 0 forever."""
        if not self.in_iteration:
            raise SystemExit(0)
        self.stopping = True

    def run(self, parent: int) -> None:
        loop = self.scheduler.event_loop()
        while os.getppid() == parent and not self.stopping:  # the server went away: so does its scheduler
            self.publisher.poll()
            self.receive(block=not self.runnable())
            if not self.runnable():
                self.publisher.ship(force=True)
                continue
            self.in_iteration = True
            try:
                next(loop)
            finally:
                self.in_iteration = False
            self.steps = max(0, self.steps - 1)
            if self.outputs:
                self.to_detokenizer.send_pyobj(list(self.outputs))
                self.outputs.clear()
            idle = not self.scheduler.has_work()
            if self.metrics is not None:
                self.metrics.update(self.scheduler, force=idle)  # an idle server reports 0 running
            self.publisher.ship(force=idle or self.paused)

    def _to_detokenizer(self, out: BatchTokenIDOut) -> None:
        """One request's output: kept for this iteration's message to the detokenizer
        process; its TokensEmitted emitted now while anyone listens."""
        self.outputs.append(out)
        if self.metrics is not None:
            self.metrics.on_output(out.rid, len(out.new_token_ids), out.finished)
        if self.scheduler.event_bus.active:
            self.event_detokenizer.handle_batch_token_id_out(out)
        elif self.event_detokenizer.decode_status:
            self.event_detokenizer.decode_status.clear()  # nobody listens: keep no text for them

    def receive(self, block: bool) -> None:
        """Move what arrived into the scheduler's queue (its recv_requests takes it at the
        start of the next iteration); answer debug controls here; wait a little when
        ``block``."""
        import zmq

        if block and not self.recv.poll(IDLE_POLL_MS):
            return
        while True:
            try:
                item = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(item, DebugControlReq):
                self.control(item.cmd)
            elif isinstance(item, (GetInternalStateReq, FlushCacheReqInput, ExplainReq)):
                self.scheduler.process_input_requests([item])  # answered now, between iterations, paused or not
            else:
                self.scheduler.send(item)

    def control(self, cmd: str) -> None:
        if cmd in ("pause", "step"):
            self.paused = True
            self.steps += cmd == "step"
        elif cmd == "run":
            self.paused, self.steps = False, 0
        self.to_tokenizer.send_pyobj(DebugControlReqOutput(self.paused, self.scheduler.iteration))


class EventPublisher:
    """The scheduler's events for the server's ``/debug/events`` readers (``sglite tui
    --attach``), on a ZMQ XPUB socket. It subscribes to the EventBus only while a reader
    is there, and ships at most every SHIP_INTERVAL seconds, the newest iteration of a
    shipment with a SchedulerSnapshot (as the TUI's own host does; a new reader's first
    shipment carries the whole radix tree)."""

    def __init__(self, ctx: Any, address: str, scheduler: Any):
        import zmq

        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscribe, not only the first of a topic
        if hasattr(zmq, "XPUB_VERBOSER"):
            self.sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # every unsubscribe too
        self.sock.bind(address)
        self.scheduler, self.readers = scheduler, 0
        self.events: list[Any] = []
        self._unsubscribe: Callable[[], None] | None = None
        self._shipped_at, self._full_tree = 0.0, False

    def poll(self) -> None:
        """Count readers coming and going (XPUB's subscribe / unsubscribe messages)."""
        import zmq

        while True:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if msg[:1] == b"\x01":
                self.readers, self._full_tree = self.readers + 1, True
            elif msg[:1] == b"\x00":
                self.readers = max(0, self.readers - 1)
        if self.readers and self._unsubscribe is None:
            self._unsubscribe = self.scheduler.event_bus.subscribe(self.events.append)
        elif not self.readers and self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe, self.events[:] = None, []

    def ship(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.events or (not force and now - self._shipped_at < SHIP_INTERVAL):
            return
        events, self.events[:] = list(self.events), []
        self.sock.send_pyobj(self.scheduler.observer.with_snapshot(events, full_tree=self._full_tree))
        self._shipped_at, self._full_tree = now, False
