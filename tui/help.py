"""The `?` screen: every panel, column and abbreviation of the TUI in plain words, with
the SGLang name each one shows, and every key (read from the app's bindings, so the list
cannot drift from what the keys do)."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# (term as the screen shows it, what it means, the SGLang name behind it)
TOP_LINE = [
    ("running / paused", "the engine steps by itself / waits for n (space toggles)", ""),
    ("idle — workload done", "no request left and no arrival to come: w starts a workload, a adds a prompt", ""),
    ("after iter N", "every panel shows the state after iteration N ran: one pass of the event loop "
                     "(recv_requests, get_next_batch_to_run, run_batch, process_batch_result)", "Scheduler.iteration"),
    ("overlap / normal loop", "which event loop runs: the overlap loop plans batch N+1 while batch N runs",
     "event_loop_overlap / event_loop_normal"),
    ("tp N", "tensor parallelism: the model is cut across N processes (ranks), each holding a shard of every "
             "layer; rank 0 schedules and the others run its batches (docs/tensor_parallel.md)", "--tp-size"),
    ("next arrival: k at iter M", "a workload submits k more requests at iteration M", ""),
]
PANELS = [
    ("waiting_queue (lpm)", "requests received and not admitted yet, in the order the schedule policy "
                            "(in brackets) sorts them", "Scheduler.waiting_queue, --schedule-policy"),
    ("  arriving: r12", "submitted but not yet received: the next iteration's recv_requests takes it in",
     "recv_requests"),
    ("  len", "prompt tokens", "len(Req.origin_input_ids)"),
    ("  cached", "prompt tokens found in the radix cache at the last admission try", "len(Req.prefix_indices)"),
    ("  wait", "iterations since it arrived (or was retracted)", ""),
    ("  why", "the budget that left it waiting at the last admission round: pool (KV pool), prefill "
              "(max_prefill_tokens), chunk (chunked_prefill_size), max run (max_running_requests), order (an "
              "earlier request stopped admission), prefix (a request sharing its prefix goes first), trial (a "
              "failed round's requests re-run one at a time), grammar (in the grammar_queue: its json_schema, regex "
              "or ebnf still compiles); the request's detail has the numbers (docs/why.md)",
     "PrefillAdder rem_total_tokens / rem_input_tokens / rem_chunk_tokens, max_running_requests; ReqHeld"),
    ("running_batch", "requests admitted and decoding (a chunked request shows here too)", "Scheduler.running_batch"),
    ("  seq", "tokens in the sequence: prompt + output; counts the token sampled this round, "
              "which is not in the KV cache yet", "Req.seqlen"),
    ("  out/max", "output tokens so far / the request's limit", "len(Req.output_ids) / max_new_tokens"),
    ("  k finished", "requests finished since the start", ""),
    ("iter N ran #b: MODE, r rows", "the batch that iteration N planned and launched: its id b (batches are "
                                    "counted apart from iterations: an idle iteration launches none), its mode "
                                    "and how many token rows it feeds the model",
     "ScheduleBatch, Scheduler.forward_ct, ForwardMode (EXTEND = prefill, DECODE, MIXED)"),
    ("  pre / ext / seq", "per request: tokens reused from the cache, tokens computed now, the sum",
     "prefix_len / extend_input_len / seq_len"),
    ("  loc", "the KV pool slots the new tokens are written to", "out_cache_loc"),
    ("  #b in flight, #a processed", "overlap loop: batch b runs on the worker while the results of batch a "
                                     "are processed", "TpModelWorkerClient, resolve_last_batch_result"),
    ("  fwd ms TP0 a TP1 b (all-reduce c)", "tp N: each rank's time for the last forward, and how much of rank "
                                           "0's went to all-reduces and the logits' all-gather",
     "ForwardFinished.tp_timings, tensor_model_parallel_all_reduce"),
    ("KV pool: T tokens", "the token pool; the bar: █ held by requests, ▒ cached in the radix tree and "
                          "evictable, · free", "max_total_num_tokens, TokenToKVPoolAllocator"),
    ("  used / free / cached", "tokens held by requests / free slots / evictable cached tokens",
     "available_size(), tree_cache.evictable_size()"),
    ("  usage", "share of the pool held by requests", "token_usage (sglang:token_usage)"),
    ("  hit", "share of prompt tokens served from the radix cache so far", "cache_hit_rate"),
    ("  retracted", "requests evicted from running_batch to free KV memory (they return to the queue)",
     "retract_decode, num_retracted_reqs"),
    ("  new_token_ratio", "the share of each running request's remaining max_new_tokens that admission "
                          "reserves KV for; falls each decode step, jumps back after a retraction",
     "Scheduler.new_token_ratio"),
    ("  admit: ...", "why admission stopped this round: queue empty (EMPTY_QUEUE), KV pool full (NO_TOKEN), "
                     "prefill budget spent (OTHER: max_prefill_tokens or the chunk), max running reqs "
                     "(MAX_RUNNING_REQUESTS), waits on a shared prefix (IN_BATCH_PREFIX_WAIT), a failed round's "
                     "requests re-run one at a time (FAILED_ROUND_TRIAL); 'queue was empty; then retraction refilled "
                     "it': the round's decode retracted requests after admission found nothing to admit",
     "PrefillAdder, AddReqResult"),
    ("  miss: ...", "prompt tokens computed so far, by why the radix cache did not serve them: new (nothing "
                    "cached starts like it), past (beyond the part the cache shares), evicted (LRU took them), "
                    "page (a last partial page); shown in a terminal of 30 rows or more (docs/why.md)",
     "CacheMatched, RadixCache.evict"),
    ("  tok/s", "output tokens a second over the last 2 s (0 when nothing runs); the sparklines: hit rate "
                "and tok/s per iteration", "gen_throughput"),
    ("radix tree", "the prefix cache: one node a line, children indented; the path the last admitted "
                   "request matched is highlighted", "RadixCache, TreeNode"),
    ("  34", "tokens in the node's key", "len(TreeNode.key)"),
    ("  🔒8", "requests using the node: a locked node is never evicted", "TreeNode.lock_ref"),
    ("  lru15", "the node's rank by last access: lru0 is evicted first among unlocked leaves",
     "TreeNode.last_access_time"),
    ('  "<|im_start|>…" / [1, 9690, …]', "the node's first tokens as text or as ids (t switches)", "TreeNode.key"),
    ("events", "one line an event, after the iteration it happened in", "sglite/events.py"),
    ("  hit r4: 34 cached + 10 new", "r4 was admitted with 34 prompt tokens from the cache and 10 to compute",
     "prefix_indices, extend_input_len"),
    ("  chunk r4 #1 64/300", "a chunk of a long prompt was computed: 64 of its 300 tokens so far", "chunked_req"),
    ("  retract r8 at 45 tok", "r8 left running_batch after 45 output tokens; new_token_ratio before -> after",
     "retract_decode"),
    ("  evict / done / abort", "cached tokens evicted from the tree / a request finished (its finish reason: "
                               "stop, length, abort) / a request was aborted", "evict, FINISH_*"),
]


Section = tuple[str, list[tuple[str, str, str]]]


def help_text(bindings: Sequence[Binding], replay: bool, sections: Sequence[Section] = ()) -> Group:
    """The help as Rich tables: term | what it means [SGLang's name]; ``sections``
    first (a screen built on the main one explains its own terms)."""
    parts: list[Any] = []

    def section(title: str, rows: list[tuple[str, str, str]]) -> None:
        parts.append(Text(title, style="bold underline"))
        table = Table(show_header=False, box=None, expand=True, padding=(0, 1, 0, 0))
        table.add_column(style="bold", ratio=1, overflow="fold")
        table.add_column(ratio=3)
        for term, what, name in rows:
            table.add_row(term, Text(what).append(f"  [{name}]" if name else "", style="dim"))
        parts.extend([table, Text("")])

    for title, rows in sections:
        section(title, rows)
    section("Top line", TOP_LINE)
    section("Panels and columns", PANELS)
    keys = []
    for b in bindings:
        shown = ", ".join("?" if k == "question_mark" else k for k in b.key.split(","))
        keys.append((shown, KEY_WORDS.get(b.action, b.description), ""))
    keys += [("click", "on a row: selects that request and opens its detail", ""),
             ("Esc", "closes this screen, the detail and the prompt box", "")]
    section("Keys" + (" (replay)" if replay else ""), keys)
    return Group(*parts)


KEY_WORDS = {
    "quit": "quit (stops the engine process)",
    "help": "this screen",
    "toggle_pause": "pause / run (a replay: play forwards)",
    "step": "one iteration (pauses)",
    "back": "one iteration back (replay only)",
    "first": "first iteration (replay only)",
    "last": "last iteration (replay only)",
    "add_prompt": "type a prompt; Enter submits it (greedy, 64 tokens), Esc cancels",
    "add_workload": "type a workload name or a .jsonl file; its arrivals start now",
    "next_policy": "next schedule policy: fcfs, lpm, dfs-weight, lof, random",
    "select_next": "select the next request (its rows are highlighted)",
    "detail": "the selected request: its state, its stages with their iterations, its text",
    "toggle_tree_text": "radix tree nodes as text or as token ids",
    "next_difference": "the next iteration where the two runs' batch, queues or holds differ",
    "previous_difference": "the previous iteration where the two runs differ",
    "toggle_requests": "the bottom panel: what differs at this iteration, or per request over the whole runs",
}


class HelpScreen(ModalScreen):
    """Every term on screen, what it means and its SGLang name; every key."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]
    CSS = """
    HelpScreen { align: center middle; }
    #help { width: 96%; height: 94%; border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, bindings: Sequence[Binding], replay: bool = False, sections: Sequence[Section] = ()):
        super().__init__()
        self.text = help_text(bindings, replay, sections)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(self.text, id="help-body")

    def on_mount(self) -> None:
        box = self.query_one("#help", VerticalScroll)
        box.border_title = "sglite tui: what the screen shows (Esc closes, ↑↓ scroll)"
        box.focus()
