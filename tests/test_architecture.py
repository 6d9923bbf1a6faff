"""The architecture of docs/architecture.md, kept true: every import between the package's parts is one its
table allows, no caller asks which kind of testbed it holds, no code outside testbed/engine/ compares an engine
name, and no module reaches into another's private names. Read from the source with `ast` (nothing is
imported); imports inside functions count.

Pure logic: runs without root. `python tests/test_architecture.py` prints the counts the rules keep at zero."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_imports import PACKAGE_DIR, import_graph, module_files  # noqa: E402

DOC = PACKAGE_DIR.parent / "docs" / "architecture.md"
# Where the kinds of testbed may be named: the factory, and the kinds themselves.
KIND_AWARE = ("testbed.testbeds", "testbed.net", "testbed.machines")
KIND_NAMES = {"Testbed", "ClusterTestbed", "cluster_of"}


def layer_table(doc: Path = DOC) -> dict[str, tuple[list[str], list[str]]]:
    """The doc's table: part -> (its modules: `x.py` and `testbed` name one module, `x/` a package and all its
    modules, as dotted names with a trailing "." for packages; the parts it may import, ["*"] for anything)."""
    rows = {}
    for line in doc.read_text().splitlines():
        m = re.match(r"^\|\s*\*\*(\w+)\*\*\s*\|([^|]*)\|[^|]*\|([^|]*)\|\s*$", line)
        if not m:
            continue
        mods = []
        for x in re.findall(r"`([\w./]+)`", m.group(2)):
            if x == "testbed":
                mods.append("testbed")
            elif x.endswith("/"):
                mods.append("testbed." + x.rstrip("/").replace("/", ".") + ".")
            else:
                mods.append("testbed." + x.removesuffix(".py").replace("/", "."))
        may = m.group(3)
        rows[m.group(1)] = (mods, ["*"] if "anything" in may else re.findall(r"\*\*(\w+)\*\*", may))
    return rows


def part_of(module: str, table) -> str | None:
    """The part a module belongs to (the longest of its entries that names it), or None."""
    best = None
    for part, (entries, _) in table.items():
        for e in entries:
            hit = module.startswith(e) or module == e.rstrip(".") if e.endswith(".") else module == e
            if hit and (best is None or len(e) > len(best[1])):
                best = (part, e)
    return best[0] if best else None


def layer_violations(graph=None, table=None) -> list[str]:
    graph = import_graph() if graph is None else graph
    table = layer_table() if table is None else table
    out = []
    for m, deps in sorted(graph.items()):
        pm = part_of(m, table)
        if pm is None:
            out.append(f"{m}: in no part of docs/architecture.md")
            continue
        allowed = table[pm][1]
        for d, line in sorted(deps.items()):
            pd = part_of(d, table)
            if pd != pm and "*" not in allowed and pd not in allowed:
                out.append(f"{m} (part {pm}) imports {d} (part {pd}) at line {line}")
    return out


def _trees():
    for mod, path in module_files().items():
        yield mod, path, ast.parse(path.read_text(), filename=str(path))


def kind_branches() -> list[str]:
    """Code outside the factory and the kinds that names a kind of testbed, or asks an object whether it is one
    (isinstance/hasattr on `tb`)."""
    out = []
    for mod, path, tree in _trees():
        if mod.startswith(KIND_AWARE):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("testbed.net", "testbed.machines")):
                out += [f"{mod}:{n.lineno}: imports {a.name}" for a in n.names if a.name in KIND_NAMES]
            elif isinstance(n, ast.Attribute) and n.attr in KIND_NAMES - {"Testbed"}:
                out.append(f"{mod}:{n.lineno}: uses {n.attr}")
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "hasattr")
                  and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in ("tb", "testbed", "proc")):
                out.append(f"{mod}:{n.lineno}: {n.func.id}({n.args[0].id}, ...)")
    return out


def engine_name_comparisons() -> list[str]:
    """`x == "bpf"`, `x != "nfqueue"`, `x in ("nfqueue", "bpf", ...)` outside testbed/engine/."""
    out = []
    for mod, path, tree in _trees():
        if mod.startswith("testbed.engine"):
            continue
        for n in ast.walk(tree):
            if not isinstance(n, ast.Compare):
                continue
            values = set()
            for side in [n.left, *n.comparators]:
                consts = [side] if isinstance(side, ast.Constant) else (
                    list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])
                values |= {c.value for c in consts if isinstance(c, ast.Constant)}
            text = ast.unparse(n)
            # "auto" is also other settings' word (an image base, a VM accelerator): an engine's only beside one
            if values & {"nfqueue", "bpf"} or ("auto" in values and re.search(r"engine|kind", text)):
                out.append(f"{mod}:{n.lineno}: {text}")
    return out


def private_cross_module() -> list[str]:
    """A module using another module's private name: `from x import _name`, `mod._name` of an imported testbed
    module, or `obj._name` where only another module defines `_name`."""
    trees = list(_trees())
    defined: dict[str, set[str]] = {}
    for mod, _, tree in trees:
        names = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
        defined[mod] = {x for x in names if x.startswith("_") and not x.startswith("__")}
    out = []
    for mod, _, tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("testbed"):
                out += [f"{mod}:{n.lineno}: from {n.module} import {a.name}" for a in n.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                  and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                  and n.attr not in defined[mod] and any(n.attr in d for m, d in defined.items() if m != mod)):
                out.append(f"{mod}:{n.lineno}: {ast.unparse(n)}")
    return out


def test_every_module_is_in_one_part_and_imports_only_what_its_part_may():
    table = layer_table()
    assert len(table) >= 10, f"docs/architecture.md's table not found or too short: {sorted(table)}"
    problems = layer_violations(table=table)
    assert not problems, "imports that docs/architecture.md does not allow:\n  " + "\n  ".join(problems)


def test_the_rules_catch_a_forbidden_import():
    table = {"low": (["testbed.a"], []), "high": (["testbed.b."], ["low"])}
    assert layer_violations({"testbed.a": {}, "testbed.b.x": {"testbed.a": 1}}, table) == []
    assert layer_violations({"testbed.a": {"testbed.b.x": 3}, "testbed.b.x": {}}, table) == [
        "testbed.a (part low) imports testbed.b.x (part high) at line 3"]
    assert layer_violations({"testbed.c": {}}, table) == ["testbed.c: in no part of docs/architecture.md"]


def test_no_caller_asks_which_kind_of_testbed_it_holds():
    found = kind_branches()
    assert not found, "testbed-kind branches outside testbed/testbeds.py:\n  " + "\n  ".join(found)


def test_no_engine_name_is_compared_outside_the_engines():
    found = engine_name_comparisons()
    assert not found, "engine names compared outside testbed/engine/:\n  " + "\n  ".join(found)


def test_no_module_uses_another_modules_private_names():
    found = private_cross_module()
    assert not found, "private names used across modules:\n  " + "\n  ".join(found)


def test_the_registered_engines_are_the_vocabulary():
    """Engine names are one fact: the kinds that register themselves are testbed/vocab.py's (which the
    topology schema, written before any kind is imported, offers with auto)."""
    from testbed import vocab
    from testbed.engine.registry import engine_choices, engine_names

    assert tuple(engine_names()) == vocab.ENGINES and tuple(engine_choices()) == vocab.ENGINE_CHOICES


def top_level_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE_DIR.glob("*.py"))


if __name__ == "__main__":
    for name, found in (("layer violations", layer_violations()), ("testbed-kind branches", kind_branches()),
                        ("engine-name comparisons outside testbed/engine/", engine_name_comparisons()),
                        ("private cross-module names", private_cross_module())):
        print(f"{name}: {len(found)}")
        for f in found:
            print(f"  {f}")
    print(f"modules at testbed/'s top level: {len(top_level_modules())} ({', '.join(top_level_modules())})")
