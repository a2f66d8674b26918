"""The package's import graph: no cycles, counting imports inside functions and TYPE_CHECKING blocks too
(a lazy import still ties two modules together for whoever reads or moves them)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cli"


def imports_of(path: Path) -> set[str]:
    """The dflash_cli modules `path` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dflash_cli":
            if node.module == "dflash_cli":  # `from dflash_cli import bench`
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dflash_cli."))
    return found


def import_graph() -> dict[str, set[str]]:
    """Modules and subpackages (a subpackage is one node: the imports of all its files)."""
    modules = {path.stem: [path] for path in PACKAGE.glob("*.py")}
    modules |= {init.parent.name: sorted(init.parent.glob("*.py")) for init in PACKAGE.glob("*/__init__.py")}
    return {
        name: set().union(*(imports_of(path) for path in paths)) & modules.keys() - {name}
        for name, paths in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def subpackage_graph(name: str) -> dict[str, set[str]]:
    """The files of subpackage `name` as nodes: a cycle between two files of one subpackage is still a cycle."""
    prefix = f"dflash_cli.{name}"
    files = {path.stem: path for path in (PACKAGE / name).glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for stem, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == prefix:  # `from dflash_cli.engine import target`
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix + "."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names if a.name.startswith(prefix + "."))
        graph[stem] = found & files.keys() - {stem}
    return graph


def test_no_import_cycles_between_the_files_of_a_subpackage() -> None:
    subpackages = [init.parent.name for init in PACKAGE.glob("*/__init__.py")]
    assert "engine" in subpackages
    for name in subpackages:
        graph = subpackage_graph(name)
        assert graph, name
        cycle = find_cycle(graph)
        assert cycle is None, f"{name}: " + " -> ".join(cycle or [])
    assert "target" in subpackage_graph("engine")["loop"]  # the graph sees the imports it is meant to see


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_shared_values_and_machine_facts_sit_at_the_bottom() -> None:
    graph = import_graph()
    assert graph["choices"] <= {"errors"}
    assert graph["hardware"] <= {"choices", "errors"}  # machine facts know nothing of recipes or plans
    assert "planning" not in graph["recipes"] and "hardware" not in graph["recipes"]
