"""All-reduce and all-gather through shared memory for the tp ranks of one machine
(SGLang's CPU backend: ``shm_allreduce`` from sgl_kernel, when shared memory allows).

gloo sends every all-reduce through the loopback network: about 1-2 ms each on this
project's VMs, and SmolLM2 does 62 a forward. Here the ranks share one mapped file:

    flags:  one int64 per rank, each on its own 64-byte line: the last op it wrote
    data:   2 x ranks x CHUNK floats: a slot per rank, in two halves used in turn

An op (number ``seq``) writes the rank's tensor into its slot of half ``seq % 2``, sets
its flag to ``seq``, waits until every flag is >= seq, then reads all the slots: the sum
(all-reduce) or the concatenation (all-gather), computed the same way on every rank, so
every rank gets the same bits. One wait per op is enough with two halves: a rank can
only write half ``seq % 2`` again at op seq + 2, after every rank wrote op seq + 1, which
each did after it finished reading op seq. Tensors longer than CHUNK go in pieces, an
op each.

Ordering: x86-64 keeps stores in program order and loads in program order (TSO), so a
rank that sees a flag also sees the data written before it; sglite uses this path on
x86-64 only (gloo elsewhere). A wait spins (each rank has its own cores, see
ModelRunner's split_cpu_threads), yields the CPU after a while, and every
LIVENESS_INTERVAL seconds checks that the other ranks' processes are alive: a dead rank
raises TpRankDiedError instead of a wait forever.
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch

CHUNK = 1 << 20  # floats per rank slot (4 MB); larger tensors go in pieces
FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
SPINS_BEFORE_YIELD = 2000
LIVENESS_INTERVAL = 0.5  # seconds of waiting between checks that the other ranks live


def shm_supported(nnodes: int, device: str) -> bool:
    return nnodes == 1 and device == "cpu" and platform.machine().lower() in ("x86_64", "amd64") \
        and os.path.isdir("/dev/shm")


def new_shm_path() -> str:
    return f"/dev/shm/sglite-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world_size: int, pids: list[int], create: bool):
        """Rank 0 ``create``s the file; the others map it once it exists (the group's
        caller orders this with a barrier, then rank 0 unlinks it: the mapping stays)."""
        self.rank, self.world_size, self.pids = rank, world_size, pids
        size = world_size * FLAG_STRIDE * 8 + 2 * world_size * CHUNK * 4
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.flags = raw[: world_size * FLAG_STRIDE * 8].view(torch.int64)
        self.data = raw[world_size * FLAG_STRIDE * 8 :].view(torch.float32).view(2, world_size, CHUNK)
        self.seq = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (float32 math; bfloat16 is rounded once, after)."""
        flat = t.view(-1)
        for start in range(0, flat.numel(), CHUNK):
            piece = flat[start : start + CHUNK]
            slots = self._exchange(piece)
            piece.copy_(slots.sum(dim=0))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (one shape on all) side by side along the last dimension."""
        flat = t.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        for start in range(0, flat.numel(), CHUNK):
            slots = self._exchange(flat[start : start + CHUNK])
            for r in range(self.world_size):
                parts[r][start : start + CHUNK].copy_(slots[r])
        return torch.cat([p.view(t.shape) for p in parts], dim=-1)

    def _exchange(self, piece: torch.Tensor) -> torch.Tensor:
        """Publish ``piece`` (<= CHUNK values); every rank's, once all have published."""
        self.seq += 1
        n = piece.numel()
        half = self.data[self.seq % 2]
        half[self.rank, :n].copy_(piece)
        self.flags[self.rank * FLAG_STRIDE] = self.seq  # after the data (TSO: seen after it)
        self._wait(self.seq)
        return half[:, :n]

    def _wait(self, seq: int) -> None:
        others = [r * FLAG_STRIDE for r in range(self.world_size) if r != self.rank]
        spins, checked = 0, time.monotonic()
        while any(int(self.flags[i]) < seq for i in others):
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()
                if time.monotonic() - checked > LIVENESS_INTERVAL:
                    self._check_alive()
                    checked = time.monotonic()

    def _check_alive(self) -> None:
        from sglite.distributed.parallel_state import TpRankDiedError

        for r, pid in enumerate(self.pids):
            if r != self.rank and not _alive(pid):
                raise TpRankDiedError(f"tp rank {r} (pid {pid}) stopped during a shared-memory all-reduce")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
