"""How often tp 2 and tp 1 give the same tokens in bfloat16, and whether each tp size
gives a request its solo tokens under pressure (docs/tensor_parallel.md, "tp 1 and tp 2
give other bits in bfloat16"). The workload is tests/managers/test_batch_invariance.py's:
half the prompts behind a shared prefix, greedy and seeded; "batched" is every request
at once on a small pool (retraction), chunks of 32, lpm.

    python benchmarks/tp_invariance.py                  # tiny-random (24 requests)
    python benchmarks/tp_invariance.py smollm2-135m     # 12 requests
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from sglite.engine import Engine
    from tests.managers.test_batch_invariance import PRESSURE, workload

    model = sys.argv[1] if len(sys.argv) > 1 else "tiny-random"
    n, vocab, pool = (24, 500, 400) if model == "tiny-random" else (12, 49000, 300)
    prompts, params = workload(n, vocab)
    runs = {}
    for tp in (1, 2):
        with Engine(model, dtype="bfloat16", tp_size=tp, log_level="error") as e:
            runs[tp, "solo"] = [e.generate(input_ids=p, sampling_params=sp)["output_ids"]
                                for p, sp in zip(prompts, params)]
        with Engine(model, dtype="bfloat16", tp_size=tp, log_level="error", **{**PRESSURE, "max_total_tokens": pool}) as e:
            runs[tp, "batched"] = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    for tp in (1, 2):
        same = sum(a == b for a, b in zip(runs[tp, "solo"], runs[tp, "batched"]))
        print(f"{model} bfloat16, tp {tp}: batched == solo for {same}/{n} requests")
    same = sum(a == b for a, b in zip(runs[1, "solo"], runs[2, "solo"]))
    print(f"{model} bfloat16: tp 2 == tp 1 (each request alone) for {same}/{n} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
