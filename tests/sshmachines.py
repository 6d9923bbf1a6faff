"""Test helper: "machines" on this host, each a network namespace running a real OpenSSH server.

    with ssh_machines(2) as machines:          # m1 = 192.0.2.11, m2 = 192.0.2.12
        inv = inventory(machines)              # or inventory_yaml(machines) for a --machines file
        with Remote.connect(inv["m1"]) as r:
            r.run(["id", "-u"])

Layout (tag T, by default from the pid, so that parallel test sessions never collide):
- `tbmT-ul`: the underlay, a Linux bridge `br0` holding 192.0.2.1/24;
- `tbmT-m1`, `tbmT-m2`, ...: machine i has `lo` and `ul0` (a veth into br0) with 192.0.2.(10+i)/24, and its
  own sshd (Debian's /usr/sbin/sshd; the system's ssh service is never used) listening on 192.0.2.(10+i):22,
  with its own host key, root login with a key made for the session, and SetEnv TESTBED_STATE_DIR (its own
  state directory), TESTBED_PREFIX=tbmTmi. (its own namespace prefix, so that its `testbed down --all` sweeps
  its namespaces only), TMPDIR (its own, removed at the end; Remote.start's logs go there) and PATH (the venv's
  bin first; on this host root's ~/.bashrc, which bash reads for SSH commands, puts pyenv's and cargo's first
  again, so name commands by absolute path, as the inventory's `testbed:` does).
- `known_hosts` in the session's directory lists every machine's host key: the inventory points at it
  (`known_hosts:`), so the controller checks the machines' keys as it would any machine's.
Host interfaces and routes are never touched: the controller (the test process, in the root namespace) reaches
the machines only over SSH, through a proxy command that relays the connection from inside the underlay
namespace (`nsenter --net=... python relay.py %h %p`, the machine's `proxy_command`).

sshd is started with `nsenter --net` (network namespace only), not `ip netns exec`: the latter gives the
process a private (slave) mount namespace, so the namespaces a machine's testbed creates (bind mounts under
/run/netns) would be invisible from the root namespace and be left behind as dead files.

On exit, even on failure or Ctrl-C: every process in the machines' and the underlay's namespaces (sshd, its
sessions, processes started there, relays) is killed, every namespace of the tag is deleted (the machines'
own `tbmTmi.*` included), and the temporary directory removed; a RuntimeError says what could not be.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

from testbed import nsutil
from testbed.machines.inventory import Inventory, Machine, parse_inventory
from testbed.machines.remote import RELAY, known_hosts_line
from testbed.machines.vm import SSHD_COMMON

SSHD = "/usr/sbin/sshd"
NETNS_DIR = Path("/run/netns")
VENV_BIN = Path(sys.executable).parent
SUBNET_PREFIX = "192.0.2."
UNDERLAY_ADDRESS = "192.0.2.1"
UNDERLAY_IFACE = "ul0"
START_TIMEOUT_S = 15.0
_counter = itertools.count()


@dataclass(frozen=True)
class TestMachine:
    """One machine made by ssh_machines."""

    __test__ = False  # not a pytest test class

    name: str
    address: str
    port: int
    user: str
    key: str            # the client's private key (the session's)
    netns: str          # the machine's namespace name (its path: /run/netns/NAME)
    prefix: str         # its TESTBED_PREFIX
    state_dir: str      # its TESTBED_STATE_DIR
    proxy_command: str  # how the controller reaches it (%h, %p: address and port)
    underlay_iface: str = UNDERLAY_IFACE
    underlay_netns: str = ""  # the underlay's namespace (the bridge; the proxies run there)
    dir: str = ""       # its sshd config, host key and log
    known_hosts: str = ""  # the session's known_hosts file (every machine's host key)

    @property
    def host_key(self) -> str:
        """Its host public key file."""
        return str(Path(self.dir) / "host_ed25519.pub")

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def sshd_log(self) -> str:
        try:
            return (Path(self.dir) / "sshd.log").read_text()
        except OSError:
            return ""

    def machine(self, testbed_cmd: str | None = None, **overrides) -> Machine:
        """This machine as an inventory entry (fields overridable, e.g. address=, key=, testbed=)."""
        m = Machine(name=self.name, address=self.address, user=self.user, port=self.port, key=self.key,
                    testbed=testbed_cmd or venv_testbed(), underlay_iface=self.underlay_iface,
                    proxy_command=self.proxy_command, known_hosts=self.known_hosts or None)
        return replace(m, **overrides)


def venv_testbed() -> str:
    """The absolute path of this venv's `testbed` script."""
    path = VENV_BIN / "testbed"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: install the project into the venv (pip install -e .)")
    return str(path)


def inventory_yaml(machines: list[TestMachine], testbed_cmd: str | None = None) -> str:
    """A machines file for them (testbed: the venv's testbed script unless `testbed_cmd`)."""
    inv = Inventory({m.name: m.machine(testbed_cmd) for m in machines})
    return inv.to_yaml()


def inventory(machines: list[TestMachine], testbed_cmd: str | None = None) -> Inventory:
    """The Inventory of `inventory_yaml(machines)` (through the parser, as --machines would read it)."""
    return parse_inventory(inventory_yaml(machines, testbed_cmd), "<ssh_machines>")


def namespaces_of(tag: str) -> list[str]:
    """Every namespace of a tag: the underlay, the machines, and those the machines' testbeds made."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(f"tbm{tag}-") or n.startswith(f"tbm{tag}m"))


def new_tag() -> str:
    return f"{os.getpid():x}-{next(_counter)}"


@contextmanager
def ssh_machines(n: int, tag: str | None = None) -> Iterator[list[TestMachine]]:
    """`n` machines (1 <= n <= 200), each a namespace with its own sshd; see the module docstring."""
    if not 1 <= n <= 200:
        raise ValueError(f"n={n}: between 1 and 200 machines")
    tag = tag if tag is not None else new_tag()
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,11}", tag):
        raise ValueError(f"tag {tag!r}: 1-12 characters of a-z, 0-9, '-'")
    if namespaces_of(tag):
        raise RuntimeError(f"namespaces of tag {tag!r} exist already: {namespaces_of(tag)}")
    lab = _Lab(n, tag)
    try:
        lab.setup()
        yield lab.machines
    finally:
        lab.cleanup()


class _Lab:
    def __init__(self, n: int, tag: str):
        self.n, self.tag = n, tag
        self.ul = f"tbm{tag}-ul"
        self.dir = Path(tempfile.mkdtemp(prefix=f"tbm{tag}-"))
        self.machines: list[TestMachine] = []
        self.sshd: dict[str, subprocess.Popen] = {}

    # -- setup ---------------------------------------------------------------------------------------------

    def setup(self) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        key = self.dir / "client_key"
        _keygen(key)
        (self.dir / "authorized_keys").write_text((self.dir / "client_key.pub").read_text())
        relay = self.dir / "relay.py"
        relay.write_text(RELAY)

        _ip("netns", "add", self.ul)
        _nsexec(self.ul, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
        _ip("-n", self.ul, "link", "set", "lo", "up")
        _ip("-n", self.ul, "link", "add", "br0", "type", "bridge")
        # an address without a machine answers "no route to host" within ~1 s instead of ~3 s
        _nsexec(self.ul, "sysctl", "-qw", "net.ipv4.neigh.br0.retrans_time_ms=300")
        _ip("-n", self.ul, "addr", "add", f"{UNDERLAY_ADDRESS}/24", "dev", "br0")
        _ip("-n", self.ul, "link", "set", "br0", "up")
        proxy = (f"nsenter --net={NETNS_DIR / self.ul} -- {sys.executable} -I -S {relay} %h %p")

        for i in range(1, self.n + 1):
            name, ns, address = f"m{i}", f"tbm{self.tag}-m{i}", f"{SUBNET_PREFIX}{10 + i}"
            mdir = self.dir / name
            state = mdir / "state"
            state.mkdir(parents=True)
            (mdir / "tmp").mkdir()
            _ip("netns", "add", ns)
            _nsexec(ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", UNDERLAY_IFACE, "netns", ns, "type", "veth", "peer", "name", name, "netns", self.ul)
            _ip("-n", self.ul, "link", "set", name, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", UNDERLAY_IFACE)
            _ip("-n", ns, "link", "set", UNDERLAY_IFACE, "up")
            prefix = f"tbm{self.tag}m{i}."
            _keygen(mdir / "host_ed25519")
            with open(self.dir / "known_hosts", "a") as kh:
                kh.write(known_hosts_line(address, 22, mdir / "host_ed25519.pub"))
            config = mdir / "sshd_config"
            config.write_text(_sshd_config(address, mdir, self.dir / "authorized_keys", state, prefix))
            log = open(mdir / "sshd.log", "wb")
            try:
                self.sshd[name] = subprocess.Popen(
                    ["nsenter", f"--net={NETNS_DIR / ns}", "--", SSHD, "-D", "-e", "-f", str(config)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            finally:
                log.close()
            self.machines.append(TestMachine(name=name, address=address, port=22, user="root", key=str(key),
                                             netns=ns, prefix=prefix, state_dir=str(state), proxy_command=proxy,
                                             underlay_netns=self.ul, dir=str(mdir),
                                             known_hosts=str(self.dir / "known_hosts")))
        for m in self.machines:
            self._wait_listening(m)

    def _wait_listening(self, m: TestMachine) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        proc = self.sshd[m.name]
        while True:
            log = m.sshd_log()
            if f"Server listening on {m.address} port {m.port}" in log:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"sshd of {m.name} ({m.netns}) exited with status {proc.returncode}:\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {m.name} ({m.netns}) does not listen on {m.address}:{m.port} after "
                                   f"{START_TIMEOUT_S:g} s:\n{log}")
            time.sleep(0.02)

    # -- cleanup -------------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        problems = []
        for name, proc in self.sshd.items():
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self.sshd.items():
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Machines' own namespaces first (hosts of topologies their testbeds made), then machines, underlay.
        for ns in sorted(namespaces_of(self.tag), key=lambda s: (not s.startswith(f"tbm{self.tag}m"), s)):
            path = str(NETNS_DIR / ns)
            try:
                nsutil.kill_processes_in_netns(path, grace_s=2.0)
            except Exception as e:  # noqa: BLE001 - keep cleaning
                problems.append(f"killing processes in {ns}: {e}")
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        shutil.rmtree(self.dir, ignore_errors=True)
        left = namespaces_of(self.tag)
        if left:
            problems.append(f"namespaces left: {left}")
        if problems:
            raise RuntimeError("ssh_machines cleanup: " + "; ".join(problems))


def _sshd_config(address: str, mdir: Path, authorized_keys: Path, state: Path, prefix: str) -> str:
    path = f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin"
    return f"""# test machine: made by tests/sshmachines.py
ListenAddress {address}
Port 22
AddressFamily inet
HostKey {mdir / 'host_ed25519'}
PidFile {mdir / 'sshd.pid'}
AuthorizedKeysFile {authorized_keys}
{SSHD_COMMON}SetEnv TESTBED_STATE_DIR={state} TESTBED_HISTORY_DIR={mdir / 'history'} TESTBED_PREFIX={prefix} TMPDIR={mdir / 'tmp'} PATH={path}
"""


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "testbed-test", "-f", str(path)],
                   check=True, capture_output=True)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _nsexec(ns: str, *argv: str) -> None:
    r = subprocess.run(["nsenter", f"--net={NETNS_DIR / ns}", "--", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {ns}: {r.stderr.strip()}")
