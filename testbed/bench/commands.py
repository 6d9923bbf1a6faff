"""Latency and collective benchmarks over a testbed's real sockets: `testbed bench latency` and
`testbed bench collective`, and the functions the experiment runner calls.

    doc = measure_latency(Topology.load("topologies/pair.yaml"), None, [0, 1e-6, 1e-5], 16384, 500, print)
    doc = measure_collective("ring4", sizes=[1024, 1 << 20], log=print)   # a topology that is up

Latency: TCP ping-pong (testbed.bench.probe) between the two end hosts of one link, the client on the link's
first endpoint, the server on its second, addressed by the server's address *on that link* (so the round trips
cross this link and no other). Configurations, always in this order:

    no engine        the clean veth (no NFQUEUE rule on the link)
    engine ber 0     engines on both directions, BER 0, checksum fix (the engine's own cost, GSO packets)
    engine ber 0 keep   BER 0, checksum keep: the engine's cost with MTU-sized frames (what keep runs with)
    ber B fix        for each BER B > 0 (ascending): corrupted bytes delivered, no retransmission
    ber B keep       the same BER, corrupted frames dropped by the receiver, TCP retransmits

Engines are changed live (`BaseTestbed.set_link`, both directions, scope payload); a direction without one gets one
started. Every configuration uses a fresh TCP connection, the same message size and count, and the same few
in-connection warm-up round trips (not timed); one discarded warm-up run precedes the first configuration.
Per configuration the engines' counters (bits flipped) and the hosts' /proc/net/snmp and /proc/net/netstat
(retransmitted segments, checksum drops, RTOs, tail-loss probes) are read before and after.

A topology given as a Topology (or YAML path on the command line) is brought up for the measurement without any
engine on the measured link and taken down after. A topology that is up (a BaseTestbed or its name) is left as it
was found: engines the benchmark started are stopped, the settings of engines it changed are restored, and
for "no engine" existing engines are detached (their NFQUEUE rule removed) only while that configuration runs.

Why 16 KB messages by default: a round trip carries 2 x 16384 x 8 = 262,144 bits, so at BER 1e-6 about 0.26
flips are expected per round trip (23% of round trips hit; ~130 flips in 500 round trips = 131 Mbit) and at
1e-5 about 2.6 (93% hit). A 64-byte message would see ~0.5 flips in 500 round trips at 1e-6: nothing to
measure. 16 KB is also more than one MSS (12 segments at MTU 1500), so a lost segment is usually recovered by
SACK/RACK or a tail-loss probe, as in bulk transfers, rather than only by the 200 ms minimum RTO that a
one-segment message would wait for.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from testbed import testbeds
from testbed.base import BaseTestbed
from testbed.errors import EXIT_CAPABILITY, EXIT_INPUT, CliError
from testbed.engine.counters import counter_delta
from testbed.engine.registry import engine_choices
from testbed.net import text_table
from testbed.runtime.base import RuntimeUnavailable, runtime_names
from testbed.state import write_json_atomic
from testbed.topology.topo import Link, Topology, TopologyError
from testbed.vocab import CHECKSUM_MODES, LATENCY_BERS, SCOPES

DEFAULT_BERS = LATENCY_BERS
DEFAULT_SIZE = 16384
DEFAULT_COUNT = 500
DEFAULT_WARMUP = 20  # untimed round trips at the start of every connection
PINGPONG_PORT = 7301
DEFAULT_COLLECTIVE_SIZES = "1K..64M"
COLLECTIVE_TENSOR_FILTER = ["allreduce", "p2p"]  # the timed traffic; never the broadcast that agrees iterations
SNMP_FIELDS = {  # name in latency.json -> (table, counter)
    "retrans_segs": ("Tcp", "RetransSegs"),
    "in_csum_errors": ("Tcp", "InCsumErrors"),
    "rto_timeouts": ("TcpExt", "TCPTimeouts"),
    "loss_probes": ("TcpExt", "TCPLossProbes"),
}
ENGINE_FIELDS = ("bits_seen", "bits_flipped", "packets", "packets_modified", "retransmitted_bits",
                 "retransmitted_flips")

Log = Callable[[str], None]


class BenchError(ValueError):
    """Bad input: an unknown link, a link that does not join two hosts, bad sizes or BERs."""


def _quiet(_msg: str) -> None:
    pass


# -- shared plumbing -----------------------------------------------------------------------------------------


def resolve_link(topo: Topology, name: str | None) -> Link:
    """The link to measure (default: the first), which must join two hosts."""
    if not topo.links:
        raise BenchError(f"topology {topo.name!r} has no links")
    if name is None:
        link = topo.links[0]
    else:
        try:
            link = topo.link(name)
        except KeyError as e:
            raise BenchError(e.args[0]) from None
    switches = [ep.node for ep in (link.a, link.b) if topo.nodes[ep.node].kind != "host"]
    if switches:
        hostlinks = [l.name for l in topo.links if all(topo.nodes[e.node].kind == "host" for e in (l.a, l.b))]
        raise BenchError(f"link {link.name} ends at switch {', '.join(switches)}: the ping-pong runs between the "
                         f"link's two end hosts, so both ends must be hosts (links between two hosts: "
                         f"{', '.join(hostlinks) or 'none'})")
    return link


def link_address(topo: Topology, link: Link, host: str) -> str:
    """`host`'s address on `link` (not its first data address: that may sit on another link)."""
    for hi in topo.plan.interfaces[host]:
        if hi.link == link.name:
            return str(hi.address.ip)
    raise BenchError(f"host {host} has no address on link {link.name}")


def _engine_delta(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """ENGINE_FIELDS summed over every engine of two `BaseTestbed.counters()` snapshots, and which died."""
    per_engine = counter_delta(before, after, ENGINE_FIELDS)
    d: dict[str, Any] = {f: sum(e[f] for e in per_engine.values()) for f in ENGINE_FIELDS}
    d["engines_alive"] = all(e["alive"] for e in per_engine.values())
    d["dead_engines"] = sorted(k for k, e in per_engine.items() if not e["alive"])
    return d


def _snmp(tb: BaseTestbed, host: str) -> dict[str, int]:
    """TCP counters of `host`'s network namespace (read inside it: /proc/net is per namespace)."""
    r = tb.run(host, ["cat", "/proc/net/snmp", "/proc/net/netstat"], timeout=30)
    if r.returncode != 0:
        return {}
    tables: dict[str, list[list[str]]] = {}
    for line in r.stdout.splitlines():
        head, _, rest = line.partition(":")
        tables.setdefault(head, []).append(rest.split())
    out = {}
    for name, (table, counter) in SNMP_FIELDS.items():
        rows = tables.get(table, [])
        if len(rows) >= 2 and counter in rows[0]:
            out[name] = int(rows[1][rows[0].index(counter)])
    return out


def _snmp_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name in SNMP_FIELDS:
        vals = [after[h][name] - before[h][name] for h in after if name in after[h] and name in before.get(h, {})]
        out[name] = sum(vals) if vals else None
    return out


@contextmanager
def _open(target: "BaseTestbed | Topology | str", *, runtime: str | None, name: str | None, out: Path | None,
          links: set[str], prepare: Callable[[Topology], Topology] | None = None, log: Log,
          machines=None) -> Iterator[BaseTestbed]:
    """A running testbed for `target`: a Topology is brought up (after `prepare`; across the machines of the
    inventory `machines`, if given) and down after; a testbed or the name of a topology that is up is used as it
    is and its `links`' engines are put back afterwards."""
    if isinstance(target, Topology):
        topo = target
        if name or runtime:
            topo = topo.with_overrides(name=name, runtime=runtime)
        if prepare is not None:
            topo = prepare(topo)
        with testbeds.create(topo, machines, runtime=runtime, results_dir=out, log=log) as tb:
            yield tb
        return
    tb = _attached(target)
    try:
        if not tb.is_up:
            raise BenchError(f"topology {tb.name} is not up")
        with tb.links_restored(links, warn=lambda msg: log(f"warning: {msg}")):
            yield tb
    finally:
        if tb is not target:
            tb.close()


def _attached(target: "BaseTestbed | str") -> BaseTestbed:
    """The testbed of `target`: itself, or that of the topology of that name that is up."""
    if isinstance(target, BaseTestbed):
        return target
    if isinstance(target, str):
        try:
            return testbeds.attach(target)
        except LookupError:
            raise BenchError(f"{target!r} is neither a topology file nor the name of a topology that is up "
                             "(testbed status lists those)") from None
    raise TypeError("target must be a testbed, a Topology or the name of a topology that is up")


def _topology_of(target) -> Topology:
    if isinstance(target, Topology):
        return target
    tb = _attached(target)  # the state file's topology, checked like every attach
    if tb is not target:
        tb.close()
    return tb.topo


def _without_ber(topo: Topology, link_name: str) -> Topology:
    """The topology with no corruption engine on one link (so 'no engine' can be measured first)."""
    raw = copy.deepcopy(topo.raw)
    idx = [l.name for l in topo.links].index(link_name)
    entry = raw["topology"]["links"][idx]
    changed = entry.pop("ber", None) is not None
    for d in (entry.get("directions") or {}).values():
        if isinstance(d, dict):
            changed |= d.pop("ber", None) is not None
    return Topology.from_dict(raw, file=topo.file) if changed else topo


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    try:
        p.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def _g(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


# -- latency -------------------------------------------------------------------------------------------------


def latency_configurations(bers) -> list[dict]:
    """The fixed order: no engine, engine BER 0 (fix, then keep), then each BER > 0 ascending, fix then keep."""
    cfgs = [{"label": "no engine", "engine": False, "ber": 0.0, "checksum": None},
            {"label": "engine ber 0", "engine": True, "ber": 0.0, "checksum": "fix"},
            {"label": "engine ber 0 keep", "engine": True, "ber": 0.0, "checksum": "keep"}]
    for b in sorted({float(b) for b in bers if float(b) > 0}):
        for cs in CHECKSUM_MODES:
            cfgs.append({"label": f"ber {b:g} {cs}", "engine": True, "ber": b, "checksum": cs})
    return cfgs


def _one_of(names) -> str:
    """'a, b or c': the allowed values, for an error message."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _check_bers(bers) -> list[float]:
    from testbed.topology.units import parse_probability
    out = []
    for b in bers:
        try:
            out.append(parse_probability(b, upper=0.5))
        except ValueError as e:
            raise BenchError(f"BER {b!r}: {e}") from None
    return out


def _pingpong(tb: BaseTestbed, client: str, server: str, addr: str, size: int, count: int, warmup: int,
              port: int) -> dict:
    py = tb.runtime.python
    srv = tb.popen(server, [py, "-m", "testbed.bench.probe", "pingpong-server", "--port", str(port),
                            "--size", str(size)],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        tb.read_json_line(srv, "listening", timeout=60)
        argv = [py, "-m", "testbed.bench.probe", "pingpong-client", "--host", addr, "--port", str(port),
                "--count", str(count), "--size", str(size), "--warmup", str(warmup)]
        t0 = time.monotonic()
        r = tb.run(client, argv, timeout=120 + count * 0.5)
        seconds = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"ping-pong client exited with {r.returncode}: {r.stderr.strip()[-1500:]}")
        res = None
        for line in r.stdout.splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "result" in obj:
                res = obj["result"]
        if res is None:
            raise RuntimeError(f"ping-pong client printed no result: {r.stdout[-500:]} {r.stderr[-500:]}")
        res["seconds"] = seconds
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return res
    finally:
        _stop(srv)


def _percentiles(samples: list[float]) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {k: None for k in ("p50_us", "p90_us", "p99_us", "p999_us", "mean_us", "max_us")}
    return {"p50_us": float(np.percentile(a, 50)), "p90_us": float(np.percentile(a, 90)),
            "p99_us": float(np.percentile(a, 99)), "p999_us": float(np.percentile(a, 99.9)),
            "mean_us": float(a.mean()), "max_us": float(a.max())}


def latency_headline(results: list[dict]) -> list[dict]:
    """Per BER > 0: keep against fix (p50, p99, mean ratios; extra mean time per round trip)."""
    by = {(r["ber"], r["checksum"]): r for r in results if r.get("engine")}
    keep0 = by.get((0.0, "keep"))
    rows = []
    for (ber, cs), fix in sorted(by.items()):
        if ber <= 0 or cs != "fix" or (ber, "keep") not in by:
            continue
        keep = by[(ber, "keep")]

        def ratio(k, a=keep, b=fix):
            return a[k] / b[k] if a.get(k) and b.get(k) else None

        row = {"ber": ber, "p50_ratio": ratio("p50_us"), "p99_ratio": ratio("p99_us"),
               "p999_ratio": ratio("p999_us"), "mean_ratio": ratio("mean_us"),
               "keep_minus_fix_mean_us": (keep["mean_us"] - fix["mean_us"])
               if keep.get("mean_us") is not None and fix.get("mean_us") is not None else None,
               "keep_retrans_segs": keep.get("retrans_segs"), "fix_retrans_segs": fix.get("retrans_segs"),
               "fix_bits_flipped": fix.get("bits_flipped"), "keep_bits_flipped": keep.get("bits_flipped")}
        if keep0 is not None:
            row["keep_vs_keep0_p99_ratio"] = ratio("p99_us", keep, keep0)
            row["keep_vs_keep0_mean_ratio"] = ratio("mean_us", keep, keep0)
        rows.append(row)
    return rows


def measure_latency(tb_or_topology: "BaseTestbed | Topology | str", link: str | None = None, bers=DEFAULT_BERS,
                    size: int = DEFAULT_SIZE, count: int = DEFAULT_COUNT, log: Log = print, *,
                    repeat: int = 1, warmup: int = DEFAULT_WARMUP, port: int = PINGPONG_PORT,
                    out: str | Path | None = None, runtime: str | None = None, name: str | None = None,
                    machines=None, engine: str | None = None) -> dict:
    """Ping-pong RTT percentiles over one link for every configuration of `latency_configurations(bers)`.

    `tb_or_topology`: a Topology (brought up without an engine on the link, down after), or a running BaseTestbed
    or its name (left as found). With `repeat` > 1 the whole fixed sequence runs `repeat` times (interleaved, so
    drift hits every configuration alike); each result then pools all samples, and `repeats` holds the
    per-repetition figures. Returns the latency.json document (written atomically to out/latency.json if
    `out` is given). `engine` (nfqueue, bpf or auto): the engine kind of the measured link, for a topology
    file (default: what the file says, else nfqueue).
    """
    log = log or _quiet
    bers = _check_bers(bers)
    if engine is not None:
        if engine not in (kinds := engine_choices()):
            raise BenchError(f"engine {engine!r}: {_one_of(kinds)}")
        if not isinstance(tb_or_topology, Topology):
            raise BenchError("engine applies to a topology file (a topology that is up keeps its engines)")
    if size < 1 or count < 1 or repeat < 1 or warmup < 0:
        raise BenchError("size, count and repeat must be >= 1 and warmup >= 0")
    topo = _topology_of(tb_or_topology)
    l = resolve_link(topo, link)
    out = Path(out).resolve() if out else None
    cfgs = latency_configurations(bers)
    samples: dict[str, list[float]] = {c["label"]: [] for c in cfgs}
    per_rep: dict[str, list[dict]] = {c["label"]: [] for c in cfgs}
    started = time.time()
    def prepare(t: Topology) -> Topology:
        return _without_ber(t.with_overrides(engine=engine) if engine else t, l.name)

    with _open(tb_or_topology, runtime=runtime, name=name, out=out, links={l.name},
               prepare=prepare, log=log, machines=machines) as tb:
        client, server = l.a.node, l.b.node
        addr = link_address(tb.topo, l, server)
        hosts = [client, server]
        log(f"latency on {tb.name} ({tb.runtime_name}) link {l.name}: {client} -> {server} {addr}:{port}, "
            f"{size} B x {count} round trips, {len(cfgs)} configurations x {repeat}"
            + (f", engine {engine}" if engine else ""))
        with tb.detached(l.name):
            _pingpong(tb, client, server, addr, size, min(count, 200), warmup, port)  # discarded warm-up run
        for rep in range(repeat):
            for c in cfgs:
                if c["engine"]:
                    tb.set_link(l.name, ber=c["ber"], checksum=c["checksum"], scope="payload")
                ctx = tb.detached(l.name) if not c["engine"] else nullcontext()
                with ctx:
                    e0, s0 = tb.counters([l.name]), {h: _snmp(tb, h) for h in hosts}
                    err = None
                    try:
                        res = _pingpong(tb, client, server, addr, size, count, warmup, port)
                    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                        err, res = f"{type(e).__name__}: {e}", {"samples_us": []}
                    e1, s1 = tb.counters([l.name]), {h: _snmp(tb, h) for h in hosts}
                eng = _engine_delta(e0, e1) if c["engine"] else {f: 0 for f in ENGINE_FIELDS}
                rec = {"rep": rep, **_percentiles(res["samples_us"]), **{f: eng[f] for f in ENGINE_FIELDS},
                       **_snmp_delta(s0, s1), "seconds": res.get("seconds"), "error": err}
                if c["engine"] and not eng["engines_alive"]:
                    rec["error"] = (err + "; " if err else "") + f"engine died: {', '.join(eng['dead_engines'])}"
                samples[c["label"]].extend(res["samples_us"])
                per_rep[c["label"]].append(rec)
                log(f"  {c['label']:<18} p50 {_g(rec['p50_us'])} us  p99 {_g(rec['p99_us'])} us  flipped "
                    f"{rec['bits_flipped']}  retrans {rec['retrans_segs']}" + (f"  ERROR {rec['error']}" if rec["error"] else ""))
        runtime_name = tb.runtime_name
        topo_name, topo_file = tb.name, tb.topo.file
        kinds = sorted({str(x.get("engine") or "nfqueue") for x in tb.counters([l.name]).values()})
    results = []
    for c in cfgs:
        reps = per_rep[c["label"]]
        r = {**c, **_percentiles(samples[c["label"]])}
        for f in (*ENGINE_FIELDS, *SNMP_FIELDS):
            vals = [x[f] for x in reps if x.get(f) is not None]
            r[f] = sum(vals) if vals else None
        r["scope"] = "payload" if c["engine"] else None
        r["samples"] = len(samples[c["label"]])
        r["errors"] = [x["error"] for x in reps if x.get("error")]
        if repeat > 1:
            r["repeats"] = reps
            r["p50_us_median_of_repeats"] = _median([x["p50_us"] for x in reps])
            r["p99_us_median_of_repeats"] = _median([x["p99_us"] for x in reps])
            r["mean_us_median_of_repeats"] = _median([x["mean_us"] for x in reps])
        r["samples_us"] = samples[c["label"]]
        results.append(r)
    doc = {"topology": topo_name, "topology_file": topo_file, "runtime": runtime_name, "link": l.name,
           "client": l.a.node, "server": l.b.node, "server_address": addr, "port": port,
           "size": size, "count": count, "warmup": warmup, "repeat": repeat, "scope": "payload",
           "engine": ",".join(kinds) or None,
           "bers": sorted(set(bers)), "started_at": started, "finished_at": time.time(),
           "counters_note": "bits and TCP counters cover each configuration's whole connection (warm-up round "
                            "trips and handshake included), summed over both directions / both hosts",
           "results": results, "headline": latency_headline(results)}
    if out is not None:
        write_json_atomic(out / "latency.json", doc)
    return doc


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def latency_table(doc: dict) -> str:
    rows = []
    for r in doc["results"]:
        rows.append([r["label"], _g(r["p50_us"]), _g(r["p90_us"]), _g(r["p99_us"]), _g(r["p999_us"]),
                     _g(r["mean_us"]), _g(r["max_us"]), _g(r.get("bits_flipped"), "d"),
                     _g(r.get("retrans_segs"), "d"), _g(r.get("in_csum_errors"), "d"),
                     _g(r.get("rto_timeouts"), "d"), _g(r.get("loss_probes"), "d"),
                     "; ".join(r.get("errors") or [])[:60]])
    head = ["configuration", "p50 us", "p90 us", "p99 us", "p999 us", "mean us", "max us", "bits flipped",
            "retrans segs", "csum drops", "RTOs", "TLPs", "error"]
    if not any(r[-1] for r in rows):
        head, rows = head[:-1], [r[:-1] for r in rows]
    text = [f"{doc['topology']} link {doc['link']} ({doc['client']} -> {doc['server']}), {doc['runtime']}, "
            + (f"engine {doc['engine']}, " if doc.get("engine") else "") +
            f"{doc['size']} B messages x {doc['count']} round trips" +
            (f" x {doc['repeat']} repeats (pooled)" if doc.get("repeat", 1) > 1 else ""), "",
            text_table(rows, head, right=True)]
    if doc.get("headline"):
        text += ["", "retransmission (keep) vs delivered errors (fix):"]
        hrows = [[f"{h['ber']:g}", _g(h["p50_ratio"], ".2f"), _g(h["p99_ratio"], ".2f"), _g(h["mean_ratio"], ".2f"),
                  _g(h["keep_minus_fix_mean_us"]), _g(h.get("keep_vs_keep0_p99_ratio"), ".2f")]
                 for h in doc["headline"]]
        text.append(text_table(hrows, ["BER", "keep/fix p50", "keep/fix p99", "keep/fix mean", "keep-fix mean us",
                                       "keep/keep@0 p99"], right=True))
    return "\n".join(text)


# -- collectives ---------------------------------------------------------------------------------------------


def parse_sizes(text: str | list) -> list[int]:
    """'1K..64M' (x4 steps; '1K..64M:2' for x2), '1K,64K,1M', or a list of ints/strings -> bytes."""
    from testbed.topology.units import parse_size

    try:
        if isinstance(text, (list, tuple)):
            sizes = [parse_size(s) for s in text]
        elif ".." in text:
            rng, _, factor = text.partition(":")
            lo, _, hi = rng.partition("..")
            lo_b, hi_b = parse_size(lo.strip()), parse_size(hi.strip())
            f = int(factor) if factor else 4
            if f < 2 or lo_b > hi_b:
                raise ValueError("a range is LOW..HIGH[:FACTOR] with LOW <= HIGH and FACTOR >= 2")
            sizes, s = [], lo_b
            while s <= hi_b:
                sizes.append(s)
                s *= f
        else:
            sizes = [parse_size(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise BenchError(f"sizes {text!r}: {e}") from None
    if not sizes:
        raise BenchError(f"sizes {text!r}: no sizes")
    if any(s < 4 for s in sizes):
        raise BenchError("collective message sizes must be at least 4 bytes (one fp32)")
    return sizes


def measure_collective(tb_or_topology: "BaseTestbed | Topology | str", sizes=DEFAULT_COLLECTIVE_SIZES,
                       ber: float | None = None, scope: str = "tensor", checksum: str | None = None,
                       collectives: list[str] | None = None, log: Log = print, *, budget: float = 0.5,
                       timeout: float = 60.0, out: str | Path | None = None, runtime: str | None = None,
                       name: str | None = None, machines=None) -> dict:
    """Run testbed/bench/collective.py on every host (one rank per host, in the topology's host order).

    With `ber`, every link's engines are set first (scope `tensor` by default, restricted to allreduce and
    point-to-point payloads so that gloo's headers and the bench's own agreement broadcast stay intact). Returns
    the collective.json document (written atomically to out/collective.json if `out` is given).
    """
    log = log or _quiet
    sizes = parse_sizes(sizes)
    if ber is not None:
        ber = _check_bers([ber])[0]
    if scope not in SCOPES:
        raise BenchError(f"scope {scope!r}: {_one_of(SCOPES)}")
    if checksum not in (None, *CHECKSUM_MODES):
        raise BenchError(f"checksum {checksum!r}: {_one_of(CHECKSUM_MODES)}")
    if scope == "tensor" and collectives is None:
        collectives = list(COLLECTIVE_TENSOR_FILTER)
    if scope != "tensor":
        collectives = None
    topo = _topology_of(tb_or_topology)
    if len(topo.hosts) < 2:
        raise BenchError(f"topology {topo.name} has {len(topo.hosts)} host(s); a collective needs at least 2")
    out = Path(out).resolve() if out else None
    settings = {"ber": ber, "scope": scope, "checksum": checksum, "collectives": collectives} if ber is not None else {}

    def prepare(t: Topology) -> Topology:
        return t.with_overrides(**settings) if settings else t

    started = time.time()
    with _open(tb_or_topology, runtime=runtime, name=name, out=out, links={l.name for l in topo.links},
               prepare=prepare, log=log, machines=machines) as tb:
        if settings and not isinstance(tb_or_topology, Topology):
            for l in tb.topo.links:
                tb.set_link(l.name, **settings)
        hosts = list(tb.topo.hosts)
        shared = tb.runtime.shared_dir()
        base = out if out is not None else Path.cwd()
        run_dir = Path(shared) / f"bench-{uuid.uuid4().hex[:12]}" if shared is not None else \
            base / f".collective-{uuid.uuid4().hex[:8]}"
        run_dir.mkdir(parents=True, exist_ok=True)
        before = tb.counters()
        log(f"collective on {tb.name} ({tb.runtime_name}): {len(hosts)} ranks on {', '.join(hosts)}, "
            f"{len(sizes)} sizes" + (f", ber {ber:g} {scope}" if ber is not None else ""))
        try:
            # the ranks write where rank 0's result can be read: run_dir where the hosts see this machine's
            # files, else a directory of the same name on every machine; the rank logs come into run_dir here
            with tb.host_dir(hosts, run_dir) as result_dir:
                worker = _run_collective(tb, hosts, sizes, budget, timeout, run_dir,
                                         result_dir / "collective-rank0.json", log)
        finally:
            after = tb.counters()
            logs = {p.name: p.read_text(errors="replace")[-4000:] for p in sorted(run_dir.glob("rank*.log"))}
            shutil.rmtree(run_dir, ignore_errors=True)
        runtime_name, topo_name, topo_file = tb.runtime_name, tb.name, tb.topo.file
    eng = _engine_delta(before, after)
    doc = {"topology": topo_name, "topology_file": topo_file, "runtime": runtime_name, "hosts": hosts,
           "world_size": worker.get("world_size"), "ifname": worker.get("ifname"), "sizes": sizes,
           "budget_s": budget, "ber": ber, "scope": scope if ber is not None else None,
           "checksum": checksum, "collectives": collectives if ber is not None else None,
           "bits_seen": eng["bits_seen"], "bits_flipped": eng["bits_flipped"],
           "engines_alive": eng["engines_alive"], "started_at": started, "finished_at": time.time(),
           "results": worker["results"], "logs_tail": logs}
    if out is not None:
        write_json_atomic(out / "collective.json", doc)
    return doc


def _run_collective(tb: BaseTestbed, hosts: list[str], sizes: list[int], budget: float, timeout: float,
                    run_dir: Path, result_file: Path, log: Log) -> dict:
    master, port = tb.mgmt_address(hosts[0]), str(tb.topo.control_ports[0])
    argv = [tb.runtime.python, "-m", "testbed.bench.collective", "--sizes", *map(str, sizes),
            "--budget", str(budget), "--timeout", str(timeout), "--out", str(result_file)]
    procs = []
    try:
        for rank, h in enumerate(hosts):
            env = {"RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "MASTER_ADDR": master, "MASTER_PORT": port,
                   "GLOO_SOCKET_IFNAME": tb.topo.plan.data_iface(h), "PYTHONUNBUFFERED": "1"}
            with open(run_dir / f"rank{rank}.log", "wb") as f:
                procs.append(tb.popen(h, argv, env, stdout=f, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True))
        # generous: per size and op the budget plus a few slow iterations, plus start-up (torch import)
        deadline = time.monotonic() + 120 + len(sizes) * (4 * budget + 20)
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if any(c != 0 for c in codes):
            tails = "\n".join(f"--- rank {r} ({hosts[r]}) exit {c}:\n" +
                              (run_dir / f"rank{r}.log").read_text(errors="replace")[-1500:]
                              for r, c in enumerate(codes) if c != 0)
            why = "timed out" if any(c is None for c in codes) else "failed"
            raise RuntimeError(f"collective benchmark {why} (exit codes {codes}):\n{tails}")
        return json.loads(tb.read_file(hosts[0], str(result_file)))  # on rank 0's machine
    finally:
        for p in procs:
            _stop(p)


def collective_table(doc: dict) -> str:
    rows = []
    for r in doc["results"]:
        ar, sr = r.get("allreduce", {}), r.get("sendrecv") or {}
        rows.append([_size(r["bytes"]), _g(ar.get("median_s", 0) * 1e3, ".3f"), _g(ar.get("algbw_GBps"), ".3f"),
                     _g(ar.get("busbw_GBps"), ".3f"), _g(sr["median_s"] * 1e3 if sr else None, ".3f"),
                     _g(sr.get("busbw_GBps"), ".3f")])
    ber = f", ber {doc['ber']:g} {doc['scope']}" if doc.get("ber") is not None else ""
    text = [f"{doc['topology']} ({doc['runtime']}), {doc['world_size']} ranks over {doc.get('ifname')}{ber}", "",
            text_table(rows, ["size", "allreduce ms", "algbw GB/s", "busbw GB/s", "sendrecv ms", "busbw GB/s"],
                       right=True)]
    if doc.get("ber") is not None:
        text.append(f"\nbits flipped {doc['bits_flipped']:,} of {doc['bits_seen']:,} eligible")
    return "\n".join(text)


def _size(n: int) -> str:
    for unit, f in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return str(n)


# -- command line --------------------------------------------------------------------------------------------


def _target(arg: str, name: str | None):
    if os.path.exists(arg):
        return Topology.load(arg, name=name)
    if name:
        raise BenchError("--name applies to a topology file, not to a topology that is up")
    return arg


def _machines(args, target):
    """The inventory of --machines (a topology file is then placed across those machines), or None."""
    if not getattr(args, "machines", None):
        return None
    if not isinstance(target, Topology):
        raise BenchError(f"--machines places a topology file; {target!r} is already up (where it was placed)")
    from testbed.machines.inventory import load_inventory

    return load_inventory(args.machines)


def _default_out(kind: str, target) -> Path:
    base = target.name if isinstance(target, Topology) else str(target)
    return Path("results") / "bench" / f"{kind}-{base}-{time.strftime('%Y%m%d-%H%M%S')}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cli_errors(fn):
    """Bad input to a bench command is the command's bad input (exit 2)."""
    def wrapped(args) -> int:
        try:
            return fn(args)
        except BenchError as e:
            raise CliError(str(e), EXIT_INPUT) from None
    return wrapped


@_cli_errors
def cmd_bench_latency(args) -> int:
    target = _target(args.topology, args.name)
    bers = [b for b in args.bers.split(",") if b.strip()]
    out = Path(args.out) if args.out else _default_out("latency", target)
    doc = measure_latency(target, args.link, bers, args.size, args.count, _log, repeat=args.repeat,
                          warmup=args.warmup, port=args.port, out=out, runtime=args.runtime,
                          machines=_machines(args, target), engine=args.engine)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(latency_table(doc))
        print(f"\nwritten: {out.resolve() / 'latency.json'}")
    return 1 if any(r.get("errors") for r in doc["results"]) else 0


@_cli_errors
def cmd_bench_collective(args) -> int:
    target = _target(args.topology, args.name)
    out = Path(args.out) if args.out else _default_out("collective", target)
    doc = measure_collective(target, args.sizes, ber=args.ber, scope=args.scope, checksum=args.checksum,
                             collectives=args.collectives.split(",") if args.collectives else None, log=_log,
                             budget=args.budget, timeout=args.timeout, out=out, runtime=args.runtime,
                             machines=_machines(args, target))
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(collective_table(doc))
        print(f"\nwritten: {out.resolve() / 'collective.json'}")
    return 0


def _ber_arg(text: str) -> float:
    from testbed.topology.units import parse_probability
    try:
        return parse_probability(text, upper=0.5)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    from testbed.topology.units import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


BENCH_DESCRIPTION = ("Measurements over real sockets. TOPOLOGY is a YAML file (brought up for the measurement and "
                     "down after) or the name of a topology that is up (left as it was found). Tables go to stdout, "
                     "progress to stderr, JSON to --out.")


def register_bench(sub) -> None:
    """Adds `bench latency` and `bench collective` to the `testbed` command's subparsers."""
    b = sub.add_parser("bench", help="latency and collective benchmarks over a topology's real sockets",
                       description=BENCH_DESCRIPTION)
    add_bench_commands(b)


def _machines_flag(s: argparse.ArgumentParser) -> None:
    s.add_argument("--machines", metavar="FILE", help="inventory of machines (docs/machines.md): place the topology "
                   "file's hosts on them for the measurement (a topology that is up across machines needs no flag)")


def add_bench_commands(b: argparse.ArgumentParser) -> None:
    """The `latency` and `collective` subcommands, under `b` (`testbed bench`, or this module's own main)."""
    bsub = b.add_subparsers(dest="bench_cmd", metavar="{latency,collective}", required=True)

    s = bsub.add_parser("latency", help="TCP ping-pong RTT over one link: no engine, BER 0, fix vs keep per BER",
                        description="TCP ping-pong round trips between the two end hosts of one link, for: no "
                                    "engine; engine at BER 0 (fix, and keep); and for each BER > 0 checksum fix "
                                    "(errors delivered) and keep (receiver drops, TCP retransmits), changed live "
                                    "on both directions (scope payload). Prints p50..max, bits flipped and TCP "
                                    "retransmissions per configuration and the keep/fix ratios; writes "
                                    "DIR/latency.json. Default size 16 KB: ~0.26 flips per round trip at 1e-6.")
    s.add_argument("topology", metavar="TOPOLOGY")
    s.add_argument("--link", help="link name (default: the first link); both ends must be hosts")
    s.add_argument("--bers", default="0,1e-6,1e-5", help="comma-separated BERs (default 0,1e-6,1e-5)")
    s.add_argument("--size", type=_positive_int, default=DEFAULT_SIZE,
                   help=f"message bytes each way (default {DEFAULT_SIZE}; 16k, 1m also accepted)")
    s.add_argument("--count", type=int, default=DEFAULT_COUNT, help=f"timed round trips (default {DEFAULT_COUNT})")
    s.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed round trips per connection")
    s.add_argument("--repeat", type=int, default=1, help="run the whole sequence this many times (pooled)")
    s.add_argument("--port", type=int, default=PINGPONG_PORT, help=f"server port (default {PINGPONG_PORT})")
    s.add_argument("--engine", choices=engine_choices(),
                   help="engine kind on the measured link, for a topology file (default: the file's, else nfqueue; "
                        "auto: bpf where it loads)")
    s.add_argument("--out", metavar="DIR", help="where latency.json goes (default results/bench/latency-NAME-TIME)")
    s.add_argument("--runtime", choices=runtime_names(), help="runtime for a topology file")
    s.add_argument("--name", help="topology name to bring the file up under")
    _machines_flag(s)
    s.add_argument("--json", action="store_true", help="print the whole document as JSON")
    s.set_defaults(fn=cmd_bench_latency)

    s = bsub.add_parser("collective", help="gloo allreduce and ring send/recv timing on every host",
                        description="Runs testbed/bench/collective.py on every host (one rank each): allreduce "
                                    "and ring send/recv per message size, algbw and busbw as nccl-tests reports "
                                    "them. With --ber, every link's engines are set first (scope tensor, limited "
                                    "to allreduce and p2p payloads, so gloo survives). Writes DIR/collective.json.")
    s.add_argument("topology", metavar="TOPOLOGY")
    s.add_argument("--sizes", default=DEFAULT_COLLECTIVE_SIZES,
                   help="LOW..HIGH[:FACTOR] (x4 steps by default) or a comma list (default 1K..64M)")
    s.add_argument("--ber", type=_ber_arg, help="set every link's BER (both directions) first")
    s.add_argument("--scope", choices=SCOPES, default="tensor",
                   help="with --ber (default tensor; payload/all corrupt gloo's headers and usually crash it)")
    s.add_argument("--checksum", choices=CHECKSUM_MODES, help="with --ber")
    s.add_argument("--collectives", help="with --ber and scope tensor (default allreduce,p2p)")
    s.add_argument("--budget", type=float, default=0.5, help="seconds of timing per size and operation")
    s.add_argument("--timeout", type=float, default=60.0, help="gloo process-group timeout (s)")
    s.add_argument("--out", metavar="DIR", help="where collective.json goes (default results/bench/collective-NAME-TIME)")
    s.add_argument("--runtime", choices=runtime_names(), help="runtime for a topology file")
    s.add_argument("--name", help="topology name to bring the file up under")
    _machines_flag(s)
    s.add_argument("--json", action="store_true", help="print the whole document as JSON")
    s.set_defaults(fn=cmd_bench_collective)


def main(argv: list[str] | None = None) -> int:
    """`python -m testbed.bench.commands latency|collective ...`: the same as `testbed bench ...`."""
    p = argparse.ArgumentParser(prog="python -m testbed.bench.commands", description=BENCH_DESCRIPTION)
    add_bench_commands(p)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except TopologyError as e:
        print(str(e), file=sys.stderr)
        return EXIT_INPUT
    except RuntimeUnavailable as e:
        print(f"testbed: {e}", file=sys.stderr)
        return EXIT_CAPABILITY
    except CliError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
