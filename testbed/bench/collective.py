"""Collective timing over gloo, one process per host (the same env as the training workers: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME).

  python -m testbed.bench.collective --sizes 1024 65536 ... --out result.json

For each message size: allreduce (sum, fp32) and a ring send/recv (each rank sends to rank+1 and receives from
rank-1 at once). Bandwidths as nccl-tests reports them: algbw = bytes / time; allreduce busbw = algbw *
2(n-1)/n (the bytes a ring moves per rank), send/recv busbw = algbw. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _time(fn, budget_s: float, min_iters: int = 3, max_iters: int = 50) -> list[float]:
    fn()  # warm-up: connections, buffers
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or (len(times) < max_iters and time.perf_counter() - start < budget_s):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _agree(iters: int) -> int:
    # Every rank must run the same number of iterations or the collectives deadlock: take rank 0's count.
    n = torch.tensor([iters])
    dist.broadcast(n, 0)
    return int(n)


def run(sizes: list[int], budget_s: float) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for size in sizes:
        n = max(1, size // 4)
        x = torch.ones(n, dtype=torch.float32)
        row: dict = {"bytes": n * 4}

        # Fixed iteration counts agreed up front (timing loops must not diverge between ranks).
        probe = _time(lambda: dist.all_reduce(x), budget_s=0.0, min_iters=1, max_iters=1)
        iters = max(3, min(50, int(budget_s / max(probe[0], 1e-6))))
        iters = _agree(iters)
        t = _time(lambda: dist.all_reduce(x), budget_s=1e9, min_iters=iters, max_iters=iters)
        med = statistics.median(t)
        algbw = n * 4 / med
        row["allreduce"] = {"median_s": med, "p90_s": sorted(t)[int(0.9 * (len(t) - 1))], "iters": len(t),
                            "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * 2 * (world - 1) / world / 1e9}
        if world > 1:
            send, recv = torch.ones(n), torch.empty(n)

            def sendrecv():
                reqs = [dist.isend(send, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
                for r in reqs:
                    r.wait()

            t = _time(sendrecv, budget_s=1e9, min_iters=iters, max_iters=iters)
            med = statistics.median(t)
            row["sendrecv"] = {"median_s": med, "p90_s": sorted(t)[int(0.9 * (len(t) - 1))], "iters": len(t),
                               "algbw_GBps": n * 4 / med / 1e9, "busbw_GBps": n * 4 / med / 1e9}
        results.append(row)
        if rank == 0:
            print(f"{n * 4:>10} B  allreduce {row['allreduce']['median_s'] * 1e3:8.3f} ms  "
                  f"busbw {row['allreduce']['busbw_GBps']:.3f} GB/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", required=True, help="message sizes in bytes")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timing per size and operation")
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        results = run(args.sizes, args.budget)
        if dist.get_rank() == 0:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"world_size": dist.get_world_size(), "results": results,
                           "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}, f, indent=2)
            os.replace(tmp, args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
