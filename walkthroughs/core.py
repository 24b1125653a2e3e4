"""What every walkthrough uses: narration in English or Chinese, tables, checked
numbers and graphviz diagrams. A walkthrough states a number only through ``check``,
so its text cannot drift from what the engine does."""

from __future__ import annotations

import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO


class WalkthroughFailed(AssertionError):
    """A number the narration states is not what the engine produced."""


@dataclass
class Walkthrough:
    name: str
    teaches_en: str
    teaches_zh: str
    seed: str  # the seed section it mirrors
    run: Callable[["Narrator"], None]


@dataclass
class Narrator:
    lang: str = "en"
    out_dir: Path | None = None
    png: bool = False
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    checks: list[str] = field(default_factory=list)
    diagrams: list[Path] = field(default_factory=list)
    # narrates the same run once more (in the other language): a walkthrough never reads
    # its narrator's language, so one run told twice is the two runs told once each
    mirror: "Narrator | None" = None

    def pick(self, en: str, zh: str) -> str:
        return zh if self.lang == "zh" else en

    def title(self, en: str, zh: str) -> None:
        text = self.pick(en, zh)
        self.stream.write(f"\n{text}\n{'=' * min(78, len(text) * (2 if self.lang == 'zh' else 1))}\n")
        if self.mirror is not None:
            self.mirror.title(en, zh)

    def step(self, en: str, zh: str) -> None:
        self.stream.write(f"\n## {self.pick(en, zh)}\n")
        if self.mirror is not None:
            self.mirror.step(en, zh)

    def say(self, en: str, zh: str) -> None:
        text = textwrap.dedent(self.pick(en, zh)).strip()
        for para in text.split("\n\n"):
            if self.lang == "zh":  # no spaces to break at: one line per paragraph, the terminal wraps
                self.stream.write("".join(line.strip() for line in para.splitlines()) + "\n\n")
            else:
                self.stream.write(textwrap.fill(" ".join(para.split()), 88) + "\n\n")
        if self.mirror is not None:
            self.mirror.say(en, zh)

    def code(self, text: str) -> None:
        self.stream.write(textwrap.indent(textwrap.dedent(text).strip("\n"), "    ") + "\n\n")
        if self.mirror is not None:
            self.mirror.code(text)

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        line = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
        self.stream.write(line(cells[0]) + "\n" + "  " + "  ".join("-" * w for w in widths) + "\n")
        for r in cells[1:]:
            self.stream.write(line(r) + "\n")
        self.stream.write("\n")
        if self.mirror is not None:
            self.mirror.table(headers, rows)

    def check(self, actual: Any, expected: Any, en: str, zh: str) -> None:
        what = self.pick(en, zh)
        if actual != expected:
            raise WalkthroughFailed(f"{what}: expected {expected!r}, the engine gave {actual!r}")
        self.checks.append(what)
        self.stream.write(f"  ✓ {what} = {actual!r}\n")
        if self.mirror is not None:
            self.mirror.check(actual, expected, en, zh)

    def diagram(self, name: str, dot_source: str) -> list[Path]:
        """Write ``name.dot``; render SVG (and PNG when asked) where graphviz's ``dot`` exists."""
        if self.out_dir is None:
            return []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        dot_path = self.out_dir / f"{name}.dot"
        dot_path.write_text(dot_source)
        made = [dot_path]
        if shutil.which("dot"):
            import graphviz

            for fmt in ["svg"] + (["png"] if self.png else []):
                out = graphviz.Source(dot_source).render(outfile=str(self.out_dir / f"{name}.{fmt}"), format=fmt,
                                                          cleanup=True)
                made.append(Path(out))
        else:
            self.stream.write("  " + self.pick(
                f"(graphviz's dot program is not installed, a system package: wrote {dot_path.name} only)",
                f"（未安装 graphviz 的 dot 程序（系统软件包）：只写了 {dot_path.name}）") + "\n")
        self.diagrams.extend(made)
        self.stream.write(f"  {self.pick('diagram', '图')}: {', '.join(p.name for p in made)}\n")
        if self.mirror is not None:
            self.mirror.diagram(name, dot_source)
        return made


def radix_tree_dot(tree_cache: Any, title: str, highlight: set[int] | None = None) -> str:
    """A radix tree snapshot as graphviz: node token counts, first tokens, lock_ref."""
    highlight = highlight or set()
    lines = ["digraph radix {", "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10];",
             f'  labelloc=t; label="{title}";']
    for n in tree_cache.snapshot():
        if n.parent_id == -1:
            lines.append(f'  n{n.id} [label="root", shape=circle];')
            continue
        head = " ".join(map(str, n.key_head))
        style = ', style=filled, fillcolor="#ffe08a"' if n.id in highlight else ""
        lock = f'\\nlock_ref={n.lock_ref}'
        lines.append(f'  n{n.id} [label="[{head}{" …" if n.key_len > len(n.key_head) else ""}]\\n'
                     f'{n.key_len} tokens{lock}"{style}];')
        lines.append(f'  n{n.parent_id} -> n{n.id};')
    lines.append("}")
    return "\n".join(lines)


def batch_dot(batch: Any, title: str) -> str:
    """One round's composition: per request, the rows reused from the cache (grey) and
    the rows computed this round."""
    lines = ["digraph batch {", "  rankdir=LR; node [shape=record, fontname=monospace, fontsize=10];",
             f'  labelloc=t; label="{title} ({batch.forward_mode.name})";']
    for i, (r, pre, ext) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        lines.append(f'  r{i} [label="{r.rid}|{{prefix {pre}\\lreused|{ext} new rows\\lcomputed}}"];')
    lines += [f"  r{i} -> r{i + 1} [style=invis];" for i in range(len(batch.reqs) - 1)]
    lines.append("}")
    return "\n".join(lines)
