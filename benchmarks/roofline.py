"""The machine's limits at the model's decode shapes, and sglite's linears against them.

Measured in the calling process, so every ``sglite bench`` result carries its own:

- matmul peak: the best of the linear paths below (torch's ``F.linear``, oneDNN's
  prepacked ``mkldnn._linear_pointwise``, sglite's own) for the model's linears at batch
  64, float32 and bfloat16, in GFLOP/s;
- read bandwidth: a sum over a buffer far larger than the caches, in GB/s;
- one decode step's linears (every layer's qkv, o, gate_up, down, and the LM head) at
  batch 1 and 64: torch's ``F.linear`` (float32, bfloat16), oneDNN prepacked (bfloat16)
  and sglite's ``weight_packed_linear`` (bfloat16), in ms;
- the floors these give a decode step: batch 64 at the bfloat16 matmul peak, batch 1 at
  the read bandwidth (the weights read once).

    python -m benchmarks.roofline            # prints the table (about a minute)
    python -m benchmarks.roofline --json r.json
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

SMOLLM2 = {"hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30,
           "vocab": 49152}


@dataclass
class Shapes:
    """One decode step's linears: (out_features, in_features, how many per step)."""
    linears: list[tuple[int, int, int]]

    @classmethod
    def of(cls, c: dict[str, int]) -> "Shapes":
        q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
        h, i, n = c["hidden"], c["intermediate"], c["layers"]
        return cls([(q + 2 * kv, h, n), (h, q, n), (2 * i, h, n), (h, i, n), (c["vocab"], h, 1)])

    def flops(self, batch: int) -> float:
        return sum(2.0 * batch * o * k * n for o, k, n in self.linears)

    def weight_bytes(self, elem: int) -> float:
        return sum(float(o * k * n * elem) for o, k, n in self.linears)


def _best_ms(fn: Callable[[], Any], reps: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def read_bandwidth_gbs(mb: int = 512) -> float:
    buf = torch.ones(mb << 18, dtype=torch.float32)  # mb MB
    ms = _best_ms(lambda: buf.sum(), reps=3)
    return buf.numel() * 4 / (ms * 1e-3) / 1e9


def _step_fn(kind: str, shapes: Shapes, batch: int) -> Callable[[], None]:
    """One decode step's linears on ``batch`` rows with torch or sglite's kernel, in the
    model's order; every layer has weights of its own (as a model does: reusing one would
    measure the caches, not memory)."""
    dtype = torch.float32 if kind == "F.linear fp32" else torch.bfloat16
    layers = []
    for layer in range(max(n for _, _, n in shapes.linears)):
        for o, k, n in shapes.linears:
            if layer >= n:
                continue
            w = torch.randn(o, k).to(dtype)
            if kind == "oneDNN prepacked bf16":
                w = torch.ops.mkldnn._reorder_linear_weight(w, batch)
            elif kind == "sglite packed bf16":
                from sglite.layers.cpu_ops import load_cpu_ops

                w = load_cpu_ops().convert_weight_packed(w)
            layers.append((torch.randn(batch, k).to(dtype), w, o))
    if kind == "oneDNN prepacked bf16":
        def linear(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    elif kind == "sglite packed bf16":
        from sglite.layers.cpu_ops import load_cpu_ops

        ops = load_cpu_ops()

        def linear(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
            return ops.weight_packed_linear(x, w, None, n)
    else:
        def linear(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
            return F.linear(x, w)

    def step() -> None:
        for x, w, n in layers:
            linear(x, w, n)

    return step


KINDS = ("F.linear fp32", "F.linear bf16", "oneDNN prepacked bf16", "sglite packed bf16")


def measure(config: dict[str, int] | None = None, batches: tuple[int, ...] = (1, 64),
            kinds: tuple[str, ...] = KINDS, say: Callable[[str], None] = print) -> dict[str, Any]:
    shapes = Shapes.of(config or SMOLLM2)
    step_ms: dict[str, dict[str, float]] = {}  # kind -> batch (as a string: JSON keys) -> ms
    for kind in kinds:
        step_ms[kind] = {}
        for b in batches:
            try:
                step_ms[kind][str(b)] = _best_ms(_step_fn(kind, shapes, b), reps=2 if b > 1 else 5)
            except (RuntimeError, ImportError) as e:  # no oneDNN, no compiler: say so, go on
                say(f"roofline: {kind} at batch {b} unavailable: {str(e).splitlines()[0][:120]}")
    bw = read_bandwidth_gbs()
    big = max(batches)

    def peak(kinds_: tuple[str, ...]) -> float:
        ms = [step_ms[k][str(big)] for k in kinds_ if str(big) in step_ms.get(k, {})]
        return shapes.flops(big) / (min(ms) * 1e-3) / 1e9 if ms else float("nan")

    # the peak is the best any path reached (sglite's own kernel included)
    peak_f32, peak_bf16 = peak(("F.linear fp32",)), peak(tuple(k for k in kinds if "bf16" in k))
    return {
        "read_bandwidth_gbs": bw, "matmul_peak_gflops": {"float32": peak_f32, "bfloat16": peak_bf16},
        "step_ms": step_ms, "batch_big": big,
        "floor_ms": {"batch1_bf16_bandwidth": shapes.weight_bytes(2) / bw / 1e6,
                     "batch1_fp32_bandwidth": shapes.weight_bytes(4) / bw / 1e6,
                     f"batch{big}_bf16_matmul": shapes.flops(big) / peak_bf16 / 1e6},
    }


def markdown(r: dict[str, Any]) -> list[str]:
    big = r["batch_big"]
    fl = r["floor_ms"]
    lines = [f"- read bandwidth: {r['read_bandwidth_gbs']:.1f} GB/s; matmul peak at the decode shapes (batch {big}): "
             f"float32 {r['matmul_peak_gflops']['float32']:.0f}, bfloat16 {r['matmul_peak_gflops']['bfloat16']:.0f} GFLOP/s",
             f"- floors of one decode step: batch 1 {fl['batch1_bf16_bandwidth']:.1f} ms in bf16 "
             f"({fl['batch1_fp32_bandwidth']:.1f} in fp32: the weights read once); batch {big} "
             f"{fl[f'batch{big}_bf16_matmul']:.1f} ms (bf16 matmul peak)", "",
             f"| one decode step's linears | batch 1 ms | batch {big} ms |", "|---|---:|---:|"]
    for kind, ms in r["step_ms"].items():
        cells = [f"{ms[str(b)]:.1f}" if str(b) in ms else "n/a" for b in (1, big)]
        lines.append(f"| {kind} | {cells[0]} | {cells[1]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the numbers as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    r = measure()
    print("\n".join(markdown(r)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
