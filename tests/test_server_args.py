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
