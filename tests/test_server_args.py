"""ServerArgs: SGLang's knob names, and defaults that depend on the device."""

import argparse

import pytest

from sglite.engine import Engine
from sglite.server_args import ServerArgs


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_the_loop_defaults_by_device():
    """event_loop_overlap on CUDA; event_loop_normal on a CPU, whatever its backend and
    dtype (SGLang's CPU default: the scheduler's thread would take a core from the
    forward's threads); either flag wins."""
    assert ServerArgs(device="cuda").disable_overlap_schedule is False
    assert ServerArgs(device="cuda", attention_backend="torch_native").disable_overlap_schedule is False
    for kw in ({}, {"attention_backend": "cpu"}, {"dtype": "bfloat16"}, {"attention_backend": "torch_native"},
               {"attention_backend": "triton"}, {"disable_cpu_graph": True}, {"dtype": "float16"}):
        assert ServerArgs(device="cpu", **kw).disable_overlap_schedule is True, kw
    assert ServerArgs(device="cpu", disable_overlap_schedule=False).disable_overlap_schedule is False
    assert ServerArgs(device="cuda", disable_overlap_schedule=True).disable_overlap_schedule is True


def test_overlap_flags_on_the_command_line(capsys):
    assert parse("--device", "cpu").disable_overlap_schedule is True
    assert parse("--device", "cpu", "--enable-overlap-schedule").disable_overlap_schedule is False
    assert parse("--device", "cpu", "--attention-backend", "torch_native").disable_overlap_schedule is True
    assert parse("--device", "cpu", "--attention-backend", "torch_native",
                 "--enable-overlap-schedule").disable_overlap_schedule is False
    assert parse("--device", "cpu", "--disable-overlap-schedule").disable_overlap_schedule is True
    assert parse("--device", "cuda", "--disable-overlap-schedule").disable_overlap_schedule is True
    with pytest.raises(SystemExit):
        parse("--enable-overlap-schedule", "--disable-overlap-schedule")
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_engine_runs_the_loop_it_was_given():
    assert Engine("tiny-random", device="cpu", disable_overlap_schedule=True).scheduler.enable_overlap is False
    engine = Engine("tiny-random", device="cpu", attention_backend="torch_native", disable_overlap_schedule=False)
    assert engine.scheduler.enable_overlap is True
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert len(out["output_ids"]) == 3


def test_deterministic_inference_is_on_by_default_and_sglang_s_flag_is_accepted(capsys):
    assert parse().enable_deterministic_inference is True
    assert parse("--enable-deterministic-inference").enable_deterministic_inference is True
    assert parse("--disable-deterministic-inference").enable_deterministic_inference is False
    assert parse("--triton-attention-split-tile-size", "128").triton_attention_split_tile_size == 128
    with pytest.raises(SystemExit):
        parse("--enable-deterministic-inference", "--disable-deterministic-inference")
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_torch_native_engine_says_it_is_not_batch_invariant(caplog):
    with caplog.at_level("WARNING", logger="sglite"):
        Engine("tiny-random", attention_backend="torch_native", max_total_tokens=256).shutdown()
    assert "torch_native is not batch-invariant" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sglite"):
        Engine("tiny-random", attention_backend="torch_native", max_total_tokens=256,
               enable_deterministic_inference=False).shutdown()
    assert "batch-invariant" not in caplog.text


def test_sglang_s_environment_knobs(monkeypatch):
    """SGLANG_REQ_WAITING_TIMEOUT / SGLANG_REQ_RUNNING_TIMEOUT (seconds; 0 or less: off)
    where the flags are unset; SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION checked; bad values
    are one line naming the variable."""
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "2.5")
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "-1")
    args = ServerArgs(model_path="tiny-random")
    assert args.waiting_timeout == 2.5 and args.running_timeout is None
    assert ServerArgs(model_path="tiny-random", waiting_timeout=9.0).waiting_timeout == 9.0  # the flag wins
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_REQ_RUNNING_TIMEOUT='soon' is not a number"):
        ServerArgs(model_path="tiny-random")
    monkeypatch.delenv("SGLANG_REQ_RUNNING_TIMEOUT")
    monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "0")
    with pytest.raises(ValueError, match="must be a positive integer"):
        ServerArgs(model_path="tiny-random")

    def first_round(clip: str) -> int:
        """Requests admitted in the first round: admission reserves min(max_new_tokens, clip) each."""
        monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", clip)
        with Engine("tiny-random", max_total_tokens=256, log_level="error") as engine:
            for i in range(8):
                engine.submit(input_ids=[5 + i] * 10, sampling_params={"max_new_tokens": 100})
            engine.step()
            return engine.scheduler.cur_batch.batch_size()

    assert first_round("4096") < first_round("1") == 8


def test_skip_tokenizer_init_serves_ids_in_and_ids_out():
    with Engine("tiny-random", log_level="error") as engine:
        want = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
    with Engine("tiny-random", skip_tokenizer_init=True, log_level="error") as engine:
        assert engine.tokenizer is None
        got = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert got["output_ids"] == want["output_ids"] and got["text"] == ""
        assert engine.generate("Hello")["error"].startswith(
            "The engine initialized with skip_tokenizer_init=True cannot accept text prompts.")
        refused = engine.generate(input_ids=[5, 6], sampling_params={"stop": "x"})["error"]
        assert refused.startswith("stop='x' is unavailable when skip_tokenizer_init=True")
