"""``sglite walkthrough``: list the lessons or run one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("walkthrough", help="run a self-checking lesson from the seed tutorials ('list' to see them)")
    p.add_argument("name", help="a walkthrough name, or 'list'")
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="narration language")
    p.add_argument("--out", default="walkthrough-out", help="folder for the diagrams")
    p.add_argument("--png", action="store_true", help="also render PNG diagrams")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from walkthroughs import MODULES, Narrator, WalkthroughFailed, registry

    if args.name != "list" and args.name not in MODULES:
        print(f"error: no walkthrough {args.name!r}; known: {', '.join(MODULES)}", file=sys.stderr)
        return 2
    items = registry()
    if args.name == "list":
        width = max(map(len, items)) + 2
        for w in items.values():
            print(f"{w.name:<{width}}{w.teaches_zh if args.lang == 'zh' else w.teaches_en}  ({w.seed})")
        return 0
    w = items[args.name]
    narrator = Narrator(lang=args.lang, out_dir=Path(args.out) / w.name, png=args.png)
    try:
        w.run(narrator)
    except WalkthroughFailed as e:
        print(f"error: walkthrough {w.name} does not hold: {e}", file=sys.stderr)
        return 1
    print("\n" + narrator.pick(f"{len(narrator.checks)} checks passed; diagrams in {narrator.out_dir}",
                                 f"{len(narrator.checks)} 项检查全部通过；图在 {narrator.out_dir}"))
    return 0
