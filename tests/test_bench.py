"""`testbed bench latency` / `bench collective` over real sockets and real engines: the retransmission cost of
checksum `keep` against delivered errors (`fix`), gloo collective timing, and argument errors.

BER 1e-5 with 16 KB messages: a round trip carries 262,144 bits, ~2.6 expected flips, so nearly every round
trip has a corrupted segment. With `keep` the receiver drops it and TCP retransmits (fast retransmit, tail-loss
probe, or a >= 200 ms RTO when the retransmission is hit too); with `fix` the bytes arrive corrupted and nothing
is retransmitted."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache

import pytest

from conftest import ROOT, TOPOLOGIES, leftovers, running, tb_cli, unique_name
from testbed.bench.commands import BenchError, measure_latency
from testbed.net import Testbed as TB
from testbed.net import teardown
from testbed.topology.topo import Topology

DOCUMENTED = ("label", "engine", "ber", "checksum", "p50_us", "p90_us", "p99_us", "p999_us", "mean_us", "max_us",
              "samples_us")
LABELS = ["no engine", "engine ber 0", "engine ber 0 keep", "ber 1e-05 fix", "ber 1e-05 keep"]


@lru_cache(maxsize=1)
def _bench_prefix() -> tuple[str, ...]:
    """`testbed bench` once the main command registers it; the module's own entry point until then."""
    if tb_cli("bench", "--help", timeout=60).returncode == 0:
        return (sys.executable, "-m", "testbed", "bench")
    return (sys.executable, "-m", "testbed.bench.commands")


def bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*_bench_prefix(), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def quiet(_msg):
    pass


def check_latency_doc(doc: dict, count: int) -> None:
    for k in ("topology", "link", "size", "count", "results"):
        assert k in doc
    assert doc["link"] == "h1-h2" and doc["size"] == 16384 and doc["count"] == count
    by = {r["label"]: r for r in doc["results"]}
    assert [r["label"] for r in doc["results"]] == LABELS
    for r in doc["results"]:
        assert all(k in r for k in DOCUMENTED), r.keys()
        assert not r["errors"], r["errors"]
        assert len(r["samples_us"]) == count
        assert 0 < r["p50_us"] <= r["p90_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"]
    clean, fix, keep = by["no engine"], by["ber 1e-05 fix"], by["ber 1e-05 keep"]
    assert clean["engine"] is False and clean["bits_flipped"] == 0
    assert by["engine ber 0"]["bits_flipped"] == 0 and by["engine ber 0 keep"]["bits_flipped"] == 0
    # Corruption happened in both modes (expected ~2.6 flips per round trip, ~130 over 50 round trips).
    assert fix["bits_flipped"] > 20 and keep["bits_flipped"] > 20, (fix["bits_flipped"], keep["bits_flipped"])
    # fix: corrupted bytes delivered; the receiver never drops a segment for its checksum. (A stray tail-loss
    # probe when the engine stalls on a busy 2-vCPU machine is possible, hence the small allowance.)
    assert fix["in_csum_errors"] == 0
    assert fix["retrans_segs"] <= 3, fix
    # keep: corrupted segments dropped by the receiver and retransmitted, which costs time.
    assert keep["in_csum_errors"] > 10 and keep["retrans_segs"] >= keep["in_csum_errors"] * 0.8, keep
    assert keep["retrans_segs"] > 5 * max(1, fix["retrans_segs"])
    assert keep["p99_us"] > fix["p99_us"]
    assert keep["mean_us"] > 2 * fix["mean_us"], (keep["mean_us"], fix["mean_us"])
    (h,) = doc["headline"]
    assert h["ber"] == 1e-5 and h["p99_ratio"] > 1 and h["mean_ratio"] > 2


def test_latency_keep_costs_retransmissions_fix_delivers_errors(tmp_path, runtime, load_topology):
    """On a running topology, by name: every configuration, the retransmission penalty, and the topology left
    as it was (pair has no engines: those the benchmark started are gone)."""
    with running(load_topology("pair.yaml"), runtime=runtime) as tb:
        doc = measure_latency(tb.name, None, [1e-5], 16384, 30, quiet, out=tmp_path)
        assert doc["runtime"] == runtime
        check_latency_doc(doc, 30)
        assert json.loads((tmp_path / "latency.json").read_text())["results"][0]["label"] == "no engine"
        again = TB.attach(tb.name)  # the state file as the benchmark left it
        assert again.engine_handles() == {} and again.stats() == []


def test_cli_latency_from_yaml_and_bad_arguments(tmp_path):
    name = unique_name("blat")
    out = tmp_path / "lat"
    try:
        # --engine auto: the bpf engine where it loads (the other latency test measures nfqueue engines)
        r = bench("latency", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--bers", "1e-5", "--count", "30",
                  "--engine", "auto", "--out", str(out))
        assert r.returncode == 0, r.stderr
        for label in LABELS:
            assert label in r.stdout
        assert "keep/fix p99" in r.stdout
        doc = json.loads((out / "latency.json").read_text())
        check_latency_doc(doc, 30)
        from testbed.engine.bpf.engine import available
        assert doc["engine"] == ("bpf" if available()[0] else "nfqueue"), doc["engine"]
    finally:
        teardown(name, save_stats=False)
    assert not leftovers(name)

    # Bad input is refused before anything is created (exit 2, a message that names the problem).
    r = bench("latency", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--link", "h1-h9")
    assert r.returncode == 2 and "no link 'h1-h9'" in r.stderr and "h1-h2" in r.stderr, r.stderr
    r = bench("latency", str(TOPOLOGIES / "star8.yaml"), "--name", name)
    assert r.returncode == 2 and "ends at switch s1" in r.stderr, r.stderr
    r = bench("latency", "no-such-topology-up")
    assert r.returncode == 2 and "neither a topology file nor" in r.stderr, r.stderr
    r = bench("latency", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--engine", "tc")
    assert r.returncode == 2 and "tc" in r.stderr, r.stderr
    r = bench("latency", "no-such-topology-up")
    assert r.returncode == 2 and "neither a topology file nor" in r.stderr, r.stderr
    r = bench("latency", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--bers", "0,0.7")
    assert r.returncode == 2 and "0.7" in r.stderr, r.stderr
    r = bench("collective", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--sizes", "1K..lots")
    assert r.returncode == 2 and "lots" in r.stderr, r.stderr
    assert not leftovers(name)
    with pytest.raises(BenchError, match="ends at switch"):
        measure_latency(Topology.load(TOPOLOGIES / "star8.yaml", name=name), "h3-s1", [0], 64, 10, quiet)
    assert not leftovers(name)


def test_cli_collective_from_yaml(tmp_path):
    name = unique_name("bcol")
    out = tmp_path / "col"
    try:
        r = bench("collective", str(TOPOLOGIES / "pair.yaml"), "--name", name, "--sizes", "1K,64K,1M",
                  "--budget", "0.2", "--out", str(out))
        assert r.returncode == 0, r.stderr
    finally:
        teardown(name, save_stats=False)
    assert not leftovers(name)
    for col in ("size", "allreduce ms", "algbw GB/s", "busbw GB/s", "sendrecv ms"):
        assert col in r.stdout
    for size in ("1K", "64K", "1M"):
        assert f"\n{size} " in r.stdout
    doc = json.loads((out / "collective.json").read_text())
    assert doc["world_size"] == 2 and doc["sizes"] == [1024, 65536, 1 << 20]
    for row in doc["results"]:
        assert row["allreduce"]["busbw_GBps"] > 0 and row["sendrecv"]["busbw_GBps"] > 0


def test_collective_with_ber_on_running_topology(tmp_path, load_topology):
    """By name, with --ber: engines set on every link (tensor scope, allreduce + p2p), gloo survives, bits are
    flipped, and afterwards the topology is as it was (no engines)."""
    with running(load_topology("pair.yaml")) as tb:
        r = bench("collective", tb.name, "--sizes", "4K,256K", "--ber", "1e-5", "--budget", "0.2",
                  "--out", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert "bits flipped" in r.stdout
        doc = json.loads((tmp_path / "collective.json").read_text())
        assert doc["ber"] == 1e-5 and doc["scope"] == "tensor" and doc["collectives"] == ["allreduce", "p2p"]
        assert doc["bits_flipped"] > 0 and doc["engines_alive"]
        assert all(row["allreduce"]["busbw_GBps"] > 0 for row in doc["results"])
        assert TB.attach(tb.name).stats() == []  # engines the benchmark started are stopped again
