"""bigtrain's import graph has no circle: no module imports itself through others, and no package of bigtrain/
imports one that imports it back (an import running back up). Imports inside functions count: they are how a
verb stays light, not a way around the layering. Read from the source (ast), nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bigtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The bigtrain modules `path` imports (a name imported from a package counts as its module when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            found |= subs or {node.module}
    return found - {module_name(path)}


def module_graph() -> dict[str, set[str]]:
    known = modules()
    # a package's __init__ that only hands names on would tie every module of the package to every other
    return {name: {t for t in imported(path, known) if not _face(t, known)}
            for name, path in known.items() if not _face(name, known)}


def _face(name: str, known: dict[str, Path]) -> bool:
    return known[name].name == "__init__.py"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def package_of(module: str) -> str:
    """bigtrain.data.prepare.core -> bigtrain.data (top-level modules are their own package)."""
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_package_imports_one_that_imports_it_back():
    graph: dict[str, set[str]] = {}
    for source, targets in module_graph().items():
        graph.setdefault(package_of(source), set()).update(package_of(t) for t in targets)
    for package, targets in graph.items():
        targets.discard(package)
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
