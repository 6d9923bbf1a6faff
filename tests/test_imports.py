"""The `testbed` package's import structure, read from the source with `ast` (nothing is imported): no import
cycles, counting imports inside functions, and library code never imports the command layer.

Pure logic: runs without root and without the conftest fixtures that need it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "testbed"
# The command layers: they may import testbed.cli (its exit codes, its main); nothing else may.
COMMAND_LAYER = {"testbed.cli", "testbed.__main__", "testbed.experiments.cli", "testbed.runtime.image_cli"}


def module_files(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is named by its __init__)."""
    out = {}
    root = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of `from ... import` (relative levels resolved against the importing module)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(package):
        raise ValueError(f"{module}: relative import beyond the top-level package (line {node.lineno})")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict) -> str | None:
    """The longest prefix of `name` that is one of our modules (`import a.b.c` of a function-less name)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict) -> dict[str, int]:
    """Modules of the package that `module` imports anywhere in its file (module level, functions, methods),
    each with the line of its first import. The implicit import of a parent package's __init__ is not an
    edge: only what the code names is."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            m = _known(t, modules)
            if m is not None and m != module:
                found[m] = min(found.get(m, node.lineno), node.lineno)
    return found


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, dict[str, int]]:
    modules = module_files(package_dir)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colouring nodes)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        colour[m] = GREY
        stack.append(m)
        for dep in sorted(graph.get(m, {})):
            if colour.get(dep, BLACK) == GREY:
                return stack[stack.index(dep):] + [dep]
            if colour.get(dep) == WHITE:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        colour[m] = BLACK
        return None

    for m in sorted(graph):
        if colour[m] == WHITE:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def _describe(graph, cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b} (line {graph[a][b]} of {a})" for a, b in zip(cycle, cycle[1:]))


def test_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "testbed"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    import testbed.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from . import b  # a submodule, not the package\n")
    graph = import_graph(pkg)
    assert graph["testbed.a"] == {"testbed.sub.b": 1}
    assert graph["testbed.sub.b"] == {"testbed.a": 2, "testbed.sub.c": 3}
    assert graph["testbed.sub"] == {}  # the package __init__ imports nothing back: no edge into a cycle
    cycle = find_cycle(graph)
    assert cycle in (["testbed.a", "testbed.sub.b", "testbed.a"],
                     ["testbed.sub.b", "testbed.sub.c", "testbed.sub.b"])


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 20 and "testbed.net" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + _describe(graph, cycle)


def test_only_command_layers_import_the_cli():
    graph = import_graph()
    offenders = sorted(f"{m} (line {deps['testbed.cli']})" for m, deps in graph.items()
                       if "testbed.cli" in deps and m not in COMMAND_LAYER)
    assert not offenders, "library modules importing testbed.cli: " + ", ".join(offenders)


def test_clean_imports_nothing_from_net():
    """Teardown works from the state file alone (Mininet's `mn -c`): clean never needs the orchestration."""
    assert "testbed.net" not in import_graph()["testbed.clean"]


def test_vocabulary_is_at_the_bottom():
    """testbed/vocab.py (the scopes, checksum modes, engines, ... every layer imports) imports nothing of the
    package, so any module may import it without a cycle."""
    assert import_graph()["testbed.vocab"] == {}
