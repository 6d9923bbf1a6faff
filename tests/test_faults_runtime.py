"""The fault campaign, runtime half (issue 36; docs/faults.md has the table): faults injected for real under a
running testbed, and what must hold after each. Engines killed mid-point (the NFQUEUE process with SIGKILL, the
bpf program's filter deleted: it has no process), a host's namespace deleted under a topology that is up, the
Docker daemon stopped under a docker-runtime topology, an SSH machine that stops answering in the middle of `up`,
and a Slurm node's slurmd killed during a job. Every test removes what it made, even when it fails, and checks
that nothing is left (namespaces, engines, iptables rules, state, containers, processes, jobs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, TOPOLOGIES, leftovers, tb_cli, unique_name
from test_experiments import leftovers_named
from test_warm import services
from testbed.experiments.runner import run_experiment
from testbed.experiments.spec import Experiment
from testbed.fileio import read_jsonl

pytestmark = pytest.mark.privileged


def say(row: str) -> None:
    """A fault-table number, printed where `pytest -s` (and the -rA summary) shows it."""
    print(f"\nFAULT {row}", flush=True)


def experiment(tmp_path: Path, name: str, topology: Path, grid: str, steps: int, extra: str = "") -> Experiment:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"""name: {name}
model: tiny
steps: {steps}
topologies: {{ddp: {topology}}}
grid: {{{grid}}}
train: {{batch_size: 4, seq_len: 32, eval_every: 0, timeout: 15}}
point_timeout: 300
{extra}""")
    return Experiment.load(f)


def engine_processes(prefix: str) -> list[int]:
    """NFQUEUE engine processes serving topologies whose name starts with `prefix`."""
    from testbed.state import state_dir

    root = str(state_dir(prefix))
    found = []
    for p in Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        if "testbed.engine" in argv and any(a.startswith(root) for a in argv):
            found.append(int(p.name))
    return found


def sweep_prefix(exp: Experiment) -> str:
    """The name prefix of the topologies a warm sweep of `exp` brings up (runner: name[:8] + pid)."""
    return f"{exp.spec.name[:8]}{os.getpid() % 10000}-"


def the_sweeps_topology(prefix: str) -> str:
    """The one topology up whose name starts with `prefix` (the sweep's, while a point trains)."""
    from testbed.state import running_names

    names = [n for n in running_names() if n.startswith(prefix)]
    assert len(names) == 1, names
    return names[0]


def when_training(run_dir: Path, steps: int, act, done: threading.Event, acted: list, limit_s: float = 120):
    """A thread that calls act() once rank 1 of the point in `run_dir` has logged `steps` steps."""

    def watch():
        deadline = time.monotonic() + limit_s
        while not done.is_set() and time.monotonic() < deadline:
            if len(read_jsonl(run_dir / "metrics-rank1.jsonl")) >= steps:
                acted.append(act())
                return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def sweep_with_a_fault(tmp_path: Path, exp: Experiment, victim: str, act) -> tuple[dict, list]:
    out = tmp_path / "out"
    done, acted = threading.Event(), []
    t = when_training(out / "points" / victim, 3, act, done, acted)
    try:
        rows = {r["point"]: r for r in run_experiment(exp, out, log=lambda m: None)}
    finally:
        done.set()
        t.join()
    assert acted, f"{victim} never reached step 3"
    return rows, acted


# -- engines killed mid-point -----------------------------------------------------------------------------------

def test_an_nfqueue_engine_killed_mid_point_makes_that_point_invalid_and_the_next_ok(tmp_path):
    """SIGKILL of the engine process while a wire point trains: the link fails closed (drops), the point ends
    `invalid` naming the dead engine, and the next point (warm: the sweep brings a fresh topology up) is ok."""
    exp = experiment(tmp_path, "fnfq", TOPOLOGIES / "pair.yaml",
                     "mode: [ddp], ber: [1e-6], seed: [1, 2], scope: [tensor], checksum: [fix]", steps=40)
    prefix = sweep_prefix(exp)
    victim = "ddp-ber1e-6-tensor-fix-s1"

    def kill():
        pids = engine_processes(prefix)
        assert pids, "no engine process found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return time.monotonic(), len(pids)

    rows, acted = sweep_with_a_fault(tmp_path, exp, victim, kill)
    hit, nxt = rows[victim], rows["ddp-ber1e-6-tensor-fix-s2"]
    assert hit["status"] == "invalid", (hit["status"], hit["reason"])
    assert "corruption engine died on h1-h2" in hit["reason"], hit["reason"]
    assert nxt["status"] == "ok" and nxt["steps_completed"] == 40 and nxt["bits_flipped"] > 0, nxt.get("reason")
    assert not leftovers_named(prefix) and not services(tmp_path / "out")
    say(f"nfqueue engine SIGKILL: {acted[0][1]} engine process(es) killed at step 3; killed point "
        f"{hit['status']} after {hit['steps_completed']}/40 steps; next point ok, {nxt['bits_flipped']} flips")


def bpf_pair(tmp_path: Path) -> Path:
    """pair.yaml with the bpf engine on its link (scope payload: the bpf engine has no tensor scope)."""
    f = tmp_path / "pair-bpf.yaml"
    text = (TOPOLOGIES / "pair.yaml").read_text()
    assert "endpoints:" in text
    import yaml

    doc = yaml.safe_load(text)
    for link in doc["topology"]["links"]:
        link["engine"] = "bpf"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_a_bpf_engine_whose_filter_is_deleted_mid_point_makes_that_point_invalid_and_the_next_ok(tmp_path):
    """The bpf engine has no process to kill: its tc filter deleted by hand is how it dies. The link then passes
    clean, so the point cannot claim its BER: `invalid`; the next point gets a fresh topology and is ok."""
    from testbed.state import State

    exp = experiment(tmp_path, "fbpf", bpf_pair(tmp_path),
                     "mode: [ddp], ber: [1e-9], seed: [1, 2], scope: [payload], checksum: [fix]", steps=40)
    prefix = sweep_prefix(exp)
    victim = "ddp-ber1e-9-payload-fix-s1"

    def delete_filters():
        from testbed import nsutil
        from testbed.engine.bpf.engine import PREF

        deleted = 0
        for h in State.load(the_sweeps_topology(prefix)).data["engines"].values():
            att = json.loads(Path(h["handle"]["bpf"]["sidecar"]).read_text())["attach"]  # where it is attached now
            assert att, h
            nsutil.nsexec(att["netns"], ["tc", "filter", "del", "dev", att["iface"], att["hook"], "pref", str(PREF)])
            deleted += 1
        return deleted

    rows, acted = sweep_with_a_fault(tmp_path, exp, victim, delete_filters)
    hit, nxt = rows[victim], rows["ddp-ber1e-9-payload-fix-s2"]
    assert hit["status"] == "invalid", (hit["status"], hit["reason"])
    assert "h1-h2" in hit["reason"], hit["reason"]
    assert nxt["status"] == "ok" and nxt["steps_completed"] == 40, nxt.get("reason")
    assert all(e["alive"] is not False for e in nxt["engines"]) if nxt.get("engines") else True
    assert not leftovers_named(prefix) and not services(tmp_path / "out")
    say(f"bpf filter deleted: {acted[0]} filter(s) at step 3; point {hit['status']} ({hit['reason'][:80]}); "
        f"next point ok")


# -- a host's namespace deleted under a running topology --------------------------------------------------------

def test_a_host_namespace_deleted_under_a_running_topology(tmp_path):
    """`ip netns delete` of a host's namespace while the topology is up, with engines on its links: `status`
    names the missing host (exit 1), `down` removes the rest (exit 0) and nothing is left: no namespace, engine
    process (the one that served the deleted host lives on in it until killed), state or veth."""
    from conftest import root_links

    name = unique_name("fns")
    links_before = root_links()
    r = tb_cli("up", str(TOPOLOGIES / "pair.yaml"), "--name", name)
    try:
        assert r.returncode == 0, r.stderr
        r = tb_cli("link", "set", "h1-h2", "--topo", name, "--ber", "1e-5", "--scope", "payload")
        assert r.returncode == 0, r.stderr
        engines = engine_processes(name)
        assert len(engines) == 2, engines
        subprocess.run(["ip", "netns", "delete", f"tb.{name}.h2"], check=True)
        t = time.monotonic()
        st = tb_cli("status", "--topo", name)
        status_s = time.monotonic() - t
        assert st.returncode == 1, st.stdout + st.stderr
        assert "PROBLEM" in st.stdout and "h2" in st.stdout, st.stdout
    finally:
        t = time.monotonic()
        down = tb_cli("down", name)
        down_s = time.monotonic() - t
    assert down.returncode == 0, down.stderr
    assert not leftovers(name), leftovers(name)
    assert not engine_processes(name)
    assert root_links() == links_before
    problem = [line for line in st.stdout.splitlines() if line.startswith(f"{name}:")]
    say(f"namespace deleted: status exit 1 in {status_s:.1f} s ({problem[0] if problem else st.stdout!r}); "
        f"down exit 0 in {down_s:.1f} s, 0 leftovers, 0 engine processes")


def test_a_host_namespace_deleted_mid_point_fails_no_later_point(tmp_path):
    """The same under a warm sweep: h2's namespace deleted while the first point trains. The processes inside
    keep the namespace itself alive, so that point may finish; whatever its status, the sweep must notice the
    broken topology and give every later point a fresh one: the next point is ok and nothing is left."""
    exp = experiment(tmp_path, "fnsp", TOPOLOGIES / "pair.yaml",
                     "mode: [ddp], ber: [1e-6], seed: [1, 2], scope: [tensor], checksum: [fix]", steps=40)
    prefix = sweep_prefix(exp)
    victim = "ddp-ber1e-6-tensor-fix-s1"

    def delete_h2():
        name = the_sweeps_topology(prefix)
        subprocess.run(["ip", "netns", "delete", f"tb.{name}.h2"], check=True)
        return name

    rows, _ = sweep_with_a_fault(tmp_path, exp, victim, delete_h2)
    hit, nxt = rows[victim], rows["ddp-ber1e-6-tensor-fix-s2"]
    assert nxt["status"] == "ok" and nxt["steps_completed"] == 40, (nxt["status"], nxt.get("reason"))
    assert not leftovers_named(prefix) and not services(tmp_path / "out")
    say(f"namespace deleted mid-point: that point {hit['status']} ({(hit.get('reason') or '')[:100]}); "
        f"next point ok; 0 leftovers")


# -- the Docker daemon stopped under a docker-runtime topology --------------------------------------------------

DOCKER_PIDFILE = Path("/run/testbed-docker/dockerd.pid")


@pytest.mark.docker
def test_the_docker_daemon_stopped_under_a_docker_topology(docker_client, worker_image, tmp_path):
    """dockerd stopped (SIGTERM, as `systemctl stop docker` does: it stops the containers) under a topology of
    containers. `status` says what is wrong (exit 1); `down` removes what it can, says which containers are left
    and why, exits 1 and keeps the record; once the daemon is back, `down` again leaves nothing. The testbed's
    own daemon (containers/ensure-docker.sh) is the one stopped, and it is started again whatever happens."""
    from test_docker_runtime import ENSURE, containers_of, nothing_left

    if not DOCKER_PIDFILE.exists():
        pytest.skip("the Docker engine is not the testbed's own (containers/ensure-docker.sh): not stopped here")
    name = unique_name("fdock")
    r = tb_cli("up", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--runtime", "docker")
    downs = []
    try:
        assert r.returncode == 0, r.stderr
        pid = int(DOCKER_PIDFILE.read_text())
        os.kill(pid, signal.SIGTERM)
        t = time.monotonic()
        while Path(f"/proc/{pid}").exists() and time.monotonic() - t < 60:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "dockerd did not stop"
        stop_s = time.monotonic() - t
        st = tb_cli("status", "--topo", name, timeout=180)
        assert st.returncode == 1, st.stdout + st.stderr
        downs.append(tb_cli("down", name, timeout=180))
    finally:
        up_again = subprocess.run([str(ENSURE)], capture_output=True, text=True, timeout=300)
        assert up_again.returncode == 0, up_again.stderr
        downs.append(tb_cli("down", name, timeout=180))
        for c in containers_of(docker_client, name):
            c.remove(force=True)
    first, second = downs[0], downs[-1]
    assert first.returncode == 1, first.stdout + first.stderr
    assert "docker" in first.stderr.lower() and "testbed down" in first.stderr, first.stderr
    assert second.returncode == 0, second.stderr
    assert not nothing_left(docker_client, name)
    problems = [line for line in st.stdout.splitlines() if line.startswith(f"{name}:")]
    say(f"dockerd stopped ({stop_s:.1f} s): status exit 1 ({problems[:2]}); down without the daemon exit "
        f"{first.returncode} ({first.stderr.strip().splitlines()[-1][:160]}); after a restart down exit 0, "
        f"0 leftovers")


# -- an SSH machine that stops answering in the middle of `up` --------------------------------------------------

def sshd_pids(machine) -> list[int]:
    """The sshd processes (listener and sessions) in the machine's network namespace."""
    ns = os.stat(machine.netns_path).st_ino
    found = []
    for p in Path("/proc").iterdir():
        try:
            if (p / "comm").read_text().strip() == "sshd" and os.stat(p / "ns" / "net").st_ino == ns:
                found.append(int(p.name))
        except (OSError, ValueError):
            continue
    return found


def test_an_ssh_machine_that_stops_answering_mid_up(tmp_path, monkeypatch):
    """Three SSH machines; once `up ring4 --machines` has begun building, every sshd process of m2 is stopped
    (SIGSTOP: the listener and the controller's session; the machine's kernel still acknowledges TCP, so only an
    SSH-level request can tell). `up` must fail in bounded time with a message naming m2 and what happened,
    remove what it built on the machines that answer, keep its record where m2's part could not be removed, and
    after m2 answers again (SIGCONT) `testbed down` leaves nothing on any machine."""
    from conftest import separate_controller
    from sshmachines import inventory_yaml, ssh_machines
    from test_cluster import _testbed, assert_nothing_left, netns_of
    from testbed.machines import cluster

    separate_controller(monkeypatch, tmp_path / "ctl", "tbf")
    (tmp_path / "ctl").mkdir()
    with ssh_machines(3) as ms:
        inv = tmp_path / "machines.yaml"
        inv.write_text(inventory_yaml(ms))
        name = unique_name("fssh")
        victim = ms[1]
        p = subprocess.Popen([*_testbed(), "up", str(TOPOLOGIES / "ring4.yaml"), "--name", name, "--machines",
                              str(inv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        stopped: list[int] = []
        try:
            deadline = time.monotonic() + 120
            while not netns_of(victim):  # m2 has begun building its part
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
                time.sleep(0.02)
            stopped = sshd_pids(victim)
            assert len(stopped) >= 2, stopped  # the listener and the controller's session at least
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            t = time.monotonic()
            out, err = p.communicate(timeout=300)
            fail_s = time.monotonic() - t
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode != 0
        assert f"{victim.name} (" in err and "unanswered" in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        others = [m for m in ms if m is not victim]
        left_on_others = {m.name: netns_of(m) for m in others if netns_of(m)}
        kept_record = cluster.cluster_of(name) is not None
        if kept_record:
            assert f"testbed down {name}" in err, err[-3000:]
        r = tb_cli("down", name, timeout=300) if kept_record else None
        assert r is None or r.returncode == 0, r.stderr
        assert_nothing_left(ms, name)
    msg = [line for line in err.splitlines() if "unanswered" in line]
    say(f"sshd of m2 stopped mid-up: up failed after {fail_s:.0f} s ({msg[0][:200] if msg else err[-200:]}); "
        f"left on the answering machines right after: {left_on_others or 'nothing'}; record kept: {kept_record}; "
        f"after SIGCONT and down: 0 leftovers")


# -- a Slurm node's slurmd killed during a job -------------------------------------------------------------------

@pytest.mark.slow  # ~140 s: a cluster of its own and two 150-step jobs (make test-all)
def test_a_slurm_nodes_slurmd_killed_during_a_job(tmp_path):
    """Two process-injector points as Slurm jobs on the two-node test cluster; once a job trains on tbn1, that
    node's slurmd is SIGKILLed (the job's slurmstepd lives on, as on a real node). Whatever Slurm makes of it,
    every point ends with a row that says what happened (ok, or an error naming the job's state), no row is half
    written, `testbed run` exits 0, no job is left in the queue, and a run with --retry-failed finishes any
    point that did not end ok."""
    from slurmcluster import available, slurm_cluster
    from test_slurm import experiment as slurm_experiment, rows_of, run as slurm_run

    if available() is not None:
        pytest.skip(f"slurm test cluster: {available()}")
    with slurm_cluster() as cluster:
        exp = slurm_experiment(tmp_path, "fslurmd", "process", steps=150, bers="0, 1e-5")
        out = tmp_path / "out"
        from test_slurm import controller

        p = controller(cluster, str(exp), "--out", str(out), "--executor", "slurm")
        killed = None
        try:
            deadline = time.monotonic() + 180
            while killed is None and time.monotonic() < deadline and p.poll() is None:
                running = [line.split() for line in cluster.jobs()]
                on_n1 = [j for j in running if len(j) >= 3 and j[1] == "RUNNING" and j[2] == "tbn1"]
                trained = list((out / "points").glob("*/metrics-rank1.jsonl")) if (out / "points").exists() else []
                if on_n1 and any(len(read_jsonl(m)) >= 2 for m in trained):
                    proc = cluster.daemons["slurmd-tbn1"]
                    # the daemon runs under `sh -c ... exec slurmd`: the Popen is slurmd itself
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = time.monotonic()
                time.sleep(0.2)
            assert killed is not None, f"no job trained on tbn1: {cluster.jobs()}"
            stdout, stderr = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        took = time.monotonic() - killed
        assert p.returncode == 0, stderr[-3000:]
        rows = rows_of(out)
        assert len(rows) == 2 and all(json.dumps(r) for r in rows.values())  # whole rows
        statuses = {pt: (r["status"], (r.get("reason") or "")[:160]) for pt, r in rows.items()}
        assert all(r["status"] == "ok" or "Slurm job" in (r.get("reason") or "") for r in rows.values()), statuses
        assert not cluster.jobs(), cluster.jobs()
        retried = None
        if any(r["status"] != "ok" for r in rows.values()):
            retried = slurm_run(cluster, str(exp), "--out", str(out), "--executor", "slurm", "--retry-failed")
            assert retried.returncode == 0, retried.stderr[-3000:]
            assert all(r["status"] == "ok" for r in rows_of(out).values()), rows_of(out)
        assert not cluster.jobs()
    say(f"slurmd of tbn1 SIGKILLed during a job: the run ended {took:.0f} s later, exit 0; rows: {statuses}; "
        f"retry needed: {retried is not None}; 0 jobs left")
