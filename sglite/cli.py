"""The ``sglite`` command."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Callable, NoReturn, Sequence

from sglite.server_args import KNOWN_MODELS, ServerArgs


def plugins() -> list[ModuleType]:
    """Viewer packages (tracing, tui, walkthroughs) add their options and commands
    through the ``sglite.cli_plugins`` entry point; the engine never imports them."""
    found = []
    for ep in sorted(entry_points(group="sglite.cli_plugins"), key=lambda e: e.name):
        try:
            found.append(ep.load())
        except ImportError as e:  # a viewer's optional dependency is missing
            print(f"warning: sglite plugin {ep.name!r} unavailable: {e}", file=sys.stderr)
    return found


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of every command that runs an engine."""
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--record", default=None, metavar="PATH",
                        help="write every engine event as JSON lines (replay it, or convert it with `sglite trace`)")
    for plugin in plugins():
        if hasattr(plugin, "add_engine_arguments"):
            plugin.add_engine_arguments(parser)


def check_output_path(path: str | None, flag: str) -> None:
    """A file an option will write: its folder must exist (checked before any loading)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder, not a file")


def check_model_path(model: str) -> None:
    """--model-path names a registry model or something that exists (before loading)."""
    if model not in KNOWN_MODELS and not os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"--model-path {model!r}: not a file or folder, and not one of: {', '.join(KNOWN_MODELS)}")


def check_engine_args(args: argparse.Namespace) -> ServerArgs:
    """Everything about an engine command's arguments that can be known before loading
    anything: the model path names a model or exists, output files have a folder, the
    plugins' options are sane, and every server argument is in range. Raises ValueError
    with a one-line reason (``main`` prints it), well under a second after the start."""
    check_model_path(args.model_path)
    check_output_path(getattr(args, "record", None), "--record")
    for plugin in plugins():
        if hasattr(plugin, "check_args"):
            plugin.check_args(args)
    return ServerArgs.from_cli_args(args)


def attach_viewers(engine: Any, args: argparse.Namespace) -> Callable[[], None]:
    """Subscribe the recorder and the plugins' viewers; returns what closes them."""
    from sglite.events import EventRecorder
    from sglite.replay import header_for

    closers: list[Callable[[], None]] = []
    if getattr(args, "record", None):
        rec = EventRecorder(args.record, header_for(engine))  # sglite replay --rerun rebuilds the engine
        unsubscribe = engine.event_bus.subscribe(rec, snapshots=True)  # `sglite tui --replay` shows state
        closers += [rec.close, unsubscribe]
    for plugin in plugins():
        if hasattr(plugin, "attach"):
            closer = plugin.attach(engine.event_bus, args, engine.server_args.model_path)
            if closer is not None:
                closers.append(closer)

    def close() -> None:
        for c in reversed(closers):
            c()

    return close


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streaming tokens to the terminal",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--show-stats", action="store_true", help="print token counts and latency after the text")
    add_engine_arguments(p)
    p.set_defaults(func=_run_generate)


def _sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop": args.stop}


def _run_generate(args: argparse.Namespace) -> int:
    from sglite.sampling.sampling_params import SamplingParams

    SamplingParams.from_dict(_sampling_params(args)).verify()  # before anything loads
    if not args.chat and args.prompt == "":
        raise ValueError("the prompt is empty")  # (the gate's words; it would say so after the model loads)
    server_args = check_engine_args(args)
    from sglite.engine import Engine

    engine = Engine(**vars(server_args))
    close_viewers = attach_viewers(engine, args)
    try:
        return _generate(engine, args)
    finally:
        engine.shutdown()
        close_viewers()


def _generate(engine: Any, args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        stream = engine.generate(messages=messages, sampling_params=params, stream=True)
    else:
        stream = engine.generate(args.prompt, sampling_params=params, stream=True)
    meta: dict = {}
    for chunk in stream:
        if chunk.get("error"):
            print(f"error: {chunk['error']}", file=sys.stderr)
            return 1
        sys.stdout.write(chunk["text"])
        sys.stdout.flush()
        if chunk["finished"]:
            meta = chunk["meta_info"]
    sys.stdout.write("\n")
    if args.show_stats and meta:
        ttft = meta.get("time_to_first_token")
        print(f"[{meta['prompt_tokens']} prompt tokens, {meta['completion_tokens']} generated, "
              f"finish {meta['finish_reason']}, ttft {ttft:.3f}s, e2e {meta['e2e_latency']:.3f}s]", file=sys.stderr)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    for name in ("serve", "launch_server"):
        p = sub.add_parser(name, help="serve HTTP: OpenAI /v1/* and SGLang's native routes (docs/serving.md)"
                           if name == "serve" else "the same as serve (SGLang's name)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--host", default="127.0.0.1", help="address to listen on")
        p.add_argument("--port", type=int, default=30000, help="port to listen on")
        p.add_argument("--enable-metrics", action="store_true", help="Prometheus metrics at /metrics (sglang:* names)")
        p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model-path)")
        p.add_argument("--enable-debug-control", action="store_true",
                       help="let POST /debug/control pause and step the scheduler (sglite tui --attach); off, a "
                            "server cannot be paused by anyone")
        _add_security_arguments(p)
        add_engine_arguments(p)  # server arguments, --record and the tracing options (the scheduler's process)
        # SGLang's default level: the startup line, Prefill / Decode batch lines, aborts
        p.set_defaults(func=_run_serve, log_level="info")


def _add_security_arguments(p: argparse.ArgumentParser) -> None:
    """docs/serving.md, "Security"."""
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /health_generate and "
                        "/metrics (default: $SGLITE_API_KEY; none: no key)")
    p.add_argument("--enable-debug-events", action="store_true",
                   help="let GET /debug/events stream the scheduler's events (sglite tui --attach): they hold every "
                        "client's prompts and outputs; off, no route shows one client's data to another")
    p.add_argument("--max-body-size", default="32M", help="largest request body, e.g. 32M, 512K (bigger: 413)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names clients may use in Host and Origin besides IP addresses and "
                        "localhost (a DNS-rebinding and cross-site guard); '*' accepts any")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="/metrics needs the --api-key too (off: Prometheus scrapes without a token)")


def _run_serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    from sglite.entrypoints.http_security import parse_size
    from sglite.entrypoints.launch_server import ServeArgs, health_check_timeout, launch_server

    api_key = args.api_key or os.environ.get("SGLITE_API_KEY") or None  # (not the default: --help would print it)
    serve = ServeArgs(args.host, args.port, args.enable_metrics, args.served_model_name, args.enable_debug_control,
                      api_key, args.enable_debug_events, parse_size(args.max_body_size),
                      tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
                      args.metrics_require_api_key, health_check_timeout())
    if args.metrics_require_api_key and not api_key:
        raise ValueError("--metrics-require-api-key needs --api-key (or SGLITE_API_KEY)")
    server_args = check_engine_args(args)
    viewer_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("func", "api_key")})
    return launch_server(server_args, serve, viewer_args)


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line naming the command and where its options are listed
    (argparse printed the whole usage first: 40 lines for generate). Subcommands'
    parsers are of this class too (add_subparsers makes them of the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="sglite", description="A small SGLang-style inference engine built to be watched.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(_commands=sub.choices)  # main() names the command an unknown argument was given to
    _add_generate(sub)
    _add_serve(sub)
    from sglite.replay import add_command as add_replay

    add_replay(sub)
    for plugin in plugins():
        if hasattr(plugin, "add_commands"):
            plugin.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    commands = vars(args).pop("_commands")  # (parsers: args travel to other processes, pickled)
    if unknown:  # told by the command's parser, not the top-level one
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `sglite explain ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file to write into a missing folder, a file that cannot be read
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:
        from sglite.model_loader.errors import ModelLoadError  # (here: importing sglite.model_loader imports torch)

        if not isinstance(e, ModelLoadError):
            raise
        print(f"error: {e}", file=sys.stderr)  # a model that cannot be found or read, wherever it was loaded
        return 1


if __name__ == "__main__":
    sys.exit(main())
