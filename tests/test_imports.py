"""The import graph of the serving packages: no circles, and the planes import downwards.

Every module under models/, runtime/, sessions/ and web/ is parsed (never imported) and each of
its `import` / `from ... import` statements becomes an edge to the module it names (`from P
import x` names P.x when that is a module, else P). Imports inside functions count too: a lazy
import that closes a circle still couples the two modules, it only hides the circle from Python.
Imports under `if TYPE_CHECKING:` do not count (they never run). A package's `__init__` is the
node of the package itself; importing a submodule adds no edge to its parents.

Planes: web -> sessions -> runtime -> models (a plane imports its own or a lower plane only).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANES = ("models", "runtime", "sessions", "web")  # lowest first


@dataclass(frozen=True)
class Edge:
    """One import statement: `source` imports `target` at `line`."""

    source: str
    target: str
    line: int


def module_names() -> dict[str, Path]:
    """Module name -> file, for every module of the planes (a package is its __init__)."""
    names: dict[str, Path] = {}
    for plane in PLANES:
        for path in sorted((ROOT / plane).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def edges(names: dict[str, Path]) -> list[Edge]:
    """The import edges between the planes' modules (imports of anything else are dropped)."""
    out: list[Edge] = []
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            for target in targets:
                # `import a.b.c` of a module outside the planes, or a name inside a module: the
                # longest prefix that is one of ours
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.append(Edge(name, target, node.lineno))
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph_of(all_edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.source, set()).add(e.target)
    return graph


def test_the_walk_sees_the_planes_and_their_imports():
    names = module_names()
    assert {"models.registry", "runtime.engine", "sessions.manager", "web.cli"} <= set(names)
    found = {(e.source, e.target) for e in edges(names)}
    assert ("runtime.engine", "models.registry") in found  # a module-level import
    assert ("web.cli", "models.registry") in found  # a lazy one, inside a function


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    all_edges = edges(module_names())
    found = circles(graph_of(all_edges))
    lines = []
    for component in found:
        members = set(component)
        lines += sorted(
            {f"{e.source}:{e.line} -> {e.target}" for e in all_edges if {e.source, e.target} <= members}
        )
    assert not found, "import circles:\n" + "\n".join(lines)


def upward(all_edges: list[Edge]) -> list[str]:
    """The edges from a plane to a higher one (models -> runtime, runtime -> web, ...)."""
    rank = {plane: i for i, plane in enumerate(PLANES)}
    return [
        f"{e.source}:{e.line} imports {e.target}"
        for e in all_edges
        if rank[e.target.split(".")[0]] > rank[e.source.split(".")[0]]
    ]


def test_upward_imports_are_found():
    assert upward([Edge("models.world", "runtime.engine", 3), Edge("web.app", "models.registry", 4)]) == [
        "models.world:3 imports runtime.engine"
    ]


def test_planes_import_downwards():
    found = upward(edges(module_names()))
    assert not found, "imports against the planes (web > sessions > runtime > models):\n" + "\n".join(found)
