"""One point of an experiment as a job of its own: what `testbed run --executor slurm` submits and `-j N` starts,
`python -m testbed.experiments.jobs DIR POINT_ID [--runtime R]`.

The job reads the experiment from DIR/experiment.yaml (the runner's portable copy), trains the point cold (its
own topology, named from this process's pid so that concurrent jobs on one machine never share one, and its own
state) and writes its row to DIR/rows/POINT_ID.json atomically; the controller merges that file into
results.jsonl. A job always leaves a row, unless it is killed outright (the controller then writes one from the
scheduler's word). Wire points need root on the node (namespaces, veths, iptables); under any other user the
point is refused with an `error` row that says so. Process-injector points need nothing of the sort.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from testbed.fileio import write_json_atomic
from testbed.analysis.results import error_row
from testbed.experiments.spec import Experiment, Point

ROWS_DIR = "rows"


def row_path(out: Path, point_id: str) -> Path:
    return Path(out) / ROWS_DIR / f"{point_id}.json"


def wire_refusal(exp: Experiment, point: Point) -> str | None:
    """Why a point cannot run in this process (a wire point without root), or None."""
    injector = exp.train_settings(point).injector
    if injector == "process" or os.geteuid() == 0:
        return None
    return (f"refused: a wire point (injector {injector}) needs root on the node (network namespaces, veths, "
            f"iptables) and this job runs as uid {os.geteuid()}; run wire points where jobs get root, or use "
            "`injector: process`, which needs none")


def thread_share(world_size: int, cpus: int | None) -> int:
    """torch threads per worker when a point has `cpus` CPUs for its `world_size` workers (at least 1)."""
    return max(1, (cpus or 1) // max(1, world_size))


def run_job(out: str | Path, point_id: str, runtime: str | None = None, cpus: int | None = None) -> dict:
    """Train one point of DIR/experiment.yaml and write its row to DIR/rows/POINT_ID.json; return the row.
    `cpus`: the CPUs this point may use (its torch threads are split from them unless the experiment or
    $TESTBED_TORCH_THREADS sets them); default: the scheduler's allocation ($SLURM_CPUS_PER_TASK), else 1."""
    from testbed.experiments.runner import run_point

    out = Path(out).resolve()
    # SIGTERM (scancel, a time limit, the local controller's Ctrl-C): unwind, so that a wire point's topology
    # comes down before the scheduler's SIGKILL; submitit's own handlers would ignore it
    signal.signal(signal.SIGTERM, _interrupt)
    if hasattr(signal, "SIGUSR2"):
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # submitit's pre-timeout warning: no checkpoint to take
    exp = Experiment.load(out / "experiment.yaml")
    points = exp.points()
    point = next((p for p in points if p.id == point_id), None)
    if point is None:
        raise SystemExit(f"{out / 'experiment.yaml'} has no point {point_id!r}")
    runtime = runtime or exp.spec.runtime
    fp = exp.fingerprint(runtime, point.recipe)
    cfg = exp.train_settings(point)
    if cpus is None and os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        cpus = int(os.environ["SLURM_CPUS_PER_TASK"])
    if cfg.threads is None and "TESTBED_TORCH_THREADS" not in os.environ:
        os.environ["TESTBED_TORCH_THREADS"] = str(thread_share(exp.world_size(point.mode, cfg.hosts, point.recipe),
                                                               cpus))
    refusal = wire_refusal(exp, point)
    if refusal:
        row = failed_row(exp, point, fp, runtime, refusal)
    else:
        name = f"{exp.spec.name[:8]}{os.getpid() % 10000}-{points.index(point)}"
        row = run_point(exp, point, out, runtime, fp, name)
        row.pop("_line", None)
    write_json_atomic(row_path(out, point.id), row)
    return row


def failed_row(exp: Experiment, point: Point, fp: str, runtime: str | None, reason: str) -> dict:
    """The `error` row of a point that did not run to its end (refused, or its job was killed)."""
    return error_row(point=point.id, baseline=point.baseline.id, experiment=exp.spec.name,
                     tolerance=exp.spec.tolerance, fingerprint=fp, **point.params(), ber_at_lambda=point.lam,
                     model=exp.model_of(point.recipe), steps=exp.steps_of(point.recipe), runtime=runtime or "netns",
                     injector=exp.train_settings(point).injector, status="error", reason=reason, steps_completed=0,
                     finished_at=time.time(), run_dir=f"points/{point.id}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.experiments.jobs", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("point")
    ap.add_argument("--runtime")
    ap.add_argument("--cpus", type=int)
    args = ap.parse_args(argv)
    try:
        row = run_job(args.dir, args.point, args.runtime, args.cpus)
    except KeyboardInterrupt:
        return 130
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
