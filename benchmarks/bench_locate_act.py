"""Does acting on a detection help? Step time of monitored DDP training on ring4 with one bad link in keep mode
(its corrupted segments dropped and retransmitted: slow steps), without and with `on_detection: clean` (the
launcher sets the link the first confident detector names to BER 0), against the same run on a clean fabric.
Issue 13, item 5; docs/locate.md, "Acting on a detection".

    .venv/bin/python benchmarks/bench_locate_act.py [--seeds 1 2 3] [--steps 20] [--ber 1e-5] [--out F]

Per seed: one link drawn as in experiments/locate.yaml (testbed.locate.faults.pick_link); three runs: clean
(every link at BER 0), fault (the link at --ber, no action), act (the same, on_detection clean). Step time is
the slowest rank's, medians over steps; for `act` split at the action (detectors.recovery). Results are written
atomically after every run (an interrupted benchmark keeps what finished). Run as root from the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import running, unique_name  # noqa: E402

from testbed.experiments.training import train  # noqa: E402
from testbed.fileio import read_jsonl, write_json_atomic  # noqa: E402
from testbed.locate.cli import actions_taken  # noqa: E402
from testbed.locate.faults import pick_link  # noqa: E402
from testbed.topology.topo import Topology  # noqa: E402
from testbed.train.settings import TrainSettings  # noqa: E402


def step_times(run_dir: Path) -> list[float]:
    took: dict[int, float] = {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        took[r["step"]] = max(took.get(r["step"], 0.0), r["step_time_s"])
    return [took[k] for k in sorted(took)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ber", type=float, default=1e-5)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_locate_act.json"))
    args = ap.parse_args()

    topo = Topology.load(ROOT / "topologies" / "ring4.yaml", name=unique_name("act"))
    result = {"ber": args.ber, "steps": args.steps, "checksum": "keep", "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with running(topo.with_overrides(ber=0.0, scope="tensor", collectives=["allreduce", "p2p"])) as tb, \
            tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            link = pick_link(tb.topo, seed)
            for kind in ("clean", "fault", "act"):
                for l in tb.topo.links:
                    bad = kind != "clean" and l.name == link
                    tb.set_link(l.name, ber=args.ber if bad else 0.0, checksum="keep")
                cfg = TrainSettings(mode="ddp", model="tiny", steps=args.steps, seed=seed, batch_size=2,
                                    seq_len=32, monitor=True, on_detection="clean" if kind == "act" else "none",
                                    timeout=60, stall_timeout=120, run_timeout=900)
                run_dir = Path(work) / f"{kind}-{seed}"
                s = train(tb.name, cfg, run_dir, log=lambda m: None)
                times = step_times(run_dir)
                row = {"seed": seed, "link": link, "kind": kind, "status": s["status"],
                       "step_time_median_s": statistics.median(times) if times else None,
                       "step_times_s": times}
                if kind == "act":
                    row["actions"] = actions_taken(run_dir)
                result["runs"].append(row)
                write_json_atomic(out, result)
                a = (row.get("actions") or [None])[0]
                print(f"seed {seed} {link} {kind}: {s['status']}, median step {row['step_time_median_s']:.3f} s"
                      + (f"; acted on {a['link']} ({a['detector']}, step {a['detection_step']}): "
                         f"{a['step_time_before_s']:.3f} s before, "
                         f"{a['step_time_after_s'] if a['step_time_after_s'] is None else round(a['step_time_after_s'], 3)} s after"
                         if a else (" (no action)" if kind == "act" else "")), flush=True)
        for l in tb.topo.links:
            tb.set_link(l.name, ber=0.0, checksum="fix")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
