"""The command line answers bad arguments and files with one line on stderr and a non-zero
exit status, never a traceback (docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglite.cli import main

# (what was tried, argv, a fragment of the one-line error)
BAD_COMMANDS: list[tuple[str, list[str], str]] = [
    ("--record into a missing folder", ["generate", "hi", "--model-path", "tiny-random", "--max-new-tokens", "2",
                                        "--record", "/nonexistent-dir/run.jsonl"], "folder /nonexistent-dir does not exist"),
    ("--trace-jsonl into a missing folder", ["generate", "hi", "--model-path", "tiny-random", "--max-new-tokens", "2",
                                             "--trace-jsonl", "/nonexistent-dir/spans.jsonl"],
     "folder /nonexistent-dir does not exist"),
    ("--decode-log-interval 0", ["generate", "hi", "--model-path", "tiny-random", "--decode-log-interval", "0"],
     "decode_log_interval must be positive"),
    ("--context-length -5", ["generate", "hi", "--model-path", "tiny-random", "--context-length", "-5"],
     "context_length must be positive"),
    ("--device tpu", ["generate", "hi", "--model-path", "tiny-random", "--device", "tpu"], "device must be"),
    ("--max-running-requests -1", ["generate", "hi", "--model-path", "tiny-random", "--max-running-requests", "-1"],
     "max_running_requests must be positive"),
    ("--max-prefill-tokens 0", ["generate", "hi", "--model-path", "tiny-random", "--max-prefill-tokens", "0"],
     "max_prefill_tokens must be positive"),
    ("a model path that does not exist", ["generate", "hi", "--model-path", "/nonexistent/model.gguf"], "nonexistent"),
    ("--tp-size 0", ["generate", "hi", "--model-path", "tiny-random", "--tp-size", "0"],
     "tp_size and nnodes must be >= 1"),
    ("--tp-size 3 over --nnodes 2", ["generate", "hi", "--tp-size", "3", "--nnodes", "2", "--dist-init-addr",
                                     "10.0.0.1:5000"], "tp_size 3 must be a multiple of nnodes 2"),
    ("--nnodes 2 without --dist-init-addr", ["serve", "--tp-size", "2", "--nnodes", "2"],
     "--nnodes > 1 needs --dist-init-addr host:port"),
    ("--node-rank 2 of 2 nodes", ["serve", "--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr",
                                  "10.0.0.1:5000"], "node_rank must be in [0, nnodes)"),
    ("--dist-init-addr without a port", ["serve", "--tp-size", "2", "--dist-init-addr", "10.0.0.1"],
     "dist_init_addr must be host:port"),
    ("an empty prompt", ["generate", ""], "the prompt is empty"),
    ("an unknown flag", ["generate", "hi", "--bogus-flag"],
     "sglite generate: error: unrecognized arguments: --bogus-flag"),
    ("a flag value of the wrong type", ["generate", "hi", "--max-new-tokens", "abc"],
     "sglite generate: error: argument --max-new-tokens: invalid int value: 'abc'"),
    ("--max-new-tokens -1", ["generate", "hi", "--max-new-tokens", "-1"], "max_new_tokens must be a non-negative integer"),
    ("--temperature -1", ["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    ("--top-p 0", ["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    ("--stop ''", ["generate", "hi", "--stop", ""], "stop must be a non-empty string"),
    ("tui: a misspelled workload", ["tui", "--workload", "dmeo"], "unknown workload 'dmeo'; built in: demo"),
    ("tui --max-total-tokens -5", ["tui", "--max-total-tokens", "-5"], "max_total_tokens must be positive"),
    ("tui --record into a missing folder", ["tui", "--record", "/nonexistent-dir/r.jsonl"], "does not exist"),
    ("tui: a model path that does not exist", ["tui", "--model-path", "/nonexistent/m.gguf"], "not a file or folder"),
    ("walkthrough: an unknown name", ["walkthrough", "two-request"], "no walkthrough 'two-request'; known"),
    ("bench --requests 0", ["bench", "--requests", "0"], "--requests must be at least 1"),
    ("bench --hf-batch-sizes x", ["bench", "--hf-batch-sizes", "x"], "--hf-batch-sizes must be a comma list"),
    ("bench --model-path missing", ["bench", "--model-path", "/nonexistent/m.gguf"], "not a file or folder"),
    ("bench --ablations nope", ["bench", "--ablations", "nope"], "unknown ablation(s) nope"),
    ("serve --port 0", ["serve", "--port", "0"], "--port must be in 1..65535"),
    ("serve: a model path that does not exist", ["serve", "--model-path", "/nonexistent/m.gguf"], "not a file or folder"),
    ("tui --attach without a URL scheme", ["tui", "--attach", "127.0.0.1:30000"], "--attach needs a URL"),
    ("bench-serving --max-concurrency 0", ["bench-serving", "--max-concurrency", "0"], "--max-concurrency must be"),
    ("replay --rerun a missing file", ["replay", "--rerun", "/nonexistent/r.jsonl"], "No such file"),
    ("replay --diff a missing file", ["replay", "--diff", "/nonexistent/a.jsonl", "/nonexistent/b.jsonl"],
     "No such file"),
    ("explain a missing file", ["explain", "/nonexistent/r.jsonl", "r0"], "No such file"),
]


@pytest.mark.parametrize("what,argv,message", BAD_COMMANDS, ids=[c[0] for c in BAD_COMMANDS])
def test_bad_commands_fail_in_one_line(capsys, what, argv, message):
    try:
        rc = main(argv)
    except SystemExit as e:  # (argparse's own errors)
        rc = e.code
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


# every bad command in turn in one interpreter: its exit status, its stderr, and whether
# torch had been imported by then (once imported it stays, so the first case that loads
# it is the one named)
NOTHING_LOADED = """
import contextlib, io, json, sys
from sglite.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    results.append([rc, err.getvalue(), "torch" in sys.modules])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def one_interpreter() -> dict[str, tuple[int, str, bool]]:
    argvs = [argv for _, argv, _ in BAD_COMMANDS]
    proc = subprocess.run([sys.executable, "-c", NOTHING_LOADED, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {what: tuple(r) for (what, _, _), r in zip(BAD_COMMANDS, json.loads(proc.stdout))}


@pytest.mark.parametrize("what,argv,message", BAD_COMMANDS, ids=[c[0] for c in BAD_COMMANDS])
def test_bad_arguments_are_refused_before_anything_loads(one_interpreter, what, argv, message):
    """Argument errors come before any loading: torch (0.8 s to import, then the model)
    is never imported. (All cases run in one fresh interpreter, in order.)"""
    rc, err, torch_loaded = one_interpreter[what]
    assert rc != 0 and not torch_loaded, (rc, err)
    assert message in err


# --tp-size the model's heads cannot be cut by: found from the config in the launching
# process, before any rank starts (each rank used to load the model and print it again)
BAD_SPLITS = [
    pytest.param(["generate", "hi", "--model-path", "tiny-random", "--tp-size", "3"],
                 "--tp-size 3 cannot split 4 attention heads over 2 KV heads; sizes that can: 1, 2, 4",
                 id="generate --tp-size 3 on tiny-random"),
    pytest.param(["serve", "--model-path", "tiny-random", "--tp-size", "3"],
                 "--tp-size 3 cannot split 4 attention heads over 2 KV heads; sizes that can: 1, 2, 4",
                 id="serve --tp-size 3 on tiny-random"),
    pytest.param(["serve", "--model-path", "tiny-random", "--tp-size", "6", "--nnodes", "2", "--node-rank", "1",
                  "--dist-init-addr", "127.0.0.1:9"], "--tp-size 6 cannot split 4 attention heads",
                 id="serve --node-rank 1 --tp-size 6 on tiny-random"),
    pytest.param(["generate", "hi", "--tp-size", "4"],
                 "--tp-size 4 cannot split 9 attention heads over 3 KV heads; sizes that can: 1, 2, 3, 9",
                 id="generate --tp-size 4 on smollm2", marks=pytest.mark.real_model),
]


@pytest.mark.parametrize("argv,message", BAD_SPLITS)
def test_a_tp_size_the_model_cannot_take_is_one_line_and_starts_no_rank(argv, message):
    """Exit 2 and one error line: a rank that had started would print its own."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from sglite.cli import main; sys.exit(main(sys.argv[1:]))",
                           *argv], capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(err) == 1 and message in err[0], proc.stderr
    assert "Traceback" not in proc.stderr and "tp_worker" not in proc.stderr


def test_tui_needs_a_terminal(capsys):
    """(Under pytest stdout is captured: not a terminal.) Checked after the arguments."""
    assert main(["tui", "--model-path", "tiny-random"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sglite tui draws in a terminal, and stdout is not one" in err and len(err.splitlines()) == 1


def test_trace_convert_of_an_empty_or_wrong_file_fails(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "convert", str(empty), str(tmp_path / "out.json")]) == 1
    assert "no events" in capsys.readouterr().err
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"kind": "SchedulerSnapshot", "iteration": "x", "waiting": 5}\n')
    assert main(["trace", "convert", str(wrong), str(tmp_path / "out.json")]) == 1
    assert "not an sglite event recording" in capsys.readouterr().err


def test_tui_replay_of_json_with_wrong_field_types_fails(tmp_path, capsys):
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"kind": "SchedulerSnapshot", "iteration": "x", "waiting": 5}\n')
    assert main(["tui", "--replay", str(wrong)]) != 0
    err = capsys.readouterr().err
    assert "not an sglite recording" in err and "Traceback" not in err
