"""An experiment run twice, on this machine (`testbed run`, warm points) and on the two-node Slurm test cluster
(`--executor slurm`, tests/slurmcluster.py), then compared row by row and report by report (issue 23: "its
report identical in substance to the local one"). Every row field is compared; the ones that differ by design
are the timing fields (results.TIMING_FIELDS), `finished_at`, and where a point ran (`machine`, `topology`).

    flock /tmp/testbed-roottests.lock .venv/bin/python benchmarks/slurm_vs_local.py [experiments/calibrate.yaml]
        [--out /tmp/slurm-vs-local]

Needs root (wire points, the cluster) and `make slurm-deps`. calibrate.yaml's 48 points: ~1.5 min locally, ~5 min
on the cluster (each job a cold point) on 2 CPUs. Exit status 1 when anything but those fields differs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from slurmcluster import slurm_cluster  # noqa: E402
from testbed.analysis.results import TIMING_FIELDS  # noqa: E402

WHERE = ("finished_at", "machine", "topology")  # when and where a point ran: differ by design
# report lines that carry times or where the runs ran
TIMING_LINE = re.compile(r"Runs finished|Training wall time|Report generated|Fingerprint")


def rows_of(d: Path) -> dict:
    return {r["point"]: r for r in map(json.loads, (d / "results.jsonl").read_text().splitlines())}


def report_lines(d: Path) -> list[str]:
    """The report without its timing lines, and its tables without their step-time and wall-time columns."""
    out, drop = [], set()
    for line in (d / "report.md").read_text().splitlines():
        if not line.startswith("|"):
            drop = set()
        elif not drop and ("step time" in line or "wall s" in line):  # a header: columns to leave out
            drop = {i for i, c in enumerate(line.split("|")) if "step time" in c or "wall s" in c}
        if drop:
            line = "|".join(c for i, c in enumerate(line.split("|")) if i not in drop)
        elif TIMING_LINE.search(line):
            continue
        out.append(line)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", nargs="?", default=str(ROOT / "experiments" / "calibrate.yaml"))
    ap.add_argument("--out", default="/tmp/slurm-vs-local", help="run directory (replaced)")
    a = ap.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.chmod(out, 0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "testbed", "run", a.experiment, "--out", str(out / "local")],
                       env=env, cwd=ROOT, capture_output=True, text=True)
    print(f"local: exit {r.returncode}, {time.monotonic() - t:.0f} s; {r.stdout.strip().splitlines()[-2:]}",
          flush=True)
    with slurm_cluster() as cluster:
        t = time.monotonic()
        r = subprocess.run(cluster.login([sys.executable, "-m", "testbed", "run", a.experiment, "--out",
                                          str(out / "slurm"), "--executor", "slurm"]),
                           env=cluster.env(PYTHONPATH=str(ROOT)), cwd=ROOT, capture_output=True, text=True)
        print(f"slurm: exit {r.returncode}, {time.monotonic() - t:.0f} s; {r.stdout.strip().splitlines()[-2:]}",
              flush=True)
        if r.returncode:
            print(r.stderr[-3000:])
            return 1
    local, slurm = rows_of(out / "local"), rows_of(out / "slurm")
    ignored = set(TIMING_FIELDS) | set(WHERE)
    differing = sorted({k for p in local if p in slurm for k in local[p]
                        if local[p].get(k) != slurm[p].get(k)} - ignored)
    print(f"points: local {len(local)}, slurm {len(slurm)}; ok: local "
          f"{sum(x['status'] == 'ok' for x in local.values())}, slurm {sum(x['status'] == 'ok' for x in slurm.values())}")
    print(f"fields compared per row: {len(next(iter(local.values()))) - len(ignored)} (ignored: "
          f"{', '.join(sorted(ignored))})")
    print(f"fields that differ in some row: {differing or 'none'}")
    d = [x for x in difflib.unified_diff(report_lines(out / "local"), report_lines(out / "slurm"),
                                         lineterm="", n=0) if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    print(f"report lines that differ (timing lines left out): {len(d)}")
    print("\n".join(d[:40]))
    same = set(local) == set(slurm) and not differing and not d
    print("rows and report identical apart from timing and placement:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
