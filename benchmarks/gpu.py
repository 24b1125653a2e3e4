"""Triton kernels and CUDA graphs on a CUDA GPU, in one run; writes
benchmarks/results/gpu-<date>.md.

1. Checks: every Triton kernel against its torch reference (attention against the
   torch_native backend on ragged paged batches, the fused RMSNorm / SiLU-and-mul /
   RoPE against each layer's forward_native, the KV store against indexing), in
   bfloat16 and float32; then greedy tokens of tiny-random through the Engine with
   torch_native, triton, and triton + CUDA graphs.
2. Decode attention bandwidth: bytes the kernel must read (K, V and the req_to_token
   slots of every position) over its time, as a fraction of the GPU's peak memory
   bandwidth (looked up by device name; --peak-bandwidth-gbs overrides). Goal: >= 60 %
   at batch 128 with 2k-token contexts.
3. Decode throughput of a 1B-class llama config (Llama-3.2-1B shapes, random bf16
   weights) at batch 1, 32 and 128: triton vs torch_native, CUDA graphs on vs off.
   Goal: CUDA graphs >= 1.5x at batch 1.

    python benchmarks/gpu.py                         # on a CUDA machine
    python benchmarks/gpu.py --peak-bandwidth-gbs 3350 --batch-sizes 1,8

A section that fails is reported in the results file with its error; the others still
run. The pure-Python parts (arguments, the bandwidth table, the markdown) import no
torch and are tested on CPU (tests/benchmarks/test_gpu.py).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BANDWIDTH_GOAL = 0.60  # decode attention, batch 128, 2k-token contexts
GRAPH_SPEEDUP_GOAL = 1.5  # decode throughput at batch 1, CUDA graphs on / off

# Peak memory bandwidth in GB/s (vendor datasheets) by a substring of
# torch.cuda.get_device_name(); the first match wins, so longer names come first
# ("GH200" before "H200" before "H20", "A100" before "A10", "L40" before "L4").
PEAK_BANDWIDTH_GBS: list[tuple[str, float]] = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("H20", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
]

# Llama-3.2-1B shapes (random weights; untied lm_head would only add a matmul)
LLAMA_1B = dict(
    architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=131072, tie_word_embeddings=True, name="llama-1b-random",
)


# --- pure Python: arguments, lookups, results --------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                   help="the GPU's peak memory bandwidth in GB/s (default: looked up by device name)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 32, 128], help="decode batch sizes, e.g. 1,32,128")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each request's KV cache (throughput)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per configuration")
    p.add_argument("--attn-context", type=int, default=2048, help="context of the decode-attention bandwidth runs")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where gpu-<date>.md goes")
    p.add_argument("--date", default=None, help="date in the file name (default: today, YYYY-MM-DD)")
    p.add_argument("--no-write", action="store_true", help="print the report, write no file")
    args = p.parse_args(argv)
    if args.peak_bandwidth_gbs is not None and args.peak_bandwidth_gbs <= 0:
        p.error("--peak-bandwidth-gbs must be positive")
    return args


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def peak_bandwidth_gbs(device_name: str, override: float | None = None) -> tuple[float | None, str]:
    """(GB/s, where it came from). None when the device is unknown and no override given."""
    if override is not None:
        return override, "--peak-bandwidth-gbs"
    for key, gbs in PEAK_BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return gbs, f"datasheet value for {key}"
    return None, "unknown device: pass --peak-bandwidth-gbs"


def results_path(out_dir: Path, date: str) -> Path:
    return Path(out_dir) / f"gpu-{date}.md"


# per element, |triton - reference| <= atol + rtol * |reference|. bfloat16 keeps ~3
# digits and rounds at different points in the two paths; in float32, Triton's tl.dot
# runs in TF32 (10-bit mantissa). The KV store is a copy and must be exact.
TOLERANCES = {"bfloat16": (2e-2, 2e-2), "float32": (5e-3, 5e-3)}


@dataclass
class KernelCheck:
    name: str
    shape: str
    dtype: str
    max_abs_err: float
    worst: float  # max over elements of |err| / (atol + rtol * |ref|); <= 1 passes

    @property
    def passed(self) -> bool:
        return self.worst <= 1.0  # False for NaN


@dataclass
class BandwidthRow:
    batch_size: int
    context: int
    num_kv_splits: int
    slots: str  # "contiguous" or "shuffled"
    time_us: float
    gbytes: float  # bytes that must be read, in GB
    default_splits: bool = True  # False: a sweep row, not what the engine would pick

    @property
    def gbs(self) -> float:
        return self.gbytes / (self.time_us * 1e-6)


@dataclass
class ThroughputRow:
    batch_size: int
    backend: str
    cuda_graph: bool
    ms_per_step: float | None  # None: not applicable
    note: str = ""

    @property
    def tok_s(self) -> float | None:
        return None if self.ms_per_step is None else self.batch_size / (self.ms_per_step * 1e-3)


@dataclass
class Report:
    date: str
    device: str = "?"
    versions: str = ""
    peak_gbs: float | None = None
    peak_source: str = ""
    checks: list[KernelCheck] = field(default_factory=list)
    token_checks: list[tuple[str, bool]] = field(default_factory=list)
    bandwidth: list[BandwidthRow] = field(default_factory=list)
    throughput: list[ThroughputRow] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (section, traceback)
    command: str = "python benchmarks/gpu.py"
    attn_context: int = 2048


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def goal_lines(report: Report) -> list[str]:
    lines = []
    rows = [r for r in report.bandwidth if r.batch_size == 128 and r.context == report.attn_context
            and r.slots == "contiguous" and r.default_splits]
    if rows and report.peak_gbs:
        frac = rows[0].gbs / report.peak_gbs
        lines.append(f"- decode attention, batch 128, {report.attn_context}-token contexts: {frac:.0%} of peak "
                     f"bandwidth (goal >= {BANDWIDTH_GOAL:.0%}): {'met' if frac >= BANDWIDTH_GOAL else 'NOT met'}")
    else:
        lines.append("- decode attention bandwidth goal: not measured (no batch-128 row or unknown peak bandwidth)")
    speedup = graph_speedup(report.throughput, 1)
    if speedup is not None:
        lines.append(f"- CUDA graphs at batch 1 (triton): {speedup:.2f}x decode throughput (goal >= "
                     f"{GRAPH_SPEEDUP_GOAL}x): {'met' if speedup >= GRAPH_SPEEDUP_GOAL else 'NOT met'}")
    else:
        lines.append("- CUDA graph speedup goal: not measured (no batch-1 triton rows with graphs on and off)")
    return lines


def graph_speedup(rows: list[ThroughputRow], batch_size: int) -> float | None:
    by = {(r.backend, r.cuda_graph): r.ms_per_step for r in rows if r.batch_size == batch_size}
    on, off = by.get(("triton", True)), by.get(("triton", False))
    return off / on if on and off else None


def render_markdown(report: Report) -> str:
    out = [f"# GPU: Triton kernels and CUDA graphs, {report.date}", ""]
    peak = f"{report.peak_gbs:.0f} GB/s ({report.peak_source})" if report.peak_gbs else report.peak_source
    out += [f"Machine: {report.device}; peak memory bandwidth {peak}. {report.versions}", "",
            "```", f"$ {report.command}", "```", "", "## Goals", ""]
    out += goal_lines(report)
    out += ["", "## Kernel checks against the torch reference", ""]
    if report.checks:
        tols = "; ".join(f"{d} atol {a:g}, rtol {r:g}" for d, (a, r) in TOLERANCES.items())
        out += [f"Allowed error per element: atol + rtol * |reference| ({tols}); the KV store must be exact. "
                "The last column is the worst element's error over its allowance (<= 1 passes).", "",
                "| kernel | shape | dtype | max abs err | worst err / allowed | |", "|---|---|---|---:|---:|---|"]
        out += [f"| {c.name} | {c.shape} | {c.dtype} | {c.max_abs_err:.2e} | {c.worst:.2f} | "
                f"{'ok' if c.passed else 'FAIL'} |" for c in report.checks]
        failed = sum(not c.passed for c in report.checks)
        out += ["", f"{len(report.checks) - failed} of {len(report.checks)} checks pass."]
    else:
        out.append("No kernel checks ran.")
    if report.token_checks:
        out += ["", "Greedy tokens of tiny-random (float32, 6 requests x 24 tokens) through the Engine:", ""]
        out += [f"- {name}: {'same tokens' if ok else 'DIFFERENT tokens'}" for name, ok in report.token_checks]
    out += ["", "## Decode attention bandwidth", "",
            "Bytes counted: K and V of every position plus its req_to_token slot index, plus q and the output; "
            "the split-KV partial results are not counted. bfloat16, 32 query heads, 8 KV heads, head dim 64.", ""]
    if report.bandwidth:
        out += ["| batch | context | KV splits | slots | time (us) | GB/s | of peak |",
                "|---:|---:|---:|---|---:|---:|---:|"]
        for r in report.bandwidth:
            frac = f"{r.gbs / report.peak_gbs:.0%}" if report.peak_gbs else "n/a"
            splits = str(r.num_kv_splits) if r.default_splits else f"{r.num_kv_splits} (sweep)"
            out.append(f"| {r.batch_size} | {r.context} | {splits} | {r.slots} | {r.time_us:.1f} | "
                       f"{r.gbs:.0f} | {frac} |")
    else:
        out.append("Not measured.")
    out += ["", "## Decode throughput, 1B-class llama (random bf16 weights)", ""]
    if report.throughput:
        out += ["| batch | backend | CUDA graphs | ms / step | tokens/s | |", "|---:|---|---|---:|---:|---|"]
        for r in report.throughput:
            out.append(f"| {r.batch_size} | {r.backend} | {'on' if r.cuda_graph else 'off'} | "
                       f"{_fmt(r.ms_per_step, '.2f')} | {_fmt(r.tok_s, '.0f')} | {r.note} |")
        speedups = [(bs, graph_speedup(report.throughput, bs)) for bs in sorted({r.batch_size for r in report.throughput})]
        text = ", ".join(f"batch {bs}: {s:.2f}x" for bs, s in speedups if s is not None)
        if text:
            out += ["", f"CUDA graphs on / off (triton): {text}."]
    else:
        out.append("Not measured.")
    if report.errors:
        out += ["", "## Errors", ""]
        for section, tb in report.errors:
            out += [f"### {section}", "", "```", tb.rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def write_report(report: Report, out_dir: Path) -> Path:
    path = results_path(out_dir, report.date)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(report))
    return path


# --- GPU parts ----------------------------------------------------------------------------


def run_section(report: Report, name: str, fn: Callable[[], Any]) -> None:
    print(f"== {name}", flush=True)
    tic = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001 - one failing section must not lose the others
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        report.errors.append((name, tb))
    print(f"   {time.perf_counter() - tic:.1f} s", flush=True)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cuda_time_us(fn: Callable[[], Any], warmup: int = 5, iters: int = 50, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def _errors(got: Any, want: Any, dtype_name: str, exact: bool = False) -> tuple[float, float]:
    """(max abs error, worst error / allowance) of ``got`` against the reference ``want``."""
    import torch

    if not want.numel():
        return 0.0, 0.0
    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[dtype_name]
    err = (got.float() - want.float()).abs()
    allowed = atol + rtol * want.float().abs()
    ratio = torch.where(allowed > 0, err / allowed.clamp(min=1e-30), torch.where(err == 0, 0.0, float("inf")))
    return err.max().item(), ratio.max().item()


def _errors_of_pairs(pairs: Any, dtype_name: str) -> tuple[float, float]:
    results = [_errors(g, w, dtype_name) for g, w in pairs]
    return max(r[0] for r in results), max(r[1] for r in results)


# shapes of the kernel checks: (q heads, kv heads, head dim) with GQA 4, 1, 3, 1; a
# ragged extend batch (prefix lens, extend lens); decode prefix lens (seq_len = prefix + 1)
CHECK_SHAPES = [(32, 8, 64), (8, 8, 128), (24, 8, 128), (4, 4, 64)]
CHECK_RAGGED = ([0, 37, 300, 1000, 0], [129, 1, 64, 300, 7])
CHECK_DECODE_PREFIX = [0, 76, 1000, 2048, 4095]
CHECK_ROWS = (1, 300)


def check_kernels(report: Report, device: str = "cuda") -> None:
    import torch

    from sglite.layers.activation import SiluAndMul
    from benchmarks.paged_batch import make_paged_case, run_attention
    from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglite.layers.attention.triton_backend import TritonAttnBackend
    from sglite.layers.attention.triton_ops.kv_store import store_kv_cache
    from sglite.layers.layernorm import RMSNorm
    from sglite.layers.rotary_embedding import get_rope

    dev = device
    shapes, ragged, decode_lens = CHECK_SHAPES, CHECK_RAGGED, CHECK_DECODE_PREFIX
    n_ragged = sum(ragged[1])
    for dtype in (torch.bfloat16, torch.float32):
        dname = str(dtype).replace("torch.", "")
        for h, kvh, d in shapes:
            shape = f"q {h} / kv {kvh} heads, dim {d}"
            cases = [make_paged_case(*ragged, h, kvh, d, dtype=dtype, device=dev, seed=s) for s in (0, 0)]
            out, ref = run_attention(TritonAttnBackend(dev, kvh), cases[0]), run_attention(TorchNativeAttnBackend(), cases[1])
            report.checks.append(KernelCheck("extend attention", f"{shape}, prefix {min(ragged[0])}..{max(ragged[0])}",
                                             dname, *_errors(out, ref, dname)))
            cases = [make_paged_case(decode_lens, [1] * len(decode_lens), h, kvh, d, decode=True, dtype=dtype,
                                     device=dev, seed=s) for s in (1, 1)]
            out, ref = run_attention(TritonAttnBackend(dev, kvh), cases[0]), run_attention(TorchNativeAttnBackend(), cases[1])
            report.checks.append(KernelCheck("decode attention", f"{shape}, seq {min(decode_lens) + 1}..{max(decode_lens) + 1}",
                                             dname, *_errors(out, ref, dname)))
        case = make_paged_case(*ragged, 8, 8, 128, dtype=dtype, device=dev)
        fb, pool = case.forward_batch, case.forward_batch.token_to_kv_pool
        k_ref = pool.k_buffer[0].clone()
        k_ref[fb.out_cache_loc] = case.k
        store_kv_cache(pool.k_buffer[0], pool.v_buffer[0], fb.out_cache_loc, case.k, case.v)
        report.checks.append(KernelCheck("KV store", f"{n_ragged} rows, 8 x 128", dname,
                                         *_errors(pool.k_buffer[0], k_ref, dname, exact=True)))

        g = torch.Generator(device=dev).manual_seed(0)
        for rows in CHECK_ROWS:
            x = torch.randn(rows, 2048, generator=g, device=dev).to(dtype)
            r = torch.randn(rows, 2048, generator=g, device=dev).to(dtype)
            norm = RMSNorm(2048, 1e-5).to(dev, dtype)
            norm.weight.data = (1 + 0.1 * torch.randn(2048, generator=g, device=dev)).to(dtype)
            got, want = norm.forward_triton(x, r), norm.forward_native(x, r)
            report.checks.append(KernelCheck("RMSNorm + residual", f"{rows} x 2048", dname,
                                             *_errors_of_pairs(zip(got, want), dname)))
            gu = torch.randn(rows, 2 * 8192, generator=g, device=dev).to(dtype)
            act = SiluAndMul()
            report.checks.append(KernelCheck("SiLU and mul", f"{rows} x 8192", dname,
                                             *_errors(act.forward_triton(gu), act.forward_native(gu), dname)))
            for h, kvh, d in [(32, 8, 64), (24, 8, 128)]:
                rope = get_rope(d, 8192, 500000.0).to(dev)
                q = torch.randn(rows, h, d, generator=g, device=dev).to(dtype)
                k = torch.randn(rows, kvh, d, generator=g, device=dev).to(dtype)
                pos = torch.randint(0, 8192, (rows,), generator=g, device=dev)
                got, want = rope.forward_triton(pos, q, k), rope.forward_native(pos, q, k)
                report.checks.append(KernelCheck("RoPE (neox)", f"{rows} tokens, {h}/{kvh} heads, dim {d}", dname,
                                                 *_errors_of_pairs(zip(got, want), dname)))
    _sync(dev)


def check_engine_tokens(report: Report, device: str = "cuda") -> None:
    from sglite import Engine

    prompts = ["The quick brown fox", "What is the capital of France?", "def f(x):", "Numbers like 0 1 2"]
    follow = ["The quick brown fox jumps over the lazy dog", "What is the capital of France? The"]
    params = {"max_new_tokens": 24, "temperature": 0}

    def tokens(**kw: Any) -> list[list[int]]:
        engine = Engine("tiny-random", device=device, dtype="float32", max_total_tokens=4096, **kw)
        outs = engine.generate(prompts, params) + engine.generate(follow, params)
        engine.shutdown()
        return [o["output_ids"] for o in outs]

    ref = tokens(attention_backend="torch_native")
    eager = tokens(attention_backend="triton", disable_cuda_graph=True)
    graphs = tokens(attention_backend="triton")
    report.token_checks.append(("triton (CUDA graphs off) vs torch_native", eager == ref))
    report.token_checks.append(("triton, CUDA graphs on vs off", graphs == eager))


def measure_decode_attention(report: Report, context: int, batch_sizes: tuple[int, ...] = (1, 32, 128),
                             device: str = "cuda", timer: Callable[[Callable[[], Any]], float] = cuda_time_us) -> None:
    import torch

    from benchmarks.paged_batch import make_paged_case
    from sglite.layers.attention.triton_ops.decode_attention import decode_attention_fwd, num_kv_splits_for

    h, kvh, d = 32, 8, 64
    elem = 2  # bfloat16

    def one(bs: int, splits: int | None, shuffled: bool) -> None:
        case = make_paged_case([context - 1] * bs, [1] * bs, h, kvh, d, decode=True, dtype=torch.bfloat16,
                               device=device, shuffle_slots=shuffled)
        fb, pool = case.forward_batch, case.forward_batch.token_to_kv_pool
        n_splits = splits or num_kv_splits_for(bs, kvh, device)
        out = torch.empty_like(case.q)
        logits = torch.empty((bs, h, n_splits, d), dtype=torch.float32, device=device)
        lse = torch.empty((bs, h, n_splits), dtype=torch.float32, device=device)
        r2t = fb.req_to_token_pool.req_to_token

        def run() -> None:
            decode_attention_fwd(case.q, pool.k_buffer[0], pool.v_buffer[0], out, r2t, fb.req_pool_indices,
                                 fb.seq_lens, n_splits, case.layer.scaling, logits, lse)

        t = timer(run)
        tokens = bs * context
        nbytes = tokens * (2 * kvh * d * elem + r2t.element_size()) + 2 * bs * h * d * elem
        report.bandwidth.append(BandwidthRow(bs, context, n_splits, "shuffled" if shuffled else "contiguous", t,
                                             nbytes / 1e9, default_splits=splits is None))

    def measure(bs: int, splits: int | None, shuffled: bool) -> None:
        one(bs, splits, shuffled)
        torch.cuda.empty_cache()  # the case's KV pool went with one()'s locals

    for bs in batch_sizes:
        measure(bs, None, False)
    big = max(batch_sizes)
    for splits in (1, 2, 4, 8, 16):  # a sweep at the largest batch, for tuning num_kv_splits_for
        measure(big, splits, False)
    measure(big, None, True)


def random_llama_weights(config: Any, seed: int = 0, device: str = "cuda") -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rand(config.vocab_size, h), "model.norm.weight": rand(h) + 1}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": rand(h) + 1, p + "post_attention_layernorm.weight": rand(h) + 1,
        })
    return w


def time_decode_steps(runner: Any, bs: int, context: int, steps: int, warmup: int = 3) -> float:
    """ms per decode step of ``bs`` requests that each have ``context`` tokens cached
    (their KV slots hold whatever the pool holds: the values do not change the time)."""
    import torch

    from sglite.managers.schedule_batch import ModelWorkerBatch
    from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device = runner.device
    total = context + warmup + steps
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.token_to_kv_pool_allocator.alloc(bs * total)
    if rows is None or slots is None:
        raise RuntimeError(f"pool too small for batch {bs} x {total} tokens")
    slots = slots.view(bs, total).to(device)
    runner.req_to_token_pool.req_to_token[torch.tensor(rows, device=device), :total] = slots
    input_ids = torch.zeros(bs, dtype=torch.int64, device=device)

    def step(i: int) -> None:
        nonlocal input_ids
        seq = context + i + 1
        # input_ids stay a device tensor (ForwardBatch.init_new takes it as it is)
        batch = ModelWorkerBatch(0, i, ForwardMode.DECODE, input_ids, rows, [seq] * bs, slots[:, seq - 1].contiguous())
        fb = ForwardBatch.init_new(batch, runner)
        input_ids = runner.forward(fb).argmax(-1)

    for i in range(warmup):
        step(i)
    _sync(device)
    tic = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync(device)
    elapsed = time.perf_counter() - tic
    runner.req_to_token_pool.free(rows)
    runner.token_to_kv_pool_allocator.free(slots.reshape(-1).cpu())
    return elapsed * 1000 / steps


def measure_decode_throughput(report: Report, batch_sizes: list[int], context: int, steps: int,
                              config_kwargs: dict[str, Any] = LLAMA_1B, device: str = "cuda") -> None:
    import gc

    import torch

    from sglite.configs.model_config import ModelConfig
    from sglite.model_executor.model_runner import ModelRunner
    from sglite.server_args import ServerArgs

    config = ModelConfig(**config_kwargs)
    weights = random_llama_weights(config, device=device)
    max_bs = max(batch_sizes)
    tokens = max_bs * (context + steps + 8) + 64
    for backend, graphs in (("triton", True), ("triton", False), ("torch_native", False), ("torch_native", True)):
        if backend == "torch_native" and graphs:
            report.throughput += [ThroughputRow(bs, backend, True, None, "no CUDA-graph path: it loops over requests "
                                                "in Python") for bs in batch_sizes]
            continue
        args = ServerArgs(model_path=config.name, device=device, dtype="bfloat16", attention_backend=backend,
                          disable_cuda_graph=not graphs, cuda_graph_max_bs=max_bs, max_total_tokens=tokens,
                          max_running_requests=max_bs, context_length=context + steps + 64)
        tic = time.perf_counter()
        runner = ModelRunner(args, model_config=config, weights=weights)
        print(f"   {backend}, graphs {'on' if graphs else 'off'}: ready in {time.perf_counter() - tic:.1f} s", flush=True)
        for bs in batch_sizes:
            ms = time_decode_steps(runner, bs, context, steps)
            report.throughput.append(ThroughputRow(bs, backend, graphs, ms))
            print(f"   batch {bs}: {ms:.2f} ms/step", flush=True)
        del runner
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU and torch sees none; on CPU the kernels are checked by the "
              "tests under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    report = Report(date=args.date or datetime.date.today().isoformat(), attn_context=args.attn_context,
                    command="python benchmarks/gpu.py" + (" " + " ".join(argv) if argv else ""))
    report.device = torch.cuda.get_device_name(0)
    report.versions = (f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
                       f"Python {platform.python_version()}.")
    report.peak_gbs, report.peak_source = peak_bandwidth_gbs(report.device, args.peak_bandwidth_gbs)

    run_section(report, "kernel checks", lambda: check_kernels(report))
    run_section(report, "engine tokens", lambda: check_engine_tokens(report))
    run_section(report, "decode attention bandwidth", lambda: measure_decode_attention(report, args.attn_context))
    run_section(report, "decode throughput",
                lambda: measure_decode_throughput(report, args.batch_sizes, args.context, args.steps))

    text = render_markdown(report)
    print(text)
    if not args.no_write:
        print(f"wrote {write_report(report, args.out_dir)}")
    failed = any(not c.passed for c in report.checks) or not all(ok for _, ok in report.token_checks)
    return 1 if failed or report.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
