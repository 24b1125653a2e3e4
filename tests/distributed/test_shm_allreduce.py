"""The shared-memory all-reduce / all-gather between real processes: exact sums and
concatenations (also across chunk boundaries and in bfloat16), the same bits on every
rank, and a rank that dies mid-wait is an error, not a hang."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from sglite.distributed import shm_allreduce
from sglite.distributed.parallel_state import TpRankDiedError
from sglite.distributed.shm_allreduce import ShmAllReduce, new_shm_path

WORLD = 3


def _worker(rank: int, path: str, pids: list[int], chunk: int, start: multiprocessing.Barrier,
            results: multiprocessing.Queue) -> None:
    shm_allreduce.CHUNK = chunk  # small: every tensor below goes in several pieces
    start.wait()
    shm = ShmAllReduce(path, rank, WORLD, pids, create=False)
    start.wait()
    out = {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        t = (torch.arange(40, dtype=torch.float32).view(4, 10) * (rank + 1)).to(dtype)
        out[name] = shm.all_reduce(t.clone()).float().tolist()
    logits = torch.full((2, 5), float(rank)) + torch.arange(5.0)
    out["gather"] = shm.all_gather(logits).tolist()
    results.put((rank, out))


def test_shared_memory_collectives_are_exact_and_identical_on_every_rank():
    ctx = multiprocessing.get_context("spawn")
    path, chunk = new_shm_path(), 7
    ShmAllReduce(path, 0, WORLD, [0] * WORLD, create=True)  # (the file; each rank maps it)
    try:
        start, results = ctx.Barrier(WORLD), ctx.Queue()
        alive = [os.getpid()] * WORLD  # (liveness checks look at this test's process: alive)
        procs = [ctx.Process(target=_worker, args=(r, path, alive, chunk, start, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        os.unlink(path)
    base = torch.arange(40, dtype=torch.float32).view(4, 10)
    assert got[0]["f32"] == (base * 6).tolist()  # 1 + 2 + 3
    assert got[0]["bf16"] == (base * 6).to(torch.bfloat16).float().tolist()
    want = torch.cat([torch.full((2, 5), float(r)) + torch.arange(5.0) for r in range(WORLD)], dim=-1)
    assert got[0]["gather"] == want.tolist()
    assert got[0] == got[1] == got[2]


def _lonely(path: str, pids: list[int], results: multiprocessing.Queue) -> None:
    shm = ShmAllReduce(path, 0, 2, pids, create=False)
    start = time.monotonic()
    try:
        shm.all_reduce(torch.ones(8))
        results.put("returned")
    except TpRankDiedError as e:
        results.put(f"{time.monotonic() - start:.1f}s {e}")


def test_a_rank_that_never_arrives_because_it_died_is_an_error():
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=os.getpid)
    dead.start()
    dead.join()
    path = new_shm_path()
    ShmAllReduce(path, 0, 2, [0, 0], create=True)
    try:
        results = ctx.Queue()
        p = ctx.Process(target=_lonely, args=(path, [0, dead.pid], results))
        p.start()
        msg = results.get(timeout=60)
        p.join(10)
    finally:
        os.unlink(path)
    assert f"tp rank 1 (pid {dead.pid}) stopped during a shared-memory all-reduce" in msg
    assert float(msg.split("s ", 1)[0]) < 5


@pytest.mark.parametrize("machine,nnodes,device,ok", [("x86_64", 1, "cpu", True), ("x86_64", 2, "cpu", False),
                                                      ("x86_64", 1, "cuda:0", False), ("aarch64", 1, "cpu", False)])
def test_shared_memory_is_used_only_on_one_x86_machine_on_the_cpu(monkeypatch, machine, nnodes, device, ok):
    monkeypatch.setattr(shm_allreduce.platform, "machine", lambda: machine)
    assert shm_allreduce.shm_supported(nnodes, device) is ok
