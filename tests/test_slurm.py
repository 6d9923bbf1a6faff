"""`testbed run --executor slurm` on a real two-node Slurm cluster (tests/slurmcluster.py: Debian's slurm-wlm and
munge, slurmctld and two slurmd each in its own namespace and hostname; `make slurm-deps`), and `-j 2` on this
machine. Skipped with a reason where the cluster cannot be made (no root, Slurm not installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurmcluster import slurm_cluster, available
from testbed.analysis.results import TIMING_FIELDS
from testbed.train.fingerprint import bit_identical

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "topologies" / "pair.yaml"
# what differs between two runs of one point by design: timing, and where it ran (the machine; the name its
# topology was brought up under holds the pid of the process that ran it)
TIMING = {*TIMING_FIELDS, "machine", "topology"}

pytestmark = pytest.mark.skipif(available() is not None, reason=f"slurm test cluster: {available()}")


def experiment(d: Path, name: str, recipes: str, steps: int = 6, bers: str = "0, 1e-4", extra: str = "") -> Path:
    f = d / f"{name}.yaml"
    f.write_text(f"""name: {name}
model: tiny
steps: {steps}
tokens_per_step: 256
topologies: {{ddp: {PAIR}}}
recipes:
  wire: {{train: {{injector: wire}}}}
  process: {{train: {{injector: process}}}}
grid: {{recipe: [{recipes}], mode: [ddp], ber: [{bers}], seed: [1]}}
train: {{seq_len: 64, lr: 0.003, timeout: 20}}
point_timeout: 300
resources: {{cpus: 2, time: 10}}
{extra}""")
    os.chmod(f, 0o644)
    return f


def rows_of(out: Path) -> dict[str, dict]:
    return {r["point"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def same_rows(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for p in a:
        diff = {k for k in a[p] if a[p][k] != b[p].get(k)} - TIMING
        assert not diff, f"{p}: {[(k, a[p][k], b[p][k]) for k in sorted(diff)]}"


@pytest.fixture(scope="module")
def cluster():
    with slurm_cluster() as c:
        yield c
        left = c.jobs()
    assert not left, f"jobs left: {left}"


def controller(cluster, *args, user: str | None = None, env=None, **kw) -> subprocess.Popen:
    """`testbed run ARGS` on the cluster's login node (as `user`), with this checkout's code."""
    argv = [sys.executable, "-m", "testbed", "run", *args]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    env = cluster.env(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen(cluster.login(argv), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def run(cluster, *args, timeout=600, **kw) -> subprocess.CompletedProcess:
    p = controller(cluster, *args, **kw)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def no_leftovers(cluster) -> None:
    assert not [n for n in cluster.namespaces() if n.startswith(cluster.testbed_prefix)], cluster.namespaces()
    assert not list(cluster.state_dir.iterdir())


def test_slurm_rows_equal_the_sequential_run(cluster, tmp_path):
    """Process-injector and wire points as Slurm jobs on both nodes: the rows the sequential run writes, apart from
    timing and the node; the same parameters, step by step (param_sha256), and the same flips."""
    exp = experiment(tmp_path, "across", "wire, process")
    seq = tmp_path / "seq"
    r = subprocess.run([sys.executable, "-m", "testbed", "run", str(exp), "--out", str(seq)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "slurm"
    t = time.monotonic()
    r = run(cluster, str(exp), "--out", str(out), "--executor", "slurm")
    took = time.monotonic() - t
    assert r.returncode == 0, r.stderr[-3000:] + cluster.log("slurmctld")[-2000:]
    a, b = rows_of(seq), rows_of(out)
    assert all(x["status"] == "ok" for x in b.values()), {p: x["reason"] for p, x in b.items()}
    same_rows(a, b)
    for p in a:
        assert bit_identical(seq / "points" / p, out / "points" / p), p
    assert b["ddp-ber1e-4-tensor-fix-wire-s1"]["bits_flipped"] > 0
    assert b["ddp-ber1e-4-tensor-fix-process-s1"]["bits_flipped"] > 0
    assert {x["machine"]["hostname"] for x in b.values()} == {"tbn1", "tbn2"}  # both nodes ran points
    assert "done 4, failed 0" in r.stderr
    jobs = json.loads((out / "jobs.json").read_text())
    assert jobs["executor"] == "slurm" and jobs["jobs"] == {}  # every job collected
    no_leftovers(cluster)
    print(f"slurm run of 4 points: {took:.0f} s")


@pytest.mark.slow  # make test-all: the suite stays under its 20 minutes on 2 cores (clean-clone run: 22 min with it)
def test_cancelled_job_is_reported_and_retried(cluster, tmp_path):
    """--detach submits and returns; a job cancelled (scancel) mid-run becomes an error row saying so when a later
    run collects; --retry-failed runs that point again, and only it."""
    exp = experiment(tmp_path, "cancel", "process", steps=200, bers="0, 1e-5, 1e-4")
    out = tmp_path / "out"
    r = run(cluster, str(exp), "--out", str(out), "--executor", "slurm", "--detach")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "detached: 3 jobs left running" in r.stderr
    jobs = json.loads((out / "jobs.json").read_text())["jobs"]
    victim = jobs["ddp-ber0-tensor-fix-process-s1"]["id"]  # the baseline: the others wait for it
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = dict(line.split()[:2] for line in cluster.jobs())
        if state.get(victim) == "RUNNING" and (out / "points" / "ddp-ber0-tensor-fix-process-s1"
                                               / "metrics.jsonl").exists():
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"job {victim} did not start: {cluster.jobs()}")
    cluster.run(["scancel", victim])
    r = run(cluster, str(exp), "--out", str(out), "--executor", "slurm")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(out)
    base = rows["ddp-ber0-tensor-fix-process-s1"]
    assert base["status"] == "error" and f"Slurm job {victim} ended CANCELLED" in base["reason"], base["reason"]
    assert "scancel" in base["reason"]
    assert "3 jobs of an earlier run found" in r.stderr
    others = [x for p, x in rows.items() if p != base["point"]]
    assert all(x["status"] == "ok" for x in others), {x["point"]: x["reason"] for x in others}
    finished = {p: x["finished_at"] for p, x in rows.items()}

    r = run(cluster, str(exp), "--out", str(out), "--executor", "slurm", "--retry-failed")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(out)
    assert all(x["status"] == "ok" for x in rows.values()), {p: x["reason"] for p, x in rows.items()}
    assert rows[base["point"]]["finished_at"] > finished[base["point"]]
    assert all(rows[p]["finished_at"] == finished[p] for p in finished if p != base["point"])  # not rerun
    no_leftovers(cluster)


@pytest.fixture
def unprivileged(data_cache):
    """A run directory and a cache that `nobody` owns (the cache a copy of this user's: the corpus and tokenizer
    are prepared offline), and, where the venv's interpreter lies under a directory nobody may not enter (here:
    pyenv under /root), a traverse-only ACL entry for nobody on it, removed afterwards."""
    # not under tmp_path: pytest makes its base directory 0700 again whenever a pytest session starts
    work = Path(tempfile.mkdtemp(prefix="tbslurm-nobody-"))
    work.chmod(0o755)
    shutil.copytree(data_cache, work / "cache", ignore=shutil.ignore_patterns("locks", "vm", "downloads", "torchinductor"))
    (work / "out").mkdir()
    subprocess.run(["chown", "-R", "nobody:nogroup", str(work)], check=True)
    blocked = [p for p in Path(os.path.realpath(sys.executable)).parents if p.stat().st_mode & 0o001 == 0]
    added = []
    try:
        for p in blocked:
            had = subprocess.run(["getfacl", "-ps", "--skip-base", str(p)], capture_output=True, text=True).stdout
            if had.strip():
                pytest.skip(f"{p} has an ACL of its own: not touched")
            subprocess.run(["setfacl", "-m", "u:nobody:x", str(p)], check=True)
            added.append(p)
        yield work
    finally:
        for p in added:
            subprocess.run(["setfacl", "-b", str(p)], check=True)
        shutil.rmtree(work, ignore_errors=True)


def test_process_points_run_unprivileged_and_wire_points_are_refused(cluster, tmp_path, unprivileged):
    """The controller and its jobs as `nobody`: process-injector points train (no namespace, no iptables, nothing
    written outside the run directory and the cache); a wire point is refused with a clear reason."""
    exp = experiment(unprivileged, "nobody", "process, wire", bers="0, 1e-4")
    out = unprivileged / "out"
    marker = unprivileged / "marker"
    marker.write_text("")
    before = set(os.listdir("/run/netns"))
    r = run(cluster, str(exp), "--out", str(out), "--executor", "slurm", user="nobody",
            env={"TESTBED_CACHE": str(unprivileged / "cache"), "HOME": str(unprivileged), "MPLCONFIGDIR":
                 str(out / ".mpl")})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(out)
    for p in ("ddp-ber0-tensor-fix-process-s1", "ddp-ber1e-4-tensor-fix-process-s1"):
        assert rows[p]["status"] == "ok", rows[p]["reason"]
    assert rows["ddp-ber1e-4-tensor-fix-process-s1"]["bits_flipped"] > 0
    for p in ("ddp-ber0-tensor-fix-wire-s1", "ddp-ber1e-4-tensor-fix-wire-s1"):
        assert rows[p]["status"] == "error"
        assert rows[p]["reason"].startswith("refused: a wire point (injector wire) needs root on the node"), \
            rows[p]["reason"]
        assert "uid 65534" in rows[p]["reason"]
    assert set(os.listdir("/run/netns")) == before
    # every file nobody wrote during the run is in the run directory or the cache
    found = subprocess.run(["find", "/", "(", "-path", "/proc", "-o", "-path", "/sys", "-o", "-path", "/dev", ")",
                            "-prune", "-o", "-user", "nobody", "-newer", str(marker), "-print"],
                           capture_output=True, text=True).stdout.split()
    outside = [f for f in found if not (f.startswith(str(out)) or f.startswith(str(unprivileged / "cache")))]
    assert not outside, outside


@pytest.mark.slow  # make test-all: the suite stays under its 20 minutes on 2 cores (clean-clone run: 22 min with it)
def test_time_limit_becomes_a_row_with_the_reason(cluster, tmp_path):
    """A point that outlasts its time limit (resources.time, here --time 1) is killed by Slurm; its row says so."""
    exp = experiment(tmp_path, "limit", "process", steps=100000, bers="0")
    out = tmp_path / "out"
    r = run(cluster, str(exp), "--out", str(out), "--executor", "slurm", "--time", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    row = rows_of(out)["ddp-ber0-tensor-fix-process-s1"]
    assert row["status"] == "error"
    assert " ended TIMEOUT on tbn" in row["reason"] and "Slurm killed it at its time limit" in row["reason"], \
        row["reason"]
    no_leftovers(cluster)
