"""On-disk state of running topologies, so `down`, `status`, `exec` and `stats` work from a new shell and
after the process that ran `up` was killed. Lives on /run (tmpfs): a reboot clears it together with the
namespaces it describes. Every write is atomic (temp file + rename)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from testbed.fileio import write_json_atomic  # noqa: F401 (imported from here by net.py and others)

STATE_ROOT = Path(os.environ.get("TESTBED_STATE_DIR", "/run/testbed"))
HISTORY_ROOT = Path(os.environ.get("TESTBED_HISTORY_DIR", "/var/lib/testbed/history"))


class TopologyNotFound(LookupError):
    pass


def state_dir(name: str) -> Path:
    return STATE_ROOT / name


def claim(name: str) -> Path:
    """Create the state directory of `name`; fails if that topology is already up (atomic mkdir)."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    d = state_dir(name)
    try:
        d.mkdir()
    except FileExistsError:
        raise FileExistsError(
            f"a topology named {name!r} is already up (state in {d}); bring it down with "
            f"`testbed down {name}` or choose another name with --name") from None
    return d


class State:
    """The state file of one topology: read-modify-write, always atomically."""

    def __init__(self, name: str):
        self.name = name
        self.dir = state_dir(name)
        self.path = self.dir / "state.json"
        self.data: dict = {}

    @classmethod
    def new(cls, name: str, **fields) -> "State":
        s = cls(name)
        s.data = {"name": name, "created_at": time.time(), "phase": "creating", "namespaces": [],
                  "hosts": {}, "engines": {}, **fields}
        s.save()
        return s

    @classmethod
    def load(cls, name: str) -> "State":
        s = cls(name)
        try:
            s.data = json.loads(s.path.read_text())
        except FileNotFoundError:
            if s.dir.exists():
                # `up` was killed before its first write; the directory alone still marks leftovers.
                s.data = {"name": name, "phase": "unknown", "namespaces": [], "hosts": {}, "engines": {}}
                return s
            raise TopologyNotFound(f"no topology named {name!r} is up (see `testbed status`)") from None
        return s

    def save(self) -> None:
        write_json_atomic(self.path, self.data)

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.save()


def running_names() -> list[str]:
    try:
        return sorted(p.name for p in STATE_ROOT.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []
