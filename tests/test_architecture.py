"""The package's import graph: the layer order of docs/architecture.md, and no cycles between files.

Imports inside functions and TYPE_CHECKING blocks count too: a lazy import still ties two modules together for
whoever reads or moves them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cli"

# Top to bottom. A module imports only from its own layer's package or from a layer below it; two packages on one
# layer (commands and bench) do not import each other.
LAYERS: list[set[str]] = [
    {"cli"},
    {"commands", "bench"},
    {"training"},
    {"loading"},
    {"setup"},
    {"engine"},
    {"protocol"},
    {"errors", "cpu_load", "wording", "progress"},
]
RANK = {package: len(LAYERS) - i for i, layer in enumerate(LAYERS) for package in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The dflash_cli modules `path` imports anywhere in its body (`from a import b` counts a.b when that is a
    module, else a)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dflash_cli":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "dflash_cli")
    return found & known


def imported_roots(source: str) -> set[str]:
    """The top-level names of what `source` imports anywhere in its body (absolute imports only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, set(known)) - {name} for name, path in known.items()}


def layer_of(module: str) -> str | None:
    """The top-level package (or module) a module belongs to; None for the package root (the lazy public API and
    `python -m dflash_cli`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
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


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        own = layer_of(module)
        if own is None:
            continue
        for other in imported:
            theirs = layer_of(other)
            if theirs is None or theirs == own:
                continue
            if RANK[theirs] >= RANK[own]:
                bad.append(f"{module} imports {other}")
    return sorted(bad)


def test_every_package_has_a_layer() -> None:
    packages = {layer_of(name) for name in modules()} - {None}
    assert packages == set(RANK), packages ^ set(RANK)


def test_a_lower_layer_never_imports_a_higher_one() -> None:
    assert layer_violations(import_graph()) == []


def test_no_import_cycles_between_files() -> None:
    graph = import_graph()
    # a package's __init__ re-exports its files; an edge from a file back to its own package's __init__ is the
    # only kind of cycle that is not one (the file is loaded before the name is looked up)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
    assert "dflash_cli.engine.target.attention" in graph["dflash_cli.engine.loop"] | graph["dflash_cli.engine.target"]


def test_the_checks_find_what_they_look_for() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    upward = {
        "dflash_cli.engine.loop": {"dflash_cli.loading.session"},
        "dflash_cli.bench.measure": {"dflash_cli.commands.run"},
    }
    assert layer_violations(upward) == [
        "dflash_cli.bench.measure imports dflash_cli.commands.run",
        "dflash_cli.engine.loop imports dflash_cli.loading.session",
    ]
    assert imported_roots("def main():\n    from benchmarks.gpu_bench import run\n") == {"benchmarks"}


def test_the_package_never_imports_the_lab() -> None:
    """benchmarks/ (the checkout's benchmarks, not in the wheel) uses the package, never the other way round: an
    installed dflash has no `benchmarks` to import."""
    importing = [name for name, path in modules().items() if "benchmarks" in imported_roots(path.read_text("utf-8"))]
    assert importing == []


def test_each_command_has_its_own_cli_module_and_app_only_wires_them() -> None:
    """cli/<command>.py holds one command's typer signature and imports no other command's; cli/app.py registers
    them and holds none."""
    graph = import_graph()
    shared = {"dflash_cli.cli", "dflash_cli.cli.app", "dflash_cli.cli.flags", "dflash_cli.cli.output"}
    commands = {name for name in modules() if name.startswith("dflash_cli.cli.")} - shared
    assert {name.rsplit(".", 1)[1] for name in commands} >= {"chat", "run", "serve", "bench", "doctor", "export"}
    for command in commands:
        assert {other for other in graph[command] if layer_of(other) == "cli"} <= {
            "dflash_cli.cli.flags",
            "dflash_cli.cli.output",
        }, command
    assert commands <= graph["dflash_cli.cli.app"]
    tree = ast.parse(modules()["dflash_cli.cli.app"].read_text(encoding="utf-8"))
    decorated = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.decorator_list]
    assert decorated == ["_main"]  # the group's callback (--version); no command is defined in app.py


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/helpers/ (and conftest.py's fixtures): a test module imported by another
    would run its tests' setup twice and tie two files together for whoever moves one."""
    tests = Path(__file__).resolve().parent
    names = {path.stem for path in tests.rglob("test_*.py")}
    importing = [
        path.relative_to(tests).as_posix()
        for path in tests.rglob("*.py")
        if imported_roots(path.read_text("utf-8")) & names
    ]
    assert importing == []
    assert imported_roots("from test_serve import server\n") & names == {"test_serve"}


def test_the_request_format_and_the_engine_stay_low() -> None:
    graph = import_graph()
    for module, imported in graph.items():
        if layer_of(module) == "protocol":  # torch-free: the CLI reads requests before any model loads
            source = modules()[module].read_text(encoding="utf-8")
            assert "import torch" not in source and "transformers" not in source, module
        if layer_of(module) == "engine":
            below = {"engine", "protocol", "errors", "cpu_load", "wording"}
            assert {layer_of(other) for other in imported} <= below, module
    assert {layer_of(other) for other in graph["dflash_cli.setup.hardware"]} <= {"setup", "errors"}
    assert "dflash_cli.setup.planning" not in graph["dflash_cli.setup.recipes"]
