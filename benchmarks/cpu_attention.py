"""Decode attention on a CPU: the torch_native backend (gather each request's K/V into
padded chunks, then SDPA) against the cpu backend (the C++ kernel reading the pool
through req_to_token), on the same ragged paged decode batches, side by side.

SmolLM2-135M's attention geometry (9 query heads, 3 KV heads, head_dim 64), sequence
lengths drawn like the random-lengths workload's (prompt 50-500 plus up to 200
generated), each request's KV slots in one run as the engine's allocator mostly hands
them out (``--shuffle-slots``: every slot anywhere in the pool, which costs the kernel
TLB misses). Times one layer's attention (K/V store included), the two backends taking
turns so that a drift of the machine's speed hits both; checks they agree.

    python benchmarks/cpu_attention.py                  # batches of 1, 8, 32 and 64
    python benchmarks/cpu_attention.py --batch-sizes 32 --iters 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sglite.layers.attention.cpu_backend import CpuAttnBackend  # noqa: E402
from sglite.layers.attention.paged_batch import make_paged_case, run_attention  # noqa: E402
from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def seq_lens(bs: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 500) + rng.randint(0, 200) for _ in range(bs)]


def time_per_call(backend, case, iters: int) -> float:
    """Seconds per layer call (the per-forward metadata built once, as in a forward)."""
    fb = case.forward_batch
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    tic = time.perf_counter()
    for _ in range(iters):
        backend.forward(case.q, case.k, case.v, case.layer, fb)
    return (time.perf_counter() - tic) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8,32,64", help="comma list of decode batch sizes")
    ap.add_argument("--iters", type=int, default=50, help="layer calls per timing")
    ap.add_argument("--rounds", type=int, default=5, help="timings per backend, taking turns; the median is shown")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shuffle-slots", action="store_true", help="KV slots in a random order over the whole pool")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        if not sizes or min(sizes) < 1 or args.iters < 1 or args.rounds < 1:
            raise ValueError
    except ValueError:
        ap.error("--batch-sizes takes positive integers (1,8,32); --iters and --rounds positive")
    print(f"decode attention, one layer: {HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, float32, "
          f"{torch.get_num_threads()} torch threads, KV slots {'shuffled' if args.shuffle_slots else 'in runs'}; "
          f"median of {args.rounds} rounds of {args.iters} calls",
          flush=True)
    print("\n| batch | keys read | torch_native ms | cpu ms | torch_native ÷ cpu | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bs in sizes:
        lens = seq_lens(bs, args.seed + bs)
        case = make_paged_case([n - 1 for n in lens], [1] * bs, HEADS, KV_HEADS, HEAD_DIM, decode=True,
                               seed=args.seed, shuffle_slots=args.shuffle_slots)
        native, cpu = TorchNativeAttnBackend(), CpuAttnBackend()
        diff = (run_attention(native, case) - run_attention(cpu, case)).abs().max().item()
        times: dict[str, list[float]] = {"native": [], "cpu": []}
        for _ in range(args.rounds):
            times["native"].append(time_per_call(native, case, args.iters))
            times["cpu"].append(time_per_call(cpu, case, args.iters))
        a, b = statistics.median(times["native"]), statistics.median(times["cpu"])
        print(f"| {bs} | {sum(lens):,} | {a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.2f}× | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
