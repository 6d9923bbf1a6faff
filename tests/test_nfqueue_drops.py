"""Engine-caused loss is counted apart from link loss: packets the kernel drops on the way to an NFQUEUE engine
(its queue full: `queue_dropped`; its socket overrun: `user_dropped`, from /proc/net/netfilter/nfnetlink_queue
inside the namespace) reach the engine's stats, `testbed stats` and a run's counters. The drops are real: an
engine is paused with SIGSTOP while datagrams flow, so its queue overflows. Also: one engine process serving all
of a host's directions (engine_procs host), live-joined by `link set`, stopped direction by direction.

Every test tears down what it made (engines, processes, namespaces), also when it fails."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from engine_fixtures import MB, PYTHON, assert_flips_delivered, read_json_line, transfer, checked_veth_link

from testbed.engine.manager import engine_stats
from testbed.engine.nfqueue import kernel_queues, queue_drops
from testbed.engine.counters import counter_delta

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, iptables)")

# A UDP burst from inside a namespace: `n` datagrams of `size` bytes to HOST:PORT, as fast as they go. The send
# buffer is forced large: a datagram waiting in a stopped engine's queue is still charged to its socket.
UDP_SENDER = r"""
import json, socket, sys
host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 32, 1 << 30)  # SO_SNDBUFFORCE
data = bytes(size)
for _ in range(n):
    s.sendto(data, (host, port))
print(json.dumps({"result": "sent", "n": n}), flush=True)
"""

# Counts datagrams until none came for 1 s after the first one (or 20 s without any).
UDP_COUNTER = r"""
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 28)  # SO_RCVBUFFORCE: count what arrives, lose none here
s.bind(("0.0.0.0", int(sys.argv[1])))
print(json.dumps({"listening": True}), flush=True)
n = 0
s.settimeout(20)
try:
    while True:
        s.recv(65536)
        n += 1
        s.settimeout(1)
except socket.timeout:
    pass
print(json.dumps({"result": {"received": n}}), flush=True)
"""


# -- pure logic (no root) ----------------------------------------------------------------------------------------

def test_kernel_queue_file_is_parsed_per_queue(tmp_path):
    f = tmp_path / "nfnetlink_queue"
    # the kernel's format: queue, portid, total, copy mode, copy range, dropped, user dropped, last id, 1
    f.write_text("    1 4294963173     0 2 65531   184     0      200  1\n"
                 "    2  40321   16 2 65531     0    37     9001  1\n")
    assert set(kernel_queues(str(f))) == {1, 2}
    assert queue_drops(1, str(f)) == {"queue_dropped": 184, "user_dropped": 0, "queue_total": 0}
    assert queue_drops(2, str(f)) == {"queue_dropped": 0, "user_dropped": 37, "queue_total": 16}
    assert queue_drops(3, str(f)) == {"queue_dropped": None, "user_dropped": None, "queue_total": None}
    assert kernel_queues(str(tmp_path / "absent")) == {}


def test_counter_delta_keeps_engine_drops_apart():
    before = {"l/a->b": {"bits_seen": 10, "bits_flipped": 1, "queue_dropped": 5, "user_dropped": 0}}
    after = {"l/a->b": {"link": "l", "direction": "a->b", "alive": True, "bits_seen": 30, "bits_flipped": 2,
                        "queue_dropped": 9, "user_dropped": 3},
             "l/b->a": {"link": "l", "direction": "b->a", "bits_seen": 8, "bits_flipped": 0}}  # bpf: no queue
    d = counter_delta(before, after)
    assert (d["l/a->b"]["queue_dropped"], d["l/a->b"]["user_dropped"]) == (4, 3)
    assert (d["l/b->a"]["queue_dropped"], d["l/b->a"]["user_dropped"]) == (0, 0)


# -- a real engine on a veth -------------------------------------------------------------------------------------

@pytest.fixture
def link():
    yield from checked_veth_link()


def burst_while_stopped(link, h, n: int, size: int, port: int) -> tuple[dict, dict]:
    """Pause the engine of `h`, send `n` datagrams a -> b through it, read its stats while paused (the manager
    reads the kernel's counters in the namespace itself), resume it; (stats while paused, receiver's result)."""
    rx = link.popen("b", [PYTHON, "-c", UDP_COUNTER, str(port)])
    read_json_line(rx, "listening")
    os.kill(h.pid, signal.SIGSTOP)
    try:
        tx = link.popen("a", [PYTHON, "-c", UDP_SENDER, link.addr["b"], str(port), str(n), str(size)])
        assert read_json_line(tx, "result", 60)["n"] == n
        paused = engine_stats(h, timeout=0.5)
    finally:
        os.kill(h.pid, signal.SIGCONT)
    return paused, read_json_line(rx, "result", 60)["result"]


@needs_root
@pytest.mark.timeout(60)
def test_a_full_queue_is_counted_and_its_packets_are_lost(link):
    n, maxlen = 300, 16
    h = link.start_engine(ber=0.0, seed=1, queue_maxlen=maxlen)
    assert (engine_stats(h)["queue_dropped"], engine_stats(h)["user_dropped"]) == (0, 0)
    paused, rres = burst_while_stopped(link, h, n, 1000, 5011)
    # paused: no answer on the control socket, the counters come from the kernel all the same
    assert paused["responding"] is False and paused["alive"] is True
    assert paused["queue_dropped"] == n - maxlen and paused["user_dropped"] == 0
    st = engine_stats(h)  # resumed
    assert st["alive"] and "responding" not in st
    assert (st["queue_dropped"], st["user_dropped"]) == (n - maxlen, 0)
    # the queued ones went through once the engine ran again; the dropped ones never arrived (fail closed)
    assert rres["received"] == maxlen == st["packets"]


@needs_root
@pytest.mark.timeout(60)
def test_an_overrun_engine_socket_is_counted(link):
    # A queue long enough never to fill: ~60 KB datagrams overrun the engine's 64 MiB receive buffer first.
    n = 3000
    h = link.start_engine(ber=0.0, seed=1, queue_maxlen=65535)
    paused, rres = burst_while_stopped(link, h, n, 60000, 5012)
    assert paused["queue_dropped"] == 0 and paused["user_dropped"] > 0
    st = engine_stats(h)
    assert st["queue_dropped"] == 0 and st["user_dropped"] == paused["user_dropped"]
    assert rres["received"] == n - st["user_dropped"] == st["packets"]


@needs_root
@pytest.mark.timeout(90)
def test_a_healthy_run_drops_nothing(link):
    h = link.start_engine(ber=1e-5, seed=2)
    snd, rres = transfer(link, 20 * MB, seed=12)
    st = engine_stats(h)
    assert rres["received"] == 20 * MB and rres["bit_errors"] > 0
    assert_flips_delivered(st["bits_flipped"], rres["bit_errors"], snd, 1e-5)
    assert (st["queue_dropped"], st["user_dropped"]) == (0, 0)


# -- a topology: one process per host, `testbed stats`, run counters, live join, teardown -------------------------

def _line(name: str):
    from testbed.topology.topo import Topology

    return Topology.from_dict({"name": name, "topology": {
        "nodes": {"h1": {}, "h2": {}, "h3": {}},
        "links": [{"endpoints": ["h1:eth1", "h2:eth1"], "directions": {"h2->h1": {"ber": 1e-5, "seed": 3}}},
                  {"endpoints": ["h2:eth2", "h3:eth1"]}]}})


@needs_root
@pytest.mark.timeout(120)
def test_host_engine_process_drops_in_stats_and_live_join(capsys):
    from conftest import running, tb_cli, unique_name

    from testbed.cli import main
    from testbed.net import Testbed

    def cli(*args: str) -> tuple[int, str]:  # in this process: a `testbed` process takes seconds to start here
        capsys.readouterr()
        rc = main(list(args))
        return rc, capsys.readouterr().out

    name = unique_name("drops")
    with running(_line(name), engine_procs="host") as tb:
        (h21,) = tb.engine_handles().values()
        # `link set` (a later process) on another direction of h2 joins h2's engine process; h1's first direction
        # starts h1's own
        r = tb_cli("link", "set", "h2-h3", "--topo", name, "--direction", "h2->h3", "--ber", "1e-5")
        assert r.returncode == 0, r.stderr
        assert cli("link", "set", "h1-h2", "--topo", name, "--direction", "h1->h2", "--ber", "1e-6")[0] == 0
        tb = Testbed.attach(name)  # the state `link set` wrote
        handles = tb.engine_handles()
        h23, h12 = handles["h2-h3/h2->h3"], handles["h1-h2/h1->h2"]
        assert h23.pid == h21.pid != h12.pid and h23.spec.queue_num != h21.spec.queue_num
        assert json.loads(cli("status", "--topo", name, "--json")[1])[0]["healthy"]
        # corruption works on both lanes of the shared process
        for dst in ("h1", "h3"):
            rx = tb.popen(dst, [PYTHON, "-m", "testbed.bench.probe", "recv", "--port", "5021", "--bytes", str(4 * MB),
                                "--seed", "4"], stdout=-1, stderr=-1, text=True)
            read_json_line(rx, "listening")
            tx = tb.popen("h2", [PYTHON, "-m", "testbed.bench.probe", "send", "--host", tb.address(dst), "--port",
                                 "5021", "--bytes", str(4 * MB), "--seed", "4"], stdout=-1, stderr=-1, text=True)
            rres = read_json_line(rx, "result", 60)["result"]
            snd = read_json_line(tx, "result", 60)["result"]
            tx.wait(10), rx.wait(10)
            st = {s["direction"]: s for s in tb.stats()}[f"h2->{dst}"]
            assert rres["received"] == 4 * MB
            assert_flips_delivered(st["bits_flipped"], rres["bit_errors"], snd, 1e-5)
            assert st["process_lanes"] == 2 and st["queue_dropped"] == 0
        # pause h2's engine process while a burst goes to h1: its queue (4096) overflows
        before = tb.counters()
        rx = tb.popen("h1", [PYTHON, "-c", UDP_COUNTER, "5022"], stdout=-1, stderr=-1, text=True)
        read_json_line(rx, "listening")
        os.kill(h21.pid, signal.SIGSTOP)
        try:
            tx = tb.popen("h2", [PYTHON, "-c", UDP_SENDER, tb.address("h1"), "5022", "5000", "100"], stdout=-1,
                          stderr=-1, text=True)
            read_json_line(tx, "result", 60)
            tx.wait(10)
        finally:
            os.kill(h21.pid, signal.SIGCONT)
        assert read_json_line(rx, "result", 60)["result"]["received"] == 4096
        rc, out = cli("stats", "--topo", name, "--json")
        assert rc == 0
        st = {s["direction"]: s for s in json.loads(out)}
        assert st["h2->h1"]["queue_dropped"] == 5000 - 4096 and st["h2->h3"]["queue_dropped"] == 0
        table = cli("stats", "--topo", name)[1]
        assert "engine_dropped" in table and " 904 " in f" {table} ".replace("\n", " ")
        delta = tb.counters_since(before)
        assert delta["h1-h2/h2->h1"]["queue_dropped"] == 904 and delta["h1-h2/h2->h1"]["user_dropped"] == 0
        # one direction of the shared process stopped (as links_restored does): the other keeps running
        final = tb.engines.stop("h2-h3/h2->h3")
        assert final["alive"] is False and final["bits_flipped"] > 0
        assert engine_stats(tb.engine_handles()["h1-h2/h2->h1"])["alive"]
        # the process dies: every direction it served is reported dead
        os.kill(h21.pid, signal.SIGKILL)
        time.sleep(0.2)
        rc, out = cli("status", "--topo", name)
        assert rc == 1 and "engine dead: h1-h2 h2->h1" in out and "engine dead: h2-h3" not in out


def test_up_prints_what_engine_auto_resolved_to():
    from types import SimpleNamespace

    from testbed.net import Testbed
    from testbed.topology.topo import Topology

    topo = Topology.from_dict({"name": "autoeng", "topology": {
        "nodes": {"h1": {}, "h2": {}},
        "links": [{"endpoints": ["h1:eth1", "h2:eth1"], "ber": 1e-6, "engine": "auto",
                   "directions": {"h2->h1": {"scope": "tensor"}}}]}})
    engines = {"h1-h2/h1->h2": {"spec": {"engine": "bpf"}}, "h1-h2/h2->h1": {"spec": {"engine": "nfqueue"}}}
    tb = Testbed(topo)  # not up: describe() reads the engines of its state
    tb.state = SimpleNamespace(data={"engines": engines})
    rows = {line.split()[5]: line for line in tb.describe().splitlines() if "->" in line}
    assert rows["h1->h2"].endswith("engine bpf (auto)") and rows["h2->h1"].endswith("engine nfqueue (auto)")
    # a direction whose engine runs on another machine: nothing resolved here
    tb.state.data["engines"] = {}
    assert tb.describe().count("engine auto") == 2
