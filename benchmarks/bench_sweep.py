"""Benchmark of a sweep's cost per point, cold (`testbed run --cold`: a fresh topology and fresh workers per point)
against warm (the default: one topology and worker services per topology, runtime and mode; docs/experiments.md).

A fixed subset of experiments/calibrate.yaml, both injectors (recipes wire and process), DDP and PP on
topologies/pair.yaml: BER 0 and 1e-4, seeds 1 and 2, 100 steps (16 points per run), run cold and warm in
turn `--reps` times. Per (recipe, mode): the median seconds per point (the time from one point's row to the
next, set-up and row included), the part of it that is training (the workers' own step times, slowest rank,
summed over the steps), its work (steps, evals, fingerprints, the loop: what cold and warm both do) and the
rest, the ratio cold / warm (of the medians, and the median of each repetition's ratio), and the bound the work
puts on it (a warm point that cost nothing beyond its work: (cold rest + warm work) / warm work); then the median
of each phase of a point (the rows' phase_times_s: set-up, the workers' start, rendezvous, build, steps, eval,
fingerprints, exit, finish). Run as root from the repository root:

    .venv/bin/python benchmarks/bench_sweep.py [--steps 100] [--reps 1] [--out F]

Target (issue 21): warm at least 3x faster per point than cold for tiny DDP and PP 100-step points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.experiments.runner import run_experiment  # noqa: E402
from testbed.experiments.spec import Experiment  # noqa: E402


def subset(tmp: Path, steps: int) -> Experiment:
    doc = yaml.safe_load((ROOT / "experiments" / "calibrate.yaml").read_text())
    doc.update(name="bsweep", steps=steps, topologies={m: str(ROOT / "topologies" / "pair.yaml") for m in ("ddp", "pp")})
    doc["grid"].update(ber=[0, 1e-4], seed=[1, 2])
    f = tmp / "bsweep.yaml"
    f.write_text(yaml.safe_dump(doc))
    return Experiment.load(f)


# a point's own work (phase_times_s): what a cold and a warm point both do, whatever runs them
WORK = ("steps", "eval", "fingerprint", "loop")


def one_run(exp: Experiment, out: Path, cold: bool, rep: int = 0) -> list[dict]:
    """Per point: recipe, mode, status, seconds (since the previous point's row), training seconds (the steps)
    and work seconds (WORK)."""
    started = time.time()
    rows = sorted(run_experiment(exp, out, cold=cold, log=lambda m: None), key=lambda r: r["finished_at"])
    points, prev = [], started
    for r in rows:
        phases = r.get("phase_times_s") or {}
        points.append({"point": r["point"], "recipe": r["recipe"], "mode": r["mode"], "status": r["status"],
                       "s": r["finished_at"] - prev, "train_s": sum(r["step_time_curve"]),
                       "work_s": sum(phases.get(k, 0.0) for k in WORK), "rep": rep, "phases": phases})
        prev = r["finished_at"]
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--reps", type=int, default=1, help="cold and warm runs each (medians over all their points)")
    p.add_argument("--out", help="write the per-point times as JSON here")
    a = p.parse_args()
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        exp = subset(Path(tmp), a.steps)
        for rep in range(a.reps):
            for kind in ("cold", "warm"):
                t = time.monotonic()
                runs[kind] += one_run(exp, Path(tmp) / f"{kind}-{rep}", cold=kind == "cold", rep=rep)
                print(f"rep {rep + 1}/{a.reps} {kind}: {time.monotonic() - t:.1f}s", file=sys.stderr, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"steps": a.steps, "reps": a.reps, "points": runs}, indent=1))
    # per (recipe, mode): medians over every repetition's points; the ratio also per repetition (cold and warm
    # ran one after the other: the load of the shared cores changes less within one), and its median
    print(f"{'recipe':8} {'mode':4} {'cold s/pt':>9} {'work':>5} {'rest':>5} {'warm s/pt':>9} {'work':>5} "
          f"{'rest':>5} {'ratio':>6} {'per rep':>7}  bound")
    summary = []
    for recipe in exp.spec.grid.recipe:
        for mode in exp.spec.grid.mode:
            med, fails = {}, 0
            for kind, pts in runs.items():
                mine = [x for x in pts if (x["recipe"], x["mode"]) == (recipe, mode)]
                med[kind] = {"s": statistics.median(x["s"] for x in mine),
                             "train_s": statistics.median(x["train_s"] for x in mine),
                             "work_s": statistics.median(x["work_s"] for x in mine),
                             "rest_s": statistics.median(x["s"] - x["work_s"] for x in mine)}
                fails += sum(x["status"] != "ok" for x in mine)
            per_rep = []
            for rep in range(a.reps):
                at = {k: statistics.median(x["s"] for x in pts
                                           if (x["recipe"], x["mode"], x["rep"]) == (recipe, mode, rep))
                      for k, pts in runs.items()}
                per_rep.append(at["cold"] / at["warm"])
            c, w = med["cold"], med["warm"]
            # what a warm point that cost nothing beyond its work would give: the work bounds the ratio
            bound = (c["rest_s"] + w["work_s"]) / w["work_s"] if w["work_s"] else float("nan")
            summary.append({"recipe": recipe, "mode": mode, "cold": c, "warm": w, "ratio": c["s"] / w["s"],
                            "ratio_per_rep": per_rep, "ratio_median_per_rep": statistics.median(per_rep),
                            "bound": bound, "not_ok": fails})
            print(f"{recipe:8} {mode:4} {c['s']:9.2f} {c['work_s']:5.2f} {c['rest_s']:5.2f} {w['s']:9.2f} "
                  f"{w['work_s']:5.2f} {w['rest_s']:5.2f} {c['s'] / w['s']:5.1f}x {statistics.median(per_rep):6.1f}x"
                  f"  {bound:4.1f}x" + (f"  ({fails} points not ok)" if fails else ""))
    if a.out:
        Path(a.out).write_text(json.dumps({"steps": a.steps, "reps": a.reps, "summary": summary, "points": runs},
                                          indent=1))
    # where a point's time went (the rows' phase_times_s, medians; docs/experiments.md)
    phases = ("setup", "launch", "import", "data", "connect", "build", "steps", "eval", "fingerprint", "loop",
              "exit", "finish")
    print(f"\n{'median s':18} {' '.join(f'{n[:7]:>7}' for n in phases)} {'other':>7}")
    for recipe in exp.spec.grid.recipe:
        for mode in exp.spec.grid.mode:
            for kind, pts in runs.items():
                mine = [x for x in pts if (x["recipe"], x["mode"]) == (recipe, mode) and x["phases"]]
                if not mine:
                    continue
                med = {n: statistics.median(x["phases"].get(n, 0.0) for x in mine) for n in phases}
                # other: the rest of a point's seconds (from the previous row): results.jsonl, the runner
                other = statistics.median(x["s"] - sum(x["phases"].get(n, 0.0) for n in phases) for x in mine)
                print(f"{recipe:8} {mode:4} {kind:4} {' '.join(f'{med[n]:7.2f}' for n in phases)} {other:7.2f}")


if __name__ == "__main__":
    main()
