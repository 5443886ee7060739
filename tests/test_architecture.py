"""The shape the code keeps (docs/architecture.md), checked on the source: a trainer that reads in one
sitting, infrastructure that never reaches into components or privates (the import graph's cycles and
floors: tests/test_import_graph.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_engine"
INFRASTRUCTURE = ("grpo_engine.distributed", "grpo_engine.world", "grpo_engine.checkpoint",
                  "grpo_engine.guards")
COMPONENTS = ("grpo_engine.losses", "grpo_engine.rewards", "grpo_engine.advantages", "grpo_engine.entropy",
              "grpo_engine.sampling", "grpo_engine.data", "grpo_engine.presets")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, *, everywhere: bool) -> set[str]:
    """The package modules ``name`` imports: at module level, or ``everywhere`` (inside functions too)."""
    tree = ast.parse(MODULES[name].read_text())
    nodes = ast.walk(tree) if everywhere else tree.body
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {_resolve(alias.name) for alias in node.names if alias.name.startswith("grpo_engine")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_engine"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else _resolve(node.module))
    return found - {name, "grpo_engine"}  # the root package is the curated facade over everything


def _resolve(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def test_the_trainer_reads_in_one_sitting():
    source = (PACKAGE / "trainer.py").read_text()
    assert len(source.splitlines()) <= 400
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 50}
    assert not long, f"functions over 50 lines: {long}"


def test_the_trainer_reads_only_what_the_protocols_declare():
    calls = [node.func.id for node in ast.walk(ast.parse((PACKAGE / "trainer.py").read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    assert "getattr" not in calls and "hasattr" not in calls


@pytest.mark.parametrize("module", INFRASTRUCTURE)
def test_infrastructure_imports_no_component(module):
    reached = _imports(module, everywhere=True)
    assert not [name for name in reached if name.startswith(COMPONENTS)], reached


def test_checkpoints_read_no_private_attribute_of_another_object():
    tree = ast.parse((PACKAGE / "checkpoint.py").read_text())
    private = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and node.attr.startswith("_") and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not private, private


def test_no_line_of_the_package_is_over_110_characters():
    long = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 110]
    assert not long, long
