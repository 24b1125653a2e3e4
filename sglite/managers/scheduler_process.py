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
from multiprocessing.connection import Connection
from typing import Any, Callable

from sglite.managers.io_struct import BatchTokenIDOut
from sglite.server_args import PortArgs, ServerArgs

IDLE_POLL_MS = 500  # how long an idle scheduler waits for a request before looking at its parent


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe: Connection,
                          metrics_labels: dict[str, str] | None = None, viewer_args: Any = None) -> None:
    """``viewer_args``: the CLI's viewer options (--record, tracing): they attach to
    this process's EventBus, as to an offline Engine's, and are closed (spans flushed,
    the recording ended) when the server stops this process with SIGTERM."""
    from sglite.engine import _setup_logging
    from sglite.managers.scheduler import Scheduler

    _setup_logging(server_args.log_level)
    parent = os.getppid()
    try:
        scheduler = Scheduler(server_args)
    except BaseException as e:  # noqa: BLE001 - the parent prints it and exits
        pipe.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    close_viewers = _attach_viewers(scheduler, server_args, viewer_args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _serve(scheduler, server_args, port_args, pipe, metrics_labels, parent)
    except SystemExit:
        pass
    finally:
        close_viewers()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _attach_viewers(scheduler: Any, server_args: ServerArgs, viewer_args: Any) -> Callable[[], None]:
    if viewer_args is None:
        return lambda: None
    from types import SimpleNamespace

    from sglite.cli import attach_viewers

    return attach_viewers(SimpleNamespace(event_bus=scheduler.event_bus, server_args=server_args), viewer_args)


def _serve(scheduler: Any, server_args: ServerArgs, port_args: PortArgs, pipe: Connection,
           metrics_labels: dict[str, str] | None, parent: int) -> None:
    import zmq

    from sglite.metrics.collector import SchedulerMetricsCollector

    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(port_args.scheduler_input_ipc_name)
    to_detokenizer = ctx.socket(zmq.PUSH)
    to_detokenizer.connect(port_args.detokenizer_ipc_name)
    to_tokenizer = ctx.socket(zmq.PUSH)
    to_tokenizer.connect(port_args.tokenizer_ipc_name)
    outputs: list[BatchTokenIDOut] = []
    scheduler.send_to_detokenizer = outputs.append
    scheduler.send_to_tokenizer = to_tokenizer.send_pyobj
    metrics = SchedulerMetricsCollector(metrics_labels) if metrics_labels is not None else None
    pipe.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens,
               "max_req_input_len": scheduler.max_req_input_len, "tokenizer": scheduler.tokenizer,
               "vocab_size": scheduler.model_config.vocab_size,
               "context_len": scheduler.tp_worker.model_runner.context_len, "pid": os.getpid()})
    loop = scheduler.event_loop()
    while os.getppid() == parent:  # the server went away: so does its scheduler
        received = _recv_requests(recv, scheduler, block=not scheduler.has_work())
        if not received and not scheduler.has_work():
            continue
        next(loop)
        if outputs:
            to_detokenizer.send_pyobj(list(outputs))
            outputs.clear()
        if metrics is not None:
            metrics.update(scheduler, force=not scheduler.has_work())  # an idle server reports 0 running


def _recv_requests(sock: Any, scheduler: Any, block: bool) -> int:
    """Move what arrived on the socket into the scheduler's queue (its recv_requests
    takes it at the start of the next iteration); wait a little when ``block``."""
    import zmq

    if block and not sock.poll(IDLE_POLL_MS):
        return 0
    n = 0
    while True:
        try:
            scheduler.send(sock.recv_pyobj(zmq.NOBLOCK))
            n += 1
        except zmq.Again:
            return n
