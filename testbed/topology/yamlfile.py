"""Reading the project's YAML input files (topologies, experiments) so that bad input gets a clear error.

`read_yaml(path)` parses a file with duplicate keys refused and remembers the line of every field path
(`topology.links[0].ber` -> 8); `InputError` renders problems as `FILE:LINE: FIELD: PROBLEM`, one per line,
in file order. `YamlDocument.validate(model)` runs a pydantic model over the data and reports its errors that
way. Pure: nothing here touches the system but reading the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class InputError(Exception):
    """Bad input file. `problems` is a list of (field path, message), `lines` maps field paths to line
    numbers; str() is the full report."""

    def __init__(self, file: str | Path | None, problems: list[tuple[str, str]], lines: dict[str, int] | None = None):
        self.file = str(file) if file is not None else "<input>"
        self.problems = list(dict.fromkeys(problems))  # e.g. both directions of a link report the same problem
        self.lines = lines or {}
        super().__init__(self.render())

    def line_of(self, path: str) -> int | None:
        """The line of field `path`, else of its closest parent in the file (a missing key: the mapping that
        lacks it); None when the problem has no place in a file."""
        while path not in self.lines and path:
            path = path[:max(path.rfind("."), path.rfind("["), 0)]
        return self.lines.get(path)

    def render(self) -> str:
        out = []
        for path, msg in sorted(self.problems, key=lambda p: self.line_of(p[0]) or 0):
            line = self.line_of(path)
            where = f"{self.file}:{line}" if line else self.file
            out.append(f"{where}: {path}: {msg}" if path else f"{where}: {msg}")
        return "\n".join(out)


@dataclass(frozen=True)
class YamlDocument:
    """A parsed input file: its data and the line of every field path in it."""

    file: str
    data: Any
    lines: dict[str, int]

    def error(self, problems: list[tuple[str, str]]) -> InputError:
        return InputError(self.file, problems, self.lines)

    def validate(self, model: type[Model]) -> Model:
        """The data as `model`, or an InputError naming each bad field's line."""
        try:
            return model.model_validate(self.data)
        except ValidationError as e:
            raise self.error(pydantic_problems(e)) from None


def read_yaml(path: str | Path) -> YamlDocument:
    """Read and parse a YAML file; InputError when it cannot be read, is not YAML, repeats a key or is empty."""
    path = Path(path)
    data, lines = parse_yaml(read_text(path), path)
    return YamlDocument(str(path), data, lines)


def read_text(path: str | Path) -> str:
    """The text of an input file; InputError naming the file when it cannot be read or is not UTF-8 text."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(path, [("", f"cannot read file: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        raise InputError(path, [("", f"not a text file: byte {e.start} is not UTF-8 ({e.reason})")]) from None


# More values than any input file of the project holds; aliases (*name) that expand beyond it are refused
# rather than walked (a few nested aliases can stand for billions of values).
MAX_VALUES = 100_000


def parse_yaml(text: str, path: str | Path | None = None) -> tuple[Any, dict[str, int]]:
    """(data, field path -> line number) of YAML text; `path` names the file in errors."""
    loader = None
    try:
        loader = _UniqueKeyLoader(text)  # refuses characters YAML does not allow (a ReaderError)
        node = loader.get_single_node()
        if node is not None:
            _check_graph(node)
        data = loader.construct_document(node) if node is not None else None
    except RecursionError:  # the composer recurses once per level of nesting
        raise InputError(path, [("", "not valid YAML: nested too deeply")]) from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        what = f"character #x{e.character:04x}" if isinstance(e.character, int) else "byte"
        raise InputError(path, [("", f"not valid YAML: {what} is not allowed ({e.reason})")], {"": line}) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        if mark is None:
            raise InputError(path, [("", f"not valid YAML: {problem}")]) from None
        # the line goes where every error puts it (FILE:LINE:), the column into the message
        raise InputError(path, [("", f"not valid YAML (column {mark.column + 1}): {problem}")],
                         {"": mark.line + 1}) from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        raise InputError(path, [("", "the file is empty")])
    lines: dict[str, int] = {}
    _index_lines(node, "", lines)
    return data, lines


def pydantic_problems(e: ValidationError) -> list[tuple[str, str]]:
    """A pydantic ValidationError as (field path, message) pairs, in words a user of the file understands."""
    problems = []
    for err in e.errors():
        # Drop pydantic's internal union/validator tags from the location.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and the documented fields)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] != "value_error" and "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        problems.append((field_path(loc), msg))
    return problems


def field_path(loc: tuple) -> str:
    """('topology', 'links', 0, 'ber') -> 'topology.links[0].ber', the form errors and the line index use."""
    s = ""
    for part in loc:
        if isinstance(part, int):
            s += f"[{part}]"
        else:
            s += ("." if s else "") + _key(part)
    return s


def _key(key) -> str:
    """A mapping key as a field path writes it: an empty key as '' (else the path would name nothing)."""
    return str(key) if str(key) != "" else "''"


# ----------------------------------------------------------------------------------------------------------
# YAML with duplicate-key detection and line numbers for every field path.


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # A value its tag cannot hold (`!!float abc`, `!!int 1.5`) fails in the constructor with a plain ValueError
        # or TypeError that says neither where nor what: make it a YAML error at the node.
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {node.value!r} as {node.tag.rsplit(':', 1)[-1]}: {e}",
                node.start_mark) from None


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain name, not a {type(key).__name__}", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _check_graph(root: yaml.Node) -> None:
    """Refuse an alias inside what its anchor names (`a: &x [*x]`: a value that contains itself, which nothing
    can validate or print) and aliases that expand to more than MAX_VALUES values."""
    seen = 0
    stack: list[tuple[yaml.Node, frozenset[int]]] = [(root, frozenset())]
    while stack:
        node, above = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise yaml.constructor.ConstructorError(
                None, None, f"more than {MAX_VALUES} values (aliases that expand without end?)", node.start_mark)
        if id(node) in above:
            raise yaml.constructor.ConstructorError(
                None, None, "an alias inside the value its anchor names: a value cannot contain itself",
                node.start_mark)
        if isinstance(node, yaml.MappingNode):
            children = [n for kv in node.value for n in kv]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            continue
        inner = above | {id(node)}
        stack.extend((child, inner) for child in reversed(children))


def _index_lines(node: yaml.Node, path: str, out: dict[str, int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            sub = f"{path}.{_key(k.value)}" if path else _key(k.value)
            out[sub] = k.start_mark.line + 1
            _index_lines(v, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _index_lines(v, f"{path}[{i}]", out)
