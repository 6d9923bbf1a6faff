"""Test helper: a real two-node Slurm cluster on this host (Debian's slurm-wlm and munge; `make slurm-deps`).

    with slurm_cluster() as c:                   # controller `ctl`, nodes tbn1 and tbn2
        c.run(["sinfo"])                          # a client command, as on the cluster's login node
        subprocess.run(c.login(["python", "-m", "testbed", "run", ...]), env=c.env())

Layout (tag T, by default from the pid, so that parallel test sessions never collide), measured-facts.md section 5:
- `tbslurmT-ul`: the underlay, a Linux bridge `br0` (no address) that joins the three namespaces below;
- `tbslurmT-ctl`: the controller (and login node): slurmctld, 198.18.0.2, hostname `ctl` (its own UTS namespace);
- `tbslurmT-n1`, `tbslurmT-n2`: the nodes tbn1 and tbn2, a slurmd each, 198.18.0.11/.12, CPUs=2 each.
- munged in the root namespace with its own key and socket (a file, so every namespace reaches it);
- slurm.conf, cgroup.conf, spool, state, logs and the munge files in one temporary directory (mode 0755: an
  unprivileged submitter reaches the munge socket and slurm.conf).
Daemons are started with `nsenter --net` (not `ip netns exec`, whose private mount namespace would hide the
namespaces that a job's wire point creates under /run/netns). Jobs run in their node's network namespace and
hostname and share this host's file system, users and kernel. No accounting (accounting_storage/none): job
states come from squeue/scontrol (testbed/experiments/slurm.py).

Jobs get TESTBED_PREFIX=tbslurmT. and TESTBED_STATE_DIR from `env()`, so that the topologies of wire points are
this cluster's own. On exit, even on failure or Ctrl-C: every job is cancelled, the topologies of the cluster's
state directory are taken down, every process in the cluster's namespaces killed, the daemons stopped, every
namespace of the tag deleted and the temporary directory removed; a RuntimeError says what could not be.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from testbed import nsutil

NETNS_DIR = Path("/run/netns")
SUBNET = "198.18.0."
CTL_ADDRESS = SUBNET + "2"
NODES = {"tbn1": SUBNET + "11", "tbn2": SUBNET + "12"}
START_TIMEOUT_S = 60.0
_counter = itertools.count()


def available() -> str | None:
    """None when the cluster can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root (namespaces, daemons)"
    missing = [p for p in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch")
               if not os.path.exists(p)]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)}): make slurm-deps"
    try:
        import submitit  # noqa: F401
    except ImportError:
        return "submitit is not installed (pip install -e '.[slurm]')"
    return None


class Cluster:
    def __init__(self, tag: str):
        self.tag = tag
        self.prefix = f"tbslurm{tag}"
        self.ul, self.ctl_ns = f"{self.prefix}-ul", f"{self.prefix}-ctl"
        self.node_ns = {n: f"{self.prefix}-{n[2:]}" for n in NODES}
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        os.chmod(self.dir, 0o755)
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge" / "munge.socket"
        self.state_dir = self.dir / "testbed-state"
        self.testbed_prefix = f"{self.prefix}."
        self.daemons: dict[str, subprocess.Popen] = {}

    # -- what tests use ------------------------------------------------------------------------------------

    def env(self, **extra) -> dict:
        """The environment of a client on the login node (jobs inherit it: sbatch exports it)."""
        env = {**os.environ, "SLURM_CONF": str(self.conf), "TESTBED_STATE_DIR": str(self.state_dir),
               "TESTBED_PREFIX": self.testbed_prefix}
        env.update(extra)
        return env

    def login(self, argv: list[str]) -> list[str]:
        """`argv` run on the login node (the controller's namespace, which reaches slurmctld)."""
        return ["nsenter", f"--net={NETNS_DIR / self.ctl_ns}", "--", *argv]

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(self.login(argv), capture_output=True, text=True, env=self.env(), timeout=60, **kw)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
        return r

    def log(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def jobs(self) -> list[str]:
        """Jobs Slurm still runs or queues (id, state, node)."""
        out = self.run(["squeue", "-h", "-o", "%i %T %N"], check=False).stdout
        return [line for line in out.splitlines() if line.strip()]

    # -- set-up --------------------------------------------------------------------------------------------

    def setup(self) -> None:
        d = self.dir
        for sub in ("munge", "ctld", "spool/tbn1", "spool/tbn2", "testbed-state"):
            (d / sub).mkdir(parents=True)
        os.chmod(d / "munge", 0o755)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
        self.conf.write_text(self._slurm_conf())
        os.chmod(self.conf, 0o644)
        self._daemon("munged", ["/usr/sbin/munged", "--foreground", "--force", f"--key-file={key}",
                                f"--socket={self.socket}", f"--pid-file={d / 'munge' / 'munged.pid'}",
                                f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munge' / 'seed'}"])
        self._wait(lambda: self.socket.exists(), "munged's socket", "munged")
        os.chmod(self.socket, 0o777)

        _ip("netns", "add", self.ul)
        _ip("-n", self.ul, "link", "set", "lo", "up")
        _ip("-n", self.ul, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.ul, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate([(self.ctl_ns, CTL_ADDRESS)]
                                          + [(self.node_ns[n], a) for n, a in NODES.items()]):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.ul)
            _ip("-n", self.ul, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        self._daemon("slurmctld", self._in(self.ctl_ns, "ctl", f"exec /usr/sbin/slurmctld -D -f {self.conf}"))
        for n, ns in self.node_ns.items():
            self._daemon(f"slurmd-{n}", self._in(ns, n, f"exec /usr/sbin/slurmd -D -f {self.conf}"))
        self._wait(self._nodes_idle, "both nodes idle", "slurmctld")

    def _in(self, ns: str, hostname: str, command: str) -> list[str]:
        return ["nsenter", f"--net={NETNS_DIR / ns}", "--", "unshare", "--uts", "--", "sh", "-c",
                f"hostname {hostname} && {command}"]

    def _daemon(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / f"{name}.out", "wb")
        try:
            self.daemons[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                                  env=self.env(), start_new_session=True)
        finally:
            out.close()

    def _nodes_idle(self) -> bool:
        r = subprocess.run(self.login(["sinfo", "-h", "-N", "-o", "%N %T"]), capture_output=True, text=True,
                           env=self.env(), timeout=30)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return set(states) == set(NODES) and all(s == "idle" for s in states.values())

    def _wait(self, ready, what: str, log: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not after {START_TIMEOUT_S:g} s"
                logs = "\n".join(f"--- {n}:\n{self.log(n)[-2000:]}{_read(self.dir / f'{n}.out')[-1000:]}"
                                 for n in self.daemons)
                raise RuntimeError(f"slurm cluster {self.tag}: waiting for {what}: {why}\n{logs}")
            time.sleep(0.5)

    def _slurm_conf(self) -> str:
        d = self.dir
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=2 RealMemory=8000 State=UNKNOWN" for n, a in NODES.items())
        return f"""# made by tests/slurmcluster.py
ClusterName={self.prefix}
SlurmctldHost=ctl({CTL_ADDRESS})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=300
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    # -- cleanup -------------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        problems = []
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            subprocess.run(self.login(["scancel", "--full", "--partition=debug"]), capture_output=True,
                           env=self.env(), timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self._jobs_active():
                time.sleep(0.5)
        # the topologies jobs brought up (wire points): their namespaces are this cluster's (TESTBED_PREFIX)
        for state in sorted(self.state_dir.glob("*")) if self.state_dir.exists() else []:
            r = subprocess.run([sys.executable, "-m", "testbed", "down", state.name], capture_output=True, text=True,
                               env=self.env(), timeout=120)
            if r.returncode:
                problems.append(f"testbed down {state.name}: {r.stderr.strip()[-300:]}")
        for name in sorted(self.daemons, key=lambda n: n == "munged"):  # munged last
            p = self.daemons[name]
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # job steps (slurmstepd and what it ran) may outlive slurmd: nothing of the cluster keeps running
        for ns in sorted(self.namespaces(), key=lambda s: (s.startswith(f"{self.prefix}-"), s)):
            try:
                nsutil.remove_netns(ns)  # its processes killed first
            except Exception as e:  # noqa: BLE001 - keep cleaning
                problems.append(f"removing namespace {ns}: {e}")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.namespaces():
            problems.append(f"namespaces left: {self.namespaces()}")
        if problems:
            raise RuntimeError(f"slurm cluster {self.tag} cleanup: " + "; ".join(problems))

    def _jobs_active(self) -> bool:
        r = subprocess.run(self.login(["squeue", "-h", "-o", "%i"]), capture_output=True, text=True, env=self.env(),
                           timeout=30)
        return r.returncode == 0 and bool(r.stdout.strip())

    def namespaces(self) -> list[str]:
        """Every namespace of the tag: underlay, controller, nodes, and the topologies jobs made."""
        try:
            return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(self.prefix))
        except FileNotFoundError:
            return []


@contextmanager
def slurm_cluster(tag: str | None = None) -> Iterator[Cluster]:
    tag = tag if tag is not None else f"{os.getpid() % 100000:x}{next(_counter)}"
    if not re.fullmatch(r"[a-z0-9]{1,8}", tag):
        raise ValueError(f"tag {tag!r}: 1-8 characters of a-z, 0-9")
    c = Cluster(tag)
    if c.namespaces():
        raise RuntimeError(f"namespaces of tag {tag!r} exist already: {c.namespaces()}")
    try:
        c.setup()
        yield c
    finally:
        c.cleanup()


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
