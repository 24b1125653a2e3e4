"""The live scheduler in a terminal (Textual).

The screen only ever sees Views (tui/state.py) built from the engine's events: live, the
events come from the engine host (tui/host.py, its own process under ``sglite tui``);
in a replay, from a recording. Either way the same builder makes the same panels.
"""

from __future__ import annotations

import gc
from time import monotonic
from typing import Any

from rich.markup import escape
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, RichLog, Static

from sglite.server_args import SCHEDULE_POLICIES
from tui.help import HelpScreen
from tui.host import HostState
from tui.state import ADMISSION_WORDS, LOG_KEEP, THROUGHPUT_WINDOW, ReqInfo, View, ViewBuilder
from tui.widgets import RadixTreeView, RowTable, TextSparkline, TitleBar, WidthLines
from tui.workloads import BUILTIN, load

UI_INTERVAL = 0.02  # seconds between looks for a new view (the host ships one at most every tui.host.SHIP_INTERVAL)
REPLAY_SPEED = 10  # iterations a second while a replay plays
# while the engine runs, the radix tree and the events log, whose changes of size cost a
# layout pass of the whole screen, are redrawn at most this often (paused, stepping or
# replaying: every view)
SLOW_PANELS_INTERVAL = 0.15
DECAY_REDRAW = THROUGHPUT_WINDOW / 4  # live, once no iteration ran for this long, tok/s is redrawn as it falls


MISS_LINE_MIN_HEIGHT = 30  # terminal rows from which the KV pool panel shows its miss line


def pool_lines(v: View, width: int, throughput: float | None) -> list[Text]:
    """The KV pool panel's lines for a panel ``width`` cells wide: the bar (█ held by
    requests, ▒ cached and evictable, · free), then the counts (``throughput`` None:
    live and paused, nothing is generated)."""
    used = v.pool_total - v.pool_free - v.pool_evictable
    bar_width = max(10, min(40, width - 1))
    bar_used = round(bar_width * used / max(v.pool_total, 1))
    bar_cache = round(bar_width * v.pool_evictable / max(v.pool_total, 1))
    bar = Text.assemble(("█" * bar_used, "red"), ("▒" * bar_cache, "yellow"), "·" * (bar_width - bar_used - bar_cache))
    stop = ADMISSION_WORDS.get(v.admission_stop, v.admission_stop) if v.admission_stop else "-"
    if v.admission_stop and width >= 36:  # SGLang's code (the retraction variant is sglite's words only)
        stop += f" ({v.admission_stop.removesuffix('_THEN_RETRACT')})"
    return [bar] + [Text(line) for line in (
        f"used {used} free {v.pool_free}", f"cached {v.pool_evictable} usage {v.token_usage:.2f}",
        f"hit {v.cache_hit_rate:.2f} retracted {v.retractions}", f"new_token_ratio {v.new_token_ratio:.3f}",
        f"admit: {stop}", "paused: 0 tok/s" if throughput is None else f"{throughput:.1f} tok/s")]


def tp_forward_line(timings: tuple[tuple[float, float], ...]) -> str:
    """--tp-size N: each rank's last forward in ms, and rank 0's all-reduce share of it."""
    ranks = " ".join(f"TP{r} {sec * 1e3:.1f}" for r, (sec, _) in enumerate(timings))
    return f"fwd ms {ranks} (all-reduce {timings[0][1] * 1e3:.1f})"


class IterationKeys:
    """The keys that move through a recording's iterations (a replay; two runs
    compared), for an App with ``index``, ``paused``, ``show_index(i)`` and
    ``last_index``."""

    def on_key(self, event: Any) -> None:
        """A terminal sends Esc and a key typed soon after it (within Textual's 100 ms
        escape delay, tmux's escape-time) as one key, alt+key: Esc then q closed nothing
        and quit nothing. Take alt+<key> as what was typed: Esc (close the help or detail
        screen on top), then the key."""
        key = event.key
        if not (key.startswith("alt+") and len(key) == len("alt+x")):
            return
        event.stop()
        event.prevent_default()
        if isinstance(self.screen, ModalScreen):
            self.screen.dismiss()
        self.call_after_refresh(self.simulate_key, key[len("alt+"):])

    def action_step(self) -> None:
        self.paused = True
        self.show_index(self.index + 1)

    def action_back(self) -> None:
        self.paused = True
        self.show_index(self.index - 1)

    def action_first(self) -> None:
        self.show_index(0)

    def action_last(self) -> None:
        self.show_index(self.last_index)


class LiveFeed:
    """Messages from the engine host, folded into Views; the screen draws the latest."""

    def __init__(self, connection: Any, info: dict[str, Any]):
        self.connection = connection
        self.info = info
        self.builder = ViewBuilder()
        self.latest: View | None = None
        self.error: str | None = None
        self.host_state: HostState | None = None
        self.state_changed = False  # a HostState came since the screen last looked
        self.paused_by_engine: bool | None = None  # attached: whether the server's scheduler is paused

    def latest_iteration(self) -> int:
        return self.latest.iteration if self.latest is not None else -1

    def pump(self) -> View | None:
        """Apply everything the engine sent since the last call; the newest View."""
        new = None
        for kind, payload in self.connection.drain():
            if kind == "events":
                for e in payload:
                    view = self.builder.apply(e)
                    if view is not None:
                        new = view
            elif kind == "state":
                self.host_state, self.state_changed = payload, True
            elif kind == "paused":
                self.paused_by_engine, self.state_changed = payload, True
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

    def show(self, req: ReqInfo | None, view: View, arriving: bool = False) -> None:
        """``arriving``: the host submitted it and the scheduler has not received it yet."""
        body = self.query_one("#detail-body", Static)
        if req is None:
            body.update(f"{self.rid}: " + ("arriving (received at the next iteration's recv_requests)"
                                           if arriving else "no events yet"))
            return
        lines = [f"[b]{escape(self.rid)}[/]  {escape(req.state_at(view))}",
                 f"prompt {req.prompt_tokens} tokens, max_new_tokens {req.max_new_tokens}"
                 + (" · ignore_eos" if req.ignore_eos else ""), "", "[b]stages[/] (iteration, what happened)"]
        lines += [f"  iter {it:>5}  {escape(what)}" for it, what in req.timeline_at(view.iteration)]
        logprobs = req.logprob_lines(view.iteration)
        if logprobs:
            lines += ["", "[b]logprobs[/] (token id, logprob; top tokens)"] + [escape(x) for x in logprobs]
        grammar = req.grammar_lines(view.iteration)
        if grammar:
            lines += ["", "[b]grammar mask[/] (tokens it allowed; the model's choice before it)"]
            lines += [escape(x) for x in grammar]
        text = Text.from_markup("\n".join(lines) + "\n\n").append("text so far\n", style="bold")
        if req.ignore_eos:
            text.append("EOS ignored: generation continues past the model's end of turn, so the text runs on "
                        "into turns the model invents\n", style="italic yellow")
        body.update(text.append(req.text_at(view.iteration) or "(none yet)"))


class SchedulerApp(IterationKeys, App):
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
    # q and ? first: a narrow footer cuts the end (the help screen lists every key)
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("space", "toggle_pause", "run"),
        Binding("n,right", "step", "step"),
        Binding("b,left", "back", "back"),
        Binding("home", "first", "first", show=False),
        Binding("end", "last", "last", show=False),
        Binding("a", "add_prompt", "prompt"),
        Binding("w", "add_workload", "workload"),
        Binding("p", "next_policy", "policy"),
        Binding("s", "select_next", "select"),
        Binding("d", "detail", "detail"),
        Binding("t", "toggle_tree_text", "text/ids", show=False),  # (the tree's border says t)
    ]
    ENABLE_COMMAND_PALETTE = False  # every action has a key, and ^p took footer room
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
        self._pool_drawn = 0.0  # when the KV pool panel was last drawn (monotonic)
        self.tree_as_text = True  # radix nodes labelled with their text (t: token ids)

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
            yield RowTable(("rid", "len", "cached", "wait", "why"), id="waiting", hideable=("cached", "len"))
            yield RowTable(("rid", "seq", "out/max"), id="running")
            yield RowTable(("rid", "pre", "ext", "seq", "loc"), id="plan")
            with Vertical(id="poolbox"):
                yield WidthLines(id="pool")
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
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # the border sub-titles give the units (a narrow panel cuts them; ? explains all)
        for wid, title, sub in (("poolbox", "KV pool", "█ used ▒ cached · free"),
                                ("treebox", "radix tree", "tokens 🔒lock_ref lru order · t"),
                                ("log", "events", "iteration, event")):
            box = self.query_one(f"#{wid}")
            box.border_title, box.border_subtitle = title, sub
        self._show_top_line(self.subtitle_base)
        if self.replay and self.views:
            self.render_view(self.views[0])
        elif not self.replay:
            # until the engine's first iteration comes (a first start also warms its kernels)
            self._show_top_line(f"starting: waiting for the engine's first iteration · {self.subtitle_base}")
            self.query_one("#waiting", RowTable).show([], notes=["waiting for the engine's first iteration ..."])
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
        if self.feed.paused_by_engine is not None:  # what the server says wins over the key pressed
            self.paused, self.feed.paused_by_engine = self.feed.paused_by_engine, None
        if view is not None or self.feed.state_changed:
            self.feed.state_changed = False
            self.render_view(view or self.last_view or View())
        elif self._slow_stale and monotonic() - self._slow_drawn >= SLOW_PANELS_INTERVAL:
            self._render_slow_panels(self.last_view)
        elif self.last_view is not None and monotonic() - self._pool_drawn >= DECAY_REDRAW:
            if self.query("#pool"):  # (none while the app closes: a last tick may come after its panels went)
                self._render_pool(self.last_view)  # tok/s falls while nothing runs

    @property
    def last_index(self) -> int:
        return len(self.views) - 1

    def show_index(self, i: int) -> None:
        if self.views:
            self.index = max(0, min(i, len(self.views) - 1))
            self.render_view(self.views[self.index])

    @property
    def host_state(self) -> HostState | None:
        return self.feed.host_state if self.feed is not None else None

    def render_view(self, v: View) -> None:
        self.last_view = v
        self.updates += 1
        self._render_tables(v)
        self._render_pool(v)
        if self.replay or self.paused or monotonic() - self._slow_drawn >= SLOW_PANELS_INTERVAL:
            self._render_slow_panels(v)
        else:
            self._slow_stale = True
        self._show_top_line(self._top_line(v))
        if isinstance(self.screen, DetailScreen):
            hs = self.host_state
            self.screen.show(self.requests.get(self.screen.rid), v, hs is not None and self.screen.rid in hs.arriving)

    def _render_tables(self, v: View) -> None:
        hs = self.host_state
        arriving = [f"arriving: {rid} (recv_requests next iteration)" for rid in hs.arriving] if hs else []
        waiting = self.query_one("#waiting", RowTable)
        waiting.show(v.waiting, self.selected, arriving)
        waiting.set_border_titles(f"waiting_queue ({v.policy})" if v.policy else "waiting_queue",
                                  "len, cached: tokens; wait: iterations")
        running = self.query_one("#running", RowTable)
        running.show(v.running, self.selected)
        running.set_border_titles("running_batch", f"{v.finished} finished · seq: tokens")
        plan = self.query_one("#plan", RowTable)
        plan.show(v.plan, self.selected)
        wide = plan.size.width >= 40
        # one counter everywhere: the iteration just run (#b: the id of the batch it launched)
        rows = f"{v.plan_rows} rows"
        if not v.bid:
            title = f"iter {v.iteration}: no batch"
        else:
            title = (f"iter {v.iteration} ran #{v.bid}: {v.forward_mode}, {rows}" if wide
                     else f"iter {v.iteration}: #{v.bid} {v.forward_mode}")
        # the overlap loop: which batch runs now, whose results this iteration processed
        flight = [] if wide or not v.bid else [rows]
        if v.overlap and v.bid and wide:
            flight.append(f"#{v.bid} in flight")
        if v.overlap and v.processed_bid:
            flight.append(f"#{v.processed_bid} processed" if wide else f"#{v.processed_bid} done")
        if v.tp_timings and wide:
            flight.append(tp_forward_line(v.tp_timings))
        plan.set_border_titles(title, ", ".join(flight) or ("tokens; loc: KV slots" if v.bid else ""))

    def _top_line(self, v: View) -> str:
        """Most important first (a narrow terminal cuts the end): the engine's state, the
        iteration on screen, the loop, then the model and the workloads with work left."""
        hs = self.host_state
        if self.replay:
            state = f"replay {self.index + 1}/{len(self.views)}"
        elif hs is not None and hs.idle:
            state = "idle — workload done (press w)"
        else:
            state = "paused" if self.paused else "running"
        loop = " · overlap loop" if v.overlap else " · normal loop" if v.has_snapshots else ""
        if v.tp_timings:
            loop += f" · tp {len(v.tp_timings)}"
        line = f"{state} · after iter {v.iteration}{loop} · {self.subtitle_base}"
        if hs is not None:
            line += " · " + (f"workload{'s' if len(hs.workloads) > 1 else ''} {' + '.join(hs.workloads)}"
                             if hs.workloads else f"workload {hs.last_workload} done")
            if hs.next_arrival is not None and not hs.idle:
                line += f" · next arrival: {hs.next_arrival[0]} at iter {hs.next_arrival[1]}"
        return line

    def _show_top_line(self, text: str) -> None:
        # not App.sub_title: setting that reactive repaints the whole screen
        self.query_one("#titlebar", TitleBar).show(self.title, text)

    def _throughput(self, v: View) -> float | None:
        """The view's tok/s, or, live and running when no iteration ran for a while, the
        rate over the last THROUGHPUT_WINDOW seconds up to now (0 once a window passed);
        None live and paused (a replay paused shows the rate as of its iteration)."""
        builder = self.feed.builder if self.feed is not None else None
        if self.paused and not self.replay:
            return None
        if self.paused or builder is None or builder.last_ts is None or v.iteration != self.feed.latest_iteration():
            return v.throughput  # (paused: the rate as of the iteration on screen)
        now = monotonic()
        return builder.throughput_at(now) if now - builder.last_ts >= DECAY_REDRAW else v.throughput

    def _render_pool(self, v: View) -> None:
        self._pool_drawn = monotonic()
        pool = self.query_one("#pool", WidthLines)
        if not v.has_snapshots:
            pool.show(lambda width: [Text("this recording has no scheduler snapshots:"),
                                     Text("record with --record to see the queues, the pool and the tree")])
            return
        title = f"KV pool: {v.pool_total} tokens"
        box = self.query_one("#poolbox")
        if box.border_title != title:  # setting it repaints the whole panel
            box.border_title = title
        throughput, miss = self._throughput(v), self._miss_line(v, self.size.height)
        pool.show(lambda width: pool_lines(v, width, throughput) + miss)
        self.query_one("#hit", TextSparkline).show(v.hit_rate_history, top=1.0)
        self.query_one("#tput", TextSparkline).show(v.throughput_history)

    @staticmethod
    def _miss_line(v: View, terminal_height: int) -> list[Text]:
        """Prompt tokens computed, by why the cache missed them (docs/why.md): a line
        in a terminal tall enough that the pool panel has room for it (not 80x24). The
        terminal's height, not the panel's: that is known before the first layout."""
        m = v.cache_miss
        if terminal_height < MISS_LINE_MIN_HEIGHT or not m:
            return []
        return [Text(f"miss: new {m['new']} past {m['past']} evicted {m['evicted']} page {m['page']}")]

    def _render_slow_panels(self, v: View) -> None:
        self._render_tree(v)
        self._render_log(v)
        self._slow_drawn, self._slow_stale = monotonic(), False

    def _render_tree(self, v: View) -> None:
        key = (v.tree, v.matched_path, self.tree_as_text)
        if key == self._tree_key:
            return  # rebuilding the widget is the costly part of a frame
        self._tree_key = key
        self.query_one("#tree", RadixTreeView).show(v.tree, v.matched_path, self.tree_as_text)

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
        if self.replay:
            super().action_step()
        else:
            self.paused = True
            self.feed.connection.send("step")

    def action_add_prompt(self) -> None:
        self._ask("prompt", "prompt, then Enter (Esc to cancel)")

    def action_add_workload(self) -> None:
        self._ask("workload", f"workload: {', '.join(BUILTIN)} or a .jsonl file (Esc cancels)")

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
            try:
                load(text)  # a bad name or file is said here, in full, not sent
            except ValueError as e:
                self.notify(str(e), title="workload", severity="error", timeout=10)
                return
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
        hs = self.host_state
        rids = [r[0] for r in v.running] + [r[0] for r in v.waiting] + list(hs.arriving if hs else ())
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
        self.clear_notifications()  # a toast ("selected r3 (d: detail)") would cover the detail's text
        self.push_screen(screen)
        hs = self.host_state
        self.call_after_refresh(screen.show, self.requests.get(self.selected), self.last_view,
                                hs is not None and self.selected in hs.arriving)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.BINDINGS, replay=self.replay))

    def action_toggle_tree_text(self) -> None:
        self.tree_as_text = not self.tree_as_text
        self.notify("radix tree: " + ("text" if self.tree_as_text else "token ids"), timeout=2)
        if self.last_view is not None:
            self._render_tree(self.last_view)

    def on_unmount(self) -> None:
        gc.unfreeze()  # back to the collector (tests make many apps in one process)
        if self.feed is not None:
            self.feed.connection.close()
