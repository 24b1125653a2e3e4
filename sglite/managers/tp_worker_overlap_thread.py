"""The model worker of the overlap loop (SGLang: managers/tp_worker_overlap_thread.py,
``TpModelWorkerClient``). docs/seeds.md §B6.

``forward_batch_generation`` hands a ForwardBatch to a worker thread and returns at
once with *future* token ids: one negative placeholder per request (``-index`` into
``future_token_ids_map``). The scheduler plans the next round with them as decode
inputs. The worker runs forwards one at a time, in launch order; just before a
forward it replaces each placeholder with the token the previous forward sampled
(``resolve_future_token_ids``), and after sampling it writes this round's tokens
into the map. On CPU the forward runs on this thread (torch releases the GIL inside
its kernels); on CUDA it also runs on its own stream.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from sglite.distributed.parallel_state import TpRankDiedError
from sglite.managers.tp_worker import GenerationBatchResult, TpModelWorker, run_forward
from sglite.model_executor.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import ModelWorkerBatch
    from sglite.model_executor.model_runner import ModelRunner


def resolve_future_token_ids(input_ids: torch.Tensor, future_token_ids_map: torch.Tensor) -> torch.Tensor:
    """input_ids = where(input_ids < 0, map[-input_ids], input_ids)."""
    return torch.where(input_ids < 0, future_token_ids_map[torch.clamp(-input_ids, min=0)], input_ids)


def _last_row_of_each_req(forward_batch: ForwardBatch) -> torch.Tensor:
    if forward_batch.forward_mode.is_decode():
        return torch.arange(forward_batch.batch_size, device=forward_batch.input_ids.device)
    return forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1


class TpModelWorkerClient:
    """A TpModelWorker whose forwards run on a thread, one round ahead of the scheduler."""

    def __init__(self, worker: TpModelWorker):
        self.worker = worker
        self.model_runner = worker.model_runner
        self.device = worker.device
        max_running_requests = worker.max_running_requests
        # futures of at most two rounds are alive at once (the one whose tokens the next
        # forward resolves, and the one being launched); a round has at most
        # max_running_requests + 1 requests (the chunked one)
        max_bs = max_running_requests + 1
        self.future_token_ids_limit = 3 * max_bs
        self.future_token_ids_map = torch.zeros(self.future_token_ids_limit + max_bs + 1, dtype=torch.int64,
                                                device=self.device)
        self.future_token_ids_ct = 0
        self.forward_stream = torch.cuda.Stream() if self.device.startswith("cuda") else None
        self.input_queue: queue.Queue[Any] = queue.Queue()
        # the thread holds no reference to self, so a dropped engine is collected and
        # its worker thread told to stop
        self._thread = threading.Thread(target=_forward_thread, args=(self.input_queue,), daemon=True,
                                        name="sglite-forward")
        self._thread.start()
        # also at interpreter exit: a forward thread still alive then aborts the process
        self._finalizer = weakref.finalize(self, _stop_forward_thread, self.input_queue, self._thread)

    def get_memory_pool(self) -> tuple[Any, Any]:
        return self.worker.get_memory_pool()

    def forward_batch_generation(self, model_worker_batch: "ModelWorkerBatch") -> GenerationBatchResult:
        """Queue the forward; return futures for the tokens it will sample. The
        ForwardBatch's tensors are built here, on the scheduler's thread (and, on CUDA,
        its stream), before the next round's planning edits any list it reads."""
        forward_batch = ForwardBatch.init_new(model_worker_batch, self.model_runner)
        bs = forward_batch.batch_size
        start = self.future_token_ids_ct + 1
        self.future_token_ids_ct = (self.future_token_ids_ct + bs) % self.future_token_ids_limit
        result = GenerationBatchResult(bid=model_worker_batch.bid, iteration=model_worker_batch.iteration,
                                       future_token_ids=[-(start + i) for i in range(bs)])
        launch_event = None
        if self.forward_stream is not None:
            # the inputs were copied to the device on this thread's stream
            launch_event = torch.cuda.Event()
            launch_event.record()
        self.input_queue.put((self.model_runner, self.future_token_ids_map, self.forward_stream, launch_event,
                              forward_batch, start, result))
        return result

    def resolve_last_batch_result(self, result: GenerationBatchResult) -> list[int]:
        """Wait for the forward to finish; its sampled token ids."""
        result.done.wait()
        result.resolved = time.monotonic()
        if isinstance(result.error, TpRankDiedError):
            raise result.error  # the engine stops; the scheduler must see what it is
        if result.error is not None:
            raise RuntimeError(f"the forward of batch {result.bid} failed: {result.error!r}") from result.error
        assert result.next_token_ids is not None
        return result.next_token_ids

    def shutdown(self) -> None:
        """Stop the forward thread, then the worker (with tp > 1: the other ranks)."""
        self._finalizer()
        self.worker.shutdown()


def _stop_forward_thread(input_queue: queue.Queue, thread: threading.Thread) -> None:
    input_queue.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=30)


def _forward_thread(input_queue: queue.Queue) -> None:
    while True:
        item = input_queue.get()
        if item is None:
            return
        model_runner, future_map, stream, launch_event, forward_batch, start, result = item
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    stream.wait_event(launch_event)
                    _forward(model_runner, future_map, forward_batch, start, result)
            else:
                _forward(model_runner, future_map, forward_batch, start, result)
        except BaseException as e:  # handed to the scheduler, which raises it
            result.error = e
        finally:
            result.done.set()
        del item, model_runner, forward_batch, result


def _forward(model_runner: "ModelRunner", future_map: torch.Tensor, forward_batch: ForwardBatch, start: int,
             result: GenerationBatchResult) -> None:
    placeholders = forward_batch.input_ids < 0
    if bool(placeholders.any()):
        forward_batch.input_ids = resolve_future_token_ids(forward_batch.input_ids, future_map)
        info = forward_batch.sampling_info
        if info is not None and info.output_token_counts is not None:
            # the penalties were built before these tokens existed: count them now
            rows = _last_row_of_each_req(forward_batch)
            was_future = placeholders[rows]
            info.cumulate_output_tokens(was_future.nonzero().view(-1), forward_batch.input_ids[rows][was_future])
    next_token_ids = run_forward(model_runner, forward_batch, result)
    future_map[start : start + len(next_token_ids)] = next_token_ids
