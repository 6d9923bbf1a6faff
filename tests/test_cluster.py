"""Topologies across machines: real sshd "machines" (network namespaces on an underlay bridge, tests/sshmachines.py)
reached only through paramiko, real VXLAN tunnels between them, real engines, real TCP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import TOPOLOGIES, separate_controller, tb_cli, unique_name
from engine_fixtures import assert_flips_delivered
from sshmachines import inventory_yaml, ssh_machines
from testbed.machines import cluster
from testbed.machines.inventory import load_inventory
from testbed.machines.remote import Remote


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    # The controller (this process and the `testbed` commands it runs) gets its own state directory and namespace
    # prefix, as each machine has: the test's `testbed down --all` then sweeps only what this module made, never
    # a topology that something else on this host has up.
    mp = pytest.MonkeyPatch()
    ctl = tmp_path_factory.mktemp("controller-state")
    separate_controller(mp, ctl, "tbc")
    try:
        with ssh_machines(3) as ms:
            inv = tmp_path_factory.mktemp("inventory") / "machines.yaml"
            inv.write_text(inventory_yaml(ms))
            yield ms, inv
            assert_nothing_left(ms)
            assert os.listdir(ctl) == []
    finally:
        mp.undo()


def netns_of(machine) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [l.split()[0] for l in out.splitlines() if l.startswith(machine.prefix)]


def assert_nothing_left(ms, name: str | None = None):
    for m in ms:
        assert netns_of(m) == [], (m.name, netns_of(m))
        state = [p for p in os.listdir(m.state_dir)] if os.path.isdir(m.state_dir) else []
        assert (state if name is None else [p for p in state if p == name]) == [], (m.name, state)
    assert cluster.cluster_of(name) is None if name else True


def up(file: str, inv, name: str, n_machines: int | None = None) -> subprocess.CompletedProcess:
    inv_path = inv
    if n_machines is not None:  # an inventory of the first n machines only
        doc = load_inventory(inv)
        keep = list(doc.machines)[:n_machines]
        text = inv.read_text()
        inv_path = inv.with_name(f"first{n_machines}.yaml")
        inv_path.write_text(_subset(text, keep))
    r = tb_cli("up", str(TOPOLOGIES / file), "--name", name, "--machines", str(inv_path), timeout=180)
    assert r.returncode == 0, r.stderr + r.stdout
    return r


def _subset(text: str, keep: list[str]) -> str:
    import yaml

    doc = yaml.safe_load(text)
    doc["machines"] = {k: v for k, v in doc["machines"].items() if k in keep}
    return yaml.safe_dump(doc)


def remote_for(name: str, node: str) -> Remote:
    record = cluster.cluster_of(name)
    return Remote.connect(cluster._machines_of(record)[record["placement"][node]])


def py(name: str, node: str) -> str:
    """The testbed's Python on the machine of `node`."""
    record = cluster.cluster_of(name)
    return cluster.python_of(cluster._machines_of(record)[record["placement"][node]])


def topo_hosts(name: str) -> list[str]:
    return [n for n in cluster.cluster_of(name)["placement"] if n.startswith("h")]


def data_address(name: str, node: str) -> str:
    from testbed.state import State
    from testbed.topology.topo import Topology

    return str(Topology.from_dict(State.load(name).data["topology"]).plan.data_address(node))


def all_pairs_tcp(name: str, port: int = 5999, nbytes: int = 200_000) -> None:
    """Every host sends to every other host's data address over TCP (across tunnels and, in a ring, over two
    hops) and checks the bytes came back intact (sha256)."""
    hosts = topo_hosts(name)
    servers = []
    try:
        for h in hosts:
            r = remote_for(name, h)
            p = r.start([r.machine.testbed, "exec", "--topo", name, h, "--", py(name, h), "-m", "testbed.bench.tcpcheck", "serve",
                         str(port)], log_path=f"/tmp/tcpcheck-{name}-{h}.log")
            servers.append((r, p))
        for r, p in servers:
            deadline = time.monotonic() + 30
            while "READY" not in p.read_log():
                assert p.poll() is None and time.monotonic() < deadline, p.read_log()
                time.sleep(0.1)
        for h in hosts:
            targets = [f"{data_address(name, o)}:{port}" for o in hosts if o != h]
            res = cluster.exec_in(name, h, [py(name, h), "-m", "testbed.bench.tcpcheck", "send", str(nbytes), *targets],
                                  timeout=60)
            assert res.returncode == 0, (h, res.stdout, res.stderr)
    finally:
        for r, p in servers:
            p.kill()
            r.close()


# ring4 across 3 machines (~38 s) is in the slow suite: make test keeps under its 20 minutes with the pair
@pytest.mark.parametrize("file,n_machines", [("pair.yaml", 2),
                                             pytest.param("ring4.yaml", 3, marks=pytest.mark.slow)])
def test_topology_across_machines_carries_tcp_between_every_pair(machines, file, n_machines):
    ms, inv = machines
    name = unique_name(file.split(".")[0])
    r = up(file, inv, name, n_machines)
    try:
        record = cluster.cluster_of(name)
        used = set(record["placement"].values())
        assert len(used) == min(n_machines, len(record["placement"])) and used <= {m.name for m in ms[:n_machines]}
        for node, m in record["placement"].items():  # `up` printed where each host runs
            assert any(line.split()[:2] == [node, m] for line in r.stdout.splitlines()), r.stdout
        # each machine holds only its own hosts, in its own namespaces
        for m in ms[:n_machines]:
            mine = [n for n, where in record["placement"].items() if where == m.name]
            assert sorted(x.rsplit(".", 1)[1] for x in netns_of(m) if not x.endswith("._mgmt")) == sorted(mine)
        s = json.loads(tb_cli("status", "--topo", name, "--json").stdout)[0]
        assert s["healthy"], s["problems"]
        assert {h: v["machine"] for h, v in s["hosts"].items()} == record["placement"]
        all_pairs_tcp(name)
        # the management segment spans the machines: every host reaches every other's management address
        for h in topo_hosts(name):
            for o in topo_hosts(name):
                if o != h:
                    res = cluster.exec_in(name, h, ["ping", "-c1", "-W2", f"{o}-mgmt"], timeout=20)
                    assert res.returncode == 0, (h, o, res.stdout)
    finally:
        d = tb_cli("down", name, timeout=180)
        assert d.returncode == 0, d.stderr
    assert_nothing_left(ms, name)


@pytest.mark.docker
def test_container_hosts_across_machines(machines, worker_image):
    """The docker runtime on each machine (its own `testbed part-up`, the same code as a local docker `up`):
    containers joined by the tunnelled data link and the cross-machine management segment."""
    ms, inv = machines
    name = unique_name("pair")
    r = tb_cli("up", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--runtime", "docker", "--machines",
               str(_first(inv, ms, 2)), timeout=180)
    assert r.returncode == 0, r.stderr + r.stdout
    try:
        s = json.loads(tb_cli("status", "--topo", name, "--json").stdout)[0]
        assert s["healthy"] and s["runtime"] == "docker", s
        assert all(v.get("container") for v in s["hosts"].values()), s["hosts"]  # hosts are containers
        assert {v["machine"] for v in s["hosts"].values()} == {ms[0].name, ms[1].name}
        for h, peer in (("h1", "h2"), ("h2", "h1")):
            for target in (data_address(name, peer), f"{peer}-mgmt"):
                res = cluster.exec_in(name, h, ["ping", "-c1", "-W2", target], timeout=30)
                assert res.returncode == 0, (h, target, res.stdout, res.stderr)
    finally:
        d = tb_cli("down", name, timeout=180)
        assert d.returncode == 0, d.stderr
    assert_nothing_left(ms, name)


def _first(inv, ms, n: int):
    path = inv.with_name(f"first{n}-only.yaml")
    path.write_text(_subset(inv.read_text(), [m.name for m in ms[:n]]))
    return path


def test_engine_on_a_cross_machine_link_delivers_app_counted_errors_equal_to_its_flips(machines):
    """BER 1e-5, payload scope, checksums fixed, on the tunnelled link h1 -> h2 (the engine runs on h1's machine,
    on the tunnel end: it sees the inner packets). 40 MB: ~3,200 flips expected, P(none) < e^-3000."""
    ms, inv = machines
    name = unique_name("pair")
    up("pair.yaml", inv, name, 2)
    try:
        record = cluster.cluster_of(name)
        assert record["placement"]["h1"] != record["placement"]["h2"]
        r = tb_cli("link", "set", "--topo", name, "h1-h2", "--direction", "h1-h2", "--ber", "1e-5", "--scope",
                   "payload", "--checksum", "fix", "--seed", "7")
        assert r.returncode == 0, r.stderr
        nbytes = 40_000_000
        rx_remote = remote_for(name, "h2")
        probe = [py(name, "h1"), "-m", "testbed.bench.probe"]
        rx = rx_remote.start([rx_remote.machine.testbed, "exec", "--topo", name, "h2", "--", *probe, "recv", "--port", "5004",
                              "--bytes", str(nbytes)], log_path=f"/tmp/probe-{name}.log")
        try:
            deadline = time.monotonic() + 30
            while "listening" not in rx.read_log():
                assert rx.poll() is None and time.monotonic() < deadline, rx.read_log()
                time.sleep(0.1)
            res = cluster.exec_in(name, "h1", [*probe, "send", "--host", data_address(name, "h2"), "--port", "5004",
                                               "--bytes", str(nbytes)], timeout=120)
            assert res.returncode == 0, res.stderr
            assert rx.wait(timeout=60) == 0, rx.read_log()
            result = json.loads(rx.read_log().strip().splitlines()[-1])["result"]
        finally:
            rx.kill()
            rx_remote.close()
        stats = {f"{s['link']}/{s['direction']}": s for s in json.loads(
            tb_cli("stats", "--topo", name, "--json").stdout)}
        eng = stats["h1-h2/h1->h2"]
        assert eng["machine"] == record["placement"]["h1"]
        assert eng["bits_flipped"] > 0
        assert result["received"] == nbytes
        sent = json.loads(res.stdout.strip().splitlines()[-1])["result"]
        assert_flips_delivered(eng["bits_flipped"], result["bit_errors"], sent, 1e-5)
    finally:
        assert tb_cli("down", name, timeout=180).returncode == 0
    assert_nothing_left(ms, name)


def test_killing_the_controller_during_up_then_down_all_leaves_nothing(machines):
    ms, inv = machines
    name = unique_name("ring4")
    p = subprocess.Popen([*_testbed(), "up", str(TOPOLOGIES / "ring4.yaml"), "--name", name, "--machines", str(inv)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # kill it once some machine has begun building its part
        deadline = time.monotonic() + 60
        while not any(netns_of(m) for m in ms):
            assert p.poll() is None and time.monotonic() < deadline, "up ended before it could be killed"
            time.sleep(0.02)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert cluster.cluster_of(name) is not None  # recorded before any machine was touched
    r = tb_cli("down", "--all", timeout=300)
    assert r.returncode == 0, r.stderr
    time.sleep(1)
    assert_nothing_left(ms, name)


def test_an_unreachable_machine_and_a_bad_key_give_clear_errors_and_build_nothing(machines, tmp_path):
    ms, inv = machines
    import yaml

    doc = yaml.safe_load(inv.read_text())
    bad_addr = dict(doc, machines={**doc["machines"], "m2": {**doc["machines"]["m2"], "address": "192.0.2.99"}})
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    bad_key = dict(doc, machines={**doc["machines"], "m2": {**doc["machines"]["m2"], "key": str(key)}})
    (tmp_path / "empty_known_hosts").write_text("")
    unknown_host_key = dict(doc, machines={**doc["machines"], "m2": {**doc["machines"]["m2"],
                                                                     "known_hosts": str(tmp_path / "empty_known_hosts")}})
    fp = subprocess.run(["ssh-keygen", "-l", "-f", ms[1].host_key], capture_output=True, text=True,
                        check=True).stdout.split()[1]
    for what, d in (("unreachable", bad_addr), ("authentication", bad_key), ("host-key", unknown_host_key)):
        f = tmp_path / f"{what}.yaml"
        f.write_text(yaml.safe_dump(d))
        name = unique_name("pair")
        r = tb_cli("up", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--machines", str(f), timeout=120)
        assert r.returncode != 0
        assert "m2" in r.stderr and what.split("-")[0][:6] in r.stderr.lower(), r.stderr
        if what == "host-key":
            assert f"m2 (192.0.2.12:22): host-key: unknown host key ssh-ed25519 {fp}" in r.stderr, r.stderr
        assert cluster.cluster_of(name) is None
        assert_nothing_left(ms, name)


@pytest.mark.slow  # 35-70 s of SSH round trips; the latency bench runs locally in make test (test_bench.py)
def test_bench_latency_across_two_machines(machines, tmp_path):
    """`testbed bench latency --machines FILE`: the topology file is placed across the machines for the
    measurement and removed after. 16 KB round trips over the tunnelled link h1-h2 (engines on both machines,
    changed live from here): at 1e-5 ~2.6 flips per round trip, 25 round trips per configuration (warm-up
    included): ~65 flips expected, P(none) < e^-60, and keep drops what is hit, so TCP retransmits."""
    ms, inv = machines
    first2 = inv.with_name("first2-bench.yaml")
    first2.write_text(_subset(inv.read_text(), [m.name for m in ms[:2]]))
    name = unique_name("pair")
    r = tb_cli("bench", "latency", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--machines", str(first2),
               "--bers", "1e-5", "--count", "20", "--warmup", "5", "--out", str(tmp_path / "lat"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout
    assert any(line.split()[:2] == ["h1", ms[0].name] for line in r.stderr.splitlines()), r.stderr  # placement
    doc = json.loads((tmp_path / "lat" / "latency.json").read_text())
    rows = {x["label"]: x for x in doc["results"]}
    assert set(rows) == {"no engine", "engine ber 0", "engine ber 0 keep", "ber 1e-05 fix", "ber 1e-05 keep"}
    assert all(x["samples"] == 20 and not x["errors"] for x in rows.values()), doc["results"]
    assert rows["no engine"]["bits_flipped"] == 0 and rows["engine ber 0"]["bits_flipped"] == 0
    assert rows["engine ber 0"]["bits_seen"] > 0  # the engines on both machines saw the traffic
    assert rows["ber 1e-05 fix"]["bits_flipped"] > 0 and rows["ber 1e-05 keep"]["bits_flipped"] > 0
    assert rows["ber 1e-05 keep"]["retrans_segs"] > 0
    assert cluster.cluster_of(name) is None
    assert_nothing_left(ms, name)


@pytest.mark.slow  # ~60 s more on top of the latency one; the same ClusterTestbed calls
def test_bench_collective_on_a_topology_up_across_machines_leaves_it_as_found(machines, tmp_path):
    """`testbed bench collective NAME` on a topology that is up across machines: ranks on both machines, engines
    started for --ber on both, and the topology left as found."""
    ms, inv = machines
    name = unique_name("pair")
    up("pair.yaml", inv, name, 2)
    try:
        r = tb_cli("bench", "collective", name, "--sizes", "1K,64K", "--budget", "0.2", "--ber", "1e-5",
                   "--out", str(tmp_path / "coll"), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:] + r.stdout
        doc = json.loads((tmp_path / "coll" / "collective.json").read_text())
        assert doc["world_size"] == 2 and [x["bytes"] for x in doc["results"]] == [1024, 65536]
        assert all(x["allreduce"]["median_s"] > 0 for x in doc["results"])
        assert doc["bits_seen"] > 0 and doc["engines_alive"]
        # left as found: the engines it started for --ber are gone again
        assert json.loads(tb_cli("stats", "--topo", name, "--json").stdout or "[]") == []
    finally:
        assert tb_cli("down", name, timeout=180).returncode == 0
    assert_nothing_left(ms, name)


def _testbed() -> list[str]:
    from conftest import TESTBED

    return list(TESTBED)


def test_tiny_ddp_trains_across_two_machines_at_ber_1e5_tensor_scope(machines, tmp_path):
    """Workers on their hosts' machines, results collected here. ~3.8e6 eligible bits per step and direction:
    ~76 flips expected per step at 1e-5, P(no flip in 10 steps) < e^-700."""
    from testbed.experiments.training import train
    from testbed.topology.topo import Topology
    from testbed.train.settings import TrainSettings

    ms, inv = machines
    first2 = inv.with_name("first2-train.yaml")
    first2.write_text(_subset(inv.read_text(), [m.name for m in ms[:2]]))
    name = unique_name("pair")
    cfg = TrainSettings(mode="ddp", model="tiny", steps=10, seed=1, batch_size=4, seq_len=32, eval_every=5,
                        timeout=15, stall_timeout=60, run_timeout=240, monitor=True)
    s = train(Topology.load(TOPOLOGIES / "pair.yaml"), cfg, tmp_path / "run", ber=1e-5, scope="tensor",
              name=name, machines=load_inventory(first2), log=lambda _m: None)
    assert s["status"] == "ok", s.get("reason")
    assert s["steps_completed"] == 10 and s["world_size"] == 2
    assert s["machines"] == {"h1": ms[0].name, "h2": ms[1].name}
    assert s["bits_flipped"] > 0 and {e["machine"] for e in s["engines"]} == {ms[0].name, ms[1].name}
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "final-rank1.pt").exists()
    # --monitor: rank 0 (on the first machine) collected both ranks' records over the management network; its
    # file was mirrored here, and testbed locate reads it
    from testbed.locate import detectors

    obs = detectors.load(tmp_path / "run")
    assert [st["step"] for st in obs["steps"]] == list(range(10)) and set(obs["steps"][0]["probe"]) == {"0->1", "1->0"}
    assert cluster.cluster_of(name) is None  # brought down after the run
    assert_nothing_left(ms, name)
