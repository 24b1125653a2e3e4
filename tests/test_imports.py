"""sglite's modules import each other in one direction: the import graph at import
time (module-level imports, not those under ``if TYPE_CHECKING`` or inside functions)
has no cycle. Type-only imports may point back up, as SGLang's own do (e.g.
forward_batch_info names ModelWorkerBatch and ModelRunner for its signatures)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sglite"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """Modules of sglite imported at module level (top level, or under try/if other
    than ``if TYPE_CHECKING``)."""
    found: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            stack.extend(s for h in getattr(node, "handlers", []) for s in h.body)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or ({node.module} & modules)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    names = set(paths)
    return {m: _runtime_imports(ast.parse(p.read_text()), names) - {m} for m, p in paths.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None: depth-first search."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_runtime_import_graph_has_no_cycle():
    graph = _import_graph()
    assert len(graph) > 50  # the walk found the package
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_forward_batch_info_sits_below_the_scheduler():
    """ForwardMode/ForwardBatch are read by the scheduler, layers and backends: at import
    time they need nothing from sglite above them."""
    graph = _import_graph()
    assert graph["sglite.model_executor.forward_batch_info"] <= {"sglite.mem_cache.memory_pool"}
