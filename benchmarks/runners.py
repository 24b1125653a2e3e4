"""One benchmark configuration, run in its own process so that its peak memory is its
own: ``python -m benchmarks.runners SPEC.json RESULT.json``.

A spec names the engine (sglite, transformers, llama-server, llama-batched-bench, or
llama-cpp-python), the model, the prompts
(token ids) and output lengths, and the engine's settings. Every engine loads the
model, warms up on a small batch, then runs the whole workload once, timed; the result
holds each request's output ids, its time to first token, the gaps between its tokens,
and the process's peak resident memory. (sglite-grammar, a grammar workload's engine,
returns per-step times instead: benchmarks/grammar.py.)
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

Say = Callable[[str], None]
WARMUP_PROMPT = list(range(100, 132))


def peak_rss_mb() -> float:
    """High-water mark of the resident memory of this process, or of the largest child
    it waited for (a peer's server: llama-server), whichever is larger (Linux reports KiB)."""
    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024


class Progress:
    """Prints how far a run is: at most every few seconds, and once at the end."""

    def __init__(self, label: str, total_reqs: int, total_tokens: int, every_s: float = 10.0):
        self.label, self.total_reqs, self.total_tokens, self.every_s = label, total_reqs, total_tokens, every_s
        self.t0 = self.last = time.monotonic()

    def update(self, reqs_done: int, tokens_done: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every_s:
            self.last = now
            print(f"      {self.label}: {tokens_done:,}/{self.total_tokens:,} output tokens, {reqs_done}/"
                  f"{self.total_reqs} requests finished, {now - self.t0:.0f} s", file=sys.stderr, flush=True)


# --- sglite ---------------------------------------------------------------------------


def freeze_heap() -> None:
    """After the warm-up, in every engine's process alike: what exists then (the model,
    torch, the imports) moves out of the cyclic garbage collector's reach, so the timed
    run is not stalled by full collections walking it (sglite: ``Engine.freeze_gc``, as
    SGLang's engine offers)."""
    import gc

    gc.collect()
    gc.freeze()


def _warmup_prompt(prompts: list[list[int]]) -> list[int]:
    """A warm-up prompt whose first token starts no workload prompt, so what it leaves
    in the prefix cache can never be hit."""
    firsts = {p[0] for p in prompts if p}
    start = next(t for t in range(3, 1 << 20) if t not in firsts)
    return [start] + WARMUP_PROMPT[1:]


class _Observer:
    """Engine-event subscriber: token times, prefill tokens computed, cache hits."""

    def __init__(self, progress: Progress):
        from sglite import events as ev

        self.ev = ev
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.gaps: list[float] = []
        self.prefill_computed = 0
        self.cache_hit_tokens = 0
        self.retracted = 0
        self.finished = 0
        self.tokens = 0
        self._chunk_continues: set[str] = set()
        self.progress = progress

    def __call__(self, e: Any) -> None:
        ev = self.ev
        if isinstance(e, ev.TokensEmitted):
            k = len(e.token_ids)
            prev = self.last.get(e.rid)
            if prev is None:
                self.first[e.rid] = e.ts
                self.gaps += [0.0] * (k - 1)
            else:  # tokens that arrive together share the gap evenly
                self.gaps += [(e.ts - prev) / k] * k
            self.last[e.rid] = e.ts
            self.tokens += k
            self.progress.update(self.finished, self.tokens)
        elif isinstance(e, ev.ReqAdmitted):
            self.prefill_computed += e.extend_len
            if e.rid not in self._chunk_continues:  # a later chunk's prefix is its own earlier chunk
                self.cache_hit_tokens += e.prefix_len
            if e.chunked:
                self._chunk_continues.add(e.rid)
            else:
                self._chunk_continues.discard(e.rid)
        elif isinstance(e, ev.ReqRetracted):
            self.retracted += 1
            self._chunk_continues.discard(e.rid)
        elif isinstance(e, ev.ReqFinished):
            self.finished += 1


def run_sglite(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from sglite.engine import Engine

    tic = time.perf_counter()
    engine = Engine(spec["model_path"], log_level="error", **spec.get("server_args", {}))
    load_s = time.perf_counter() - tic
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    warm = _warmup_prompt(prompts)
    engine.generate(input_ids=[warm, warm[:20]], sampling_params={"max_new_tokens": 4})
    engine.freeze_gc()

    tracer = None
    if spec.get("trace_level"):
        from tracing import setup_tracing

        spans = Path(tempfile.mkdtemp(prefix="sglite-bench-")) / "spans.jsonl"
        tracer = setup_tracing(engine.event_bus, spec["trace_level"], jsonl_path=str(spans),
                               model=spec["model_path"])
    obs = _Observer(Progress(spec["label"], len(prompts), sum(output_lens)))
    unsubscribe = engine.event_bus.subscribe(obs)
    runner = engine.scheduler.tp_worker.model_runner
    graph = runner.cpu_graph_runner.graph if runner.cpu_graph_runner is not None else None
    if graph is not None:
        graph.set_profiling(True)  # the split of a decode forward (a few clock reads per layer)
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in output_lens]
    rids = [f"b{i}" for i in range(len(prompts))]
    t0 = time.monotonic()
    outs = engine.generate(input_ids=prompts, sampling_params=params, rid=rids)
    wall = time.monotonic() - t0
    unsubscribe()
    obs.progress.update(obs.finished, obs.tokens, force=True)
    if tracer is not None:
        tracer.shutdown()  # flushing the exporter is not timed, as in tracing_overhead.py
        shutil.rmtree(spans.parent, ignore_errors=True)  # (written to be paid for, not kept)
    engine.shutdown()
    errors = [o["error"] for o in outs if o.get("error")]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return {
        "wall_s": wall, "load_s": load_s,
        "output_ids": [o["output_ids"] for o in outs],
        "ttft_s": [obs.first[r] - t0 for r in rids],
        "itl_s": obs.gaps,
        "prefill_computed": obs.prefill_computed,
        "cache_hit_tokens": obs.cache_hit_tokens,
        "details": {"retracted": obs.retracted, "kv_pool_tokens": engine.scheduler.max_total_num_tokens,
                    "attention_backend": runner.attn_backend.name, "dtype": str(runner.dtype).removeprefix("torch."),
                    "decode_forward_profile": graph.profile() if graph is not None else None},
    }


# --- Hugging Face transformers -----------------------------------------------------------


def load_transformers_model(model_path: str, dtype: str = "float32") -> Any:
    """The same weights as sglite's, in ``dtype``: the GGUF through transformers' own
    loader (as tests/test_real_model.py does), or tiny-random's tensors."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if model_path == "tiny-random":
        from sglite.model_loader.tiny_random import build_tiny_random

        cfg, weights, _ = build_tiny_random()
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=cfg.eos_token_ids[0])
        model = transformers.LlamaForCausalLM(hf_cfg)
        model.load_state_dict(weights, strict=True)
        return model.to(getattr(torch, dtype)).eval()
    if model_path == "smollm2-135m":
        from sglite.model_loader.registry import resolve_smollm2_gguf

        path = resolve_smollm2_gguf()
    else:
        path = Path(model_path).expanduser()
    if path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=getattr(torch, dtype))
    return model.eval()


def _greedy_config(model: Any, pad_id: int) -> Any:
    """Greedy, and EOS does not stop a row (sglite's ignore_eos): every request makes
    exactly its number of tokens, and a row that samples EOS goes on generating (in a
    batch, transformers would pad a finished row instead)."""
    import copy

    gc = copy.deepcopy(model.generation_config)
    gc.do_sample, gc.num_beams = False, 1
    gc.temperature = gc.top_p = gc.top_k = None
    # None would be filled back in from the model's config: an id no logit can produce
    gc.eos_token_id = model.config.vocab_size
    gc.pad_token_id = pad_id
    return gc


class _StepClock:
    """A logits processor that only notes when each step's logits are ready (the token
    is picked right after): one time stamp per generated position."""

    def __init__(self, on_step: Callable[[int], None] | None = None) -> None:
        self.stamps: list[float] = []
        self.on_step = on_step

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.stamps.append(time.monotonic())
        if self.on_step is not None:
            self.on_step(len(self.stamps))
        return scores


def _hf_batch(model: Any, gc: Any, prompts: list[list[int]], output_lens: list[int], pad_id: int,
              progress: Progress | None = None, reqs_before: int = 0, tokens_before: int = 0) -> dict[str, Any]:
    """One static batch: left padding, generate up to the longest output, keep each
    request's own length."""
    import torch
    from transformers import LogitsProcessorList

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    def on_step(step: int) -> None:
        if progress is not None:
            progress.update(reqs_before + sum(n <= step for n in output_lens),
                            tokens_before + sum(min(n, step) for n in output_lens))

    clock = _StepClock(on_step)
    steps = max(output_lens)
    gc.max_new_tokens = steps
    t0 = time.monotonic()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                             logits_processor=LogitsProcessorList([clock]))
    dur = time.monotonic() - t0
    new = out[:, width:]
    if new.shape[1] != steps or len(clock.stamps) != steps:
        raise RuntimeError(f"transformers generated {new.shape[1]} of {steps} steps")
    rows = []
    for r, n in enumerate(output_lens):
        st = clock.stamps[:n]
        rows.append({"output_ids": new[r, :n].tolist(), "ttft": st[0] - t0,
                     "gaps": [b - a for a, b in zip(st, st[1:])]})
    return {"dur": dur, "rows": rows, "padded_prompt_tokens": len(prompts) * width,
            "useful_tokens": sum(output_lens)}


def run_transformers(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    tic = time.perf_counter()
    model = load_transformers_model(spec["model_path"], spec.get("dtype", "float32"))
    load_s = time.perf_counter() - tic
    pad_id = spec.get("pad_id", 0)
    gc = _greedy_config(model, pad_id)
    _hf_batch(model, gc, [WARMUP_PROMPT, WARMUP_PROMPT[:20]], [4, 4], pad_id)
    freeze_heap()

    prompts, output_lens = spec["prompts"], spec["output_lens"]
    n = len(prompts)
    sizes = sorted({min(b, n) for b in spec["batch_sizes"]})
    first: dict[int, dict[str, Any]] = {}
    sweep: dict[int, float] = {}
    for b in sizes:  # each candidate's first batch; the best one's is reused below
        trial = Progress(f"{spec['label']}, first batch of {b}", b, sum(output_lens[:b]))
        res = _hf_batch(model, gc, prompts[:b], output_lens[:b], pad_id, trial)
        first[b] = res
        sweep[b] = res["useful_tokens"] / res["dur"]
        if len(sizes) > 1:
            say(f"      {spec['label']}: batch size {b}: {sweep[b]:.1f} output tok/s on its first batch "
                f"({res['dur']:.0f} s)")
    best = max(sizes, key=lambda b: sweep[b])
    batches = [first[best]]
    progress = Progress(f"{spec['label']}, batches of {best}", n, sum(output_lens))
    for start in range(best, n, best):
        batches.append(_hf_batch(model, gc, prompts[start:start + best], output_lens[start:start + best], pad_id,
                                 progress, start, sum(output_lens[:start])))
    progress.update(n, sum(output_lens), force=True)
    output_ids, ttft, gaps = [], [], []
    offset = 0.0  # static batches run one after the other
    for res in batches:
        for row in res["rows"]:
            output_ids.append(row["output_ids"])
            ttft.append(offset + row["ttft"])
            gaps += row["gaps"]
        offset += res["dur"]
    return {
        "wall_s": offset, "load_s": load_s, "output_ids": output_ids, "ttft_s": ttft, "itl_s": gaps,
        "prefill_computed": sum(r["padded_prompt_tokens"] for r in batches), "cache_hit_tokens": None,
        "details": {"batch_size": best, "sweep_tok_s": {str(k): v for k, v in sweep.items()},
                    "dtype": spec.get("dtype", "float32")},
    }


# --- llama.cpp ---------------------------------------------------------------------------


def run_llama_server(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    from benchmarks import llamacpp as llama_cpp

    progress = Progress(spec["label"], len(spec["prompts"]), sum(spec["output_lens"]))
    res = llama_cpp.run_server(spec, say, lambda reqs, toks: progress.update(reqs, toks))
    progress.update(len(spec["prompts"]), sum(spec["output_lens"]), force=True)
    return res


def run_llama_batched_bench(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    from benchmarks import llamacpp as llama_cpp

    return llama_cpp.run_batched_bench(spec, say)


# llama-cpp-python (optional; not a dependency): one request after the other


def run_llama_cpp(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    """Requests one after the other through llama-cpp-python's ``Llama.generate`` on the
    GGUF as it is (quantized weights, not float32); llama.cpp reuses the KV of the
    longest common prefix with the previous prompt."""
    from llama_cpp import Llama

    from sglite.model_loader.registry import resolve_smollm2_gguf

    path = resolve_smollm2_gguf() if spec["model_path"] == "smollm2-135m" else Path(spec["model_path"])
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    tic = time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=max(len(p) + o for p, o in zip(prompts, output_lens)) + 16,
                n_threads=spec["threads"], n_batch=512, verbose=False)
    load_s = time.perf_counter() - tic

    def one(p: list[int], n: int) -> tuple[list[int], list[float]]:
        toks, stamps = [], []
        for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            toks.append(int(t))
            stamps.append(time.monotonic())
            if len(toks) == n:
                break
        return toks, stamps

    one(WARMUP_PROMPT, 4)
    freeze_heap()
    progress = Progress(spec["label"], len(prompts), sum(output_lens))
    output_ids, ttft, gaps = [], [], []
    t0 = time.monotonic()
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        toks, stamps = one(p, n)
        output_ids.append(toks)
        ttft.append(stamps[0] - t0)
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        progress.update(i + 1, sum(output_lens[: i + 1]), force=i + 1 == len(prompts))
    return {"wall_s": time.monotonic() - t0, "load_s": load_s, "output_ids": output_ids, "ttft_s": ttft,
            "itl_s": gaps, "prefill_computed": None, "cache_hit_tokens": None,
            "details": {"weights": "GGUF as stored (quantized)", "dtype": "Q4_1"}}


def run_sglite_grammar(spec: dict[str, Any], say: Say) -> dict[str, Any]:
    """A grammar workload: constrained against unconstrained (benchmarks/grammar.py)."""
    from benchmarks import grammar

    return grammar.run(spec, say)


RUNNERS = {"sglite": run_sglite, "transformers": run_transformers, "llama.cpp": run_llama_cpp,
           "llama-server": run_llama_server, "llama-batched-bench": run_llama_batched_bench,
           "sglite-grammar": run_sglite_grammar}


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = RUNNERS[spec["engine"]](spec, say)
    result["peak_rss_mb"] = peak_rss_mb()
    result["ok"] = True
    return result


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = argv if argv is not None else sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_spec(spec)
        code = 0
    except Exception as e:  # the parent reports the failure in the table and runs on
        traceback.print_exc()
        result, code = {"ok": False, "error": f"{type(e).__name__}: {e}"}, 1
    import gc

    gc.unfreeze()  # frozen objects would outlive the interpreter's last collection
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
