"""`sglite bench` end to end on tiny-random (a few requests, each configuration in its
own process, transformers on the same tiny weights when installed): the table's
columns, consistent numbers, the plots; the grammar workload's row (constrained against
unconstrained, alternating pairs). No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import pytest

from benchmarks import bench, grammar
from benchmarks.report import COLUMNS, Row, median_run, parse_markdown_table, write_plots
from benchmarks.workloads import build_workload, distinct_prefix_tokens
from sglite.model_loader import load_model

HAS_TRANSFORMERS = bench.baseline_unavailable() == ""
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_model("tiny-random").tokenizer


def test_distinct_prefix_tokens_counts_trie_nodes():
    assert distinct_prefix_tokens([[1, 2, 3], [1, 2, 4], [5]]) == 5
    assert distinct_prefix_tokens([[1, 2], [1, 2]]) == 2
    assert distinct_prefix_tokens([]) == 0


def test_full_size_workloads(tiny_tokenizer):
    sp = build_workload("shared-prefix", tiny_tokenizer, 512, 2048)
    assert sp.num_requests == 64 and set(sp.output_lens) == {64}
    assert len({tuple(p) for p in sp.prompts}) == 64  # distinct questions
    common = next(i for i in range(len(sp.prompts[0])) if len({p[i] for p in sp.prompts}) > 1)
    assert common >= 300  # the system prompt (and the template around it) is shared
    assert sp.distinct_prompt_tokens < sp.total_prompt_tokens / 5
    rl = build_workload("random-lengths", tiny_tokenizer, 512, 2048)
    assert rl.num_requests == 32 and all(50 <= len(p) <= 500 for p in rl.prompts)
    assert all(20 <= n <= 200 for n in rl.output_lens)
    lp = build_workload("long-prompts", tiny_tokenizer, 512, 4096)
    assert [len(p) > 1000 for p in lp.prompts] == [True, False] * 3
    with pytest.raises(ValueError, match="context"):
        build_workload("long-prompts", tiny_tokenizer, 512, 1024)


def test_bench_end_to_end_on_tiny_random(tmp_path):
    argv = ["--model-path", "tiny-random", "--quick", "--workload", "shared-prefix", "--requests", "4",
            "--ablations", "radix-off,trace-2", "--hf-batch-sizes", "2,4", "--peers", "transformers",
            "--out", str(tmp_path)]
    if not HAS_TRANSFORMERS:
        argv.append("--skip-baseline")
    assert bench.main(argv) == 0

    md = next(tmp_path.glob("bench-quick-shared-prefix-*.md")).read_text()
    assert md.count("\n| config |") == 1
    table_text = md[md.index("| config |"):]
    rows = {r["config"]: r for r in parse_markdown_table(table_text)}
    assert list(parse_markdown_table(table_text)[0]) == COLUMNS
    expected = {"sglite", "sglite, radix cache off", "sglite, tracing level 2"}
    assert expected <= set(rows)
    if HAS_TRANSFORMERS:
        assert "transformers" in rows and "shared-prefix: sglite ≥ 3× transformers" in md
        assert rows["sglite"]["greedy = transformers"] == "4/4"  # tiny-random has no near-ties
        assert "static batches of" in md

    data = json.loads(next(tmp_path.glob("bench-quick-shared-prefix-*.json")).read_text())
    wl = data["workloads"]["shared-prefix"]
    by_label = {r["label"]: r for r in wl["rows"]}
    assert all(r["ok"] and r["lengths_ok"] for r in wl["rows"])
    on, off = by_label["sglite"], by_label["sglite, radix cache off"]
    assert wl["distinct_prompt_tokens"] <= on["prefill_computed"] < wl["total_prompt_tokens"]
    assert off["prefill_computed"] == wl["total_prompt_tokens"] and off["cache_hit_rate"] == 0
    assert on["cache_hit_rate"] > 0.5
    assert by_label["sglite, tracing level 2"]["prefill_computed"] == on["prefill_computed"]
    for r in wl["rows"]:
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        assert 0 < r["ttft_p50"] <= r["ttft_p99"] and 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["peak_rss_mb"] > 50
    if HAS_TRANSFORMERS:
        hf = by_label["transformers"]
        assert hf["prefill_computed"] >= wl["total_prompt_tokens"]  # padding is computed too
        assert hf["details"]["batch_size"] in (2, 4)
        assert all(r["greedy_matches"] == 4 for r in wl["rows"] if r["engine"] == "sglite")

    if HAS_MATPLOTLIB:
        assert sorted(data["plots"]) == sorted(p.name for p in tmp_path.glob("*.png"))
        assert len(data["plots"]) == 2 and all((tmp_path / p).stat().st_size > 1000 for p in data["plots"])
        assert all(f"]({p})" in md for p in data["plots"])


def test_json_schema_workload_is_bounded_schemas_and_runs_sglite_alone(tiny_tokenizer):
    wl = build_workload("json-schema", tiny_tokenizer, 512, 2048)
    assert wl.paired and wl.num_requests == 64 and wl.grammar_levels == ((1, 8), (64, 64))
    assert len({tuple(p) for p in wl.prompts}) == 64  # distinct prompts
    schemas = [json.loads(s["json_schema"]) for s in wl.sampling]
    assert len({json.dumps(s) for s in schemas[:8]}) == 8 and schemas[8:16] == schemas[:8]  # batch 1: each once
    assert all(s["additionalProperties"] is False and set(s["required"]) == set(s["properties"]) for s in schemas)
    assert wl.server_args == {"constrained_json_disable_any_whitespace": True}
    assert "json-schema" not in bench.ALL_WORKLOADS and not build_workload("one-chat", tiny_tokenizer, 512, 2048).paired
    runs, _ = bench.plan([wl], bench.select_ablations("default"), {"transformers", "llama.cpp"}, "float32", pairs=3)
    assert [(r.label, r.engine, r.settings) for r in runs] == [("sglite", "sglite-grammar", {"pairs": 3})]
    runs, _ = bench.plan([wl], bench.select_ablations("overlap-on"), set(), "float32")
    assert [r.label for r in runs] == ["sglite", "sglite, overlap loop"] and runs[1].engine == "sglite-grammar"


def test_grammar_row_end_to_end_on_tiny_random(tmp_path, capfd):
    argv = ["--model-path", "tiny-random", "--quick", "--workload", "json-schema", "--requests", "2",
            "--ablations", "none", "--peers", "transformers", "--pairs", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    # the worker process prints the pairs (to file descriptor 2: capfd, not capsys)
    progress = [ln.strip() for ln in capfd.readouterr().err.splitlines() if ": batch " in ln and "pair" in ln]
    assert [ln.split(": constrained")[0] for ln in progress] == [
        f"sglite: batch {b}, pair {i}/2" for b in (1, 2) for i in (1, 2)]

    md = next(tmp_path.glob("bench-quick-json-schema-*.md")).read_text()
    assert "Machine: " in md and "--constrained-json-disable-any-whitespace" in md
    table = parse_markdown_table(md[md.index("| config |"):])
    assert list(table[0]) == grammar.COLUMNS
    assert [(r["config"], r["batch"], r["requests"]) for r in table] == [("sglite", "1", "2"), ("sglite", "2", "2")]
    assert not list(tmp_path.glob("*.png"))  # a grammar workload has no plots (and no peer ran)

    data = json.loads(next(tmp_path.glob("bench-quick-json-schema-*.json")).read_text())
    rows = data["workloads"]["json-schema"]["rows"]
    assert [(r["label"], r["engine"], r["ok"], r["lengths_ok"]) for r in rows] == [
        ("sglite", "sglite-grammar", True, True)]
    for lv, cells in zip(rows[0]["details"]["levels"], table):
        assert len(lv["constrained_s"]) == len(lv["unconstrained_s"]) == len(lv["ratios"]) == 2
        assert min(lv["constrained_s"] + lv["unconstrained_s"]) > 0 and lv["steps"] > 0
        assert lv["ratios"] == [c / u for c, u in zip(lv["constrained_s"], lv["unconstrained_s"])]
        # batch 1: every decode step of 2 requests one at a time (the first token is the prefill's)
        assert lv["batch"] > 1 or lv["steps"] == lv["output_tokens"] - 2
        assert cells["valid JSON"] == f"{lv['valid_json']}/2" and cells["decode steps / run"] == str(lv["steps"])
        assert cells["constrained / unconstrained"] == f"{statistics.median(lv['ratios']):.3f}×"


def test_repeated_runs_are_interleaved_and_the_median_run_is_reported(tmp_path, capsys):
    argv = ["--model-path", "tiny-random", "--quick", "--workload", "random-lengths", "--requests", "2",
            "--ablations", "radix-off", "--skip-baseline", "--repeat", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[")]
    assert [ln.split("  (")[0] for ln in progress] == [
        "[1/4] random-lengths · sglite, run 1/2", "[2/4] random-lengths · sglite, radix cache off, run 1/2",
        "[3/4] random-lengths · sglite, run 2/2", "[4/4] random-lengths · sglite, radix cache off, run 2/2"]
    data = json.loads(next(tmp_path.glob("bench-quick-random-lengths-*.json")).read_text())
    rows = data["workloads"]["random-lengths"]["rows"]
    assert [r["label"] for r in rows] == ["sglite", "sglite, radix cache off"]
    for r in rows:
        assert len(r["runs_output_tok_s"]) == 2 and r["runs_agree"]
        assert r["output_tok_s"] == min(r["runs_output_tok_s"])  # the lower middle of two
    assert "Each configuration ran 2 times" in next(tmp_path.glob("bench-quick-random-lengths-*.md")).read_text()


def test_median_run_picks_the_middle_run_and_fails_with_any_failure():
    runs = [Row("a", "sglite", True, output_tok_s=t, output_ids=[[1, 2]]) for t in (30.0, 10.0, 20.0)]
    row = median_run(runs)
    assert row is runs[2] and row.runs_output_tok_s == [30.0, 10.0, 20.0] and row.runs_agree
    runs[0].output_ids = [[1, 3]]
    assert not median_run(runs).runs_agree
    broken = Row("a", "sglite", False, error="boom")
    assert median_run([runs[0], broken]) is broken


def test_missing_optional_packages_are_explained(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    assert "transformers" in bench.baseline_unavailable() and "pip install" in bench.baseline_unavailable()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    files, note = write_plots({}, tmp_path, "x")
    assert files == [] and "matplotlib is not installed" in note


def test_ablations_are_a_table_of_overrides():
    names = [a.name for a in bench.ABLATIONS]
    assert {"radix-off", "chunked-off", "mixed-chunk", "overlap-on", "overlap-off", "trace-1", "trace-2"} <= set(names)
    with pytest.raises(ValueError, match="unknown ablation"):
        bench.select_ablations("radix-off,nope")
    default = bench.select_ablations("default")
    assert "radix-off" in default and "trace-1" not in default and set(default.values()) == {"own"}
    assert bench.select_ablations("default,trace-1")["trace-1"] == "every"
    assert bench.select_ablations("none") == {} and len(bench.select_ablations("all")) == len(names)
    ghost = bench.Ablation("ghost", "sglite, ghost", {"no_such_server_arg": True})
    assert "no_such_server_arg" in bench.ablation_unavailable(ghost)


def test_cli_help_lists_workloads_and_options(capsys):
    from sglite.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for word in ("shared-prefix", "random-lengths", "long-prompts", "one-chat", "json-schema", "--quick",
                 "--skip-baseline", "--peers", "--dtype", "--roofline", "--ablations", "--pairs",
                 "--requests", "--out", "radix-off", "trace-2"):
        assert word in out
