"""Runnable, self-checking lessons built from the seed tutorials (``sglite walkthrough``)."""

from __future__ import annotations

import importlib

from walkthroughs.core import Narrator, Walkthrough, WalkthroughFailed


# walkthrough name -> its module, in teaching order (a name is checked without importing
# the lessons, which load torch)
MODULES = {"event-loop": "event_loop", "two-requests": "two_requests", "chunked-prefill": "chunked_prefill",
           "retract": "retract", "mixed": "mixed", "radix-cache": "radix_cache", "growing-queue": "growing_queue",
           "why-waiting": "why_waiting",
           "tracing": "tracing_walk", "overlap": "overlap", "tensor-parallel": "tensor_parallel",
           "batch-invariance": "batch_invariance", "constrained-decoding": "constrained"}


def registry() -> dict[str, Walkthrough]:
    items = {name: importlib.import_module(f"walkthroughs.{module}").WALKTHROUGH for name, module in MODULES.items()}
    for name, w in items.items():
        assert w.name == name, (name, w.name)  # MODULES names each lesson as it names itself
    return items


__all__ = ["MODULES", "Narrator", "Walkthrough", "WalkthroughFailed", "registry"]
