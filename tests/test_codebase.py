"""The codebase's shape (issue 12): gpulab's top-level units (packages and modules under
src/gpulab) import one another one way only - no cycle of any length. Run in the default suite,
so CI checks it on every change."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "gpulab"


def unit_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def imported_units(path: Path) -> set[str]:
    """The gpulab units a file imports, at any depth in the file (lazy imports count too)."""
    package = ["gpulab", *path.relative_to(SRC).parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from gpulab import devices` imports the unit `devices`
            modules = [f"{module}.{a.name}" for a in node.names] if module == "gpulab" else [module]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "gpulab" and len(parts) > 1 and parts[1] not in ("__init__", "__main__"):
                found.add(parts[1])
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        unit = unit_of(path)
        graph.setdefault(unit, set()).update(imported_units(path) - {unit})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (a path that returns to its start), by depth-first search, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_gpulab_s_own_imports():
    # The graph must see what the code imports however it is written.
    graph = import_graph()
    assert "parallel" in graph["train"] and "devices" in graph["parallel"]


def test_gpulab_s_units_import_one_way():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle between gpulab's units: " + " -> ".join(cycle)
