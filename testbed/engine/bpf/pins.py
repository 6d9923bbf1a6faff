"""Where the bpf engine pins its program and maps (bpffs), and how sweeps find them. No heavy imports:
testbed/clean.py uses this to remove what a killed `up` or a crashed test left.

An engine whose stats file is ``/run/testbed/NAME/engines/e0.stats.json`` pins under
``/sys/fs/bpf/testbed/run/testbed/NAME/engines/e0/`` (``prog``, ``tb_config``, ``tb_state``, ...): the bpffs
path mirrors the state path, so a topology's pins are found from its state directory alone, and two state
roots (TESTBED_STATE_DIR, e.g. the ssh test machines on one host) never collide.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["BPFFS", "PIN_ROOT", "pin_dir_for", "pins_under", "engine_pin_dirs", "remove_pins", "bpffs_mounted",
           "ensure_bpffs", "orphan_pin_dirs"]

BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "testbed"
MARKER = "tb_state"  # every engine's pin directory holds its state map


def _enc(name: str) -> str:
    # bpffs refuses names with a dot (reserved): '%' -> '%25', '.' -> '%2E'
    return name.replace("%", "%25").replace(".", "%2E")


def _dec(name: str) -> str:
    return name.replace("%2E", ".").replace("%25", "%")


def pins_under(path: str | os.PathLike) -> Path:
    """The bpffs directory that mirrors filesystem directory `path`."""
    return PIN_ROOT.joinpath(*(_enc(part) for part in Path(os.path.abspath(path)).relative_to("/").parts))


def mirrored_path(d: Path) -> Path:
    """The filesystem directory that bpffs directory `d` (under PIN_ROOT) mirrors."""
    return Path("/").joinpath(*(_dec(part) for part in d.relative_to(PIN_ROOT).parts))


def pin_dir_for(stats_file: str | os.PathLike) -> Path:
    """The pin directory of the engine whose stats file is `stats_file` (``X.stats.json`` -> ``.../X/``)."""
    p = Path(os.path.abspath(stats_file))
    stem = p.name[: -len(".stats.json")] if p.name.endswith(".stats.json") else p.name
    return pins_under(p.parent) / _enc(stem)


def engine_pin_dirs(under: Path = PIN_ROOT) -> list[Path]:
    """Engine pin directories at or below `under`."""
    if not under.is_dir():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(under):
        if MARKER in filenames:
            out.append(Path(dirpath))
            dirnames[:] = []
    return sorted(out)


def remove_pins(d: Path) -> bool:
    """Unpin everything under `d` (a pinned object is freed once nothing else holds it: a detached program
    and its maps) and remove the empty directories up to PIN_ROOT. True if something was removed."""
    if not d.exists():
        return False
    shutil.rmtree(d, ignore_errors=True)
    p = d.parent
    while p != PIN_ROOT and PIN_ROOT in p.parents:
        try:
            p.rmdir()
        except OSError:
            break
        p = p.parent
    return True


def orphan_pin_dirs(under: Path = PIN_ROOT) -> list[Path]:
    """Engine pin directories whose mirrored directory (where the engine's stats file lived) is gone: what a
    killed test or a removed state directory left behind."""
    out = []
    for d in engine_pin_dirs(under):
        if d.parent == PIN_ROOT and d.name.startswith("probe-"):  # an availability probe (engine.available)
            pid = d.name[len("probe-"):]
            if not (pid.isdigit() and os.path.exists(f"/proc/{pid}")):
                out.append(d)
            continue
        if not mirrored_path(d.parent).is_dir():
            out.append(d)
    return out


def bpffs_mounted() -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == [str(BPFFS), "bpf"] for line in f)
    except OSError:
        return False


def ensure_bpffs() -> None:
    """Mount the BPF filesystem at /sys/fs/bpf if it is not (Debian does not by default)."""
    if bpffs_mounted():
        return
    BPFFS.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "bpf", "bpf", str(BPFFS)], capture_output=True, text=True)
    if r.returncode != 0 and not bpffs_mounted():
        raise OSError(f"cannot mount the BPF filesystem at {BPFFS}: {(r.stderr or r.stdout).strip()}")
