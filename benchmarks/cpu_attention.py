"""Decode attention on a CPU: the torch_native backend (gather each request's K/V into
padded chunks, then SDPA) against the cpu backend (the C++ kernel reading the pool
through req_to_token), on the same ragged paged decode batches, side by side.

SmolLM2-135M's attention geometry (9 query heads, 3 KV heads, head_dim 64), sequence
lengths drawn like the random-lengths workload's (prompt 50-500 plus up to 200
generated), each request's KV slots in one run as the engine's allocator mostly hands
them out (``--shuffle-slots``: every slot anywhere in the pool, which costs the kernel
TLB misses). Times one layer's attention (K/V store included), the two backends taking
turns so that a drift of the machine's speed hits both; checks they agree.

``--shared-prefix N`` gives every request the same first N KV slots, as chats on one
cached system prompt: torch_native then attends those once per layer for the whole
group (its cascade path); the cpu backend reads them per request through the kernel.

    python benchmarks/cpu_attention.py                  # batches of 1, 8, 32 and 64
    python benchmarks/cpu_attention.py --batch-sizes 32 --iters 200
    python benchmarks/cpu_attention.py --shared-prefix 300
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
from benchmarks.paged_batch import make_paged_case, run_attention  # noqa: E402
from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def seq_lens(bs: int, seed: int, shared_prefix: int = 0) -> list[int]:
    rng = random.Random(seed)
    if shared_prefix:  # a chat's own turn and answer after the shared prompt
        return [shared_prefix + rng.randint(1, 200) for _ in range(bs)]
    return [rng.randint(50, 500) + rng.randint(0, 200) for _ in range(bs)]


def share_first_slots(case, n: int) -> None:  # noqa: ANN001
    """Every request's positions 0..n-1 read the first request's slots (a radix hit)."""
    fb = case.forward_batch
    r2t, rows = fb.req_to_token_pool.req_to_token, fb.req_pool_indices.tolist()
    r2t[rows[1:], :n] = r2t[rows[0], :n]


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
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every request's first N positions share their KV slots (default 0: none)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        if not sizes or min(sizes) < 1 or args.iters < 1 or args.rounds < 1 or args.shared_prefix < 0:
            raise ValueError
    except ValueError:
        ap.error("--batch-sizes takes positive integers (1,8,32); --iters and --rounds positive; "
                 "--shared-prefix >= 0")
    print(f"decode attention, one layer: {HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, float32, "
          f"{torch.get_num_threads()} torch threads, KV slots {'shuffled' if args.shuffle_slots else 'in runs'}"
          f"{f', the first {args.shared_prefix} shared by every request' if args.shared_prefix else ''}; "
          f"median of {args.rounds} rounds of {args.iters} calls",
          flush=True)
    print("\n| batch | keys read | torch_native ms | cpu ms | torch_native ÷ cpu | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bs in sizes:
        lens = seq_lens(bs, args.seed + bs, args.shared_prefix)
        case = make_paged_case([n - 1 for n in lens], [1] * bs, HEADS, KV_HEADS, HEAD_DIM, decode=True,
                               seed=args.seed, shuffle_slots=args.shuffle_slots)
        if args.shared_prefix:
            share_first_slots(case, args.shared_prefix)
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
