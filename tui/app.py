"""The live scheduler in a terminal (Textual). The engine runs in a worker thread; after
each iteration it hands the screen a ``View`` (tui/state.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.widgets import DataTable, Footer, Header, Input, RichLog, Static, Tree

from sglite import events as ev
from sglite.managers.schedule_policy import SchedulePolicy
from sglite.server_args import SCHEDULE_POLICIES
from tui.state import View, take
from tui.workloads import Workload

UI_MIN_INTERVAL = 0.05  # at most 20 screen updates per second


class EngineWorker:
    """Steps the engine on its own thread; pausing and single steps for the UI."""

    def __init__(self, engine: Any, workload: Workload, on_view: Any, paused: bool = False,
                 clock: Any = time.perf_counter):
        self.engine = engine
        self.pending = sorted(workload.arrivals, key=lambda a: a.at)
        self.on_view = on_view
        self.run_flag = threading.Event()
        if not paused:
            self.run_flag.set()
        self.step_once = threading.Event()
        self.stop = threading.Event()
        self.log: list[str] = []
        self._last_stop = ""  # log why admission stops only when the reason changes
        self.lock = threading.Lock()
        self.finished = 0
        self.tokens = 0
        self.queued_at: dict[str, int] = {}
        self.clock = clock  # tests pass a deterministic one
        self._tic = clock()
        engine.event_bus.subscribe(self._on_event)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="sglite-engine")

    def _on_event(self, e: ev.Event) -> None:
        line = None
        if isinstance(e, ev.ReqArrived):
            self.queued_at[e.rid] = e.iteration
        if isinstance(e, ev.ReqRetracted):
            self.queued_at[e.rid] = e.iteration
            line = (f"[red]retract[/] {e.rid} at {e.output_tokens} tok, "
                    f"new_token_ratio {e.old_new_token_ratio:.3f}->{e.new_token_ratio:.3f}")
        elif isinstance(e, ev.CacheEvicted):
            line = f"[yellow]evict[/] {e.num_tokens} tok, {e.num_nodes} nodes"
        elif isinstance(e, ev.ReqChunked):
            line = f"[cyan]chunk[/] {e.rid} #{e.chunk_index} {e.computed_len}/{e.total_len}"
        elif isinstance(e, ev.ReqAdmitted) and e.prefix_len:
            line = f"[green]hit[/] {e.rid} {e.prefix_len} cached +{e.extend_len}"
        elif isinstance(e, ev.ReqFinished):
            self.finished += 1
            line = f"done {e.rid} {e.reason} {e.completion_tokens} tok"
        elif isinstance(e, ev.ReqAborted):
            line = f"[red]abort[/] {e.rid}: {e.reason}"
        elif isinstance(e, ev.AdmissionStopped):
            reason = e.reason if e.waiting else ""
            if reason != self._last_stop and reason not in ("", "EMPTY_QUEUE"):
                line = f"admission stops: {reason}, {e.waiting} waiting"
            self._last_stop = reason
        elif isinstance(e, ev.TokensEmitted):
            self.tokens += len(e.token_ids)
        if line is not None:
            self.log.append(f"{e.iteration:>5} {line}")

    def submit_arrivals(self) -> None:
        it = self.engine.scheduler.iteration
        while self.pending and self.pending[0].at <= it:
            a = self.pending.pop(0)
            self.engine.submit(a.prompt, input_ids=a.input_ids, messages=a.messages,
                               sampling_params={"max_new_tokens": a.max_new_tokens, "temperature": 0,
                                                "ignore_eos": a.ignore_eos})

    def view(self) -> View:
        elapsed = max(self.clock() - self._tic, 1e-9)
        return take(self.engine, self.log, self.tokens / elapsed, self.finished, self.queued_at)

    def step(self) -> View:
        with self.lock:
            self.submit_arrivals()
            self.engine.step()
            return self.view()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self.run_flag.is_set() and not self.step_once.wait(0.05):
                continue
            single = self.step_once.is_set()
            self.step_once.clear()
            if not self.engine.scheduler.has_work() and not self.pending and not single:
                time.sleep(0.05)
                continue
            self.on_view(self.step())

    def start(self) -> None:
        self.thread.start()


class SchedulerApp(App):
    TITLE = "sglite"
    CSS = """
    Grid { grid-size: 3 2; grid-rows: 1fr 1fr; }
    DataTable, Tree, RichLog, #pool { border: round $accent; height: 1fr; }
    #prompt { dock: bottom; display: none; }
    """
    BINDINGS = [
        Binding("space", "toggle_pause", "pause/run"),
        Binding("n", "step", "step"),
        Binding("a", "add_prompt", "add prompt"),
        Binding("p", "next_policy", "policy"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, engine: Any, workload: Workload, paused: bool = False, start_worker: bool = True,
                 clock: Any = time.perf_counter):
        super().__init__()
        self.engine = engine
        self.workload = workload
        self.worker = EngineWorker(engine, workload, self._post_view, paused, clock)
        self.start_worker = start_worker
        self.last_view: View | None = None
        self.latest: View | None = None  # set by the engine thread, drawn by a UI timer
        self.updates = 0
        self._log_shown = 0
        self._tree_key: list | None = None

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Grid():
            yield DataTable(id="waiting", zebra_stripes=True)
            yield DataTable(id="running", zebra_stripes=True)
            yield DataTable(id="plan", zebra_stripes=True)
            yield Static(id="pool")
            yield Tree("root", id="tree")
            yield RichLog(id="log", markup=True, wrap=False, max_lines=500)
        yield Input(placeholder="prompt, then Enter (Esc to cancel)", id="prompt", disabled=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#waiting", DataTable).border_title = "waiting_queue"
        self.query_one("#running", DataTable).border_title = "running_batch"
        self.query_one("#plan", DataTable).border_title = "this round"
        self.query_one("#pool", Static).border_title = "KV pool"
        self.query_one("#tree", Tree).border_title = "radix tree"
        self.query_one("#log", RichLog).border_title = "events"
        # short headers so the columns fit at 80x24 (the border titles name the panels)
        for tid, cols in (("waiting", ("rid", "len", "cached", "waited")),
                          ("running", ("rid", "seq", "out/max")),
                          ("plan", ("rid", "pre", "ext", "seq", "loc"))):
            self.query_one(f"#{tid}", DataTable).add_columns(*cols)
        self.sub_title = f"{self.engine.server_args.model_path} · workload {self.workload.name}"
        self.render_view(self.worker.view())
        # the engine never waits for the screen: it leaves its latest view here and the
        # UI draws whatever is newest, at most 20 times a second
        self.set_interval(UI_MIN_INTERVAL, self._draw_latest)
        if self.start_worker:
            self.worker.start()

    def _post_view(self, view: View) -> None:
        self.latest = view

    def _draw_latest(self) -> None:
        view, self.latest = self.latest, None
        if view is not None:
            self.render_view(view)

    def render_view(self, v: View) -> None:
        self.last_view = v
        self.updates += 1
        for tid, rows in (("waiting", v.waiting), ("running", v.running), ("plan", v.plan)):
            t = self.query_one(f"#{tid}", DataTable)
            t.clear()
            t.add_rows(rows)
        self.query_one("#plan", DataTable).border_title = f"this round: {v.forward_mode}, {v.plan_rows} rows"
        used = v.pool_total - v.pool_free - v.pool_evictable
        width = max(10, min(40, self.query_one("#pool", Static).size.width - 1))
        bar_used = round(width * used / max(v.pool_total, 1))
        bar_cache = round(width * v.pool_evictable / max(v.pool_total, 1))
        bar = "[red]" + "█" * bar_used + "[/][yellow]" + "▒" * bar_cache + "[/]" + "·" * (width - bar_used - bar_cache)
        state = "running" if self.worker.run_flag.is_set() else "[b]paused[/]"
        self.query_one("#pool", Static).update(
            f"{bar}\nused {used} cached {v.pool_evictable} free {v.pool_free} / {v.pool_total}\n"
            f"usage {v.token_usage:.2f}  hit rate {v.cache_hit_rate:.2f}\n"
            f"new_token_ratio {v.new_token_ratio:.3f}\nretracted {v.retractions}  stop: {v.admission_stop or '-'}\n"
            f"{v.policy}  iter {v.iteration}  {state}\n{v.throughput:.1f} tok/s  finished {v.finished}")
        self._render_tree(v.tree)
        new = min(v.log_total - self._log_shown, len(v.log))
        log = self.query_one("#log", RichLog)
        for line in v.log[len(v.log) - new:] if new > 0 else []:
            log.write(line)
        self._log_shown = v.log_total

    def _render_tree(self, nodes: list[dict]) -> None:
        key = [(n["id"], n["parent_id"], n["key_len"], n["lock_ref"]) for n in nodes]
        if key == self._tree_key:
            return  # rebuilding the widget is the costly part of a frame
        self._tree_key = key
        tree = self.query_one("#tree", Tree)
        tree.clear()
        handles = {}
        for n in nodes:
            if n["parent_id"] is None:
                handles[n["id"]] = tree.root
                continue
            parent = handles.get(n["parent_id"], tree.root)
            lock = f" 🔒{n['lock_ref']}" if n["lock_ref"] else ""
            handles[n["id"]] = parent.add(f"{n['key_len']}{lock} {n['key_head'][:3]}", expand=True)
        tree.root.expand()

    # --- keys -----------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        if self.worker.run_flag.is_set():
            self.worker.run_flag.clear()
        else:
            self.worker.run_flag.set()
        if self.last_view is not None:
            self.render_view(self.last_view)

    def action_step(self) -> None:
        self.worker.run_flag.clear()
        self.worker.step_once.set()

    def action_add_prompt(self) -> None:
        box = self.query_one("#prompt", Input)
        box.display, box.disabled = True, False
        box.focus()

    def _hide_prompt(self, box: Input) -> None:
        box.value, box.display, box.disabled = "", False, True
        self.set_focus(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        self._hide_prompt(event.input)
        if text:
            rid = self.engine.submit(messages=[{"role": "user", "content": text}],
                                     sampling_params={"max_new_tokens": 64, "temperature": 0})
            self.worker.log.append(f"{'':>5} submitted {rid}: {text[:40]}")

    def on_key(self, event: Any) -> None:
        box = self.query_one("#prompt", Input)
        if event.key == "escape" and box.display:
            self._hide_prompt(box)

    def action_next_policy(self) -> None:
        s = self.engine.scheduler
        with self.worker.lock:
            i = (SCHEDULE_POLICIES.index(s.server_args.schedule_policy) + 1) % len(SCHEDULE_POLICIES)
            s.server_args.schedule_policy = SCHEDULE_POLICIES[i]
            s.policy = SchedulePolicy(s.server_args.schedule_policy, s.tree_cache, s.server_args.random_seed)
        self.worker.log.append(f"{'':>5} policy -> {SCHEDULE_POLICIES[i]}")

    def on_unmount(self) -> None:
        self.worker.stop.set()
        if self.worker.thread.is_alive():
            self.worker.thread.join(timeout=10)
