"""The byte-level BPE tokenizer and the chat template."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglite.model_loader.tiny_random import build_tiny_random


def tok():
    return build_tiny_random()[2]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(text):
    t = tok()
    assert t.decode(t.encode(text), skip_special_tokens=False) == text


def test_special_tokens_match_whole_and_are_skipped():
    t = tok()
    ids = t.encode("hi<|im_end|>there")
    eos = t.eos_token_ids[0]
    assert ids.count(eos) == 1
    assert t.decode(ids) == "hithere"
    assert t.decode(ids, skip_special_tokens=False) == "hi<|im_end|>there"


def test_tiny_random_is_deterministic():
    a = build_tiny_random()
    from sglite.model_loader.tiny_random import _build

    _build.cache_clear()
    b = build_tiny_random()
    assert a[2].encode("the scheduler") == b[2].encode("the scheduler")
    assert all((a[1][k] == b[1][k]).all() for k in a[1])


def test_chat_template():
    t = tok()
    text = t.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
