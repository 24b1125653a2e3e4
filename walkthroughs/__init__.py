"""Runnable, self-checking lessons built from the seed tutorials (``sglite walkthrough``)."""

from __future__ import annotations

from walkthroughs.core import Narrator, Walkthrough, WalkthroughFailed


def registry() -> dict[str, Walkthrough]:
    from walkthroughs import (chunked_prefill, event_loop, growing_queue, mixed, overlap, radix_cache, retract,
                              tracing_walk, two_requests)

    items = [m.WALKTHROUGH for m in (event_loop, two_requests, chunked_prefill, retract, mixed, radix_cache,
                                     growing_queue, tracing_walk, overlap)]
    return {w.name: w for w in items}


__all__ = ["Narrator", "Walkthrough", "WalkthroughFailed", "registry"]
