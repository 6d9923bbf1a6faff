"""Step time of the training workloads on loopback (2 ranks, a few steps), as JSON.

    .venv/bin/python benchmarks/bench_train.py                       # tiny + gpt2-124m, ddp
    .venv/bin/python benchmarks/bench_train.py --models tiny --modes ddp pp --steps 10 --out bench.json
    .venv/bin/python benchmarks/bench_train.py --models tiny small mini gpt2-124m --modes ddp pp \
        --tokens-per-step 512 --seq-len 64 --no-reference          # experiments/scaling.yaml's shape

Each case is a real run through testbed.train.launch.run_workers (workers in their own processes, gloo
over 127.0.0.1). Step time is the median over steps of the slowest rank's step; the first step (one big
DDP bucket, warm-up) is included in the median like any other.
"""

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.train.common import write_json_atomic  # noqa: E402
from testbed.train.launch import local_spawn, loopback_env, run_workers  # noqa: E402
from testbed.fileio import read_jsonl  # noqa: E402

SHAPES = {"tiny": ("8", "64"), "small": ("4", "128"), "mini": ("2", "256"), "gpt2-124m": ("1", "128")}  # batch, seq per rank


def bench(model, mode, steps, world_size, reference, threads, work_dir, tokens_per_step=None, seq_len=None):
    batch, seq = SHAPES[model]
    if tokens_per_step:  # as an experiment's tokens_per_step: DDP's batch per rank, PP's global batch
        seq = str(seq_len or int(seq))
        batch = str(tokens_per_step // int(seq) // (world_size if mode == "ddp" else 1))
    argv = ["--mode", mode, "--model", model, "--steps", str(steps), "--batch-size", batch, "--seq-len", seq,
            "--timeout", "300", "--threads", str(threads), "--no-save-final",
            "--reference" if reference else "--no-reference"]
    if mode == "pp":
        argv += ["--microbatches", str(world_size) if tokens_per_step else batch if int(batch) >= world_size
                 else "1"]
    run_dir = Path(work_dir) / f"{model}-{mode}-{'ref' if reference else 'noref'}"
    t0 = time.monotonic()
    s = run_workers(local_spawn(run_dir), world_size, argv, run_dir, loopback_env(), 1800, 600,
                    log=lambda msg: print(msg, file=sys.stderr, flush=True))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first_row_time = min(r["time"] for r in rows) if rows else None
    return {
        "model": model, "mode": mode, "world_size": world_size, "batch_size": int(batch), "seq_len": int(seq),
        "reference": reference, "threads_per_worker": threads, "steps": steps, "status": s["status"],
        "median_step_time_s": s["median_step_time_s"], "median_comm_time_s": s["median_comm_time_s"],
        "step_times_s": [max(r["step_time_s"] for r in rows if r["step"] == k) for k in range(s["steps_completed"])],
        "startup_s": (first_row_time - s["started_at"]) if first_row_time else None,  # spawn -> first step logged
        "wall_time_s": time.monotonic() - t0, "final_loss": s["final_loss"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "gpt2-124m"], choices=sorted(SHAPES))
    p.add_argument("--modes", nargs="+", default=["ddp"], choices=["ddp", "pp"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--no-reference", action="store_true", help="ddp without the clean reference allreduce")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="tokens per optimizer step for both modes (DDP: per-rank batch = T / (seq x ranks); PP: a "
                        "global batch of T / seq in world-size micro-batches), instead of the model's SHAPES")
    p.add_argument("--seq-len", type=int, default=None, help="with --tokens-per-step: tokens per sequence")
    p.add_argument("--out", default=None, help="also write the JSON here (atomically)")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_train-") as work_dir:
        for model in a.models:
            for mode in a.modes:
                results.append(bench(model, mode, a.steps, a.world_size, not a.no_reference and mode == "ddp",
                                     a.threads, work_dir, a.tokens_per_step, a.seq_len))
    report = {"benchmark": "train_step_time", "host": platform.node(), "python": platform.python_version(),
              "time": time.time(), "results": results}
    if a.out:
        write_json_atomic(a.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
