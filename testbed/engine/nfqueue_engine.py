"""The NFQUEUE engine kind: ``python -m testbed.engine --config FILE...`` in its own process group, every
scope, captures.

`start` writes the configs, starts the process, waits for "READY" (the queues are bound), and only then adds
the iptables NFQUEUE rule of each direction inside the namespace, without ``--queue-bypass``: from then on a
dead engine means a dead link (fail closed), never a clean one.

One process may serve several directions of one namespace (docs/engine.md, "Engine processes"): `start` of
several specs starts one for all of them, `join` adds a direction to a running one. Every handle still names
one direction (its queue, control socket and stats file); directions of one process share its pid, so killing
it kills them all (each fails closed).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from testbed import procs
from testbed.engine.base import Engine, EngineHandle, prepared, register_engine
from testbed.engine.config import EngineError, EngineSpec
from testbed.engine.control import request
from testbed.engine.nfqueue import queue_drops

_CHILDREN: dict[int, subprocess.Popen] = {}  # engines started by this process, until reaped
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the testbed package


def iptables_rule(spec: EngineSpec) -> list[str]:
    """The rule (arguments after -A/-D) that sends the link direction's packets to the engine's queue."""
    if spec.hook == "egress":
        chain, dev = "POSTROUTING", "-o"
    else:
        chain, dev = "PREROUTING", "-i"
    return ["-t", "mangle", chain, dev, spec.iface, "-j", "NFQUEUE", "--queue-num", str(spec.queue_num)]


def _iptables(netns: str, action: str, rule: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """``iptables -w <table> <action> <chain> ...`` inside ``netns``; EngineError if it fails and ``check``."""
    from testbed import nsutil  # here: the registry (and so topology validation) imports this module, pyroute2 is slow

    table, chain, rest = rule[:2], rule[2], rule[3:]
    argv = ["iptables", "-w", *table, action, chain, *rest]
    r = nsutil.nsexec(netns, argv, check=False, timeout=30)
    if check and r.returncode != 0:
        raise EngineError(f"{' '.join(argv)} in {netns} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _iptables_version() -> str:
    r = subprocess.run(["iptables", "--version"], capture_output=True, text=True)
    return r.stdout.strip() or "iptables"


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


def _write_config(spec: EngineSpec) -> Path:
    for p in (spec.stats_file, spec.control_socket):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    config_path = spec.config_path()
    config_path.write_text(json.dumps(spec.to_dict(), indent=1))
    return config_path


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


@register_engine
class NfqueueEngine(Engine):
    name = "nfqueue"
    captures = True
    shares_process = True
    essential = True

    def available(self) -> tuple[bool, str]:
        if not shutil.which("iptables"):
            return False, "iptables is missing (apt-get install iptables)"
        return True, "iptables present"

    def probe(self, netns: str) -> tuple[bool, str]:
        from testbed import nsutil

        if not shutil.which("iptables"):
            return False, "iptables is missing (apt-get install iptables): no bit corruption"
        r = nsutil.nsexec(netns, ["iptables", "-t", "mangle", "-A", "POSTROUTING", "-o", "lo", "-j", "NFQUEUE",
                                  "--queue-num", "7"], check=False)
        if r.returncode != 0:
            return False, f"iptables NFQUEUE rule refused: {(r.stderr or r.stdout).strip()} -> no bit corruption"
        return True, f"iptables NFQUEUE works ({_iptables_version()})"

    def preflight(self, directions: list, is_local) -> str | None:
        # every corrupting direction may come here (engine: auto falls back to this kind)
        if directions and not shutil.which("iptables"):
            return "bit corruption needs iptables (NFQUEUE target): apt-get install iptables"
        return None

    def start(self, specs: list[EngineSpec], python: str = sys.executable,
              ready_timeout: float = 20.0) -> list[EngineHandle]:
        """One engine process serving every spec (one namespace, distinct queues), each direction attached to
        its link once all are bound. The process logs into the first spec's log. On failure nothing is left:
        no process, no rule."""
        specs = [prepared(s) for s in specs]
        if not specs:
            return []
        if any(s.engine != self.name for s in specs):
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

    def join(self, running: EngineHandle, spec: EngineSpec, timeout: float = 10.0) -> EngineHandle:
        """The process binds the new queue (`{"cmd": "add"}` on the control socket), then the rule is added.
        EngineError if the process refuses or does not answer (nothing is left then)."""
        spec = prepared(spec)
        if spec.engine != self.name or running.spec.engine != self.name:
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
        handle = EngineHandle(spec=spec, pid=running.pid, start_time=running.start_time,
                              config_path=str(config_path), log_path=running.log_path, rule=iptables_rule(spec),
                              started_at=time.time())
        try:
            _iptables(spec.netns, "-A", handle.rule)
        except BaseException:
            _stop_lane(handle, timeout)
            raise
        return handle

    def stop(self, handle: EngineHandle, timeout: float = 10.0) -> dict:
        """Remove the rule while the namespace exists, stop the direction (SIGTERM, then SIGKILL after
        `timeout`, for the process's last one), and return its final counters (the stats file)."""
        spec = handle.spec
        if os.path.exists(spec.netns) and handle.rule:
            _iptables(spec.netns, "-D", handle.rule, check=False)  # already gone is fine
        if engine_alive(handle.pid, handle.start_time):
            _stop_lane(handle, timeout)
        _reap(handle.pid)
        stats = _read_stats_file(spec.stats_file) or {"link": spec.link, "direction": spec.direction}
        stats["alive"] = False
        return stats

    def alive(self, handle) -> bool:
        if isinstance(handle, dict):
            return engine_alive(handle.get("pid"), handle.get("start_time"))
        return engine_alive(handle.pid, handle.start_time)

    def stats(self, target, timeout: float = 2.0) -> dict:
        """From the control socket; if the engine does not answer: the last stats file (written every ~0.5 s)
        with ``error`` saying why, and ``responding: false`` (plus the kernel's queue drops) when its process
        still runs (busy or stuck)."""
        sock, stats_file, pid, start_time = _paths(target)
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

    def set(self, target, timeout: float = 5.0, **settings) -> dict:
        sock, _, pid, start_time = _paths(target)
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

    def detach(self, handle: EngineHandle) -> None:
        _iptables(handle.spec.netns, "-D", handle.rule)

    def attach(self, handle: EngineHandle) -> None:
        _iptables(handle.spec.netns, "-A", handle.rule)
