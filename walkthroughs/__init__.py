"""Runnable, self-checking lessons built from the seed tutorials (``sglite walkthrough``)."""

from __future__ import annotations

from walkthroughs.core import Narrator, Walkthrough, WalkthroughFailed


def registry() -> dict[str, Walkthrough]:
    from walkthroughs import chunked_prefill, event_loop, two_requests

    items = [event_loop.WALKTHROUGH, two_requests.WALKTHROUGH, chunked_prefill.WALKTHROUGH]
    return {w.name: w for w in items}


__all__ = ["Narrator", "Walkthrough", "WalkthroughFailed", "registry"]
