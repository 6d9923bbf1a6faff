"""The floor under the bpf engine's scope tensor at a BER where every packet is flipped (issue 38's bar: 0.8x of a
clean veth at 1e-4): what the program costs when it computes every flip but writes none, when it also makes each
flipped packet linear and private as a write needs (the copy), and in full. Each variant is the same flip.c built
with a benchmark-only define (testbed/engine/bpf/build.py, TESTBED_BPF_FLOOR) and measured by bench_engine.py
(bpf, scope tensor, its own clean reference in each repetition), one variant after the other, --rounds times.

    .venv/bin/python benchmarks/bench_bpf_floor.py [--reps 5] [--seconds 2] [--rounds 2] [--out F]

A TCP packet the stack hands to tc is a clone whose payload pages the retransmission queue shares: a program can
change a byte only after bpf_skb_pull_data (or a store helper) copied the packet up to it. At 1e-4 a 64 KB packet
holds ~52 flips, so every packet is copied up to its last flip: that copy, not the flips, bounds the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (("compute", "flips computed and counted, nothing written"),
            ("copy", "computed, and each flipped packet copied (linear, private) up to its last flip"),
            ("", "the engine as shipped: computed, copied, written"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2, help="each variant's bench_engine runs, interleaved")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_bpf_floor.json"))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tbfloor-") as tmp:
        for rnd in range(a.rounds):
            for var, what in VARIANTS:
                out = Path(tmp) / f"{var or 'full'}-{rnd}.json"
                env = dict(os.environ, TESTBED_BPF_FLOOR=var)
                subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--engines", "bpf",
                                "--scopes", "tensor", "--reps", str(a.reps), "--seconds", str(a.seconds), "--no-keep",
                                "--pings", "300", "--out", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
                d = json.loads(out.read_text())
                for ber in ("0", "1e-06", "0.0001"):
                    k = f"bpf tensor ber={ber}"
                    rows.append({"variant": var or "full", "what": what, "round": rnd, "ber": float(ber),
                                 "ratio": d["ratio_to_clean_median"][k],
                                 "gbit_s": d["throughput_gbit_s_median"][k],
                                 "clean_gbit_s": d["throughput_gbit_s_median"]["clean"],
                                 "prog_us_per_packet": d["bpf_prog_ns_per_packet_median"][k] / 1000})
                print(json.dumps(rows[-1]), flush=True)
    med = statistics.median
    table = {}
    for var, what in VARIANTS:
        for ber in (0.0, 1e-6, 1e-4):
            rs = [r for r in rows if r["variant"] == (var or "full") and r["ber"] == ber]
            table[f"{var or 'full'} ber={ber:g}"] = {"what": what, "ratio": med(r["ratio"] for r in rs),
                                                     "prog_us_per_packet": med(r["prog_us_per_packet"] for r in rs),
                                                     "runs": len(rs)}
    print(f"\n{'variant':<22} {'x clean':>8} {'program us/packet':>18}")
    for k, v in table.items():
        print(f"{k:<22} {v['ratio']:>8.2f} {v['prog_us_per_packet']:>18.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"reps": a.reps, "seconds": a.seconds, "rounds": a.rounds, "table": table,
                                       "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
