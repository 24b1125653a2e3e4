"""The TUI's widgets: text panels repainted line by line, a one-line sparkline, the
queue tables, the radix tree as text and the top line. Each is drawn as Rich Text rather
than with Textual's DataTable / Tree / Sparkline / Header, whose per-cell or per-node
rendering and layout passes were most of what a frame cost (docs/tui.md, Cost)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rich.text import Text
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from sglite.events import TreeNodeRow
from tui.state import short_rid


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


class WidthLines(TextLines):
    """Lines drawn for the panel's width (a bar, words that fit): ``show(draw)`` draws
    them now and again whenever the panel's size changes (the first frames of a busy
    machine draw before the layout has given the panel its width)."""

    def __init__(self, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.draw: Callable[[int], list[Text]] | None = None

    def show(self, draw: Callable[[int], list[Text]]) -> None:
        self.draw = draw
        self.set_lines(draw(self.size.width))

    def on_resize(self) -> None:
        if self.draw is not None:
            self.set_lines(self.draw(self.size.width))


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

    def __init__(self, columns: tuple[str, ...], id: str, hideable: tuple[str, ...] = ()) -> None:  # noqa: A002
        super().__init__(id=id)
        self.columns = columns
        # columns left out, in this order, while a row would not fit the panel's width
        # (80x24: the waiting_queue keeps its why column and drops cached, then len)
        self.hideable = hideable
        self.rows: list[tuple[str, ...]] = []  # everything the table holds, shown or not
        self.selected: str | None = None
        self._widths = [len(c) for c in columns]
        self._shown = 0
        self._key: Any = None
        self._titles: tuple[str, str] | None = None
        self._borders_only = False
        self.notes: tuple[str, ...] = ()
        self.marked: frozenset[str] = frozenset()

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

    def show(self, rows: list[tuple], selected: str | None = None, notes: Sequence[str] = (),
             marked: frozenset[str] = frozenset()) -> None:
        """``notes``: lines above the header (requests arriving at the waiting_queue);
        ``marked``: rids whose rows are drawn in bold yellow (two runs compared: the
        rows the other run does not have)."""
        rows = [tuple(str(c) for c in r) for r in rows]
        height = max(2, self.size.height)
        key = (rows, selected, height, tuple(notes), marked)
        if key == self._key:
            return
        self._key, self.rows, self.selected, self.notes, self.marked = key, rows, selected, tuple(notes), marked
        cells = [(short_rid(r[0]),) + r[1:] for r in rows]  # (a server's rids are uuids)
        for r in cells:
            self._widths = [max(w, len(c)) for w, c in zip(self._widths, r)]
        fit = height - 1 - len(notes)  # the header takes a line
        shown = rows if len(rows) <= fit else rows[: max(0, fit - 1)]
        self._shown = len(shown)

        keep = self._visible_columns()

        def line(cells: tuple[str, ...]) -> str:  # rid left, numbers right
            return " ".join(cells[j].ljust(self._widths[j]) if j == 0 else cells[j].rjust(self._widths[j])
                            for j in keep)

        lines = [Text(n, style="italic") for n in notes] + [Text(line(self.columns), style="bold")]
        lines += [Text(line(c), style="reverse" if r[0] == selected else "bold yellow" if r[0] in marked else "")
                  for r, c in zip(shown, cells)]
        if len(shown) < len(rows):
            lines.append(Text(f"+{len(rows) - len(shown)} more", style="dim"))
        self.set_lines(lines)

    def _visible_columns(self) -> list[int]:
        """The columns shown: all, less the hideable ones (in order) while a row is wider
        than the panel."""
        keep = list(range(len(self.columns)))
        for name in self.hideable:
            if sum(self._widths[j] for j in keep) + len(keep) - 1 <= self.size.width:
                break
            keep.remove(self.columns.index(name))
        return keep

    def on_resize(self) -> None:
        if self._key is not None:
            self._key = None
            self.show(self.rows, self.selected, self.notes, self.marked)

    def on_click(self, event: Any) -> None:
        offset = event.get_content_offset(self)
        first = 1 + len(self.notes)  # the notes, then the header, then the rows
        if offset is not None and first <= offset.y < first + self._shown:
            self.post_message(self.Clicked(self.rows[offset.y - first][0]))


class RadixTreeView(Static):
    """The radix tree as indented text, one node a line (Textual's Tree widget rebuilt
    its nodes on every change, a large part of a frame while locks and access times
    change every iteration). ``lines`` holds (depth, label) in drawing order."""

    def __init__(self, id: str) -> None:  # noqa: A002
        super().__init__(id=id)
        self.lines: list[tuple[int, str]] = []
        self._extent = (0, 0)  # (lines, widest line) last shown

    def show(self, tree: Sequence[TreeNodeRow], matched_path: Any, as_text: bool = True) -> None:
        """``as_text``: label a node with its first tokens decoded, else with their ids."""
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
                label = node_label(node, order[node_id], as_text)
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


def node_label(node: TreeNodeRow, lru_rank: int, as_text: bool) -> str:
    """``34 🔒8 lru15 "<|im_start|>system\\nYou…"``: tokens in the node's key, its lock_ref
    (when locked), its rank in eviction order, and its first tokens (text or ids)."""
    lock = f" 🔒{node.lock_ref}" if node.lock_ref else ""
    if as_text and node.key_text:
        more = "…" if node.key_len > len(node.key_head) else ""
        head = '"' + node.key_text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t") + more + '"'
    else:
        head = str(list(node.key_head[:3]))[:-1] + (", …]" if node.key_len > 3 else "]")
    return f"{node.key_len}{lock} lru{lru_rank} {head}"


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
