"""Processes by pid, read from /proc: which exist, what they run, when they started, which namespace they are
in; and signals that do not fail when the process is already gone.

A pid alone does not name a process for long: once it exits, the kernel may give the pid to a new one. So a
process we started is recorded with its start time (`start_time`), and `alive(pid, start_time)` is true only
for that same process."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Callable

PROC = "/proc"


def pids() -> list[int]:
    """Every process on this machine (in our pid namespace), except this one."""
    me = os.getpid()
    return [int(e) for e in os.listdir(PROC) if e.isdigit() and int(e) != me]


def cmdline(pid: int) -> list[str] | None:
    """The arguments of `pid` (empty for a kernel thread or a zombie); None if it does not exist."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def environ(pid: int) -> list[str] | None:
    """`pid`'s environment as NAME=VALUE strings; None if it does not exist (or is not ours to read)."""
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ_has(pid: int, entries, wait_s: float = 0.0) -> bool:
    """Does `pid`'s environment hold every NAME=VALUE of `entries`? While the process exists and does not (yet),
    ask again for up to `wait_s` seconds: a process that has just been started may still carry its parent's
    environment until it execs (a container's init under runc does)."""
    deadline = time.monotonic() + wait_s
    while True:
        env = environ(pid)
        if env is not None and all(e in env for e in entries):
            return True
        if env is None or time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def pids_with_cmdline(match: Callable[[list[str]], bool]) -> list[int]:
    """Processes whose argument list satisfies `match`."""
    out = []
    for pid in pids():
        args = cmdline(pid)
        if args and match(args):
            out.append(pid)
    return out


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on. The command name (field 2) may hold spaces and parentheses,
    so the split starts after its last ')'."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def state(pid: int) -> str | None:
    """R, S, D, Z (zombie), ... or None if there is no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks after boot (stat field 22); None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def alive(pid: int | None, started: int | None = None) -> bool:
    """Whether `pid` runs (exists and is not a zombie) and, given its recorded start time, is still the same
    process (not a later one that reuses the pid)."""
    if not pid:
        return False
    fields = _stat_fields(int(pid))
    if not fields or fields[0] in ("Z", "X"):
        return False
    return started is None or (len(fields) > 19 and int(fields[19]) == int(started))


def namespace(pid: int | str, kind: str = "net") -> tuple[int, int] | None:
    """Identity (device, inode) of `pid`'s namespace of `kind` (net, pid, uts, ...); a path to a namespace
    file (/run/netns/NAME, /proc/PID/ns/net) works too. None if it does not exist."""
    path = pid if isinstance(pid, str) else f"{PROC}/{pid}/ns/{kind}"
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def in_namespace(ns_path: str, kind: str = "net") -> list[int]:
    """Processes (but this one) whose namespace of `kind` is the one at `ns_path`."""
    target = namespace(ns_path)
    if target is None:
        return []
    return [p for p in pids() if namespace(p, kind) == target]


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal `pid`; False (no error) if it is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_group(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group that `pid` leads (a process started with start_new_session: it and its
    children); just `pid` when it leads no group any more. False (no error) if nothing is left to signal."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # PermissionError: the group id now names another's group
        return kill(pid, sig)
    return True


# -- the JSON lines a program prints (the probes, the benchmarks) -------------------------------------------------


def read_json_line(proc, key: str, timeout: float = 30) -> dict:
    """Read a local probe's stdout lines until a JSON object with `key`; raise (with its stderr) on EOF or timeout.
    (A process on another machine reads its own: RemotePopen.read_json_line; BaseTestbed.read_json_line picks.)"""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {key!r} line from pid {proc.pid} within {timeout:.0f} s")
        r, _, _ = select.select([proc.stdout], [], [], left)
        if not r:
            continue
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"pid {proc.pid} ended without a {key!r} line; stderr:\n{err.strip()[-1500:]}")
        obj = json_with(line, key)
        if obj is not None:
            return obj


def json_with(line: str, key: str) -> dict | None:
    """The JSON object on `line` if it has `key`; None for anything else (other lines, text, a torn line)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and key in obj else None
