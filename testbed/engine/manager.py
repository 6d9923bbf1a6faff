"""Start, query, change and stop engines (one handle per corrupted link direction).

``start_engine`` writes the config, starts ``python -m testbed.engine --config FILE`` in its own process
group, waits for "READY" (the queue is bound), and only then adds the iptables NFQUEUE rule inside the
namespace, without ``--queue-bypass``: from then on a dead engine means a dead link (fail closed), never a
clean one. ``EngineHandle`` is plain data (``to_dict``/``from_dict``) so a later process can stop the engine.

One process may serve several directions of one namespace (docs/engine.md, "Engine processes"):
``start_engines`` starts one for several specs, ``join_engine`` adds a direction to a running one. Every
handle still names one direction (its queue, control socket and stats file); directions of one process share
its pid, so killing it kills them all (each fails closed).

A spec with ``engine: "bpf"`` gets the in-kernel engine instead (testbed/engine/bpf: a tc program, no
process; ``pid`` is 0 and ``handle.bpf`` says where it is pinned and attached): every function here
dispatches on the spec's engine kind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from testbed import nsutil, procs
from testbed.engine.config import EngineError, EngineSpec
from testbed.engine.control import request
from testbed.engine.nfqueue import queue_drops

__all__ = [
    "EngineSpec",
    "EngineHandle",
    "EngineError",
    "start_engine",
    "start_engines",
    "join_engine",
    "stop_engine",
    "engine_stats",
    "set_engine",
    "engine_alive",
    "detach_engine",
    "attach_engine",
    "iptables_rule",
    "handle_alive",
]

_CHILDREN: dict[int, subprocess.Popen] = {}  # engines started by this process, until reaped
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the testbed package


@dataclass
class EngineHandle:
    spec: EngineSpec
    pid: int
    start_time: int | None  # /proc/PID/stat starttime: tells our engine from a later process reusing the pid
    config_path: str
    log_path: str
    rule: list[str] = field(default_factory=list)  # iptables arguments after -A / -D (bpf: the tc filter, for show)
    started_at: float = 0.0
    bpf: dict | None = None  # engine bpf: pin directory, sidecar, attachment, offload changed (bpf/engine.py)

    @property
    def kind(self) -> str:
        return self.spec.engine

    def to_dict(self) -> dict:
        d = {"spec": self.spec.to_dict(), "pid": self.pid, "start_time": self.start_time,
             "config_path": self.config_path, "log_path": self.log_path, "rule": list(self.rule),
             "started_at": self.started_at}
        if self.bpf is not None:
            d["bpf"] = dict(self.bpf)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineHandle":
        return cls(spec=EngineSpec.from_dict(d["spec"]), pid=int(d["pid"]), start_time=d.get("start_time"),
                   config_path=d["config_path"], log_path=d["log_path"], rule=list(d.get("rule") or []),
                   started_at=float(d.get("started_at") or 0.0), bpf=d.get("bpf"))


def _bpf():
    from testbed.engine.bpf import engine as bpf_engine  # only for bpf engines: the NFQUEUE path needs none of it
    return bpf_engine


def _bpf_target(h) -> tuple[EngineSpec, dict] | None:
    """(spec, bpf record) when `h` (a handle, a spec, or their dicts) is a bpf engine; else None."""
    if isinstance(h, dict) and "spec" in h:
        h = EngineHandle.from_dict(h)
    elif isinstance(h, dict) and h.get("engine") == "bpf" and "netns" in h:
        try:
            h = EngineSpec.from_dict(h)
        except (TypeError, ValueError):
            return None
    if isinstance(h, EngineHandle) and h.spec.engine == "bpf":
        return h.spec, dict(h.bpf or {})
    if isinstance(h, EngineSpec) and h.engine == "bpf":
        return h, {}
    return None


def handle_alive(handle) -> bool:
    """Whether the engine of `handle` (an EngineHandle or its dict) still corrupts its link: the same process
    (nfqueue), or the program still attached with its maps (bpf)."""
    t = _bpf_target(handle)
    if t is not None:
        return _bpf().alive(*t)
    if isinstance(handle, dict):
        return engine_alive(handle.get("pid"), handle.get("start_time"))
    return engine_alive(handle.pid, handle.start_time)


def iptables_rule(spec: EngineSpec) -> list[str]:
    """The rule (arguments after -A/-D) that sends the link direction's packets to the engine's queue."""
    if spec.hook == "egress":
        chain, dev = "POSTROUTING", "-o"
    else:
        chain, dev = "PREROUTING", "-i"
    return ["-t", "mangle", chain, dev, spec.iface, "-j", "NFQUEUE", "--queue-num", str(spec.queue_num)]


def detach_engine(handle: EngineHandle) -> None:
    """Remove the engine's NFQUEUE rule: the link passes its traffic clean (unlike a dead engine, which drops
    it) while the engine process keeps running. `attach_engine` undoes it. (bpf: the tc filter is removed, the
    maps stay.)"""
    if handle.spec.engine == "bpf":
        return _bpf().detach_engine(handle.spec, handle.bpf or {})
    _iptables(handle.spec.netns, "-D", handle.rule)


def attach_engine(handle: EngineHandle) -> None:
    """Add the engine's NFQUEUE rule back (after `detach_engine`): the link's packets go through it again."""
    if handle.spec.engine == "bpf":
        return _bpf().attach_engine(handle.spec, handle.bpf or {})
    _iptables(handle.spec.netns, "-A", handle.rule)


def _iptables(netns: str, action: str, rule: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """``iptables -w <table> <action> <chain> ...`` inside ``netns``; EngineError if it fails and ``check``."""
    table, chain, rest = rule[:2], rule[2], rule[3:]
    argv = ["iptables", "-w", *table, action, chain, *rest]
    r = nsutil.nsexec(netns, argv, check=False, timeout=30)
    if check and r.returncode != 0:
        raise EngineError(f"{' '.join(argv)} in {netns} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def engine_alive(pid: int | None, start_time: int | None = None) -> bool:
    """Whether process ``pid`` runs (not a zombie) and, if ``start_time`` is given, is the same process."""
    if pid and procs.state(int(pid)) == "Z":
        _reap(int(pid))  # our own exited child: collect it, or it stays a zombie
    return procs.alive(pid, start_time)


def _reap(pid: int) -> None:
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is not None:
            del _CHILDREN[pid]
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _prepared(spec: EngineSpec) -> EngineSpec:
    spec = replace(spec, stats_file=os.path.abspath(spec.stats_file),
                   control_socket=os.path.abspath(spec.control_socket)).validate()  # the engine runs in /
    if not os.path.exists(spec.netns):
        raise EngineError(f"network namespace {spec.netns} does not exist")
    return spec


def _write_config(spec: EngineSpec) -> Path:
    for p in (spec.stats_file, spec.control_socket):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    config_path = spec.config_path()
    config_path.write_text(json.dumps(spec.to_dict(), indent=1))
    return config_path


def start_engine(spec: EngineSpec, python: str = sys.executable, ready_timeout: float = 20.0) -> EngineHandle:
    """Start an engine for ``spec`` (its own process, or a tc program for engine bpf) and attach it to the link;
    raise EngineError (with the engine's stderr) if it does not come up."""
    spec = _prepared(spec)
    if spec.engine == "bpf":
        rec = _bpf().start(spec)
        return EngineHandle(spec=spec, pid=0, start_time=None, config_path=str(spec.config_path()),
                            log_path=str(spec.log_path()), started_at=time.time(), bpf=rec,
                            rule=["tc", "filter", rec["attach"]["hook"], "dev", rec["attach"]["iface"], "pref",
                                  str(_bpf().PREF), "bpf", "tb_flip"])
    return start_engines([spec], python=python, ready_timeout=ready_timeout)[0]


def start_engines(specs: list[EngineSpec], python: str = sys.executable,
                  ready_timeout: float = 20.0) -> list[EngineHandle]:
    """One NFQUEUE engine process serving every spec (all engine nfqueue, one namespace, distinct queues), each
    direction attached to its link once all are bound; one handle per spec. The process logs into the first
    spec's log. On failure nothing is left: no process, no rule."""
    specs = [_prepared(s) for s in specs]
    if not specs:
        return []
    if any(s.engine != "nfqueue" for s in specs):
        raise EngineError("start_engines starts NFQUEUE engine processes; a bpf engine has none (start_engine)")
    if len({os.path.realpath(s.netns) for s in specs}) > 1:
        raise EngineError("one engine process serves one network namespace, got "
                          + ", ".join(sorted({s.netns for s in specs})))
    queues = [s.queue_num for s in specs]
    if len(set(queues)) < len(queues):
        raise EngineError(f"queue numbers must differ within a namespace, got {queues}")
    configs = [_write_config(s) for s in specs]
    log_path = specs[0].log_path()
    env = dict(os.environ)
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    argv = [python, "-m", "testbed.engine"]
    for c in configs:
        argv += ["--config", str(c)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
                                start_new_session=True, cwd="/")
    start_time = procs.start_time(proc.pid)
    handles = [EngineHandle(spec=s, pid=proc.pid, start_time=start_time, config_path=str(c),
                            log_path=str(log_path), rule=iptables_rule(s), started_at=time.time())
               for s, c in zip(specs, configs)]
    added = []
    try:
        _wait_ready(proc, ready_timeout, str(log_path))
        for h in handles:
            _iptables(h.spec.netns, "-A", h.rule)
            added.append(h)
    except BaseException:
        for h in added:
            _iptables(h.spec.netns, "-D", h.rule, check=False)
        procs.kill_group(proc.pid)  # its own process group (start_new_session)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        raise
    finally:
        proc.stdout.close()
    _CHILDREN[proc.pid] = proc  # so that this process can reap it; a later process is not its parent
    return handles


def join_engine(running: EngineHandle, spec: EngineSpec, timeout: float = 10.0) -> EngineHandle:
    """Serve `spec` by the running engine process of `running` (another direction of the same namespace): the
    process binds the new queue (`{"cmd": "add"}` on the control socket), then the rule is added. EngineError if
    the process refuses or does not answer (nothing is left then)."""
    spec = _prepared(spec)
    if spec.engine != "nfqueue" or running.spec.engine != "nfqueue":
        raise EngineError("only NFQUEUE directions share an engine process")
    if not engine_alive(running.pid, running.start_time):
        raise EngineError(f"engine pid {running.pid} is not running")
    config_path = _write_config(spec)
    try:
        resp = request(running.spec.control_socket, {"cmd": "add", "config": str(config_path)}, timeout=timeout)
    except (OSError, ValueError) as e:
        raise EngineError(f"engine pid {running.pid} ({running.spec.control_socket}): {e}") from e
    if not resp.get("ok"):
        raise EngineError(f"engine pid {running.pid} refused queue {spec.queue_num}: {resp.get('error')}")
    handle = EngineHandle(spec=spec, pid=running.pid, start_time=running.start_time, config_path=str(config_path),
                          log_path=running.log_path, rule=iptables_rule(spec), started_at=time.time())
    try:
        _iptables(spec.netns, "-A", handle.rule)
    except BaseException:
        _stop_lane(handle, timeout)
        raise
    return handle


def _wait_ready(proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineError(f"engine pid {proc.pid} not ready after {timeout:.0f} s; its log "
                              f"({log_path}):\n{_tail(log_path)}")
        r, _, _ = select.select([fd], [], [], min(left, 0.2))
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:  # stdout closed: the engine exited
                code = proc.wait(timeout=5)
                raise EngineError(f"engine exited with status {code} before it was ready; its log "
                                  f"({log_path}):\n{_tail(log_path)}")
            buf += chunk
            if b"READY\n" in buf:
                return
        elif proc.poll() is not None:
            raise EngineError(f"engine exited with status {proc.returncode} before it was ready; its log "
                              f"({log_path}):\n{_tail(log_path)}")


def _read_stats_file(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stop_engine(handle: EngineHandle, timeout: float = 10.0) -> dict:
    """Detach the engine from the link (remove the rule while the namespace exists), stop it (SIGTERM, then
    SIGKILL after ``timeout``), and return its final counters (from the stats file, ``alive: false``)."""
    spec = handle.spec
    if spec.engine == "bpf":
        return _bpf().stop(spec, handle.bpf or {})
    if os.path.exists(spec.netns) and handle.rule:
        _iptables(spec.netns, "-D", handle.rule, check=False)  # already gone is fine
    if engine_alive(handle.pid, handle.start_time):
        _stop_lane(handle, timeout)
    _reap(handle.pid)
    stats = _read_stats_file(spec.stats_file) or {"link": spec.link, "direction": spec.direction}
    stats["alive"] = False
    return stats


def _stop_lane(handle: EngineHandle, timeout: float) -> None:
    """Stop the direction of `handle` in its process (`{"cmd": "stop"}`: final stats written, queue unbound);
    the process exits with its last direction. A process that does not answer serves no direction any more: it
    gets SIGTERM, then SIGKILL of its group."""
    pid, st = handle.pid, handle.start_time
    deadline = time.monotonic() + timeout
    try:
        left = request(handle.spec.control_socket, {"cmd": "stop"}, timeout=min(2.0, timeout)).get("lanes_left", 0)
    except (OSError, ValueError):
        left = None
    if left:  # others still served: wait until this direction is closed (its socket goes after its final stats)
        while os.path.exists(handle.spec.control_socket) and engine_alive(pid, st) and time.monotonic() < deadline:
            time.sleep(0.02)
        return
    if left is None:
        procs.kill(pid, signal.SIGTERM)
    while engine_alive(pid, st) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.02)
    if engine_alive(pid, st):
        procs.kill_group(pid)
        while engine_alive(pid, st) and time.monotonic() < deadline + 5:
            time.sleep(0.02)


def _paths(handle_or_paths) -> tuple[str, str, int | None, int | None]:
    h = handle_or_paths
    if isinstance(h, EngineHandle):
        return h.spec.control_socket, h.spec.stats_file, h.pid, h.start_time
    if isinstance(h, EngineSpec):
        return h.control_socket, h.stats_file, None, None
    if isinstance(h, dict):
        if "spec" in h:
            return _paths(EngineHandle.from_dict(h))
        return h["control_socket"], h["stats_file"], h.get("pid"), h.get("start_time")
    if isinstance(h, (tuple, list)) and len(h) == 2:
        return str(h[0]), str(h[1]), None, None
    raise TypeError("engine_stats takes an EngineHandle, an EngineSpec, a handle/spec dict or "
                    "(control_socket, stats_file)")


def engine_stats(handle_or_paths, timeout: float = 2.0) -> dict:
    """Live counters from the control socket (``alive: true``). If the engine does not answer: the last
    stats file (written every ~0.5 s) with ``alive: false`` and ``error`` saying why; with ``alive: true,
    responding: false`` instead when its process still runs (busy or stuck)."""
    t = _bpf_target(handle_or_paths)
    if t is not None:
        return _bpf().stats(*t)
    sock, stats_file, pid, start_time = _paths(handle_or_paths)
    running = pid is not None and engine_alive(pid, start_time)
    if pid is None or running:
        try:
            resp = request(sock, {"cmd": "stats"}, timeout=timeout)
            resp.pop("ok", None)
            resp["alive"] = True
            return resp
        except (OSError, ValueError) as e:
            reason = f"control socket: {e}"
    else:
        reason = f"engine pid {pid} is not running"
    stats = _read_stats_file(stats_file) or {}
    stats["alive"] = running
    if running:
        stats["responding"] = False
        if stats.get("queue_num") is not None:
            # a stalled engine's queue overflows: the kernel's counters, read in its namespace, say how much
            stats.update(queue_drops(stats["queue_num"], f"/proc/{pid}/net/netfilter/nfnetlink_queue"))
    stats["error"] = reason
    return stats


def set_engine(handle, timeout: float = 5.0, **settings) -> dict:
    """Change corruption settings live (ber, error_model, scope, checksum, seed, collectives, control_ports,
    element, protect, protected_ber; None values are ignored, `protect=[]` clears the protection). Returns the
    settings now in force; raises EngineError if refused."""
    t = _bpf_target(handle)
    if t is not None:
        return _bpf().set_settings(*t, **settings)
    sock, _, pid, start_time = _paths(handle)
    if pid is not None and not engine_alive(pid, start_time):
        raise EngineError(f"engine pid {pid} is not running")
    req = {"cmd": "set", **{k: v for k, v in settings.items() if v is not None}}
    try:
        resp = request(sock, req, timeout=timeout)
    except OSError as e:
        raise EngineError(f"engine control socket {sock}: {e}") from e
    if not resp.get("ok"):
        raise EngineError(f"engine refused {req}: {resp.get('error')}")
    return resp["settings"]
