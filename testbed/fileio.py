"""Writing results so that an interrupted run never leaves half a file: temp file in the same directory,
fsync, rename. One implementation for the whole testbed (state, results, metrics, benchmarks)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


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
    """Read whole lines; a torn last line (writer killed mid-write) is skipped."""
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
