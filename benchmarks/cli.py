"""``sglite bench`` (found through the ``sglite.cli_plugins`` entry point)."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    from benchmarks import bench

    p = sub.add_parser("bench", help="throughput and latency side by side with Hugging Face transformers, "
                       "sglite's ablations, a results table and plots",
                       description=bench.__doc__, epilog=bench.epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    p.set_defaults(func=_run)
    from benchmarks import bench_serving

    p = sub.add_parser("bench-serving", help="load a serving endpoint (sglite serve, or any OpenAI-compatible "
                       "server) like SGLang's bench_serving: throughput, TTFT, TPOT, ITL, e2e",
                       description=bench_serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_serving.add_arguments(p)
    p.set_defaults(func=_run_serving)


def _run_serving(args: argparse.Namespace) -> int:
    from benchmarks import bench_serving

    return bench_serving.run(args)


def _run(args: argparse.Namespace) -> int:
    from benchmarks import bench

    return bench.run(args, prog="sglite")
