"""Side by side: sglite against its peers on the same model, weights, prompts and greedy
settings: Hugging Face transformers (static batches, float32 and bfloat16) and llama.cpp
as its users run it (llama-server with parallel slots, llama-batched-bench; F32, BF16
and the Q4_1 GGUF as shipped; built from source once, see benchmarks/llamacpp.py),
with sglite's feature ablations and the machine's roofline (matmul peak, read
bandwidth, the split of a decode forward); writes a markdown table, a JSON file and PNG
plots under benchmarks/results/.

    sglite bench                                  # every workload, the default ablations
    sglite bench --quick                          # small sizes: a few minutes
    sglite bench --workload shared-prefix --ablations radix-off,trace-2
    sglite bench --workload json-schema --no-roofline  # what a JSON schema costs per decode step
    python benchmarks/bench.py --quick --skip-baseline

Each configuration runs in its own process (so peak memory is its own), warms up,
then runs the whole workload, all requests submitted at once. A grammar workload
(json-schema) runs sglite alone: constrained against the same requests unconstrained,
in alternating pairs in one process (benchmarks/grammar.py). docs/benchmarks.md defines
every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python benchmarks/bench.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import grammar  # noqa: E402
from benchmarks.report import (  # noqa: E402
    LLAMA_TYPES, Row, compare_to_baseline, markdown_table, median_run, summarize, write_plots)
from benchmarks.workloads import WORKLOADS, Workload, build_workload  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
HF_BATCH_SIZES = (8, 64)
HF_BATCH_SIZES_QUICK = (4, 8)
GOALS = {"shared-prefix": 3.0, "random-lengths": 2.0}  # sglite's output throughput / transformers'
PREFILL_GOAL = 1.1  # prefill tokens computed / distinct prompt tokens, shared-prefix


@dataclass(frozen=True)
class Ablation:
    """One sglite variant: server-argument overrides (and a tracing level). A default
    ablation runs in a plain ``sglite bench`` on ``workloads``; one named with
    ``--ablations`` runs on every selected workload."""

    name: str
    label: str
    server_args: dict[str, Any]
    trace_level: int = 0
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    default: bool = True


ABLATIONS = [
    Ablation("radix-off", "sglite, radix cache off", {"disable_radix_cache": True}, workloads=("shared-prefix",)),
    Ablation("fcfs", "sglite, fcfs policy", {"schedule_policy": "fcfs"}, workloads=("shared-prefix",), default=False),
    Ablation("chunked-off", "sglite, chunked prefill off", {"chunked_prefill_size": -1}, workloads=("long-prompts",)),
    Ablation("mixed-chunk", "sglite, mixed chunk on", {"enable_mixed_chunk": True}, workloads=("long-prompts",)),
    # the default loop is event_loop_overlap on CUDA, event_loop_normal on a CPU: each
    # ablation forces one, and the one that differs from the main row runs (a CPU: overlap-on)
    Ablation("overlap-off", "sglite, normal loop", {"disable_overlap_schedule": True},
             workloads=("shared-prefix", "one-chat")),
    Ablation("overlap-on", "sglite, overlap loop", {"disable_overlap_schedule": False},
             workloads=("shared-prefix", "one-chat")),
    Ablation("trace-1", "sglite, tracing level 1", {}, 1, workloads=("shared-prefix",), default=False),
    Ablation("trace-2", "sglite, tracing level 2", {}, 2, workloads=("shared-prefix",)),
    # on a CPU the default attention backend is cpu (decode rows read by a C++ kernel)
    Ablation("torch-native", "sglite, torch_native attention", {"attention_backend": "torch_native"},
             workloads=("random-lengths",)),
    # --disable-deterministic-inference: on a CPU the same kernels run (the cpu backend is
    # batch-invariant by construction), so this row shows there is nothing to buy back
    # there; on CUDA (triton) it is the untiled extend kernel and batch-sized decode splits
    Ablation("deterministic-off", "sglite, deterministic inference off", {"enable_deterministic_inference": False},
             workloads=("shared-prefix", "one-chat"), default=False),
    # --dtype auto is bfloat16 on CPUs with bfloat16 dot products: the float32 row beside it
    Ablation("float32", "sglite, float32", {"dtype": "float32"}, workloads=("shared-prefix", "random-lengths",
                                                                          "one-chat")),
]

# the throughput workloads: the peers run these; a grammar workload is sglite's alone
ALL_WORKLOADS = tuple(n for n, w in WORKLOADS.items() if not w.paired)


@dataclass(frozen=True)
class Peer:
    """Another engine's configuration; ``group`` is what --peers names."""

    label: str
    engine: str  # a runner of benchmarks/runners.py
    settings: dict[str, Any]
    workloads: tuple[str, ...]
    group: str  # transformers, llama.cpp, llama-cpp-python


PEERS = [
    Peer("transformers", "transformers", {"dtype": "float32"}, ALL_WORKLOADS, "transformers"),
    Peer("transformers, bfloat16", "transformers", {"dtype": "bfloat16"}, ("shared-prefix", "one-chat"),
         "transformers"),
    *[Peer(f"llama-server {t}", "llama-server", {"model_type": t}, w, "llama.cpp") for t, w in [
        ("F32", ("shared-prefix", "random-lengths", "one-chat")), ("BF16", ALL_WORKLOADS),
        ("Q4_1", ("shared-prefix", "one-chat"))]],
    *[Peer(f"llama-batched-bench -pps {t}", "llama-batched-bench", {"model_type": t, "shared_prompt": True},
           ("shared-prefix",), "llama.cpp") for t in ("F32", "BF16", "Q4_1")],
    Peer("llama-cpp-python, one at a time (Q4_1)", "llama.cpp", {}, ("shared-prefix", "random-lengths"),
         "llama-cpp-python"),
]
PEER_GROUPS = ("transformers", "llama.cpp", "llama-cpp-python")


@dataclass
class Run:
    workload: Workload
    label: str
    engine: str  # sglite or a peer's runner
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    trace_level: int = 0
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # a peer's


# --- command line ---------------------------------------------------------------------


def epilog() -> str:
    lines = ["workloads:"]
    lines += [f"  {w.name:<16}{w.help}" for w in WORKLOADS.values()]
    lines += ["", "ablations (sglite variants; a plain run has those marked default, each on the workloads listed;",
              "one named in --ablations runs on every selected workload):"]
    for a in ABLATIONS:
        what = ", ".join(f"{k}={v}" for k, v in a.server_args.items()) or f"spans to a JSONL file at level {a.trace_level}"
        where = f"default: {', '.join(a.workloads)}" if a.default else "not in the default run"
        lines.append(f"  {a.name:<16}{what}  [{where}]")
    lines += ["", "A grammar workload (json-schema) runs sglite only (ablations too): each of its levels (batch 1, "
              "batch N) constrained and unconstrained in --pairs alternating pairs in one process, per decode step.",
              "", "Results: benchmarks/results/bench-DATE.md (+ .json, -throughput.png, -latency-WORKLOAD.png).",
              "See docs/benchmarks.md for what each number means."]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", action="append", choices=[*WORKLOADS, "all"], default=None,
                   help="workload to run (repeatable; default: all)")
    p.add_argument("--model-path", default="smollm2-135m", help="the model for every engine (smollm2-135m, "
                   "tiny-random, a .gguf file or a Hugging Face folder)")
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default: the workload's)")
    p.add_argument("--quick", action="store_true", help="small sizes (8 requests, short outputs): a few minutes")
    p.add_argument("--out", default=None, metavar="DIR", help=f"where results go (default: {RESULTS_DIR})")
    p.add_argument("--skip-baseline", action="store_true", help="run sglite only (no peers: same as --peers none)")
    p.add_argument("--peers", default="all", metavar="LIST",
                   help="peers to run: 'all' (default), 'none', or a comma list of transformers, llama.cpp (built "
                        "from source the first time, a few minutes), llama-cpp-python (when installed)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="sglite's dtype (default auto: bfloat16 on CPUs with AVX512-BF16 or AMX, else float32; "
                        "the float32 ablation runs beside it)")
    p.add_argument("--ablations", default="default", metavar="LIST",
                   help="'default', 'all' (every ablation on every workload), 'none', or a comma list of names, "
                        "which may include 'default': radix-off,trace-1 or default,trace-1")
    p.add_argument("--hf-batch-sizes", default=None, metavar="LIST",
                   help=f"static batch sizes transformers tries; the best is reported (default: "
                        f"{','.join(map(str, HF_BATCH_SIZES))}; --quick: {','.join(map(str, HF_BATCH_SIZES_QUICK))})")
    p.add_argument("--threads", type=int, default=None, help="torch threads for every engine (default: torch's, "
                   "usually the number of cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' prompts")
    p.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the machine's matmul peak and read bandwidth and put sglite's decode against "
                        "them (about a minute; default: on, off with --quick or with only a grammar workload)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every configuration N times, interleaved (A, B, A, B, ...) so a machine whose speed "
                        "drifts slows every configuration alike; each row is the median run (default: 1)")
    p.add_argument("--pairs", type=int, default=grammar.PAIRS, metavar="N",
                   help="a grammar workload (json-schema): alternating pairs, constrained then unconstrained, of "
                        f"each level in one process; its ratios are the pairs' medians (default: {grammar.PAIRS})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.split("\n\n")[0],
                                epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- planning -------------------------------------------------------------------------


def select_ablations(spec: str) -> dict[str, str]:
    """Ablation name -> where it runs: 'own' (its default workloads) or 'every' workload."""
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    known = {a.name for a in ABLATIONS}
    unknown = [t for t in tokens if t not in known | {"default", "all", "none"}]
    if unknown:
        raise ValueError(f"unknown ablation(s) {', '.join(unknown)}; known: {', '.join(known)}, default, all, none")
    if "all" in tokens:
        return {a.name: "every" for a in ABLATIONS}
    chosen = {a.name: "own" for a in ABLATIONS if a.default} if "default" in tokens else {}
    chosen.update({t: "every" for t in tokens if t in known})
    return chosen


def ablation_unavailable(a: Ablation) -> str:
    """Why an ablation cannot run in this build ('' when it can)."""
    from sglite.server_args import ServerArgs

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    missing = [k for k in a.server_args if k not in fields]
    if missing:
        return f"needs server argument {', '.join(missing)}, not in this build"
    if a.trace_level and importlib.util.find_spec("tracing") is None:
        return "needs the tracing package"
    return ""


def select_peers(spec: str) -> set[str]:
    tokens = {t.strip() for t in spec.split(",") if t.strip()}
    unknown = tokens - set(PEER_GROUPS) - {"all", "none"}
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(sorted(unknown))}; known: {', '.join(PEER_GROUPS)}, all, none")
    if "none" in tokens:
        return set()
    return set(PEER_GROUPS) if "all" in tokens else tokens


def plan(workloads: list[Workload], chosen: dict[str, str], peers: set[str], dtype: str,
         pairs: int = grammar.PAIRS) -> tuple[list[Run], list[str]]:
    """Every configuration of every workload. A grammar workload runs sglite's grammar
    runner (its ablations too, with ``pairs`` alternating pairs) and no peer."""
    runs: list[Run] = []
    notes: list[str] = []
    ablations = [a for a in ABLATIONS if a.name in chosen]
    for a in ablations:
        why = ablation_unavailable(a)
        if why:
            notes.append(f"ablation {a.name} skipped: {why}")
    for wl in workloads:
        base = {"max_total_tokens": wl.pool_tokens(), "dtype": dtype, **wl.server_args}
        engine, settings = ("sglite-grammar", {"pairs": pairs}) if wl.paired else ("sglite", {})
        runs.append(Run(wl, "sglite", engine, base, settings=settings))
        for a in ablations:
            if ablation_unavailable(a) or not (chosen[a.name] == "every" or wl.name in a.workloads):
                continue
            args = {**base, **a.server_args}
            if _effective(args) == _effective(base) and not a.trace_level:
                continue  # the workload already runs this way: the sglite row is it
            runs.append(Run(wl, a.label, engine, args, a.trace_level, settings))
        runs += [Run(wl, p.label, p.engine, settings=p.settings) for p in PEERS
                 if p.group in peers and wl.name in p.workloads]
    return runs, notes


def _effective(server_args: dict[str, Any]) -> Any:
    from sglite.server_args import ServerArgs

    return ServerArgs.from_kwargs(**server_args)


def baseline_unavailable() -> str:
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"transformers baseline skipped: {' and '.join(missing)} not installed "
                "(pip install -e '.[test]' installs them)")
    return ""


def available_peers(wanted: set[str], model_path: str) -> tuple[set[str], list[str]]:
    """The wanted peer groups that can run here (building llama.cpp the first time), and
    a note for each that cannot."""
    peers, notes = set(wanted), []
    if "transformers" in peers and (why := baseline_unavailable()):
        notes.append(why)
        peers.discard("transformers")
    if "llama-cpp-python" in peers and importlib.util.find_spec("llama_cpp") is None:
        peers.discard("llama-cpp-python")  # optional, not a dependency: no note
    gguf = model_path == "smollm2-135m" or model_path.endswith(".gguf")
    for group in ("llama.cpp", "llama-cpp-python"):
        if group in peers and not gguf:
            notes.append(f"{group} skipped: it needs a GGUF model")
            peers.discard(group)
    if "llama.cpp" in peers:
        from benchmarks import llamacpp as llama_cpp

        try:
            llama_cpp.build()
        except llama_cpp.BuildUnavailable as e:
            notes.append(f"llama.cpp skipped: {e}")
            peers.discard("llama.cpp")
    return peers, notes


# --- running --------------------------------------------------------------------------


def run_one(run: Run, model_path: str, threads: int, batch_sizes: list[int], pad_id: int, tmp: Path,
            index: int) -> dict[str, Any]:
    """Run one configuration in a fresh process; its progress lines pass through."""
    spec = {"engine": run.engine, "model_path": model_path, "threads": threads, "label": run.label,
            "prompts": run.workload.prompts, "output_lens": run.workload.output_lens,
            "server_args": run.server_args, "trace_level": run.trace_level,
            "batch_sizes": batch_sizes, "pad_id": pad_id, **run.settings}
    if run.workload.paired:
        spec.update(sampling=run.workload.sampling, levels=run.workload.grammar_levels)
    spec_path, out_path = tmp / f"spec-{index}.json", tmp / f"result-{index}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "TQDM_DISABLE": "1"}  # transformers' GGUF loader draws a progress bar over ours
    proc = subprocess.run([sys.executable, "-m", "benchmarks.runners", str(spec_path), str(out_path)],
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    if out_path.is_file():
        return json.loads(out_path.read_text())
    return {"ok": False, "error": f"worker exited with code {proc.returncode} and wrote no result"}


def measure_roofline(threads: int) -> dict[str, Any] | None:
    """benchmarks/roofline.py in its own process (its weights are a model's worth)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="sglite-roofline-") as tmp:
        out = Path(tmp) / "roofline.json"
        subprocess.run([sys.executable, "-m", "benchmarks.roofline", "--threads", str(threads), "--json", str(out)],
                       env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text()) if out.is_file() else None


def machine_line(threads: int) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
    except OSError:
        pass
    from sglite.model_executor.model_runner import cpu_bf16_flags

    bf16 = cpu_bf16_flags()
    cpu += f" ({', '.join(bf16) if bf16 else 'no avx512_bf16 or amx'})"
    try:
        ram = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GB RAM"
    except (ValueError, OSError, AttributeError):
        ram = ""
    versions = [f"torch {torch.__version__}"]
    for mod in ("transformers", "llama_cpp"):
        if importlib.util.find_spec(mod) is not None:
            from importlib.metadata import PackageNotFoundError, version

            try:
                versions.append(f"{mod.replace('_', '-')} {version(mod.replace('_', '-') + ('-python' if mod == 'llama_cpp' else ''))}")
            except PackageNotFoundError:
                pass
    from benchmarks import llamacpp

    if llamacpp.built():
        versions.append(f"llama.cpp of the {llamacpp.SDIST} sdist")
    return (f"{cpu}, {os.cpu_count()} cores{ram}; python {platform.python_version()}, {', '.join(versions)}; "
            f"{threads} torch threads")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# --- the document ---------------------------------------------------------------------


def _cli_flags(args: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in args.items())


def goal_lines(results: dict[str, tuple[Workload, list[Row]]], quick: bool) -> list[str]:
    def main_rows(name: str) -> tuple[Row | None, Row | None]:
        rows = results[name][1] if name in results else []
        return (next((r for r in rows if r.label == "sglite" and r.ok), None),
                next((r for r in rows if r.engine == "transformers" and r.ok), None))

    def mark(ok: bool) -> str:
        return "**met**" if ok else "**NOT met**"

    lines = []
    for name, goal in GOALS.items():
        ours, hf = main_rows(name)
        if ours is None or hf is None:
            continue
        x = ours.output_tok_s / hf.output_tok_s
        line = f"- {name}: sglite ≥ {goal:.0f}× transformers' output throughput: {mark(x >= goal)} ({x:.2f}×)"
        if name == "shared-prefix":
            same = ours.greedy_matches == ours.num_requests
            line += f"; identical greedy outputs: {mark(same)} ({ours.greedy_matches}/{ours.num_requests})"
        lines.append(line)
    ours, _ = main_rows("shared-prefix")
    if ours is not None and ours.prefill_ratio is not None:
        lines.append(f"- shared-prefix: prefill tokens computed ≤ {PREFILL_GOAL}× distinct prompt tokens: "
                     f"{mark(ours.prefill_ratio <= PREFILL_GOAL)} ({ours.prefill_ratio:.2f}×)")
    if lines and quick:
        lines.append("- (a --quick run: the goals are stated for the full-size workloads)")
    return lines


def workload_header(wl: Workload, rows: list[Row], run_args: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"## {wl.name}", "",
             f"{wl.title}. Prompt tokens: {wl.total_prompt_tokens:,} in all, {wl.distinct_prompt_tokens:,} distinct "
             f"(the union of the prompts' prefixes); {wl.total_output_tokens:,} output tokens."]
    base = run_args.get("sglite")
    if base is not None:
        lines[-1] += f" sglite runs with `{_cli_flags(base)}`."
    hf = next((r for r in rows if r.engine == "transformers" and r.ok), None)
    if hf is not None:
        sweep = ", ".join(f"{b}: {t:.1f}" for b, t in hf.details.get("sweep_tok_s", {}).items())
        lines[-1] += (f" transformers runs static batches of {hf.details.get('batch_size')} (output tok/s of each "
                      f"size's first batch: {sweep}).")
    repeated = [r for r in rows if r.ok and len(r.runs_output_tok_s) > 1]
    if repeated:
        lines.append(f"Each configuration ran {len(repeated[0].runs_output_tok_s)} times, in rounds (every "
                     "configuration once, then again); a row is its median run. Output tok/s of every run, in "
                     "order: " + "; ".join(f"{r.label} " + ", ".join(f"{t:.1f}" for t in r.runs_output_tok_s)
                                          for r in repeated) + ".")
    for r in rows:
        if r.ok and r.details.get("retracted"):
            lines.append(f"{r.label}: {r.details['retracted']} retractions.")
    return lines + [""]


def _row(results: dict[str, tuple[Workload, list[Row]]], workload: str, label: str) -> Row | None:
    rows = results[workload][1] if workload in results else []
    return next((r for r in rows if r.label == label and r.ok), None)



def _mark(ok: bool) -> str:
    return "**met**" if ok else "**NOT met**"


def _shared_prefix_goal(results: dict[str, tuple[Workload, list[Row]]]) -> list[str]:
    ours = _row(results, "shared-prefix", "sglite")
    llama = [r for r in results.get("shared-prefix", (None, []))[1] if r.ok and r.engine.startswith("llama-")]
    if ours is None or not llama:
        return []
    best = max(llama, key=lambda r: r.output_tok_s)
    x = ours.output_tok_s / best.output_tok_s
    line = (f"- shared-prefix: sglite ≥ 2× llama.cpp's best batched row ({best.label}, "
            f"{best.output_tok_s:.0f} tok/s): {_mark(x >= 2)} ({x:.2f}×)")
    same = [r for r in llama if r.details.get("dtype") == LLAMA_TYPES.get(ours.details.get("dtype", ""))]
    if same:
        b = max(same, key=lambda r: r.output_tok_s)
        y = ours.output_tok_s / b.output_tok_s
        line += f"; first milestone, ahead of it in the same dtype ({b.label}): {_mark(y > 1)} ({y:.2f}×)"
    return [line]


def _random_lengths_goal(results: dict[str, tuple[Workload, list[Row]]]) -> list[str]:
    ours = _row(results, "random-lengths", "sglite")
    if ours is None:
        return []
    peer = _row(results, "random-lengths", f"llama-server {LLAMA_TYPES.get(ours.details.get('dtype', ''), 'BF16')}")
    if peer is None:
        return []
    x = ours.output_tok_s / peer.output_tok_s
    return [f"- random-lengths: sglite ≥ 1.5× {peer.label} at the same concurrency (all at once): "
            f"{_mark(x >= 1.5)} ({x:.2f}×)"]


def _roofline_goals(results: dict[str, tuple[Workload, list[Row]]], roof: dict[str, Any]) -> list[str]:
    lines = []
    one = _row(results, "one-chat", "sglite")
    if one is not None and one.itl_p50_ms > 0:
        floor = roof["floor_ms"]["batch1_bf16_bandwidth"]
        f = floor / one.itl_p50_ms
        lines.append(f"- batch-1 decode ≥ 80 % of the bf16 bandwidth floor: {_mark(f >= 0.8)} "
                     f"({one.itl_p50_ms:.1f} ms/token, floor {floor:.1f} ms: {100 * f:.0f} %)")
    big, ours = roof["batch_big"], _row(results, "shared-prefix", "sglite")
    if ours is not None and ours.itl_p50_ms > 0 and ours.num_requests >= big:
        floor = roof["floor_ms"][f"batch{big}_bf16_matmul"]
        f = floor / ours.itl_p50_ms
        lines.append(f"- batch-{big} decode ≥ 50 % of the bf16 matmul floor: {_mark(f >= 0.5)} (shared-prefix "
                     f"ITL p50 {ours.itl_p50_ms:.0f} ms, floor {floor:.0f} ms: {100 * f:.0f} %)")
    return lines


def peer_goal_lines(results: dict[str, tuple[Workload, list[Row]]], roof: dict[str, Any] | None) -> list[str]:
    """Issue 28's goals: against llama.cpp's batched rows, and against the roofline."""
    return (_shared_prefix_goal(results) + _random_lengths_goal(results)
            + (_roofline_goals(results, roof) if roof is not None else []))


def roofline_lines(results: dict[str, tuple[Workload, list[Row]]], roof: dict[str, Any]) -> list[str]:
    from benchmarks.roofline import markdown as roofline_markdown

    lines = ["## Roofline", "", "Measured in this run (`python -m benchmarks.roofline`; docs/benchmarks.md says how).",
             "", *roofline_markdown(roof), "",
             "The split of sglite's decode forwards (the CPU graph times each part; mean per forward over the run's "
             "decode forwards) against the decode round the requests saw (ITL p50); what the forward does not "
             "account for is sampling, the scheduler and Python:", "",
             "| workload | decode round (ITL p50) ms | forward ms | linears | LM head | attention | norms, RoPE, SiLU "
             "| other in the forward | outside the forward |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (_, rows) in results.items():
        r = next((r for r in rows if r.label == "sglite" and r.ok), None)
        prof = r.details.get("decode_forward_profile") if r is not None else None
        if not prof or not prof.get("runs"):
            continue
        per = {k: v / prof["runs"] for k, v in prof.items() if k != "runs"}
        fwd = sum(per.values())
        parts = [per[k] for k in ("linear_ms", "lm_head_ms", "attention_ms", "norm_rope_act_ms", "other_ms")]
        lines.append(f"| {name} | {r.itl_p50_ms:.1f} | {fwd:.1f} | " + " | ".join(f"{v:.1f}" for v in parts)
                     + f" | {max(0.0, r.itl_p50_ms - fwd):.1f} |")
    return lines + [""]


def document_intro(results: dict[str, tuple[Workload, list[Row]]], threads: int, command: str, quick: bool,
                   date: str, commit: str) -> list[str]:
    """Title, machine, command and how the rows were measured (the throughput
    workloads' paragraph only where one ran; a grammar workload's is in its section)."""
    paired_only = all(wl.paired for wl, _ in results.values())
    title = "sglite: what constrained output costs per decode step" if paired_only else \
        "sglite vs transformers and llama.cpp"
    lines = [
        f"# {title}{' (quick run)' if quick else ''}, {date}", "",
        f"Machine: {machine_line(threads)}.", "",
        "```", f"$ {command}", "```", "",
        f"sglite {commit}. " if commit else "",
    ]
    if paired_only:
        return lines + ["[docs/benchmarks.md](../../docs/benchmarks.md) defines every column.", ""]
    return lines + [
        "Every request of a workload is submitted at once; greedy (temperature 0) with EOS ignored, so every "
        "engine generates exactly each request's output length; the same weights (the GGUF, dequantized, in the "
        "dtype a row names: sglite's main row runs --dtype auto; llama.cpp's F32 and BF16 files are the same "
        "weights requantized); the same number of threads; each configuration in its own process, after a "
        "warm-up. 'greedy = transformers' counts requests whose output ids equal those of transformers in the "
        "row's dtype (float32 where transformers did not run that dtype) exactly. "
        "[docs/benchmarks.md](../../docs/benchmarks.md) defines every column.",
        "",
    ]


def write_document(results: dict[str, tuple[Workload, list[Row]]], run_args: dict[str, dict[str, dict[str, Any]]],
                   out_dir: Path, stem: str, command: str, threads: int, quick: bool, notes: list[str],
                   roof: dict[str, Any] | None = None) -> Path:
    throughput = {name: v for name, v in results.items() if not v[0].paired}  # a grammar workload has no plots
    plots, plot_note = write_plots(throughput, out_dir, stem) if throughput else ([], "")
    date = datetime.date.today().isoformat()
    commit = git_commit()
    lines = document_intro(results, threads, command, quick, date, commit)
    goals = goal_lines(results, quick) + peer_goal_lines(results, roof)
    if goals:
        lines += ["Goals:", "", *goals, ""]
    for name, (wl, rows) in results.items():
        if wl.paired:
            lines += grammar.section(wl, rows, _cli_flags(run_args.get(name, {}).get("sglite", {})))
            continue
        lines += workload_header(wl, rows, run_args.get(name, {}))
        lines += [markdown_table(rows), ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots if p.stem.endswith(f"latency-{name}")]
        lines.append("")
    if plots:
        lines += [f"![throughput]({plots[0].name})", ""]
    if roof is not None:
        lines += roofline_lines(results, roof)
    for note in notes + ([plot_note] if plot_note else []):
        lines.append(f"- {note}")
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(ln for ln in lines).replace("\n\n\n", "\n\n") + "\n")
    data = {
        "date": date, "command": command, "machine": machine_line(threads), "commit": commit, "quick": quick,
        "notes": notes + ([plot_note] if plot_note else []), "plots": [p.name for p in plots], "roofline": roof,
        "workloads": {name: {"title": wl.title, "num_requests": wl.num_requests,
                             "total_prompt_tokens": wl.total_prompt_tokens,
                             "distinct_prompt_tokens": wl.distinct_prompt_tokens,
                             "total_output_tokens": wl.total_output_tokens,
                             "rows": [r.public() for r in rows]}
                      for name, (wl, rows) in results.items()},
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1))
    return path


# --- main -----------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> list[int]:
    """Every argument, before anything loads (a ValueError names the bad one); returns
    the transformers batch sizes to try."""
    from sglite.cli import check_model_path

    for flag, value in (("--repeat", args.repeat), ("--requests", args.requests), ("--threads", args.threads),
                        ("--pairs", args.pairs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    check_model_path(args.model_path)
    select_ablations(args.ablations)
    select_peers(args.peers)
    if not args.hf_batch_sizes:
        return list(HF_BATCH_SIZES_QUICK if args.quick else HF_BATCH_SIZES)
    try:
        sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--hf-batch-sizes must be a comma list of positive integers, got {args.hf_batch_sizes!r}")
    return sizes


def resolve_dtype_and_peers(args: argparse.Namespace, names: list[str]) -> tuple[str, set[str], list[str]]:
    """sglite's dtype (what --dtype resolves to here), the peer groups that can run, and
    a note for each wanted one that cannot (said now, and put under the tables). A peer
    group with no configuration on the selected workloads is not wanted (json-schema
    alone builds no llama.cpp)."""
    from sglite.model_executor.model_runner import resolve_dtype
    from sglite.server_args import resolve_device

    dtype = str(resolve_dtype(args.dtype, resolve_device("auto"))).removeprefix("torch.")
    wanted = set() if args.skip_baseline else select_peers(args.peers)
    wanted &= {p.group for p in PEERS if set(p.workloads) & set(names)}
    peers, notes = available_peers(wanted, args.model_path)
    for n in notes:
        say(f"note: {n}")
    return dtype, peers, notes


def progress_line(row: Row, took: float) -> str:
    if not row.ok:
        return f"      -> failed: {row.error}"
    levels = row.details.get("levels")
    if levels is not None:  # a grammar row
        return f"      -> {took:.0f} s: " + "; ".join(
            f"batch {lv['batch']}: constrained / unconstrained {statistics.median(lv['ratios']):.3f}× per decode "
            "step" for lv in levels)
    return (f"      -> {took:.0f} s: {row.output_tok_s:.1f} output tok/s, TTFT p50 {row.ttft_p50:.2f} s, "
            f"ITL p50 {row.itl_p50_ms:.0f} ms, peak {row.peak_rss_mb:.0f} MB")


def run_plan(runs: list[Run], workloads: list[Workload], args: argparse.Namespace, sizes: list[int], threads: int,
             pad_id: int, tic: float) -> tuple[dict[str, tuple[Workload, list[Row]]], dict[str, dict[str, Any]]]:
    """Every configuration in its own process, each workload's in rounds (all of them
    once, then again: --repeat), so that drift in the machine's speed reaches every
    configuration of a comparison; one row per configuration (its median run)."""
    results: dict[str, tuple[Workload, list[Row]]] = {wl.name: (wl, []) for wl in workloads}
    run_args: dict[str, dict[str, dict[str, Any]]] = {wl.name: {} for wl in workloads}
    order = [(rnd, r) for wl in workloads for rnd in range(args.repeat) for r in runs if r.workload is wl]
    runs_of: dict[int, list[Row]] = {id(r): [] for r in runs}
    with tempfile.TemporaryDirectory(prefix="sglite-bench-") as tmp:
        for i, (rnd, r) in enumerate(order, 1):
            which = f", run {rnd + 1}/{args.repeat}" if args.repeat > 1 else ""
            say(f"[{i}/{len(order)}] {r.workload.name} · {r.label}{which}  ({time.monotonic() - tic:.0f} s so far)")
            t = time.monotonic()
            res = run_one(r, args.model_path, threads, sizes, pad_id, Path(tmp), i)
            row = (grammar.summarize if r.workload.paired else summarize)(r.label, r.engine, r.workload, res)
            runs_of[id(r)].append(row)
            run_args[r.workload.name][r.label] = r.server_args
            say(progress_line(row, time.monotonic() - t))
    for r in runs:
        results[r.workload.name][1].append(median_run(runs_of[id(r)]))
    return results, run_args


def run(args: argparse.Namespace, prog: str = "python benchmarks/bench.py", argv: list[str] | None = None) -> int:
    sizes = check_args(args)
    import torch

    from sglite.model_loader import ModelLoadError, load_model

    tic = time.monotonic()
    names = list(WORKLOADS) if not args.workload or "all" in args.workload else list(dict.fromkeys(args.workload))
    chosen = select_ablations(args.ablations)
    threads = args.threads or torch.get_num_threads()
    dtype, peers, notes = resolve_dtype_and_peers(args, names)

    try:
        model = load_model(args.model_path)  # downloads / converts once, before anything is timed
    except ModelLoadError as e:
        say(f"error: {e}")
        return 1
    tok, cfg = model.tokenizer, model.config
    del model
    if tok is None:
        say("error: the benchmark builds its prompts with the model's tokenizer; this model has none")
        return 1
    workloads = [build_workload(n, tok, cfg.vocab_size, cfg.context_len, args.requests, args.quick, args.seed)
                 for n in names]
    runs, plan_notes = plan(workloads, chosen, peers, dtype, args.pairs)
    notes += plan_notes
    pad_id = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0

    out_dir = Path(args.out) if args.out else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "-".join(["bench"] + (["quick"] if args.quick else []) +
                    (names if len(names) < len(WORKLOADS) else []) + [datetime.date.today().isoformat()])
    say(f"sglite bench: model {args.model_path} ({dtype}), {threads} torch threads, {len(runs)} runs:")
    for wl in workloads:
        say(f"  {wl.name}: " + ", ".join(r.label for r in runs if r.workload is wl))
    for n in plan_notes:
        say(f"note: {n}")

    results, run_args = run_plan(runs, workloads, args, sizes, threads, pad_id, tic)
    for wl, rows in results.values():
        compare_to_baseline(rows, next((r for r in rows if r.engine == "transformers"), None))
    roof = None
    # default: on, but not for --quick nor for grammar workloads alone (nothing to put against it)
    if args.roofline if args.roofline is not None else not (args.quick or all(wl.paired for wl in workloads)):
        say(f"roofline: the machine's matmul peak and read bandwidth ({time.monotonic() - tic:.0f} s so far)")
        roof = measure_roofline(threads)
        if roof is None:
            notes.append("roofline: the measurement failed (see the bench's output)")

    command = " ".join([prog, *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    path = write_document(results, run_args, out_dir, stem, command.strip(), threads, args.quick, notes, roof)
    print(path.read_text())
    say(f"wrote {path} (+ .json and plots) in {(time.monotonic() - tic) / 60:.1f} min")
    return 0 if all(r.ok for _, rows in results.values() for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv=argv)
    except ValueError as e:
        say(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
