"""KV-cache memory: two levels of indirection, as in SGLang.

``ReqToTokenPool`` maps (request slot, position) -> KV slot index.
``TokenToKVPoolAllocator`` hands out KV slot indices (pages of ``page_size`` slots).
``MHATokenToKVPool`` holds the per-layer K and V buffers those indices point into.
"""

from __future__ import annotations

import threading

from collections import deque

import torch


def num_pages(n: int, page_size: int) -> int:
    """Pages that ``n`` tokens occupy (the last one may be partly used)."""
    return -(-n // page_size)


def page_align_up(n: int, page_size: int) -> int:
    return num_pages(n, page_size) * page_size


def page_align_down(n: int, page_size: int) -> int:
    """The tokens of ``n`` that fill whole pages (what the radix tree can hold)."""
    return n // page_size * page_size


class ReqToTokenPool:
    """One row per running request: ``req_to_token[req_pool_idx, pos]`` is the KV slot
    holding that request's token at position ``pos``."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots: list[int] = list(range(size))
        # The overlap loop plans round N+1 while round N's forward still reads rows.
        # A row freed then is held back until that forward is done, so the scheduler
        # never rewrites a row under a running forward. forward_launched/forward_done
        # are batch ids set by the scheduler; in the normal loop they stay equal.
        self.forward_launched = 0
        self.forward_done = 0
        self._held: list[tuple[int, int]] = []  # (row, forward that may still read it)
        # tp > 1 (track_rewrites): positions of live rows rewritten outside a round's own
        # writes (the radix cache pointing a row at its copy of a prefix and freeing the
        # duplicate slots); the next forward carries them to the other ranks, whose
        # tables know only the rounds' writes. A lock: the overlap loop's forward thread
        # takes them while the scheduler adds more.
        self._rewrites: dict[int, dict[int, int]] | None = None  # row -> {position: slot}
        self._rewrites_lock = threading.Lock()

    def track_rewrites(self) -> None:
        self._rewrites = {}

    def rewrite(self, req_pool_idx: int, start: int, values: torch.Tensor) -> None:
        """``write`` for a live row outside the rounds' writes (tracked under tp > 1)."""
        self.write(req_pool_idx, start, values)
        if self._rewrites is not None:
            with self._rewrites_lock:
                row = self._rewrites.setdefault(req_pool_idx, {})
                row.update(zip(range(start, start + len(values)), values.tolist()))

    def take_rewrites(self) -> list[tuple[int, list[int], list[int]]]:
        """The rewrites since the last call: (row, positions, slots) of rows still live."""
        if self._rewrites is None:
            return []
        with self._rewrites_lock:
            taken, self._rewrites = self._rewrites, {}
        return [(idx, list(row), list(row.values())) for idx, row in taken.items()]

    def available_size(self) -> int:
        """Free rows, counting those held back for an in-flight forward."""
        return len(self.free_slots) + len(self._held)

    def mark_forward_done(self, bid: int) -> None:
        self.forward_done = max(self.forward_done, bid)
        ready = [idx for idx, until in self._held if until <= self.forward_done]
        if ready:
            self._held = [(idx, until) for idx, until in self._held if until > self.forward_done]
            self.free_slots.extend(ready)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select

    def free(self, free_index: int | list[int]) -> None:
        if isinstance(free_index, int):
            free_index = [free_index]
        held = {idx for idx, _ in self._held}
        for idx in free_index:
            if idx in self.free_slots or idx in held or not 0 <= idx < self.size:
                raise RuntimeError(f"double free or bad req_pool_idx {idx}")
        if self._rewrites is not None:
            with self._rewrites_lock:  # a freed row's rewrites must not reach its next owner
                for idx in free_index:
                    self._rewrites.pop(idx, None)
        if self.forward_launched > self.forward_done:
            self._held += [(idx, self.forward_launched) for idx in free_index]
        else:
            self.free_slots.extend(free_index)

    def write(self, req_pool_idx: int, start: int, values: torch.Tensor) -> None:
        self.req_to_token[req_pool_idx, start : start + len(values)] = values.to(self.device)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
        self._held = []


class KVDoubleFreeError(RuntimeError):
    """A KV page was freed while already free: the scheduler's accounting is wrong."""


class TokenToKVPoolAllocator:
    """Free list of KV slots, kept as whole pages.

    Slot indices run from ``page_size`` to ``size + page_size - 1``: the first page is
    reserved as a padding target (SGLang keeps slot 0 for dummy writes the same way).
    With ``page_size == 1`` a page is a slot; with larger pages, ``alloc_extend`` and
    ``alloc_decode`` first fill the tail of a request's last page, then take new pages.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1 or size % page_size != 0:
            raise ValueError(f"pool size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        num_pages = self.size // self.page_size
        # page p covers slots [p*page_size, (p+1)*page_size); page 0 is the padding page
        # a deque: taking n pages costs O(n), not a copy of the whole free list
        self.free_pages: deque[int] = deque(range(1, num_pages + 1))
        self._free_set: set[int] = set(self.free_pages)  # catches a double free where it happens

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def _take_pages(self, n: int) -> list[int] | None:
        if n > len(self.free_pages):
            return None
        pages = [self.free_pages.popleft() for _ in range(n)]
        self._free_set.difference_update(pages)
        return pages

    def _pages_to_slots(self, pages: list[int]) -> torch.Tensor:
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (base[:, None] + torch.arange(self.page_size)).reshape(-1)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` fresh slots (whole pages; a multiple of page_size when paged)."""
        if need_size % self.page_size != 0:
            raise ValueError(f"alloc({need_size}) is not page aligned (page_size {self.page_size})")
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._pages_to_slots(pages)

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for positions ``prefix_len .. seq_len-1`` of each request, continuing the
        page that holds position ``prefix_len-1`` (whose slot is ``last_loc``)."""
        if self.page_size == 1:
            return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        ps = self.page_size
        need_pages = sum(num_pages(s, ps) - num_pages(p, ps) for p, s in zip(prefix_lens, seq_lens))
        pages = self._take_pages(need_pages)
        if pages is None:
            return None
        out: list[torch.Tensor] = []
        cursor = 0
        for p, s, last in zip(prefix_lens, seq_lens, last_locs):
            tail = min(s, page_align_up(p, ps)) - p  # free slots left in the prefix's last page
            if tail > 0:
                out.append(torch.arange(last + 1, last + 1 + tail, dtype=torch.int64))
            n_new = num_pages(s, ps) - num_pages(p, ps)
            new_slots = self._pages_to_slots(pages[cursor : cursor + n_new])
            cursor += n_new
            out.append(new_slots[: s - p - max(tail, 0)])
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for position ``seq_len-1`` (seq_lens include the new token)."""
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.page_size == 1:
            pages = free_index.tolist()
        else:
            # a page is freed when any of its slots is; callers free whole pages (the radix
            # cache only keeps page-aligned keys, and requests free all their slots)
            pages = torch.unique(free_index // self.page_size).tolist()
        again = self._free_set.intersection(pages)
        if again or len(set(pages)) != len(pages):
            raise KVDoubleFreeError(f"KV page(s) freed twice: {sorted(again)[:8] or 'within one call'}")
        self.free_pages.extend(pages)
        self._free_set.update(pages)

    def debug_free_slots(self) -> set[int]:
        return set(self._pages_to_slots(sorted(self.free_pages)).tolist())


class MHATokenToKVPool:
    """Per-layer K and V buffers ``[size + page_size, head_num, head_dim]`` indexed by slot."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]

    @staticmethod
    def cell_size(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * head_num * head_dim * layer_num * torch.tensor([], dtype=dtype).element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)
