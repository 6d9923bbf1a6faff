"""Warm points (testbed/experiments/warm.py, testbed/train/serve.py): a point run warm, on a topology and worker
services that earlier points used, gives what it gives cold (fresh topology, fresh workers): the same per-step
parameter hashes and the same flips. A worker killed in the middle of a warm sweep fails its point only."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, TESTBED
from test_experiments import leftovers_named
from testbed.experiments.runner import run_experiment
from testbed.experiments.spec import Experiment
from testbed.fileio import read_jsonl

pytestmark = pytest.mark.privileged


def experiment(tmp_path: Path, name: str, grid: str, steps: int = 3, extra: str = "") -> Experiment:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"""name: {name}
model: tiny
steps: {steps}
topologies: {{ddp: {ROOT}/topologies/pair.yaml, pp: {ROOT}/topologies/pair.yaml}}
recipes: {{process: {{train: {{injector: process}}}}}}
grid: {{{grid}, scope: [tensor], checksum: [fix]}}
train: {{batch_size: 4, seq_len: 32, eval_every: 2, timeout: 15}}
{extra}""")
    return Experiment.load(f)


def services(out: Path) -> list[int]:
    """Worker services of the sweep into `out` still running (their inbox is under it)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if "testbed.train.serve" in cmd and str(out) in cmd:
            found.append(int(p.name))
    return found


def outcome(out: Path) -> dict:
    """Per point: status, flips and bits seen, and every rank's per-step parameter hashes."""
    got = {}
    for row in read_jsonl(out / "results.jsonl"):
        run = out / row["run_dir"]
        hashes = {m.name: [(r["step"], r["param_sha256"]) for r in read_jsonl(m)]
                  for m in sorted(run.glob("metrics-rank*.jsonl"))}
        got[row["point"]] = {"status": row["status"], "flipped": row["bits_flipped"], "seen": row["bits_seen"],
                             "hashes": hashes}
    return got


def cold_and_warm(tmp_path: Path, exp: Experiment) -> tuple[dict, dict]:
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    run_experiment(exp, cold, cold=True, log=lambda m: None)
    run_experiment(exp, warm, log=lambda m: None)
    prefix = f"{exp.spec.name[:8]}{os.getpid() % 10000}-"
    assert not leftovers_named(prefix) and not services(warm)
    a, b = outcome(cold), outcome(warm)
    assert set(a) == set(b) and all(p["status"] == "ok" and p["hashes"] for p in a.values()), a
    # the workers' start (spawn to a point's first line of Python: torch's import) is paid by every cold point
    # and by the first warm point of each group only (phase_times_s: docs/experiments.md)
    started = {k: {r["point"]: r["phase_times_s"]["launch"] + r["phase_times_s"]["import"] for r in read_jsonl(d)}
               for k, d in (("cold", cold / "results.jsonl"), ("warm", warm / "results.jsonl"))}
    groups = {r["mode"] if r["injector"] == "wire" else "process" for r in read_jsonl(warm / "results.jsonl")}
    assert all(s > 0.3 for s in started["cold"].values()), started
    assert sum(s > 0.3 for s in started["warm"].values()) <= len(groups), started
    return a, b


def test_wire_points_at_ber0_are_the_same_cold_and_warm(tmp_path):
    # DDP then PP, two seeds each: every warm point but the first of a mode follows one on the same workers
    cold, warm = cold_and_warm(tmp_path, experiment(tmp_path, "wzero", "mode: [ddp, pp], ber: [0], seed: [1, 2]"))
    assert cold == warm
    assert all(p["flipped"] == 0 and p["seen"] > 0 for p in warm.values())


def test_process_injector_points_are_the_same_cold_and_warm(tmp_path):
    # the local services carry DDP's points into PP's: one world size, one group
    exp = experiment(tmp_path, "wproc", "recipe: [process], mode: [ddp, pp], ber: [0, 1e-4], seed: [1, 2]", steps=2)
    cold, warm = cold_and_warm(tmp_path, exp)
    assert cold == warm
    assert all(p["flipped"] > 0 for k, p in warm.items() if "ber1e-4" in k)


def test_a_service_keeps_no_threads_of_earlier_points(tmp_path):
    """A point's process groups, with their gloo and store threads, go with it: the DDP reducer's comm hook (a
    bound method of the trainer) made a cycle through C++ that kept them, 7 threads per point and rank, until a
    star8 sweep's services had ~1,000 threads each. The services log their thread count after each point."""
    exp = experiment(tmp_path, "wthr", "recipe: [process], mode: [ddp, pp], ber: [0], seed: [1, 2, 3]", steps=2)
    run_experiment(exp, tmp_path / "out", log=lambda m: None)
    logs = sorted((tmp_path / "out" / "warm").glob("*/*/worker-rank*.log"))
    assert logs
    for log in logs:
        counts = [int(line.rsplit("threads ", 1)[1].rstrip(")")) for line in log.read_text().splitlines()
                  if line.startswith("point ") and "threads " in line]
        assert len(counts) == 6, (log, counts)
        # nothing piles up: a thread kept per point would make the count climb by 5 or more over six points; one
        # thread of a point still going down when counted (seen once in make test, [2, 3, 2, 2, 2, 3]) is not kept
        assert max(counts) - min(counts) <= 1, (log, counts)


def test_wire_points_with_flips_are_the_same_cold_and_warm(tmp_path):
    cold, warm = cold_and_warm(tmp_path, experiment(tmp_path, "wflip", "mode: [ddp], ber: [0, 1e-4], seed: [1]"))
    assert all(p["flipped"] > 0 for k, p in warm.items() if "ber1e-4" in k)
    assert cold == warm


def test_a_worker_killed_mid_sweep_fails_its_point_only(tmp_path):
    exp = experiment(tmp_path, "wkill", "mode: [ddp], ber: [0], seed: [1, 2, 3]", steps=40)
    out = tmp_path / "out"
    run = out / "points" / "ddp-ber0-tensor-fix-s2"
    killed, done = [], threading.Event()

    def kill_when_training():  # rank 1's worker, once it has logged two steps of the second point
        import json

        while not done.is_set() and not killed:
            try:
                if len(read_jsonl(run / "metrics-rank1.jsonl")) >= 2:
                    pid = json.loads((run / "status-rank1.json").read_text())["pid"]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.02)

    t = threading.Thread(target=kill_when_training, daemon=True)
    t.start()
    try:
        rows = {r["point"]: r for r in run_experiment(exp, out, log=lambda m: None)}
    finally:
        done.set()
        t.join()
    assert killed, "the second point never reached step 2"
    assert rows["ddp-ber0-tensor-fix-s1"]["status"] == "ok"
    assert rows["ddp-ber0-tensor-fix-s2"]["status"] in ("crashed", "invalid"), rows["ddp-ber0-tensor-fix-s2"]
    assert "SIGKILL" in rows["ddp-ber0-tensor-fix-s2"]["reason"]
    s3 = rows["ddp-ber0-tensor-fix-s3"]
    assert s3["status"] == "ok" and s3["steps_completed"] == 40, (s3["status"], s3.get("reason"))
    assert not services(out)
    assert not leftovers_named(f"{exp.spec.name[:8]}{os.getpid() % 10000}-")


def test_a_service_on_its_way_out_gets_no_further_point(tmp_path):
    """A service answers a failed point, then exits; one the launcher killed may not have died yet. The pool must
    wait for either to go and start a fresh one: a request written to it is never served, and the next point
    then hangs on its peers' rendezvous (seen in `make test` on a loaded machine: the point after a SIGKILL was
    `hung`). The services here are plain processes that never answer: the test writes their answers."""
    import sys

    from testbed.experiments.warm import WorkerPool
    from testbed.fileio import write_json_atomic
    from testbed.train.launch import WORKER_MODULE

    started = []

    def start(rank, argv, env):
        started.append(subprocess.Popen(["sleep", "60"]))
        return started[-1]

    pool = WorkerPool(start, tmp_path / "inbox")
    argv = [sys.executable, "-m", WORKER_MODULE, "--out", str(tmp_path / "p")]
    try:
        first = pool.spawn(0, argv, {})
        write_json_atomic(first.answer, {"code": 6, "exits": True})  # crashed: it goes once it has answered
        assert first.poll() == 6
        threading.Timer(0.5, started[0].terminate).start()  # ... a moment later
        second = pool.spawn(0, argv, {})
        assert len(started) == 2 and started[0].poll() is not None, "a request went to a service on its way out"
        second.kill()  # the launcher kills a hung point's service: no answer, and SIGKILL takes a moment
        pool.spawn(0, argv, {})
        assert len(started) == 3 and started[1].poll() is not None
        write_json_atomic(answer_path_of(pool, 0), {"code": 0, "exits": False})
        pool.spawn(0, argv, {})
        assert len(started) == 3, "a service that stays takes the next point"
    finally:
        pool.close(wait_s=1)
    assert all(p.poll() is not None for p in started)


def answer_path_of(pool, rank):
    """The answer file of the last request the pool wrote to rank's service."""
    from testbed.train.common import answer_path

    _, sid, k = pool.services[rank]
    return answer_path(pool.inbox, sid, k - 1)


def test_a_terminated_or_killed_sweep_resumes_with_every_point_trained(tmp_path):
    """SIGTERM unwinds a sweep as Ctrl-C does (services stopped, inboxes removed). SIGKILL leaves a run's inboxes
    with its services' answers: the run resumed in the same --out must not take them for its own points' (the first
    run of thresholds.yaml, resumed after a kill: 14 points "ended" at once with 0/300 steps, and their workers
    trained them afterwards)."""
    exp = experiment(tmp_path, "wres", "recipe: [process], mode: [ddp], ber: [0], seed: [1, 2, 3, 4, 5, 6]", steps=2)
    out = tmp_path / "out"

    def run_until(rows: int, sig: int) -> subprocess.Popen:
        p = subprocess.Popen([*TESTBED, "run", str(tmp_path / "wres.yaml"), "--out", str(out)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while p.poll() is None and time.monotonic() < deadline:
            if (out / "results.jsonl").exists() and len(read_jsonl(out / "results.jsonl")) >= rows:
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1][-2000:]
        p.send_signal(sig)
        p.communicate(timeout=60)
        return p

    p = run_until(1, signal.SIGTERM)
    assert p.returncode == 130
    assert not services(out)
    assert not list((out / "warm").glob("**/inbox"))  # the services were stopped, not orphaned
    run_until(3, signal.SIGKILL)
    deadline = time.monotonic() + 30  # orphaned services see their parent gone and exit
    while services(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not services(out)
    assert list((out / "warm").glob("**/inbox/*.done"))  # the case this test is about: answers left behind
    rows = run_experiment(exp, out, log=lambda m: None)
    assert len(rows) == 6 and all(r["status"] == "ok" and r["steps_completed"] == 2 for r in rows), \
        [(r["point"], r["status"], r.get("reason")) for r in rows]
    assert not services(out)
