"""The docs point at things that exist: files named in docs/architecture.md and its
graph, the tutorial sections cited as docs/seeds.md §An / §Bn; and the code keeps to the
style rule that no function in sglite/ runs over 60 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def _named_paths(text: str, short: bool = False) -> set[str]:
    """Repository paths a doc names (``short``: also managers/x.py etc., under sglite/)."""
    found = set(re.findall(r"(?:sglite|walkthroughs|tui|tracing|benchmarks|docs)/[\w/]*\w(?:\.\w+)?", text))
    if short:
        found |= {"sglite/" + p for p in re.findall(r"(?<![\w/])((?:managers|mem_cache|model_executor)/\w+\.py)", text)}
    return found


def test_architecture_doc_names_existing_files():
    doc = (ROOT / "docs/architecture.md").read_text()
    dot = (ROOT / "docs/architecture.dot").read_text()
    paths = _named_paths(doc) | _named_paths(dot, short=True)  # the table's short paths are SGLang's
    assert len(paths) > 15
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
    assert (ROOT / "docs/architecture.svg").read_text().count("<g id=\"node") >= 12


def test_every_tutorial_reference_resolves():
    headings = set(re.findall(r"^### (§[AB]\d+)\b", (ROOT / "docs/seeds.md").read_text(), re.M))
    assert {f"§A{i}" for i in range(1, 7)} <= headings and {f"§B{i}" for i in range(1, 15)} <= headings
    cited: dict[str, set[str]] = {}
    files = [p for d in ("sglite", "walkthroughs", "tests", "docs", "tui", "tracing", "benchmarks")
             for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")] + [ROOT / "README.md"]
    for path in files:
        text = path.read_text()
        assert not re.search(r"(?i)\bseed 00[04]\b", text), f"{path}: cite docs/seeds.md §An/§Bn instead"
        for ref in re.findall(r"§[AB]\d+", text):
            cited.setdefault(ref, set()).add(path.name)
    assert cited, "nothing cites the tutorials"
    unknown = {ref: sorted(names) for ref, names in cited.items() if ref not in headings}
    assert not unknown, unknown


def test_no_function_in_sglite_is_longer_than_60_lines():
    long = []
    for path in (ROOT / "sglite").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_reliability_doc_lists_every_case_the_tests_try():
    from tests.managers.test_reliability import BAD_REQUESTS, BAD_SERVER_ARGS
    from tests.test_cli_errors import BAD_COMMANDS

    doc = (ROOT / "docs/reliability.md").read_text()
    rows = re.findall(r"^\| \d+ \|", doc, re.M)
    assert len(rows) >= 60 and len(rows) == len(BAD_REQUESTS) + len(BAD_SERVER_ARGS) + len(BAD_COMMANDS)
    for what, _, message in BAD_REQUESTS + BAD_SERVER_ARGS + BAD_COMMANDS:
        assert what.replace("|", "\\|") in doc and message in doc, what
