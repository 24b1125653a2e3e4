"""Two recordings side by side: ``sglite tui --replay A.jsonl --compare B.jsonl``.

Both runs are stepped together by scheduler iteration: the virtual clock a recording
and its ``sglite replay --rerun`` share (docs/why.md), so iteration k of one run and
iteration k of the other saw the same arrivals. Each side shows its waiting_queue,
running_batch, the batch it ran and its KV pool; rows the other run does not have are
marked, the bottom panel says in words what differs at this iteration, and ``f`` jumps to
the next iteration where the two schedulers decided differently. ``r`` swaps the bottom
panel for the per-request table of ``sglite replay --diff``.
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from sglite import events as ev
from sglite.replay import diff_table, format_table
from tui.app import IterationKeys, pool_lines
from tui.help import HelpScreen
from tui.state import ADMISSION_WORDS, View, build_views, short_rid
from tui.widgets import RowTable, TextLines, TitleBar, WidthLines

TABLES = {  # panel -> (View field, columns): the main screen's three queue tables
    "waiting": ("waiting", ("rid", "len", "cached", "wait", "why")),
    "running": ("running", ("rid", "seq", "out/max")),
    "plan": ("plan", ("rid", "pre", "ext", "seq", "loc")),
}
SIDES = ("a", "b")
MAX_BATCH_LINES = 3  # requests of a differing batch named one a line, then "+k more"
PLAY_SPEED = 10  # iterations a second while playing
TALL = 40  # terminal rows from which each side shows its pool bar and the diff panel 6 lines


class Run(NamedTuple):
    """One recording: its label, its server arguments, its events and their Views."""

    label: str
    server_args: dict[str, Any]
    events: list[ev.Event]
    views: list[View]
    iterations: list[int]  # each View's iteration, ascending

    @classmethod
    def of(cls, label: str, events: list[ev.Event]) -> "Run":
        header = next((e for e in events if isinstance(e, ev.RecordingStarted)), None)
        views = build_views(events)[0]
        return cls(label, dict(header.server_args) if header else {}, events, views, [v.iteration for v in views])

    def at(self, iteration: int) -> tuple[View, str]:
        """The run's View as of ``iteration`` (its latest at or before it) and a note
        when the run had not started or had already ended there."""
        its = self.iterations
        i = bisect.bisect_right(its, iteration) - 1
        if i < 0:
            return View(iteration=iteration), "not started"
        if iteration > its[-1]:
            return self.views[-1], f"ended at iter {its[-1]}"
        return self.views[i], ""


def row_key(table: str, row: tuple) -> tuple:
    """What a row says, for comparing two runs: a batch row without its KV slots (two
    pools of different sizes place the same tokens differently)."""
    return tuple(row[:4]) if table == "plan" else tuple(row)


def decisions(v: View) -> tuple:
    """What the scheduler decided in ``v``'s iteration: the batch (its mode, and per
    request the tokens reused and computed), who runs, who waits and why."""
    return (v.forward_mode, tuple(row_key("plan", p) for p in v.plan), tuple(r[0] for r in v.running),
            tuple((w[0], w[4]) for w in v.waiting))


def marked_rows(mine: View, other: View) -> dict[str, frozenset[str]]:
    """Per table, the rids of ``mine`` whose row the other run does not have as it is."""
    out = {}
    for table, (name, _) in TABLES.items():
        theirs = {row_key(table, r) for r in getattr(other, name)}
        out[table] = frozenset(r[0] for r in getattr(mine, name) if row_key(table, r) not in theirs)
    return out


def _only(a: list[str], b: list[str]) -> str:
    parts = [f"only {side}: {', '.join(map(short_rid, rids))}" for side, rids in (("A", [r for r in a if r not in b]),
                                                                 ("B", [r for r in b if r not in a])) if rids]
    return " · ".join(parts)


def _batch_lines(a: View, b: View) -> list[str]:
    def summary(v: View) -> str:
        return f"{v.forward_mode} {len(v.plan)} req(s) {v.plan_rows} rows" if v.plan else "no batch"

    lines = [f"batch: A {summary(a)} · B {summary(b)}"]
    rows_a = {p[0]: row_key("plan", p) for p in a.plan}
    rows_b = {p[0]: row_key("plan", p) for p in b.plan}
    rids = list(rows_a) + [r for r in rows_b if r not in rows_a]
    changed = [rid for rid in rids if rows_a.get(rid) != rows_b.get(rid)]

    def desc(row: tuple | None) -> str:
        return f"prefix {row[1]} + extend {row[2]}" if row else "not in the batch"

    lines += [f"  {short_rid(rid)}: A {desc(rows_a.get(rid))} · B {desc(rows_b.get(rid))}"
              for rid in changed[:MAX_BATCH_LINES]]
    if len(changed) > MAX_BATCH_LINES:
        lines.append(f"  +{len(changed) - MAX_BATCH_LINES} more")
    return lines


def differences(a: View, b: View) -> list[str]:
    """What differs between two runs at one iteration, in words: the batch, the queues,
    the holds, then the counters. Empty when they decided the same."""
    lines = _batch_lines(a, b) if decisions(a)[:2] != decisions(b)[:2] else []
    for name, field in (("running_batch", "running"), ("waiting_queue", "waiting")):
        only = _only([r[0] for r in getattr(a, field)], [r[0] for r in getattr(b, field)])
        if only:
            lines.append(f"{name}: {only}")
    held_b = {w[0]: w[4] for w in b.waiting}
    held = [f"{short_rid(w[0])} A {w[4] or '-'} B {held_b[w[0]] or '-'}" for w in a.waiting
            if w[0] in held_b and held_b[w[0]] != w[4]]
    if held:
        lines.append("held by: " + ", ".join(held))
    counters = [(label, x, y) for label, x, y in (
        ("finished", a.finished, b.finished), ("retracted", a.retractions, b.retractions),
        ("free slots", a.pool_free, b.pool_free), ("cached", a.pool_evictable, b.pool_evictable))
        if x != y]
    if counters:
        lines.append(" · ".join(f"{label} A {x} B {y}" for label, x, y in counters))
    return lines


def args_line(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The server arguments the two runs differ in, ``name A -> B`` (a recording
    without its RecordingStarted line has none to compare)."""
    if not a or not b:
        return "server args unknown (a recording without its RecordingStarted line)"
    changed = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "args: " + ", ".join(changed) if changed else "the same server args"


def request_lines(a: list[ev.Event], b: list[ev.Event]) -> list[Text]:
    """``sglite replay --diff``'s table for the requests that changed (TTFT in
    iterations: the seconds differ between any two runs), then a count of the others."""
    header, rows = diff_table(a, b)
    kept = [j for j, name in enumerate(header) if name != "ttft (s)"]
    header, rows = [header[j] for j in kept], [[short_rid(r[0])] + [r[j] for j in kept[1:]] for r in rows]
    changed = [r for r in rows if r[-1] != "same" or any("->" in c for c in r[1:])]
    head, *body = format_table(header, changed)
    return ([Text(head, style="bold")] + [Text(line) for line in body]
            + [Text(f"{len(rows) - len(changed)} other request(s) the same in both runs", style="dim")])


def side_lines(run: Run, v: View, note: str, width: int, short: bool = False) -> list[Text]:
    """A side's head: the run's name and state, then its KV pool: a bar and two lines,
    or (``short``: a terminal under TALL rows) one line."""
    head = Text(f"{run.label}", style="bold")
    if note:
        head.append(f"  ({note})", style="italic")
    if not v.has_snapshots:
        return [head, Text("no scheduler snapshots: record with --record to see the queues")]
    stop = ADMISSION_WORDS.get(v.admission_stop, v.admission_stop) if v.admission_stop else "-"
    used = v.pool_total - v.pool_free - v.pool_evictable
    pool = Text(f"pool {v.pool_total}: used {used} free {v.pool_free} cached {v.pool_evictable} · "
                f"hit {v.cache_hit_rate:.2f} · retracted {v.retractions}")
    if short:
        return [head, pool]
    return [head, pool_lines(v, width, v.throughput)[0], pool,
            Text(f"new_token_ratio {v.new_token_ratio:.3f} · admit: {stop} · {v.finished} finished")]


class CompareApp(IterationKeys, App):
    """Two runs, stepped together by iteration (module docstring)."""

    TITLE = "sglite compare"
    CSS = """
    #sides { height: 1fr; }
    .side { width: 1fr; }
    .side WidthLines { height: auto; padding: 0 1; }
    .side RowTable { border: round $accent; height: 1fr; padding: 0 1; }
    #diff { border: round $warning; height: 8; padding: 0 1; }
    #diff.short { height: 5; }
    #diff.requests { height: 50%; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("space", "toggle_pause", "play"),
        Binding("n,right", "step", "step"),
        Binding("b,left", "back", "back"),
        Binding("f", "next_difference", "next diff"),
        Binding("F", "previous_difference", "prev diff", key_display="F"),
        Binding("r", "toggle_requests", "per request"),
        Binding("home", "first", "first", show=False),
        Binding("end", "last", "last", show=False),
    ]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, a: Run, b: Run):
        super().__init__()
        self.runs = (a, b)
        self.iterations = sorted({v.iteration for v in a.views} | {v.iteration for v in b.views})
        self.index = 0
        self.paused = True
        self.show_requests = False
        self._ticks = 0
        # iterations (as indices) where the two schedulers decided differently
        self.differing = [i for i, it in enumerate(self.iterations)
                          if decisions(a.at(it)[0]) != decisions(b.at(it)[0])]
        self.request_lines = request_lines(a.events, b.events)
        self.args = args_line(a.server_args, b.server_args)

    def compose(self) -> ComposeResult:
        yield TitleBar(id="titlebar")
        with Horizontal(id="sides"):
            for side in SIDES:
                with Vertical(classes="side", id=f"side-{side}"):
                    yield WidthLines(id=f"{side}-head")
                    for table, (_, columns) in TABLES.items():
                        yield RowTable(columns, id=f"{side}-{table}")
        yield TextLines(id="diff")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        for side in SIDES:
            for table, title in (("waiting", "waiting_queue"), ("running", "running_batch"), ("plan", "batch")):
                self.query_one(f"#{side}-{table}", RowTable).border_title = f"{side.upper()} {title}"
        self.show_index(0)
        self.set_interval(1 / PLAY_SPEED, self._tick)

    def _tick(self) -> None:
        if not self.paused:
            if self.index >= len(self.iterations) - 1:
                self.paused = True
            self.show_index(self.index + 1)

    @property
    def iteration(self) -> int:
        return self.iterations[self.index] if self.iterations else 0

    def show_index(self, i: int) -> None:
        if not self.iterations:
            return
        self.index = max(0, min(i, len(self.iterations) - 1))
        shown = [run.at(self.iteration) for run in self.runs]
        short = self.size.height < TALL  # (a short terminal: the pool in one line, a smaller diff panel)
        for side, run, (v, note), (other, _) in zip(SIDES, self.runs, shown, reversed(shown)):
            head = self.query_one(f"#{side}-head", WidthLines)
            head.show(lambda width, run=run, v=v, note=note: side_lines(run, v, note, width, short))
            marks = marked_rows(v, other)
            for table, (name, _) in TABLES.items():
                self.query_one(f"#{side}-{table}", RowTable).show(getattr(v, name), marked=marks[table])
        self._show_diff(shown[0][0], shown[1][0])
        self._show_top_line()

    def _show_diff(self, a: View, b: View) -> None:
        panel = self.query_one("#diff", TextLines)
        panel.set_class(self.show_requests, "requests")
        panel.set_class(self.size.height < TALL, "short")
        if self.show_requests:
            lines = self.request_lines
            panel.border_title = "per request, A -> B (the whole runs: sglite replay --diff)"
            panel.border_subtitle = "r: this iteration"
        else:
            diff = differences(a, b)
            lines = [Text(line) for line in diff] or [Text(
                "the same decisions here: the same batch, queues and holds (KV slots aside)", style="dim")]
            panel.border_title = f"iter {self.iteration}: " + ("what differs" if diff else "no difference")
            panel.border_subtitle = "f: next difference · r: per request"
        panel.set_lines(lines)

    def _show_top_line(self) -> None:
        first = (f"first difference at iter {self.iterations[self.differing[0]]}" if self.differing
                 else "the runs decide the same at every iteration")
        state = "playing" if not self.paused else f"iter {self.iteration} ({self.index + 1}/{len(self.iterations)})"
        self.query_one("#titlebar", TitleBar).show(self.title, f"{state} · {first} · {self.args}")

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._show_top_line()

    @property
    def last_index(self) -> int:
        return len(self.iterations) - 1

    def action_next_difference(self) -> None:
        self._jump(next((i for i in self.differing if i > self.index), None), "after")

    def action_previous_difference(self) -> None:
        self._jump(next((i for i in reversed(self.differing) if i < self.index), None), "before")

    def _jump(self, index: int | None, where: str) -> None:
        self.paused = True
        if index is None:
            self.notify(f"the runs decide the same at every iteration {where} iter {self.iteration}", timeout=3)
            self._show_top_line()
        else:
            self.show_index(index)

    def on_resize(self) -> None:
        self.show_index(self.index)

    def action_toggle_requests(self) -> None:
        self.show_requests = not self.show_requests
        self.show_index(self.index)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.BINDINGS, replay=True, sections=[("Comparing two runs", COMPARE_HELP)]))


COMPARE_HELP = [
    ("A / B", "the two recordings, --replay first; the top line names the server arguments they differ in",
     "RecordingStarted.server_args"),
    ("iter N (k/K)", "both runs as they were after scheduler iteration N: requests arrive in the same iterations "
                     "in a run and its rerun (a virtual clock), so the two sides saw the same arrivals", ""),
    ("not started / ended at iter M", "the run had no iteration yet / had finished all its work; its last state "
                                      "is shown", ""),
    ("waiting_queue, running_batch, batch", "as on the main screen (below); a row in bold yellow is one the other "
                                            "run does not have as it is (the batch's KV slots aside)",
     "waiting_queue, running_batch, ScheduleBatch"),
    ("what differs", "in words: the batch each ran and, per request, the prefix reused and the tokens computed; "
                     "requests only one run has running or waiting; holds that differ; finished, retracted and "
                     "pool counts that differ", "prefix_len, extend_input_len, ReqHeld"),
    ("first difference at iter M", "the first iteration whose batch, queues or holds differ", ""),
    ("per request (r)", "each request's wait, TTFT, cached tokens, retracts, chunks and output over the whole "
                        "runs, A -> B: the table of sglite replay --diff (TTFT in iterations), the requests that "
                        "changed and a count of the others", ""),
]
