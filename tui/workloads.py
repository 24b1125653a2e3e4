"""Workloads for the TUI: who arrives when. Built in by name, or a JSONL file with one
request per line: {"at": <iteration>, "prompt": "..."} or {"at": 3, "input_ids": [...]},
optional "max_new_tokens" and "ignore_eos"."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEM = ("You are a helpful assistant. Answer briefly and precisely, and say so when you do not know. "
          "Prefer short sentences. ")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How do bees make honey?",
             "What is a prime number?", "Who wrote Hamlet?", "How far is the Moon?", "What is photosynthesis?",
             "Why do cats purr?", "What is the speed of light?", "How does a rainbow form?",
             "What is the tallest mountain?", "Why is the sea salty?"]


@dataclass
class Arrival:
    at: int  # scheduler iteration at which it is submitted
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    max_new_tokens: int = 48
    ignore_eos: bool = False  # decode the whole budget (pressure scenarios)
    source: str = ""  # the workload it belongs to (the screen's title names those with work left)


@dataclass
class Workload:
    name: str
    description: str
    arrivals: list[Arrival]
    server_args: dict[str, Any] = field(default_factory=dict)  # what the scenario needs (a small pool...)

    def shifted(self, by: int, source: str = "") -> list[Arrival]:
        """The arrivals, each ``by`` iterations later (and marked as ``source``'s)."""
        return [dataclasses.replace(a, at=a.at + by, source=source or a.source) for a in self.arrivals]


def _chat(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def builtin(name: str) -> Workload:
    rng = random.Random(0)
    if name == "shared-prefix":
        return Workload(name, "chat requests sharing a system prompt: watch the radix tree and the hit rate",
                        [Arrival(at=i // 2 * 3, messages=_chat(q)) for i, q in enumerate(QUESTIONS)])
    if name == "long-prompts":
        text = " ".join(QUESTIONS) * 3
        return Workload(name, "a burst of long prompts that needs chunked prefill",
                        [Arrival(at=i, prompt=f"Summarize: {text[i * 7:]}", max_new_tokens=24) for i in range(6)],
                        {"chunked_prefill_size": 64})
    if name == "pool-pressure":
        return Workload(name, "a KV pool small enough to force retractions",
                        [Arrival(at=0, messages=_chat(q), max_new_tokens=96, ignore_eos=True) for q in QUESTIONS],
                        {"max_total_tokens": 1024, "schedule_conservativeness": 0.3})
    if name == "steady":
        return Workload(name, "requests arriving over time",
                        [Arrival(at=i * 6 + rng.randrange(3), messages=_chat(QUESTIONS[i % len(QUESTIONS)]))
                         for i in range(24)])
    if name == "demo":
        return Workload(name, "queueing, cache hits and retractions within a minute (the default)",
                        [Arrival(at=i // 4 * 2, messages=_chat(q), max_new_tokens=64, ignore_eos=True)
                         for i, q in enumerate(QUESTIONS)],
                        {"max_total_tokens": 700, "schedule_conservativeness": 0.3})
    raise ValueError(f"unknown workload {name!r}; built in: {', '.join(BUILTIN)}, or a .jsonl file")


BUILTIN = ("demo", "shared-prefix", "long-prompts", "pool-pressure", "steady")


def load(name_or_path: str) -> Workload:
    if name_or_path in BUILTIN:
        return builtin(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown workload {name_or_path!r}; built in: {', '.join(BUILTIN)}, or a .jsonl file")
    arrivals = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d.get("ignore_eos", False), bool):
                raise ValueError("ignore_eos must be true or false")
            arrivals.append(Arrival(at=int(d.get("at", 0)), prompt=d.get("prompt"), input_ids=d.get("input_ids"),
                                    messages=d.get("messages"), max_new_tokens=int(d.get("max_new_tokens", 48)),
                                    ignore_eos=d.get("ignore_eos", False)))
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: not a workload line ({e})") from None
    return Workload(path.stem, f"from {path}", arrivals)
