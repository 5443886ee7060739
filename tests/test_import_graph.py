"""The package's import graph (STYLE habit 16, issue 50): no cycle, and at most seven floors.

Read from the source with ``ast``; nothing is imported. A module is a file of ``grpo_engine``, a
package's ``__init__.py`` standing for the package (``grpo_engine`` itself is the facade). An edge is
every ``import`` / ``from ... import`` of the package anywhere in a file, inside functions too: a lazy
import still runs, and still ties the two files together. ``from a.b import c`` is an edge to ``a.b.c``
when that is a module, else to ``a.b``, whose ``__init__`` runs every import it holds.

One exception: imports in the body of ``if TYPE_CHECKING:`` are left out. ``typing.TYPE_CHECKING`` is
False whenever the program runs, so that block never executes; the names it imports serve only
annotations, which ``from __future__ import annotations`` leaves unevaluated (a test below fails on
any other use). The module neither loads the other nor calls anything of it: it only
reads fields of objects its caller built (``memory/apply.py`` and ``memory/estimate.py`` take a
``MemoryPlan``, ``sampling/static_step.py`` a ``TokenDraw``; none of them builds one).

Floors: a module that imports nothing of the package is floor 1; any other is one floor above the
highest module it imports. Today's top is ``grpo_engine.cli``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_engine"
MAX_FLOORS = 7  # issue 50

Graph = Mapping[str, set[str]]


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_nodes(tree: ast.AST, skip: Set[ast.AST] = frozenset()) -> Iterator[ast.AST]:
    """Every node of ``tree`` but the body of an ``if TYPE_CHECKING:`` (its ``else`` runs, so it stays) and
    the subtrees in ``skip``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if node in skip:
            continue
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [node.test, *node.orelse]
        else:
            stack += ast.iter_child_nodes(node)


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Each module's set of the package's modules it imports (module docstring: which imports count)."""
    top = min(modules, key=len)

    def resolve(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str | None] = set()
        for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {resolve(alias.name) for alias in node.names if alias.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: ``from . import x`` is the importing module's own package
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.split(".")[0] == top:
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        found.add(full if full in modules else resolve(base))
        graph[name] = {dep for dep in found if dep is not None and dep != name}
    return graph


def type_only_names_used_at_run_time(tree: ast.AST) -> set[str]:
    """The names imported under ``if TYPE_CHECKING:`` that the module uses outside an annotation."""
    typed, annotations = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            imports = [sub for stmt in node.body for sub in ast.walk(stmt)
                       if isinstance(sub, (ast.Import, ast.ImportFrom))]
            typed |= {(alias.asname or alias.name).split(".")[0] for sub in imports for alias in sub.names}
        elif isinstance(node, ast.arg) and node.annotation is not None:
            annotations.add(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            annotations.add(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.add(node.annotation)
    return {node.id for node in _run_time_nodes(tree, skip=annotations)
            if isinstance(node, ast.Name) and node.id in typed}


def import_cycles(graph: Graph) -> list[list[str]]:
    """The graph's cycles: each strongly connected group of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for dep in graph.get(name, ()):
            if dep not in index:
                visit(dep)
                low[name] = min(low[name], low[dep])
            elif dep in stack:
                low[name] = min(low[name], index[dep])
        if low[name] == index[name]:
            group = stack[stack.index(name):]
            del stack[stack.index(name):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(cycles)


def floors(graph: Graph) -> dict[str, int]:
    """Each module's floor (module docstring); the graph must have no cycle."""

    @functools.cache
    def floor(name: str) -> int:
        return 1 + max((floor(dep) for dep in graph.get(name, ())), default=0)

    return {name: floor(name) for name in graph}


def longest_chain(graph: Graph, name: str) -> list[str]:
    """The chain of imports that sets ``name``'s floor: each step to the highest module imported."""
    height = floors(graph)
    chain = [name]
    while graph.get(chain[-1]):
        chain.append(max(sorted(graph[chain[-1]]), key=lambda dep: height.get(dep, 1)))
    return chain


GRAPH = import_graph(package_modules())


def _check_floors(limit: int) -> None:
    assert not import_cycles(GRAPH), "an import cycle: floors are undefined (see the cycle test)"
    height = floors(GRAPH)
    over = sorted((name for name in height if height[name] > limit), key=lambda name: (-height[name], name))
    if over:
        chain = longest_chain(GRAPH, over[0])
        pytest.fail(f"{len(over)} module(s) above floor {limit}: "
                    + ", ".join(f"{name} ({height[name]})" for name in over)
                    + f"; the longest chain ({len(chain)} floors): " + " -> ".join(chain)
                    + ". Import the module that defines a name, not a package's __init__; move a helper "
                    "that a low module needs down beside it.")


def test_the_package_has_no_import_cycle():
    cycles = import_cycles(GRAPH)
    assert not cycles, "import cycles (every module of each imports the next, through the others): " + \
        "; ".join(" <-> ".join(group) for group in cycles)


def test_no_module_is_above_seven_floors():
    _check_floors(MAX_FLOORS)


def test_the_graph_is_the_real_one():
    """A vacuous graph would pass: the trainer sits on the loop's components, the CLI on everything."""
    height = floors(GRAPH)
    assert {"grpo_engine.distributed", "grpo_engine.gradients", "grpo_engine.sampling"} <= GRAPH[
        "grpo_engine.trainer"]
    assert "grpo_engine.trainer" in GRAPH["grpo_engine.demo"] and height["grpo_engine.trainer"] >= 5
    assert max(height, key=height.get) == "grpo_engine.cli"


def test_type_checking_imports_serve_only_annotations():
    """What the graph leaves out must run nothing: a name imported under ``if TYPE_CHECKING:`` is used
    in annotations only (elsewhere it would be a NameError at run time, and a hidden edge)."""
    used = {name: found for name, path in package_modules().items()
            if (found := type_only_names_used_at_run_time(ast.parse(path.read_text())))}
    assert not used, f"imported under TYPE_CHECKING but used at run time: {used}"
    toy = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from m import A, B\n"
                    "def f(a: A) -> B:\n    x: A = a\n    return B(x)\n")
    assert type_only_names_used_at_run_time(toy) == {"B"}


def test_the_cycle_finder_names_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}, "f": {"f"}}
    assert import_cycles(graph) == [["a", "b", "c"]]  # d and e hang off it; a self-import is no cycle
    assert import_cycles({"x": {"y"}, "y": {"x"}, "z": {"w"}, "w": {"z"}}) == [["w", "z"], ["x", "y"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond is not a cycle


def test_floors_and_the_longest_chain_of_a_toy_graph():
    graph = {"top": {"mid", "low"}, "mid": {"low"}, "low": set(), "side": {"low"}}
    assert floors(graph) == {"top": 3, "mid": 2, "low": 1, "side": 2}
    assert longest_chain(graph, "top") == ["top", "mid", "low"]


def test_which_imports_are_edges(tmp_path):
    """Lazy, relative and ``from pkg import module`` imports count; ``if TYPE_CHECKING:`` bodies do not."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from toy.high import run\n",
        "low.py": "X = 1\n",
        "typed.py": "",
        "mid.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy import typed\n"
                  "else:\n    import toy.low\n",
        "high.py": "def run():\n    from toy.sub import leaf, NAME\n    from . import mid\n",
        "sub/__init__.py": "NAME = 1\n",
        "sub/leaf.py": "from ..low import X\nimport toy.sub.leaf\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert import_graph(package_modules(pkg)) == {
        "toy": {"toy.high"}, "toy.low": set(), "toy.typed": set(), "toy.mid": {"toy.low"},
        "toy.high": {"toy.sub.leaf", "toy.sub", "toy.mid"}, "toy.sub": set(), "toy.sub.leaf": {"toy.low"},
    }
