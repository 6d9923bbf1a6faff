#!/usr/bin/env python3
"""Time `up` + `down` of star8 and of a 32-host star (median of several runs), and, when Debian's mininet is
installed (apt-get install mininet bridge-utils), the same star built by Mininet with Linux bridges in the
same run, as a reference. Mininet creates its switch and interfaces in the root namespace; the testbed keeps
everything inside its own namespaces.

    .venv/bin/python benchmarks/bench_topology.py [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.net import Testbed  # noqa: E402
from testbed.topology.topo import Topology  # noqa: E402


def star(n: int, name: str) -> Topology:
    nodes = {"s1": {"kind": "switch"}, **{f"h{i}": {} for i in range(1, n + 1)}}
    links = [{"endpoints": [f"h{i}:eth1", f"s1:p{i}"]} for i in range(1, n + 1)]
    return Topology.from_dict({"name": name, "topology": {"nodes": nodes, "links": links}})


def time_testbed(n: int, runs: int) -> dict:
    ups, downs = [], []
    for r in range(runs):
        tb = Testbed(star(n, f"bench{n}-{r}"))
        t0 = time.perf_counter()
        tb.up()
        t1 = time.perf_counter()
        tb.down(save_stats=False)
        t2 = time.perf_counter()
        ups.append(t1 - t0)
        downs.append(t2 - t1)
    return {"up_s": statistics.median(ups), "down_s": statistics.median(downs),
            "total_s": statistics.median(u + d for u, d in zip(ups, downs)), "runs": runs}


MININET_SCRIPT = """
import sys, time
from mininet.net import Mininet
from mininet.topo import SingleSwitchTopo
from mininet.nodelib import LinuxBridge
from mininet.clean import cleanup
n = int(sys.argv[1])
t0 = time.perf_counter()
net = Mininet(topo=SingleSwitchTopo(n), switch=LinuxBridge, controller=None, autoSetMacs=True)
net.start()
t1 = time.perf_counter()
net.stop()
t2 = time.perf_counter()
print("RESULT", t1 - t0, t2 - t1)
"""


def time_mininet(n: int, runs: int) -> dict | None:
    if shutil.which("mn") is None:
        return None
    ups, downs = [], []
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(MININET_SCRIPT)
    for _ in range(runs):
        # Debian's mininet runs under the system python3.
        r = subprocess.run(["/usr/bin/python3", f.name, str(n)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed"}
        line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
        u, d = map(float, line.split()[1:3])
        ups.append(u)
        downs.append(d)
    # No `mn -c` afterwards: net.stop() removed what the run made, and `mn -c` kills every `ping` (and other
    # tools) on the machine and empties /tmp/*.log, others' as well. After a failed run, clean up by hand.
    return {"up_s": statistics.median(ups), "down_s": statistics.median(downs),
            "total_s": statistics.median(u + d for u, d in zip(ups, downs)), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    results = {}
    for n in args.sizes:
        results[f"testbed_star{n}"] = time_testbed(n, args.runs)
        mn = time_mininet(n, args.runs)
        if mn is not None:
            results[f"mininet_star{n}"] = mn
    print(f"{'what':<18} {'up (s)':>8} {'down (s)':>9} {'total (s)':>10}   median of {args.runs} runs")
    for k, v in results.items():
        if "error" in v:
            print(f"{k:<18} error: {v['error']}")
        else:
            print(f"{k:<18} {v['up_s']:>8.2f} {v['down_s']:>9.2f} {v['total_s']:>10.2f}")
    for n in args.sizes:
        a, b = results.get(f"testbed_star{n}"), results.get(f"mininet_star{n}")
        if a and b and "error" not in b:
            print(f"star{n}: testbed/mininet total time ratio {a['total_s'] / b['total_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
