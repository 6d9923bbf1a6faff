"""The corruption engine driven through topologies and the CLI: `up` starts engines where the file asks,
`stats`/`link set`/`status`/`down` talk to them, switches get theirs on the receiving host's ingress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from conftest import leftovers, running, tb_cli, unique_name
from engine_fixtures import assert_flips_delivered, read_json_line

PAIR = """name: {name}
topology:
  nodes: {{h1: {{}}, h2: {{}}}}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
      directions:
        h1->h2: {{ber: {ber}, seed: 11}}
"""


def probe(tb, host: str, *args) -> subprocess.Popen:
    return tb.popen(host, [tb.runtime.python, "-m", "testbed.bench.probe", *map(str, args)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


def transfer(tb, src: str, dst: str, nbytes: int, seed: int = 3, pause_at: int | None = None):
    rx = probe(tb, dst, "recv", "--port", 5002, "--bytes", nbytes, "--seed", seed)
    read_json_line(rx, "listening")
    extra = ["--pause-at", pause_at] if pause_at else []
    tx = probe(tb, src, "send", "--host", tb.address(dst), "--port", 5002, "--bytes", nbytes, "--seed", seed, *extra)
    return tx, rx


def finish(tx, rx, timeout=120):
    s = read_json_line(tx, "result", timeout)["result"]
    r = read_json_line(rx, "result", timeout)["result"]
    tx.wait(10)
    rx.wait(10)
    return s, r


def stats_by_direction(name: str) -> dict:
    r = tb_cli("stats", "--topo", name, "--json")
    assert r.returncode == 0, r.stderr
    return {s["direction"]: s for s in json.loads(r.stdout)}


def test_cli_up_stats_down_with_corruption(tmp_path, runtime):
    from testbed.net import Testbed

    name = unique_name("corr")
    f = tmp_path / "pair.yaml"
    f.write_text(PAIR.format(name=name, ber="1e-5"))
    out = tmp_path / "final"
    cap = tmp_path / "cap"
    r = tb_cli("up", str(f), "--out", str(out), "--runtime", runtime, "--capture", str(cap), "--capture-limit", "1")
    assert r.returncode == 0, r.stderr
    try:
        assert "ber 1e-05 payload/fix" in r.stdout
        tb = Testbed.attach(name)
        snd, rcv = finish(*transfer(tb, "h1", "h2", 20_000_000))
        stats = stats_by_direction(name)
        assert set(stats) == {"h1->h2"}  # only the direction that asks for corruption has an engine
        st = stats["h1->h2"]
        for key in ("link", "direction", "packets", "bits_seen", "bits_flipped", "realized_ber"):
            assert key in st
        assert st["link"] == "h1-h2" and st["bits_seen"] == 20_000_000 * 8
        assert rcv["bit_errors"] > 0
        assert_flips_delivered(st["bits_flipped"], rcv["bit_errors"], snd, 1e-5)
        table = tb_cli("stats", "--topo", name)
        assert table.returncode == 0 and "h1->h2" in table.stdout
        # --capture: the corrupted packets before and after corruption, bounded, readable pcap files
        from scapy.all import rdpcap
        pcaps = sorted(cap.rglob("*.pcap"))
        assert len(pcaps) == 2, pcaps
        for p in pcaps:
            assert 0 < p.stat().st_size <= 1_100_000 and len(rdpcap(str(p))) > 0
    finally:
        r = tb_cli("down", name)
    assert r.returncode == 0 and "final counters in" in r.stdout, r.stdout + r.stderr
    saved = json.loads(next(out.glob("stats-*.json")).read_text())
    assert saved[0]["bits_flipped"] == st["bits_flipped"]
    assert not leftovers(name)


def test_link_set_changes_ber_mid_transfer(tmp_path, runtime):
    from testbed.net import Testbed

    name = unique_name("lset")
    f = tmp_path / "pair.yaml"
    f.write_text(PAIR.format(name=name, ber="0"))
    assert tb_cli("up", str(f), "--runtime", runtime).returncode == 0
    try:
        tb = Testbed.attach(name)
        tx, rx = transfer(tb, "h1", "h2", 16_000_000, pause_at=8_000_000)
        read_json_line(tx, "paused")
        before = stats_by_direction(name)["h1->h2"]
        assert before["bits_flipped"] == 0 and before["bits_seen"] > 0
        r = tb_cli("link", "set", "h1-h2", "--topo", name, "--direction", "h1->h2", "--ber", "1e-4")
        assert r.returncode == 0, r.stderr
        tx.stdin.write("go\n")
        tx.stdin.flush()
        snd, rcv = finish(tx, rx)
        after = stats_by_direction(name)["h1->h2"]
        assert after["ber"] == 1e-4
        epochs = after["epochs"]
        assert [e["ber"] for e in epochs] == [0.0, 1e-4]
        assert epochs[0]["bits_flipped"] == 0 and epochs[1]["bits_flipped"] > 100
        assert_flips_delivered(after["bits_flipped"], rcv["bit_errors"], snd, 1e-4)
        # The other direction had no engine: `link set` starts one there, traffic unaffected.
        r = tb_cli("link", "set", "h1-h2", "--topo", name, "--direction", "h2-h1", "--ber", "1e-6")
        assert r.returncode == 0, r.stderr
        assert set(stats_by_direction(name)) == {"h1->h2", "h2->h1"}
        bad = tb_cli("link", "set", "h1-h2", "--topo", name, "--direction", "h1->h9", "--ber", "1e-6")
        assert bad.returncode == 2 and "no direction" in bad.stderr
        bad = tb_cli("link", "set", "h1-h2", "--topo", name, "--ber", "0.9")
        assert bad.returncode == 2 and "--ber" in bad.stderr
        # settings the engine refuses: a clear error, and no half-started engine left in the state
        bad = tb_cli("link", "set", "h1-h2", "--topo", name, "--ber", "0.4", "--error-model", "gilbert_elliott",
                     "--burst-length", "2")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert tb_cli("status", "--topo", name).returncode == 0
    finally:
        tb_cli("down", name)
    assert not leftovers(name)


def test_dead_engine_is_reported(tmp_path, runtime):
    from testbed.net import Testbed

    name = unique_name("dead")
    f = tmp_path / "pair.yaml"
    f.write_text(PAIR.format(name=name, ber="1e-6"))
    assert tb_cli("up", str(f), "--runtime", runtime).returncode == 0
    try:
        assert tb_cli("status", "--topo", name).returncode == 0
        tb = Testbed.attach(name)
        (handle,) = tb.engine_handles().values()
        os.kill(handle.pid, signal.SIGKILL)
        time.sleep(0.2)
        r = tb_cli("status", "--topo", name)
        assert r.returncode == 1 and "engine dead: h1-h2 h1->h2" in r.stdout
        st = json.loads(tb_cli("status", "--topo", name, "--json").stdout)[0]
        assert not st["healthy"]
        r = tb_cli("stats", "--topo", name)
        assert r.returncode == 1 and "DEAD" in r.stdout
        # Fail closed: the corrupted direction carries nothing now.
        ping = tb.run("h1", ["ping", "-c2", "-W1", tb.address("h2")])
        assert ping.returncode != 0
    finally:
        tb_cli("down", name)
    assert not leftovers(name)


def test_switch_direction_corrupts_at_receiving_host(runtime):
    from testbed.topology.topo import Topology

    name = unique_name("swc")
    topo = Topology.from_dict({"name": name, "topology": {
        "nodes": {"s1": {"kind": "switch"}, "h1": {}, "h2": {}, "h3": {}},
        "links": [{"endpoints": ["h1:eth1", "s1:p1"]},
                  {"endpoints": ["h2:eth1", "s1:p2"], "directions": {"s1->h2": {"ber": 1e-5}}},
                  {"endpoints": ["h3:eth1", "s1:p3"]}]}})
    with running(topo, runtime=runtime) as tb:
        (key, handle), = tb.engine_handles().items()
        assert key == "h2-s1/s1->h2"
        spec = tb.state.data["engines"][key]["spec"]
        assert (spec["hook"], spec["iface"], spec["netns"]) == ("ingress", "eth1", tb.host("h2").netns)
        snd, rcv = finish(*transfer(tb, "h1", "h2", 10_000_000))
        (st,) = tb.stats()
        assert rcv["bit_errors"] > 0
        assert_flips_delivered(st["bits_flipped"], rcv["bit_errors"], snd, 1e-5)
        # h1 -> h3 does not cross the corrupted direction.
        _, clean = finish(*transfer(tb, "h1", "h3", 2_000_000))
        assert clean["bit_errors"] == 0
