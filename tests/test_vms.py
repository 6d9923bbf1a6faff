"""Real VMs: two Debian VMs booted with qemu from an image built here with debootstrap (testbed/machines/vm.py), driven
through the same code path as any machines: paramiko (testbed/machines/remote.py) and `testbed up --machines`, with the
controller's checkout and Python shared into the guests read-only (9p), real VXLAN tunnels between the VMs and
netem (sch_netem) in their kernel.

Marked `vm` (minutes: the first run builds the image; TCG when KVM does not boot here) and deselected by
default: `make test-vm` (pytest -m vm tests/test_vms.py). Privileged (root: debootstrap, namespaces, taps).
The timings are printed at the end (shown with -rA or -s) and written to $TESTBED_VM_TIMINGS when it is set."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import yaml

from conftest import TOPOLOGIES, separate_controller, tb_cli, unique_name
from testbed.machines import cluster
from testbed.machines import vm

pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]

DELAY_MS = 5


def log(msg: str) -> None:
    print(f"[vm] {msg}", file=sys.stderr, flush=True)


def ns_of_tag(tag: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/run/netns") if n.startswith(f"tbv{tag}-"))
    except FileNotFoundError:
        return []


def guest_netns(m: vm.VM) -> list[str]:
    with m.ssh() as r:
        return sorted(l.split()[0] for l in r.run(["ip", "netns", "list"], timeout=60).stdout.splitlines() if l.strip())


def data_address(name: str, node: str) -> str:
    from testbed.state import State
    from testbed.topology.topo import Topology

    return str(Topology.from_dict(State.load(name).data["topology"]).plan.data_address(node))


def tcp_both_ways(name: str, machines: dict[str, vm.VM], port: int = 5999, nbytes: int = 2_000_000) -> None:
    """h1 and h2 each send `nbytes` to the other's data address over TCP (through the tunnel between the VMs),
    at the same time; each server replies with the byte count and sha256, which the client checks."""
    where = cluster.cluster_of(name)["placement"]
    testbed_cmd = vm.guest_testbed()
    py = testbed_cmd.rsplit("/", 1)[0] + "/python"
    servers = []
    try:
        for h in ("h1", "h2"):
            r = machines[where[h]].ssh()
            servers.append((r, r.start([testbed_cmd, "exec", "--topo", name, h, "--", py, "-m",
                                        "testbed.bench.tcpcheck", "serve", str(port)],
                                       log_path=f"/tmp/tcpcheck-{name}-{h}.log")))
        deadline = time.monotonic() + 180
        for r, p in servers:
            while "READY" not in p.read_log():
                assert p.poll() is None and time.monotonic() < deadline, p.read_log()
                time.sleep(0.3)
        results = {}

        def send(src, dst):
            results[src] = cluster.exec_in(name, src, [py, "-m", "testbed.bench.tcpcheck", "send", str(nbytes),
                                                       f"{data_address(name, dst)}:{port}"], timeout=240)

        threads = [threading.Thread(target=send, args=a) for a in (("h1", "h2"), ("h2", "h1"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for src in ("h1", "h2"):
            assert src in results and results[src].returncode == 0, (src, results.get(src))
    finally:
        for r, p in servers:
            p.kill()
            r.close()


def test_two_qemu_vms_carry_a_topology_with_netem_delay(tmp_path, monkeypatch):
    missing = [t for t in (vm.QEMU, "debootstrap", "mkfs.ext4") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: apt-get install qemu-system-x86 debootstrap e2fsprogs")
    # The controller (this process and its `testbed` commands) keeps its state in a directory of its own, as in
    # test_cluster: a failed run leaves no record here pointing at VMs that are gone.
    ctl = tmp_path / "controller-state"
    ctl.mkdir()
    separate_controller(monkeypatch, ctl, "tbc")
    timings: dict[str, float] = {}
    t_all = time.monotonic()
    t = time.monotonic()
    image = vm.build_image(log=log)
    timings["image_s"] = time.monotonic() - t
    timings["image_build_s (when built)"] = image.info.get("build_s", float("nan"))

    tag = f"{os.getpid() % 0xfffff:x}t"
    t = time.monotonic()
    try:
        with vm.vms(2, image, tag=tag, log=log) as ms:
            timings["boot_2_vms_s"] = time.monotonic() - t
            log(f"booted {ms} ({ms[0].accel}) in {timings['boot_2_vms_s']:.1f} s")
            machines = {m.name: m for m in ms}
            inv = tmp_path / "machines.yaml"
            inv.write_text(vm.inventory_yaml(ms))

            # the guests' kernel has netem (this host's may not); `up` checks their testbed's version itself
            for m in ms:
                with m.ssh() as r:
                    r.run(["modprobe", "sch_netem"], timeout=60)
                    assert "sch_netem" in r.run(["cat", "/proc/modules"], timeout=30).stdout

            # topologies/pair.yaml with a netem delay on its link
            name = unique_name("vmpair")
            doc = yaml.safe_load((TOPOLOGIES / "pair.yaml").read_text())
            doc["name"] = name
            doc["topology"]["links"][0]["delay"] = f"{DELAY_MS}ms"
            topo = tmp_path / "vmpair.yaml"
            topo.write_text(yaml.safe_dump(doc))
            t = time.monotonic()
            r = tb_cli("up", str(topo), "--name", name, "--machines", str(inv), timeout=900)
            timings["up_s"] = time.monotonic() - t
            assert r.returncode == 0, r.stderr + r.stdout
            try:
                record = cluster.cluster_of(name)
                assert sorted(record["placement"].values()) == ["m1", "m2"], record["placement"]
                for m in ms:  # each VM holds its own host's namespace only
                    mine = [h for h, where in record["placement"].items() if where == m.name]
                    got = [n.rsplit(".", 1)[1] for n in guest_netns(m) if not n.endswith("._mgmt")]
                    assert got == mine, (m.name, got)

                t = time.monotonic()
                s = json.loads(tb_cli("status", "--topo", name, "--json", timeout=300).stdout)[0]
                timings["status_s"] = time.monotonic() - t
                assert s["healthy"], s["problems"]
                assert {h: v["machine"] for h, v in s["hosts"].items()} == record["placement"]

                t = time.monotonic()
                tcp_both_ways(name, machines)
                timings["tcp_both_ways_s"] = time.monotonic() - t

                # netem's delay on the link, each direction: rtt >= 2 x delay
                res = cluster.exec_in(name, "h1", ["ping", "-c", "10", "-i", "0.2", "-W", "5",
                                                   data_address(name, "h2")], timeout=120)
                assert res.returncode == 0, res.stdout + res.stderr
                rtt = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/", res.stdout)
                assert rtt, res.stdout
                timings["rtt_min_ms"] = float(rtt.group(1))
                timings["rtt_avg_ms"] = float(rtt.group(2))
                assert float(rtt.group(1)) >= 2 * DELAY_MS, res.stdout
                for m in ms:  # the delay is netem's, in each VM's kernel
                    with m.ssh() as rr:
                        q = rr.run("for ns in $(ip netns list | cut -d' ' -f1); do ip netns exec $ns tc qdisc show; "
                                   "done", timeout=60).stdout
                        assert re.search(rf"netem .*delay {DELAY_MS}(\.0)?ms", q), (m.name, q)
            finally:
                t = time.monotonic()
                d = tb_cli("down", name, timeout=600)
                timings["down_s"] = time.monotonic() - t
                assert d.returncode == 0, d.stderr
            assert cluster.cluster_of(name) is None and os.listdir(ctl) == []
            for m in ms:
                assert guest_netns(m) == [], m.name
    finally:
        timings["total_s"] = time.monotonic() - t_all
        report = ", ".join(f"{k}={v:.1f}" for k, v in timings.items())
        log(f"timings: {report}")
        if os.environ.get("TESTBED_VM_TIMINGS"):
            with open(os.environ["TESTBED_VM_TIMINGS"], "w") as f:
                json.dump(timings, f, indent=1)
    # nothing of the VMs is left on this host
    assert vm.qemu_processes(tag) == []
    assert ns_of_tag(tag) == []
    left = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert f"tbv{tag}" not in left
