"""`make demo` (until the experiment runner lands): bring up topologies/pair.yaml, move traffic across it,
print what was measured, tear it down."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .net import Testbed
from .topo import Topology

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    topo = Topology.load(ROOT / "topologies" / "pair.yaml", name="demo-pair")
    with Testbed(topo) as tb:
        print(f"up: {topo.name}: h1 {tb.address('h1')} <-> h2 {tb.address('h2')}")
        ping = tb.run("h1", ["ping", "-c", "5", "-i", "0.2", tb.address("h2")])
        print(ping.stdout.strip().splitlines()[-1])
        srv = tb.popen("h2", ["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL)
        time.sleep(0.3)
        r = tb.run("h1", ["iperf3", "-c", tb.address("h2"), "-t", "3", "-J"], timeout=60)
        srv.wait(timeout=10)
        bps = json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"]
        print(f"iperf3 h1 -> h2: {bps / 1e9:.2f} Gbit/s")
    print("down: nothing left behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
