"""The live scheduler in a terminal (Textual).

The screen only ever sees Views (tui/state.py) built from the engine's events: live, the
events come from the engine host (tui/host.py, its own process under ``sglite tui``);
in a replay, from a recording. Either way the same builder makes the same panels.
"""

from __future__ import annotations

import gc
from time import monotonic
from typing import Any, Sequence

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.message import Message
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Footer, Input, RichLog, Static

from sglite.events import TreeNodeRow
from sglite.server_args import SCHEDULE_POLICIES
from tui.state import LOG_KEEP, ReqInfo, View, ViewBuilder

UI_INTERVAL = 0.02  # seconds between looks for a new view (the host ships one at most every tui.host.SHIP_INTERVAL)
REPLAY_SPEED = 10  # iterations a second while a replay plays
# while the engine runs, the radix tree and the events log, whose changes of size cost a
# layout pass of the whole screen, are redrawn at most this often (paused, stepping or
# replaying: every view)
SLOW_PANELS_INTERVAL = 0.15


class LiveFeed:
    """Messages from the engine host, folded into Views; the screen draws the latest."""

    def __init__(self, connection: Any, info: dict[str, Any]):
        self.connection = connection
        self.info = info
        self.builder = ViewBuilder()
        self.latest: View | None = None
        self.error: str | None = None

    def pump(self) -> View | None:
        """Apply everything the engine sent since the last call; the newest View."""
        new = None
        for kind, payload in self.connection.drain():
            if kind == "events":
                for e in payload:
                    view = self.builder.apply(e)
                    if view is not None:
                        new = view
            elif kind == "log":
                self.builder.add_log("", payload)
            elif kind == "error":
                self.error = payload
                self.builder.add_log("", f"[red]engine error[/] {payload.splitlines()[-1]}")
        if new is not None:
            self.latest = new
        elif self.builder.log and self.latest is not None and len(self.builder.log) != self.latest.log_total:
            # a log line without an iteration (a submit, a policy change): show it now
            self.latest.log, self.latest.log_total = self.builder.log[-LOG_KEEP:], len(self.builder.log)
            new = self.latest
        return new


class TextLines(Widget):
    """Lines of Rich Text, repainted line by line: a change redraws only the lines that
    differ. A Static re-renders its whole text, and the styles pass every line of its
    box, on any change; the queues, the plan and the pool change a few lines an
    iteration (and their blank lines never), and redrawing whole panels was most of what
    a frame cost. Lines wider than the panel end in an ellipsis."""

    DEFAULT_CSS = "TextLines { height: auto; }"

    def __init__(self, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.lines: list[Text] = []
        self._strips: dict[int, Strip] = {}  # line -> what it drew, for _strips_made_for
        self._strips_made_for: tuple | None = None  # (width, base style)
        self._pass: tuple | None = None

    @property
    def plain(self) -> str:
        return "\n".join(t.plain for t in self.lines)

    def set_lines(self, lines: list[Text]) -> None:
        old, self.lines = self.lines, lines
        # (Text's == compares the characters and the spans, not the line's own style)
        dirty = [y for y in range(max(len(old), len(lines)))
                 if y >= len(old) or y >= len(lines) or old[y] != lines[y] or old[y].style != lines[y].style]
        if not dirty:
            return
        for y in dirty:
            self._strips.pop(y, None)
        if len(lines) != len(old) and self.styles.height is not None and self.styles.height.is_auto:
            self.refresh(layout=True)  # an auto-height panel changes size
            return
        width = max(self.size.width, 1)
        runs: list[list[int]] = []
        for y in dirty:
            if runs and runs[-1][1] == y:
                runs[-1][1] = y + 1
            else:
                runs.append([y, y + 1])
        self.refresh(*(Region(0, a, width, b - a) for a, b in runs))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.lines)

    def render_lines(self, crop: Region) -> list[Strip]:
        # the width and the base style once a pass (each costs a walk of the DOM), not a line
        self._pass = None
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        if self._pass is None:
            self._pass = (self.size.width, self.rich_style)
            if self._pass != self._strips_made_for:  # a new size or style: every line anew
                self._strips.clear()
                self._strips_made_for = self._pass
        strip = self._strips.get(y)
        if strip is None:
            width, base = self._pass
            if y >= len(self.lines):
                strip = Strip.blank(width, base)
            else:
                text = self.lines[y]
                if text.cell_len > width:
                    text = text.copy()
                    text.truncate(width, overflow="ellipsis")
                console = self.app.console  # (Text.render leaves the line's own style out)
                style = base + console.get_style(text.style) if text.style else base
                strip = Strip(list(text.render(console))).apply_style(style)
            self._strips[y] = strip
        return strip


class TextSparkline(TextLines):
    """A one-line bar chart of the last values that fit, newest on the right. (Textual's
    Sparkline blends a colour for every cell and re-rendered both charts every frame:
    a tenth of what a frame cost.)"""

    BARS = " ▁▂▃▄▅▆▇█"
    DEFAULT_CSS = "TextSparkline { height: 1; width: 1fr; color: $success; }"

    def __init__(self, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self._data: tuple[list[float], float | None] = ([], None)

    def show(self, data: list[float], top: float | None = None) -> None:
        """``top``: the value of a full bar (default: the largest shown)."""
        self._data = (data, top)
        width = max(self.size.width, 1)
        shown = data[-width:]
        peak = top if top is not None else max(shown, default=0.0)
        levels = len(self.BARS) - 1
        bars = "".join(self.BARS[max(1, min(levels, round(levels * v / peak)))] if peak > 0 else self.BARS[1]
                       for v in shown)
        self.set_lines([Text(bars.rjust(width))])

    def on_resize(self) -> None:
        self.show(*self._data)


class RowTable(TextLines):
    """A table of rows (a queue, this round's plan), one line a row.

    Every running request's seq_len changes every iteration, so a live table changes
    nearly every row every frame; Textual's DataTable renders and caches cell by cell,
    which made the three tables half of what a frame cost. Here a row is one line of
    text, and only the rows that changed are repainted. Columns widen for a wider value
    and never narrow (no jitter); rows that do not fit end in a "+N more" line; the
    selected request's row is reversed; a click on a row selects that request.
    """

    class Clicked(Message):
        def __init__(self, rid: str) -> None:
            super().__init__()
            self.rid = rid

    def __init__(self, columns: tuple[str, ...], id: str) -> None:  # noqa: A002
        super().__init__(id=id)
        self.columns = columns
        self.rows: list[tuple[str, ...]] = []  # everything the table holds, shown or not
        self.selected: str | None = None
        self._widths = [len(c) for c in columns]
        self._shown = 0
        self._key: Any = None
        self._titles: tuple[str, str] | None = None
        self._borders_only = False

    def set_border_titles(self, title: str, subtitle: str) -> None:
        """Set the border's title and sub-title, repainting only the border's two lines
        (a title set repaints the whole panel, and this round's title changes every
        iteration)."""
        if (title, subtitle) == self._titles:
            return
        self._titles = (title, subtitle)
        self._borders_only = True
        try:
            self.border_title, self.border_subtitle = title, subtitle
        finally:
            self._borders_only = False

    def refresh(self, *regions: Region, **kwargs: Any) -> Any:
        if self._borders_only and not regions and not kwargs and self.is_mounted:
            # regions are relative to the content: the border lines lie outside it
            off, outer = self.content_offset, self.outer_size
            regions = (Region(-off.x, -off.y, outer.width, 1), Region(-off.x, outer.height - 1 - off.y, outer.width, 1))
        return super().refresh(*regions, **kwargs)

    def show(self, rows: list[tuple], selected: str | None = None) -> None:
        rows = [tuple(str(c) for c in r) for r in rows]
        height = max(2, self.size.height)
        key = (rows, selected, height)
        if key == self._key:
            return
        self._key, self.rows, self.selected = key, rows, selected
        for r in rows:
            self._widths = [max(w, len(c)) for w, c in zip(self._widths, r)]
        fit = height - 1  # the header takes a line
        shown = rows if len(rows) <= fit else rows[: fit - 1]
        self._shown = len(shown)

        def line(cells: tuple[str, ...]) -> str:  # rid left, numbers right
            return " ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, self._widths)))

        lines = [Text(line(self.columns), style="bold")]
        lines += [Text(line(r), style="reverse" if r[0] == selected else "") for r in shown]
        if len(shown) < len(rows):
            lines.append(Text(f"+{len(rows) - len(shown)} more", style="dim"))
        self.set_lines(lines)

    def on_resize(self) -> None:
        if self._key is not None:
            self._key = None
            self.show(self.rows, self.selected)

    def on_click(self, event: Any) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and 1 <= offset.y <= self._shown:
            self.post_message(self.Clicked(self.rows[offset.y - 1][0]))


class RadixTreeView(Static):
    """The radix tree as indented text, one node a line (Textual's Tree widget rebuilt
    its nodes on every change, a large part of a frame while locks and access times
    change every iteration). ``lines`` holds (depth, label) in drawing order."""

    def __init__(self, id: str) -> None:  # noqa: A002
        super().__init__(id=id)
        self.lines: list[tuple[int, str]] = []
        self._extent = (0, 0)  # (lines, widest line) last shown

    def show(self, tree: Sequence[TreeNodeRow], matched_path: Any) -> None:
        children: dict[int, list[TreeNodeRow]] = {}
        root = None
        for node in tree:
            if node.parent_id == -1:
                root = node.id
            else:
                children.setdefault(node.parent_id, []).append(node)
        # least recently used first: the order eviction takes unlocked leaves in
        order = {row.id: rank for rank, row in enumerate(sorted(tree, key=lambda r: r.access_seq))}
        text = Text("root", no_wrap=True, overflow="ellipsis")
        self.lines = []

        def walk(parent: int, prefix: str) -> None:
            kids = children.get(parent, [])
            for i, node in enumerate(kids):
                node_id, last = node.id, i == len(kids) - 1
                lock = f" 🔒{node.lock_ref}" if node.lock_ref else ""
                label = f"{node.key_len}{lock} lru{order[node_id]} {list(node.key_head[:3])}"
                self.lines.append((len(prefix) // 3, label))
                text.append("\n" + prefix + ("└─ " if last else "├─ "), style="dim")
                text.append(label, style="bold reverse" if node_id in matched_path else "")
                walk(node_id, prefix + ("   " if last else "│  "))

        if root is not None:
            walk(root, "")
        # a layout pass (the scroll box measures the text) costs a whole-screen repaint;
        # only a change of size needs one
        extent = (len(self.lines), max((len(ln) for ln in text.plain.split("\n")), default=0))
        self.update(text, layout=extent != self._extent)
        self._extent = extent


class TitleBar(Static):
    """The top line: the app's title and sub-title (state, iteration, loop, model).

    Textual's Header redraws its title with a layout pass, and the sub-title changes
    every frame: that made every frame a whole-screen repaint. The bar's size never
    depends on its text, so an update here repaints this one line."""

    DEFAULT_CSS = """
    TitleBar { dock: top; width: 100%; height: 1; background: $panel; color: $foreground;
               text-wrap: nowrap; text-overflow: ellipsis; content-align: center middle; }
    """

    def show(self, title: str, sub_title: str) -> None:
        self.update(self.app.format_title(title, sub_title), layout=False)


class DetailScreen(ModalScreen):
    """One request: its stages so far and its text (live, or as of the replayed iteration)."""

    BINDINGS = [Binding("escape,d,enter", "dismiss", "close")]
    CSS = """
    DetailScreen { align: center middle; }
    #detail { width: 90%; height: 90%; border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, rid: str):
        super().__init__()
        self.rid = rid

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail"):
            yield Static(id="detail-body")

    def on_mount(self) -> None:
        self.query_one("#detail", VerticalScroll).border_title = f"request {self.rid} (Esc closes)"

    def show(self, req: ReqInfo | None, view: View) -> None:
        body = self.query_one("#detail-body", Static)
        if req is None:
            body.update(f"no events for {self.rid} yet")
            return
        state = _state_of(self.rid, view)
        lines = [f"[b]{self.rid}[/]  {state}  prompt {req.prompt_tokens} tokens, "
                 f"output {req.tokens_at(view.iteration)}/{req.max_new_tokens}", "", "[b]stages[/]"]
        lines += [f"  iter {it:>5}  {what}" for it, what in req.timeline_at(view.iteration)]
        body.update(Text.from_markup("\n".join(lines) + "\n\n").append("text so far\n", style="bold")
                    .append(req.text_at(view.iteration) or "(none yet)"))


def _state_of(rid: str, view: View) -> str:
    if any(r[0] == rid for r in view.running):
        return "running"
    if any(r[0] == rid for r in view.waiting):
        return "waiting"
    return "chunked" if view.chunked_rid == rid else "not queued"


class SchedulerApp(App):
    TITLE = "sglite"
    CSS = """
    Grid { grid-size: 3 2; grid-rows: 1fr 1fr; grid-columns: 1fr 0.8fr 1.2fr; }
    RowTable, #treebox, RichLog, #poolbox { border: round $accent; height: 1fr; }
    #tree { width: auto; }
    RowTable { padding: 0 1; }
    .spark { height: 1; }
    .spark Static { width: 7; }
    #prompt { dock: bottom; display: none; }
    """
    BINDINGS = [
        Binding("space", "toggle_pause", "pause/run"),
        Binding("n,right", "step", "step"),
        Binding("b,left", "back", "back"),
        Binding("home", "first", "first", show=False),
        Binding("end", "last", "last", show=False),
        Binding("a", "add_prompt", "add prompt"),
        Binding("w", "add_workload", "workload"),
        Binding("p", "next_policy", "policy"),
        Binding("s", "select_next", "select"),
        Binding("d", "detail", "detail"),
        Binding("q", "quit", "quit"),
    ]
    LIVE_ONLY = {"add_prompt", "add_workload", "next_policy"}
    REPLAY_ONLY = {"back", "first", "last"}

    def __init__(self, feed: LiveFeed | None = None, views: list[View] | None = None,
                 builder: ViewBuilder | None = None, title: str = "", paused: bool = False):
        """Live: a LiveFeed. Replay: the recording's Views and the builder that made them."""
        super().__init__()
        self.feed = feed
        self.views = views or []
        self.replay_builder = builder
        self.subtitle_base = title
        self.paused = paused if feed is not None else True
        self.index = 0  # replay: the View shown
        self.last_view: View | None = None
        self.selected: str | None = None
        self.updates = 0
        self._log_shown = 0
        self._tree_key: Any = None
        self._input_mode = "prompt"
        self._ticks = 0
        self._slow_drawn = 0.0  # when the tree and the log were last drawn (monotonic)
        self._slow_stale = False  # a view was drawn without them

    @property
    def replay(self) -> bool:
        return self.feed is None

    @property
    def requests(self) -> dict[str, ReqInfo]:
        return self.feed.builder.requests if self.feed is not None else self.replay_builder.requests

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action in self.LIVE_ONLY and self.replay:
            return False
        if action in self.REPLAY_ONLY and not self.replay:
            return False
        return True

    def compose(self) -> ComposeResult:
        yield TitleBar(id="titlebar")
        with Grid():
            # short headers so the columns fit at 80x24 (the border titles name the panels)
            yield RowTable(("rid", "len", "cached", "wait"), id="waiting")
            yield RowTable(("rid", "seq", "out/max"), id="running")
            yield RowTable(("rid", "pre", "ext", "seq", "loc"), id="plan")
            with Vertical(id="poolbox"):
                yield TextLines(id="pool")
                with Horizontal(classes="spark"):
                    yield Static("hit")
                    yield TextSparkline(id="hit")
                with Horizontal(classes="spark"):
                    yield Static("tok/s")
                    yield TextSparkline(id="tput")
            with VerticalScroll(id="treebox", can_focus=False):  # space and home/end are the app's keys
                yield RadixTreeView(id="tree")
            yield RichLog(id="log", markup=True, wrap=False, max_lines=500)
        yield Input(id="prompt", disabled=True)
        yield Footer()

    def on_mount(self) -> None:
        for wid, title in (("waiting", "waiting_queue"), ("running", "running_batch"), ("plan", "this round"),
                           ("poolbox", "KV pool"), ("treebox", "radix tree"), ("log", "events")):
            self.query_one(f"#{wid}").border_title = title
        self._show_top_line(self.subtitle_base)
        if self.replay and self.views:
            self.render_view(self.views[0])
        self.set_interval(UI_INTERVAL, self._tick)
        # what exists now (Textual, the widgets, imported modules) lives as long as the
        # app: keep it out of the cyclic collector, whose full passes over it stalled
        # the screen for up to 180 ms (one in seven frames) while a fast engine ran
        gc.freeze()

    # --- drawing --------------------------------------------------------------------

    def _tick(self) -> None:
        if self.replay:
            self._ticks += 1
            step = max(1, round(1 / (UI_INTERVAL * REPLAY_SPEED)))
            if not self.paused and self._ticks % step == 0 and self.index < len(self.views) - 1:
                self.show_index(self.index + 1)
            return
        view = self.feed.pump()
        if view is not None:
            self.render_view(view)
        elif self._slow_stale and monotonic() - self._slow_drawn >= SLOW_PANELS_INTERVAL:
            self._render_slow_panels(self.last_view)

    def show_index(self, i: int) -> None:
        if self.views:
            self.index = max(0, min(i, len(self.views) - 1))
            self.render_view(self.views[self.index])

    def render_view(self, v: View) -> None:
        self.last_view = v
        self.updates += 1
        for tid, rows in (("waiting", v.waiting), ("running", v.running), ("plan", v.plan)):
            self.query_one(f"#{tid}", RowTable).show(rows, self.selected)
        plan = self.query_one("#plan", RowTable)
        wide = plan.size.width >= 40
        if not v.bid:
            title = "this round: idle"
        else:
            title = (f"this round #{v.bid}: {v.forward_mode}, {v.plan_rows} rows" if wide
                     else f"#{v.bid} {v.forward_mode} {v.plan_rows} rows")
        # the overlap loop: which batch runs now, whose results this iteration processed
        flight = []
        if v.overlap and v.bid:
            flight.append(f"#{v.bid} in flight" if wide else f"#{v.bid} running")
        if v.overlap and v.processed_bid:
            flight.append(f"#{v.processed_bid} processed" if wide else f"#{v.processed_bid} done")
        plan.set_border_titles(title, ", ".join(flight))
        self._render_pool(v)
        if self.replay or self.paused or monotonic() - self._slow_drawn >= SLOW_PANELS_INTERVAL:
            self._render_slow_panels(v)
        else:
            self._slow_stale = True
        state = "replay" if self.replay else ("paused" if self.paused else "running")
        where = f" {self.index + 1}/{len(self.views)}" if self.replay else ""
        loop = " · overlap loop" if v.overlap else " · normal loop" if v.has_snapshots else ""
        # most important first: a narrow terminal cuts the end
        self._show_top_line(f"{state}{where} · iter {v.iteration}{loop} · {self.subtitle_base}")
        if isinstance(self.screen, DetailScreen):
            self.screen.show(self.requests.get(self.screen.rid), v)

    def _show_top_line(self, text: str) -> None:
        # not App.sub_title: setting that reactive repaints the whole screen
        self.query_one("#titlebar", TitleBar).show(self.title, text)

    def _render_pool(self, v: View) -> None:
        pool = self.query_one("#pool", TextLines)
        if not v.has_snapshots:
            pool.set_lines([Text("this recording has no scheduler snapshots:"),
                            Text("record with --record to see the queues, the pool and the tree")])
            return
        used = v.pool_total - v.pool_free - v.pool_evictable
        width = max(10, min(40, pool.size.width - 1))
        bar_used = round(width * used / max(v.pool_total, 1))
        bar_cache = round(width * v.pool_evictable / max(v.pool_total, 1))
        bar = Text.assemble(("█" * bar_used, "red"), ("▒" * bar_cache, "yellow"), "·" * (width - bar_used - bar_cache))
        title = f"KV pool: {v.pool_total} tokens"
        box = self.query_one("#poolbox")
        if box.border_title != title:  # setting it repaints the whole panel
            box.border_title = title
        pool.set_lines([bar] + [Text(line) for line in (
            f"used {used} free {v.pool_free}", f"cached {v.pool_evictable} usage {v.token_usage:.2f}",
            f"hit {v.cache_hit_rate:.2f} retracted {v.retractions}", f"ratio {v.new_token_ratio:.3f} {v.policy}",
            f"stop {v.admission_stop or '-'}", f"{v.throughput:.1f} tok/s done {v.finished}")])
        self.query_one("#hit", TextSparkline).show(v.hit_rate_history, top=1.0)
        self.query_one("#tput", TextSparkline).show(v.throughput_history)

    def _render_slow_panels(self, v: View) -> None:
        self._render_tree(v)
        self._render_log(v)
        self._slow_drawn, self._slow_stale = monotonic(), False

    def _render_tree(self, v: View) -> None:
        key = (v.tree, v.matched_path)
        if key == self._tree_key:
            return  # rebuilding the widget is the costly part of a frame
        self._tree_key = key
        self.query_one("#tree", RadixTreeView).show(v.tree, v.matched_path)

    def _render_log(self, v: View) -> None:
        log = self.query_one("#log", RichLog)
        new = v.log_total - self._log_shown
        if new < 0 or new > len(v.log):  # a replay jumped: redraw
            log.clear()
            new = len(v.log)
        for line in v.log[len(v.log) - new:] if new > 0 else []:
            log.write(line)
        self._log_shown = v.log_total

    # --- keys -----------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if not self.replay:
            self.feed.connection.send("pause" if self.paused else "run")
        if self.last_view is not None:
            self.render_view(self.last_view)

    def action_step(self) -> None:
        self.paused = True
        if self.replay:
            self.show_index(self.index + 1)
        else:
            self.feed.connection.send("step")

    def action_back(self) -> None:
        self.paused = True
        self.show_index(self.index - 1)

    def action_first(self) -> None:
        self.show_index(0)

    def action_last(self) -> None:
        self.show_index(len(self.views) - 1)

    def action_add_prompt(self) -> None:
        self._ask("prompt", "prompt, then Enter (Esc to cancel)")

    def action_add_workload(self) -> None:
        self._ask("workload", "workload: demo, shared-prefix, long-prompts, pool-pressure, steady or a .jsonl file")

    def _ask(self, mode: str, placeholder: str) -> None:
        self._input_mode = mode
        box = self.query_one("#prompt", Input)
        box.placeholder = placeholder
        box.display, box.disabled = True, False
        box.focus()

    def _hide_prompt(self, box: Input) -> None:
        box.value, box.display, box.disabled = "", False, True
        self.set_focus(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        self._hide_prompt(event.input)
        if not text:
            return
        if self._input_mode == "workload":
            self.feed.connection.send("workload", text)
        else:
            self.feed.connection.send("submit", {"messages": [{"role": "user", "content": text}],
                                                 "sampling_params": {"max_new_tokens": 64, "temperature": 0}})

    def on_key(self, event: Any) -> None:
        box = self.query_one("#prompt", Input)
        if event.key == "escape" and box.display:
            self._hide_prompt(box)

    def action_next_policy(self) -> None:
        current = self.last_view.policy if self.last_view is not None and self.last_view.policy else SCHEDULE_POLICIES[0]
        nxt = SCHEDULE_POLICIES[(SCHEDULE_POLICIES.index(current) + 1) % len(SCHEDULE_POLICIES)]
        self.feed.connection.send("policy", nxt)

    def action_select_next(self) -> None:
        v = self.last_view
        if v is None:
            return
        rids = [r[0] for r in v.running] + [r[0] for r in v.waiting]
        rids += [rid for rid in reversed(self.requests) if rid not in rids]  # then the most recent others
        if not rids:
            return
        i = rids.index(self.selected) + 1 if self.selected in rids else 0
        self.selected = rids[i % len(rids)]
        self.notify(f"selected {self.selected} (d: detail)", timeout=2)
        self.render_view(v)

    def on_row_table_clicked(self, event: RowTable.Clicked) -> None:
        self.selected = event.rid
        if self.last_view is not None:
            self.render_view(self.last_view)  # the row shows the selection
        self.action_detail()

    def action_detail(self) -> None:
        if self.selected is None:
            self.action_select_next()
        if self.selected is None or self.last_view is None:
            return
        screen = DetailScreen(self.selected)
        self.push_screen(screen)
        self.call_after_refresh(screen.show, self.requests.get(self.selected), self.last_view)

    def on_unmount(self) -> None:
        gc.unfreeze()  # back to the collector (tests make many apps in one process)
        if self.feed is not None:
            self.feed.connection.close()
