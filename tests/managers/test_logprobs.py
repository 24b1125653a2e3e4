"""Logprobs (SGLang's return_logprob, logprob_start_len, top_logprobs_num,
token_ids_logprob): their shapes, that a cached prefix does not cut the prompt's
logprobs short, and that they are batch-invariant like the tokens: a request's logprobs
are bit for bit its solo run's however it is batched, chunked, retracted or mixed, in
both loops, in bfloat16. The values against transformers: tests/test_real_model.py."""

from __future__ import annotations

import pytest

from sglite import events as ev
from sglite.engine import Engine
from tests.managers.test_batch_invariance import PRESSURE, workload

N = 24  # requests: enough that some are retracted in a 300-token pool
LOGPROB_KEYS = ["input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs"]


def asks(n: int) -> dict:
    """Every request asks for logprobs; odd ones from the prompt's start (their shared
    prefix would be a cache hit), even ones for the output only; top 3 and two ids."""
    return {"return_logprob": True, "logprob_start_len": [0 if i % 2 else -1 for i in range(n)],
            "top_logprobs_num": 3, "token_ids_logprob": [1, 2]}


def logprobs_of(results: list[dict]) -> list[dict]:
    return [{k: r["meta_info"][k] for k in LOGPROB_KEYS} for r in results]


@pytest.fixture(scope="module")
def solo() -> list[dict]:
    prompts, params = workload(N, 500)
    lp = asks(N)
    with Engine("tiny-random", dtype="bfloat16", log_level="error") as engine:
        return [logprobs_of([engine.generate(input_ids=p, sampling_params=sp, **{**lp, "logprob_start_len": s})])[0]
                for p, sp, s in zip(prompts, params, lp["logprob_start_len"])]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal-loop", "overlap-loop"])
def test_logprobs_equal_solo_runs_under_pressure(solo, overlap):
    prompts, params = workload(N, 500)
    seen: set[type] = set()
    with Engine("tiny-random", dtype="bfloat16", log_level="error", enable_mixed_chunk=True,
                disable_overlap_schedule=not overlap, **{**PRESSURE, "max_total_tokens": 300}) as engine:
        engine.event_bus.subscribe(lambda e: seen.add(type(e)))
        got = logprobs_of(engine.generate(input_ids=prompts, sampling_params=params, **asks(N)))
    assert {ev.ReqRetracted, ev.ReqChunked, ev.CacheMatched} <= seen
    assert got == solo


def test_shapes_are_sglang_s(solo):
    prompts, params = workload(N, 500)
    for i, (prompt, sp, lp) in enumerate(zip(prompts, params, solo)):
        start = 0 if i % 2 else len(prompt) - 1
        assert [t for _, t, _ in lp["input_token_logprobs"]] == prompt[start:]
        assert lp["input_token_logprobs"][0][0] is None and lp["input_top_logprobs"][0] is None
        assert all(v is not None for v, _, _ in lp["input_token_logprobs"][1:])
        assert len(lp["output_token_logprobs"]) == sp["max_new_tokens"]
        assert all(len(top) == 3 for top in lp["output_top_logprobs"] + lp["input_top_logprobs"][1:])
        assert all([t for _, t, _ in pos] == [1, 2] for pos in lp["output_token_ids_logprobs"])
        if sp.get("temperature") == 0:  # greedy: the sampled token is the top one
            assert all(top[0] == tok for top, tok in zip(lp["output_top_logprobs"], lp["output_token_logprobs"]))


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs_and_gives_the_same_bits():
    prompt = list(range(5, 45))
    greedy = {"max_new_tokens": 3, "temperature": 0}
    with Engine("tiny-random", dtype="bfloat16", log_level="error", chunked_prefill_size=8) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True, logprob_start_len=0)
        again = engine.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True, logprob_start_len=0)
        tail = engine.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True, logprob_start_len=30)
        plain = engine.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True)
    assert again["meta_info"]["cached_tokens"] == 0  # (SGLang too: the match stops at logprob_start_len)
    assert tail["meta_info"]["cached_tokens"] == 30 and plain["meta_info"]["cached_tokens"] == 39
    assert again["meta_info"]["input_token_logprobs"] == first["meta_info"]["input_token_logprobs"]
    assert tail["meta_info"]["input_token_logprobs"][1:] == first["meta_info"]["input_token_logprobs"][31:]
    for r in (again, tail, plain):
        assert r["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]


def test_a_stream_gives_each_chunk_s_new_logprobs_and_the_prompt_s_first():
    with Engine("tiny-random", log_level="error") as engine:
        args = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
        whole = engine.generate(**args)["meta_info"]
        chunks = list(engine.generate(**args, stream=True))
    assert chunks[0]["meta_info"]["input_token_logprobs"] == whole["input_token_logprobs"]
    assert all(c["meta_info"]["input_token_logprobs"] == [] for c in chunks[1:])
    assert [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]] == whole["output_token_logprobs"]
    assert [e for c in chunks for e in c["meta_info"]["output_top_logprobs"]] == whole["output_top_logprobs"]


def test_a_batch_may_ask_per_request_and_the_others_get_no_logprob_keys():
    with Engine("tiny-random", log_level="error") as engine:
        out = engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], sampling_params={"max_new_tokens": 2},
                              return_logprob=[True, False], top_logprobs_num=[0, 4])
        with pytest.raises(ValueError, match="a list of 2, for a batch of 2"):
            engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]], return_logprob=[True])
    assert "output_top_logprobs" not in out[0]["meta_info"] and len(out[0]["meta_info"]["output_token_logprobs"]) == 2
    assert not any(k in out[1]["meta_info"] for k in LOGPROB_KEYS)


def test_explain_the_trace_and_the_tui_show_a_request_s_closest_call():
    """A request asking for top logprobs: explain names its nearest tie (the output
    token whose two best candidates were closest), the TUI's request detail shows it and
    each token's top tokens, from the same events."""
    from tui.state import ViewBuilder

    builder = ViewBuilder()
    with Engine("tiny-random", log_level="error") as engine:
        engine.event_bus.subscribe(builder.apply)
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 6, "temperature": 0},
                              return_logprob=True, top_logprobs_num=3, rid="lp")
        text = engine.explain("lp")
    tops = out["meta_info"]["output_top_logprobs"]
    i = min(range(6), key=lambda k: tops[k][0][0] - tops[k][1][0])
    (best, best_id, _), (second, second_id, _) = tops[i][:2]
    want = f"closest call was output token {i}: {best_id} (logprob {best:.4f}) over {second_id} ({second:.4f})"
    assert want in text, text
    lines = builder.requests["lp"].logprob_lines(10 ** 9)
    assert lines[0].startswith(f"closest call: output token {i}: {best_id} ({best:.4f}) over {second_id}")
    assert len(lines) == 1 + 6 and lines[-1].startswith(f"  token    5: {out['output_ids'][5]}")


def test_max_new_tokens_0_scores_the_prompt():
    """SGLang's scoring request: max_new_tokens 0 runs the prompt and returns its
    logprobs, no output token (finish reason length 0); the same bits as a generating run."""
    with Engine("tiny-random", log_level="error") as engine:
        args = {"input_ids": [5, 6, 7, 8, 9], "return_logprob": True, "logprob_start_len": 0}
        scored = engine.generate(**args, sampling_params={"max_new_tokens": 0})
        ran = engine.generate(**args, sampling_params={"max_new_tokens": 3, "temperature": 0})
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    assert meta["input_token_logprobs"] == ran["meta_info"]["input_token_logprobs"]
