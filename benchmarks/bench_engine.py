"""Benchmark of the corruption engines on a veth between two namespaces (tbE-*), all in one run, side by side:

- TCP throughput without an engine and with each engine (nfqueue: a Python process behind an NFQUEUE rule; bpf:
  the tc program, testbed/engine/bpf) in scopes payload and tensor (checksum fix, GSO) at BER 0, 1e-6, 1e-4,
  measured interleaved in each repetition (the clean run is the reference of the same repetition); medians of the
  per-repetition ratios. The traffic is gloo-framed bulk data (`probe gloo-send`: gloo's handshake, then 1 MiB
  allreduce data frames behind 48-byte headers, one sendmsg each, as gloo's writev), so that scope tensor has
  tensor bytes to corrupt (every payload byte is eligible, the headers are not);
- TCP ping-pong round trips (64-byte messages, gloo-framed: 112 bytes) without an engine and with each engine,
  scope and BER: the engine sits on one direction only, so the RTT difference is its added one-way latency;
- informational: nfqueue with checksum=keep at BER 1e-5 (MTU-sized frames, corrupted ones dropped and
  retransmitted), scope payload;
- realized-BER accuracy: each run at BER > 0 is one epoch of the engine's counters, checked against the exact
  99.9% binomial interval;
- memory per corrupted direction: the nfqueue process's RSS (and PSS), the bpf engine's maps (bpftool's
  memlock figure, kernel memory charged for them; the program itself is shared by every direction).

Scope tensor on bpf draws its flips with the counter function in the kernel (docs/engine.md, "Keyed flips in the
kernel"); on nfqueue with PCG64 (error_model bernoulli, the default) as training runs do.

Prints a table and writes JSON. Run as root from the repository root:

    .venv/bin/python benchmarks/bench_engine.py [--reps 5] [--seconds 3] [--engines nfqueue,bpf]
        [--scopes payload,tensor] [--out F]

Targets: nfqueue (the engine's first brief): BER 0 >= 0.6x clean, BER 1e-4 >= 0.3x, added one-way latency
p50 <= 50 us; bpf (issue 21, scope payload): BER 0 >= 0.9x, BER 1e-6 >= 0.85x, BER 1e-4 >= 0.8x, added one-way
p50 <= 10 us; bpf scope tensor (issue 38): BER 0 >= 0.9x, BER 1e-4 >= 0.8x. Numbers depend on the machine: 2 vCPUs
carry the sender, the receiver and the engine.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the namespace helpers the engine tests use

from engine_fixtures import read_json_line, veth_link  # noqa: E402

from testbed.engine.manager import attach_engine, detach_engine, engine_stats, set_engine  # noqa: E402

BERS = (0.0, 1e-6, 1e-4)
KEEP_BER = 1e-5
BULK_PORT = 5201
PINGPONG_PORT = 5301


def bulk(link, seconds: float, port: int) -> dict:
    """gloo-framed bulk a -> b for `seconds`: the receiver's Gbit/s."""
    rx = link.probe("b", "gloo-recv", "--port", port)
    read_json_line(rx, "listening")
    tx = link.probe("a", "gloo-send", "--host", link.addr["b"], "--port", port, "--seconds", seconds)
    read_json_line(tx, "result", timeout=seconds + 60)
    res = read_json_line(rx, "result", timeout=60)["result"]
    tx.wait(10)
    rx.wait(10)
    return res


def prog_run_time(h) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a bpf engine's program (kernel.bpf_stats_enabled must be 1)."""
    r = subprocess.run(["bpftool", "prog", "show", "pinned", h.bpf["pin_dir"] + "/prog", "-j"],
                       capture_output=True, text=True, check=True)
    d = json.loads(r.stdout)
    return int(d.get("run_time_ns", 0)), int(d.get("run_cnt", 0))


def memory(h) -> dict:
    """What one corrupted direction costs: the engine process's RSS and PSS (nfqueue), or its maps' memlock
    (bpf: kernel memory charged for the maps this direction pinned; no process)."""
    if h.spec.engine == "bpf":
        total, n = 0, 0
        for pin in sorted(Path(h.bpf["pin_dir"]).iterdir()):
            out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(pin)], capture_output=True, text=True)
            if out.returncode == 0:  # the program's pin is not a map
                total += int(json.loads(out.stdout).get("bytes_memlock", 0))
                n += 1
        return {"kind": "bpf maps", "bytes": total, "maps": n}
    with open(f"/proc/{h.pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024
    pss = None
    try:
        with open(f"/proc/{h.pid}/smaps_rollup") as f:
            pss = next(int(l.split()[1]) for l in f if l.startswith("Pss:")) * 1024
    except (OSError, StopIteration):
        pass
    return {"kind": "process", "bytes": rss, "pss_bytes": pss}


def pingpong(link, count: int, port: int) -> dict:
    srv = link.probe("b", "pingpong-server", "--port", port, "--size", 64, "--gloo")
    read_json_line(srv, "listening")
    cli = link.probe("a", "pingpong-client", "--host", link.addr["b"], "--port", port,
                     "--count", count, "--size", 64, "--gloo")
    res = read_json_line(cli, "result", timeout=120)["result"]
    cli.wait(10)
    srv.wait(10)
    return res


def binomial_ok(flips: int, bits: int, ber: float, alpha: float = 0.001) -> bool:
    if ber == 0:
        return flips == 0
    return stats.binom.ppf(alpha / 2, bits, ber) <= flips <= stats.binom.isf(alpha / 2, bits, ber)


class Ports:
    """A fresh port per connection: a listener's port in TIME_WAIT is not reused within the run."""

    def __init__(self, base: int):
        self.n = base

    def __call__(self) -> int:
        self.n += 1
        return self.n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--no-keep", dest="keep", action="store_false",
                    help="skip the informational checksum=keep row (BER 1e-5, MTU-sized frames)")
    ap.add_argument("--engines", default="nfqueue,bpf", help="engines to compare (default nfqueue,bpf)")
    ap.add_argument("--scopes", default="payload,tensor", help="scopes to compare (default payload,tensor)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_engine.json"))
    ap.add_argument("--seed", type=int, default=None,
                    help="the engines' seed (default: a fresh one per run, printed: with a fixed seed every run's "
                         "first epoch at a BER replays the same stretch of the same stream, one sample, not a new one)")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {args.seed}", flush=True)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    scopes = [x.strip() for x in args.scopes.split(",") if x.strip()]
    combos = [(e, sc) for sc in scopes for e in engines]
    name = {c: f"{c[0]} {c[1]}" for c in combos}
    runs: dict[str, list[dict]] = {"clean": [], **{f"{name[c]} ber={b:g}": [] for c in combos for b in BERS}}
    if args.keep and "nfqueue" in engines:
        runs[f"nfqueue keep ber={KEEP_BER:g}"] = []
    accuracy = []
    bulk_port, ping_port = Ports(BULK_PORT), Ports(PINGPONG_PORT)
    with veth_link() as link:
        handles = {}
        for c in combos:
            e, sc = c
            extra = {"peer_netns": link.path["b"], "peer_iface": link.iface} if e == "bpf" else {}
            handles[c] = link.start_engine(ber=0.0, seed=args.seed, scope=sc, checksum="fix", engine=e, **extra)
            detach_engine(handles[c])  # the engine stays; attaching decides whether traffic goes through it
        mem = {name[c]: memory(h) for c, h in handles.items()}
        # the bpf program's own cost per packet (kernel.bpf_stats_enabled: ~20 ns per run; restored after)
        stats_was = Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip()
        Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1")
        atexit.register(Path("/proc/sys/kernel/bpf_stats_enabled").write_text, stats_was)
        lat_rounds = []
        for rep in range(args.reps):
            runs["clean"].append(bulk(link, args.seconds, bulk_port()))
            rnd = {"clean": pingpong(link, args.pings, ping_port())}
            for c, h in handles.items():
                e, sc = c
                attach_engine(h)
                for ber in BERS:
                    set_engine(h, ber=ber)
                    if e == "bpf":
                        t0, before = prog_run_time(h), engine_stats(h)
                    r = bulk(link, args.seconds, bulk_port())
                    if e == "bpf":
                        (ns1, n1), after = prog_run_time(h), engine_stats(h)
                        mod = after["packets_modified"] - before["packets_modified"]
                        r["prog_ns_per_packet"] = (ns1 - t0[0]) / max(n1 - t0[1], 1)
                        r["packets_modified_share"] = mod / max(n1 - t0[1], 1)
                    runs[f"{name[c]} ber={ber:g}"].append(r)
                    ep = engine_stats(h)["epochs"][-1]
                    accuracy.append({"engine": name[c], "ber": ber, "bits": ep["bits_seen"],
                                     "flips": ep["bits_flipped"], "realized": ep["realized_ber"],
                                     "in_99.9%_interval": bool(binomial_ok(ep["bits_flipped"], ep["bits_seen"], ber))})
                    rnd[f"{name[c]} ber={ber:g}"] = pingpong(link, args.pings, ping_port())
                if args.keep and c == ("nfqueue", "payload"):  # informational: MTU-sized frames, drops + retransmits
                    set_engine(h, checksum="keep", ber=KEEP_BER)
                    runs[f"nfqueue keep ber={KEEP_BER:g}"].append(bulk(link, args.seconds, bulk_port()))
                    set_engine(h, checksum="fix", ber=0.0)
                set_engine(h, ber=0.0)
                detach_engine(h)
            lat_rounds.append(rnd)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]['gbit_s']:.2f}" for k, v in runs.items()),
                  flush=True)
        finals = {name[c]: engine_stats(h) for c, h in handles.items()}

    med = statistics.median
    ratios = {k: med(r["gbit_s"] / c["gbit_s"] for r, c in zip(runs[k], runs["clean"])) for k in runs if k != "clean"}
    latency = {"rounds": [{k: {"p50_us": v["rtt_p50_us"], "p99_us": v["rtt_p99_us"]} for k, v in r.items()}
                          for r in lat_rounds],
               "clean_p50_us": med(r["clean"]["rtt_p50_us"] for r in lat_rounds),
               "clean_p99_us": med(r["clean"]["rtt_p99_us"] for r in lat_rounds)}
    for k in lat_rounds[0]:
        if k == "clean":
            continue
        latency[k] = {
            "p50_us": med(r[k]["rtt_p50_us"] for r in lat_rounds),
            "p99_us": med(r[k]["rtt_p99_us"] for r in lat_rounds),
            # the engine sits on one direction only: the added round-trip time is the added one-way latency
            "added_one_way_p50_us": med(r[k]["rtt_p50_us"] - r["clean"]["rtt_p50_us"] for r in lat_rounds),
            "added_one_way_p99_us": med(r[k]["rtt_p99_us"] - r["clean"]["rtt_p99_us"] for r in lat_rounds)}
    targets = {}
    bars = {("nfqueue", "payload"): (0.6, None, 0.3, 50.0), ("bpf", "payload"): (0.9, 0.85, 0.8, 10.0),
            ("bpf", "tensor"): (0.9, None, 0.8, None)}  # bpf payload: issue 21; bpf tensor: issue 38
    for c in combos:
        if c not in bars:
            continue
        b0, b6, b4, lat = bars[c]
        n = name[c]
        targets[f"{n} ber0_ratio>={b0}"] = ratios[f"{n} ber=0"] >= b0
        if b6 is not None:
            targets[f"{n} ber1e-6_ratio>={b6}"] = ratios[f"{n} ber=1e-06"] >= b6
        targets[f"{n} ber1e-4_ratio>={b4}"] = ratios[f"{n} ber=0.0001"] >= b4
        if lat is not None:
            targets[f"{n} added_p50_us<={lat:g}"] = latency[f"{n} ber=0"]["added_one_way_p50_us"] <= lat
    result = {
        "reps": args.reps, "seconds": args.seconds, "engines": engines, "scopes": scopes, "seed": args.seed,
        "traffic": "gloo-framed bulk (probe gloo-send: 1 MiB allreduce data frames), gloo-framed 64-byte ping-pong",
        "throughput_gbit_s_median": {k: med(r["gbit_s"] for r in v) for k, v in runs.items()},
        "ratio_to_clean_median": ratios,
        "bpf_prog_ns_per_packet_median": {k: med(r["prog_ns_per_packet"] for r in v)
                                          for k, v in runs.items() if v and "prog_ns_per_packet" in v[0]},
        "runs": runs, "latency": latency, "ber_accuracy": accuracy,
        "memory_per_direction": mem,
        "engine_final": {n: {k: st.get(k) for k in ("packets", "bytes", "packets_modified", "packets_errors",
                                                    "packets_truncated", "verdict_errors", "flows_desynced",
                                                    "flows_midstream")}
                         for n, st in finals.items()},
        "targets": targets,
    }
    print()
    print(f"{'config':<26} {'Gbit/s':>8} {'x clean':>8} {'p50 us':>8} {'p99 us':>8} {'+1-way p50':>11} {'+1-way p99':>11}")
    for k in runs:
        L = latency.get(k)
        lat = (f"{L['p50_us']:>8.1f} {L['p99_us']:>8.1f} {L['added_one_way_p50_us']:>11.1f} "
               f"{L['added_one_way_p99_us']:>11.1f}") if L else (
            f"{latency['clean_p50_us']:>8.1f} {latency['clean_p99_us']:>8.1f}" if k == "clean" else "")
        print(f"{k:<26} {result['throughput_gbit_s_median'][k]:>8.2f} {ratios.get(k, 1.0):>8.2f} {lat}")
    for k, ns in result["bpf_prog_ns_per_packet_median"].items():
        share = med(r["packets_modified_share"] for r in runs[k])
        print(f"{k}: the program's own time {ns / 1000:.2f} us per packet ({share:.0%} of packets modified)")
    for n, m in mem.items():
        print(f"memory per corrupted direction, {n}: {m['bytes'] / 2**20:.2f} MiB ({m['kind']}"
              + (f", PSS {m['pss_bytes'] / 2**20:.1f} MiB" if m.get("pss_bytes") else "")
              + (f", {m['maps']} maps" if "maps" in m else "") + ")")
    for c in combos:
        for b in BERS[1:]:
            acc = [a for a in accuracy if a["ber"] == b and a["engine"] == name[c]]
            bits = sum(a["bits"] for a in acc)
            flips = sum(a["flips"] for a in acc)
            print(f"{name[c]} BER {b:g}: realized {flips / bits:.4g} over {bits:.3g} bits; "
                  f"{sum(a['in_99.9%_interval'] for a in acc)}/{len(acc)} runs inside the 99.9% binomial interval")
    print("targets:", targets)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
