"""No import cycles between sgl_atom's folders (module-level and lazy imports alike)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "sgl_atom"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imported(mod: str, path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [name] + [f"{name}.{a.name}" for a in node.names]


def folder_graph() -> dict[str, set[str]]:
    """sgl_atom.<folder or module> -> the others it imports from anywhere in its code."""
    mods = _modules()
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _imported(mod, path, node):
                    if name in mods and top(name) not in (top(mod), "sgl_atom"):
                        graph.setdefault(top(mod), set()).add(top(name))
    return graph


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycles_between_folders():
    graph = folder_graph()
    assert "sgl_atom.speculative" in graph.get("sgl_atom.patches", set())  # the graph is real
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a in _reaches(graph, b))
    assert not cycles, cycles
