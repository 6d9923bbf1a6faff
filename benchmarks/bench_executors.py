"""Points per hour of `testbed run` with the same points: `-j 1` (sequential, warm), `-j 2` (two at once, each
cold) on this machine, and `--executor slurm` on the two-node test cluster (tests/slurmcluster.py: both nodes
are namespaces of this machine, so they share its CPUs; it measures the executor's overhead, not a cluster's
speed-up). Ratios against `-j 1` measured in the same run; medians of --reps runs, in an interleaved order.

    flock /tmp/testbed-roottests.lock python benchmarks/bench_executors.py [--reps 3] [--steps 10]

Needs root (wire points, the cluster) and `make slurm-deps`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def experiment(d: Path, steps: int) -> Path:
    f = d / "bench.yaml"
    f.write_text(f"""name: benchx
model: tiny
steps: {steps}
tokens_per_step: 256
topologies: {{ddp: {ROOT / 'topologies' / 'pair.yaml'}}}
recipes:
  wire: {{train: {{injector: wire}}}}
  process: {{train: {{injector: process}}}}
grid: {{recipe: [wire, process], mode: [ddp], ber: [0, 1e-5, 1e-4], seed: [1]}}
train: {{seq_len: 64, lr: 0.003, timeout: 20}}
point_timeout: 300
resources: {{cpus: 2}}
""")
    os.chmod(f, 0o644)
    return f


def timed(argv: list[str], env: dict, out: Path) -> float:
    t = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    took = time.monotonic() - t
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()] if r.returncode == 0 else []
    bad = [x["point"] for x in rows if x["status"] != "ok"]
    if r.returncode or bad or not rows:
        raise SystemExit(f"{' '.join(argv)} failed ({bad}):\n{r.stderr[-3000:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    from slurmcluster import available, slurm_cluster

    why = available()
    if why:
        print(f"bench_executors: skipped: {why}", file=sys.stderr)
        return 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times: dict[str, list[float]] = {"-j 1": [], "-j 2": [], "slurm 2 nodes": []}
    with tempfile.TemporaryDirectory(prefix="bench-executors-") as tmp, slurm_cluster() as cluster:
        d = Path(tmp)
        os.chmod(d, 0o755)
        exp = experiment(d, args.steps)
        n = 6
        for rep in range(args.reps):
            for what in times:
                out = d / f"{what.replace(' ', '')}-{rep}"
                base = [sys.executable, "-m", "testbed", "run", str(exp), "--out", str(out)]
                if what == "-j 1":
                    t = timed(base, env, out)
                elif what == "-j 2":
                    t = timed([*base, "-j", "2"], env, out)
                else:
                    t = timed(cluster.login([*base, "--executor", "slurm"]), cluster.env(PYTHONPATH=str(ROOT)), out)
                times[what].append(t)
                print(f"rep {rep + 1} {what}: {t:.1f} s, {n / t * 3600:.0f} points/h", flush=True)
    ref = statistics.median(times["-j 1"])
    print(f"\n{n} points (tiny GPT-2, DDP on pair, {args.steps} steps, wire and process, BER 0/1e-5/1e-4), "
          f"{os.cpu_count()} CPUs, median of {args.reps}:")
    print("| executor | wall s (runs) | points/h | vs -j 1 |\n|---|---|---|---|")
    for what, ts in times.items():
        m = statistics.median(ts)
        print(f"| {what} | {m:.1f} ({', '.join(f'{t:.0f}' for t in ts)}) | {n / m * 3600:.0f} | {ref / m:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
