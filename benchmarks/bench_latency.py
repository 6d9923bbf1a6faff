"""Retransmission (checksum keep) against delivered errors (checksum fix): TCP ping-pong RTT over the pair
topology's link for no engine, BER 0, and fix/keep at each BER, plus gloo collective timing on pair. A thin
wrapper of testbed.bench.commands (`testbed bench latency` / `testbed bench collective`).

    .venv/bin/python benchmarks/bench_latency.py [--repeat 3] [--count 500] [--bers 0,1e-6,1e-5]
                                                 [--out results/bench_latency]

Run as root from the repository root. Writes OUT/latency.json and OUT/collective.json and prints the tables.
With --repeat R the fixed sequence of configurations runs R times (interleaved) and percentiles pool all
samples; the per-repetition figures are in latency.json ("repeats").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.bench.commands import (collective_table, latency_table, measure_collective,  # noqa: E402
                                       measure_latency)
from testbed.topology.topo import Topology  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default=str(ROOT / "topologies" / "pair.yaml"))
    ap.add_argument("--bers", default="0,1e-6,1e-5")
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--sizes", default="1K..16M", help="collective message sizes")
    ap.add_argument("--no-collective", dest="collective", action="store_false")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_latency"))
    args = ap.parse_args()

    def log(m):
        print(m, file=sys.stderr, flush=True)

    name = f"benchlat{os.getpid() % 100000}"
    topo = Topology.load(args.topology, name=name)
    doc = measure_latency(topo, None, args.bers.split(","), args.size, args.count, log, repeat=args.repeat,
                          out=args.out)
    print(latency_table(doc))
    if args.collective:
        col = measure_collective(Topology.load(args.topology, name=name), args.sizes, log=log, out=args.out)
        print()
        print(collective_table(col))
    print(f"\nwritten: {args.out}/latency.json" + (", collective.json" if args.collective else ""))
    return 1 if any(r.get("errors") for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
