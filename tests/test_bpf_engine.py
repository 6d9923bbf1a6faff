"""The bpf engine (testbed/engine/bpf: a tc program, no process) on a real link: the engine tests' statistical
checks against it. Two namespaces joined by a veth (engine_fixtures.veth_link), known bytes counted by the
receiving application, the engine's counters read from its maps. Every test tears everything down and checks
that no pinned map, filter, clsact qdisc or offload change is left."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import leftovers, tb_cli, unique_name
from engine_fixtures import (ALPHA, MB, PYTHON, assert_ber, assert_flips_delivered, assert_two_epochs, paused_transfer,
                             read_json_line, stop_elsewhere, transfer, checked_veth_link)
from scipy import stats

from testbed.engine.bpf import maps, pins
from testbed.engine.manager import (
    EngineError,
    attach_engine,
    detach_engine,
    EngineHandle,
    engine_stats,
    handle_alive,
    set_engine,
    start_engine,
    stop_engine,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, tc, bpf)")



def _bpf_available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root"
    from testbed.engine.bpf.engine import available
    return available()


@pytest.fixture(scope="module", autouse=True)
def bpf_here():
    ok, why = _bpf_available()
    if not ok:
        pytest.skip(f"the bpf engine cannot run here: {why}")


def _no_pins_left(vl) -> None:
    assert not pins.engine_pin_dirs(pins.pins_under(vl.tmp)), "pinned maps left behind"


@pytest.fixture
def link():
    yield from checked_veth_link(_no_pins_left)


def bpf(link, side: str = "a", hook: str = "egress", **kw) -> EngineHandle:
    """A bpf engine on `side`'s egress (or ingress), with the link's other end named (for checksum keep)."""
    other = "b" if side == "a" else "a"
    return link.start_engine(side, hook, engine="bpf", peer_netns=link.path[other], peer_iface=link.iface, **kw)


def clean_after_stop(link, h: EngineHandle) -> None:
    """What a stopped engine must leave: no pins, no filter, no clsact qdisc, the offload as it was."""
    final = stop_engine(h)
    assert final["alive"] is False and not handle_alive(h)
    assert not Path(h.bpf["pin_dir"]).exists()
    for side in ("a", "b"):
        assert "clsact" not in link.run(side, ["tc", "qdisc", "show", "dev", link.iface]).stdout
        assert "tx-checksumming: on" in link.run(side, ["ethtool", "-k", link.iface]).stdout
    return final


# -- the reference: the program's flips computed in Python from the documented PRNG and gap sampler ------------

M64 = (1 << 64) - 1
NEVER = 1 << 62


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Reference:
    """flip.c's stream (splitmix64, digit-sampled geometric gaps, Gilbert-Elliott sojourns) in Python."""

    def __init__(self, ber: float, error_model: dict, seed: int, generation: int = 0):
        self.tables, pi_bad = maps.model_tables(error_model, ber)
        self.s = _mix(seed ^ _mix((generation + 0x5851F42D4C957F2D) & M64))
        self.bad = 1 if self.next() < pi_bad else 0
        self.pos = 0
        self.soj_end = self._add(0, self.gap(3 if self.bad else 2))
        self.next_flip = self._add(M64, self.gap(1 if self.bad else 0))  # pos - 1 + G

    def next(self) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        return _mix(self.s)

    def gap(self, t: int) -> int:
        ndig, never, thr = self.tables[t]
        if never:
            return NEVER
        block = 8 if ndig <= 8 else 16 if ndig <= 16 else 32 if ndig <= 32 else 64
        x = 0
        for k in range(block):
            if self.next() < thr[k]:
                x |= 1 << k
        return x + 1

    @staticmethod
    def _add(a: int, g: int) -> int:
        r = (a + g) & M64
        return NEVER if g >= NEVER or r >= NEVER else r

    def flips(self, nbits: int) -> list[int]:
        """Positions (relative) of the flips among the next `nbits` eligible bits."""
        start, end, out = self.pos, self.pos + nbits, []
        while True:
            if self.next_flip < self.soj_end and self.next_flip < end:
                out.append(self.next_flip - start)
                self.next_flip = self._add(self.next_flip, self.gap(1 if self.bad else 0))
            elif self.soj_end < end:
                se = self.soj_end
                self.bad ^= 1
                self.soj_end = self._add(se, self.gap(3 if self.bad else 2))
                self.next_flip = self._add((se - 1) & M64, self.gap(1 if self.bad else 0))
            else:
                break
        self.pos = end
        return out


def test_gap_tables_are_the_geometric_distribution():
    """The digit sampler's law: P(G = g) from the tabulated digit probabilities equals Geometric(p) exactly (to
    double precision) over the bulk of the distribution; the truncated tail is below 2^-64."""
    for p in (1e-9, 1e-6, 1e-4, 0.01, 0.5, 1.0):
        ndig, never, thr = maps.gap_table(p)
        assert not never and ndig <= 64
        r = [t / 2.0 ** 64 for t in thr]
        for g in (1, 2, 3, 17, 1000, int(1 / p) if p < 1 else 1, int(5 / p) if p < 1 else 1):
            x = g - 1
            if x >> ndig:
                continue
            prob = 1.0
            for k in range(ndig):
                prob *= r[k] if (x >> k) & 1 else 1.0 - r[k]
            exact = p * math.exp(x * math.log1p(-p)) if p < 1 else float(x == 0)
            assert prob == pytest.approx(exact, rel=1e-9, abs=1e-300), (p, g, prob, exact)
        if p < 1:
            assert (1 - p) ** (2 ** ndig) < 2.0 ** -60  # the truncated tail
    assert maps.gap_table(0.0)[1] == 1  # never
    # and the sampler that uses the tables (Reference mirrors flip.c; test_same_seed_same_packets_same_flips
    # checks that the program draws exactly what it draws): sample means of Geometric(p) gaps
    ref = Reference(1e-4, {"type": "bernoulli"}, seed=3)
    for p in (0.5, 1 / 64, 1e-3):
        ref.tables[0] = maps.gap_table(p)
        g = np.array([ref.gap(0) for _ in range(20000)], dtype=float)
        sd = ((1 - p) / p ** 2 / g.size) ** 0.5
        assert abs(g.mean() - 1 / p) < 4 * sd and g.min() >= 1, (p, g.mean())


# -- checksum fix: corrupted bytes reach the application, exactly as counted -----------------------------------

def lossless(link, attempt, tries: int = 3, port0: int = 5001, keep_engine: bool = False):
    """``attempt(port)`` (engine started, transfer, stats read) on a path that lost nothing after the engine.
    The engine's exactness (docs/engine.md) holds for what reaches the application only if no copy of a segment is
    lost on the way: a receiver that drops one it was handed (a full socket backlog while the loaded machine
    deschedules the reading process: TCPBacklogDrop) gets the retransmission, which passes clean, and sees fewer
    errors than were counted. Such an attempt tells nothing about the engine: its engine is stopped and the
    transfer repeated on a new connection, at most ``tries`` times. An engine's own drop never is (tc_drops)."""
    seen = []
    for i in range(tries):
        before = link.losses()
        h, *rest = attempt(port0 + i)
        assert link.tc_drops("a") == link.tc_drops("b") == 0  # the program drops nothing in fix mode
        lost = {k: v - before.get(k, 0) for k, v in link.losses().items() if v != before.get(k, 0)}
        if not lost:
            return (h, *rest)
        seen.append(lost)
        print(f"attempt {i + 1} lost segments on the path, not the engine: {lost}; again", file=sys.stderr)
        if not keep_engine:  # keep_engine: the attempts share one running engine (its stats read before and after)
            stop_engine(h)
    pytest.fail(f"every attempt lost segments on the path (not the engine): {seen}")


@pytest.mark.timeout(150)
def test_fix_app_bit_errors_equal_flips_at_1e4_with_gso(link):
    n, ber = 40 * MB, 1e-4

    def attempt(port):
        h = bpf(link, ber=ber, seed=1)
        _, rres = transfer(link, n, seed=11, port=port)
        return h, rres, engine_stats(h)

    h, rres, st = lossless(link, attempt)
    assert h.pid == 0 and h.bpf["attach"] == {"netns": link.path["a"], "iface": link.iface, "hook": "egress"}
    assert st["alive"] and st["engine"] == "bpf" and st["packets_errors"] == 0 and st["ring_overruns"] == 0
    assert rres["received"] == n
    assert st["bits_seen"] == n * 8  # every payload bit once: bytes sent before (retransmitted) pass clean
    assert rres["bit_errors"] == st["bits_flipped"] > 0
    assert st["flips_applied"] == st["bits_flipped"]
    assert_ber(st["bits_flipped"], st["bits_seen"], ber)
    assert st["packets_gso"] > 0 and st["packets_multiflip"] > 0  # super-packets corrupted whole, many flips each
    # fix mode drops nothing: the receiver found no bad checksum, and lossless saw no segment lost on the path.
    # TCP's own retransmissions are not counted against it: with nothing lost they are tail loss probes and
    # spurious timeouts of a receiver slow to acknowledge, as many as the load makes (CI: 45 of 27,646 segments)
    assert link.snmp("b")["InCsumErrors"] == 0
    clean_after_stop(link, h)


@pytest.mark.timeout(180)
def test_fix_binomial_interval_at_1e6(link):
    n, ber = 400 * MB, 1e-6  # ~3200 expected flips: the 99.9% interval is +-6%

    def attempt(port):
        h = bpf(link, ber=ber, seed=2)
        _, rres = transfer(link, n, seed=12, port=port)
        return h, rres, engine_stats(h)

    h, rres, st = lossless(link, attempt)
    assert st["bits_seen"] == n * 8 and rres["bit_errors"] == st["bits_flipped"] and st["packets_errors"] == 0
    assert_ber(st["bits_flipped"], st["bits_seen"], ber)
    clean_after_stop(link, h)


@pytest.mark.timeout(120)
def test_fix_on_the_ingress_hook(link):
    """Where a switch sends, the engine sits on the receiving host's ingress. Segments reach the hook out of
    order at times (veth hands a segment on from the backlog of the CPU its sender ran on): a late one is new
    data (hole_bits), not a retransmission, so every payload bit is counted once."""
    n, ber = 10 * MB, 1e-4

    def attempt(port):
        h = bpf(link, side="b", hook="ingress", ber=ber, seed=3)
        _, rres = transfer(link, n, seed=13, port=port)
        return h, rres, engine_stats(h)

    h, rres, st = lossless(link, attempt)
    assert st["attached"]["hook"] == "ingress" and st["packets_errors"] == 0
    assert st["bits_seen"] == n * 8 and rres["bit_errors"] == st["bits_flipped"] > 0, st
    assert_ber(st["bits_flipped"], st["bits_seen"], ber)
    clean_after_stop(link, h)


# -- Gilbert-Elliott ---------------------------------------------------------------------------------------------

BIT_ERRORS_RECEIVER = r"""
import json, socket, sys
import numpy as np
from testbed.bench.probe import CHUNK, expected_chunk
port, n, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); ls.bind(("0.0.0.0", port)); ls.listen(1)
print(json.dumps({"listening": port}), flush=True)
c, _ = ls.accept()
buf = bytearray(n); mv = memoryview(buf); got = 0
while got < n:
    k = c.recv_into(mv[got:])
    if not k:
        break
    got += k
c.close()  # before the (long) result line: the sender waits for the close, the test reads this line after it
exp = b"".join(expected_chunk(seed, i) for i in range((n + CHUNK - 1) // CHUNK))[:n]
x = np.frombuffer(buf, np.uint8) ^ np.frombuffer(exp, np.uint8)
bad = np.flatnonzero(x)
bits = np.flatnonzero(np.unpackbits(x[bad]).reshape(-1, 8))  # MSB first, as the engine numbers bits
pos = (bad[bits // 8].astype(np.int64) * 8 + bits % 8).tolist()
print(json.dumps({"result": {"received": got, "positions": pos}}), flush=True)
"""


def transfer_positions(link, nbytes: int, seed: int, port: int) -> list[int]:
    """Send probe bytes a -> b; the receiver reports the stream position of every wrong bit."""
    rx = link.popen("b", [PYTHON, "-c", BIT_ERRORS_RECEIVER, str(port), str(nbytes), str(seed)])
    read_json_line(rx, "listening")
    tx = link.probe("a", "send", "--host", link.addr["b"], "--port", port, "--bytes", nbytes, "--seed", seed,
                    "--sport", 42000 + port % 1000)
    read_json_line(tx, "result", 60)
    res = read_json_line(rx, "result", 60)["result"]
    assert res["received"] == nbytes
    return res["positions"]


def ge_count_sigma(nbits: int, ber: float, burst: float, bad_ber: float) -> float:
    """Asymptotic standard deviation of the flip count of a stationary Gilbert-Elliott chain (good_ber 0) over
    nbits (renewal-reward: one cycle = a good and a bad sojourn)."""
    p_bg = 1 / burst
    pi_b = ber / bad_ber
    p_gb = p_bg * pi_b / (1 - pi_b)
    e_cycle = 1 / p_bg + 1 / p_gb
    var_cycle = (bad_ber * (1 - bad_ber) / p_bg + (bad_ber - ber) ** 2 * (1 - p_bg) / p_bg ** 2
                 + ber ** 2 * (1 - p_gb) / p_gb ** 2)
    return (nbits / e_cycle * var_cycle) ** 0.5


@pytest.mark.timeout(150)
def test_gilbert_elliott_mean_ber_and_burst_length(link):
    """Mean BER within its (renewal-reward) 99.9% normal interval; the application sees exactly the engine's
    flips, in bursts; with bad_ber 1 every bad bit flips, so the runs of wrong bits the application sees are the
    bad sojourns: their mean length is the configured burst length (99.9% interval), as the engine counts it.
    Both transfers go through `lossless`: a segment the loaded receiver drops comes again clean (CI once saw
    28,157 wrong bits of 28,191 flips that way)."""
    ber, burst, n = 1e-4, 64.0, 40 * MB
    z = stats.norm.isf(ALPHA / 2)
    ge = {"type": "gilbert_elliott", "burst_length": burst}

    def csum_errors():
        return link.snmp("b")["InCsumErrors"]

    def attempt(port):
        h = bpf(link, ber=ber, seed=9, error_model=ge)
        csum0 = csum_errors()
        return h, transfer_positions(link, n, seed=18, port=port), engine_stats(h), csum0

    # Session 13's CI saw this fail twice in five runs with fewer wrong bits than flips and no path loss; 90 runs
    # since (quiet and loaded) never did. Should it come back, the message says which way the flips went: counted
    # but not written (flips_applied) or written into a segment whose checksum fix the receiver rejected.
    h, pos, st, csum0 = lossless(link, attempt, port0=5010)
    why = dict(st, wrong_bits=len(pos), receiver_csum_errors=csum_errors() - csum0)
    assert st["flips_applied"] == st["bits_flipped"], why
    assert st["bits_seen"] == n * 8 and len(pos) == st["bits_flipped"], why
    sigma = ge_count_sigma(n * 8, ber, burst, 0.5)
    assert abs(st["bits_flipped"] - ber * n * 8) <= z * sigma, (st["bits_flipped"], ber * n * 8, sigma)
    gaps = np.diff(pos)
    assert np.mean(gaps <= 16) > 0.9  # bursts: independent errors at 1e-4 would be ~1e4 bits apart
    clean_after_stop(link, h)

    def attempt_bad_ber_1(port):
        # the model changed on a running engine, as `testbed set` does
        h = bpf(link, ber=ber, seed=9, error_model=ge)
        set_engine(h, error_model={**ge, "bad_ber": 1.0})
        before, csum0 = engine_stats(h), csum_errors()
        return h, before, np.array(transfer_positions(link, n, seed=19, port=port)), engine_stats(h), csum0

    h, before, pos, st, csum0 = lossless(link, attempt_bad_ber_1, port0=5020)
    why = dict(st, wrong_bits=len(pos), receiver_csum_errors=csum_errors() - csum0)
    assert st["flips_applied"] - before["flips_applied"] == st["bits_flipped"] - before["bits_flipped"], why
    assert st["bits_seen"] - before["bits_seen"] == n * 8
    assert len(pos) == st["bits_flipped"] - before["bits_flipped"] > 0, why
    starts = np.flatnonzero(np.diff(pos, prepend=-2) != 1)
    runs = np.diff(np.append(starts, len(pos)))
    assert len(runs) > 300
    sd = ((1 - 1 / burst) * burst ** 2 / len(runs)) ** 0.5  # Geometric(1/burst) sojourns
    assert abs(runs.mean() - burst) <= z * sd, (runs.mean(), len(runs))
    bad_runs = st["bad_sojourns"] - before["bad_sojourns"]
    bad_bits = st["bad_sojourn_bits"] - before["bad_sojourn_bits"]
    assert abs(bad_runs - len(runs)) <= 2 and abs(bad_bits - runs.sum()) <= 4 * burst * 2
    clean_after_stop(link, h)


# -- checksum keep: the receiver drops exactly the corrupted segments --------------------------------------------

@pytest.mark.timeout(90)
def test_keep_receiver_drops_exactly_the_corrupted_segments(link):
    """keep: the program moves to the receiving end's ingress and the sending end's transmit checksum offload is
    turned off, so every frame arrives with a completed checksum and the receiving stack verifies it: each
    corrupted segment is dropped (TcpInCsumErrors) and retransmitted, the application sees clean data. The only
    corrupted segments that pass are the 16-bit ones'-complement checksum's blind spot (two or more flips that
    cancel), as with the NFQUEUE engine (tests/test_engine.py)."""
    n, ber = 20 * MB, 1e-5
    h = bpf(link, ber=ber, seed=3, checksum="keep")
    assert h.bpf["attach"] == {"netns": link.path["b"], "iface": link.iface, "hook": "ingress"}
    assert "tx-checksumming: off" in link.run("a", ["ethtool", "-k", link.iface]).stdout
    before = link.snmp("b")["InCsumErrors"]
    sres, rres = transfer(link, n, seed=13)
    st = engine_stats(h)
    assert not st["gso"] and st["keep_gso_passed"] == 0 and st["packets_gso"] == 0  # MTU frames only
    assert rres["received"] == n
    csum_errors = link.snmp("b")["InCsumErrors"] - before
    passed = st["packets_modified"] - csum_errors
    bound = int(stats.binom.isf(ALPHA, st["packets_multiflip"], 1 / 16))
    assert 0 <= passed <= min(st["packets_multiflip"], bound), (st["packets_modified"], csum_errors,
                                                                 st["packets_multiflip"])
    assert st["packets_modified"] > 500
    # what passes carries >= 2 cancelling flips; its bytes reach the application unless TCP already had them (a
    # passed segment can be a spurious retransmission: seen once, 3 passed segments and 4 bit errors)
    assert rres["bit_errors"] == 0 or (passed > 0 and rres["bit_errors"] >= 2), (passed, rres["bit_errors"])
    assert st["bits_seen"] > n * 8  # retransmissions are drawn again, as on a real link
    assert_ber(st["bits_flipped"], st["bits_seen"], ber)
    assert sres["retrans_segs"] >= csum_errors * 0.9
    clean_after_stop(link, h)


# -- reproducibility: same seed, same packets -> same flips -----------------------------------------------------

UDP_SENDER = r"""
import json, socket, sys, time
import numpy as np
n, size = int(sys.argv[1]), int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rng = np.random.default_rng(1)
data = [rng.bytes(size) for _ in range(n)]
for i, d in enumerate(data):
    s.sendto(d, ("10.99.0.2", 6000))
    if i % 50 == 49:
        time.sleep(0.002)
print(json.dumps({"result": "sent"}), flush=True)
"""

UDP_RECEIVER = r"""
import json, socket, sys
import numpy as np
n, size = int(sys.argv[1]), int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
s.bind(("0.0.0.0", 6000)); s.settimeout(10)
print(json.dumps({"listening": 6000}), flush=True)
rng = np.random.default_rng(1)
data = [rng.bytes(size) for _ in range(n)]
flips = []
for i in range(n):
    got = s.recv(65536)
    x = np.frombuffer(got, np.uint8) ^ np.frombuffer(data[i], np.uint8)
    flips.append(np.flatnonzero(np.unpackbits(x)).tolist())
print(json.dumps({"result": flips}), flush=True)
"""


def udp_flips(link, n: int, size: int) -> list[list[int]]:
    rx = link.popen("b", [PYTHON, "-c", UDP_RECEIVER, str(n), str(size)])
    read_json_line(rx, "listening")
    tx = link.popen("a", [PYTHON, "-c", UDP_SENDER, str(n), str(size)])
    read_json_line(tx, "result", 60)
    return read_json_line(rx, "result", 60)["result"]


@pytest.mark.timeout(90)
def test_same_seed_same_packets_same_flips(link):
    """UDP datagrams of fixed content: a fresh engine with the same seed flips exactly the same bits, another
    seed other bits; and the flips are those the documented PRNG and gap sampler give (a Python reference of
    flip.c's stream), datagram by datagram."""
    n, size, ber = 2000, 1200, 1e-4
    assert link.run("a", ["ping", "-c1", "-W2", link.addr["b"]]).returncode == 0  # ARP resolved beforehand
    runs = {}
    for key, seed in (("first", 7), ("again", 7), ("other", 8)):
        h = bpf(link, ber=ber, seed=seed)
        runs[key] = udp_flips(link, n, size)
        st = engine_stats(h)
        assert st["packets"] == n and st["bits_seen"] == n * size * 8
        assert sum(map(len, runs[key])) == st["bits_flipped"] > 0
        clean_after_stop(link, h)
    assert runs["first"] == runs["again"]
    assert runs["first"] != runs["other"]
    ref = Reference(ber, {"type": "bernoulli"}, seed=7)
    assert [ref.flips(size * 8) for _ in range(n)] == runs["first"]
    # Gilbert-Elliott too
    em = {"type": "gilbert_elliott", "burst_length": 40.0, "bad_ber": 0.5}
    h = bpf(link, ber=ber, seed=5, error_model=em)
    got = udp_flips(link, n, size)
    clean_after_stop(link, h)
    ref = Reference(ber, em, seed=5)
    assert [ref.flips(size * 8) for _ in range(n)] == got and sum(map(len, got)) > 0


# -- live changes through the map ------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_live_set_of_ber_and_a_later_process_stops_the_engine(link):
    n1, n2 = 20 * MB, 5 * MB
    h = bpf(link, ber=1e-5, seed=4)
    rx, tx = paused_transfer(link, h, n1, n2)
    # from another process, through the map (like `testbed link set`)
    code = ("import json,sys; from testbed.engine.manager import EngineHandle, set_engine; "
            "print(json.dumps(set_engine(EngineHandle.from_dict(json.loads(sys.stdin.read())), ber=1e-3)))")
    r = subprocess.run([PYTHON, "-c", code], input=json.dumps(h.to_dict()), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ber"] == 1e-3
    assert engine_stats(h)["ber"] == 1e-3
    with pytest.raises(EngineError, match="in scopes payload and tensor, not all"):
        set_engine(h, scope="all", error_model={"type": "counter"})
    with pytest.raises(EngineError):
        set_engine(h, ber=0.4, error_model={"type": "gilbert_elliott", "burst_length": 2})
    tx.stdin.write("go\n")
    tx.stdin.flush()
    rres = read_json_line(rx, "result")["result"]
    sent = read_json_line(tx, "result")["result"]

    final = stop_elsewhere(h)
    assert final["alive"] is False and not handle_alive(h) and engine_stats(h)["alive"] is False
    assert not Path(h.bpf["pin_dir"]).exists()
    assert "clsact" not in link.run("a", ["tc", "qdisc", "show", "dev", link.iface]).stdout
    assert_two_epochs(final, n1, n2, rres, sent)


@pytest.mark.timeout(60)
def test_keep_turns_the_offload_off_only_while_frames_can_be_flipped(link):
    """keep at BER 0 leaves the sending end's transmit checksum offload on (nothing is flipped, so no frame needs
    a completed checksum: no software segmentation); a BER turns it off before any flip, BER 0 back on; a
    detached keep engine leaves a clean link, offload included, and attaching puts it back off."""
    def tx():
        return "tx-checksumming: on" in link.run("a", ["ethtool", "-k", link.iface]).stdout

    h = bpf(link, ber=0.0, seed=3, checksum="keep")
    assert h.bpf["attach"]["hook"] == "ingress" and tx() and engine_stats(h)["tx_checksum_off"] is None
    _, rres = transfer(link, 5 * MB, seed=23)
    st = engine_stats(h)
    assert rres["bit_errors"] == 0 and st["bits_flipped"] == 0 and st["keep_gso_passed"] == 0
    # super-packets, counted: none can flip. keep draws a retransmission again, as a real link would, so a
    # spurious one of the loaded machine is counted too (CI once saw 1,672 bytes more): at least every byte once
    assert st["packets_gso"] > 0 and st["bits_seen"] >= 5 * MB * 8
    set_engine(h, ber=1e-5)
    assert not tx() and engine_stats(h)["tx_checksum_off"]["was_on"]
    detach_engine(h)
    assert tx()
    attach_engine(h)
    assert not tx()
    set_engine(h, ber=0.0)
    assert tx()
    clean_after_stop(link, h)


@pytest.mark.timeout(90)
def test_live_checksum_switch_moves_the_program_and_control_ports(link):
    """fix -> keep moves the program to the receiving end (and the offload off), keep -> fix back; a flow on a
    control port is never touched (and counted once)."""
    h = bpf(link, ber=1e-4, seed=6, control_ports=[5007])
    _, clean = transfer(link, 5 * MB, seed=20, port=5007)
    st = engine_stats(h)
    assert clean["bit_errors"] == 0 and st["bits_seen"] == 0 and st["flows_excluded"] == 1
    set_engine(h, checksum="keep", ber=1e-5)
    st = engine_stats(h)
    assert st["attached"]["netns"] == link.path["b"] and st["attached"]["hook"] == "ingress"
    assert "tx-checksumming: off" in link.run("a", ["ethtool", "-k", link.iface]).stdout
    assert "clsact" not in link.run("a", ["tc", "qdisc", "show", "dev", link.iface]).stdout
    before = link.snmp("b")["InCsumErrors"]
    _, rres = transfer(link, 5 * MB, seed=21, port=5008)
    st2 = engine_stats(h)
    assert link.snmp("b")["InCsumErrors"] - before >= (st2["packets_modified"] - st["packets_modified"]) - \
        (st2["packets_multiflip"] - st["packets_multiflip"]) > 0
    set_engine(h, checksum="fix")
    assert engine_stats(h)["attached"]["hook"] == "egress"
    assert "tx-checksumming: on" in link.run("a", ["ethtool", "-k", link.iface]).stdout
    def attempt(port):
        pre = engine_stats(h)
        return h, pre, transfer(link, 5 * MB, seed=22, port=port)[1], engine_stats(h)

    _, pre, rres, st = lossless(link, attempt, port0=5009, keep_engine=True)
    assert rres["bit_errors"] == st["bits_flipped"] - pre["bits_flipped"] > 0
    clean_after_stop(link, h)


# -- scope all and checksums on packets with complete checksums --------------------------------------------------

RAW_SENDER = r"""
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)  # IP_HDRINCL: sent as built
for h in json.loads(sys.stdin.read()):
    s.sendto(bytes.fromhex(h), ("10.99.0.2", 0))
print(json.dumps({"result": "sent"}), flush=True)
"""

CAPTURE = r"""
import json, socket, sys, select
n = int(sys.argv[1])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 24)  # SO_RCVBUFFORCE: a burst of ~200 frames, none dropped
s.bind(("veth0", 0))
print(json.dumps({"listening": 0}), flush=True)
out = []
while len(out) < n:
    r, _, _ = select.select([s], [], [], 5)
    if not r:
        break
    data, addr = s.recvfrom(65536)
    if addr[2] != socket.PACKET_OUTGOING:
        out.append(data[14:].hex())
print(json.dumps({"result": out}), flush=True)
"""


def raw_packets(n: int) -> list[bytes]:
    from scapy.layers.inet import ICMP, IP, TCP, UDP
    from scapy.packet import Raw

    rng = np.random.default_rng(30)
    S, D = "10.99.0.1", "10.99.0.2"
    pkts = []
    for i in range(n):
        size = int(rng.integers(200, 1400))
        if i % 2:
            p = IP(src=S, dst=D, id=i + 1) / TCP(sport=4000, dport=9, seq=1000 + i * 2000, flags="PA") / \
                Raw(rng.bytes(size))
        else:
            p = IP(src=S, dst=D, id=i + 1) / UDP(sport=4001, dport=9) / Raw(rng.bytes(size))
        pkts.append(bytes(p))  # scapy completes every checksum: CHECKSUM_NONE skbs, no offload
    pkts.append(bytes(IP(src=S, dst=D, id=9999) / ICMP() / Raw(b"ping" * 10)))  # unparsed: not_tcp_udp
    pkts.append(bytes(IP(src=S, dst=D, id=9998, flags="MF") / UDP(sport=1, dport=9) / Raw(rng.bytes(64))))  # fragment
    return pkts


def send_and_capture(link, pkts: list[bytes]) -> list[bytes]:
    cap = link.popen("b", [PYTHON, "-c", CAPTURE, str(len(pkts))])
    read_json_line(cap, "listening")
    tx = link.popen("a", [PYTHON, "-c", RAW_SENDER], stdin=subprocess.PIPE)
    tx.stdin.write(json.dumps([p.hex() for p in pkts]))
    tx.stdin.close()
    read_json_line(tx, "result")
    return [bytes.fromhex(h) for h in read_json_line(cap, "result", 30)["result"]]


def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = int(np.frombuffer(b, dtype=">u2").astype(np.uint64).sum())
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def checks_valid(pkt: bytes) -> tuple[bool | None, bool | None]:
    """(IPv4 header checksum valid, L4 checksum valid as the packet's own headers describe it); None where the
    (corrupted) header length or headers no longer describe an IPv4 header / a TCP or UDP packet."""
    ihl = (pkt[0] & 15) * 4
    if ihl < 20 or ihl > len(pkt):
        return None, None  # as the NFQUEUE engine: no header checksum to make valid
    ip_ok = _csum(pkt[:ihl]) == 0xFFFF
    total = (pkt[2] << 8) | pkt[3]
    if pkt[0] >> 4 != 4 or ihl < 20 or total > len(pkt) or total < ihl + 8 or pkt[9] not in (6, 17) or \
            (pkt[6] & 0x3F) or pkt[7]:
        return ip_ok, None
    l4 = pkt[ihl:total]
    pseudo = pkt[12:20] + bytes([0, pkt[9]]) + len(l4).to_bytes(2, "big")
    return ip_ok, _csum(pseudo + l4) == 0xFFFF


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scope", ["all", "payload"])
def test_fix_keeps_complete_checksums_valid(link, scope):
    """Packets that carry complete checksums (raw sockets: no offload) stay valid after corruption in checksum
    fix mode: scope payload updates the L4 checksum incrementally; scope all also recomputes the IPv4 header
    checksum and folds pseudo-header changes in (flips drawn on the checksum fields themselves are counted, as
    the NFQUEUE engine overwrites them). Every other bit that differs is a flip the engine counted; packets the
    parser does not handle pass unmodified and are counted by reason."""
    assert link.run("a", ["ping", "-c1", "-W2", link.addr["b"]]).returncode == 0
    pkts = raw_packets(200)
    h = bpf(link, ber=2e-3, seed=31, scope=scope)
    got = send_and_capture(link, pkts)
    st = engine_stats(h)
    assert len(got) == len(pkts) and st["packets"] == len(pkts)
    assert st["packets_unparsed"] == 2 and st["unparsed_reasons"] == {"not_tcp_udp": 1, "fragment": 1}
    assert got[-2:] == pkts[-2:]
    differing = 0
    l4_checked = 0
    for sent, recv in zip(pkts[:-2], got[:-2]):
        ihl = (sent[0] & 15) * 4
        csum_at = ihl + (16 if sent[9] == 6 else 6)
        mask = np.ones(len(sent), bool)
        mask[[csum_at, csum_at + 1]] = False
        if scope == "all":
            mask[[10, 11]] = False
        else:
            assert recv[:ihl + (20 if sent[9] == 6 else 8)][:csum_at] == sent[:csum_at]  # headers untouched
        x = np.frombuffer(sent, np.uint8)[mask] ^ np.frombuffer(recv, np.uint8)[mask]
        differing += int(np.unpackbits(x).sum())
        ip_ok, l4_ok = checks_valid(recv)
        assert ip_ok is not False, recv.hex()
        if l4_ok is not None and (recv[2:4] == sent[2:4]) and recv[0] == sent[0]:
            # lengths and header length intact: the incremental update covers the same bytes
            l4_checked += 1
            assert l4_ok, (sent.hex(), recv.hex())
    assert differing == st["flips_applied"] == st["bits_flipped"] - st["flips_on_checksum"] > 100
    assert l4_checked > 150
    clean_after_stop(link, h)


# -- start failures and validation -------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_refused_settings_and_start_errors(link):
    with pytest.raises(ValueError, match="scope tensor with checksum fix only"):
        start_engine(link.engine_spec(engine="bpf", scope="tensor", checksum="keep"))
    with pytest.raises(ValueError, match="counter in scopes payload and tensor, not all"):
        start_engine(link.engine_spec(engine="bpf", scope="all", error_model={"type": "counter"}))
    with pytest.raises(ValueError, match="up to a BER of about 1.2e-2"):
        start_engine(link.engine_spec(engine="bpf", scope="tensor", ber=0.05))
    with pytest.raises(ValueError, match="peer"):
        start_engine(link.engine_spec(engine="bpf", checksum="keep"))
    with pytest.raises(ValueError, match="capture"):
        start_engine(link.engine_spec(engine="bpf", capture={"dir": str(link.tmp / "c")}))
    with pytest.raises(EngineError, match="does not exist"):
        start_engine(link.engine_spec(engine="bpf", netns="/run/netns/tbE-missing"))
    assert not pins.engine_pin_dirs(pins.pins_under(link.tmp))
    h = bpf(link, ber=1e-6)
    assert EngineHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    clean_after_stop(link, h)
    assert stop_engine(h)["alive"] is False  # idempotent


# -- topologies: engine: bpf through up/stats/link set/down, and a killed up leaves nothing -------------------

PAIR = """name: {name}
topology:
  nodes: {{h1: {{}}, h2: {{}}}}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
      engine: {engine}
      directions:
        h1->h2: {{ber: {ber}, seed: 11}}
"""


def test_topology_validation_of_engine(tmp_path):
    from testbed.topology.topo import Topology, TopologyError

    ok = Topology.from_dict({"name": "bpfv", "topology": {"nodes": {"h1": {}, "h2": {}}, "links": [
        {"endpoints": ["h1:eth1", "h2:eth1"], "ber": 1e-6, "engine": "auto"}]}})
    assert ok.links[0].forward.engine == "auto"
    default = Topology.from_dict({"name": "bpfv", "topology": {"nodes": {"h1": {}, "h2": {}}, "links": [
        {"endpoints": ["h1:eth1", "h2:eth1"], "ber": 1e-6}]}})
    assert default.links[0].forward.engine == "nfqueue"
    for eng, scope, words in (("bpf", "tensor\n      checksum: keep", "scope tensor with checksum fix only"),
                              ("ebpf", "payload", "engine")):
        f = tmp_path / f"{eng}.yaml"
        f.write_text(f"name: bpfv\ntopology:\n  nodes: {{h1: {{}}, h2: {{}}}}\n  links:\n"
                     f"    - endpoints: [\"h1:eth1\", \"h2:eth1\"]\n      ber: 1e-6\n      scope: {scope}\n"
                     f"      engine: {eng}\n")
        with pytest.raises(TopologyError, match=words):
            Topology.load(f)
        r = tb_cli("up", str(f))
        assert r.returncode == 2 and "topology.links[0].engine" in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_topology_engine_bpf_up_stats_link_set_down(tmp_path):
    from testbed.net import Testbed

    name = unique_name("bpfup")
    f = tmp_path / "pair.yaml"
    f.write_text(PAIR.format(name=name, ber="1e-4", engine="bpf"))
    r = tb_cli("up", str(f))
    assert r.returncode == 0, r.stderr
    try:
        assert "engine bpf" in r.stdout
        tb = Testbed.attach(name)
        (key, h), = tb.engine_handles().items()
        assert h.spec.engine == "bpf" and h.pid == 0
        assert tb_cli("status", "--topo", name).returncode == 0
        rx = tb.popen("h2", [tb.runtime.python, "-m", "testbed.bench.probe", "recv", "--port", "5002", "--bytes",
                             str(10 * MB), "--seed", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        read_json_line(rx, "listening")
        tx = tb.popen("h1", [tb.runtime.python, "-m", "testbed.bench.probe", "send", "--host", tb.address("h2"),
                             "--port", "5002", "--bytes", str(10 * MB), "--seed", "3"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        snd = read_json_line(tx, "result", 60)["result"]
        rcv = read_json_line(rx, "result", 60)["result"]
        rx.wait(10)
        tx.wait(10)
        out = tb_cli("stats", "--topo", name, "--json")
        assert out.returncode == 0, out.stderr
        (st,) = json.loads(out.stdout)
        assert st["engine"] == "bpf" and rcv["bit_errors"] > 0 and st["bits_seen"] == 80 * MB
        assert_flips_delivered(st["bits_flipped"], rcv["bit_errors"], snd, 1e-4)
        r = tb_cli("link", "set", "h1-h2", "--topo", name, "--direction", "h1->h2", "--ber", "1e-6")
        assert r.returncode == 0, r.stderr
        assert tb.stats()[0]["ber"] == 1e-6
        bad = tb_cli("link", "set", "h1-h2", "--topo", name, "--direction", "h1->h2", "--scope", "all",
                     "--error-model", "counter")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        # detached: the program is removed, the link passes clean; back afterwards
        with tb.detached("h1-h2"):
            assert not handle_alive(h)
        assert handle_alive(h)
        # the other direction: `link set` starts an engine there (engine from the file: bpf)
        r = tb_cli("link", "set", "h1-h2", "--topo", name, "--direction", "h2->h1", "--ber", "1e-6")
        assert r.returncode == 0, r.stderr
        assert {s["direction"]: s["engine"] for s in Testbed.attach(name).stats()} == {"h1->h2": "bpf", "h2->h1": "bpf"}
    finally:
        r = tb_cli("down", name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not leftovers(name)


@pytest.mark.timeout(120)
def test_engine_bpf_where_it_cannot_run_and_auto(tmp_path):
    """engine: bpf where the bpf engine cannot run: exit 3 (CapabilityMissing) before anything is created;
    engine: auto falls back to nfqueue there, and picks bpf where it runs (scope payload; scope tensor, the
    training scope, too; not what the program cannot draw: Gilbert-Elliott in scope tensor)."""
    name = unique_name("bpfcap")
    f = tmp_path / "pair.yaml"
    f.write_text(PAIR.format(name=name, ber="1e-6", engine="bpf"))
    env = dict(os.environ, TESTBED_BPF_ENGINE="off")
    r = tb_cli("up", str(f), env=env)
    assert r.returncode == 3 and "engine: bpf on h1-h2 (h1->h2)" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not leftovers(name)
    for off, want in ((True, "nfqueue"), (False, "bpf")):
        f.write_text(PAIR.format(name=name, ber="1e-6", engine="auto"))
        r = tb_cli("up", str(f), env=env if off else None)
        assert r.returncode == 0, r.stderr
        try:
            st = json.loads(tb_cli("stats", "--topo", name, "--json").stdout)
            assert [s.get("engine", "nfqueue") for s in st] == [want]
        finally:
            assert tb_cli("down", name).returncode == 0
        assert not leftovers(name)
    # what auto resolves to, per direction's settings, where bpf runs (registry.resolve_engine, as `up` calls it)
    from testbed.engine.registry import resolve_engine
    from testbed.topology.elements import LinkImpairment

    ge = {"type": "gilbert_elliott", "burst_length": 8.0, "bad_ber": 0.5, "good_ber": 0.0}
    for kw, want in (({"scope": "tensor"}, "bpf"), ({"scope": "tensor", "error_model": {"type": "counter"}}, "bpf"),
                     ({"scope": "tensor", "error_model": ge}, "nfqueue"), ({"scope": "tensor", "checksum": "keep"},
                                                                            "nfqueue"),
                     ({"scope": "tensor", "ber": 0.05}, "nfqueue"), ({"scope": "all", "error_model": {"type": "counter"}},
                                                                      "nfqueue")):
        imp = LinkImpairment(**{"ber": 1e-6, "engine": "auto", **kw})
        assert resolve_engine(imp, None, "/run/netns/peer") == want, kw


@pytest.mark.timeout(60)
def test_reordered_and_lost_segments_are_new_bytes_retransmissions_pass_clean(link):
    """A segment that arrives after a later one (reordered on the way, or lost before the hook and then
    retransmitted) carries new bytes: they are drawn and counted once; bytes seen before pass clean. Segments of
    one connection sent as built (raw socket), in a chosen order: every payload byte is counted exactly once,
    the retransmitted parts arrive unchanged and every flip lies in a part first seen in that packet."""
    from scapy.layers.inet import IP, TCP
    from scapy.packet import Raw

    isn = 5_000_000
    data = np.random.default_rng(31).bytes(6000)
    # (first byte, end) of the payload, in sending order; `new` is the part first seen in that segment
    order = [(0, 1000), (2000, 3000), (1000, 2000), (1000, 2000), (3000, 4000), (3500, 4500), (5000, 6000),
             (4500, 4800), (4700, 5000)]
    new = [(0, 1000), (2000, 3000), (1000, 2000), None, (3000, 4000), (4000, 4500), (5000, 6000), (4500, 4800),
           (4800, 5000)]
    S, D = link.addr["a"], link.addr["b"]
    pkts = [bytes(IP(src=S, dst=D) / TCP(sport=4100, dport=9, seq=isn, flags="S"))]
    pkts += [bytes(IP(src=S, dst=D, id=i + 1) / TCP(sport=4100, dport=9, seq=isn + 1 + a, flags="PA") /
                   Raw(data[a:b])) for i, (a, b) in enumerate(order)]
    h = bpf(link, ber=5e-3, seed=4)
    got = send_and_capture(link, pkts)
    st = engine_stats(h)
    assert st["packets_errors"] == 0 and st["holes_lost"] == 0
    assert st["bits_seen"] == 6000 * 8, st
    assert st["retransmitted_bits"] == (1000 + 500 + 100) * 8
    assert st["hole_bits"] == (1000 + 300 + 200) * 8
    segs = [p for p in got if len(p) > 40 and p[9] == 6]
    assert len(segs) == len(order)
    flips = 0
    for p, (a, b), nw in zip(segs, order, new):
        ihl = (p[0] & 15) * 4
        payload = p[ihl + (p[ihl + 12] >> 4) * 4:]
        assert int.from_bytes(p[ihl + 4:ihl + 8], "big") == isn + 1 + a and len(payload) == b - a
        x = np.frombuffer(payload, np.uint8) ^ np.frombuffer(data[a:b], np.uint8)
        wrong = np.flatnonzero(x) + a
        if nw is None:
            assert wrong.size == 0
        else:
            assert ((wrong >= nw[0]) & (wrong < nw[1])).all(), (a, b, nw, wrong)
        flips += int(np.unpackbits(x).sum())
    assert flips == st["bits_flipped"] > 0
    clean_after_stop(link, h)


@pytest.mark.timeout(90)
def test_concurrent_flows_on_two_cpus_share_one_exact_stream(link):
    """Two TCP flows sent from processes pinned to different CPUs cross the same direction at once: the
    program's lock and ring keep one stream, so the applications together see exactly the engine's flips, every
    eligible bit once, at the configured rate."""
    n, ber = 30 * MB, 1e-4

    def attempt(port):  # two flows on ports port+20 and port+21, a fresh pair of source ports each attempt
        h = bpf(link, ber=ber, seed=12)
        rxs, txs = [], []
        for i in range(2):
            rx = link.probe("b", "recv", "--port", port + 20 + i, "--bytes", n, "--seed", 40 + i)
            read_json_line(rx, "listening")
            rxs.append(rx)
        for i in range(2):
            txs.append(link.popen("a", ["taskset", "-c", str(i % (os.cpu_count() or 1)), PYTHON, "-m",
                                        "testbed.bench.probe", "send", "--host", link.addr["b"], "--port",
                                        str(port + 20 + i), "--bytes", str(n), "--seed", str(40 + i),
                                        "--sport", str(43000 + 2 * (port - 5001) + i)]))
        for tx in txs:
            read_json_line(tx, "result", 60)
        return h, [read_json_line(rx, "result", 60)["result"] for rx in rxs], engine_stats(h)

    # a segment the loaded receiver dropped comes again clean (lossless): seen once in make test, 56 bits short
    h, res, st = lossless(link, attempt)
    assert all(r["received"] == n for r in res)
    assert st["bits_seen"] == 2 * n * 8 == st["bits_reserved"]
    assert sum(r["bit_errors"] for r in res) == st["bits_flipped"] == st["flips_applied"]
    assert st["ring_overruns"] == 0 and st["packets_errors"] == 0
    assert_ber(st["bits_flipped"], st["bits_seen"], ber)
    print(f"flips met by a later packet (generation shared between CPUs): {st['ring_shared']}")
    clean_after_stop(link, h)


@pytest.mark.timeout(120)
def test_killed_up_leaves_nothing(tmp_path):
    """SIGKILL `testbed up` as soon as its bpf engine is pinned: `down` removes everything, pins included; and
    the sweep alone (no state file) removes pins too."""
    from testbed import clean
    from testbed.state import state_dir

    name = unique_name("bpfkill")
    f = tmp_path / "pair.yaml"
    f.write_text(PAIR.format(name=name, ber="1e-5", engine="bpf"))
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "up", str(f)], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    mirror = pins.pins_under(state_dir(name))
    deadline = time.monotonic() + 60
    try:
        while not pins.engine_pin_dirs(mirror) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        assert pins.engine_pin_dirs(mirror), "the engine was never pinned"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # `up` already finished: then it is a kill right after up, still fine
            pass
        proc.wait(10)
    assert leftovers(name).get("bpf_pins")
    r = tb_cli("down", name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not leftovers(name) and not mirror.exists()

    # a pinned engine no state file knows of (killed before anything was recorded): swept by name
    from testbed.engine.bpf.build import object_path
    from testbed.engine.bpf.engine import _load

    _load(object_path(), pins.pins_under(state_dir(name)) / "engines" / "e0")
    assert leftovers(name).get("bpf_pins")
    clean.sweep_topology(name)
    assert not leftovers(name) and not mirror.exists()


@pytest.mark.timeout(120)
def test_counter_flips_are_the_same_in_bpf_nfqueue_and_the_function(link):
    """error_model counter, scope payload: a 4 MiB transfer through the bpf engine and the same through the NFQUEUE
    engine flip the same bits, and both are exactly counterflips.flips of the connection's key (its ordinal 0 and
    the two addresses under the engine's seed): flips are a pure function of the stream position in both."""
    import ipaddress

    from testbed.engine import counterflips as cf
    from testbed.engine.models import TAG_FLOW

    n, ber, seed = 4 * MB, 1e-4, 5
    got = {}
    for kind, port in (("bpf", 5101), ("nfqueue", 5102)):
        def attempt(p, kind=kind):
            if kind == "bpf":
                h = bpf(link, ber=ber, seed=seed, error_model={"type": "counter"})
            else:
                h = link.start_engine("a", "egress", ber=ber, seed=seed, error_model={"type": "counter"})
            return h, transfer_positions(link, n, 11, p), engine_stats(h)

        h, pos, st = lossless(link, attempt, port0=port)
        assert st["bits_seen"] == 8 * n and st["bits_flipped"] == len(pos) and st["packets_errors"] == 0, st
        stop_engine(h)
        got[kind] = pos
    sa, da = (int(ipaddress.ip_address(link.addr[s])) for s in ("a", "b"))
    want = cf.flips(cf.model_key(seed, TAG_FLOW, 0, 0, sa, da, 0), ber, 0, n).tolist()
    assert len(want) > 2000
    assert got["bpf"] == want and got["nfqueue"] == want
