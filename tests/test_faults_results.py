"""Fault campaign, results (issue 36, item 2): faults injected for real into `testbed run` and its results
directory, each checked for what must hold: no result row lost or half written, the interrupted point run again
on resume (and only it), a clear message, nothing left behind (network namespaces, engines, the iptables rules
and qdiscs inside them, worker processes, Slurm jobs, state under the state directory).

- the controller (`testbed run`, a subprocess) SIGKILLed mid-sweep: sequential warm (twice: in a wire group, then
  in a process-injector group), `-j 2`, `--executor slurm`; the same command then resumes;
- the results directory's file system full (a tmpfs mounted as --out, filled while a point runs);
- results.jsonl damaged: a cut-off last row, a line that is not JSON, JSON lines that are not objects.

Each test prints a `FAULT |` line with its measured numbers (docs/experiments.md, "Faults"). Every test runs its
controller with a state directory and namespace prefix of its own (conftest.separate_controller) and cleans up
even when it fails: processes it started are killed by pid, `testbed down --all` sweeps its prefix only, mounts
are unmounted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TESTBED, separate_controller
from testbed import procs
from testbed.fileio import read_jsonl_objects

pytestmark = pytest.mark.privileged
PAIR = ROOT / "topologies" / "pair.yaml"


# -- helpers ---------------------------------------------------------------------------------------------------


def experiment(d: Path, name: str, grid: str, recipes: str, steps: int = 8, extra: str = "", seeds: str = "1") -> Path:
    f = d / f"{name}.yaml"
    f.write_text(f"""name: {name}
model: tiny
steps: {steps}
topologies: {{ddp: {PAIR}}}
recipes: {{{recipes}}}
grid: {{{grid}, mode: [ddp], scope: [tensor], checksum: [fix], seed: [{seeds}]}}
train: {{batch_size: 4, seq_len: 32, eval_every: 4, timeout: 20}}
point_timeout: 120
{extra}""")
    os.chmod(f, 0o644)
    return f


def rows_of(out: Path) -> dict[str, dict]:
    rows, bad = read_jsonl_objects(out / "results.jsonl")
    assert not bad, f"results.jsonl has lines that are no rows: {bad}"
    return {r["point"]: r for r in rows}


def referencing(path: Path) -> list[int]:
    """Processes (but this one) with an argument under `path`: a run's controller, jobs, services, workers."""
    return procs.pids_with_cmdline(lambda args: any(a == str(path) or a.startswith(f"{path}/") for a in args))


def left_behind(out: Path, state: Path, prefix: str) -> dict:
    """What a run into `out` with state under `state` and namespaces named `prefix`... left on this machine."""
    found = {
        "netns": sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix)) if os.path.isdir("/run/netns")
        else [],
        "state": sorted(p.name for p in state.iterdir()) if state.exists() else [],
        "engines": procs.pids_with_cmdline(lambda a: "testbed.engine" in a and any(x.startswith(f"{state}/")
                                                                                for x in a)),
        "processes": [p for p in referencing(out) if procs.alive(p)],
    }
    # the iptables rules and qdiscs of a topology live in its namespaces (gone with them); the host's own
    # namespace never gets one: no NFQUEUE rule there
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    found["host_nfqueue_rules"] = [r for r in rules.splitlines() if "NFQUEUE" in r and prefix in r]
    return {k: v for k, v in found.items() if v}


def count(left: dict) -> int:
    return sum(len(v) for v in left.values())


class Controller:
    """`testbed run ARGS` as a subprocess (the controller itself, no shell between: its pid is the one to kill),
    its output in files (a pipe nobody reads would stall it)."""

    n = 0

    def __init__(self, tmp: Path, *args: str, env: dict | None = None, login=None):
        Controller.n += 1
        self.err_path = tmp / f"controller{Controller.n}.err"
        self.out_path = tmp / f"controller{Controller.n}.out"
        argv = [sys.executable, "-m", "testbed", "run", *args]
        self.started = time.monotonic()
        with open(self.err_path, "w") as err, open(self.out_path, "w") as out:
            self.p = subprocess.Popen(login(argv) if login else argv, cwd=ROOT, stdout=out, stderr=err,
                                      stdin=subprocess.DEVNULL, env=env)
        self.pid = self.p.pid

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_until(self, cond, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            rc = self.p.poll()
            if rc is not None:
                pytest.fail(f"the controller ended (exit {rc}) before {what}:\n{self.err[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout:.0f} s:\n{self.err[-3000:]}")
            time.sleep(0.02)

    def sigkill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)  # what a crash, the OOM killer or `kill -9` does
        self.p.wait(timeout=30)
        assert self.p.returncode == -signal.SIGKILL

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the controller did not end within {timeout:.0f} s:\n{self.err[-3000:]}")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def n_rows(out: Path) -> int:
    try:
        return sum(1 for line in (out / "results.jsonl").read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def metrics_started(out: Path, point: str) -> bool:
    m = out / "points" / point / "metrics-rank0.jsonl"
    return m.exists() and m.stat().st_size > 0


def wrote_steps(out: Path, point: str) -> list[int]:
    """The steps rank 0 of a point wrote, in order (a re-run sharing the directory with an orphan would repeat
    steps)."""
    rows, bad = read_jsonl_objects(out / "points" / point / "metrics-rank0.jsonl")
    assert not bad
    return [r["step"] for r in rows]


def fault_line(fault: str, **numbers) -> None:
    print(f"FAULT | {fault} | " + ", ".join(f"{k} = {v}" for k, v in numbers.items()))


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A state directory and namespace prefix of the test's own (exported, so the controllers it starts get them);
    at the end, even on failure: every process it started (they reference tmp_path) SIGKILLed, stopped ones too,
    and `testbed down --all`, which sweeps this prefix only."""
    state = tmp_path / "state"
    prefix = separate_controller(monkeypatch, state, "tf")
    yield state, prefix
    for pid in referencing(tmp_path):
        procs.kill(pid, signal.SIGKILL)
    subprocess.run([*TESTBED, "down", "--all"], cwd=ROOT, capture_output=True, text=True, timeout=120)


# -- 1. the controller SIGKILLed mid-sweep ----------------------------------------------------------------------


def test_sequential_controller_killed_in_a_wire_group_resumes_and_takes_its_topology_down(tmp_path, isolated):
    """The sequential warm run (`testbed run`, no -j) SIGKILLed while its second wire point trains: its topology
    stays up (namespaces with their veths, iptables rules and qdiscs, engines, state; the services inside finish
    the point and exit). The same command takes that topology down before it starts (its `up` process, the
    killed controller, is gone), keeps the row that was written (byte for byte: finished_at too) and runs the
    interrupted point again, alone; nothing is left behind."""
    state, prefix = isolated
    exp = experiment(tmp_path, "kseq", "recipe: [wire], ber: [0, 1e-4]", "wire: {train: {injector: wire}}", steps=6)
    out = tmp_path / "out"
    W0, W4 = "ddp-ber0-tensor-fix-wire-s1", "ddp-ber1e-4-tensor-fix-wire-s1"
    c1 = Controller(tmp_path, str(exp), "--out", str(out))
    c1.wait_until(lambda: n_rows(out) >= 1 and metrics_started(out, W4), "the second point training")
    c1.sigkill()
    kept = rows_of(out)
    assert list(kept) == [W0], kept.keys()
    left1 = left_behind(out, state, prefix)
    assert left1.get("netns") and left1.get("state") and left1.get("engines"), \
        f"the killed run left no topology to sweep: {left1}"

    t = time.monotonic()
    c2 = Controller(tmp_path, str(exp), "--out", str(out))
    assert c2.wait() == 0, c2.err[-3000:]
    took = time.monotonic() - t
    assert f"was killed outright; taken down what it left: topology kseq{c1.pid % 10000}-0 (its `up` pid " \
           f"{c1.pid} is gone)" in c2.err, c2.err[-3000:]
    assert "1 of 2 points already in" in c2.err
    final = rows_of(out)
    assert set(final) == {W0, W4} and all(r["status"] == "ok" and r["steps_completed"] == 6 for r in final.values()), \
        {p: (r["status"], r["reason"]) for p, r in final.items()}
    assert final[W0] == kept[W0], "the row that was written changed (run again?)"
    assert final[W4]["finished_at"] > kept[W0]["finished_at"]
    assert wrote_steps(out, W4) == list(range(6))
    left = left_behind(out, state, prefix)
    assert not left, left
    fault_line("controller SIGKILLed, sequential warm, wire group",
               rows_lost=sum(final.get(p) != r for p, r in kept.items()), rows_kept_unchanged=len(kept),
               points_rerun=1,
               left_after_kill=f"{count(left1)} ({', '.join(f'{len(v)} {k}' for k, v in left1.items())})",
               left_after_resume=count(left), resume_s=round(took, 1))


def test_sequential_controller_killed_in_a_process_group_resumes_and_stops_its_services(tmp_path, isolated):
    """The sequential warm run SIGKILLed while its second process-injector point trains on two local worker
    services, held stopped until the resume (a long point's services would still be training then, writing into
    the run directory the resume gives the point afresh). The same command kills them (their parent is gone)
    before it starts, keeps the row written and runs the interrupted point again: its run directory holds the
    re-run's steps alone; nothing is left behind."""
    state, prefix = isolated
    exp = experiment(tmp_path, "kproc", "recipe: [process], ber: [0, 1e-4]", "process: {train: {injector: process}}",
                     steps=6)
    out = tmp_path / "out"
    P0, P4 = "ddp-ber0-tensor-fix-process-s1", "ddp-ber1e-4-tensor-fix-process-s1"
    c1 = Controller(tmp_path, str(exp), "--out", str(out))
    c1.wait_until(lambda: n_rows(out) >= 1 and metrics_started(out, P4), "the second point training")
    services = [p for p in referencing(out / "warm") if "testbed.train.serve" in (procs.cmdline(p) or [])]
    assert len(services) == 2, services
    for pid in services:
        os.kill(pid, signal.SIGSTOP)  # held mid-point, whatever the machine's speed, until the resume
    c1.sigkill()
    kept = rows_of(out)
    assert list(kept) == [P0], kept.keys()
    left1 = left_behind(out, state, prefix)
    assert sorted(left1.get("processes", [])) == sorted(services), left1

    t = time.monotonic()
    c2 = Controller(tmp_path, str(exp), "--out", str(out))
    assert c2.wait() == 0, c2.err[-3000:]
    took = time.monotonic() - t
    assert all(f"worker pid {p}" in c2.err for p in services), c2.err[-3000:]
    final = rows_of(out)
    assert set(final) == {P0, P4} and all(r["status"] == "ok" and r["steps_completed"] == 6 for r in final.values()), \
        {p: (r["status"], r["reason"]) for p, r in final.items()}
    assert final[P0] == kept[P0]
    assert wrote_steps(out, P4) == list(range(6))  # the re-run alone wrote its run directory
    left = left_behind(out, state, prefix)
    assert not left, left
    fault_line("controller SIGKILLed, sequential warm, process-injector group",
               rows_lost=sum(final.get(p) != r for p, r in kept.items()), rows_kept_unchanged=len(kept),
               points_rerun=1, left_after_kill=f"{count(left1)} (worker services)", left_after_resume=count(left),
               resume_s=round(took, 1))


def job_of(out: Path, point: str) -> int | None:
    """The pid of the `-j` job (python -m testbed.experiments.jobs OUT POINT) that runs `point`."""
    found = procs.pids_with_cmdline(lambda a: "testbed.experiments.jobs" in a and str(out) in a and point in a)
    return found[0] if found else None


@pytest.mark.slow  # ~50-60 s on 2 shared cores: make test-all
def test_parallel_controller_killed_resumes_merges_and_sweeps(tmp_path, isolated):
    """`-j 2` (a job process per point, in a session of its own, each with its own topology) with its controller
    SIGKILLed while: one row is in results.jsonl, one job has written its row file that the controller had not
    merged yet (the controller was stopped first, so it could not), and one job is mid-point, its topology up
    (held stopped until the resume, so it is still running then whatever the machine's speed). The resume stops
    that orphaned job (SIGTERM and SIGCONT: it takes its topology down), merges the row file (not run again) and
    runs the interrupted point again; nothing is left behind."""
    state, prefix = isolated
    # quick's clean point ends first (10 steps), then its BER point starts beside long's clean point (200 steps)
    exp = experiment(tmp_path, "kpar", "recipe: [quick, long], ber: [0]",
                     "quick: {steps: 10, ber: [0, 1e-4]}, long: {steps: 200}", steps=10)
    out = tmp_path / "out"
    Q0, Q4, L0 = "ddp-ber0-tensor-fix-quick-s1", "ddp-ber1e-4-tensor-fix-quick-s1", "ddp-ber0-tensor-fix-long-s1"
    c1 = Controller(tmp_path, str(exp), "--out", str(out), "-j", "2")

    def q4_started() -> bool:  # its job has brought its topology up (named from the job's pid)
        job = job_of(out, Q4)
        return bool(job) and any(f"kpar{job % 10000}-" in n for n in left_behind(out, state, prefix).get("netns", []))

    c1.wait_until(lambda: Q0 in rows_of(out) and q4_started(), "quick's BER point's topology up")
    os.kill(c1.pid, signal.SIGSTOP)  # no merge from now on
    q4_job = job_of(out, Q4)
    assert L0 not in rows_of(out), "long's clean point ended before quick's: make it longer"
    os.killpg(q4_job, signal.SIGSTOP)  # the job and nothing else: its workers are in sessions of their own
    assert not (out / "rows" / f"{Q4}.json").exists(), "quick's BER point ended before its job was held"
    row_file = out / "rows" / f"{L0}.json"
    c1.wait_until(row_file.exists, "long's clean point's row file")
    c1.sigkill()
    kept = rows_of(out)
    assert set(kept) == {Q0}, kept.keys()
    unmerged = json.loads(row_file.read_text())
    left1 = left_behind(out, state, prefix)
    assert q4_job in left1.get("processes", []) and left1.get("netns"), left1

    t = time.monotonic()
    c2 = Controller(tmp_path, str(exp), "--out", str(out), "-j", "2")
    assert c2.wait() == 0, c2.err[-3000:]
    took = time.monotonic() - t
    assert f"-j job pid {q4_job} (point {Q4})" in c2.err, c2.err[-3000:]
    assert f"{L0}: ok: merged the row a job of an earlier run wrote" in c2.err, c2.err[-3000:]
    final = rows_of(out)
    assert list(final) == [Q0, L0, Q4]  # the grid's order, as ever with -j
    assert all(r["status"] == "ok" for r in final.values()), {p: (r["status"], r["reason"]) for p, r in final.items()}
    assert final[Q0] == kept[Q0]
    assert final[L0] == unmerged  # merged as its job wrote it, not run again
    assert final[Q4]["finished_at"] > unmerged["finished_at"]  # run again
    assert wrote_steps(out, Q4) == list(range(10))
    left = left_behind(out, state, prefix)
    assert not left, left
    fault_line("controller SIGKILLed, -j 2", rows_lost=sum(final.get(p) != r for p, r in kept.items()),
               unmerged_rows_merged=1, points_rerun=1, left_after_kill=count(left1), left_after_resume=count(left),
               resume_s=round(took, 1))


@pytest.mark.slow  # ~1 min on 2 shared cores (a two-node Slurm cluster in namespaces): make test-all
def test_slurm_controller_killed_resumes_by_collecting_its_jobs(tmp_path):
    """`--executor slurm` with its controller SIGKILLed once a row is in results.jsonl and jobs are still queued
    or running (the second array waits for the baselines). Slurm's jobs are not the controller's children: they
    go on, and write their rows. The same command then collects them from jobs.json (none submitted again: the
    jobs' folders are those of the first run), keeps the rows written (finished_at too), and leaves no job, no
    namespace, no topology state behind."""
    from slurmcluster import available, slurm_cluster

    if available() is not None:
        pytest.skip(f"slurm test cluster: {available()}")
    f = experiment(tmp_path, "kslurm", "recipe: [process], ber: [0, 1e-4]", "process: {train: {injector: process}}",
                   steps=6, seeds="1, 2", extra="resources: {cpus: 1, time: 10}")
    out = tmp_path / "out"
    with slurm_cluster() as cluster:
        env = cluster.env(PYTHONPATH=str(ROOT))
        args = (str(f), "--out", str(out), "--executor", "slurm")
        c1 = Controller(tmp_path, *args, env=env, login=cluster.login)
        c1.wait_until(lambda: n_rows(out) >= 1, "a row")
        assert "testbed" in " ".join(procs.cmdline(c1.pid) or []), "not the controller's own pid"
        c1.sigkill()
        kept = rows_of(out)
        submitted = json.loads((out / "jobs.json").read_text())["jobs"]
        running = cluster.jobs()
        assert running, "every job had ended: nothing for the resume to collect"
        folders = sorted(p.name for p in (out / "slurm").iterdir())

        t = time.monotonic()
        c2 = Controller(tmp_path, *args, env=env, login=cluster.login)
        assert c2.wait() == 0, c2.err[-3000:]
        took = time.monotonic() - t
        assert f"{len(submitted)} jobs of an earlier run found in" in c2.err, c2.err[-3000:]
        final = rows_of(out)
        assert len(final) == 4 and all(r["status"] == "ok" for r in final.values()), \
            {p: (r["status"], r["reason"]) for p, r in final.items()}
        assert all(final[p] == r for p, r in kept.items())
        assert sorted(p.name for p in (out / "slurm").iterdir()) == folders  # no job submitted again
        assert json.loads((out / "jobs.json").read_text())["jobs"] == {}
        left = {"jobs": cluster.jobs(),
                "netns": [n for n in cluster.namespaces() if n.startswith(cluster.testbed_prefix)],
                "state": sorted(p.name for p in cluster.state_dir.iterdir()) if cluster.state_dir.exists() else [],
                "processes": [p for p in referencing(out) if procs.alive(p)]}
        left = {k: v for k, v in left.items() if v}
        assert not left, left
        fault_line("controller SIGKILLed, --executor slurm", rows_lost=sum(final.get(p) != r for p, r in kept.items()),
                   jobs_running_at_kill=len(running), jobs_resubmitted=0, rows_collected=len(final) - len(kept),
                   left_after_resume=count(left), resume_s=round(took, 1))


# -- 2. the results directory's file system full ---------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """mount(path, size) -> `path` (made if missing) with a tmpfs of that size on it; every one unmounted at the
    end, even on failure (what still uses it killed first), the last mounted first."""
    mounted = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tbfaults", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for m in reversed(mounted):
        for pid in referencing(m):
            procs.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        if subprocess.run(["umount", str(m)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(m)], check=True)


def fill(fs: Path) -> int:
    """Fill the file system of `fs` (a file written until ENOSPC); the bytes it took."""
    n = 0
    with open(fs / "filler", "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == 28, e
    return n


def free(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def test_a_results_write_on_a_full_disk_keeps_the_old_file(tmp_path, small_fs):
    """ResultsStore on a 256 KiB tmpfs, rows added until one does not fit: the write fails with an OutputError that
    names the file, the errno and the bytes free; results.jsonl on disk is the last complete version (every line
    a whole row, no temp file beside it), and the row that was not saved is not taken for saved either."""
    from testbed.experiments.runner import OutputError, ResultsStore

    fs = small_fs(tmp_path / "mnt", "256k")
    store = ResultsStore(fs, "fp")
    pad = "x" * 20000
    with pytest.raises(OutputError) as err:
        for i in range(100):
            store.add({"point": f"p{i}", "fingerprint": "fp", "pad": pad})
    failed_at = i
    message = str(err.value)
    assert err.value.errno == 28 and f"cannot write {fs / 'results.jsonl'}: [Errno 28] No space left on device" \
        in message, message
    assert "bytes free on its file system" in message and f"({failed_at} complete rows)" in message, message
    rows = rows_of(fs)
    assert list(rows) == [f"p{k}" for k in range(failed_at)] == list(store.rows)
    assert [p.name for p in fs.iterdir()] == ["results.jsonl"]
    fault_line("results.jsonl rewrite on a full disk (unit)", rows_on_disk=len(rows), rows_lost=0,
               bytes_free_at_failure=free(fs), temp_files_left=0)


def test_full_disks_stop_the_run_cleanly_and_it_resumes(tmp_path, isolated, small_fs):
    """--out on a tmpfs (1 MiB: results.jsonl and the run's small files), its points/ and warm/ on tmpfs of their
    own. (1) points/ too small for a point: the run stops at its first point with exit 1 and a message naming the
    error, the path and what to do, no traceback, and records no `error` row (the point did not fail, its disk
    did: such a row would not run again). (2) points/ made large enough and the run resumed; --out filled to the
    last byte once the first row is written: the next point trains, its row cannot be written, and the run stops
    the same way; results.jsonl is the complete file it was (not a byte of the failed write, no temp file), the
    worker services are down. (3) The filler removed, the same command runs exactly the points without a row."""
    state, prefix = isolated
    out = small_fs(tmp_path / "out", "1m")
    points = small_fs(out / "points", "512k")
    small_fs(out / "warm", "16m")
    exp = experiment(tmp_path, "kfull", "recipe: [process], ber: [0, 1e-4]", "process: {train: {injector: process}}",
                     steps=4)
    P0, P4 = "ddp-ber0-tensor-fix-process-s1", "ddp-ber1e-4-tensor-fix-process-s1"

    c1 = Controller(tmp_path, str(exp), "--out", str(out))
    assert c1.wait() == 1, c1.err[-3000:]
    tail1 = c1.err[c1.err.rfind("testbed: "):].strip()
    assert tail1.startswith(f"testbed: cannot write {points / P0}") and "No space left on device" in tail1, tail1
    assert "bytes free on its file system" in tail1 and "run the same command again" in tail1, tail1
    assert "Traceback" not in c1.err
    assert not rows_of(out), "a point that its full disk broke was recorded"
    left1 = left_behind(out, state, prefix)
    assert not left1, left1

    subprocess.run(["mount", "-o", "remount,size=64m", str(points)], check=True)
    c2 = Controller(tmp_path, str(exp), "--out", str(out))
    c2.wait_until(lambda: n_rows(out) >= 1, "the first row")
    took = fill(out)
    at_fill = (out / "results.jsonl").read_bytes()
    free_at_fill = free(out)
    assert c2.wait() == 1, c2.err[-3000:]
    tail2 = c2.err[c2.err.rfind("testbed: "):].strip()
    assert tail2.startswith(f"testbed: cannot write {out / 'results.jsonl'}: [Errno 28] No space left on device ("), \
        tail2
    assert "needed); the file on disk is as it was before this write (1 complete row)" in tail2, tail2
    assert "run the same command again" in tail2 and "Traceback" not in c2.err, c2.err[-3000:]
    # the point trained to its end; its row is what could not be written
    assert json.loads((points / P4 / "summary.json").read_text())["status"] == "ok"
    assert (out / "results.jsonl").read_bytes() == at_fill  # not a byte of the failed write
    kept = rows_of(out)  # every line a whole row
    assert list(kept) == [P0] and kept[P0]["status"] == "ok"
    assert not [p.name for p in out.rglob(".*.tmp")]
    left2 = left_behind(out, state, prefix)
    assert not left2, left2

    (out / "filler").unlink()
    t = time.monotonic()
    c3 = Controller(tmp_path, str(exp), "--out", str(out))
    assert c3.wait() == 0, c3.err[-3000:]
    resumed = time.monotonic() - t
    assert "1 of 2 points already in" in c3.err
    final = rows_of(out)
    assert len(final) == 2 and all(r["status"] == "ok" for r in final.values()), \
        {p: (r["status"], r["reason"]) for p, r in final.items()}
    assert final[P0] == kept[P0] and final[P4]["finished_at"] > kept[P0]["finished_at"]
    assert not left_behind(out, state, prefix)
    fault_line("--out file systems full mid-run", error_rows_recorded=0, exit_code=1, rows_lost=0,
               rows_half_written=0, bytes_free_when_results_write_failed=free_at_fill, filler_bytes=took,
               points_rerun=1, left_after_failure=count(left1) + count(left2), resume_s=round(resumed, 1))
    print("FAULT | messages |", tail1, "|", tail2)


def test_a_topology_comes_down_when_its_results_disk_is_full(tmp_path, isolated, small_fs):
    """Taking a topology down saves its engines' final counters into its results directory (a warm group's); on a
    full disk that write failed and the teardown stopped there, leaving namespaces, engines and state up (also
    for `testbed down --all`, which reads the same directory from the state). Now the counters are lost with a
    note, and everything comes down."""
    from testbed import testbeds
    from testbed.topology.topo import Topology

    state, prefix = isolated
    res = small_fs(tmp_path / "res", "256k")
    topo = Topology.load(PAIR, name="kdown")
    tb = testbeds.create(topo, None, results_dir=res).up()
    try:
        tb.set_link(topo.links[0].name, ber=1e-6)  # an engine on each direction
        up = left_behind(tmp_path / "nothing", state, prefix)
        assert up.get("engines") and up.get("netns"), up
        fill(res)
        result = tb.down()
    finally:
        subprocess.run([*TESTBED, "down", "--all"], cwd=ROOT, capture_output=True, timeout=120)
    assert "No space left on device" in result.get("stats_error", ""), result
    left = left_behind(tmp_path / "nothing", state, prefix)
    assert not left, left
    fault_line("topology down with its results disk full", left_before=count(up), left_after=count(left))


def test_worker_services_stop_when_their_inbox_disk_is_full(tmp_path, small_fs):
    """A warm sweep stops its worker services with a request file in their inbox; on a full disk that write failed
    and the error left them running (and replaced the run's own, clearer error). Now a service that cannot be
    asked is killed."""
    from testbed.experiments.warm import WorkerPool
    from testbed.train.launch import WORKER_MODULE

    inbox = small_fs(tmp_path / "warm", "64k") / "inbox"
    started = []

    def start(rank, argv, env):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    pool = WorkerPool(start, inbox)
    try:
        pool.spawn(0, [sys.executable, "-m", WORKER_MODULE, "--out", str(tmp_path)], {})
        fill(inbox.parent)
        pool.close(wait_s=2)
        assert started[0].poll() is not None, "a service was left running"
    finally:
        for p in started:
            p.kill()
            p.wait()


# -- 3. results.jsonl damaged ----------------------------------------------------------------------------------


def damage(rows: list[str]) -> tuple[str, list[tuple[int, str]]]:
    """results.jsonl text from whole rows (JSON lines, at least two) with damage between and after them: a line
    that is not JSON, JSON lines that are not objects, an object without a point id, the last row cut in the
    middle (no newline). The text, and the (line number, text) of every damaged line."""
    cut = rows[-1][: len(rows[-1]) // 2]
    lines = [rows[0], "garbage from a bad copy", "[1]", '"x"', *rows[1:-1], '{"fingerprint": "x"}', cut]
    bad = [(i, t) for i, t in enumerate(lines, 1) if t not in rows]
    return "\n".join(lines), bad


def test_damaged_results_lines_are_reported_and_kept_aside(tmp_path):
    """ResultsStore on a damaged results.jsonl (no training): no exception (a JSON line that is not an object
    raised AttributeError before); a note per damaged line naming the file, the line and what is wrong (the point
    a cut-off row still names); every damaged line kept verbatim in results-damaged.txt under a line saying where
    it came from; results.jsonl rewritten with the whole rows only; opening it again finds nothing more."""
    from testbed.experiments.runner import DAMAGED_FILE, ResultsStore

    rows = [json.dumps({"point": f"p{i}", "fingerprint": "fp", "status": "ok", "curve": list(range(30))})
            for i in range(3)]
    text, bad = damage(rows)
    (tmp_path / "results.jsonl").write_text(text)
    store = ResultsStore(tmp_path, "fp")
    assert list(store.rows) == ["p0", "p1"]
    notes = "\n".join(store.notes)
    path = tmp_path / "results.jsonl"
    assert f"{path} line 2: not JSON (Expecting value at column 1)" in notes, notes
    assert f"{path} line 3: a JSON array, not a JSON object" in notes, notes
    assert f"{path} line 4: a JSON string, not a JSON object" in notes, notes
    assert f"{path} line 6: a JSON object without a point id" in notes, notes
    assert f"{path} line 7: cut off after {len(bad[-1][1])} bytes (the file ends in the middle of a line); " \
           "it was a row of point p2" in notes, notes
    assert f"4 damaged lines" not in notes and f"5 damaged lines of {path} kept as they were in " \
           f"{tmp_path / DAMAGED_FILE}; without a complete row, point p2 runs again" in notes, notes
    side = (tmp_path / DAMAGED_FILE).read_text().splitlines()
    assert [x for x in side if not x.startswith("# ")] == [t for _, t in bad]  # verbatim, in order
    assert [x.split(",")[0] for x in side if x.startswith("# ")] == [f"# {path} line {i}" for i, _ in bad]
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    again = ResultsStore(tmp_path, "fp")
    assert list(again.rows) == ["p0", "p1"] and again.notes == []
    assert (tmp_path / DAMAGED_FILE).read_text().splitlines() == side
    fault_line("results.jsonl damaged (unit)", damaged_lines=len(bad), lines_kept_aside=len(bad), rows_lost=0,
               exception=None)


def test_a_damaged_results_file_resumes_rerunning_only_the_cut_row(tmp_path, isolated):
    """A finished run whose results.jsonl is then damaged (garbage and non-object lines between the rows, the last
    row cut in the middle), resumed with the same command: it says what it found, line by line, keeps the damaged
    text in results-damaged.txt, runs exactly the point whose row was cut, keeps the others (finished_at too), and
    ends ok."""
    from testbed.experiments.runner import DAMAGED_FILE

    state, prefix = isolated
    exp = experiment(tmp_path, "kdmg", "recipe: [process], ber: [0, 1e-4]", "process: {train: {injector: process}}",
                     steps=4)
    out = tmp_path / "out"
    c1 = Controller(tmp_path, str(exp), "--out", str(out))
    assert c1.wait() == 0, c1.err[-3000:]
    lines = (out / "results.jsonl").read_text().splitlines()
    first = rows_of(out)
    assert len(lines) == 2
    text, bad = damage(lines)
    (out / "results.jsonl").write_text(text)
    cut = json.loads(lines[-1])["point"]

    t = time.monotonic()
    c2 = Controller(tmp_path, str(exp), "--out", str(out))
    assert c2.wait() == 0, c2.err[-3000:]
    took = time.monotonic() - t
    err = c2.err
    assert "Traceback" not in err
    for i, _ in bad:
        assert f"{out / 'results.jsonl'} line {i}: " in err, (i, err[-3000:])
    assert f"it was a row of point {cut}: moved to {out / DAMAGED_FILE}" in err, err[-3000:]
    assert "1 of 2 points already in" in err
    final = rows_of(out)
    assert set(final) == set(first) and all(r["status"] == "ok" for r in final.values())
    assert [p for p in final if final[p] != first[p]] == [cut]  # only the cut row's point ran again
    assert final[cut]["finished_at"] > first[cut]["finished_at"]
    kept_aside = [x for x in (out / DAMAGED_FILE).read_text().splitlines() if not x.startswith("# ")]
    assert kept_aside == [t for _, t in bad]
    assert not left_behind(out, state, prefix)
    fault_line('results.jsonl damaged (cut-off last row, garbage, [1], "x", object without point)',
               damaged_lines_reported=len(bad), lines_kept_aside=len(kept_aside), points_rerun=1, rows_lost=0,
               resume_s=round(took, 1))


def test_a_second_run_into_the_same_directory_is_refused(tmp_path):
    """Two `testbed run` into one directory would each rewrite results.jsonl from the rows it knows, losing the
    other's: while one holds the directory (its lock), another is refused at once with a message that names the
    holder, and creates nothing; a run killed outright holds nothing (the kernel drops its lock)."""
    from testbed.experiments.runner import RunLock

    exp = experiment(tmp_path, "klock", "recipe: [process], ber: [0]", "process: {train: {injector: process}}")
    out = tmp_path / "out"
    out.mkdir()
    lock = RunLock(out)
    try:
        c = Controller(tmp_path, str(exp), "--out", str(out))
        assert c.wait(60) == 1, c.err[-3000:]
    finally:
        lock.release()
    assert f"testbed: {out} is in use by another `testbed run` (pid {os.getpid()} on " in c.err, c.err[-2000:]
    assert "Traceback" not in c.err
    assert sorted(p.name for p in out.iterdir()) == []  # nothing created (the lock file went with its holder)
    pid = os.fork()
    if pid == 0:  # a holder killed outright, as a crashed run is
        try:
            RunLock(out)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    RunLock(out).release()  # free again: no BlockingIOError, no RunDirectoryBusy
