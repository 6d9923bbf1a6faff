"""Remove every leftover of the testbed (Mininet's `mn -c` is the model): engines, processes inside our
namespaces, the namespaces themselves, bind mounts and state directories. Only things the testbed made
(names starting with `tb.`, state under /run/testbed, containers labelled by the docker runtime) are touched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

from . import nsutil
from .state import STATE_ROOT, running_names, state_dir


def stop_engines(engines: dict) -> list[dict]:
    """Stop the engines recorded in a state file; return their final counters."""
    finals = []
    for key, rec in engines.items():
        handle = rec.get("handle")
        if not handle:
            continue
        from .engine.manager import EngineHandle, engine_alive, stop_engine
        try:
            stats = stop_engine(EngineHandle.from_dict(handle))
        except Exception as e:  # a dead or half-started engine: make sure the process is gone
            pid = handle.get("pid")
            # the recorded start time tells our engine from a later process that reuses its pid
            if pid and engine_alive(pid, handle.get("start_time")):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            stats = {"error": str(e)}
        link, _, direction = key.partition("/")
        stats.setdefault("link", link)
        stats.setdefault("direction", direction)
        finals.append(stats)
    return finals


def _mounts_under(prefix: str) -> list[str]:
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                mnt = line.split()[1].replace("\\040", " ")
                if mnt.startswith(prefix):
                    out.append(mnt)
    except OSError:
        pass
    return sorted(out, key=len, reverse=True)


def orphan_engine_pids(topology: str | None = None) -> list[int]:
    """Engine processes whose config lives under our state root (and, if given, under that topology)."""
    want = str(state_dir(topology)) + "/" if topology else str(STATE_ROOT) + "/"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"testbed.engine" in args and any(a.decode(errors="replace").startswith(want) for a in args):
            pids.append(int(entry))
    return pids


def _sweep(prefix: str, topology: str | None) -> list[str]:
    """Engines, namespaces (and the processes in them), /etc/netns files and mounts of one topology, or of all
    (topology None), whether recorded in a state file or not."""
    removed = []
    for pid in orphan_engine_pids(topology):
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"engine pid {pid}")
        except ProcessLookupError:
            pass
    for ns in nsutil.list_testbed_netns(topology):
        nsutil.remove_netns(ns)
        removed.append(f"netns {ns}")
    _sweep_etc_netns(prefix)
    root = state_dir(topology) if topology else STATE_ROOT
    for mnt in _mounts_under(str(root) + "/"):
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    return removed


def sweep_topology(name: str, keep_state: bool = False) -> list[str]:
    """Remove whatever is left of topology `name`, recorded or not (`keep_state`: leave its state directory,
    so that a later `down` can retry what failed)."""
    removed = _sweep(f"{nsutil.PREFIX}{name}.", name)
    d = state_dir(name)
    if d.exists() and not keep_state:
        shutil.rmtree(d, ignore_errors=True)
        removed.append(f"state {d}")
    return removed


def clean_all() -> dict:
    """`testbed down --all`: tear down every topology with state, then sweep anything left by prefix."""
    from .net import teardown

    done: dict = {"topologies": [], "swept": []}
    for name in running_names():
        teardown(name)
        done["topologies"].append(name)
    done["swept"] += _sweep(nsutil.PREFIX, None)
    try:
        from .runtime.docker import sweep_containers
        done["swept"] += [f"container {c}" for c in sweep_containers()]
    except Exception:
        pass  # no docker runtime or no engine reachable: nothing of ours can be there
    return done


def _sweep_etc_netns(prefix: str) -> None:
    try:
        names = os.listdir("/etc/netns")
    except FileNotFoundError:
        return
    for n in names:
        if n.startswith(prefix):
            shutil.rmtree(f"/etc/netns/{n}", ignore_errors=True)


def leftovers(topology: str | None = None) -> dict:
    """What of the testbed exists right now (used by tests and `status`)."""
    want = f"{nsutil.PREFIX}{topology}." if topology else nsutil.PREFIX
    try:
        etc = sorted(n for n in os.listdir("/etc/netns") if n.startswith(want))
    except FileNotFoundError:
        etc = []
    try:
        from .runtime.docker import DockerRuntime
        containers = DockerRuntime().list(topology)
    except Exception:  # no docker SDK or no engine: then no container of ours can exist
        containers = []
    return {
        "netns": nsutil.list_testbed_netns(topology),
        "etc_netns": etc,
        "containers": containers,
        "engines": orphan_engine_pids(topology),
        "state": [n for n in running_names() if topology in (None, n)],
    }
