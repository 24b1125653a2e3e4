"""Turn raw runs into the numbers of the results table, the markdown, and the plots."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.workloads import Workload

COLUMNS = [
    "config", "output tok/s", "total tok/s", "vs transformers", "TTFT p50 / p99 (s)", "ITL p50 / p99 (ms)",
    "prefill computed", "÷ distinct", "cache hit", "peak RSS (MB)", "greedy = transformers",
]


@dataclass
class Row:
    """One configuration's numbers on one workload (None: not measured / not applicable)."""

    label: str
    engine: str
    ok: bool
    error: str = ""
    wall_s: float = 0.0
    output_tok_s: float = 0.0
    total_tok_s: float = 0.0
    vs_baseline: float | None = None
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    prefill_computed: int | None = None
    prefill_ratio: float | None = None
    cache_hit_rate: float | None = None
    peak_rss_mb: float = 0.0
    greedy_matches: int | None = None
    num_requests: int = 0
    runs_output_tok_s: list[float] = field(default_factory=list)  # every run of this configuration (--repeat)
    runs_agree: bool = True  # every run made the same output ids
    lengths_ok: bool = True
    details: dict[str, Any] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list, repr=False)
    itl_s: list[float] = field(default_factory=list, repr=False)
    output_ids: list[list[int]] = field(default_factory=list, repr=False)

    def public(self) -> dict[str, Any]:
        """For the JSON file: everything but the raw per-request lists."""
        return {k: v for k, v in self.__dict__.items() if k not in ("ttft_s", "itl_s", "output_ids")}


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def summarize(label: str, engine: str, wl: Workload, res: dict[str, Any]) -> Row:
    if not res.get("ok"):
        return Row(label, engine, False, error=res.get("error", "no result"), num_requests=wl.num_requests)
    wall = res["wall_s"]
    computed, hits = res.get("prefill_computed"), res.get("cache_hit_tokens")
    # a tool that prints no output ids (llama-batched-bench) runs prompts of its own
    lengths_ok = res["output_ids"] is None or [len(o) for o in res["output_ids"]] == wl.output_lens
    return Row(
        label, engine, True, wall_s=wall,
        output_tok_s=wl.total_output_tokens / wall,
        total_tok_s=(wl.total_prompt_tokens + wl.total_output_tokens) / wall,
        ttft_p50=percentile(res["ttft_s"], 50), ttft_p99=percentile(res["ttft_s"], 99),
        itl_p50_ms=1e3 * percentile(res["itl_s"], 50), itl_p99_ms=1e3 * percentile(res["itl_s"], 99),
        prefill_computed=computed,
        prefill_ratio=computed / wl.distinct_prompt_tokens if computed is not None else None,
        cache_hit_rate=hits / (hits + computed) if hits is not None and computed else None,
        peak_rss_mb=res["peak_rss_mb"], num_requests=wl.num_requests, lengths_ok=lengths_ok,
        details=res.get("details", {}), ttft_s=res["ttft_s"], itl_s=res["itl_s"], output_ids=res["output_ids"] or [],
    )


def median_run(runs: list[Row]) -> Row:
    """The run of one configuration to report when it ran several times (--repeat): the
    median by output throughput (the lower middle one for an even count), so the row's
    latency and memory come from that same run. A failed run fails the row."""
    failed = next((r for r in runs if not r.ok), None)
    if failed is not None:
        return failed
    ranked = sorted(runs, key=lambda r: r.output_tok_s)
    row = ranked[(len(ranked) - 1) // 2]
    row.runs_output_tok_s = [r.output_tok_s for r in runs]
    row.runs_agree = all(r.output_ids == runs[0].output_ids for r in runs)
    return row


# llama.cpp's file type (GGML's name) of each dtype; a llama.cpp row's dtype is its file's type
LLAMA_TYPES = {"float32": "F32", "bfloat16": "BF16"}
_DTYPE = {t: d for d, t in LLAMA_TYPES.items()}


def compare_to_baseline(rows: list[Row], baseline: Row | None) -> None:
    """Fill 'vs transformers' (output throughput / the baseline's) and 'greedy =
    transformers' (requests whose output ids equal exactly those of the transformers row
    in the row's dtype, else the baseline's) for every other row with output ids."""
    if baseline is None or not baseline.ok:
        return
    hf = {r.details.get("dtype", "float32"): r for r in rows if r.ok and r.engine == "transformers"}
    for row in rows:
        if row.ok and row is not baseline:
            row.vs_baseline = row.output_tok_s / baseline.output_tok_s
            dtype = row.details.get("dtype", "float32")
            ref = hf.get(_DTYPE.get(dtype, dtype), baseline)
            if row.output_ids and ref is not row:
                row.greedy_matches = sum(a == b for a, b in zip(row.output_ids, ref.output_ids))


# --- markdown -------------------------------------------------------------------------


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def row_cells(r: Row) -> list[str]:
    if not r.ok:
        return [r.label, f"failed: {r.error}"] + [""] * (len(COLUMNS) - 2)
    ratio = _f(r.prefill_ratio, ".2f")
    if r.prefill_ratio is not None:
        ratio += "×"
    greedy = "—" if r.greedy_matches is None else f"{r.greedy_matches}/{r.num_requests}"
    label = r.label if r.lengths_ok else f"{r.label} (output lengths differ!)"
    if not r.runs_agree:
        label += " (runs made different outputs!)"
    return [
        label, f"{r.output_tok_s:.1f}", f"{r.total_tok_s:.1f}",
        "1.00×" if r.engine == "transformers" and r.vs_baseline is None
        else (_f(r.vs_baseline, ".2f") + ("×" if r.vs_baseline else "")),
        f"{r.ttft_p50:.2f} / {r.ttft_p99:.2f}", f"{r.itl_p50_ms:.0f} / {r.itl_p99_ms:.0f}",
        _f(r.prefill_computed, ",d"), ratio,
        "—" if r.cache_hit_rate is None else f"{100 * r.cache_hit_rate:.0f} %",
        f"{r.peak_rss_mb:,.0f}", greedy,
    ]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def parse_markdown_table(text: str) -> list[dict[str, str]]:
    """The inverse of markdown_table for the first table in ``text`` (tests read it back)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


# --- plots ----------------------------------------------------------------------------


def write_plots(results: dict[str, tuple[Workload, list[Row]]], out_dir: Path, stem: str) -> tuple[list[Path], str]:
    """Throughput bars (one panel per workload) and latency CDFs (one figure per
    workload). Returns the files, or none and why."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib, or the `test` extra)"
    written = []
    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 0.5 * max(len(r) for _, r in results.values()) + 1.6),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        _, rows = results[name]
        ok = [r for r in rows if r.ok][::-1]
        colors = ["tab:gray" if r.engine != "sglite" else "tab:blue" for r in ok]
        bars = ax.barh([r.label for r in ok], [r.output_tok_s for r in ok], color=colors)
        for bar, r in zip(bars, ok):
            tag = f" {r.output_tok_s:.0f}" + (f" ({r.vs_baseline:.1f}×)" if r.vs_baseline else "")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, tag, va="center", fontsize=8)
        ax.set_title(name)
        ax.set_xlabel("output tokens/s")
        ax.margins(x=0.3)
    fig.tight_layout()
    path = out_dir / f"{stem}-throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for name in names:
        _, rows = results[name]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for r in rows:
            if not r.ok:
                continue
            for ax, xs in ((a1, r.ttft_s), (a2, [1e3 * x for x in r.itl_s])):
                if xs:
                    s = np.sort(xs)
                    ax.step(s, np.arange(1, len(s) + 1) / len(s), where="post", label=r.label,
                            linestyle="-" if r.engine == "sglite" else "--")
        a1.set_xlabel("time to first token (s)")
        a2.set_xlabel("inter-token latency (ms)")
        a2.set_xscale("log")
        for ax in (a1, a2):
            ax.set_ylabel("fraction of requests" if ax is a1 else "fraction of token gaps")
            ax.grid(alpha=0.3)
        a1.legend(fontsize=8, loc="lower right")
        fig.suptitle(f"{name}: latency CDFs")
        fig.tight_layout()
        path = out_dir / f"{stem}-latency-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written, ""
