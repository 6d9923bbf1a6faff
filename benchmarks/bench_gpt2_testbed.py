#!/usr/bin/env python3
"""GPT-2 124M, DDP on two namespace hosts (topologies/pair.yaml) on CPU: step time without a corruption
engine, with engines at BER 0, and with engines at a BER > 0 (scope tensor), all measured in the same run.
Medians over steps after the first (which includes DDP's bucket rebuild and warm-up) and over repetitions.

    .venv/bin/python benchmarks/bench_gpt2_testbed.py [--steps 4] [--reps 2] [--ber 1e-7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.experiments.training import train  # noqa: E402
from testbed.train.settings import TrainSettings  # noqa: E402
from testbed.fileio import read_jsonl  # noqa: E402
from testbed.topology.topo import Topology  # noqa: E402


def per_step(run_dir: Path, key: str) -> list[float]:
    """`key` per step (slowest rank), steps after the first."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    by_step: dict[int, float] = {}
    for r in rows:
        by_step[r["step"]] = max(by_step.get(r["step"], 0.0), r[key] or 0.0)
    return [t for s, t in sorted(by_step.items()) if s > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ber", type=float, default=1e-7)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = TrainSettings(mode="ddp", model="gpt2-124m", steps=args.steps, seed=1, batch_size=args.batch_size,
                        seq_len=args.seq_len, timeout=120, stall_timeout=600, reference=False)
    conditions = [("no engine", {}), ("engine, BER 0", {"ber": 0.0, "scope": "tensor"}),
                  (f"engine, BER {args.ber:g}", {"ber": args.ber, "scope": "tensor"})]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for label, over in conditions:
                topo = Topology.load(ROOT / "topologies" / "pair.yaml", name=f"bgpt-{rep}")
                out = Path(tmp) / f"{rep}-{len(results)}"
                s = train(topo, cfg, out, log=lambda m: None, **over)
                r = results.setdefault(label, {"step_times": [], "comm_times": [], "status": [], "bits_flipped": 0,
                                               "skipped_steps": 0})
                r["status"].append(s["status"])
                r["bits_flipped"] += s.get("bits_flipped") or 0
                r["skipped_steps"] += s.get("skipped_steps") or 0
                if s["status"] == "ok":
                    r["step_times"] += per_step(out, "step_time_s")
                    r["comm_times"] += per_step(out, "comm_time_s")
                print(f"rep {rep} {label}: {s['status']}, median step {s.get('median_step_time_s')}", flush=True)
    base = statistics.median(results["no engine"]["step_times"])
    print(f"\nGPT-2 124M DDP on pair.yaml, batch {args.batch_size} x {args.seq_len} per rank, 2 ranks, "
          f"median of {args.reps} x {args.steps - 1} steps")
    base_comm = statistics.median(results["no engine"]["comm_times"])
    print("(allreduce = time in DDP's gradient allreduce; a skipped step, after a corrupted exponent made the "
          "gradient norm non-finite, saves the optimizer's time)")
    print(f"{'condition':<22} {'step (s)':>9} {'x no engine':>12} {'allreduce (s)':>14} {'x no engine':>12} "
          f"{'bits flipped':>13} {'skipped':>8}")
    for label, r in results.items():
        med = statistics.median(r["step_times"]) if r["step_times"] else float("nan")
        comm = statistics.median(r["comm_times"]) if r["comm_times"] else float("nan")
        r["median_step_s"], r["median_comm_s"] = med, comm
        print(f"{label:<22} {med:>9.2f} {med / base:>12.2f} {comm:>14.2f} {comm / base_comm:>12.2f} "
              f"{r['bits_flipped']:>13,} {r['skipped_steps']:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
