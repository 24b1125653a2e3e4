"""A load generator for a serving endpoint, shaped like SGLang's ``bench_serving``:
``sglite bench-serving --base-url http://127.0.0.1:30000 --max-concurrency 32``.

Requests come from the benchmark workloads (``shared-prefix``, ``random-lengths``,
``long-prompts``: token ids, so ``--tokenizer`` names the model whose tokenizer builds
them) or from a JSONL file (``{"prompt": ...}`` or ``{"messages": [...]}`` and
``"max_tokens"``, one a line). They are sent at ``--request-rate`` (a Poisson process;
``inf`` sends all at once), at most ``--max-concurrency`` in flight, streamed, to
``--backend``: ``sglite`` (SGLang's native /generate), ``openai`` (/v1/completions) or
``openai-chat`` (/v1/chat/completions), so any OpenAI-compatible server can be measured.
Every request generates exactly its output length (``ignore_eos``). The report is
SGLang's "Serving Benchmark Result": throughput, and mean / median / p99 of TTFT,
TPOT, ITL and end-to-end latency in milliseconds, measured at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

BACKENDS = {"sglite": "/generate", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class Request:
    prompt: list[int] | str | None = None
    messages: list[dict[str, str]] | None = None
    output_len: int = 64
    prompt_len: int = 0


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # tokens the server says it generated
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks


def _body(backend: str, req: Request, model: str) -> dict[str, Any]:
    if backend == "sglite":
        key = "input_ids" if isinstance(req.prompt, list) else "text"
        return {key: req.prompt, "stream": True, "sampling_params": {
            "max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True}}
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        return body | {"messages": req.messages or [{"role": "user", "content": str(req.prompt)}]}
    return body | {"prompt": req.prompt}


def _tokens_in(backend: str, event: dict[str, Any]) -> int | None:
    """The completion token count an event reports (the last one wins)."""
    if backend == "sglite":
        return event.get("meta_info", {}).get("completion_tokens")
    usage = event.get("usage")
    return usage.get("completion_tokens") if usage else None


async def send_one(client: Any, url: str, backend: str, req: Request, model: str) -> Result:
    res = Result(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=_body(backend, req, model)) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"])[:200]
                    return res
                now = time.perf_counter()
                if _has_text(backend, event):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                res.output_len = _tokens_in(backend, event) or res.output_len
    except Exception as e:  # noqa: BLE001 - one failed request is a row in the report, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e, res.ok = time.perf_counter() - start, True
    return res


def _has_text(backend: str, event: dict[str, Any]) -> bool:
    if backend == "sglite":
        return bool(event.get("output_ids"))
    choices = event.get("choices") or []
    return bool(choices) and bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


async def run_load(base_url: str, backend: str, reqs: list[Request], model: str, request_rate: float,
                   max_concurrency: int | None, seed: int = 0) -> tuple[list[Result], float]:
    """Send every request (Poisson arrivals at ``request_rate``, at most
    ``max_concurrency`` in flight); the results in request order and the duration."""
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency or len(reqs))
    limits = httpx.Limits(max_connections=(max_concurrency or len(reqs)) + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        async def one(req: Request) -> Result:
            async with gate:
                return await send_one(client, base_url + BACKENDS[backend], backend, req, model)

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": 1000 * statistics.fmean(values), "median": 1000 * statistics.median(values), "p99": 1000 * p99}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "input_token_throughput": in_tokens / duration,
        "output_token_throughput": out_tokens / duration, "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens, "concurrency": sum(r.e2e for r in ok) / duration,
        "ttft_ms": _ms([r.ttft for r in ok]), "tpot_ms": _ms(tpot), "itl_ms": _ms([g for r in ok for g in r.itl]),
        "e2e_ms": _ms([r.e2e for r in ok]), "errors": sorted({r.error for r in results if r.error})[:5],
    }


def report(summary: dict[str, Any], title: str) -> str:
    lines = [f"{' Serving Benchmark Result ':=^60}", f"{title}"]
    for key, label in (("successful_requests", "Successful requests"), ("failed_requests", "Failed requests"),
                       ("duration_s", "Benchmark duration (s)"), ("total_input_tokens", "Total input tokens"),
                       ("total_output_tokens", "Total generated tokens"),
                       ("request_throughput", "Request throughput (req/s)"),
                       ("input_token_throughput", "Input token throughput (tok/s)"),
                       ("output_token_throughput", "Output token throughput (tok/s)"),
                       ("concurrency", "Concurrency")):
        v = summary[key]
        lines.append(f"{label:<40}{v:>20.2f}" if isinstance(v, float) else f"{label:<40}{v:>20}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {label} (ms)':<40}{summary[key][stat]:>20.2f}")
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def load_requests(args: argparse.Namespace) -> list[Request]:
    if args.dataset.endswith(".jsonl"):
        return _jsonl_requests(args.dataset, args.num_prompts)
    from benchmarks.workloads import WORKLOADS

    if args.dataset not in WORKLOADS:
        raise ValueError(f"unknown dataset {args.dataset!r}; known: {', '.join(WORKLOADS)}, or a .jsonl file")
    from benchmarks.workloads import build_workload
    from sglite.model_loader import load_model

    model = load_model(args.tokenizer)
    wl = build_workload(args.dataset, model.tokenizer, model.config.vocab_size, model.config.context_len,
                        args.num_prompts, args.quick, args.seed)
    return [Request(prompt=p, output_len=n, prompt_len=len(p)) for p, n in zip(wl.prompts, wl.output_lens)]


def _jsonl_requests(path: str, limit: int | None) -> list[Request]:
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                reqs.append(Request(prompt=d.get("prompt"), messages=d.get("messages"),
                                    output_len=int(d.get("max_tokens", 64))))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: not a request line ({e})") from None
    return reqs[:limit] if limit else reqs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server to load")
    p.add_argument("--backend", choices=tuple(BACKENDS), default="sglite",
                   help="sglite: /generate; openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name sent to OpenAI routes (default: the server's first)")
    p.add_argument("--dataset", default="shared-prefix",
                   help="shared-prefix, random-lengths, long-prompts, or a .jsonl file")
    p.add_argument("--tokenizer", default="smollm2-135m", help="the model whose tokenizer builds the workloads")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default: the workload's)")
    p.add_argument("--quick", action="store_true", help="the workloads' small sizes")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="append the summary as one JSON line")


def check_args(args: argparse.Namespace) -> None:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    import httpx

    try:
        models = httpx.get(f"{args.base_url}/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        print(f"error: no server answers at {args.base_url} ({type(e).__name__})", file=sys.stderr)
        return 1
    model = args.model or models[0]["id"]
    reqs = load_requests(args)
    print(f"bench-serving: {len(reqs)} requests to {args.base_url} ({args.backend}), rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency or 'unlimited'} ...", file=sys.stderr, flush=True)
    results, duration = asyncio.run(run_load(args.base_url, args.backend, reqs, model, args.request_rate,
                                             args.max_concurrency, args.seed))
    summary = summarize(results, duration)
    print(report(summary, f"backend {args.backend}, dataset {args.dataset}, model {model}"))
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"}, **summary}) + "\n")
    return 0 if summary["failed_requests"] == 0 else 1


__all__ = ["Request", "Result", "add_arguments", "run", "run_load", "summarize", "report"]
