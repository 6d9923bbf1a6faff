"""Training through each corruption path, side by side in one run: DDP on topologies/pair.yaml at a BER in scope
tensor, with the bpf engine (gloo's tensor bytes corrupted in the kernel, docs/engine.md "Keyed flips in the
kernel"), the NFQUEUE engine (the same in a Python process per host) and the process injector (the same errors
applied inside the workers, no wire; docs/experiments.md).

    .venv/bin/python benchmarks/bench_wire_train.py [--models tiny small] [--arms bpf nfqueue process]
        [--steps 30] [--reps 5] [--ber 1e-5] [--out F]
    .venv/bin/python benchmarks/bench_wire_train.py --models gpt2-124m --arms bpf process --steps 20 --reps 1 \
        --ber 1e-10 --batch-size 1 --seq-len 128          # GPT-2 124M on the wire

Each wire arm brings its topology up once (engines at BER 0, scope tensor, engine of the arm) and trains every
repetition on it (as `testbed train NAME` does); repetitions interleave the arms (the machine's drift falls on all).
Per run: the step time (the summary's median_step_time_s: over steps, the slowest rank's, the first included), the run's
wall time (`wall_s`, the controller's; `wall_time_s`, the workers' from the summary), lost (skipped) steps, flips.
Per model and arm: medians over repetitions, and each arm's ratio to the process injector in the same repetition.
Run as root from the repository root; writes JSON (atomically) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.experiments.training import train  # noqa: E402
from testbed.fileio import write_json_atomic  # noqa: E402
from testbed.net import Testbed, teardown  # noqa: E402
from testbed.topology.topo import Topology  # noqa: E402
from testbed.train.settings import TrainSettings  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--arms", nargs="+", default=["bpf", "nfqueue", "process"], choices=["bpf", "nfqueue", "process"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ber", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--topology", default=str(ROOT / "topologies" / "pair.yaml"))
    p.add_argument("--out", default=str(ROOT / "results" / "bench_wire_train.json"))
    a = p.parse_args()

    file_topo = Topology.load(a.topology)
    rows = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="tbwt-") as tmp:
        names = {}
        for arm in a.arms:
            if arm == "process":
                continue
            topo = Topology.load(a.topology, name=f"wt{arm}{int(time.time()) % 10000}").with_overrides(
                ber=0.0, scope="tensor", engine=arm)
            Testbed(topo).up()
            stack.callback(teardown, topo.name, save_stats=False)
            names[arm] = topo.name
        for rep in range(a.reps):
            for model in a.models:
                for arm in a.arms:
                    cfg = TrainSettings(mode="ddp", model=model, steps=a.steps, seed=rep + 1, batch_size=a.batch_size,
                                        seq_len=a.seq_len, timeout=600, stall_timeout=900, run_timeout=7200,
                                        injector="process" if arm == "process" else "wire")
                    out = Path(tmp) / f"{model}-{arm}-{rep}"
                    t0 = time.time()
                    s = train(file_topo if arm == "process" else names[arm], cfg, out, ber=a.ber, scope="tensor",
                              log=lambda m: None)
                    wall = time.time() - t0
                    row = {"model": model, "arm": arm, "rep": rep, "status": s.get("status"),
                           "steps_completed": s.get("steps_completed"), "skipped_steps": s.get("skipped_steps"),
                           "bits_seen": s.get("bits_seen"), "bits_flipped": s.get("bits_flipped"),
                           "step_time_s": s.get("median_step_time_s"), "wall_s": wall,
                           "wall_time_s": s.get("wall_time_s"), "final_loss": s.get("final_loss"), "engines": [e.get("engine") for e in s.get("engines", [])]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    med = statistics.median
    table = {}
    for model in a.models:
        for arm in a.arms:
            rs = [r for r in rows if r["model"] == model and r["arm"] == arm and r["step_time_s"] is not None]
            if not rs:
                continue
            d = {"step_time_s": med(r["step_time_s"] for r in rs), "wall_s": med(r["wall_s"] for r in rs),
                 "runs": len(rs), "ok": sum(r["status"] == "ok" for r in rs),
                 "skipped_steps": [r["skipped_steps"] for r in rs], "bits_flipped": [r["bits_flipped"] for r in rs]}
            if "process" in a.arms and arm != "process":
                pairs = [(r, q) for r in rs for q in rows if q["model"] == model and q["arm"] == "process"
                         and q["rep"] == r["rep"] and q["step_time_s"]]
                if pairs:
                    d["step_time_x_process"] = med(r["step_time_s"] / q["step_time_s"] for r, q in pairs)
            table[f"{model} {arm}"] = d
    result = {"ber": a.ber, "steps": a.steps, "reps": a.reps, "batch_size": a.batch_size, "seq_len": a.seq_len,
              "topology": a.topology, "table": table, "rows": rows}
    print(f"\n{'model arm':<22} {'step s':>8} {'x process':>10} {'wall s':>8} {'ok':>4} skipped steps / flips")
    for k, d in table.items():
        x = d.get("step_time_x_process")
        print(f"{k:<22} {d['step_time_s']:>8.3f} {x if x is None else round(x, 2)!s:>10} {d['wall_s']:>8.1f} "
              f"{d['ok']:>2}/{d['runs']} {d['skipped_steps']} / {d['bits_flipped']}")
    write_json_atomic(Path(a.out), result)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
