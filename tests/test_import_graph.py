"""The core package's import graph: no cycles, and no imports of plugins, kernels or contrib packages.

Read from the source with ``ast``, nothing is imported. For cycles, an edge is
any import statement that can run: at module level, in ``try`` and class
bodies, and inside functions too. A function-local import runs when the
function is first called rather than when its module is imported, but it ties
the two modules together all the same: a cycle closed by one is a cycle in the
design, hidden from the interpreter, not removed (fix it by moving code to the
module it belongs to). Only imports under ``if TYPE_CHECKING:`` are not edges:
they never run (their ``else:`` does, and counts). ``from a.b import c``
points at ``a.b.c`` when that is a module, else at ``a.b``; parent packages are
not edges (every submodule would otherwise meet ``tokenmill/__init__.py``).
Imports by name at run time (``importlib``, the plugin registry's
``module:Class`` paths) are not statements, and are not seen.

The core reaches plugins only through hooks (STYLE.md §1), so any import of
them, wherever it stands, fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core"
PACKAGE = "tokenmill"
FORBIDDEN_IN_CORE = {"tokenmill_plugins", "tokenmill_kernels", "contrib"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted((CORE / PACKAGE).rglob("*.py"))}


def _contrib_packages() -> set[str]:
    """Import names of the packages under contrib/ (``src`` layout or flat)."""
    found = set()
    for pattern in ("*/src/*/__init__.py", "*/*/__init__.py"):
        found |= {init.parent.name for init in (REPO / "contrib").glob(pattern) if init.parent.name != "tests"}
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes: Iterable[ast.AST], type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements among ``nodes`` and below, inside functions too; those under ``if TYPE_CHECKING:``
    only with ``type_checking``."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, type_checking)  # the ``else:`` of ``if TYPE_CHECKING`` runs
        else:
            yield from _imports(ast.iter_child_nodes(node), type_checking)


def _source_module(statement: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved against ``module``."""
    if not statement.level:
        return statement.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (statement.level - 1)]
    return ".".join([*anchor, statement.module] if statement.module else anchor)


def _imported_modules(statement: ast.Import | ast.ImportFrom, module: str, path: Path, known: set[str]) -> set[str]:
    """What ``statement`` imports: ``from a import b`` gives ``a.b`` when that is a known module, else ``a``."""
    if isinstance(statement, ast.Import):
        return {alias.name for alias in statement.names}
    source = _source_module(statement, module, path.name == "__init__.py")
    return {f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in statement.names}


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the core modules it imports, wherever in it (but under ``if TYPE_CHECKING:``)."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for statement in _imports(tree.body, type_checking=False):
            edges |= _imported_modules(statement, module, path, known)
        graph[module] = (edges & known) - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself (breadth first)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target not in previous:
                    previous[target] = node
                    next_frontier.append(target)
        frontier = next_frontier
    raise AssertionError(f"no cycle in component {component}")


def _assert_no_cycles(graph: dict[str, set[str]]) -> None:
    cycles = _cycles(graph)
    assert not cycles, "import cycles in core/tokenmill (imports in functions count):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )


def test_core_has_no_import_cycles() -> None:
    _assert_no_cycles(_import_graph(_core_modules()))


def test_core_imports_no_plugins_kernels_or_contrib() -> None:
    forbidden = FORBIDDEN_IN_CORE | _contrib_packages()
    assert "tokenmill_eager_attention" in forbidden  # the contrib scan finds the packages there
    found = []
    for module, path in _core_modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement in _imports(tree.body, type_checking=True):  # anywhere: functions and TYPE_CHECKING too
            for name in _imported_modules(statement, module, path, set()):
                if name.split(".")[0] in forbidden:
                    found.append(f"  {path.relative_to(REPO)}:{statement.lineno} imports {name}")
    assert not found, "core reaches plugins only through hooks:\n" + "\n".join(sorted(set(found)))


def test_the_checker_sees_cycles_and_skips_what_does_not_run(tmp_path: Path) -> None:
    source = {
        "a": "from tokenmill.b import thing\n",
        "b": "import tokenmill.c\n",
        "c": "from . import a\n",
        "d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokenmill import e\n",
        "e": "def f():\n    import tokenmill.d\n",
        # Closed only by imports inside functions (a method, an async function): still a cycle.
        "f": "class Launcher:\n    def start(self):\n        from tokenmill.g import run\n",
        "g": "async def run():\n    from . import f\n",
    }
    modules = {}
    for name, text in source.items():
        path = tmp_path / PACKAGE / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        modules[f"{PACKAGE}.{name}"] = path
    graph = _import_graph(modules)
    assert graph["tokenmill.d"] == set() and graph["tokenmill.e"] == {"tokenmill.d"}
    assert _cycles(graph) == [
        ["tokenmill.a", "tokenmill.b", "tokenmill.c", "tokenmill.a"],
        ["tokenmill.f", "tokenmill.g", "tokenmill.f"],
    ]
    with pytest.raises(AssertionError, match="tokenmill.f -> tokenmill.g -> tokenmill.f"):
        _assert_no_cycles(graph)
