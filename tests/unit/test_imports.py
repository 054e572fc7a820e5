"""The repository's import graph has no circle: no module imports itself through others, and no package of bigtrain/
imports one that imports it back (an import running back up). Imports inside functions count: they are how a
verb stays light, not a way around the layering. The whole tree is read: bigtrain/, and the scripts and test
files that import one another as top-level modules (scripts/ from its own folder, tests' helpers from tests/).
Read from the source (ast), nothing imported."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "bigtrain"
# Folders of plain files, each imported by its file name from its own folder (a script's folder is on sys.path when
# it runs) and, under tests/, from tests/ too (tests/conftest.py and the dist scripts put it on sys.path).
LOOSE = ("scripts", "tests", "tests/unit", "tests/dist", "tests/dist_scripts")


def module_name(path: Path) -> str:
    """bigtrain/data/prepare/core.py -> bigtrain.data.prepare.core; scripts/gpu_journeys.py -> scripts.gpu_journeys."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for folder in LOOSE:
        found |= {module_name(p): p for p in (REPO / folder).glob("*.py")}
    return found


def resolve(name: str, path: Path, known: dict[str, Path]) -> str | None:
    """The module `import name` in `path` loads: bigtrain's by its dotted name; a top-level name from the importer's
    own folder, then (under tests/) from tests/."""
    if name.split(".")[0] == "bigtrain":
        return name if name in known else None
    if path.is_relative_to(PACKAGE) or "." in name:
        return None
    folders = [path.parent] + ([REPO / "tests"] if path.is_relative_to(REPO / "tests") else [])
    return next((module_name(f / f"{name}.py") for f in folders if module_name(f / f"{name}.py") in known), None)


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the tree `path` imports (a name imported from a package counts as its module when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {m for a in node.names if (m := resolve(a.name, path, known))}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = resolve(node.module, path, known)
            if module is None:
                continue
            subs = {f"{module}.{a.name}" for a in node.names} & set(known)
            found |= subs or {module}
    return found - {module_name(path)}


@functools.cache
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
    """bigtrain.data.prepare.core -> bigtrain.data (top-level modules are their own package); a script or a test
    file is its own."""
    return ".".join(module.split(".")[:2]) if module.startswith("bigtrain.") else module


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


def test_the_whole_tree_is_read():
    """Scripts and tests are in the graph, their imports of one another resolved (else a circle there hides)."""
    graph = module_graph()
    assert {"scripts.gpu_journeys", "tests.launch", "tests.dist_scripts.hf_runs", "tests.unit.test_imports"} <= set(graph)
    assert "scripts.bench_packing" in graph["scripts.gpu_journeys"]  # scripts/ from its own folder
    assert any("tests.launch" in targets for name, targets in graph.items() if name.startswith("tests.dist."))
    assert "bigtrain.atomic" in graph["scripts.bench_prepare"]


def test_a_package_map_names_only_modules_that_exist():
    """The file table in a package's docstring (`runner.py   one evaluation ...`) lists files that are there."""
    for init in PACKAGE.rglob("__init__.py"):
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in re.findall(r"^\s+([\w/]+\.py)\s", text, re.M):
            assert (init.parent / name).is_file() or (REPO / name).is_file(), \
                f"{init.relative_to(REPO)} lists {name}, which is not there"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
