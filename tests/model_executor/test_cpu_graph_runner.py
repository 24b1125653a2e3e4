"""CpuGraphRunner: a decode forward as one C++ call (DecodeGraph) gives the modules'
logits and K/V bit for bit, on the model variants sglite loads; it takes every decode
batch and nothing else, and leaves the GIL while it runs."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from sglite.configs.model_config import ModelConfig
from sglite.engine import Engine
from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglite.model_executor.model_runner import ModelRunner
from sglite.server_args import ServerArgs
from tests.helpers import hand_batch, HandScheduler

VARIANTS = {
    # tiny-random's shape: GQA 4/2, head_dim 16 (the kernel's runtime head_dim), untied
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    # head_dim 64 as SmolLM2 (compiled in), MHA, tied embeddings
    "mha-tied-d64": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    # Qwen2-style QKV bias, llama3 RoPE scaling
    "qwen2-bias-llama3-rope": dict(architecture="qwen2", attention_bias=True, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


def make_model(variant: str, seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig(vocab_size=101, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
                      rms_norm_eps=1e-5, max_position_embeddings=512, **VARIANTS[variant])
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, std=1.0), "model.norm.weight": 1 + rand(h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (cfg.intermediate_size, h)),
                            ("mlp.up_proj", (cfg.intermediate_size, h)), ("mlp.down_proj", (h, cfg.intermediate_size))]:
            w[f"{p}{name}.weight"] = rand(*shape)
            if cfg.attention_bias and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                w[f"{p}{name}.bias"] = rand(shape[0])
        w[p + "input_layernorm.weight"] = 1 + rand(h)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(h)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rand(cfg.vocab_size, h)
    return cfg, w


def runner(variant: str, graph: bool, tokens: int = 512, dtype: str = "float32") -> ModelRunner:
    cfg, w = make_model(variant)
    args = ServerArgs(model_path="unused", device="cpu", max_total_tokens=tokens, max_running_requests=8,
                      disable_cpu_graph=not graph, dtype=dtype)
    return ModelRunner(args, cfg, w)


class CountingGraph:
    """Wraps a DecodeGraph and counts the forwards it ran."""

    def __init__(self, graph):  # noqa: ANN001
        self.graph, self.calls = graph, 0
        self.num_layers = graph.num_layers

    def run(self, *args):  # noqa: ANN002
        self.calls += 1
        return self.graph.run(*args)


def drive(hs: HandScheduler, steps: list) -> list[torch.Tensor]:
    """Prefill three requests, then run the decode steps (lists of (request, token))."""
    seqs = [hs.new_seq() for _ in range(3)]
    out = [hs.extend([(seqs[0], [5, 6, 7, 8, 9]), (seqs[1], [10, 11]), (seqs[2], list(range(20, 60)))])]
    for step in steps:
        out.append(hs.decode([(seqs[i], t) for i, t in step]))
    return out


STEPS = [[(0, 1), (1, 2), (2, 3)], [(2, 4)], [(1, 5), (0, 6)], [(0, 7), (1, 8), (2, 9)]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_logits_and_kv_equal_the_modules_bit_for_bit(variant, dtype):
    """bfloat16: the graph runs the packed linears (a vocabulary of 101 pads the LM head's
    last block) and the bfloat16 kernels, as the modules do."""
    graphed, plain = runner(variant, graph=True, dtype=dtype), runner(variant, graph=False, dtype=dtype)
    assert graphed.model.model.layers[0].mlp.down_proj.packed  # the cpu backend packs both dtypes
    assert plain.cpu_graph_runner is None
    counting = graphed.cpu_graph_runner.graph = CountingGraph(graphed.cpu_graph_runner.graph)
    got, want = drive(HandScheduler(graphed), STEPS), drive(HandScheduler(plain), STEPS)
    assert counting.calls == len(STEPS)  # every decode step ran in the graph, the prefill did not
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert torch.equal(g, w)
    for layer in range(graphed.model_config.num_hidden_layers):
        assert torch.equal(graphed.token_to_kv_pool.get_key_buffer(layer), plain.token_to_kv_pool.get_key_buffer(layer))
        assert torch.equal(graphed.token_to_kv_pool.get_value_buffer(layer),
                           plain.token_to_kv_pool.get_value_buffer(layer))


def test_decode_rows_sharing_a_cached_prefix_run_in_the_graph_too():
    """Chats on one cached system prompt: their decode rounds run in the graph, with the
    modules' logits (the cpu backend attends them with its kernel either way)."""
    graphed, plain = runner("gqa-untied", graph=True), runner("gqa-untied", graph=False)
    counting = graphed.cpu_graph_runner.graph = CountingGraph(graphed.cpu_graph_runner.graph)
    out = []
    for r in (graphed, plain):
        hs = HandScheduler(r)
        src, a, b = hs.new_seq(), hs.new_seq(), hs.new_seq()
        hs.extend([(src, [1 + i % 100 for i in range(300)])])
        hs.share_prefix(src, a, 300)
        hs.share_prefix(src, b, 300)
        out.append([hs.decode([(a, 7), (b, 8)]), hs.decode([(src, 9), (a, 10), (b, 11)])])
    assert counting.calls == 2
    assert all(torch.equal(g, w) for g, w in zip(*out))


def test_the_graph_leaves_the_gil_while_it_runs():
    """With a switch interval of a second, another Python thread gets the GIL within the
    call only if the call lets go of it."""
    r = runner("mha-tied-d64", graph=True, tokens=2048)
    hs = HandScheduler(r)
    seqs = [hs.new_seq() for _ in range(8)]
    hs.extend([(s, [1 + i % 100 for i in range(199)]) for s in seqs])
    loc = r.token_to_kv_pool_allocator.alloc(len(seqs))
    for j, s in enumerate(seqs):
        r.req_to_token_pool.write(s, 199, loc[j : j + 1])
    fb = ForwardBatch.init_new(hand_batch(ForwardMode.DECODE, [3] * len(seqs), seqs, [200] * len(seqs), loc), r)
    assert r.cpu_graph_runner.can_run(fb)
    started, done = threading.Event(), threading.Event()

    def forward() -> None:
        started.set()
        for _ in range(20):
            r.cpu_graph_runner.replay(fb)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        t = threading.Thread(target=forward)
        t.start()
        started.wait()
        n = 0
        while not done.is_set():
            n += 1
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert n > 0


def test_bad_input_is_a_one_line_error():
    r = runner("gqa-untied", graph=True)
    graph = r.cpu_graph_runner.graph
    ids = torch.tensor([1, 2], dtype=torch.int64)
    r2t = r.req_to_token_pool.req_to_token
    with pytest.raises(RuntimeError, match="out_cache_loc holds a slot outside the KV pool") as e:
        graph.run(ids, ids, torch.tensor([1, 10**6]), r2t, ids, ids + 1)
    assert "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="one length"):
        graph.run(ids, ids[:1], ids, r2t, ids, ids + 1)
    with pytest.raises(RuntimeError, match="input_ids must be a contiguous int64"):
        graph.run(ids.int(), ids, ids, r2t, ids, ids + 1)
    with pytest.raises(RuntimeError, match=r"input_norm has shape \[3\], expected \[128\]"):
        graph.add_layer(*[torch.ones(3)] * 2, None, *[torch.ones(3)] * 7, 256)


def test_off_without_the_cpu_backend_and_with_the_flag():
    assert ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=64,
                                  attention_backend="torch_native")).cpu_graph_runner is None
    assert ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=64)).cpu_graph_runner is not None
    assert ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=64,
                                  disable_cpu_graph=True)).cpu_graph_runner is None


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_tokens_equal_with_and_without_the_graph(overlap):
    """Greedy and seeded sampling through retracts (a small pool), both loops."""
    prompts = [f"request {i}: " + "tell me about the number seven " * (1 + i % 3) for i in range(10)]
    params = [dict(max_new_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(10)]

    def generate(graph: bool) -> list[list[int]]:
        engine = Engine(model_path="tiny-random", max_total_tokens=160, max_running_requests=6,
                        disable_cpu_graph=not graph, disable_overlap_schedule=not overlap)
        try:
            return [o["output_ids"] for o in engine.generate(prompts, params)]
        finally:
            engine.shutdown()

    assert generate(True) == generate(False)


def test_profiling_times_each_part_of_every_run():
    """DecodeGraph.set_profiling: every run's time split by part (the bench's roofline
    section); off by default, and turning it on again starts from zero."""
    r = runner("gqa-untied", graph=True, dtype="bfloat16")
    graph = r.cpu_graph_runner.graph
    parts = {"linear_ms", "lm_head_ms", "attention_ms", "norm_rope_act_ms", "other_ms"}
    drive(HandScheduler(r), STEPS[:1])
    assert graph.profile() == {**{p: 0.0 for p in parts}, "runs": 0.0}
    graph.set_profiling(True)
    drive(HandScheduler(r), STEPS)
    prof = graph.profile()
    assert set(prof) == parts | {"runs"} and prof["runs"] == len(STEPS)
    assert all(prof[p] > 0 for p in parts)
    graph.set_profiling(True)
    assert graph.profile()["runs"] == 0
