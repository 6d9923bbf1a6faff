"""The process injector (testbed/train/inject.py): its error streams against binomial bounds and the engine's own
models, the XOR on integer views, protected bits, the ring allreduce's error reach (real gloo processes), whole
DDP and PP runs on loopback (counters exact, flips within bounds, the same seed bit-identical), the settings'
errors, and the calibration's statistics. A small calibration against the wire (root, engines) is marked slow.

Every random draw is seeded; counts are checked against two-sided binomial bounds at 1e-6 (a false failure
once in a million runs), so none of these tests is flaky.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from scipy import stats

from testbed.engine import models
from testbed.report.calibration import calibration, two_proportion_p
from testbed.train import inject
from testbed.train.inject import Hop, apply_flips, hop_pairs, ring_allreduce
from testbed.train.settings import TrainSettings

pytestmark = pytest.mark.timeout(240)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGIES = os.path.join(ROOT, "topologies")


def binom_bounds(n, p, tail=1e-6):
    return stats.binom.ppf(tail / 2, n, p), stats.binom.isf(tail / 2, n, p)


def popcount(t):
    b = t.view(-1).view(torch.uint8).numpy()
    return int(np.unpackbits(b).sum())


# ---------------------------------------------------------------------------------------------------------------
# One hop: statistics, determinism, the engine's model code, protected bits
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draws", ["numpy", "torch"])
def test_flip_count_is_binomial_and_the_xor_flips_exactly_those_bits(draws):
    ber, n_values, chunks = 1e-4, 1 << 20, 8
    hop = Hop(0, 1, ber, seed=3, run_seed=1, draws=draws)
    total = 0
    per_chunk = []
    for _ in range(chunks):
        t = torch.zeros(n_values // chunks)
        n = hop.corrupt(t)
        assert popcount(t) == n  # zeros in, so every set bit is one flip: the XOR hit exactly n distinct bits
        per_chunk.append(n)
        total += n
    bits = n_values * 32
    lo, hi = binom_bounds(bits, ber)
    assert lo <= total <= hi, (total, lo, hi)
    assert hop.counts["bits_seen"] == bits and hop.counts["bits_flipped"] == total
    assert sum(hop.counts[f"flips_{f}"] for f in ("sign", "exponent", "mantissa")) == total
    # by field: 1 of 32 positions is the sign, 8 the exponent (fp32), each binomial
    lo, hi = binom_bounds(total, 8 / 32)
    assert lo <= hop.counts["flips_exponent"] <= hi


def test_torch_draws_have_the_dispersion_of_independent_bits():
    """Gaps drawn with torch.geometric_ (the device path) give per-block counts with the binomial's variance:
    the dispersion statistic sum((k - m)^2) / m over blocks is chi-square with blocks - 1 degrees of freedom."""
    ber, block, blocks = 1e-3, 1 << 14, 400  # 16,384 bits per block: mean 16.4 flips
    for draws in ("numpy", "torch"):
        hop = Hop(0, 1, ber, seed=11, draws=draws)
        counts = np.array([hop.corrupt(torch.zeros(block // 32)) for _ in range(blocks)])
        m = block * ber
        chi2 = ((counts - m) ** 2).sum() / (m * (1 - ber))
        lo, hi = stats.chi2.ppf(1e-6, blocks - 1), stats.chi2.isf(1e-6, blocks - 1)
        assert lo <= chi2 <= hi, (draws, chi2, lo, hi)


def test_numpy_draws_are_the_engines_model_and_the_same_seed_gives_the_same_flips():
    em = {"type": "gilbert_elliott", "burst_length": 16}
    a = Hop(1, 0, 1e-4, em, seed=7, run_seed=2)
    b = Hop(1, 0, 1e-4, em, seed=7, run_seed=2)
    t1, t2 = torch.zeros(1 << 18), torch.zeros(1 << 18)
    a.corrupt(t1)
    for piece in t2.split(1000):  # cut differently: the stream does not depend on how it is cut
        b.corrupt(piece)
    assert torch.equal(t1.view(torch.int32), t2.view(torch.int32))
    # the engine's own model with the same key gives these positions
    engine = models.build_model(em, 1e-4, 7, 2, inject.TAG, 1, 0)
    pos = engine.flips((1 << 18) * 32)
    bits = np.unpackbits(t1.view(torch.uint8).numpy())
    assert np.array_equal(np.flatnonzero(bits), pos)
    c = Hop(1, 0, 1e-4, em, seed=7, run_seed=3)  # another run seed: another stream
    t3 = torch.zeros(1 << 18)
    c.corrupt(t3)
    assert not torch.equal(t1, t3)


def test_apply_flips_numbers_bits_as_the_engine_does():
    t = torch.zeros(2, dtype=torch.bfloat16)
    apply_flips(t, torch.tensor([0, 9]))  # stream bit 0 = MSB of byte 0; bit 9 = 0x40 of byte 1
    assert t.view(torch.uint8).tolist() == [0x80, 0x40, 0, 0]
    x = torch.tensor([1.0])
    apply_flips(x, torch.tensor([25]))  # byte 3 (the top byte, little-endian) 0x40: value bit 30, exponent MSB
    assert x.item() > 1e38


def test_protected_bits_take_only_their_residual_rate():
    ber, n_values = 1e-3, 1 << 18
    hop = Hop(0, 1, ber, seed=5, protect_bits=["sign", "exponent"])
    t = torch.zeros(n_values)
    n = hop.corrupt(t)
    v = t.view(torch.int32)
    assert int(((v >> 23) & 0x1FF).sum()) == 0  # no sign or exponent bit set
    assert hop.counts["flips_sign"] == hop.counts["flips_exponent"] == 0
    lo, hi = binom_bounds(n_values * 23, ber)
    assert lo <= n == hop.counts["flips_mantissa"] <= hi
    assert hop.counts["bits_protected"] == n_values * 9
    res = Hop(0, 1, ber, seed=5, protect_bits=["exponent"], protected_ber=ber / 4)
    res.corrupt(torch.zeros(n_values))
    lo, hi = binom_bounds(n_values * 8, ber / 4)
    assert lo <= res.counts["flips_protected"] == res.counts["flips_exponent"] <= hi


def test_hops_are_the_ring_and_the_stage_boundaries():
    assert hop_pairs("ddp", 2) == [(0, 1), (1, 0)]
    assert hop_pairs("ddp", 4) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert hop_pairs("pp", 3) == [(0, 1), (1, 0), (1, 2), (2, 1)]


# ---------------------------------------------------------------------------------------------------------------
# Settings and refusals
# ---------------------------------------------------------------------------------------------------------------

def test_settings_and_settings_refused_with_a_reason():
    argv = TrainSettings(mode="ddp", steps=1, injector="process").worker_argv()
    assert argv[argv.index("--injector") + 1] == "process" and argv[argv.index("--device") + 1] == "cpu"
    with pytest.raises(ValueError, match="device: cuda needs injector process"):
        TrainSettings(mode="ddp", steps=1, device="cuda")
    with pytest.raises(ValueError, match="mode ddp"):
        TrainSettings(mode="pp", steps=1, device="cuda", injector="process")
    with pytest.raises(ValueError, match="injector: must be one of wire, process"):
        TrainSettings(mode="ddp", steps=1, injector="nic")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_absent_is_a_clear_error():
    with pytest.raises(RuntimeError, match="--device cuda: no CUDA device is available here"):
        inject.resolve_device("cuda")


def test_topology_settings_the_process_injector_cannot_model_are_refused():
    from testbed.topology.topo import Topology

    chain = Topology.load(os.path.join(TOPOLOGIES, "chain4.yaml"))
    with pytest.raises(ValueError, match="share no direct link"):
        inject.hop_settings(chain, chain.hosts, "ddp")  # h4 -> h1 is three links away on a chain
    assert len(inject.hop_settings(chain, chain.hosts, "pp")) == 6
    pair = Topology.load(os.path.join(TOPOLOGIES, "pair.yaml"))
    with pytest.raises(ValueError, match="models scope tensor"):
        inject.hop_settings(pair.with_overrides(ber=1e-5, scope="payload"), pair.hosts, "ddp")
    with pytest.raises(ValueError, match="checksum fix"):
        inject.hop_settings(pair.with_overrides(ber=1e-5, scope="tensor", checksum="keep"), pair.hosts, "ddp")
    hops = inject.hop_settings(pair.with_overrides(ber=1e-5, scope="tensor", protect=["sign"]), pair.hosts, "ddp")
    assert [(h["direction"], h["ber"], h["protect"]) for h in hops] == [("h1->h2", 1e-5, ["sign"]),
                                                                        ("h2->h1", 1e-5, ["sign"])]


# ---------------------------------------------------------------------------------------------------------------
# The ring allreduce, on real gloo process groups (3 processes on loopback)
# ---------------------------------------------------------------------------------------------------------------

RING_SCRIPT = textwrap.dedent("""
    import datetime, json, sys, torch, torch.distributed as dist
    from testbed.train.inject import ring_allreduce
    rank, world, port = int(sys.argv[1]), 3, int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
    pg = dist.ProcessGroupGloo(store, rank, world, opts)
    out = {}
    for phase_step in (-1, 0, 2, 3):  # one start-up for every case: starting torch is the slow part
        seen = []
        def on_receive(chunk, src):
            # rank 1 corrupts the k-th chunk it receives: k < 2 reduce-scatter, k >= 2 allgather
            if rank == 1 and len(seen) == phase_step:
                chunk[0] = 1e6
            seen.append(src)
        t = torch.arange(6, dtype=torch.float32) + rank  # 3 chunks of 2 values
        ring_allreduce(t, pg, rank, world, on_receive)
        out[phase_step] = {"rank": rank, "t": t.tolist(), "sources": seen}
    print(json.dumps(out))
""")


def run_ring():
    """{phase_step: {rank: result}} from 3 processes."""
    from testbed.train.launch import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RING_SCRIPT, str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(3)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    per_rank = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    return {int(k): {d[k]["rank"]: d[k] for d in per_rank} for k in per_rank[0]}


def test_ring_allreduce_sums_and_errors_reach_as_on_gloos_ring():
    clean = (torch.arange(6, dtype=torch.float32) * 3 + 3).tolist()
    cases = run_ring()
    res = cases[-1]  # nothing corrupted: the exact sum on every rank, chunks from the left
    assert all(res[r]["t"] == clean for r in range(3))
    assert all(res[r]["sources"] == [(r - 1) % 3] * 4 for r in range(3))
    # reduce-scatter: the corrupted partial sum is reduced and gathered: every rank holds the same wrong chunk
    rs = cases[0]
    assert all(rs[r]["t"] == rs[0]["t"] for r in range(3)) and rs[0]["t"] != clean
    # allgather, first step: rank 1 stores it and forwards it to rank 2; rank 0 keeps the right value
    ag = cases[2]
    wrong = {r for r in range(3) if ag[r]["t"] != clean}
    assert wrong == {1, 2}
    # allgather, last step: only the receiver (with 2 ranks every allgather error is of this kind)
    last = cases[3]
    assert {r for r in range(3) if last[r]["t"] != clean} == {1}


# ---------------------------------------------------------------------------------------------------------------
# Whole runs on loopback (no root: local processes, real gloo)
# ---------------------------------------------------------------------------------------------------------------

def process_run(tmp_path, name, mode, steps, ber, seed=1, **train):
    from testbed.experiments.training import train as train_fn
    from testbed.topology.topo import Topology

    cfg = TrainSettings(mode=mode, model="tiny", steps=steps, seed=seed, injector="process", seq_len=64,
                        timeout=20, run_timeout=180, **train)
    topo = Topology.load(os.path.join(TOPOLOGIES, "pair.yaml"))
    return train_fn(topo, cfg, tmp_path / name, ber=ber, scope="tensor", log=lambda m: None)


def test_process_ddp_counts_every_bit_of_the_ring_and_is_reproducible(tmp_path):
    from testbed.train.fingerprint import bit_identical
    from testbed.analysis.theory import param_count

    steps, ber = 6, 1e-5
    a = process_run(tmp_path, "a", "ddp", steps, ber, batch_size=4)
    b = process_run(tmp_path, "b", "ddp", steps, ber, batch_size=4)
    n = param_count("tiny")
    assert a["status"] == "ok" and a["injector"] == "process" and a["runtime"] == "loopback"
    # 2 ranks: each sends half the gradient in reduce-scatter and half in allgather, 32 bits per value
    assert a["bits_seen"] == 2 * n * 32 * steps
    assert [e["bits_seen"] for e in a["engines"]] == [n * 32 * steps] * 2
    lo, hi = binom_bounds(a["bits_seen"], ber)
    assert lo <= a["bits_flipped"] <= hi
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert sum(r["injected_bits_flipped"] for r in rows) == a["bits_flipped"]
    assert a["corrupted_values_total"] > 0  # the reference (the same ring, clean) sees the corrupted values
    assert bit_identical(tmp_path / "a", tmp_path / "b")  # the same seed: the same flips, the same run
    assert a["bits_flipped"] == b["bits_flipped"]


def test_resync_keeps_sanitized_replicas_bit_identical(tmp_path):
    """guard sanitize zeroes each rank's own copy of the reduced gradient, and allgather errors reach only the
    receiver, so at 1e-4 the replicas drift apart (about 75 exponent-bit-30 flips per step over 2 x 237k values);
    --resync-every 1 copies rank 0's parameters and moments to rank 1 after every update: identical at every step."""
    from testbed.train.fingerprint import final_distance, replica_divergence

    def ranks_alike(name):
        rows = {}
        for r in (0, 1):
            for line in open(tmp_path / name / f"metrics-rank{r}.jsonl"):
                row = json.loads(line)
                rows[(row["step"], r)] = row["param_sha256"]
        return [rows[(s, 0)] == rows[(s, 1)] for s in range(steps)]

    steps, ber = 4, 1e-4
    drift = process_run(tmp_path, "drift", "ddp", steps, ber, batch_size=4, guard="sanitize")
    synced = process_run(tmp_path, "synced", "ddp", steps, ber, batch_size=4, guard="sanitize", resync_every=1)
    assert drift["status"] == synced["status"] == "ok"
    assert drift["sanitized_values"] > 0 and synced["sanitized_values"] > 0
    assert not all(ranks_alike("drift")) and replica_divergence(tmp_path / "drift")["final"][1]["l2"] > 0
    assert all(ranks_alike("synced"))
    assert final_distance(tmp_path / "synced" / "final-rank0.pt", tmp_path / "synced" / "final-rank1.pt")["bit_identical"]


def test_process_pp_corrupts_both_directions_of_the_stage_boundary(tmp_path):
    steps, ber = 4, 1e-4
    s = process_run(tmp_path, "pp", "pp", steps, ber, batch_size=4)
    assert s["status"] == "ok", s["reason"]
    per_step = 4 * 64 * 64 * 32  # B x T x width fp32 values, each way
    assert [(e["direction"], e["bits_seen"]) for e in s["engines"]] == [("h1->h2", per_step * steps),
                                                                        ("h2->h1", per_step * steps)]
    lo, hi = binom_bounds(s["bits_seen"], ber)
    assert lo <= s["bits_flipped"] <= hi
    rows = [json.loads(line) for line in open(tmp_path / "pp" / "metrics.jsonl")]
    assert sum(r["injected_bits_seen"] for r in rows) == s["bits_seen"]


# ---------------------------------------------------------------------------------------------------------------
# Calibration statistics (pure logic)
# ---------------------------------------------------------------------------------------------------------------

def _row(injector, seed, flips, bits=10**8, skipped=5, steps=40, eval_loss=5.0, ber=1e-5):
    return {"injector": injector, "mode": "ddp", "scope": "tensor", "checksum": "fix", "ber": ber, "seed": seed,
            "recipe": injector, "status": "ok", "bits_seen": bits, "bits_flipped": flips,
            "skipped_steps": skipped, "steps_completed": steps, "final_eval_loss": eval_loss, "wall_time_s": 10.0}


def test_calibration_verdicts():
    rng = np.random.default_rng(0)
    same = [_row(i, s, int(rng.poisson(1000)), eval_loss=5.0 + 0.01 * rng.standard_normal())
            for i in ("wire", "process") for s in (1, 2, 3)]
    [c] = calibration(same)
    assert c["verdict"] == "agree" and c["seeds"] == (3, 3)
    off = [_row("wire", s, 1000) for s in (1, 2)] + [_row("process", s, 2000, skipped=30) for s in (1, 2)]
    [c] = calibration(off)
    assert c["verdict"].startswith("disagree") and "flips" in c["verdict"] and "lost" in c["verdict"]
    assert two_proportion_p(0, 40, 0, 40) == 1.0 and two_proportion_p(5, 40, 30, 40) < 1e-6
    assert calibration([_row("wire", 1, 10)]) == []  # one injector only: nothing to compare
    # another size at the same BER is another point (paper-regime: 124M on the wire beside mini's process rows)
    mixed = same + [dict(r, model="mini", final_eval_loss=4.0, bits_flipped=10)
                    for r in same if r["injector"] == "process"]
    cal = calibration(mixed)
    assert [c["seeds"] for c in cal] == [(3, 3)] and cal[0]["verdict"] == "agree"


# ---------------------------------------------------------------------------------------------------------------
# Against the wire (root: engines on a namespace pair)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.privileged
@pytest.mark.skipif(os.geteuid() != 0, reason="privileged: the wire needs namespaces and engines")
def test_small_calibration_against_the_wire(tmp_path):
    """experiments/calibrate.yaml cut down to DDP at BER 1e-5, one seed, 10 steps (4 points, ~100 s on 2 cores):
    the same bits carried, flip counts consistent, and the report's calibration table with a verdict."""
    import yaml

    from testbed.report.report import write_report
    from testbed.experiments.runner import run_experiment
    from testbed.experiments.spec import Experiment

    doc = yaml.safe_load(open(os.path.join(ROOT, "experiments", "calibrate.yaml")))
    doc.update(name="calsmall", steps=10, topologies={m: os.path.join(TOPOLOGIES, "pair.yaml") for m in ("ddp", "pp")})
    doc["grid"].update(mode=["ddp"], ber=[1e-5], seed=[1])
    path = tmp_path / "calsmall.yaml"
    path.write_text(yaml.safe_dump(doc))
    rows = run_experiment(Experiment.load(path), tmp_path / "out", log=lambda m: None)
    by = {(r["injector"], r["ber"]): r for r in rows}
    assert len(by) == 4 and all(r["status"] == "ok" for r in rows)
    assert by[("wire", 1e-5)]["bits_seen"] == by[("process", 1e-5)]["bits_seen"] > 0
    [_, c] = calibration(rows)
    assert c["flips"]["p"] > 1e-4, c
    report = write_report(tmp_path / "out").read_text()
    assert "## Calibration: the process injector against the wire" in report and "| agree |" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_an_experiment_that_needs_cuda_is_refused_before_any_point_where_there_is_none(tmp_path):
    """experiments/cuda.yaml (GPT-2 124M on a GPU) on a machine without CUDA: exit 3 naming the file and why,
    nothing written (each point would otherwise end in an error row)."""
    r = subprocess.run([sys.executable, "-m", "testbed", "run", os.path.join(ROOT, "experiments", "cuda.yaml"),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 3, r.stderr
    assert "cuda.yaml: --device cuda: no CUDA device is available here" in r.stderr
    assert not (tmp_path / "out").exists()
