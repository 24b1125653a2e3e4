"""--tp-size 2 for real: rank 0 in this process, rank 1 a process of its own, gloo
between them on this box. Greedy tokens must equal --tp-size 1's under chunked
prefill, mixed batches, retraction and radix-cache hits, in both loops; a rank that
dies must stop the engine with an error that names it, never a hang."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from sglite import events as ev
from sglite.distributed.parallel_state import TpRankDiedError, get_tp_group
from sglite.engine import Engine

# retraction, chunks of 16 with decode rows mixed in, and prompts that share stems
PRESSURE = {"max_total_tokens": 400, "schedule_conservativeness": 0.05, "chunked_prefill_size": 16,
            "enable_mixed_chunk": True, "max_running_requests": 16}


def workload(n: int = 16) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(7)
    stems = [[rng.randrange(3, 250) for _ in range(rng.randrange(12, 30))] for _ in range(3)]
    prompts = [stems[i % 3] + [rng.randrange(3, 250) for _ in range(rng.randrange(2, 20))] for i in range(n)]
    params = [{"max_new_tokens": rng.randrange(20, 40), "temperature": 0, "ignore_eos": True} for _ in range(n)]
    return prompts, params


def run(tp: int, **kw) -> tuple[list[list[int]], dict[type, list]]:
    """Every request at once; the outputs and the events that show the pressure."""
    prompts, params = workload()
    bus = ev.EventBus()
    seen: dict[type, list] = {ev.ReqRetracted: [], ev.ReqChunked: [], ev.CacheMatched: [], ev.ForwardFinished: []}
    bus.subscribe(lambda e: seen[type(e)].append(e) if type(e) in seen else None)
    with Engine("tiny-random", tp_size=tp, event_bus=bus, log_level="error", **{**PRESSURE, **kw}) as engine:
        out = engine.generate(input_ids=prompts, sampling_params=params)
        followers = list(engine._tp_followers)
    # shutdown told the other ranks to stop: they ended on their own, not killed
    assert [p.exitcode for p in followers] == [0] * (tp - 1)
    return [o["output_ids"] for o in out], seen


@pytest.fixture(scope="module")
def tp1() -> list[list[int]]:
    return run(1)[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal-loop", "overlap-loop"])
def test_tp2_gives_tp1_s_tokens_under_chunking_retraction_and_cache_hits(tp1, overlap):
    cpu_before = (os.sched_getaffinity(0), torch.get_num_threads())
    out, seen = run(2, disable_overlap_schedule=not overlap)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == cpu_before, "rank 0 gets its cores back"
    assert out == tp1
    assert seen[ev.ReqRetracted] and seen[ev.ReqChunked], "the workload must retract and chunk"
    assert any(e.matched_len > 0 for e in seen[ev.CacheMatched]), "the workload must hit the radix cache"
    # every forward reports both ranks' times, and the all-reduces inside them
    timings = [e.tp_timings for e in seen[ev.ForwardFinished]]
    assert timings and all(len(t) == 2 and all(sec > comm > 0 for sec, comm in t) for t in timings)
    assert get_tp_group().world_size == 1, "shutdown leaves the group"


def _follower_pids(engine: Engine) -> list[int]:
    return [p.pid for p in engine._tp_followers]


def test_tp2_in_bfloat16_is_batch_invariant_within_itself():
    """tp 2's all-reduce adds the two shards' partial sums, so in bfloat16 it may part
    from tp 1 (docs/tensor_parallel.md); within tp 2 a request's tokens still do not
    depend on its batch: under the pressure above, each equals its solo tp 2 run, and so
    do its logprobs (the prompt's from position 0: their logits all-gathered block by
    block on every rank)."""
    prompts, params = workload()
    seeded = [dict(p, temperature=0.8, seed=i) if i % 3 == 0 else p for i, p in enumerate(params)]
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}

    def kept(out: dict) -> tuple:
        meta = out["meta_info"]
        return out["output_ids"], meta["input_token_logprobs"], meta["output_top_logprobs"]

    with Engine("tiny-random", tp_size=2, dtype="bfloat16", log_level="error") as engine:
        solo = [kept(engine.generate(input_ids=p, sampling_params=sp, **lp)) for p, sp in zip(prompts, seeded)]
    with Engine("tiny-random", tp_size=2, dtype="bfloat16", log_level="error", **PRESSURE) as engine:
        batched = engine.generate(input_ids=prompts, sampling_params=seeded, **lp)
    assert [kept(o) for o in batched] == solo


def test_a_rank_that_dies_stops_the_engine_with_an_error_naming_it():
    cpu_before = (os.sched_getaffinity(0), torch.get_num_threads())
    engine = Engine("tiny-random", tp_size=2, log_level="error", max_total_tokens=512)
    try:
        engine.generate("warm up", {"max_new_tokens": 2})
        (pid,) = _follower_pids(engine)
        for _ in range(3):
            engine.submit("The quick brown fox", sampling_params={"max_new_tokens": 500, "ignore_eos": True})
        engine.step()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TpRankDiedError, match=rf"tp rank 1 \(pid {pid}\) exited with code -9"):
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - start < 30
        with pytest.raises(TpRankDiedError, match="start a new one"):
            engine.step()
    finally:
        engine.shutdown()
    assert get_tp_group().world_size == 1
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == cpu_before, "rank 0 gets its cores back"
    # a new tensor-parallel engine can start in the same process afterwards
    with Engine("tiny-random", tp_size=2, log_level="error", max_total_tokens=256) as again:
        assert again.generate("hi", {"max_new_tokens": 3, "temperature": 0})["output_ids"]


def test_a_tp_size_that_cannot_split_the_heads_is_refused_and_leaves_no_process():
    before = set(_children())
    with pytest.raises(ValueError, match="--tp-size 3 cannot split 4 attention heads over 2 KV heads; sizes that can: 1, 2, 4"):
        Engine("tiny-random", tp_size=3, log_level="error", max_total_tokens=256)
    deadline = time.monotonic() + 15
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_children()) - before
    assert get_tp_group().world_size == 1


def _children() -> list[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if os.path.exists(f"/proc/{p}") and "Z" not in _state(int(p))]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2]
    except OSError:
        return "Z"


@pytest.mark.real_model
def test_smollm2_tp2_gives_tp1_s_tokens():
    """SmolLM2-135M: 9 heads, 3 KV heads, so rank 0 holds KV heads 0-1 with query heads
    0-5 and rank 1 KV head 2 with query heads 6-8 (the split is by GQA group, uneven);
    the MLP's 1536 features and the 49152-token vocabulary split evenly."""
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    # chunks of 8 and a pool too small for all three to finish: retraction
    kw = {"max_total_tokens": 48, "chunked_prefill_size": 8, "schedule_conservativeness": 0.05,
          "log_level": "error", "dtype": "float32"}
    outs, retracted = {}, {}
    for tp in (1, 2):
        bus = ev.EventBus()
        seen: list = []
        bus.subscribe(lambda e: seen.append(e) if isinstance(e, (ev.ReqRetracted, ev.ReqChunked)) else None)
        with Engine(tp_size=tp, event_bus=bus, **kw) as engine:
            params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
            outs[tp] = [o["output_ids"] for o in engine.generate(prompts, params)]
        retracted[tp] = [type(e).__name__ for e in seen]
    assert outs[2] == outs[1]
    assert "ReqRetracted" in retracted[2] and "ReqChunked" in retracted[2]


def test_a_script_without_the_main_guard_fails_at_once_and_says_why(tmp_path):
    """Each rank re-imports the script (spawn): without the guard rank 1 dies starting;
    rank 0 sees it while it waits for the ranks to meet, not after the 300 s timeout."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text("from sglite.engine import Engine\n"
                      "Engine('tiny-random', tp_size=2, max_total_tokens=256, log_level='error')\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and time.monotonic() - start < 60
    assert "tp rank 1 (pid" in out.stderr and "needs the if __name__ == '__main__': guard" in out.stderr, out.stderr


def test_a_forward_that_fails_on_rank_0_stops_the_engine_instead_of_desynchronizing_the_ranks(monkeypatch):
    """With tp 1 a failed round fails its requests and the engine goes on
    (SchedulerRecovery); with tp 2 the other rank is already inside that forward's
    collectives, so the engine stops with the cause."""
    with Engine("tiny-random", tp_size=2, log_level="error", max_total_tokens=256) as engine:
        engine.generate("warm up", {"max_new_tokens": 2})
        runner = engine.scheduler.tp_worker.model_runner
        real = runner._forward

        def broken(fb):
            if fb.forward_mode.is_decode():
                raise RuntimeError("injected")
            return real(fb)

        monkeypatch.setattr(runner, "_forward", broken)
        with pytest.raises(TpRankDiedError, match=r"tp rank 0's forward failed .*out of step \(RuntimeError: injected\)"):
            engine.generate("Hello", {"max_new_tokens": 4})
