"""Small helpers around network namespaces: naming, creation, processes inside, running commands in them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from pyroute2 import netns as pr_netns

from testbed import procs

NETNS_DIR = Path("/run/netns")
# The prefix of every namespace (and container) this testbed makes; `down --all` sweeps exactly these. Several
# "machines" sharing one kernel (the multi-machine tests: one sshd per namespace) each get their own prefix and
# state directory (TESTBED_STATE_DIR), so that one machine's `down --all` never touches another's.
PREFIX = os.environ.get("TESTBED_PREFIX", "tb.")
if not PREFIX or "/" in PREFIX or not PREFIX.endswith("."):
    raise SystemExit(f"TESTBED_PREFIX={PREFIX!r}: give a name ending in '.', without '/', e.g. 'tb.'")
# Every host namespace (and container) gets these, and only they: forwarding for multi-hop routes, and no
# IPv6 (router solicitations, MLD, DAD would otherwise chatter on the data links).
HOST_SYSCTLS = {"net.ipv4.ip_forward": "1", "net.ipv6.conf.all.disable_ipv6": "1",
                "net.ipv6.conf.default.disable_ipv6": "1"}


def ns_name(topology: str, node: str) -> str:
    return f"{PREFIX}{topology}.{node}"


def mgmt_ns_name(topology: str) -> str:
    return f"{PREFIX}{topology}._mgmt"


def ns_path(name: str) -> str:
    return str(NETNS_DIR / name)


def list_testbed_netns(topology: str | None = None) -> list[str]:
    want = f"{PREFIX}{topology}." if topology else PREFIX
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(want))
    except FileNotFoundError:
        return []


def create_netns(name: str) -> str:
    pr_netns.create(name)
    path = ns_path(name)
    # One process for both: each costs milliseconds, and a topology has many namespaces.
    settings = " ".join(f"{k}={v}" for k, v in HOST_SYSCTLS.items())
    nsexec(path, ["sh", "-c", f"ip link set lo up && sysctl -qw {settings}"])
    return path


@contextlib.contextmanager
def scratch_netns(purpose: str):
    """A throwaway namespace for probing what the kernel offers (never the host's own interfaces); yields
    its path and removes it. Raises OSError/NetlinkError if namespaces cannot be made at all."""
    name = f"{PREFIX}_{purpose}.{os.getpid()}"
    pr_netns.create(name)
    try:
        yield ns_path(name)
    finally:
        try:
            pr_netns.remove(name)
        except OSError:
            pass


def remove_netns(name: str) -> None:
    path = ns_path(name)
    if os.path.exists(path):
        kill_processes_in_netns(path)
        try:
            pr_netns.remove(name)
        except FileNotFoundError:
            pass
    # Per-namespace /etc files (`ip netns exec` convention), e.g. the hosts file of a netns host.
    shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def nsexec(netns_path: str, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a short command inside a network namespace (iptables, sysctl, ethtool)."""
    r = subprocess.run(["nsenter", f"--net={netns_path}", "--", *argv], capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {netns_path} failed: {(r.stderr or r.stdout).strip()}")
    return r


def processes_in_netns(netns_path: str) -> list[int]:
    return procs.in_namespace(netns_path, "net")


def kill_processes_in_netns(netns_path: str, grace_s: float = 1.0) -> list[int]:
    """Kill every process whose network namespace is `netns_path` (TERM, then KILL after a grace)."""
    pids = processes_in_netns(netns_path)
    started = {p: procs.start_time(p) for p in pids}  # so that a pid reused meanwhile is left alone
    for pid in pids:
        procs.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(procs.alive(p, started[p]) for p in pids):
        time.sleep(0.02)
    for pid in pids:
        if procs.alive(pid, started[pid]):
            procs.kill(pid, signal.SIGKILL)
    return pids
