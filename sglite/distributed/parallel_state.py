"""The tensor-parallel group (SGLang: distributed/parallel_state.py).

Every process of a ``--tp-size N`` engine calls ``init_distributed_environment`` once
(before its model is built: the parallel layers read their rank here) and
``destroy_model_parallel`` when it stops. Without it, or with N = 1, the group is a
single rank and its collectives return their input: tp 1 runs no torch.distributed.

The group holds two torch process groups over the same ranks: ``device_group`` for the
forward's all-reduce and all-gather (NCCL on CUDA, gloo on a CPU) and ``cpu_group``
(always gloo) for ``broadcast_pyobj``, the leader's batch sent to the other ranks. When
every rank is on one x86-64 machine and on the CPU, all-reduce and all-gather go through
shared memory instead of gloo's loopback sockets (``shm_allreduce.py``, as SGLang's CPU
backend: 25-40 us against 1-2 ms an all-reduce on this project's VMs). It also adds up
the seconds its collectives took (``take_comm_time``): on a CPU gloo
returns when the data is there, so this is the all-reduce's real cost; on CUDA NCCL
returns at once and the number is only the launch.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch

from sglite.distributed.shm_allreduce import ShmAllReduce, new_shm_path, shm_supported

# a rank waits for the leader's next batch in a collective: an idle server waits there
# for as long as it is idle, so the groups' timeout is long; a rank that dies is seen at
# once (its sockets close and the collective raises)
GROUP_TIMEOUT = timedelta(days=30)
# how long the ranks wait for each other to start (rank 0's store waits for the others)
RENDEZVOUS_TIMEOUT = timedelta(seconds=300)


class TpRankDiedError(RuntimeError):
    """A tensor-parallel rank stopped: the engine cannot go on without its shard."""


@dataclass
class GroupCoordinator:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    device_group: Any = None  # torch ProcessGroup, None for a single rank
    cpu_group: Any = None
    shm: Any = None  # ShmAllReduce when the ranks share this machine's memory, else None
    comm_time: float = field(default=0.0)  # seconds in all_reduce / all_gather since take_comm_time
    comm_calls: int = 0  # all_reduce and all_gather calls of the forward (a count for the walkthrough)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        start = time.perf_counter()
        if self.shm is not None:
            self.shm.all_reduce(t)
        else:
            with _rank_loss("all_reduce"):
                dist.all_reduce(t, group=self.device_group)
        self.comm_time += time.perf_counter() - start
        self.comm_calls += 1
        return t

    def all_reduce_min(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (each rank's KV pool size: the pools must match)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        with _rank_loss("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` side by side along the last dimension (rank order); the
        ranks' tensors have the same shape."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        start = time.perf_counter()
        if self.shm is not None:
            out = self.shm.all_gather(t.contiguous())
        else:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            with _rank_loss("all_gather"):
                dist.all_gather(parts, t.contiguous(), group=self.device_group)
            out = torch.cat(parts, dim=-1)
        self.comm_time += time.perf_counter() - start
        self.comm_calls += 1
        return out

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same count on each), rank by rank; on the CPU group."""
        if self.world_size == 1:
            return [list(values)]
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        with _rank_loss("all_gather"):
            dist.all_gather(parts, t, group=self.cpu_group)
        return [p.tolist() for p in parts]

    def broadcast_pyobj(self, obj: Any = None, src: int = 0) -> Any:
        """SGLang's broadcast_pyobj: ``src`` pickles ``obj``; its size, then its bytes go
        to every rank as tensors on the CPU group. Every rank returns the object."""
        import torch.distributed as dist

        with _rank_loss("broadcast"):
            if self.rank == src:
                data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
                size = torch.tensor([data.numel()], dtype=torch.int64)
                dist.broadcast(size, src, group=self.cpu_group)
                dist.broadcast(data, src, group=self.cpu_group)
                return obj
            size = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(size, src, group=self.cpu_group)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(data, src, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def take_comm_time(self) -> float:
        """Seconds the collectives took since the last call."""
        t, self.comm_time = self.comm_time, 0.0
        return t


@contextlib.contextmanager
def _rank_loss(op: str) -> Iterator[None]:
    """A collective whose peer went away raises TpRankDiedError (gloo: 'Connection closed
    by peer'; NCCL: an error or a timeout), not a bare RuntimeError."""
    try:
        yield
    except RuntimeError as e:
        raise TpRankDiedError(f"a tensor-parallel rank stopped answering during {op}: {e}") from e


_TP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(t: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(t)


def tensor_model_parallel_all_gather(t: torch.Tensor) -> torch.Tensor:
    return _TP.all_gather(t)


def init_distributed_environment(world_size: int, rank: int, init_method: str, device: str,
                                 one_machine: bool = True) -> GroupCoordinator:
    """Join the ``world_size`` ranks at ``init_method`` (``tcp://host:port``; rank 0
    listens there): gloo on a CPU, NCCL on CUDA (with a gloo group beside it for
    broadcast_pyobj); shared memory for a CPU's collectives when ``one_machine``. One
    tensor-parallel engine per process at a time."""
    global _TP
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine (torch.distributed is initialized); "
                           "shut it down first")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), world_size, rank == 0, timeout=RENDEZVOUS_TIMEOUT,
                              wait_for_workers=False)
        if rank == 0:
            _wait_for_ranks(store, world_size)
        else:
            store.add(JOINED_KEY, 1)
    except TpRankDiedError:
        raise
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        raise TpRankDiedError(f"rank {rank}: the {world_size} tensor-parallel ranks did not all meet at "
                              f"{host}:{port} within {RENDEZVOUS_TIMEOUT.seconds} s: {e}") from e
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank, timeout=GROUP_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    _TP = GroupCoordinator(rank, world_size, device, dist.group.WORLD, cpu_group)
    if one_machine and shm_supported(1, device):
        _TP.shm = _open_shm(_TP)
    return _TP


def _open_shm(group: GroupCoordinator) -> ShmAllReduce:
    """Rank 0 makes the shared file and tells the others its name and every rank's pid
    (to notice a dead one); once all have mapped it, rank 0 unlinks it (the mappings
    stay; a crash leaves nothing in /dev/shm)."""
    import torch.distributed as dist

    path = group.broadcast_pyobj(new_shm_path() if group.rank == 0 else None)
    pids: list[Any] = [None] * group.world_size
    with _rank_loss("all_gather_object"):
        dist.all_gather_object(pids, os.getpid(), group=group.cpu_group)
    shm = ShmAllReduce(path, group.rank, group.world_size, pids, create=group.rank == 0) if group.rank == 0 else None
    with _rank_loss("barrier"):
        dist.barrier(group=group.cpu_group)  # the file exists
    shm = shm or ShmAllReduce(path, group.rank, group.world_size, pids, create=False)
    with _rank_loss("barrier"):
        dist.barrier(group=group.cpu_group)  # everyone mapped it
    if group.rank == 0:
        os.unlink(path)
    return shm


JOINED_KEY = "sglite/joined"  # each other rank adds 1 once it reached rank 0's store
_rank_watch: Callable[[], str] | None = None


def set_rank_watch(watch: Callable[[], str] | None) -> None:
    """What rank 0 asks while it waits for the others to start: '' while they run, else
    why one cannot come (the Engine: 'tp rank 1 (pid N) exited with code 1'). A rank
    that dies at start (a script without the ``if __name__ == "__main__":`` guard) then
    fails the engine at once instead of after RENDEZVOUS_TIMEOUT."""
    global _rank_watch
    _rank_watch = watch


def _wait_for_ranks(store: Any, world_size: int) -> None:
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while store.add(JOINED_KEY, 0) < world_size - 1:
        why = _rank_watch() if _rank_watch is not None else ""
        if why:
            raise TpRankDiedError(f"a tensor-parallel rank stopped before the ranks met: {why} (its error is above; "
                                  f"a script that starts a tp engine needs the if __name__ == '__main__': guard, "
                                  f"since each rank re-imports it)")
        if time.monotonic() > deadline:
            raise TpRankDiedError(f"the {world_size} tensor-parallel ranks did not all meet within "
                                  f"{RENDEZVOUS_TIMEOUT.seconds} s")
        time.sleep(0.05)


def destroy_model_parallel() -> None:
    """Leave the group (a later engine in this process may start its own)."""
    global _TP
    import torch.distributed as dist

    _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
