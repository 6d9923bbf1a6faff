"""Small helpers around network namespaces: naming, creation, processes inside, running commands in them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from pyroute2 import IPRoute
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


CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
MS_BIND = 4096
MNT_DETACH = 2
_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    """The C library of this process, also handed to pyroute2 (which otherwise looks it up by running ldconfig)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _libc_call(name: str, *args) -> None:
    # ctypes, for what neither Python 3.11 nor pyroute2 offers without a process: os.unshare comes only in 3.12,
    # there is no os.mount; pyroute2 unshares and mounts only for network namespaces, and either in a forked helper
    # (netns.create: one per namespace, 15-30 ms each) or with /proc/self (the main thread's namespace, wrong from
    # any other thread). The alternative, util-linux's unshare/umount, is a process per host.
    if getattr(_get_libc(), name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _libc_call("unshare", flags)


def in_thread(fn):
    """fn() in a new thread of its own, its result returned (its exception raised) here. A thread may change its
    own namespaces (unshare, setns) without touching the rest of the process, and the change ends with it."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="testbed-netns", daemon=True)
    t.start()
    try:
        t.join()
    except BaseException:  # Ctrl-C: let the thread finish (milliseconds), or it would create a namespace after
        t.join()  # the caller's rollback removed this topology's
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


def netlink_socket(netns_path: str) -> socket.socket:
    """An rtnetlink socket inside the namespace at `netns_path` (a socket belongs to the namespace it was
    made in, whichever thread uses it later): a thread enters the namespace, makes it and ends, with no
    process forked (pyroute2's NetNS forks a helper per socket)."""
    def make():
        fd = os.open(netns_path, os.O_RDONLY)
        try:
            pr_netns.setns(fd, libc=_get_libc())  # an open fd: pyroute2 calls setns(2) here (a path: it may fork)
        finally:
            os.close(fd)
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)

    return in_thread(make)


def iproute(netns_path: str) -> IPRoute:
    """pyroute2's IPRoute on the namespace at `netns_path` (the NetNS of pyroute2, without its fork), joined to
    no multicast group: it hears only the answers to its own requests."""
    return IPRoute(fileno=netlink_socket(netns_path).detach(), groups=0)


def create_netns(name: str) -> str:
    """A new network namespace at /run/netns/NAME (what `ip netns add` makes), with lo up and HOST_SYSCTLS
    set; its path. Made in a thread of this process, without forking: the thread unshares its network
    namespace, bind-mounts it (/proc/thread-self/ns/net) onto the path, sets it up and ends."""
    path = ns_path(name)

    def make():
        _unshare(CLONE_NEWNET)
        # pyroute2 makes /run/netns a shared mount (as iproute2 does), the mount point and the bind mount;
        # "thread-self": the namespace of this thread, not of the process's main thread.
        pr_netns.attach(name, "thread-self", libc=_get_libc())
        # This thread is in the namespace now: its /proc/sys/net and new sockets are the namespace's.
        with IPRoute(groups=0) as ip:
            ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
        for key, value in HOST_SYSCTLS.items():
            with open(f"/proc/sys/{key.replace('.', '/')}", "w") as f:
                f.write(value)

    in_thread(make)
    return path


def create_uts(path: str, hostname: str) -> None:
    """A UTS namespace whose hostname is `hostname`, kept alive by a bind mount onto the existing file at `path`
    (what `unshare --uts=PATH hostname NAME` makes), made in a thread of this process without forking."""
    def make():
        _unshare(CLONE_NEWUTS)
        socket.sethostname(hostname)  # this thread's UTS namespace, the new one
        _libc_call("mount", b"/proc/thread-self/ns/uts", os.fsencode(path), None, ctypes.c_ulong(MS_BIND), None)

    in_thread(make)


def unmount(path: str) -> None:
    """Detach the mount at `path` (a bind-mounted namespace); nothing if there is none."""
    try:
        _libc_call("umount2", os.fsencode(path), MNT_DETACH)
    except OSError:
        pass


@contextlib.contextmanager
def scratch_netns(purpose: str):
    """A throwaway namespace for probing what the kernel offers (never the host's own interfaces); yields
    its path and removes it. Raises OSError/NetlinkError if namespaces cannot be made at all."""
    name = f"{PREFIX}_{purpose}.{os.getpid()}"
    create_netns(name)
    try:
        yield ns_path(name)
    finally:
        try:
            pr_netns.remove(name, libc=_get_libc())
        except OSError:
            pass


def remove_netns(name: str) -> None:
    path = ns_path(name)
    if os.path.exists(path):
        kill_processes_in_netns(path)
        try:
            pr_netns.remove(name, libc=_get_libc())
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
