"""Results reproduced in Vagrant VMs for real (issue 24; `make test-vagrant`, mark `vagrant`, outside `make test`).

The box built here (testbed/machines/vagrantbox.py), libvirtd in a namespace of the testbed's own, two VMs m1 and m2
under TCG (KVM where it works), 1 CPU each, brought up WITH the Vagrantfile's provisioning in its `shared` mode:
this checkout, its venv and the Python installation are mounted read-only over 9p at their own paths
(TESTBED_VM_SHARE), so provisioning installs nothing (the VMs' networks have no way out: the namespace is not
routed to the host on purpose); it loads sch_netem and vxlan and lets the vagrant key log in as root. Then, from
this host, through `vagrant ssh-config` -> `testbed machines from-ssh-config` -> machines.yaml:

- a topology across the two VMs with netem delay, jitter and loss and a BER (this host's kernel has no netem):
  the RTT over a link with `delay: 1ms` against 2 ms (p50), and the loss and jitter of the other link;
- a small experiment (tiny GPT-2, DDP, BER 0 and 1e-5, scope tensor, fixed seed) with its hosts in the VMs
  (`testbed run --machines`), and the same experiment on this host (netns): per point the status, the flips,
  the final eval loss and the final `param_sha256`. The flips must be equal (wire flips are keyed on addresses,
  connection ordinal and eligible offset, docs/engine.md "Seeds and reproducibility"); the fingerprints are
  compared and reported (see docs/machines.md for why they differ across CPUs).

Everything is removed afterwards, on failure too: the VMs (`vagrant destroy -f`), the box copy (its Vagrant home
goes), libvirt's domains, networks and volumes, the daemons and the namespace. The timings (box build, vagrant up
with provisioning, the netem checks, the experiment in the VMs and on the host) and the comparison table are
printed (make test-vagrant runs pytest with -s) and written to $TESTBED_VAGRANT_REPORT when it is set. Root."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import TOPOLOGIES, separate_controller, tb_cli, unique_name
from testbed.machines import cluster, vagrantbox, vm
from testbed.machines.inventory import parse_inventory
from testbed.machines.remote import Remote

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.vagrant, pytest.mark.privileged, pytest.mark.timeout(3600)]

VMS = 2
MEMORY_MB = 1536   # one tiny-GPT-2 rank, torch mapped from the 9p share (1024 MB is the Vagrantfile's floor)
DELAY_MS = 1.0
REPORT: dict = {"timings_s": {}}


def log(msg: str) -> None:
    print(f"[vagrant] {msg}", file=sys.stderr, flush=True)


def guest_testbed() -> str:
    """The testbed command the VMs run from the shares: this venv's script, at the same path. The venv must be this
    checkout's own (`make test-vagrant`: .venv inside it): another venv's editable install points at another
    checkout, which is not shared, and the controller runs the machines' Python beside that script
    (cluster.python_of), so a PYTHONPATH in front of it would not reach the workers."""
    import testbed

    checkout = Path(testbed.__file__).resolve().parent.parent
    if Path(sys.prefix).resolve().parent != checkout:
        pytest.skip(f"the venv {sys.prefix} is not this checkout's ({checkout}/.venv): run `make test-vagrant` "
                    "in the checkout (the VMs run the shared venv's testbed)")
    return vm.guest_testbed()


def write_report() -> None:
    if os.environ.get("TESTBED_VAGRANT_REPORT"):
        Path(os.environ["TESTBED_VAGRANT_REPORT"]).write_text(json.dumps(REPORT, indent=1, default=str))


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    testbed_cmd = guest_testbed()
    mp = pytest.MonkeyPatch()
    # The controller keeps its state in a directory of its own (as in test_vms): a failed run leaves no record here
    # pointing at VMs that are gone.
    ctl = tmp_path_factory.mktemp("controller-state")
    separate_controller(mp, ctl, "tbg")
    timings = REPORT["timings_s"]
    t_all = time.monotonic()
    t = time.monotonic()
    box = vagrantbox.build_box(log=log)
    timings["box"] = round(time.monotonic() - t, 1)
    timings["box_build_when_built"] = box.info.get("build_s")
    dot = tmp_path_factory.mktemp("vagrant-dot")
    shares = vm.testbed_shares()
    env = {"TESTBED_VMS": str(VMS), "TESTBED_VM_CPUS": "1", "TESTBED_VM_MEMORY": str(MEMORY_MB),
           "VAGRANT_DOTFILE_PATH": str(dot), "TESTBED_VM_SHARE": ":".join(shares), "TESTBED_VM_PROVISION": ""}
    REPORT["shares"] = shares
    netns = None
    try:
        with vagrantbox.libvirt_netns(accel=vagrantbox.box_accel(box, log=log), log=log) as lv:
            netns = lv.netns
            REPORT["accel"] = lv.accel
            before = set(os.listdir(vagrantbox.IMAGES_DIR)) if vagrantbox.IMAGES_DIR.is_dir() else set()
            try:
                vagrantbox.add_box(box, env={"VAGRANT_HOME": str(lv.home)}, log=log)
                t = time.monotonic()
                r = lv.vagrant(["up", "--provider", "libvirt"], env=env, cwd=str(ROOT), timeout=1800)
                timings["vagrant_up_with_provisioning"] = round(time.monotonic() - t, 1)
                REPORT["vagrant_up_tail"] = r.stdout[-3000:]
                assert "using testbed/bookworm-local" in r.stderr, r.stderr
                machines_ssh = tmp_path_factory.mktemp("inventory") / "machines.ssh"
                machines_ssh.write_text(lv.ssh_config(str(ROOT), env=env))
                inv = machines_ssh.with_name("machines.yaml")
                conv = tb_cli("machines", "from-ssh-config", str(machines_ssh), "--user", "root",
                              "--underlay-iface", "eth1", "--testbed", testbed_cmd)
                assert conv.returncode == 0, conv.stderr
                inv.write_text(conv.stdout)
                yield lv, env, inv
            finally:
                lv.vagrant(["destroy", "-f"], env=env, cwd=str(ROOT), check=False, timeout=600)
                lv.vagrant(["box", "remove", "--force", vagrantbox.BOX_NAME], env=env, check=False)
    finally:
        mp.undo()
        timings["total"] = round(time.monotonic() - t_all, 1)
        log(f"timings (s): {json.dumps(timings)}")
        write_report()
    assert netns is not None and not (vm.NETNS_DIR / netns).exists()
    after = set(os.listdir(vagrantbox.IMAGES_DIR)) if vagrantbox.IMAGES_DIR.is_dir() else set()
    assert after <= before, after - before
    assert subprocess.run(["pgrep", "-x", "libvirtd"], capture_output=True).returncode != 0
    assert os.listdir(ctl) == [], os.listdir(ctl)


def test_provisioning_installs_nothing_and_loads_netem(up):
    """Shared provisioning: sch_netem and vxlan loaded (and at every boot), the host's directories mounted
    read-only at their own paths, /usr/local/bin/testbed or the inventory's command runs the host's testbed,
    nothing synced to /testbed, no route out of the VMs' networks."""
    lv, env, inv = up
    for name in [f"m{i}" for i in range(1, VMS + 1)]:
        out = lv.vagrant(["ssh", name, "-c", "lsmod | awk '{print $1}' | grep -x -e sch_netem -e vxlan | sort; "
                          "cat /etc/modules-load.d/testbed.conf; ip -o -4 addr show eth1; "
                          "test -e /testbed && echo HAS-TESTBED; findmnt -rn -t 9p -o TARGET,OPTIONS"],
                         env=env, cwd=str(ROOT)).stdout
        lines = out.split()
        assert lines[:2] == ["sch_netem", "vxlan"], out
        assert f"inet 192.168.56.{10 + int(name[1:])}/24" in out, out
        assert "HAS-TESTBED" not in out, out
        mounts = dict(line.split() for line in out.splitlines() if line.startswith("/") and " " in line)
        for d in REPORT["shares"]:
            assert d in mounts and "ro" in mounts[d].split(","), (d, out)
    machines = parse_inventory(inv.read_text())
    with Remote.connect(machines["m1"], timeout=60) as r:
        assert r.run(["id", "-u"]).stdout.strip() == "0"
        v = r.testbed(["--version"], timeout=600)
        assert v.returncode == 0 and v.stdout.strip() == tb_cli("--version").stdout.strip(), v


def test_the_vagrant_inventory_connects_without_prompts(up):
    """`vagrant ssh-config` (StrictHostKeyChecking no, UserKnownHostsFile /dev/null) through
    `testbed machines from-ssh-config --user root`: host keys not checked, nothing written, no prompt."""
    lv, env, inv = up
    for m in parse_inventory(inv.read_text()):
        assert (m.host_key_check, m.known_hosts, m.user, m.underlay_iface) == (False, "/dev/null", "root", "eth1")
        with Remote.connect(m, timeout=60) as r:
            assert r.run(["id", "-un"]).stdout.strip() == "root"


def rtts(name: str, src: str, dst: str, count: int) -> tuple[list[float], int, str]:
    """ping from host src to dst's data address: (the RTTs in ms, packets lost, the output)."""
    from testbed.state import State
    from testbed.topology.topo import Topology

    addr = str(Topology.from_dict(State.load(name).data["topology"]).plan.data_address(dst))
    res = cluster.exec_in(name, src, ["ping", "-c", str(count), "-i", "0.05", "-W", "2", addr], timeout=300)
    times = [float(x) for x in re.findall(r"time=([\d.]+) ms", res.stdout)]
    sent = re.search(r"(\d+) packets transmitted, (\d+) received", res.stdout)
    assert sent, res.stdout + res.stderr
    return times, int(sent.group(1)) - int(sent.group(2)), res.stdout


def test_netem_delay_jitter_loss_and_ber_across_the_vms(up, tmp_path):
    """h1 on m1; h2, h3 and h4 on m2, every link a tunnel between the VMs. h1-h2: delay 1 ms and BER 1e-6; h1-h3:
    delay 1 ms, jitter 0.5 ms, loss 5 % and BER 1e-6; h1-h4: nothing (the RTT the VMs themselves add). The
    netem qdiscs are in the VMs' kernels; pings to h2 and h4 at the same time show the delay (RTT p50 against
    2 ms, and above the plain link's); pings to h3 are lost as 5 % each way predicts."""
    lv, env, inv = up
    name = unique_name("vgnetem")
    doc = {"name": name, "topology": {
        "nodes": {"h1": {"kind": "host", "machine": "m1"}, "h2": {"kind": "host", "machine": "m2"},
                  "h3": {"kind": "host", "machine": "m2"}, "h4": {"kind": "host", "machine": "m2"}},
        "links": [{"endpoints": ["h1:eth1", "h2:eth1"], "delay": f"{DELAY_MS:g}ms", "ber": 1e-6},
                  {"endpoints": ["h1:eth2", "h3:eth1"], "delay": "1ms", "jitter": "0.5ms", "loss": "5%",
                   "ber": 1e-6},
                  {"endpoints": ["h1:eth3", "h4:eth1"]}]}}
    topo = tmp_path / "netem.yaml"
    topo.write_text(yaml.safe_dump(doc))
    timings = REPORT["timings_s"]
    t = time.monotonic()
    r = tb_cli("up", str(topo), "--name", name, "--machines", str(inv), timeout=1200)
    timings["netem_topology_up"] = round(time.monotonic() - t, 1)
    assert r.returncode == 0, r.stderr + r.stdout
    try:
        s = json.loads(tb_cli("status", "--topo", name, "--json", timeout=600).stdout)[0]
        assert s["healthy"], s["problems"]
        qdiscs = ""
        for m in parse_inventory(inv.read_text()):
            with Remote.connect(m, timeout=60) as rr:
                qdiscs += rr.run("for ns in $(ip netns list | cut -d' ' -f1); do echo \"== $ns\"; "
                                 "ip netns exec $ns tc qdisc show; done", timeout=120).stdout
        REPORT["qdiscs"] = [q for q in qdiscs.splitlines() if "netem" in q]
        with Remote.connect(parse_inventory(inv.read_text())["m1"], timeout=60) as rr:
            # what netem's timers run on in the guest (its delay is only as fine as its hrtimers)
            REPORT["guest_timers"] = rr.run(
                "cat /sys/devices/system/clocksource/clocksource0/current_clocksource; "
                "grep -m1 -o 'hres_active *: *[0-9]' /proc/timer_list; grep -m1 'Clock Event Device' -A1 "
                "/proc/timer_list | tail -1; grep '^CONFIG_HZ=' /boot/config-$(uname -r); "
                "grep -o -w -e avx2 -e avx512f -e fma -m1 /proc/cpuinfo | sort -u | tr '\\n' ' '",
                timeout=120, check=False).stdout.split("\n")
        log(f"guest timers: {REPORT['guest_timers']}")
        assert re.search(r"netem .*delay 1ms\s*$", qdiscs, re.MULTILINE), qdiscs
        assert re.search(r"netem .*delay 1ms\s+(499|500)us\s+loss 5%", qdiscs), qdiscs
        t = time.monotonic()
        got = {}
        pingers = [threading.Thread(target=lambda d=d: got.__setitem__(d, rtts(name, "h1", d, 100)))
                   for d in ("h2", "h4")]
        for p in pingers:
            p.start()
        for p in pingers:
            p.join()
        (times, lost, out), (plain, lost4, out4) = got["h2"], got["h4"]
        summary = {k: {"p50_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "replies": len(v)}
                   for k, v in (("delay_1ms", times), ("plain", plain))}
        REPORT["rtt"] = summary
        log(f"RTT (100 pings each, at the same time) over the link with delay 1ms: p50 {summary['delay_1ms']['p50_ms']:.2f}"
            f" ms, min {min(times):.2f} ms, against 2 ms; over the plain link: p50 {summary['plain']['p50_ms']:.2f}"
            f" ms, min {min(plain):.2f} ms")
        assert lost == lost4 == 0, out + out4
        assert min(times) >= 2 * DELAY_MS and statistics.median(times) >= 2 * DELAY_MS, out
        # the fastest replies show the delay above what the VMs add (the medians are reported: under TCG on a
        # loaded host they spread by several ms)
        assert min(times) - min(plain) >= DELAY_MS, (out, out4)
        times3, lost3, out3 = rtts(name, "h1", "h3", 200)
        REPORT["rtt_jitter_loss"] = {"p50_ms": statistics.median(times3), "min_ms": min(times3),
                                     "max_ms": max(times3), "stdev_ms": round(statistics.pstdev(times3), 2),
                                     "stdev_ms_delay_only": round(statistics.pstdev(times), 2),
                                     "lost": lost3, "sent": 200}
        log(f"h1-h3 (delay 1ms, jitter 0.5ms, loss 5%): {REPORT['rtt_jitter_loss']}")
        timings["netem_pings"] = round(time.monotonic() - t, 1)
        # 5 % each way: a ping is lost with p = 1 - 0.95^2 = 0.0975; of 200, P(lost < 5) < 1e-4 and P(lost > 40) < 1e-6
        assert 5 <= lost3 <= 40, out3
    finally:
        d = tb_cli("down", name, timeout=900)
        assert d.returncode == 0, d.stderr


EXPERIMENT = {
    "model": "tiny", "steps": 4,
    "grid": {"mode": ["ddp"], "ber": [0, 1e-5], "scope": ["tensor"], "checksum": ["fix"], "seed": [3]},
    # sanitize: the updates happen despite corrupted values, so the parameters depend on where the flips land
    "train": {"seq_len": 32, "eval_every": 4, "eval_batches": 2, "guard": "sanitize", "timeout": 300,
              "stall_timeout": 900},
}


CAPABILITY = ("import torch; print(torch.backends.cpu.get_cpu_capability(), "
              "torch.backends.mkldnn.is_available(), torch.backends.mkl.is_available())")
# torch's own kernels, MKL's and oneDNN's, each held to AVX2 (what TCG's `-cpu max` offers)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def experiment_file(tmp_path: Path, stem: str, delay: str | None) -> Path:
    """The experiment (named vgexp wherever it runs: the same point ids) on pair.yaml, with `delay` on its link."""
    doc = yaml.safe_load((TOPOLOGIES / "pair.yaml").read_text())
    if delay:
        doc["topology"]["links"][0]["delay"] = delay
    (tmp_path / f"{stem}-topo.yaml").write_text(yaml.safe_dump(doc))
    path = tmp_path / f"{stem}.yaml"
    path.write_text(yaml.safe_dump({"name": "vgexp", **EXPERIMENT, "topologies": {"ddp": f"{stem}-topo.yaml"}}))
    return path


def points(out: Path) -> dict:
    """point id -> what is compared: status, flips, final eval loss, every rank's final param_sha256."""
    got = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        shas = {}
        for f in sorted((out / row["run_dir"]).glob("metrics-rank*.jsonl")):
            last = [json.loads(x) for x in f.read_text().splitlines() if x.strip()][-1]
            shas[f.stem.removeprefix("metrics-")] = last.get("param_sha256")
        got[row["point"]] = {"ber": row["ber"], "status": row["status"], "reason": row.get("reason"),
                              "bits_flipped": row.get("bits_flipped"), "final_eval_loss": row.get("final_eval_loss"),
                              "param_sha256": shas, "placement": row.get("placement")}
    return got


def seed_training_data(inv: Path) -> list[str]:
    """The VMs have no way out, and `python -m testbed.train.data` fetches its corpus once with pip: prepare it
    here, then copy what it made (the corpus, the tokenizers, the tokens) into each VM's cache, where it finds
    them as on any machine that prepared them before."""
    from testbed.train.data import cache_dir

    r = subprocess.run([sys.executable, "-m", "testbed.train.data", "--model", EXPERIMENT["model"]],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    src = cache_dir()
    files = [p for d in ("downloads", "corpus", "tokenizers", "tokens") for p in sorted((src / d).glob("*"))
             if p.is_file()]
    for m in parse_inventory(inv.read_text()):
        with Remote.connect(m, timeout=60) as rr:
            dest = rr.run("echo ${TESTBED_CACHE:-$HOME/.cache/testbed}").stdout.strip()
            for p in files:
                rr.makedirs(f"{dest}/{p.parent.name}")
                rr.put(p, f"{dest}/{p.parent.name}/{p.name}")
    return [f"{p.parent.name}/{p.name}" for p in files]


def test_an_experiment_in_the_vms_matches_the_host(up, tmp_path):
    """The same experiment with its hosts in the two VMs (link delay 1 ms: timing only) and on this host (netns,
    no delay: this kernel has no netem): the same points, all ok, the same flips; eval losses and parameter
    fingerprints compared and reported."""
    lv, env, inv = up
    timings = REPORT["timings_s"]
    vm_exp = experiment_file(tmp_path, "vms", f"{DELAY_MS:g}ms")
    host_exp = experiment_file(tmp_path, "host", None)
    t = time.monotonic()
    REPORT["training_data_copied"] = seed_training_data(inv)
    timings["training_data_copy"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    r = tb_cli("run", str(vm_exp), "--out", str(tmp_path / "vms"), "--machines", str(inv), timeout=3000)
    timings["experiment_in_vms"] = round(time.monotonic() - t, 1)
    REPORT["vm_run_tail"] = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, r.stdout + r.stderr
    t = time.monotonic()
    r = tb_cli("run", str(host_exp), "--out", str(tmp_path / "host"), timeout=1200)
    timings["experiment_on_host"] = round(time.monotonic() - t, 1)
    assert r.returncode == 0, r.stdout + r.stderr
    # The CPU kernels each side's torch picks (TCG's `-cpu max` has AVX2, not AVX-512), and the host's run again
    # with its torch, MKL and oneDNN held to AVX2: where the fingerprints differ, this says whether the kernels
    # are why.
    caps = {}
    probe = [str(Path(sys.prefix) / "bin" / "python"), "-c", CAPABILITY]
    caps["host"] = subprocess.run(probe, capture_output=True, text=True, timeout=300).stdout.strip()
    with Remote.connect(parse_inventory(inv.read_text())["m1"], timeout=60) as rr:
        caps["vm m1"] = rr.run(probe, timeout=600, check=False).stdout.strip()
    caps["host held to AVX2"] = subprocess.run(probe, capture_output=True, text=True, timeout=300,
                                               env={**os.environ, **AVX2_ENV}).stdout.strip()
    REPORT["cpu_capability"] = caps
    t = time.monotonic()
    r = tb_cli("run", str(host_exp), "--out", str(tmp_path / "host-avx2"), timeout=1200, env={**os.environ, **AVX2_ENV})
    timings["experiment_on_host_avx2"] = round(time.monotonic() - t, 1)
    assert r.returncode == 0, r.stdout + r.stderr
    vms, host, host2 = points(tmp_path / "vms"), points(tmp_path / "host"), points(tmp_path / "host-avx2")
    table = []
    for pid in sorted(host):
        a, b, c = host[pid], vms.get(pid, {}), host2.get(pid, {})
        table.append({"point": pid, "status host/vms": f"{a['status']}/{b.get('status')}",
                      "flips host/vms": f"{a['bits_flipped']}/{b.get('bits_flipped')}",
                      "final eval loss host/vms": f"{a['final_eval_loss']}/{b.get('final_eval_loss')}",
                      "param_sha256 host=vms": a["param_sha256"] == b.get("param_sha256"),
                      "param_sha256 host-avx2=vms": c.get("param_sha256") == b.get("param_sha256"),
                      "flips host-avx2": c.get("bits_flipped"), "final eval loss host-avx2": c.get("final_eval_loss"),
                      "sha host": {k: (v or "")[:12] for k, v in a["param_sha256"].items()},
                      "sha vms": {k: (v or "")[:12] for k, v in (b.get("param_sha256") or {}).items()},
                      "sha host-avx2": {k: (v or "")[:12] for k, v in (c.get("param_sha256") or {}).items()},
                      "placement (vms)": b.get("placement")})
    REPORT["comparison"] = table
    write_report()
    log(f"torch CPU capability: {caps}")
    log("host against VMs, per point:\n" + "\n".join(json.dumps(row) for row in table))
    assert sorted(vms) == sorted(host)
    for pid in host:
        assert host[pid]["status"] == vms[pid]["status"] == "ok", (pid, host[pid], vms[pid])
        assert sorted(set((vms[pid]["placement"] or {}).values())) == ["m1", "m2"], vms[pid]
        assert host[pid]["bits_flipped"] == vms[pid]["bits_flipped"], (pid, host[pid], vms[pid])
    assert any(p["bits_flipped"] for p in host.values())
