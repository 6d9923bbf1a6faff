"""Topologies brought up for real: namespaces, veths, bridges, addresses, routes, and TCP across them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from testbed.runtime.base import RESOLV_CONF

from conftest import ROOT, leftovers, root_links, running, tb_cli, unique_name

PORT = 5301


def _rx_bytes(tb, host: str, iface: str) -> int:
    r = tb.run(host, ["cat", f"/sys/class/net/{iface}/statistics/rx_bytes"], check=True)
    return int(r.stdout)


def all_pairs_tcp(tb, nbytes: int = 200_000) -> None:
    """Every host sends to every other host's data address over TCP and checks the bytes came back intact."""
    servers = []
    try:
        for h in tb.topo.hosts:
            p = tb.popen(h, [tb.runtime.python, "-m", "testbed.bench.tcpcheck", "serve", str(PORT)],
                         stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "READY"
            servers.append(p)
        clients = {}
        for h in tb.topo.hosts:
            targets = [f"{tb.address(o)}:{PORT}" for o in tb.topo.hosts if o != h]
            clients[h] = tb.popen(h, [tb.runtime.python, "-m", "testbed.bench.tcpcheck", "send", str(nbytes), *targets],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for h, c in clients.items():
            out, _ = c.communicate(timeout=60)
            assert c.returncode == 0, f"from {h}:\n{out}"
    finally:
        for p in servers:
            p.kill()
            p.wait()


@pytest.mark.parametrize("file", ["ring4.yaml", "chain4.yaml", "star8.yaml"])
def test_tcp_crosses_every_link(load_topology, runtime, file):
    topo = load_topology(file)
    with running(topo, runtime=runtime) as tb:
        before = {(h, i.iface): _rx_bytes(tb, h, i.iface) for h in topo.hosts for i in topo.plan.interfaces[h]}
        all_pairs_tcp(tb)
        # Every data interface of every host received (at least) a transfer's worth: every link carried data.
        for (h, iface), b in before.items():
            assert _rx_bytes(tb, h, iface) - b > 200_000, f"{h}:{iface} carried no data"
        # Multi-hop really is multi-hop: in the chain, h1 reaches h4 through two forwarding hosts.
        if file == "chain4.yaml":
            r = tb.run("h1", ["ping", "-c1", "-W2", tb.address("h4")], check=True)
            assert "ttl=62" in r.stdout


def test_exec_passes_output_and_exit_code(load_topology, runtime):
    topo = load_topology("pair.yaml")
    with running(topo, runtime=runtime):
        r = tb_cli("exec", "--topo", topo.name, "h1", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
        r = tb_cli("exec", "--topo", topo.name, "h2", "--", "hostname")
        assert (r.returncode, r.stdout.strip()) == (0, "h2")
        r = tb_cli("exec", "--topo", topo.name, "h1", "--", "ip", "-o", "-4", "addr", "show", "eth1")
        assert "10.0.0.1/24" in r.stdout
        r = tb_cli("exec", "--topo", topo.name, "h9", "--", "true")
        assert r.returncode == 2 and "no host 'h9'" in r.stderr


def test_down_leaves_nothing(load_topology, runtime):
    topo = load_topology("star8.yaml")
    links_before = root_links()
    r = tb_cli("up", str(ROOT / "topologies/star8.yaml"), "--name", topo.name, "--runtime", runtime)
    assert r.returncode == 0, r.stderr
    try:
        assert "h8" in r.stdout and "s1" in r.stdout
        # A process left running inside a host, and a qdisc + iptables rule: down must remove all of it.
        sleeper = subprocess.Popen([*tb_argv(), "exec", "--topo", topo.name, "h3", "--", "sleep", "600"])
        time.sleep(0.5)
        status = json.loads(tb_cli("status", "--topo", topo.name, "--json").stdout)[0]
        assert status["healthy"] and len(status["hosts"]) == 8
        assert leftovers(topo.name)["netns"]
    finally:
        r = tb_cli("down", topo.name)
    assert r.returncode == 0, r.stderr
    sleeper.wait(timeout=10)
    assert sleeper.returncode != 0  # killed by down, not left behind
    assert not leftovers(topo.name)
    assert root_links() == links_before
    assert tb_cli("status", "--topo", topo.name).returncode == 2


def tb_argv() -> list[str]:
    return [sys.executable, "-m", "testbed"]


def test_down_all_after_sigkill_of_up(load_topology, runtime):
    names = []
    try:
        # One `up` killed half-way, one killed after it finished: both leave state for `down --all`.
        for i, kill_after in enumerate(("partial", "complete")):
            name = unique_name(f"kill{i}")
            names.append(name)
            p = subprocess.Popen([*tb_argv(), "up", str(ROOT / "topologies/star8.yaml"), "--name", name,
                                  "--runtime", runtime],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
            deadline = time.monotonic() + 60
            if kill_after == "partial":
                # Killed while hosts are being made: some namespaces/containers exist, others not yet.
                while len(leftovers(name).get("containers" if runtime == "docker" else "netns", [])) < 4 \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)
                p.kill()
            else:
                p.wait(timeout=60)
            p.wait()
            assert leftovers(name), "nothing was created before the kill"
        r = tb_cli("down", "--all")
        assert r.returncode == 0, r.stderr
        for name in names:
            assert not leftovers(name), leftovers(name)
    finally:
        for name in names:
            tb_cli("down", name)


def test_two_topologies_do_not_interfere(load_topology, runtime):
    a, b = load_topology("pair.yaml"), load_topology("pair.yaml")
    assert a.name != b.name and a.plan.mgmt == b.plan.mgmt  # same addresses on purpose
    with running(a, runtime=runtime) as ta:
        with running(b, runtime=runtime) as tb:
            # Each pair talks within itself, and a command run in a host runs in that topology's host: it
            # reports the host's own name and sits in the host's own network namespace, not the other pair's.
            all_pairs_tcp(ta)
            all_pairs_tcp(tb)
            assert ta.host("h1").netns != tb.host("h1").netns
            for t in (ta, tb):
                for h in t.topo.hosts:
                    assert t.run(h, ["hostname"], check=True).stdout.strip() == h
                    # names come from the topology's hosts file; the resolver has no server to wait for
                    assert t.run(h, ["cat", "/etc/resolv.conf"], check=True).stdout == RESOLV_CONF
                    peer = t.run(h, ["getent", "hosts", "h2-mgmt"], check=True).stdout.split()
                    assert peer[0] == str(t.topo.plan.mgmt["h2"].ip), peer
                    netns = t.run(h, ["readlink", "/proc/self/ns/net"], check=True).stdout.strip()
                    assert netns == f"net:[{os.stat(t.host(h).netns).st_ino}]", (t.name, h, netns)
        # b is gone; a still works.
        all_pairs_tcp(ta)


def test_rate_limit_is_applied(load_topology, runtime):
    topo = load_topology("pair.yaml").with_overrides(rate="50mbit")
    with running(topo, runtime=runtime) as tb:
        q = tb.run("h1", ["tc", "qdisc", "show", "dev", "eth1"], check=True).stdout
        assert "tbf" in q and "50Mbit" in q
        probe = [tb.runtime.python, "-m", "testbed.bench.probe"]
        rx = tb.popen("h2", [*probe, "recv", "--port", "5003", "--bytes", "6000000"], stdout=subprocess.PIPE,
                      text=True)
        try:
            assert "listening" in rx.stdout.readline()
            r = tb.run("h1", [*probe, "send", "--host", tb.address("h2"), "--port", "5003", "--bytes", "6000000"],
                       timeout=60, check=True)
            gbit_s = json.loads(r.stdout.strip().splitlines()[-1])["result"]["gbit_s"]
            # Shaped to 50 Mbit/s: far below an unshaped veth (>1 Gbit/s), not starved either.
            assert 0.025 < gbit_s < 0.06, gbit_s
        finally:
            rx.kill()
            rx.wait()


def test_delay_without_netem_is_refused_clearly(load_topology, tmp_path):
    from testbed.link import netem_available

    topo_file = tmp_path / "delay.yaml"
    name = unique_name("delay")
    topo_file.write_text(f"""name: {name}
topology:
  nodes: {{a: {{}}, b: {{}}}}
  links:
    - endpoints: [a:eth1, b:eth1]
      delay: 1ms
""")
    r = tb_cli("up", str(topo_file))
    try:
        if netem_available():
            assert r.returncode == 0, r.stderr
            q = subprocess.run(["ip", "netns", "exec", f"tb.{name}.a", "tc", "qdisc"], capture_output=True, text=True)
            assert "netem" in q.stdout
        else:
            assert r.returncode == 3, r.stderr
            assert "netem" in r.stderr and "a-b (a->b)" in r.stderr
            assert not leftovers(name)
    finally:
        tb_cli("down", name)


def test_offloads_and_mtu_are_applied(load_topology, runtime, tmp_path):
    from testbed.topology.topo import Topology

    f = tmp_path / "off.yaml"
    f.write_text(f"""name: {unique_name("off")}
topology:
  nodes: {{a: {{}}, b: {{}}}}
  links:
    - endpoints: [a:eth1, b:eth1]
      mtu: 9000
      offloads: {{tso: false, tx_checksum: false}}
""")
    with running(Topology.load(f), runtime=runtime) as tb:
        for h in ("a", "b"):
            link = tb.run(h, ["ip", "-o", "link", "show", "eth1"], check=True).stdout
            assert "mtu 9000" in link
            feats = tb.run(h, ["ethtool", "-k", "eth1"], check=True).stdout
            assert "tcp-segmentation-offload: off" in feats and "tx-checksumming: off" in feats


def test_doctor_reports_every_capability():
    r = tb_cli("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    for name in ("root", "netns", "veth", "bridge", "tbf", "netem", "nfqueue", "nsenter", "docker"):
        assert name in checks and checks[name]["detail"]
    assert r.returncode == (0 if all(c["ok"] for c in checks.values() if c["essential"]) else 1)
    assert checks["netns"]["ok"] and checks["veth"]["ok"] and checks["nfqueue"]["ok"]
    if not checks["netem"]["ok"]:
        assert "refused" in checks["netem"]["detail"]
    text = tb_cli("doctor").stdout
    assert "essentials" in text


def test_status_and_down_handle_a_state_without_state_file():
    from testbed.state import state_dir

    name = unique_name("broken")
    d = state_dir(name)
    d.mkdir(parents=True)  # what a SIGKILL right after `up` claimed its name leaves
    try:
        r = tb_cli("status", "--json")
        mine = [s for s in json.loads(r.stdout) if s["name"] == name][0]
        assert r.returncode == 1 and mine["phase"] == "broken" and "testbed down" in mine["problems"][0]
        r = tb_cli("exec", "--topo", name, "h1", "--", "true")
        assert r.returncode == 2 and "interrupted" in r.stderr
        assert tb_cli("down", name).returncode == 0
        assert not d.exists()
    finally:
        tb_cli("down", name)


def _nfqueue_rules(tb, host: str) -> list[str]:
    out = tb.run(host, ["iptables", "-w", "-t", "mangle", "-S"], check=True).stdout
    return [r for r in out.splitlines() if "NFQUEUE" in r]


def test_testbed_counters_restore_and_detach(load_topology):
    """The Testbed API that benchmarks and training use: counter snapshots and their per-direction deltas,
    changing a link and getting it back as it was, and detaching a link's engines for a while."""
    from testbed.engine.counters import counter_delta

    topo = load_topology("pair.yaml").with_overrides(ber=1e-5, scope="payload")
    with running(topo) as tb:
        keys = {"h1-h2/h1->h2", "h1-h2/h2->h1"}
        before = tb.counters()
        assert set(before) == keys and all(s["alive"] for s in before.values())
        nbytes = 300_000
        probe = [tb.runtime.python, "-m", "testbed.bench.probe"]
        rx = tb.popen("h2", [*probe, "recv", "--port", "5004", "--bytes", str(nbytes)], stdout=subprocess.PIPE,
                      text=True)
        try:
            assert "listening" in rx.stdout.readline()
            tb.run("h1", [*probe, "send", "--host", tb.address("h2"), "--port", "5004", "--bytes", str(nbytes)],
                   timeout=60, check=True)
            rx.wait(timeout=30)
        finally:
            rx.kill()
            rx.wait()
        delta = tb.counters_since(before)
        assert set(delta) == keys
        sent = delta["h1-h2/h1->h2"]
        assert sent["bits_seen"] == 8 * nbytes and sent["bits_flipped"] > 0, sent
        assert sent["ber"] == 1e-5 and sent["scope"] == "payload" and sent["alive"] is True
        assert set(sent) == {"link", "direction", "alive", "ber", "scope", "checksum", "bits_seen", "bits_flipped",
                             "packets_modified", "flows_desynced", "queue_dropped", "user_dropped"}
        assert sent["queue_dropped"] == sent["user_dropped"] == 0  # engine-caused loss: none in a healthy run
        assert counter_delta(before, before)["h1-h2/h1->h2"]["bits_seen"] == 0

        # Changed inside, as it was after: settings restored on the engines that were there.
        with tb.links_restored(["h1-h2"]):
            tb.set_link("h1-h2", ber=1e-3, checksum="keep")
            assert {s["ber"] for s in tb.stats()} == {1e-3}
        assert {(s["ber"], s["checksum"]) for s in tb.stats()} == {(1e-5, "fix")}

        # Detached: no NFQUEUE rule (traffic passes clean), the engines keep running; attached again after.
        assert len(_nfqueue_rules(tb, "h1")) == 1 and len(_nfqueue_rules(tb, "h2")) == 1
        with tb.detached("h1-h2"):
            assert _nfqueue_rules(tb, "h1") == [] and _nfqueue_rules(tb, "h2") == []
            assert all(e["alive"] for e in tb.status()["engines"])
        assert len(_nfqueue_rules(tb, "h1")) == 1 and len(_nfqueue_rules(tb, "h2")) == 1
        assert tb.status()["healthy"]


def test_links_restored_stops_engines_started_inside(load_topology):
    with running(load_topology("pair.yaml")) as tb:
        assert tb.counters() == {}
        with tb.links_restored():
            assert tb.set_link("h1-h2", "h1-h2", ber=1e-6) == ["h1-h2/h1->h2"]
            assert set(tb.counters()) == {"h1-h2/h1->h2"}
        assert tb.counters() == {} and tb.status()["engines"] == []
        assert not leftovers(tb.name).get("engines")


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def test_namespaces_are_made_in_a_thread_without_forking(monkeypatch, tmp_path):
    """nsutil's namespace creation (network and UTS) runs in a short-lived thread: no process is started, the
    caller's own namespaces are untouched (also when it is not the main thread), the namespace has lo up and
    the host sysctls, and removing it leaves nothing."""
    import threading

    from testbed import nsutil

    topo = unique_name("nsmake")
    names = [nsutil.ns_name(topo, h) for h in ("h1", "h2")]
    mine = os.readlink("/proc/thread-self/ns/net"), os.readlink("/proc/thread-self/ns/uts")
    hostname = os.uname().nodename

    def no_process(*a, **kw):
        raise AssertionError("a process was started")

    try:
        with monkeypatch.context() as m:
            for mod, attr in ((os, "fork"), (os, "posix_spawn"), (subprocess.Popen, "_execute_child")):
                m.setattr(mod, attr, no_process)
            path1 = nsutil.create_netns(names[0])
            box = {}  # from a thread other than the main one (/proc/self would name the main thread's namespace)
            t = threading.Thread(target=lambda: box.update(path=nsutil.create_netns(names[1])))
            t.start()
            t.join()
            path2 = box["path"]
            uts = tmp_path / "uts-h1"
            uts.touch()
            nsutil.create_uts(str(uts), "h1")
            with nsutil.iproute(path1) as ip:
                links = {l.get("ifname"): l for l in ip.get_links()}
        assert (os.readlink("/proc/thread-self/ns/net"), os.readlink("/proc/thread-self/ns/uts")) == mine
        assert os.uname().nodename == hostname
        inodes = {os.stat(p).st_ino for p in (path1, path2, "/proc/self/ns/net")}
        assert len(inodes) == 3, "each path is a namespace of its own, not this process's"
        assert list(links) == ["lo"] and links["lo"]["flags"] & 1, links  # only lo, and up
        for path in (path1, path2):
            for key, value in nsutil.HOST_SYSCTLS.items():
                r = nsutil.nsexec(path, ["sysctl", "-n", key])
                assert r.stdout.strip() == value, (path, key)
            r = nsutil.nsexec(path, ["ip", "-o", "-6", "addr", "show"])
            assert r.stdout.strip() == "", "no IPv6 address, not even on lo"
        r = subprocess.run(["nsenter", f"--uts={uts}", "hostname"], capture_output=True, text=True)
        assert r.stdout.strip() == "h1"
        with pytest.raises(FileExistsError):
            nsutil.create_netns(names[0])  # refused, and the namespace there is left as it was
        assert os.stat(path1).st_ino in inodes and _mounted(path1)
        nsutil.unmount(str(uts))
        assert not _mounted(str(uts))
    finally:
        for n in names:
            nsutil.remove_netns(n)
    assert nsutil.list_testbed_netns(topo) == [] and not leftovers(topo)
    assert not any(_mounted(nsutil.ns_path(n)) for n in names)


def test_teardown_sweeps_only_the_recorded_runtime(monkeypatch):
    """`down` of a topology whose state file names its runtime sweeps that runtime only (a netns topology never
    asks the docker daemon); without that record (an `up` killed before its first write) it sweeps them all."""
    from testbed import clean
    from testbed.runtime.base import RUNTIMES
    from testbed.state import State, claim

    swept = []
    for name, cls in RUNTIMES.items():
        monkeypatch.setattr(cls, "delete_all", lambda self, topology=None, _n=name: swept.append(_n) or [])
    name = unique_name("sweeprt")
    claim(name)
    State.new(name, runtime="netns")
    clean.teardown(name, save_stats=False)
    assert swept == ["netns"]
    swept.clear()
    claim(name)  # the state directory alone: what a SIGKILL right after `up` claimed the name leaves
    clean.teardown(name, save_stats=False)
    assert swept == list(RUNTIMES)
    assert not leftovers(name)
