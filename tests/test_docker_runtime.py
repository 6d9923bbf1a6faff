"""The docker runtime for real: hosts are containers of the worker image, joined by the same veths, bridges,
routes and corruption engines as namespace hosts. Needs a Docker engine (`containers/ensure-docker.sh`, which
`make test` runs); the worker image is built once by the session fixture if missing (~3-4 min the first time
on a machine without a registry, seconds afterwards).

Every container these tests make carries testbed.topology=NAME and is removed even when a test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from conftest import ROOT, leftovers, tb_cli, unique_name
from testbed import procs

pytestmark = pytest.mark.docker

ENSURE = ROOT / "containers" / "ensure-docker.sh"


# -- fixtures ------------------------------------------------------------------------------------------------------


def containers_of(client, name: str) -> list:
    return client.containers.list(all=True, filters={"label": f"testbed.topology={name}"})


def nothing_left(client, name: str) -> dict:
    left = leftovers(name)
    ctrs = [c.name for c in containers_of(client, name)]
    if ctrs:
        left["containers"] = ctrs
    return left


@contextmanager
def running_docker(client, topology):
    """Bring a topology up on the docker runtime; always tear it down, then check nothing is left."""
    from testbed.net import Testbed, teardown

    tb = Testbed(topology, runtime="docker")
    try:
        tb.up()
        yield tb
    finally:
        teardown(topology.name, save_stats=False)
        for c in containers_of(client, topology.name):  # belt and braces: never leave a container behind
            c.remove(force=True)
        left = nothing_left(client, topology.name)
        assert not left, f"leftovers of {topology.name}: {left}"


def _rx_bytes(tb, host: str, iface: str) -> int:
    return int(tb.run(host, ["cat", f"/sys/class/net/{iface}/statistics/rx_bytes"], check=True).stdout)


# -- tests ---------------------------------------------------------------------------------------------------------


def test_container_settings(docker_client, worker_image, load_topology):
    """Containers as the issue asks: no network of their own, NET_ADMIN only, init, labels, hostnames; names
    resolve inside (the topology's hosts file). Traffic across every link is tested for both runtimes in
    test_topology_net.py."""
    topo = load_topology("pair.yaml")
    with running_docker(docker_client, topo) as tb:
        for h in topo.hosts:
            a = docker_client.api.inspect_container(tb.host(h).container_id)
            hc = a["HostConfig"]
            assert a["Name"] == f"/tb.{topo.name}.{h}" and a["Config"]["Hostname"] == h
            assert a["Config"]["Labels"]["testbed.topology"] == topo.name
            assert a["Config"]["Labels"]["testbed.node"] == h
            assert hc["NetworkMode"] == "none" and hc["CapAdd"] == ["NET_ADMIN"] and not hc["Privileged"]
            assert hc["Init"] is True
            assert tb.host(h).netns == f"/proc/{a['State']['Pid']}/ns/net"
        other = topo.hosts[-1]
        r = tb.run(topo.hosts[0], ["ping", "-c1", "-W2", other], check=True)
        assert tb.address(other) in r.stdout


def test_exec_stdin_env_and_signals(docker_client, worker_image, load_topology):
    topo = load_topology("pair.yaml")
    with running_docker(docker_client, topo) as tb:
        # stdin passes through; the environment given reaches the command, host-only variables do not.
        r = subprocess.run(tb.runtime.exec_argv(tb.host("h1"), ["sh", "-c", "cat; echo $FOO; echo $VIRTUAL_ENV"],
                                                {"FOO": "bar", "VIRTUAL_ENV": "/work/main/.venv"}),
                           input="in\n", capture_output=True, text=True, timeout=30)
        assert (r.returncode, r.stdout) == (0, "in\nbar\n/opt/venv\n")  # the image's own
        # kill() of a popen'd command stops the command inside the container, not just the docker client.
        p = tb.popen("h1", ["sleep", "600"])
        time.sleep(0.3)
        inside = {pid: procs.start_time(pid) for pid in p.inside_pids()}
        assert inside, "the command is not running in the container"
        p.kill()
        assert p.wait(timeout=10) != 0
        time.sleep(0.2)
        assert not any(procs.alive(pid, t) for pid, t in inside.items()), "sleep survived kill()"
        # terminate(): the command gets SIGTERM and its exit status comes back through the client.
        p = tb.popen("h2", ["sh", "-c", "trap 'exit 7' TERM; sleep 600 & wait"])
        time.sleep(0.3)
        p.terminate()
        assert p.wait(timeout=10) == 7


def test_limits_env_and_mounts(docker_client, worker_image, tmp_path):
    from testbed.runtime.docker import WORK_DIR
    from testbed.topology.topo import Topology
    from testbed.topology.units import parse_size

    name = unique_name("limits")
    f = tmp_path / "limits.yaml"
    f.write_text(f"""name: {name}
runtime: docker
topology:
  nodes:
    a: {{cpus: 0.5, memory: 256m, env: {{FOO: bar}}}}
    b: {{}}
  links:
    - endpoints: [a:eth1, b:eth1]
""")
    topo = Topology.load(f)
    MEM = topo.nodes["a"].memory
    assert MEM == parse_size("256m")
    with running_docker(docker_client, topo) as tb:
        hc = docker_client.api.inspect_container(tb.host("a").container_id)["HostConfig"]
        assert hc["NanoCpus"] == 500_000_000 and hc["Memory"] == MEM
        hb = docker_client.api.inspect_container(tb.host("b").container_id)["HostConfig"]
        assert hb["NanoCpus"] == 0 and hb["Memory"] == 0
        # The limits are the cgroup the exec'd commands run in (cgroup v1 or v2).
        probe = ("if [ -f /sys/fs/cgroup/cpu.max ]; then cat /sys/fs/cgroup/cpu.max /sys/fs/cgroup/memory.max; "
                 "else echo $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us); "
                 "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; fi")
        out = tb.run("a", ["sh", "-c", probe], check=True).stdout.split()
        quota, period, mem = int(out[0]), int(out[1]), int(out[2])
        assert quota / period == 0.5 and mem == MEM
        assert tb.run("a", ["printenv", "FOO"], check=True).stdout == "bar\n"
        # The shared work directory is the same path inside every host and outside.
        mark = WORK_DIR / f"{name}.mark"
        try:
            tb.run("a", ["sh", "-c", f"echo from-a > {mark}"], check=True)
            assert mark.read_text() == "from-a\n"
            assert tb.run("b", ["cat", str(mark)], check=True).stdout == "from-a\n"
            assert tb.run("b", ["pwd"], check=True).stdout.strip() == str(WORK_DIR)
        finally:
            mark.unlink(missing_ok=True)
        cache = tb.run("a", ["printenv", "TESTBED_CACHE"], check=True).stdout.strip()
        assert cache and os.path.isdir(cache) and tb.run("a", ["test", "-d", cache]).returncode == 0


def test_down_kills_processes_that_entered_a_container(docker_client, worker_image, load_topology):
    """A process that entered a container's namespace from the host keeps it (and its veths) alive: down must
    kill it too. (Down leaving nothing is tested for both runtimes in test_topology_net.py.)"""
    topo = load_topology("pair.yaml")
    r = tb_cli("up", str(ROOT / "topologies/pair.yaml"), "--name", topo.name, "--runtime", "docker")
    outsider = None
    try:
        assert r.returncode == 0, r.stderr
        netns = json.loads(tb_cli("status", "--topo", topo.name, "--json").stdout)[0]["hosts"]["h2"]["netns"]
        outsider = subprocess.Popen(["nsenter", f"--net={netns}", "--", "sleep", "600"])
        time.sleep(0.3)
    finally:
        r = tb_cli("down", topo.name)
        for c in containers_of(docker_client, topo.name):
            c.remove(force=True)
    assert r.returncode == 0, r.stderr
    assert outsider.wait(timeout=10) == -signal.SIGKILL
    assert not nothing_left(docker_client, topo.name)


TB = [sys.executable, "-m", "testbed"]


def test_no_engine_reachable_is_a_clear_error(tmp_path):
    name = unique_name("noeng")
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    r = tb_cli("up", str(ROOT / "topologies/pair.yaml"), "--name", name, "--runtime", "docker", env=env)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "no Docker engine is reachable" in r.stderr and "unix:///nonexistent/docker.sock" in r.stderr
    assert "ensure-docker.sh" in r.stderr and "DOCKER_HOST" in r.stderr and "docker.io" in r.stderr
    assert not leftovers(name)
    # `doctor` says the same, without failing on it (docker is optional).
    r = tb_cli("doctor", "--json", env=env)
    docker_check = [c for c in json.loads(r.stdout) if c["name"] == "docker"][0]
    assert not docker_check["ok"] and "ensure-docker.sh" in docker_check["detail"]


def test_ddp_training_across_containers(docker_client, worker_image, load_topology, tmp_path):
    """GPT-2 (tiny) DDP over gloo between two containers at BER 1e-5, tensor scope: the same `train` as for
    namespaces; the results record the runtime and the image digest."""
    from testbed.experiments.training import train
    from testbed.train.settings import TrainSettings

    topo = load_topology("pair.yaml")
    cfg = TrainSettings(mode="ddp", model="tiny", steps=20, seed=1, batch_size=4, seq_len=32, timeout=15,
                        stall_timeout=60, run_timeout=300)
    s = train(topo, cfg, tmp_path / "run", ber=1e-5, scope="tensor", runtime="docker", log=lambda m: None)
    assert s["status"] == "ok", s
    assert s["steps_completed"] == 20 and s["bits_flipped"] > 0
    assert s["runtime"] == "docker" and s["image_digest"] == worker_image["id"]
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "summary.json").exists()
    assert not nothing_left(docker_client, topo.name)


def test_image_info_and_digest(worker_image):
    from testbed import __version__
    from testbed.runtime.image import image_digest

    assert image_digest(worker_image["tag"]) == worker_image["id"] and worker_image["id"].startswith("sha256:")
    r = tb_cli("image", "info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["id"] == worker_image["id"]
    assert info["labels"]["testbed.image"] == "worker" and info["labels"]["testbed.version"] == __version__
    assert image_digest("testbed-no-such-image:never") is None
