"""The benchmark's workloads: lists of prompt token ids and output lengths, the same
for every engine. Everything is submitted at once (an offline batch, as in nano-vllm's
benchmark); every request generates exactly its output length (greedy, EOS ignored).

- ``shared-prefix``: chat requests that share one 300-token system prompt and differ
  in their question (SGLang's motivating case for the radix cache).
- ``random-lengths``: nano-vllm's offline benchmark (random token ids, random input
  and output lengths) scaled to a 2-core CPU.
- ``long-prompts``: long documents interleaved with short chats, so chunked prefill
  and mixed batches decide how long the short ones wait.
- ``json-schema``: chats that each carry a JSON schema (constrained output), a *grammar*
  workload: not a throughput table against the peers but the grammar's cost per decode
  step, constrained against the same requests unconstrained, in one process
  (benchmarks/grammar.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

SYSTEM_PROMPT_TOKENS = 300


class TokenizerLike(Protocol):
    bos_token_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


@dataclass
class Workload:
    name: str
    title: str  # one line: what the requests look like
    prompts: list[list[int]]
    output_lens: list[int]  # exact (EOS ignored); a grammar workload's: caps (its outputs end where the JSON closes)
    # sglite server arguments this workload runs with (on top of a pool sized for it)
    server_args: dict[str, Any] = field(default_factory=dict)
    # a grammar workload: each request's grammar parameter ({"json_schema": ...}), and
    # its levels, (batch size, requests): the first `requests` requests run one at a
    # time (batch 1) or all at once (batch = requests), constrained and not, alternating
    sampling: list[dict[str, Any]] | None = None
    grammar_levels: tuple[tuple[int, int], ...] = ()

    @property
    def paired(self) -> bool:
        """A grammar workload (benchmarks/grammar.py), not a throughput one."""
        return bool(self.grammar_levels)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def distinct_prompt_tokens(self) -> int:
        return distinct_prefix_tokens(self.prompts)

    def pool_tokens(self) -> int:
        """A KV pool that holds the whole workload at once, so nothing is retracted."""
        need = self.total_prompt_tokens + self.total_output_tokens + 256
        return -(-need // 1024) * 1024


def distinct_prefix_tokens(prompts: list[list[int]]) -> int:
    """Tokens in the union of the prompts' prefixes: the nodes of a trie of all prompts.
    A perfect prefix cache computes exactly this many prompt tokens."""
    root: dict[int, dict] = {}
    n = 0
    for p in prompts:
        node = root
        for t in p:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                n += 1
            node = nxt
    return n


# --- text -----------------------------------------------------------------------------

_POLICY = [
    "You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear.",
    "Answer in a friendly, concise way and never invent order details you cannot see.",
    "Orders ship within two business days from the warehouse in Denver, Colorado.",
    "Standard shipping is free above fifty dollars; express shipping costs twelve dollars.",
    "Customers may return unused items within sixty days for a full refund.",
    "Worn or damaged items can be exchanged only when the damage is a manufacturing fault.",
    "Tents, sleeping bags and stoves carry a two-year warranty; backpacks carry five years.",
    "Gift cards never expire and cannot be exchanged for cash.",
    "Loyalty members earn one point per dollar and get early access to seasonal sales.",
    "When a question is about safety in the mountains, remind the customer to check the weather.",
    "If you do not know an answer, say so and offer to connect the customer with a human agent.",
    "Do not discuss competitors' prices, and do not give medical or legal advice.",
    "Keep answers under five sentences unless the customer asks for a detailed explanation.",
    "Always thank the customer for choosing Northwind Outfitters at the end of a conversation.",
]
_QUESTION_FORMS = [
    "How long does {} take?", "Can you explain {} to me?", "What should I know about {}?",
    "Is there a fee for {}?", "Who do I contact about {}?", "What is your policy on {}?",
    "Could you summarize {} in one sentence?", "Why is {} handled this way?",
]
_TOPICS = [
    "shipping to Canada", "returning a tent", "the backpack warranty", "gift cards", "loyalty points",
    "express delivery", "exchanging hiking boots", "a damaged sleeping bag",
]
_PROSE = [
    "The river rose slowly through the night, and by morning the low fields were under water.",
    "Engineers measured the bridge every spring, noting each small crack in a leather notebook.",
    "A scheduler decides which requests run next, how many tokens each may compute, and when to wait.",
    "In the old harbour town the market opened at dawn, selling fish, bread and bright wool.",
    "The committee met on Tuesdays to argue about the budget, the roads and the new school.",
    "Light from the distant star took four hundred years to reach the small observatory.",
    "She wrote the first draft in a week and spent the following year rewriting every chapter.",
    "When the power failed, the hospital switched to its generators within eleven seconds.",
    "Bees return to the hive and dance to tell the others where the flowers are.",
    "The recipe asks for flour, two eggs, a pinch of salt and a cup of warm milk.",
    "Trains left the capital every hour, crossing the plain before climbing into the hills.",
    "A cache keeps recent results close at hand, so repeated work can be skipped entirely.",
]


def _encode_parts(tok: TokenizerLike, parts: list[str]) -> list[list[int]]:
    """Encode pieces separately (the caller joins them in token space); only the first
    piece keeps a BOS the tokenizer adds."""
    out = []
    for i, text in enumerate(parts):
        ids = tok.encode(text) if text else []
        if i and tok.add_bos and ids and ids[0] == tok.bos_token_id:
            ids = ids[1:]
        out.append(ids)
    return out


def _chat_frame(tok: TokenizerLike) -> tuple[str, str, str]:
    """The chat template split around a system and a user message: (before system,
    between system and user, after user)."""
    s, u = "\x00SYSTEM\x00", "\x00USER\x00"
    try:
        text = tok.apply_chat_template([{"role": "system", "content": s}, {"role": "user", "content": u}],
                                       add_generation_prompt=True)
        before, rest = text.split(s)
        between, after = rest.split(u)
        return before, between, after
    except (ValueError, TypeError, KeyError):  # no template, or one without a system role
        return "", "\n\nQuestion: ", "\nAnswer:"


def _text_tokens(tok: TokenizerLike, sentences: list[str], n: int) -> list[int]:
    """Exactly n tokens of the sentences, cycled."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += _encode_parts(tok, ["", " " + sentences[i % len(sentences)]])[1]
        i += 1
    return ids[:n]


# --- the workloads --------------------------------------------------------------------


def shared_prefix(tok: TokenizerLike, vocab_size: int, n: int, new_tokens: int, seed: int) -> Workload:
    before, between, after = _encode_parts(tok, list(_chat_frame(tok)))
    system = _text_tokens(tok, _POLICY, SYSTEM_PROMPT_TOKENS)
    rng = random.Random(seed)
    questions = [f.format(t) for t in _TOPICS for f in _QUESTION_FORMS]
    rng.shuffle(questions)
    while len(questions) < n:  # more requests than distinct questions: number them
        questions.append(f"{questions[len(questions) % 64]} (question {len(questions) + 1})")
    prompts = [before + system + between + _encode_parts(tok, ["", q])[1] + after for q in questions[:n]]
    lens = sorted(map(len, prompts))
    return Workload(
        "shared-prefix",
        f"{n} chat requests: one {SYSTEM_PROMPT_TOKENS}-token system prompt + a distinct question "
        f"(prompts {lens[0]}-{lens[-1]} tokens), {new_tokens} new tokens each",
        prompts, [new_tokens] * n,
        # longest-prefix-match admits one request that computes the shared prefix and
        # defers the rest a round, so they hit it (in-batch prefix caching)
        server_args={"schedule_policy": "lpm"},
    )


def random_lengths(tok: TokenizerLike, vocab_size: int, n: int, inputs: tuple[int, int], outputs: tuple[int, int],
                   seed: int) -> Workload:
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), min(vocab_size, 10000)  # nano-vllm: randint(0, 10000), minus specials
    prompts = [[rng.randrange(lo, hi) for _ in range(rng.randint(*inputs))] for _ in range(n)]
    output_lens = [rng.randint(*outputs) for _ in range(n)]
    return Workload(
        "random-lengths",
        f"{n} requests of random token ids, inputs {inputs[0]}-{inputs[1]}, outputs {outputs[0]}-{outputs[1]} "
        "tokens (nano-vllm's offline benchmark, scaled down)",
        prompts, output_lens,
    )


def long_prompts(tok: TokenizerLike, vocab_size: int, n: int, long_len: tuple[int, int], long_out: int,
                 short_len: tuple[int, int], short_out: int, seed: int) -> Workload:
    rng = random.Random(seed)
    before, between, after = _encode_parts(tok, list(_chat_frame(tok)))
    prompts, output_lens = [], []
    for i in range(n):
        is_long = i % 2 == 0
        length = rng.randint(*(long_len if is_long else short_len))
        sentences = _PROSE[:]
        rng.shuffle(sentences)  # a different document (and first sentence) for each request
        doc = _text_tokens(tok, sentences, max(1, length - len(before) - len(between) - len(after) - 8))
        ask = _encode_parts(tok, ["", "Summarize the text above." if is_long else "Continue the story."])[1]
        prompts.append(before + between + doc + ask + after)
        output_lens.append(long_out if is_long else short_out)
    n_long = (n + 1) // 2
    return Workload(
        "long-prompts",
        f"{n_long} long documents ({long_len[0]}-{long_len[1]} tokens, {long_out} new) interleaved with "
        f"{n - n_long} short chats ({short_len[0]}-{short_len[1]} tokens, {short_out} new)",
        prompts, output_lens,
    )


# the grammar workload: a question and the schema of its answer. Every schema bounds its
# output (enum, maxLength, bounded integers, maxItems, no additional properties), so a
# constrained output closes well before its cap
def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _text(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


_JSON_ASKS: list[tuple[str, dict[str, Any]]] = [
    ("Pick a T-shirt color, size and fit.",
     _object({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
              "fit": {"enum": ["slim", "regular", "loose"]}})),
    ("Describe a fictional person: a name, an age and a city.",
     _object({"name": _text(20), "age": _int(0, 120), "city": _text(20)})),
    ("Give a short weather report for a city.",
     _object({"city": _text(20), "temperature_c": _int(-50, 50),
              "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    ("Recommend a classic novel.", _object({"title": _text(40), "author": _text(30), "year": _int(1000, 2025)})),
    ("Write a short shopping list for a picnic.",
     _object({"items": {"type": "array", "items": _text(15), "minItems": 3, "maxItems": 4}})),
    ("Order some camping gear.",
     _object({"product": {"enum": ["tent", "backpack", "stove", "boots"]}, "quantity": _int(1, 10),
              "express": {"type": "boolean"}})),
    ("Review a hiking backpack in one line.",
     _object({"rating": _int(1, 5), "summary": {**_text(40), "minLength": 20}})),
    ("Plan a team event for next week.",
     _object({"event": _text(30), "attendees": _int(1, 100), "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]}})),
]
_JSON_LEADS = ["", "Please answer in JSON. ", "Quick task: ", "For a demo app: ", "Make it up. ", "Be brief. ",
               "We need example data. ", "One more, please. "]


def _user_chat(tok: TokenizerLike, text: str) -> list[int]:
    """One user message in the model's chat template (plain text without one)."""
    try:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    except (ValueError, TypeError, KeyError):
        rendered = f"Question: {text}\nAnswer:"
    return tok.encode(rendered)


def json_schema(tok: TokenizerLike, n: int, new_tokens: int, alone: int) -> Workload:
    """n chats, each asking one of the questions with its schema as ``json_schema``;
    request i asks question i mod 8 (the first 8: every schema once), with a lead-in
    that makes the prompts differ. Levels: batch 1 (the first ``alone`` requests, one at
    a time) and batch n (all at once)."""
    prompts, sampling = [], []
    for i in range(n):
        question, schema = _JSON_ASKS[i % len(_JSON_ASKS)]
        lead = _JSON_LEADS[i // len(_JSON_ASKS) % len(_JSON_LEADS)]
        more = f" (request {i + 1})" if i >= len(_JSON_ASKS) * len(_JSON_LEADS) else ""
        prompts.append(_user_chat(tok, lead + question + more))
        sampling.append({"json_schema": json.dumps(schema)})
    alone = min(alone, n)
    return Workload(
        "json-schema",
        f"{n} chat requests, each with a JSON schema ({len(_JSON_ASKS)} kinds, bounded: enums, maxLength, "
        f"bounded integers, maxItems), at most {new_tokens} new tokens, greedy; batch 1 ({alone} requests one "
        f"at a time) and batch {n} (all at once), each against the same requests unconstrained",
        prompts, [new_tokens] * n,
        # no free whitespace between JSON tokens: with it allowed, SmolLM2 pads one of the
        # eight schemas with newlines up to the cap (and tiny-random, any of them)
        server_args={"constrained_json_disable_any_whitespace": True},
        sampling=sampling, grammar_levels=tuple(dict.fromkeys(((1, alone), (n, n)))),
    )


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    help: str
    build: Callable[[TokenizerLike, int, int | None, bool, int], Workload]
    paired: bool = False  # a grammar workload: sglite alone, constrained against unconstrained


def _shared(tok: TokenizerLike, vocab: int, n: int | None, quick: bool, seed: int) -> Workload:
    return shared_prefix(tok, vocab, n or (8 if quick else 64), 16 if quick else 64, seed)


def _random(tok: TokenizerLike, vocab: int, n: int | None, quick: bool, seed: int) -> Workload:
    if quick:
        return random_lengths(tok, vocab, n or 8, (50, 200), (8, 32), seed)
    return random_lengths(tok, vocab, n or 32, (50, 500), (20, 200), seed)


def _long(tok: TokenizerLike, vocab: int, n: int | None, quick: bool, seed: int) -> Workload:
    if quick:
        return long_prompts(tok, vocab, n or 4, (512, 768), 8, (32, 96), 16, seed)
    return long_prompts(tok, vocab, n or 6, (1024, 2048), 32, (32, 96), 64, seed)


def _one_chat(tok: TokenizerLike, vocab: int, n: int | None, quick: bool, seed: int) -> Workload:
    """The latency row: one chat of the shared-prefix kind alone (its TTFT, and its ITL
    = the batch-1 decode time per token)."""
    wl = shared_prefix(tok, vocab, n or 1, 16 if quick else 64, seed)
    wl.name, wl.title = "one-chat", f"{wl.num_requests} chat request(s) alone: the time to first token and the " \
                                    f"batch-1 decode time per token (ITL)"
    return wl


def _json(tok: TokenizerLike, vocab: int, n: int | None, quick: bool, seed: int) -> Workload:
    """The grammar workload (its prompts are fixed: the seed does not enter)."""
    return json_schema(tok, n or (16 if quick else 64), 48 if quick else 64, 8)


WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in [
    WorkloadSpec("shared-prefix", "64 chats sharing a 300-token system prompt, 64 new tokens each", _shared),
    WorkloadSpec("random-lengths", "32 requests, random inputs 50-500 and outputs 20-200 tokens", _random),
    WorkloadSpec("long-prompts", "3 documents of 1024-2048 tokens interleaved with 3 short chats", _long),
    WorkloadSpec("one-chat", "one chat of the shared-prefix kind alone, 64 new tokens: TTFT and batch-1 decode",
                 _one_chat),
    WorkloadSpec("json-schema", "64 chats with a JSON schema each: the grammar's cost per decode step at batch 1 "
                 "and 64, against the same requests unconstrained (sglite only)", _json, paired=True),
]}


def build_workload(name: str, tok: TokenizerLike, vocab_size: int, context_len: int, n: int | None = None,
                   quick: bool = False, seed: int = 0) -> Workload:
    wl = WORKLOADS[name].build(tok, vocab_size, n, quick, seed)
    too_long = [i for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens)) if len(p) + o > context_len]
    if too_long:
        raise ValueError(f"workload {name}: {len(too_long)} requests exceed the model's context of {context_len} tokens")
    return wl
