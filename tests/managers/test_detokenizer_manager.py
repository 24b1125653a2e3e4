"""DetokenizerManager: incremental text equals a full decode, whole characters only, stop
strings held back and trimmed; Req.check_stop_str's tail decode finds what a full
decode finds, at the same token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglite.managers.detokenizer_manager import DetokenizerManager, stop_str_holdback
from sglite.managers.io_struct import BatchTokenIDOut
from sglite.managers.schedule_batch import Req
from sglite.model_loader.tiny_random import build_tiny_random
from sglite.sampling.sampling_params import SamplingParams


def tok():
    return build_tiny_random()[2]


def feed(detok: DetokenizerManager, ids: list[int], sizes: list[int], stop_strs: tuple[str, ...] = (),
         matched: str | None = None) -> list[str]:
    """Send ``ids`` in pieces of the given sizes (the rest in the last piece); the texts out."""
    pieces, i = [], 0
    for n in sizes:
        pieces.append(ids[i : i + n])
        i += n
    pieces.append(ids[i:])
    out = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        res = detok.handle_batch_token_id_out(BatchTokenIDOut("r", piece, last, {}, True, stop_strs,
                                                              matched if last else None))
        assert res.new_token_ids == piece and res.finished == last
        out.append(res.new_text)
    return out


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 4), max_size=12))
def test_incremental_text_is_the_full_decode_in_whole_characters(text, sizes):
    t = tok()
    ids = t.encode(text)
    detok = DetokenizerManager(t)
    texts = feed(detok, ids, sizes)
    assert "".join(texts) == t.decode(ids)
    # nothing but the final flush may end in half a character
    assert not any(s.endswith("\ufffd") for s in texts[:-1] if "\ufffd" not in text)
    assert detok.decode_status == {}  # a finished request leaves nothing behind


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    t = tok()
    ids = t.encode("ab€")  # the euro sign is three bytes: the byte-level model may split it
    detok = DetokenizerManager(t)
    texts = feed(detok, ids, [1] * (len(ids) - 1))
    assert "".join(texts) == "ab€" and all("\ufffd" not in s for s in texts)


def test_stop_string_prefixes_are_held_back_then_the_stop_is_cut():
    t = tok()
    ids = t.encode("hello world. END and more")
    # the scheduler finishes the request on the token that completes the stop string
    ids = ids[: next(i for i in range(len(ids)) if "END" in t.decode(ids[: i + 1])) + 1]
    detok = DetokenizerManager(t)
    texts = feed(detok, ids, [1] * (len(ids) - 1), stop_strs=("END",), matched="END")
    assert "".join(texts) == "hello world. "
    for sent_so_far in ("".join(texts[: k + 1]) for k in range(len(texts) - 1)):
        assert not sent_so_far.endswith(("E", "EN"))  # could have started "END": held back


def test_holdback_is_the_longest_stop_prefix_at_the_end():
    assert stop_str_holdback("abc EN", ("END", "C E")) == 2
    assert stop_str_holdback("abc", ("xyz",)) == 0
    assert stop_str_holdback("ab", ("b!", "ab!")) == 2


def _finish_token(ids: list[int], stop: str, skip: bool) -> int | None:
    """Feed ``ids`` one at a time to a Req; the index of the token it finished on."""
    params = SamplingParams(stop=[stop], skip_special_tokens=skip, max_new_tokens=10_000)
    params.normalize()
    req = Req("r", None, [1], params, tokenizer=tok())
    for i, token in enumerate(ids):
        req.output_ids.append(token)
        req.check_stop_str()
        if req.finished():
            assert req.finished_reason.to_json() == {"type": "stop", "matched": stop}
            return i
    return None


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=30), st.integers(0, 29), st.integers(1, 6), st.booleans(), st.booleans())
def test_stop_str_tail_decode_finds_what_a_full_decode_finds(text, start, length, specials, skip):
    t = tok()
    ids = t.encode(text)
    if specials:  # special tokens decode to nothing when skipped: the tail must reach past them
        eos = t.eos_token_ids[0]
        ids = [x for i in ids for x in (i, eos, eos)]
    full = t.decode(ids, skip_special_tokens=skip)
    stop = full[start : start + length] or full[:1]
    want = next(i for i in range(len(ids)) if stop in t.decode(ids[: i + 1], skip_special_tokens=skip))
    assert _finish_token(ids, stop, skip) == want
