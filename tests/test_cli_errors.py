"""The command line answers bad arguments and files with one line on stderr and a non-zero
exit status, never a traceback (docs/reliability.md)."""

from __future__ import annotations

import pytest

from sglite.cli import main

# (what was tried, argv, a fragment of the one-line error)
BAD_COMMANDS: list[tuple[str, list[str], str]] = [
    ("--record into a missing folder", ["generate", "hi", "--model-path", "tiny-random", "--max-new-tokens", "2",
                                        "--record", "/nonexistent-dir/run.jsonl"], "No such file or directory"),
    ("--trace-jsonl into a missing folder", ["generate", "hi", "--model-path", "tiny-random", "--max-new-tokens", "2",
                                             "--trace-jsonl", "/nonexistent-dir/spans.jsonl"], "No such file or directory"),
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
]


@pytest.mark.parametrize("what,argv,message", BAD_COMMANDS, ids=[c[0] for c in BAD_COMMANDS])
def test_bad_commands_fail_in_one_line(capsys, what, argv, message):
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


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
