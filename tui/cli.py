"""``sglite tui``: the live scheduler view, or a recording replayed."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_commands(sub: argparse._SubParsersAction) -> None:
    from sglite.cli import add_engine_arguments

    p = sub.add_parser("tui", help="watch the scheduler live in the terminal (the default: smollm2 on the demo workload)")
    p.add_argument("--workload", default="demo",
                   help="demo, shared-prefix, long-prompts, pool-pressure, steady, or a .jsonl file")
    p.add_argument("--paused", action="store_true", help="start paused (n steps one iteration)")
    p.add_argument("--attach", metavar="URL", default=None,
                   help="show a running `sglite serve` (e.g. http://127.0.0.1:30000) instead of starting an engine; "
                        "it needs the server's --enable-debug-events, and pause and step its --enable-debug-control")
    p.add_argument("--api-key", default=None,
                   help="with --attach: the server's --api-key (default: $SGLITE_API_KEY)")
    p.add_argument("--replay", metavar="RECORDING", default=None,
                   help="show a recording made with --record instead of running the engine "
                        "(n/→ next iteration, b/← back, space play)")
    p.add_argument("--compare", metavar="RECORDING", default=None,
                   help="with --replay A: show recording B beside A, both stepped by iteration; f jumps to the "
                        "next iteration where their schedulers decided differently (docs/why.md)")
    add_engine_arguments(p)
    p.set_defaults(func=_run)


NOT_A_TERMINAL = ("sglite tui draws in a terminal, and {what} is not one (piped or redirected): run it "
                  "without | or >; to keep a run, add --record FILE and view it with sglite tui --replay FILE")


def check_terminal() -> None:
    """The screen needs a terminal on both ends: a pipe would get escape codes drawn
    for a made-up 80x24, and keys could not reach it."""
    for what, stream in (("stdout", sys.stdout), ("stdin", sys.stdin)):
        if stream is None or not stream.isatty():
            raise ValueError(NOT_A_TERMINAL.format(what=what))


def _run(args: argparse.Namespace) -> int:
    if args.compare and not args.replay:
        raise ValueError("--compare B needs --replay A: it shows two recordings side by side")
    if args.replay:
        return _replay(args.replay, args.compare)
    if args.attach:
        return _attach(args.attach, args.api_key or os.environ.get("SGLITE_API_KEY") or None)
    import dataclasses

    from sglite.cli import check_engine_args
    from sglite.server_args import ServerArgs
    from tui.workloads import load

    # every argument is checked before anything loads (main prints the ValueError)
    workload = load(args.workload)
    kwargs = vars(check_engine_args(args))
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    for k, v in workload.server_args.items():  # the scenario's needs, unless given on the command line
        if getattr(args, k) == defaults[k]:
            kwargs[k] = v
    check_terminal()
    return _live(args, kwargs)


def _live(args: argparse.Namespace, kwargs: dict) -> int:
    from tui.app import LiveFeed, SchedulerApp
    from tui.host import serve_in_process, yield_cpu_to_engine

    kwargs["log_level"] = "error"  # log lines would tear the screen; the events panel shows them
    print(f"sglite tui: loading {kwargs['model_path']} in the engine process ...", file=sys.stderr, flush=True)
    viewer_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    connection = serve_in_process(kwargs, args.workload, args.paused, viewer_args)
    try:
        info = connection.wait_ready()
    except RuntimeError as e:
        connection.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    yield_cpu_to_engine(connection)
    SchedulerApp(LiveFeed(connection, info), title=info["model"], paused=args.paused).run()
    return 0


def _attach(url: str, api_key: str | None) -> int:
    from tui.app import LiveFeed, SchedulerApp
    from tui.remote import RemoteConnection

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--attach needs a URL like http://127.0.0.1:30000, got {url!r}")
    check_terminal()
    connection = RemoteConnection(url, api_key)
    try:
        info = connection.wait_ready()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    SchedulerApp(LiveFeed(connection, info), title=f"{info['model']} · attached to {url}").run()
    return 0


def _load_recording(path: str) -> list | None:
    """A recording's events, or None after saying in one line why it cannot be read."""
    from sglite.events import load_events

    try:
        return list(load_events(path))
    except OSError as e:
        print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, json.JSONDecodeError):
            msg = e.msg
        elif isinstance(e, KeyError):
            msg = f"an event has no {e.args[0]!r} field"
        else:
            msg = str(e)
        print(f"error: {path} is not an sglite recording (--record writes one): {msg}", file=sys.stderr)
    return None


def _replay(path: str, compare: str | None = None) -> int:
    from tui.app import SchedulerApp
    from tui.state import build_views

    events = _load_recording(path)
    other = _load_recording(compare) if compare and events is not None else None
    if events is None or (compare and other is None):
        return 1
    if compare:
        return _compare(path, events, compare, other)
    views, builder = build_views(events)
    if not views:
        print(f"error: {path} holds no scheduler iterations", file=sys.stderr)
        return 1
    check_terminal()
    SchedulerApp(views=views, builder=builder, title=f"replay {path}").run()
    return 0


def _compare(path_a: str, events_a: list, path_b: str, events_b: list) -> int:
    from tui.compare import CompareApp, Run

    runs = [Run.of(f"{side} {p}", events) for side, p, events in (("A", path_a, events_a), ("B", path_b, events_b))]
    for run, p in zip(runs, (path_a, path_b)):
        if not run.views:
            print(f"error: {p} holds no scheduler iterations", file=sys.stderr)
            return 1
    check_terminal()
    CompareApp(*runs).run()
    return 0
