"""Writing results so that an interrupted run never leaves half a file: temp file in the same directory,
fsync, rename. One implementation for the whole testbed (state, results, metrics, benchmarks)."""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

# errno values that say a file system cannot take more data: it is full, or the user's quota is
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_atomic(path: str | Path, data: str | bytes, *, fsync: bool = True) -> None:
    """Write bytes or text to `path` via a temp file + rename (readers never see half a file). `fsync=False`
    for a file rewritten often whose contents need only outlive its process, not the machine (a process that
    is killed loses nothing written; only a crash of the machine could)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; run dirs and caches are shared with containers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj, *, indent: int | None = 2, sort_keys: bool = False,
                      fsync: bool = True) -> None:
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=True, default=str) + "\n",
                 fsync=fsync)


def append_jsonl(path: str | Path, obj) -> None:
    """Append one JSON line with a single write() (O_APPEND), so a reader sees whole lines only."""
    line = json.dumps(obj, sort_keys=True, allow_nan=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list:
    """Read whole lines; a torn last line (writer killed mid-write) is skipped. For a file whose every line must
    be a JSON object, and whose damage must be reported rather than skipped (results.jsonl): read_jsonl_objects."""
    rows = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


@dataclass
class BadLine:
    """A line of a JSON-lines file that is not a JSON object: its number (1-based), its text, and what is wrong."""
    line: int
    text: str
    problem: str
    point: str | None = None  # the point id a cut-off results row still shows, if any


_POINT = re.compile(r'^\{\s*"point"\s*:\s*"((?:[^"\\]|\\.)*)"')
_KIND = {list: "a JSON array", str: "a JSON string", int: "a JSON number", float: "a JSON number",
         bool: "JSON true/false", type(None): "JSON null"}


def read_jsonl_objects(path: str | Path, check=None) -> tuple[list[dict], list[BadLine]]:
    """Every line of a JSON-lines file that holds one JSON object, and every other non-blank line as a BadLine:
    one cut off (the last line, without its newline: a writer stopped mid-line or a copy cut short), one that is
    not JSON, one that is JSON but not an object (`[1]`, `"x"`), and one that `check(obj)` (optional) finds
    wrong (it returns the problem, or None). Nothing is skipped silently. ([], []) when the file is missing."""
    try:
        text = Path(path).read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return [], []
    rows: list[dict] = []
    bad: list[BadLine] = []
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last = i == len(lines)  # the text after the last newline: a line that was never finished
        try:
            obj = json.loads(line)
        except ValueError as e:
            m = _POINT.match(line)
            point = json.loads(f'"{m.group(1)}"') if m else None
            what = (f"cut off after {len(line.encode())} bytes (the file ends in the middle of a line)" if last
                    else f"not JSON ({e.msg} at column {e.colno})")
            bad.append(BadLine(i, line, what, point))
            continue
        if not isinstance(obj, dict):
            bad.append(BadLine(i, line, f"{_KIND.get(type(obj), type(obj).__name__)}, not a JSON object"))
            continue
        problem = check(obj) if check else None
        if problem:
            bad.append(BadLine(i, line, problem))
            continue
        rows.append(obj)
    return rows, bad
