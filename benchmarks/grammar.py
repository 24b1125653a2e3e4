"""What constrained output costs per decode step: a grammar workload (json-schema) in
one sglite process, each level (batch 1: requests one at a time; batch N: N at once)
run constrained and unconstrained in alternating pairs (A, B, A, B, ...).

Fair by construction: both sides run the same prompts, greedy, and decode the same
number of tokens per request. A constrained output ends where its JSON closes, so a
first constrained run of each level (the warm-up: it also compiles every schema, cached
by key for the timed runs) fixes each request's length L; the unconstrained side then
runs with ``max_new_tokens=L, ignore_eos=True``. With equal lengths the batches shrink
at the same rounds on both sides. A per-step time is the scheduler iterations that ran
a decode batch of the level's size (batch 1: every decode round; batch N: the rounds
while all N decode), summed and divided by their count; ``Engine.step`` is timed as a
whole (planning, the forward, the mask's fill and apply, sampling, the matchers'
accept, detokenizing). The cost is the median of the pairs' ratios (and differences):
a pair runs seconds apart, the machine drifts over minutes (docs/benchmarks.md).

Run by ``sglite bench --workload json-schema`` (benchmarks/runners.py runs ``run`` in
a process of its own); the bench's document takes ``summarize`` and ``section``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from benchmarks.report import Row

if TYPE_CHECKING:
    from benchmarks.workloads import Workload
    from sglite.engine import Engine

Say = Callable[[str], None]
PAIRS = 5  # the repo's noise rule: a ratio is the median of at least 5 alternating pairs
COLUMNS = ["config", "batch", "requests", "decode steps / run", "constrained ms/step", "unconstrained ms/step",
           "grammar ms/step", "constrained / unconstrained", "spread of the pairs", "valid JSON"]


@dataclass
class Side:
    """One run of a level's requests: outputs, and its timed decode steps."""

    outputs: list[dict[str, Any]]
    seconds: float  # summed over the counted decode steps
    steps: int

    @property
    def lengths(self) -> list[int]:
        return [len(o["output_ids"]) for o in self.outputs]


# --- in the worker process --------------------------------------------------------------


def drive(engine: "Engine", prompts: list[list[int]], params: list[dict[str, Any]], full: int) -> Side:
    """Submit the requests together and step the scheduler until they finish, timing
    each iteration; counted are those that ran a decode batch of ``full`` rows. Rids
    g0, g1, ... are reused run after run (a finished, read result gives its rid back)."""
    rids = [engine.submit(input_ids=p, sampling_params=sp, rid=f"g{i}") for i, (p, sp) in
            enumerate(zip(prompts, params))]
    seconds, steps = 0.0, 0
    while not all(engine.is_finished(r) for r in rids):
        tic = time.perf_counter()
        engine.step()
        took = time.perf_counter() - tic
        batch = engine.scheduler.cur_batch  # the batch this iteration launched
        if batch is not None and batch.forward_mode.is_decode() and batch.batch_size() == full:
            seconds += took
            steps += 1
        elif batch is None and not engine.scheduler.has_work() and not all(engine.is_finished(r) for r in rids):
            raise RuntimeError("the scheduler went idle with unfinished requests")
    while engine.scheduler.has_work():  # the overlap loop's last round (untimed)
        engine.step()
    outputs = [engine.result(r) for r in rids]
    errors = [o["error"] for o in outputs if o.get("error")]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return Side(outputs, seconds, steps)


def run_level(engine: "Engine", prompts: list[list[int]], params: list[dict[str, Any]], batch: int) -> Side:
    """A level's requests: one at a time (batch 1) or all at once."""
    if batch > 1:
        return drive(engine, prompts, params, batch)
    sides = [drive(engine, [p], [sp], 1) for p, sp in zip(prompts, params)]
    return Side([o for s in sides for o in s.outputs], sum(s.seconds for s in sides), sum(s.steps for s in sides))


def valid_json(outputs: list[dict[str, Any]]) -> int:
    ok = 0
    for o in outputs:
        try:
            json.loads(o["text"])
            ok += 1
        except ValueError:
            pass
    return ok


def measure_level(engine: "Engine", spec: dict[str, Any], batch: int, n: int, say: Say) -> dict[str, Any]:
    """Alternating pairs (constrained, unconstrained) of one level; the first
    constrained run warms up and fixes the lengths both sides decode."""
    prompts = spec["prompts"][:n]
    constrained = [{"temperature": 0, "max_new_tokens": cap, **g}
                   for cap, g in zip(spec["output_lens"][:n], spec["sampling"][:n])]
    first = run_level(engine, prompts, constrained, batch)
    lengths = first.lengths
    # same lengths: an unconstrained request decodes exactly its constrained twin's tokens
    plain = [{"temperature": 0, "max_new_tokens": k, "ignore_eos": True} for k in lengths]
    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    steps: int | None = None  # the timed runs' (the warm-up's may differ: it waited for compiles)
    lengths_ok = True
    for i in range(spec["pairs"]):
        for side, params in (("constrained", constrained), ("unconstrained", plain)):
            s = run_level(engine, prompts, params, batch)
            steps = s.steps if steps is None else steps
            lengths_ok &= s.lengths == lengths and s.steps == steps
            runs[side].append(s.seconds / max(s.steps, 1))  # (steps > 0: checked below)
        if not steps:  # (every output a single token: nothing decodes)
            raise RuntimeError(f"batch {batch}: no decode round ran {batch} request(s)")
        say(f"      {spec['label']}: batch {batch}, pair {i + 1}/{spec['pairs']}: constrained "
            f"{1e3 * runs['constrained'][-1]:.2f}, unconstrained {1e3 * runs['unconstrained'][-1]:.2f} ms/step")
    return {"batch": batch, "requests": n, "steps": steps, "output_tokens": sum(lengths),
            "output_lengths": [min(lengths), max(lengths)],
            "constrained_s": runs["constrained"], "unconstrained_s": runs["unconstrained"],
            "valid_json": valid_json(first.outputs), "lengths_ok": lengths_ok,
            "output_ids": [o["output_ids"] for o in first.outputs]}


def _start_tracing(engine: "Engine", spec: dict[str, Any]) -> Callable[[], None]:
    """Spans to a file (an ablation's cost); returns what stops it and removes the file."""
    if not spec.get("trace_level"):
        return lambda: None
    from tracing import setup_tracing

    folder = Path(tempfile.mkdtemp(prefix="sglite-bench-"))
    tracer = setup_tracing(engine.event_bus, spec["trace_level"], jsonl_path=str(folder / "spans.jsonl"),
                           model=spec["model_path"])

    def stop() -> None:
        tracer.shutdown()
        shutil.rmtree(folder, ignore_errors=True)

    return stop


def run(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    """The worker's side (benchmarks/runners.py): load, warm up, every level's pairs."""
    import torch

    torch.set_num_threads(spec["threads"])
    from benchmarks.runners import _warmup_prompt
    from sglite.engine import Engine

    tic = time.perf_counter()
    engine = Engine(spec["model_path"], log_level="error", **spec.get("server_args", {}))
    load_s = time.perf_counter() - tic
    warm = _warmup_prompt(spec["prompts"])
    engine.generate(input_ids=[warm, warm[:20]], sampling_params={"max_new_tokens": 4})
    engine.freeze_gc()
    stop_tracing = _start_tracing(engine, spec)
    t0 = time.monotonic()
    levels = [measure_level(engine, spec, batch, n, say) for batch, n in spec["levels"]]
    wall = time.monotonic() - t0
    stop_tracing()
    runner = engine.scheduler.tp_worker.model_runner
    details = {"attention_backend": runner.attn_backend.name, "dtype": str(runner.dtype).removeprefix("torch."),
               "overlap": bool(engine.scheduler.enable_overlap), "pairs": spec["pairs"]}
    engine.shutdown()
    return {"wall_s": wall, "load_s": load_s, "levels": levels, "details": details}


# --- in the bench's process ---------------------------------------------------------------


def summarize(label: str, engine: str, wl: "Workload", res: dict[str, Any]) -> Row:
    """A grammar row: its levels' numbers in details["levels"]; output_tok_s (what
    --repeat ranks runs by) is the largest level's constrained decode rate."""
    if not res.get("ok"):
        return Row(label, engine, False, error=res.get("error", "no result"), num_requests=wl.num_requests)
    levels = res["levels"]
    top = levels[-1]
    output_ids = top["output_ids"]  # what --repeat compares between runs
    for lv in levels:
        del lv["output_ids"]
        pairs = list(zip(lv["constrained_s"], lv["unconstrained_s"]))
        lv["ratios"] = [c / u for c, u in pairs]
        lv["differences_s"] = [c - u for c, u in pairs]
    return Row(label, engine, True, wall_s=res["wall_s"], output_tok_s=top["batch"] / statistics.median(
        top["constrained_s"]), peak_rss_mb=res["peak_rss_mb"], num_requests=wl.num_requests,
        lengths_ok=all(lv["lengths_ok"] for lv in levels), details={**res["details"], "levels": levels},
        output_ids=output_ids)


def _cells(r: Row, lv: dict[str, Any]) -> list[str]:
    ms = [1e3 * statistics.median(lv[k]) for k in ("constrained_s", "unconstrained_s", "differences_s")]
    ratios = lv["ratios"]
    label = r.label if lv["lengths_ok"] else f"{r.label} (lengths or steps differ between runs!)"
    if not r.runs_agree:
        label += " (runs made different outputs!)"
    return [label, str(lv["batch"]), str(lv["requests"]), str(lv["steps"]), f"{ms[0]:.2f}", f"{ms[1]:.2f}",
            f"{ms[2]:+.2f}", f"{statistics.median(ratios):.3f}×", f"{min(ratios):.3f}–{max(ratios):.3f}",
            f"{lv['valid_json']}/{lv['requests']}"]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    for r in rows:
        if not r.ok:
            lines.append("| " + " | ".join([r.label, f"failed: {r.error}"] + [""] * (len(COLUMNS) - 2)) + " |")
            continue
        lines += ["| " + " | ".join(_cells(r, lv)) + " |" for lv in r.details["levels"]]
    return "\n".join(lines)


def section(wl: "Workload", rows: list[Row], flags: str) -> list[str]:
    """The workload's part of the bench document: what ran, the table, every pair."""
    ok = [r for r in rows if r.ok]
    pairs = ok[0].details["pairs"] if ok else 0
    lines = [f"## {wl.name}", "",
             f"{wl.title}. sglite runs with `{flags}`; in one process, each level runs constrained and "
             f"unconstrained in {pairs} alternating pairs after a constrained warm-up run, which fixes each "
             "request's output length: the unconstrained side decodes exactly as many tokens (`ignore_eos`), so "
             "both sides run the same batches. ms/step: the scheduler iterations that ran a decode batch of the "
             "level's size, summed over a run and divided by their count, median of the runs; grammar ms/step "
             "and the ratio: medians of the pairs' differences and ratios. Valid JSON: constrained outputs that "
             "parse.", "", table(rows), ""]
    for r in ok:
        for lv in r.details["levels"]:
            lines.append(f"- {r.label}, batch {lv['batch']}: ratio of each pair, in order: "
                         + ", ".join(f"{x:.3f}" for x in lv["ratios"]) + f"; {lv['output_tokens']} output tokens "
                         f"a run ({lv['output_lengths'][0]}-{lv['output_lengths'][1]} a request).")
        if len(r.runs_output_tok_s) > 1:
            lines.append(f"- {r.label}: ran {len(r.runs_output_tok_s)} times (--repeat), the row is the median run "
                         "by the largest level's constrained rate: " + ", ".join(f"{t:.1f}" for t in
                                                                                r.runs_output_tok_s) + " tok/s.")
    return lines + [""]
