"""The bench's llama.cpp peers (benchmarks/llamacpp.py) and its roofline section.

The suite does not build llama.cpp (minutes of compiling); the runners are driven here
against stand-in tools with the real ones' command lines and outputs: a
``llama-server`` that speaks its /health and streamed /completion protocol, a
``llama-batched-bench`` that prints its table, a ``llama-quantize`` that writes a file.
The real tools' numbers are in benchmarks/results/."""

from __future__ import annotations

import sys
import textwrap

import pytest

from benchmarks import bench, llamacpp, roofline
from benchmarks.report import Row

# captured from llama-batched-bench (llama-cpp-python 0.3.36's llama.cpp) on this project's machine
BATCHED_BENCH_OUTPUT = """\
llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 1
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   320 |     16 |    8 |   2688 |    1.750 |   182.81 |    1.978 |    64.72 |    3.728 |   120.16 |
"""

FAKE_SERVER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("-np") + 1].isdigit() and "-m" in args

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        base = sum(body["prompt"])
        for i in range(body["n_predict"]):
            self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": [(base + i) % 1000],
                                                     "stop": False}).encode() + b"\\n\\n")
            self.wfile.flush()
        self.wfile.write(b"data: " + json.dumps({"content": "", "tokens": [], "stop": True}).encode() + b"\\n\\n")

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

FAKE_BATCHED_BENCH = '''
import sys
a = sys.argv[1:]
pp, tg, b = (int(a[a.index(f) + 1]) for f in ("-npp", "-ntg", "-npl"))
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
print(f"| {pp} | {tg} | {b} | {b * (pp + tg)} | 0.500 | 100.0 | 1.500 | 50.0 | 2.000 | 80.0 |")
'''

FAKE_QUANTIZE = '''
import shutil, sys
a = [x for x in sys.argv[1:] if not x.startswith("--")]
shutil.copy(a[0], a[1])
'''


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    bin_dir = llamacpp.bin_dir()
    bin_dir.mkdir(parents=True)
    for name, body in [("llama-server", FAKE_SERVER), ("llama-batched-bench", FAKE_BATCHED_BENCH),
                       ("llama-quantize", FAKE_QUANTIZE), ("llama-bench", "")]:
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        path.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake")
    return gguf


def test_batched_bench_table_is_parsed():
    r = llamacpp.parse_batched_bench(BATCHED_BENCH_OUTPUT)
    assert (r["PP"], r["TG"], r["B"], r["N_KV"]) == (320, 16, 8, 2688)
    assert r["T_PP"] == 1.75 and r["T"] == 3.728 and r["S_TG"] == 64.72
    with pytest.raises(RuntimeError, match="printed no result row"):
        llamacpp.parse_batched_bench(BATCHED_BENCH_OUTPUT.rsplit("\n", 2)[0])  # the header only (ctx too small)


def test_server_runner_sends_every_request_at_once_and_times_each_token(fake_tools):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    spec = {"model_path": str(fake_tools), "model_type": "BF16", "prompts": prompts, "output_lens": [5, 3, 4],
            "threads": 2}
    res = llamacpp.run_server(spec, print)
    assert res["output_ids"] == [[(sum(p) + i) % 1000 for i in range(n)] for p, n in zip(prompts, [5, 3, 4])]
    assert len(res["ttft_s"]) == 3 and all(0 < t <= res["wall_s"] for t in res["ttft_s"])
    assert len(res["itl_s"]) == 4 + 2 + 3 and min(res["itl_s"]) >= 0
    assert res["details"]["parallel"] == 3 and res["details"]["dtype"] == "BF16"
    # the F32/BF16 files come from llama-quantize, once, beside the build
    made = llamacpp.home() / "models" / "model.BF16.gguf"
    assert made.read_bytes() == b"GGUF fake"
    assert llamacpp.model_file(fake_tools, "Q4_1") == fake_tools


def test_server_runner_reports_a_server_that_dies(fake_tools):
    llamacpp.tool("llama-server").write_text(f"#!{sys.executable}\nimport sys\nprint('model is bad', "
                                             "file=sys.stderr)\nsys.exit(3)\n")
    spec = {"model_path": str(fake_tools), "model_type": "Q4_1", "prompts": [[1]], "output_lens": [2], "threads": 1}
    with pytest.raises(RuntimeError, match="llama-server exited with code 3: model is bad"):
        llamacpp.run_server(spec, print)


def test_batched_bench_runner_uses_the_workloads_mean_lengths(fake_tools):
    spec = {"model_path": str(fake_tools), "model_type": "Q4_1", "prompts": [[1] * 300, [2] * 340],
            "output_lens": [64, 64], "threads": 2, "shared_prompt": True}
    res = llamacpp.run_batched_bench(spec, print)
    assert res["output_ids"] is None and res["wall_s"] == 2.0 and res["ttft_s"] == [0.5, 0.5]
    assert "-npp 320 -ntg 64 -npl 2 -pps" in res["details"]["command"]
    assert res["itl_s"][0] == pytest.approx(1.5 / 64)


def test_a_missing_compiler_is_a_note_and_the_bench_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llamacpp.shutil, "which", lambda prog: None)
    with pytest.raises(llamacpp.BuildUnavailable, match="no cmake on PATH"):
        llamacpp.build()
    peers, notes = bench.available_peers({"llama.cpp"}, "smollm2-135m")
    assert peers == set() and notes == ["llama.cpp skipped: no cmake on PATH (apt-get install cmake g++)"]
    peers, notes = bench.available_peers({"llama.cpp", "llama-cpp-python"}, "tiny-random")
    assert peers == set() and notes == ["llama.cpp skipped: it needs a GGUF model"]


def test_peers_are_chosen_by_group_and_planned_per_workload(tiny_workloads):
    assert bench.select_peers("all") == set(bench.PEER_GROUPS) and bench.select_peers("none") == set()
    with pytest.raises(ValueError, match="unknown peer"):
        bench.select_peers("transformers,vllm")
    runs, _ = bench.plan(tiny_workloads, {}, {"transformers", "llama.cpp"}, "bfloat16")
    labels = {wl.name: [r.label for r in runs if r.workload is wl] for wl in tiny_workloads}
    assert labels["shared-prefix"][0] == "sglite" and "llama-batched-bench -pps BF16" in labels["shared-prefix"]
    assert "llama-batched-bench -pps BF16" not in labels["one-chat"]
    assert {"llama-server F32", "llama-server BF16", "llama-server Q4_1", "transformers, bfloat16"} <= \
        set(labels["one-chat"])
    assert all(r.server_args["dtype"] == "bfloat16" for r in runs if r.engine == "sglite")


@pytest.fixture
def tiny_workloads():
    from benchmarks.workloads import build_workload
    from sglite.model_loader import load_model

    tok = load_model("tiny-random").tokenizer
    return [build_workload(n, tok, 512, 2048, quick=True) for n in ("shared-prefix", "one-chat")]


def _row(label: str, engine: str, tok_s: float, itl_ms: float = 0.0, dtype: str = "bfloat16", n: int = 64,
         profile: dict | None = None) -> Row:
    details = {"dtype": dtype, "decode_forward_profile": profile}
    return Row(label, engine, True, output_tok_s=tok_s, itl_p50_ms=itl_ms, num_requests=n, details=details)


def test_goals_and_the_roofline_section_from_rows():
    prof = {"linear_ms": 400.0, "lm_head_ms": 40.0, "attention_ms": 120.0, "norm_rope_act_ms": 20.0,
            "other_ms": 20.0, "runs": 10.0}
    results = {
        "shared-prefix": (None, [_row("sglite", "sglite", 500.0, 70.0, profile=prof),
                                 _row("llama-server BF16", "llama-server", 200.0, dtype="BF16"),
                                 _row("llama-batched-bench -pps F32", "llama-batched-bench", 300.0, dtype="F32")]),
        "random-lengths": (None, [_row("sglite", "sglite", 90.0), _row("llama-server BF16", "llama-server", 50.0,
                                                                       dtype="BF16")]),
        "one-chat": (None, [_row("sglite", "sglite", 60.0, 12.0, n=1)]),
    }
    roof = {"batch_big": 64, "read_bandwidth_gbs": 30.0, "matmul_peak_gflops": {"float32": 100.0, "bfloat16": 300.0},
            "floor_ms": {"batch1_bf16_bandwidth": 9.0, "batch1_fp32_bandwidth": 18.0, "batch64_bf16_matmul": 56.0},
            "step_ms": {"sglite packed bf16": {"1": 10.0, "64": 60.0}}}
    lines = "\n".join(bench.peer_goal_lines(results, roof))
    assert "best batched row (llama-batched-bench -pps F32, 300 tok/s): **NOT met** (1.67×)" in lines
    assert "same dtype (llama-server BF16): **met** (2.50×)" in lines
    assert "sglite ≥ 1.5× llama-server BF16 at the same concurrency (all at once): **met** (1.80×)" in lines
    assert "batch-1 decode ≥ 80 % of the bf16 bandwidth floor: **NOT met** (12.0 ms/token, floor 9.0 ms: 75 %)" in lines
    assert "batch-64 decode ≥ 50 % of the bf16 matmul floor: **met** (shared-prefix ITL p50 70 ms, floor 56 ms: 80 %)" \
        in lines
    section = "\n".join(bench.roofline_lines(results, roof))
    # per forward: 40 + 4 + 12 + 2 + 2 = 60 ms of a 70 ms round
    assert "| shared-prefix | 70.0 | 60.0 | 40.0 | 4.0 | 12.0 | 2.0 | 2.0 | 10.0 |" in section
    assert "| sglite packed bf16 | 10.0 | 60.0 |" in section


def test_roofline_measures_every_path_on_a_small_model():
    small = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 2, "vocab": 256}
    r = roofline.measure(small, batches=(1, 4), say=print)
    assert set(r["step_ms"]) == set(roofline.KINDS) and all(set(v) == {"1", "4"} for v in r["step_ms"].values())
    assert r["read_bandwidth_gbs"] > 0 and r["matmul_peak_gflops"]["bfloat16"] > 0
    shapes = roofline.Shapes.of(small)
    assert shapes.flops(4) == 4 * shapes.flops(1) and shapes.weight_bytes(2) == 2 * 2 * (
        (64 + 2 * 32) * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128) + 256 * 64 * 2
    assert r["floor_ms"]["batch1_bf16_bandwidth"] == pytest.approx(shapes.weight_bytes(2) / r["read_bandwidth_gbs"] / 1e6)
    assert len(roofline.markdown(r)) == 5 + len(roofline.KINDS)  # 2 lines, a blank, the header, its rule

