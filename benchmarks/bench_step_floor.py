"""The floor under a training point's work: one rank's step of tiny GPT-2 alone in one process, one thread, no
network, no other process (what a warm point can never go below), against what bench_sweep's 3x bar needs.

A warm point costs its work plus a small rest; a cold one the same work plus the cold rest (topology, imports,
the first DDP or pipeline build). cold / warm >= 3 needs work <= (cold rest - 3 x warm rest) / 2. This script
measures the compute that bounds the work from below: forward, backward, global-norm clipping and AdamW of one
DDP rank's batch (4 x 64 tokens of calibrate.yaml's 512 per step over 2 ranks), with the recipe's optimizer and
clipping (testbed/train/recipe.py), medians over --steps steps after a warm-up, --reps times. Run from the
repository root:

    .venv/bin/python benchmarks/bench_step_floor.py [--model tiny] [--batch 4] [--seq-len 64] [--steps 100]
        [--cold-rest 2.94] [--warm-rest 0.24] [--evals 0.16 --fingerprints 0.14]

The defaults of --cold-rest, --warm-rest, --evals and --fingerprints are bench_sweep's medians for wire DDP
(docs/experiments.md, "Warm and cold points"); pass your own run's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from testbed.train import recipe  # noqa: E402
from testbed.train.model import PRESETS, build_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (one DDP rank's)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="steps per repetition (the point's step count)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-rest", type=float, default=2.94, help="s a cold point spends beyond its work")
    p.add_argument("--warm-rest", type=float, default=0.24, help="s a warm point spends beyond its work")
    p.add_argument("--evals", type=float, default=0.16, help="s of evals per point (part of the work)")
    p.add_argument("--fingerprints", type=float, default=0.14, help="s of fingerprints per point (work)")
    a = p.parse_args()
    torch.set_num_threads(1)  # as the workers (TESTBED_TORCH_THREADS, default 1)
    settings = SimpleNamespace(optimizer="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                               momentum=0.9, clip="norm", grad_clip=1.0)
    model = build_model(a.model, 1)
    opt = recipe.make_optimizer(model.parameters(), settings)
    vocab = PRESETS[a.model].vocab_size
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, vocab, (a.batch, a.seq_len), generator=g) for _ in range(2))
    params = list(model.parameters())

    def step() -> tuple[float, ...]:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        norm = torch.nn.utils.get_total_norm([q.grad for q in params])
        recipe.clip_(params, settings, norm)
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    for _ in range(20):
        step()
    per_rep = []
    for rep in range(a.reps):
        times = [step() for _ in range(a.steps)]
        parts = [statistics.median(c) for c in zip(*times)]
        per_rep.append((sum(sum(t) for t in times), parts))
        print(f"rep {rep + 1}: {a.steps} steps {per_rep[-1][0]:.3f} s; median ms forward {parts[0] * 1e3:.2f}, "
              f"backward {parts[1] * 1e3:.2f}, clip {parts[2] * 1e3:.2f}, AdamW {parts[3] * 1e3:.2f}")
    floor = statistics.median(s for s, _ in per_rep)
    work = floor + a.evals + a.fingerprints
    need = (a.cold_rest - 3 * a.warm_rest) / 2
    best = (a.cold_rest + work) / (a.warm_rest + work)
    print(f"\nfloor of {a.steps} steps: {floor:.3f} s (median of {a.reps}); with evals and fingerprints {work:.3f} s")
    print(f"3x needs work <= ({a.cold_rest} - 3 x {a.warm_rest}) / 2 = {need:.3f} s; "
          f"at the floor cold / warm is at most {best:.2f}x")


if __name__ == "__main__":
    main()
