"""Remove the testbed's leftovers (Mininet's `mn -c` is the model): one topology's (`teardown`) or every one's
(`clean_all`, `testbed down --all`): engines, hosts of every registered runtime, processes inside our
namespaces, the namespaces themselves, bind mounts and state directories. Only things the testbed made
(names starting with `tb.`, state under the state root, containers labelled by the docker runtime) are touched.

Works from the state file and the names alone: it imports nothing of the orchestration (testbed.net), so it
also removes what a killed or broken `up` left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from testbed import nsutil, procs
from testbed.runtime.base import Host, all_runtimes, get_runtime
from testbed.state import HISTORY_ROOT, STATE_ROOT, State, running_names, state_dir, write_json_atomic


def teardown(name: str, save_stats: bool = True, results_dir: str | Path | None = None) -> dict:
    """Remove everything topology `name` created: engines (saving their final counters), hosts, switch and
    management namespaces, processes inside them, mounts and the state directory. Idempotent. What could not
    be removed is listed in result["errors"], and the state directory is then kept for a retry."""
    try:
        st = State.load(name)
    except LookupError:
        st = None
    final: dict = {"name": name, "engines": []}
    runtime_name = st.data.get("runtime", "netns") if st is not None else None
    if st is not None:
        _stop_unfinished_up(st.data)
        final["engines"] = stop_engines(st.data.get("engines", {}))
        if save_stats and final["engines"]:
            out_dir = Path(results_dir or st.data.get("results_dir") or HISTORY_ROOT / name)
            path = out_dir / f"stats-{time.strftime('%Y%m%d-%H%M%S')}.json"
            try:
                write_json_atomic(path, final["engines"])
                final["stats_file"] = str(path)
            except OSError as e:  # e.g. its disk is full: the counters are lost, the teardown goes on
                final["stats_error"] = f"{path}: {e}"
        for hd in st.data.get("hosts", {}).values():
            if hd.get("pending"):
                continue
            try:
                get_runtime(runtime_name).delete(Host.from_dict(hd))
            except Exception as e:  # keep going: the sweeps below still remove the rest
                final.setdefault("errors", []).append(f"host {hd.get('node')}: {e}")
    # Hosts by label/prefix, also those a killed `up` created before it could record them: in the runtime its
    # state file names (written before anything was created, so no other runtime can hold hosts of this `up`),
    # in every runtime when there is no such record (no state file, or one an `up` killed at once left empty).
    recorded = st.data.get("runtime") if st is not None else None
    for rt in all_runtimes():
        if recorded is not None and rt.name != recorded:
            continue  # e.g. no docker SDK import and daemon round trip for a topology of namespaces
        try:
            rt.delete_all(name)
        except Exception as e:  # only the topology's own runtime can hold something that failed to go
            if rt.name == runtime_name:
                final.setdefault("errors", []).append(f"{rt.name}: {e}")
    sweep_topology(name, keep_state=bool(final.get("errors")))
    return final


def _stop_unfinished_up(data: dict) -> None:
    """An `up` (or a machine's `part-up`) of this topology that is still building, e.g. after its controller
    was killed: stop it first, or it would go on creating what this removes."""
    pid = data.get("up_pid")
    if data.get("phase") == "up" or not pid or pid == os.getpid():
        return
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return  # gone
    if not any(b"testbed" in a for a in argv):
        return  # the pid was reused by something else
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)


def stop_engines(engines: dict) -> list[dict]:
    """Stop the engines recorded in a state file; return their final counters."""
    from testbed.engine.manager import EngineHandle, stop_engine  # the engine package, only when there are engines

    finals = []
    for key, rec in engines.items():
        handle = rec.get("handle")
        if not handle:
            continue
        try:
            stats = stop_engine(EngineHandle.from_dict(handle))
        except Exception as e:  # a dead or half-started engine: make sure the process is gone
            pid = handle.get("pid")
            # the recorded start time tells our engine from a later process that reuses its pid
            if procs.alive(pid, handle.get("start_time")):
                procs.kill_group(pid)
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
    return procs.pids_with_cmdline(lambda args: "testbed.engine" in args and any(a.startswith(want) for a in args))


def _sweep(prefix: str, topology: str | None) -> list[str]:
    """Engines, namespaces (and the processes in them), /etc/netns files and mounts of one topology, or of all
    (topology None), whether recorded in a state file or not."""
    removed = []
    for pid in orphan_engine_pids(topology):
        if procs.kill(pid, signal.SIGKILL):
            removed.append(f"engine pid {pid}")
    for ns in nsutil.list_testbed_netns(topology):
        nsutil.remove_netns(ns)
        removed.append(f"netns {ns}")
    _sweep_etc_netns(prefix)
    root = state_dir(topology) if topology else STATE_ROOT
    for mnt in _mounts_under(str(root) + "/"):
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    removed += _sweep_bpf_pins(root, everything=topology is None)
    return removed


def _sweep_bpf_pins(root: Path, everything: bool) -> list[str]:
    """bpf engines' pinned programs and maps (bpffs, mirroring the state path: testbed/engine/bpf/pins.py). A
    program's filter went with its namespace; unpinning frees what is left. `everything`: also pins whose
    state directory no longer exists (a killed test's, another state root's stale ones)."""
    from testbed.engine.bpf import pins

    removed = []
    dirs = pins.engine_pin_dirs(pins.pins_under(root))
    if everything:
        dirs += [d for d in pins.orphan_pin_dirs() if d not in dirs]
    for d in dirs:
        if pins.remove_pins(d):
            removed.append(f"bpf pins {d}")
    if not everything:
        pins.remove_pins(pins.pins_under(root))  # the (now empty) mirror of the state directory
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
    """`testbed down --all`: tear down every topology with state, then sweep anything left by prefix, and
    every runtime's hosts by label (those no state file knows)."""
    done: dict = {"topologies": [], "swept": []}
    for name in running_names():
        teardown(name)
        done["topologies"].append(name)
    done["swept"] += _sweep(nsutil.PREFIX, None)
    for rt in all_runtimes():
        done["swept"] += [f"{rt.name}: {x}" for x in _quietly(rt.sweep)]
    return done


def _quietly(ask) -> list[str]:
    """What a runtime answers (`ask()`); nothing when it cannot answer (no daemon, no SDK): then it holds
    nothing of ours either."""
    try:
        return list(ask())
    except Exception:
        return []


def _sweep_etc_netns(prefix: str) -> None:
    try:
        names = os.listdir("/etc/netns")
    except FileNotFoundError:
        return
    for n in names:
        if n.startswith(prefix):
            shutil.rmtree(f"/etc/netns/{n}", ignore_errors=True)


def _bpf_pins(topology: str | None) -> list[str]:
    from testbed.engine.bpf import pins

    return [str(d) for d in pins.engine_pin_dirs(pins.pins_under(state_dir(topology) if topology else STATE_ROOT))]


def leftovers(topology: str | None = None) -> dict:
    """What of the testbed exists right now (used by tests and `down`): namespaces, per-namespace /etc files,
    engine processes, state directories, and each runtime's hosts under its `leftover_key`."""
    want = f"{nsutil.PREFIX}{topology}." if topology else nsutil.PREFIX
    try:
        etc = sorted(n for n in os.listdir("/etc/netns") if n.startswith(want))
    except FileNotFoundError:
        etc = []
    found = {
        "netns": nsutil.list_testbed_netns(topology),  # switch and management namespaces, whatever the runtime
        "etc_netns": etc,
        "engines": orphan_engine_pids(topology),
        "state": [n for n in running_names() if topology in (None, n)],
        "bpf_pins": _bpf_pins(topology),
    }
    for rt in all_runtimes():
        hosts = _quietly(lambda: rt.list(topology))
        found[rt.leftover_key] = sorted(set(found.get(rt.leftover_key, [])) | set(hosts))
    return found

