"""``sglite tui``: the live scheduler view."""

from __future__ import annotations

import argparse
import sys


def add_commands(sub: argparse._SubParsersAction) -> None:
    from sglite.cli import add_engine_arguments

    p = sub.add_parser("tui", help="watch the scheduler live in the terminal (the default: smollm2 on the demo workload)")
    p.add_argument("--workload", default="demo",
                   help="demo, shared-prefix, long-prompts, pool-pressure, steady, or a .jsonl file")
    p.add_argument("--paused", action="store_true", help="start paused (n steps one iteration)")
    add_engine_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from sglite.cli import attach_viewers
    from sglite.engine import Engine
    from sglite.model_loader import ModelLoadError
    from sglite.server_args import ServerArgs
    from tui.app import SchedulerApp
    from tui.workloads import load

    try:
        workload = load(args.workload)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    defaults = ServerArgs()
    kwargs = vars(ServerArgs.from_cli_args(args))
    for k, v in workload.server_args.items():  # the scenario's needs, unless given on the command line
        if kwargs.get(k) == getattr(defaults, k):
            kwargs[k] = v
    kwargs["log_level"] = "error"  # log lines would tear the screen; the events panel shows them
    try:
        engine = Engine(**kwargs)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    close = attach_viewers(engine, args)
    try:
        SchedulerApp(engine, workload, paused=args.paused).run()
    finally:
        close()
    return 0
