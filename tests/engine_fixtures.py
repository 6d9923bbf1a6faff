"""Real-network helpers for the engine tests and benchmark: two namespaces joined by a veth, processes in
them, engines on the link, all torn down by ``close()`` even when a test fails.

Namespaces are named ``tbE-<hex>-a`` / ``tbE-<hex>-b`` (the engine tests' own prefix), addresses
10.99.0.1/24 (a) and 10.99.0.2/24 (b), interface ``veth0`` on both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from pyroute2 import NetNS, netns
from scipy import stats

from testbed import procs
from testbed.engine.manager import EngineSpec, engine_alive, start_engine, stop_engine
from testbed.procs import read_json_line  # noqa: F401  (tests import it from here)

PREFIX = "tbE"
ADDR = {"a": "10.99.0.1", "b": "10.99.0.2"}
IFACE = "veth0"
PYTHON = sys.executable

# Every statistical check of an engine is a 99.9 % binomial interval (the engines' tests share these).
ALPHA = 0.001
MB = 1_000_000


def binomial_interval(n: int, p: float) -> tuple[int, int]:
    return int(stats.binom.ppf(ALPHA / 2, n, p)), int(stats.binom.isf(ALPHA / 2, n, p))


def stop_elsewhere(handle) -> dict:
    """Stop an engine from another process that knows only its handle's JSON (a handle is plain data); its final
    counters."""
    code = ("import json,sys; from testbed.engine.manager import EngineHandle, stop_engine; "
            "print(json.dumps(stop_engine(EngineHandle.from_dict(json.loads(sys.stdin.read())))))")
    r = subprocess.run([PYTHON, "-c", code], input=json.dumps(handle.to_dict()), capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def paused_transfer(link, handle, n1: int, n2: int):
    """A seeded transfer of n1 + n2 bytes over `link` (port 5003) whose sender pauses after n1 bytes, once the
    engine of `handle` has seen all of them: (receiver, sender); write "go\\n" to the sender's stdin to go on."""
    from testbed.engine.manager import engine_stats

    rx = link.probe("b", "recv", "--port", 5003, "--bytes", n1 + n2, "--seed", 14)
    read_json_line(rx, "listening")
    tx = link.probe("a", "send", "--host", link.addr["b"], "--port", 5003, "--bytes", n1 + n2, "--seed", 14,
                    "--pause-at", n1, "--sport", 42003, stdin=subprocess.PIPE)
    read_json_line(tx, "paused")
    deadline = time.monotonic() + 20
    while engine_stats(handle)["bits_seen"] < n1 * 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    return rx, tx


def assert_two_epochs(final: dict, n1: int, n2: int, received: dict, sent: dict) -> None:
    """A run whose BER went from 1e-5 (n1 bytes) to 1e-3 (n2 bytes) live: each epoch counted exactly its bytes and
    flipped within its interval, and the receiver counted every flip (assert_flips_delivered: but those of a
    segment lost after the engine, bounded at the higher BER)."""
    e1, e2 = final["epochs"]
    assert (e1["ber"], e2["ber"]) == (1e-5, 1e-3)
    assert e1["bits_seen"] == n1 * 8 and e2["bits_seen"] == n2 * 8
    assert_ber(e1["bits_flipped"], e1["bits_seen"], 1e-5)
    assert_ber(e2["bits_flipped"], e2["bits_seen"], 1e-3)
    assert final["bits_flipped"] == e1["bits_flipped"] + e2["bits_flipped"]
    assert_flips_delivered(final["bits_flipped"], received["bit_errors"], sent, 1e-3)


def assert_flips_delivered(flipped: int, bit_errors: int, sender: dict, ber: float) -> None:
    """The receiver counted every bit the engine flipped (`bit_errors` of the probe's receiver, `flipped` of the
    engine), unless a segment was lost after the engine: the receiver's backlog full while the loaded machine
    deschedules it (TCPBacklogDrop). Its retransmission passes clean (bytes seen before are not drawn again,
    docs/engine.md), so the flips of the lost copy are counted and never delivered. Every lost byte is
    retransmitted, so the flips missing are at most those drawn on the retransmitted bytes: none when the
    sender (`sender`: the probe sender's result) retransmitted nothing, else within the 99.9 % binomial bound
    on `retrans_segs` x `mss` bytes at `ber`. Never more received than flipped."""
    missing = flipped - bit_errors
    bits = sender["retrans_segs"] * sender["mss"] * 8
    hi = binomial_interval(bits, ber)[1] if bits else 0
    assert 0 <= missing <= hi, (f"engine flipped {flipped} bits, the receiver found {bit_errors}; the sender "
                                f"retransmitted {sender['retrans_segs']} segments of <= {sender['mss']} bytes, "
                                f"which carry at most {hi} flips at ber {ber}")


def assert_ber(flips: int, bits: int, ber: float) -> None:
    lo, hi = binomial_interval(bits, ber)
    assert lo <= flips <= hi, f"{flips} flips in {bits} bits: outside the 99.9% interval [{lo}, {hi}] of BER {ber}"


class VethLink:
    """Namespaces a and b joined by one veth; tracks everything it starts."""

    def __init__(self, mtu: int = 1500):
        tag = uuid.uuid4().hex[:6]
        self.ns = {"a": f"{PREFIX}-{tag}-a", "b": f"{PREFIX}-{tag}-b"}
        self.path = {k: f"/run/netns/{v}" for k, v in self.ns.items()}
        self.addr = dict(ADDR)
        self.iface = IFACE
        self.procs: list[subprocess.Popen] = []
        self.engines: list = []
        self.tmp = Path(tempfile.mkdtemp(prefix="tbE-"))
        self._queue = 0
        created = []
        try:
            for side in ("a", "b"):
                netns.create(self.ns[side])
                created.append(side)
            with NetNS(self.ns["a"]) as ns:
                ns.link("add", ifname=IFACE, kind="veth", peer={"ifname": IFACE, "net_ns_fd": self.ns["b"]})
            for side in ("a", "b"):
                with NetNS(self.ns[side]) as ns:
                    idx = ns.link_lookup(ifname=IFACE)[0]
                    ns.link("set", index=idx, mtu=mtu)
                    ns.addr("add", index=idx, address=self.addr[side], prefixlen=24)
                    ns.link("set", index=idx, state="up")
                    ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        except BaseException:
            self.close()
            raise

    # -- processes ---------------------------------------------------------------------------------------------

    def popen(self, side: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``side`` (its own process group; killed by close())."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = subprocess.Popen(["nsenter", f"--net={self.path[side]}", "--", *argv], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def probe(self, side: str, *args: str, **kw) -> subprocess.Popen:
        return self.popen(side, [PYTHON, "-m", "testbed.bench.probe", *map(str, args)], **kw)

    def run(self, side: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", f"--net={self.path[side]}", "--", *argv], capture_output=True,
                              text=True, timeout=timeout)

    def snmp(self, side: str, group: str = "Tcp") -> dict[str, int]:
        """/proc/net/snmp counters of namespace ``side`` (nstat would share one history across netns)."""
        out = self.run(side, ["cat", "/proc/net/snmp"]).stdout
        lines = [line.split() for line in out.splitlines() if line.startswith(group + ":")]
        return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:])}

    # TcpExt counters of a receiver that dropped segments it had been handed (socket backlog or receive queue full,
    # out-of-order queue pruned): on a loaded machine a descheduled reader makes its socket drop
    RECEIVER_DROPS = ("TCPBacklogDrop", "TCPRcvQDrop", "TCPOFODrop", "TCPZeroWindowDrop", "RcvPruned", "OfoPruned")

    def tcp_ext(self, side: str) -> dict[str, int]:
        """/proc/net/netstat (TcpExt, IpExt) counters of namespace ``side``."""
        lines = self.run(side, ["cat", "/proc/net/netstat"]).stdout.splitlines()
        return {k: int(v) for a, b in zip(lines[::2], lines[1::2]) for k, v in zip(a.split()[1:], b.split()[1:])}

    def losses(self) -> dict[str, int]:
        """Segments lost on the link's way a -> b other than by an engine: the receiver's drops (RECEIVER_DROPS in
        b) and the veth ends' dropped counters (a full backlog of the receiving CPU); only the nonzero ones."""
        ext = self.tcp_ext("b")
        out = {k: ext.get(k, 0) for k in self.RECEIVER_DROPS}
        for side in ("a", "b"):
            st = json.loads(self.run(side, ["ip", "-s", "-j", "link", "show", self.iface]).stdout)[0]["stats64"]
            out[f"{side}_rx_dropped"] = st["rx"]["dropped"]
            out[f"{side}_tx_dropped"] = st["tx"]["dropped"]
        return {k: v for k, v in out.items() if v}

    def tc_drops(self, side: str) -> int:
        """Packets a tc program on ``side``'s interface dropped (TC_ACT_SHOT counts as a drop of the clsact qdisc)."""
        q = json.loads(self.run(side, ["tc", "-s", "-j", "qdisc", "show", "dev", self.iface]).stdout or "[]")
        return sum(int(x.get("drops", 0)) for x in q if x.get("kind") == "clsact")

    # -- engines -----------------------------------------------------------------------------------------------

    def engine_spec(self, side: str = "a", hook: str = "egress", **kw) -> EngineSpec:
        self._queue += 1
        name = f"e{self._queue}"
        base = dict(netns=self.path[side], iface=self.iface, hook=hook, queue_num=self._queue,
                    topology="tbE", link="a-b", direction="a->b" if side == "a" else "b->a",
                    control_socket=str(self.tmp / f"{name}.sock"), stats_file=str(self.tmp / f"{name}.stats.json"))
        base.update(kw)
        return EngineSpec(**base)

    def start_engine(self, side: str = "a", hook: str = "egress", **kw):
        """An engine on the egress of ``side`` (or ingress), registered for teardown."""
        h = start_engine(self.engine_spec(side, hook, **kw), python=PYTHON)
        self.engines.append(h)
        return h

    # -- teardown ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        errors = []
        for h in self.engines:
            try:
                stop_engine(h, timeout=5)
            except Exception as e:  # keep tearing down
                errors.append(f"stop_engine: {e}")
                if engine_alive(h.pid, h.start_time):
                    procs.kill_group(h.pid)
        for p in self.procs:
            if p.poll() is None:
                procs.kill_group(p.pid)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {p.pid} did not die")
            for f in (p.stdout, p.stderr, p.stdin):
                if f is not None:
                    f.close()
        for name in self.ns.values():
            if os.path.exists(f"/run/netns/{name}"):
                for pid in procs.in_namespace(f"/run/netns/{name}", "net"):  # anything still inside
                    procs.kill(pid)
                try:
                    netns.remove(name)
                except OSError as e:
                    errors.append(f"netns remove {name}: {e}")
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextmanager
def veth_link(mtu: int = 1500):
    link = VethLink(mtu=mtu)
    try:
        yield link
    finally:
        link.close()


def checked_veth_link(*checks):
    """For a test's `link` fixture (`yield from checked_veth_link()`): a veth link, and after the test none of
    its namespaces left, and each check(link) holds."""
    with veth_link() as vl:
        yield vl
    for name in vl.ns.values():
        assert not os.path.exists(f"/run/netns/{name}"), f"namespace {name} left behind"
    for check in checks:
        check(vl)


def transfer(link: VethLink, nbytes: int, seed: int, port: int = 5001, sport: int = 0,
             timeout: float = 120) -> tuple[dict, dict]:
    """Send ``nbytes`` of probe bytes a -> b; return (sender result, receiver result). The source port is
    fixed (``sport`` or 42000 + port % 1000) so the flow key, hence the offset-keyed flips, repeat run to run."""
    sport = sport or 42000 + port % 1000
    rx = link.probe("b", "recv", "--port", port, "--bytes", nbytes, "--seed", seed, "--timeout", timeout)
    read_json_line(rx, "listening")
    tx = link.probe("a", "send", "--host", link.addr["b"], "--port", port, "--bytes", nbytes, "--seed", seed,
                    "--sport", sport, "--timeout", timeout)
    sres = read_json_line(tx, "result", timeout)["result"]
    rres = read_json_line(rx, "result", timeout)["result"]
    tx.wait(10)
    rx.wait(10)
    return sres, rres
