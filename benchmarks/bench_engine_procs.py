"""NFQUEUE engine processes: one per host (serving all of the host's corrupted directions) against one per link
direction (docs/engine.md, "Engine processes"). All in one run:

- TCP throughput (bulk flows, payload/fix) on a line h1 - h2 - h3 with BER on every direction, in three copies up at
  once: clean (no engines), `direction` and `host`. Two workloads, both of which load two of h2's directions:
  `forwarded` (one flow h1 -> h3: data leaves h2 towards h3, its ACKs towards h1) and `fan-out` (two flows at
  once, h2 -> h1 and h2 -> h3; their sum). Each repetition measures the clean copy and both modes back to back,
  so each ratio is against a clean veth of the same repetition; medians over the repetitions.
- memory (RSS and PSS of every engine process, and their totals) and `up`/`down` time of a 16-host ring with BER
  on every link (32 corrupted directions), both modes, and with the bpf engine on every link (no process: the
  kernel memory of its maps, bpftool's memlock figure) where it loads.

Prints tables and writes JSON. Run as root from the repository root:

    .venv/bin/python benchmarks/bench_engine_procs.py [--reps 5] [--seconds 3] [--out results/bench_engine_procs.json]

The numbers depend on the machine: on 2 vCPUs iperf3's client and server and the engines share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.procs import read_json_line  # noqa: E402
from testbed.fileio import write_json_atomic  # noqa: E402
from testbed.net import Testbed  # noqa: E402
from testbed.topology.topo import Topology  # noqa: E402

MODES = ("direction", "host")
BERS = (0.0, 1e-4)
PORT = 5401


def line_topology(name: str, ber: float | None) -> Topology:
    link = {"ber": ber, "seed": 1} if ber is not None else {}
    return Topology.from_dict({"name": name, "topology": {
        "nodes": {"h1": {}, "h2": {}, "h3": {}},
        "links": [{"endpoints": ["h1:eth1", "h2:eth1"], **link}, {"endpoints": ["h2:eth2", "h3:eth1"], **link}]}})


def ring_topology(name: str, n: int = 16, ber: float | None = 1e-6, engine: str | None = None) -> Topology:
    hosts = [f"h{i}" for i in range(1, n + 1)]
    extra = {"ber": ber} if ber is not None else {}
    if engine:
        extra["engine"] = engine
    links = [{"endpoints": [f"{hosts[i]}:eth1", f"{hosts[(i + 1) % n]}:eth2"], **extra} for i in range(n)]
    return Topology.from_dict({"name": name, "topology": {"nodes": {h: {} for h in hosts}, "links": links}})


# A bulk TCP flow that corruption cannot break (iperf3's control connection crosses the corrupted link too, and
# at BER 1e-4 a flipped byte in its JSON ends the test): the sink counts bytes from the first to EOF.
SINK = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1); print(json.dumps({"listening": True}), flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = c.recv_into(buf); t0 = time.monotonic()
while True:
    k = c.recv_into(buf)
    if not k:
        break
    n += k
print(json.dumps({"result": {"bytes": n, "gbit_s": n * 8 / (time.monotonic() - t0) / 1e9}}), flush=True)
"""
SOURCE = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = bytes(4 << 20)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(buf)
c.close()
"""


def bulk_flows(tb: Testbed, flows: list[tuple[str, str]], seconds: float) -> float:
    """Run the flows (src, dst) at once; their summed received throughput in Gbit/s."""
    py = tb.runtime.python
    sinks = [tb.popen(dst, [py, "-c", SINK, str(PORT + k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True) for k, (_, dst) in enumerate(flows)]
    sources = []
    try:
        for s in sinks:
            read_json_line(s, "listening")
        sources = [tb.popen(src, [py, "-c", SOURCE, tb.address(dst), str(PORT + k), str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for k, (src, dst) in enumerate(flows)]
        return sum(read_json_line(s, "result", seconds + 60)["result"]["gbit_s"] for s in sinks)
    finally:
        for p in sources + sinks:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)


WORKLOADS = {"forwarded": [("h1", "h3")], "fan-out": [("h2", "h1"), ("h2", "h3")]}


def set_ber(tb: Testbed, ber: float) -> None:
    for link in tb.topo.links:
        tb.set_link(link.name, ber=ber)


def engine_pids(tb: Testbed) -> list[int]:
    return sorted({h.pid for h in tb.engine_handles().values() if h.pid})


def memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in bytes (PSS splits shared pages among the processes sharing them)."""
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


def throughput(args, tag: str) -> dict:
    tbs = {"clean": Testbed(line_topology(f"bepc-{tag}", None))}
    for m in MODES:
        tbs[m] = Testbed(line_topology(f"bep{m[0]}-{tag}", 0.0), engine_procs=m)
    runs: dict = {}
    try:
        for tb in tbs.values():
            tb.up()
        for m in MODES:
            print(f"{m}: {len(tbs[m].engine_handles())} directions, {len(engine_pids(tbs[m]))} engine processes")
        for ber in BERS:
            for m in MODES:
                set_ber(tbs[m], ber)
            for rep in range(args.reps):
                for wl, flows in WORKLOADS.items():
                    # a seeded order per repetition: a machine whose load drifts favours no copy
                    for kind in random.Random(f"{ber}/{rep}/{wl}").sample(list(tbs), len(tbs)):
                        g = bulk_flows(tbs[kind], flows, args.seconds)
                        runs.setdefault(f"{ber:g}/{wl}/{kind}", []).append(g)
                    clean = runs[f"{ber:g}/{wl}/clean"][-1]
                    print(f"  ber {ber:g} rep {rep + 1} {wl:9s} clean {clean:6.2f} Gbit/s  "
                          + "  ".join(f"{m} {runs[f'{ber:g}/{wl}/{m}'][-1] / clean:.2f}x" for m in MODES),
                          flush=True)
        acc = {m: [{k: s.get(k) for k in ("direction", "bits_seen", "bits_flipped", "realized_ber", "queue_dropped",
                                          "user_dropped")} for s in tbs[m].stats()] for m in MODES}
    finally:
        for tb in tbs.values():
            if tb.is_up:
                tb.down(save_stats=False)
    rows = []
    for ber in BERS:
        for wl in WORKLOADS:
            clean = runs[f"{ber:g}/{wl}/clean"]
            row = {"ber": ber, "workload": wl, "clean_gbit_s": statistics.median(clean)}
            for m in MODES:
                got = runs[f"{ber:g}/{wl}/{m}"]
                row[f"{m}_gbit_s"] = statistics.median(got)
                row[f"{m}_ratio"] = statistics.median(g / c for g, c in zip(got, clean))
            row["host_vs_direction"] = statistics.median(
                h / d for h, d in zip(runs[f"{ber:g}/{wl}/host"], runs[f"{ber:g}/{wl}/direction"]))
            rows.append(row)
    return {"rows": rows, "runs": runs, "engines_last_ber": acc}


def bpf_map_bytes(tb: Testbed) -> int:
    """Kernel memory charged for the bpf engines' maps (bpftool's memlock figure of every pinned map)."""
    total = 0
    for h in tb.engine_handles().values():
        if h.spec.engine != "bpf":
            continue
        for pin in Path(h.bpf["pin_dir"]).iterdir():
            r = subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(pin)], capture_output=True, text=True)
            if r.returncode == 0:  # the program's pin is not a map
                total += int(json.loads(r.stdout).get("bytes_memlock", 0))
    return total


def ring(args, tag: str) -> dict:
    """Both modes, the bpf engine (no process: its maps' memory), and the same ring without BER (no engines:
    what `up` costs without them)."""
    from testbed.engine.bpf.engine import available

    out = {}
    kinds = ("no engines", *MODES) + (("bpf",) if available()[0] else ())
    for m in kinds:
        ber = None if m == "no engines" else 1e-6
        tb = Testbed(ring_topology(f"bepr{m[0]}-{tag}", ber=ber, engine="bpf" if m == "bpf" else None),
                     engine_procs=m if m in MODES else None)
        t0 = time.monotonic()
        tb.up()
        up_s = time.monotonic() - t0
        try:
            time.sleep(1.0)  # engines settled (first stats written)
            pids = engine_pids(tb)
            mem = {pid: memory(pid) for pid in pids}
            directions = len(tb.engine_handles())
            maps = bpf_map_bytes(tb)
        finally:
            t0 = time.monotonic()
            tb.down(save_stats=False)
            down_s = time.monotonic() - t0
        rss = [r for r, _ in mem.values()]
        pss = [p for _, p in mem.values()]
        out[m] = {"directions": directions, "processes": len(pids), "up_s": up_s, "down_s": down_s,
                  "rss_per_process_mb": statistics.median(rss) / 1e6 if rss else 0.0, "rss_total_mb": sum(rss) / 1e6,
                  "pss_total_mb": sum(pss) / 1e6, "rss_per_direction_mb": sum(rss) / 1e6 / max(directions, 1),
                  "bpf_maps_mb": maps / 1e6}
        print(f"ring16 {m}: {directions} directions, {len(pids)} processes, up {up_s:.1f} s, down {down_s:.1f} s, "
              f"RSS {out[m]['rss_per_process_mb']:.1f} MB per process, {out[m]['rss_total_mb']:.0f} MB total "
              f"(PSS {out[m]['pss_total_mb']:.0f} MB)" + (f", bpf maps {maps / 1e6:.1f} MB" if maps else ""), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="repetitions of every throughput measurement (default 5)")
    p.add_argument("--seconds", type=float, default=3.0, help="iperf3 duration per measurement (default 3)")
    p.add_argument("--out", default="results/bench_engine_procs.json", help="JSON output file")
    p.add_argument("--skip-throughput", action="store_true", help="only the 16-host ring (memory, up time)")
    p.add_argument("--skip-ring", action="store_true", help="only the throughput")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 2
    tag = f"{os.getpid() % 100000}"
    doc = {"started_at": time.time(), "reps": args.reps, "seconds": args.seconds, "cpus": os.cpu_count(),
           "uname": " ".join(os.uname()), "load_before": os.getloadavg()}
    doc["ring16"] = {} if args.skip_ring else ring(args, tag)
    if not args.skip_throughput:
        doc["throughput"] = throughput(args, tag)
    doc["load_after"] = os.getloadavg()
    print("\nring of 16 hosts, BER on every link (32 corrupted directions; `no engines`: the ring without BER)")
    print(f"{'mode':12s} {'procs':>5s} {'up s':>6s} {'down s':>6s} {'RSS/proc MB':>11s} {'RSS total MB':>12s} "
          f"{'PSS total MB':>12s} {'bpf maps MB':>11s}")
    for m, r in doc["ring16"].items():
        print(f"{m:12s} {r['processes']:5d} {r['up_s']:6.1f} {r['down_s']:6.1f} {r['rss_per_process_mb']:11.1f} "
              f"{r['rss_total_mb']:12.0f} {r['pss_total_mb']:12.0f} {r.get('bpf_maps_mb', 0):11.1f}")
    if "throughput" in doc:
        print(f"\nTCP throughput on h1 - h2 - h3, medians of {args.reps} repetitions ({args.seconds:g} s each); "
              "ratio = against the clean line of the same repetition")
        print(f"{'ber':>6s} {'workload':10s} {'clean Gbit/s':>12s} " + " ".join(f"{m + ' x':>12s}" for m in MODES)
              + f" {'host/direction':>14s}")
        for r in doc["throughput"]["rows"]:
            print(f"{r['ber']:6g} {r['workload']:10s} {r['clean_gbit_s']:12.2f} "
                  + " ".join(f"{r[m + '_ratio']:12.2f}" for m in MODES) + f" {r['host_vs_direction']:14.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, doc)
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
