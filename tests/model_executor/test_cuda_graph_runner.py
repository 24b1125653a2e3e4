"""CudaGraphRunner without a GPU: the captured batch sizes, the padding choice, and
the static-buffer plumbing (copy in, pad, replay, slice out) with an eager stand-in
for the CUDA graph, on the triton backend under TRITON_INTERPRET=1. What only a GPU
can show (the capture itself) is left to benchmarks/gpu.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from sglite.model_executor.cuda_graph_runner import CudaGraphRunner, get_batch_sizes_to_capture, padded_batch_size
from sglite.model_executor.model_runner import ModelRunner
from sglite.server_args import ServerArgs
from tests.helpers import HandScheduler


def test_batch_sizes_to_capture():
    assert get_batch_sizes_to_capture(1) == [1]
    assert get_batch_sizes_to_capture(32) == [1, 2, 4, 8, 16, 24, 32]
    assert get_batch_sizes_to_capture(20) == [1, 2, 4, 8, 16, 20]
    sizes = get_batch_sizes_to_capture(128)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 128 and all(b - a == 8 for a, b in zip(sizes[4:], sizes[5:]))


def test_a_batch_runs_in_the_smallest_graph_that_holds_it():
    sizes = get_batch_sizes_to_capture(32)
    assert [padded_batch_size(sizes, bs) for bs in (1, 3, 4, 5, 17, 24, 31, 32)] == [1, 4, 4, 8, 24, 24, 32, 32]


def test_flags_parse():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "48"]))
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 48
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)


def test_no_graphs_on_cpu():
    assert ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=64)).cuda_graph_runner is None


class EagerGraph:
    """Stands in for a captured CUDAGraph: replay reruns the forward into the output
    buffer, reading the same static inputs a real graph reads."""

    def __init__(self, run_once, out):  # noqa: ANN001
        self.run_once, self.out = run_once, out

    def replay(self) -> None:
        self.out.copy_(self.run_once())


class EagerGraphRunner(CudaGraphRunner):
    def _capture_graph(self, run_once):  # noqa: ANN001, ANN202
        out = run_once()
        return EagerGraph(run_once, out), out


def test_replay_pads_and_matches_eager_decode():
    """bs 3 runs padded to 4 (its padding row writes only slot 0), then bs 1 reuses the
    buffers; every logit equals the torch_native backend's, and KV of real rows is intact."""
    def runner(backend: str) -> ModelRunner:
        return ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=128, max_running_requests=4,
                                      attention_backend=backend))

    graphed, plain = runner("triton"), runner("torch_native")
    graphed.cuda_graph_runner = EagerGraphRunner(graphed)
    assert graphed.cuda_graph_runner.capture_bs == [1, 2, 4]
    hs_g, hs_p = HandScheduler(graphed), HandScheduler(plain)
    seqs = {}
    for hs in (hs_g, hs_p):
        ids = [hs.new_seq() for _ in range(3)]
        hs.extend([(ids[0], [5, 6, 7]), (ids[1], [8, 9]), (ids[2], [10, 11, 12, 13])])
        seqs[hs] = ids
    r = graphed.cuda_graph_runner
    for step in ([(0, 1), (1, 2), (2, 3)], [(2, 4)], [(0, 5), (2, 6)]):
        got = hs_g.decode([(seqs[hs_g][i], t) for i, t in step])
        want = hs_p.decode([(seqs[hs_p][i], t) for i, t in step])
        assert got.shape == want.shape == (len(step), graphed.model_config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        if len(step) == 3:  # the padding row: req slot 0, seq_len 1, position 0, KV slot 0
            assert (r.req_pool_indices[3].item(), r.seq_lens[3].item(), r.positions[3].item(),
                    r.out_cache_loc[3].item()) == (0, 1, 0, 0)
