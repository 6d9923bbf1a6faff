"""Count the vocabulary written out as literals in testbed/: the scopes, checksum modes, element types, engines,
guards, ... each a set of names that should be defined once (testbed/vocab.py) and imported everywhere else.

    python benchmarks/count_vocabulary.py [REV]

REV: a git revision to read testbed/ from (default: the working tree). A literal is a tuple, list or set of
constants (a `Literal[...]` too) whose values (None left out) are exactly one of the sets below; a dict keyed by
exactly such a set (data per name: a mode's published BER, a type's bit layout) is listed as a table, not
counted, but in testbed/vocab.py, where it is the definition. Also counted: copies of a training setting's default (a parameter default, a dict entry, an `or`
fallback, a keyword argument or an `x if ... is None` naming the setting with its default value; the defaults are
read from testbed/train/settings.py of the working tree, the one place that may write them), `DEFAULT_RECIPE =`
assignments, and "seq_len None means the model's context" fallbacks (an `or`/`if` with both seq_len and
n_positions or the context). Prints each set's places; "repeats" is the count beyond the first place.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import MISSING
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VOCABULARY = {
    "scopes": {"payload", "all", "tensor"},
    "checksum modes": {"fix", "keep"},
    "element types / wire dtypes": {"fp32", "bf16", "fp16"},
    "torch dtype names": {"float32", "bfloat16", "float16"},
    "engines": {"nfqueue", "bpf"},
    "engine choices": {"nfqueue", "bpf", "auto"},
    "protect fields": {"sign", "exponent", "mantissa"},
    "modes": {"ddp", "pp"},
    "guards": {"skip", "stop", "none", "sanitize"},
    "latency BERs": {0.0, 1e-6, 1e-5},
}
# training settings whose defaults are too common a value to tell a copy from a coincidence (seed=0, ...), and
# settings named like other things (a remote command's timeout, a tensor's device)
UNWATCHED_DEFAULTS = (0, 1, True, False, None, MISSING)
UNWATCHED_SETTINGS = {"timeout", "device", "seed"}


def sources(rev: str | None) -> dict[str, str]:
    """testbed/**/*.py: path -> text, at `rev` or in the working tree."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "testbed").rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "testbed/"],
                           check=True, capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def _constants(nodes) -> set | None:
    """The values of a sequence of constant nodes (None left out), or None when one is not a constant."""
    out = set()
    for n in nodes:
        if not isinstance(n, ast.Constant) or isinstance(n.value, bool):
            return None
        if n.value is not None:
            out.add(n.value)
    return out


def _value(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return MISSING


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _names(node) -> set[str]:
    """The names a node mentions: identifiers, attributes and string constants."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def _has_constant(node, default) -> bool:
    return any(isinstance(n, ast.Constant) and _same(n.value, default) for n in ast.walk(node))


def default_copies(path: str, tree: ast.AST, defaults: dict) -> set[tuple[str, int, str]]:
    """(path, line, setting) for every place that writes a watched setting's default out."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, d in pairs:
                if arg.arg in defaults and _same(_value(d), defaults[arg.arg]):
                    found.add((path, d.lineno, arg.arg))
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value in defaults and _same(_value(v), defaults[k.value]):
                    found.add((path, k.lineno, k.value))
        elif isinstance(node, ast.keyword) and node.arg in defaults:
            if _has_constant(node.value, defaults[node.arg]):
                found.add((path, node.value.lineno, node.arg))
        elif isinstance(node, (ast.BoolOp, ast.IfExp)):
            parts = node.values if isinstance(node, ast.BoolOp) else [node.test, node.body, node.orelse]
            if isinstance(node, ast.BoolOp) and not isinstance(node.op, ast.Or):
                continue
            mentioned = set().union(*(_names(p) for p in parts if not isinstance(p, ast.Constant)))
            for name in mentioned & defaults.keys():
                if any(isinstance(p, ast.Constant) and _same(p.value, defaults[name]) for p in parts):
                    found.add((path, node.lineno, name))
    return found


def context_fallbacks(path: str, tree: ast.AST) -> set[tuple[str, int]]:
    """`seq_len or <the context>`, and `if <seq_len ...>: ... = <...>.n_positions`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            names = [_names(v) for v in node.values]
            if any("seq_len" in a and any(b & {"n_positions", "context"} for b in names if b is not a)
                   for a in names):
                found.add((path, node.lineno))
        elif isinstance(node, ast.If) and "seq_len" in _names(node.test) \
                and "n_positions" in set().union(*map(_names, node.body)):
            found.add((path, node.lineno))
    return found


def count(texts: dict[str, str], defaults: dict) -> dict[str, list[str]]:
    places, tables = defaultdict(list), defaultdict(list)
    copies, fallbacks = set(), set()
    for path, text in texts.items():
        tree = ast.parse(text, filename=path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = _constants(node.elts)
                for name, vocab in VOCABULARY.items():
                    if values == vocab:
                        places[name].append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Dict) and None not in node.keys:
                keys = _constants(node.keys)
                for name, vocab in VOCABULARY.items():
                    if keys == vocab:  # testbed/vocab.py's tables are the definitions
                        (places if path == "testbed/vocab.py" else tables)[name].append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEFAULT_RECIPE"
                                                    for t in node.targets):
                places["DEFAULT_RECIPE definitions"].append(f"{path}:{node.lineno}")
        if path != "testbed/train/settings.py":
            copies |= default_copies(path, tree, defaults)
        fallbacks |= context_fallbacks(path, tree)
    for path, line, name in sorted(copies):
        places["training defaults copied"].append(f"{path}:{line} ({name})")
    # the definition of the defaults is the dataclass: every copy is a repeat, listed after a placeholder
    places["training defaults copied"].insert(0, "testbed/train/settings.py (TrainSettings)")
    places["seq_len -> model context"] = [f"{p}:{line}" for p, line in sorted(fallbacks)]
    return places, tables


def watched_defaults() -> dict:
    sys.path.insert(0, str(ROOT))
    from testbed.train.settings import described

    return {s.name: s.default for s in described()
            if s.name not in UNWATCHED_SETTINGS and not any(_same(s.default, u) for u in UNWATCHED_DEFAULTS)}


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else None
    places, tables = count(sources(rev), watched_defaults())
    total = 0
    print(f"vocabulary literals in testbed/ at {rev or 'the working tree'}:")
    for name in [*VOCABULARY, "DEFAULT_RECIPE definitions", "training defaults copied", "seq_len -> model context"]:
        where = places.get(name, [])
        repeats = max(len(where) - 1, 0)
        total += repeats
        print(f"  {name}: {len(where)} place(s), {repeats} repeat(s)")
        for w in where:
            print(f"      {w}")
        for w in tables.get(name, []):
            print(f"      {w} (table keyed by them, not counted)")
    print(f"total repeats: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
