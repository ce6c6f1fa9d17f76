"""The package graph of megarl has no cycle: every import of a megarl module, at module or
function level (parsed with ``ast``, nothing imported), is an arrow between top-level
subpackages (``megarl.engines``, ``megarl.checkpoint``, ...; a top-level module such as
``megarl/registry.py`` counts as its own), and those arrows all run one way."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"


def _unit(module: str) -> str:
    """The top-level subpackage (or module) a dotted ``megarl.x.y`` module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megarl"


def _module_name(path: Path) -> Tuple[str, bool]:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imported(node: ast.AST, module: str, is_package: bool) -> List[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolved against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # ``from megarl import tasks`` names a subpackage
        if target == "megarl":
            return [f"megarl.{alias.name}" for alias in node.names]
        return [target]
    return []


def import_graph() -> Dict[str, Dict[str, List[str]]]:
    """unit -> {imported unit: the places ("megarl/x.py:line") that import it}."""
    graph: Dict[str, Dict[str, List[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_package = _module_name(path)
        source = _unit(module)
        graph.setdefault(source, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, is_package):
                if target.split(".")[0] != "megarl" or _unit(target) == source or target == "megarl":
                    continue
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                graph[source].setdefault(_unit(target), []).append(where)
    return graph


def find_cycle(graph: Dict[str, Dict[str, List[str]]]) -> Optional[List[str]]:
    """One cycle as [a, b, ..., a], or None (depth-first search)."""
    state: Dict[str, int] = {}  # 1 on the stack, 2 done
    stack: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_names_the_cycle():
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ["x"]}, "b": {}}) is None


def test_no_cycle_between_subpackages():
    graph = import_graph()
    assert {"engines", "checkpoint", "models", "tasks", "registry"} <= set(graph)
    cycle = find_cycle(graph)
    if cycle:
        arrows = [f"  {a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between megarl subpackages " + " -> ".join(cycle) + ":\n"
                             + "\n".join(arrows))


ENTRY_POINTS = ("launch", "benchmarks", "checkpoint_tools", "tests")


def test_library_imports_no_entry_points():
    """megarl never imports launch/, benchmarks/, checkpoint_tools/ or tests/ (STYLE.md: library below, entry
    points above)."""
    offenders: Set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders.update(f"{path}: {n}" for n in names if n.split(".")[0] in ENTRY_POINTS)
    assert not offenders, sorted(offenders)
