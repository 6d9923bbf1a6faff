"""GPT-2 (tiny) trained across real topologies with the corruption engine: DDP on 2 and 4 hosts, PP on
chains of 2 and 4 stages. Each topology is brought up once per module and reused; every run changes the
links' corruption live (`link set`), as `testbed train NAME` does."""

from __future__ import annotations

import statistics

import pytest
from scipy.stats import binom

from conftest import TOPOLOGIES, running, unique_name
from testbed.experiments.training import train
from testbed.train.settings import TrainSettings
from testbed.topology.topo import Topology
from testbed.train.fingerprint import bit_identical, run_distance

SEEDS = [1, 2, 3, 4, 5]


def cfg(mode: str, seed: int, steps: int = 20, **kw) -> TrainSettings:
    return TrainSettings(mode=mode, model="tiny", steps=steps, seed=seed, batch_size=4, seq_len=32, eval_every=10,
                       timeout=15, stall_timeout=45, run_timeout=300, **kw)


def up(file: str, **overrides):
    topo = Topology.load(TOPOLOGIES / file, name=unique_name(file.split(".")[0]))
    # Engines on every direction from the start (BER 0), so runs only change settings live.
    return running(topo.with_overrides(ber=0.0, scope="tensor", **overrides))


@pytest.fixture(scope="module")
def pair():
    with up("pair.yaml") as tb:
        yield tb


@pytest.fixture(scope="module")
def ring4():
    with up("ring4.yaml") as tb:
        yield tb


def quiet(_msg):
    pass


def run(tb, out, mode, seed, ber, scope="tensor", **kw):
    return train(tb.name, cfg(mode, seed, **kw), out, ber=ber, scope=scope, log=quiet)


# Where the engines' flips land is pseudo-random (drawn from the links' seeds, the same in every run of a
# topology: tests/test_reproducible.py), so every check of a flip count below is a statistical bound: runs see
# > 1e7 eligible bits at BER >= 1e-5, >= 100 flips expected, P(no flip) < e^-100. Tensor scope flips only tensor values, never gloo's framing, and the trainers skip a
# non-finite step, so `ok` does not depend on where they land.
def assert_completed_with_corruption(s):
    assert s["status"] == "ok", s
    assert s["steps_completed"] == 20
    assert s["bits_flipped"] > 0, s["engines"]
    assert s["realized_ber"] is not None and s["bits_seen"] > 1e7


# ring4's five seeds take ~2 min: in `make test-all` (marked slow) to keep `make test` under 20 minutes.
@pytest.mark.parametrize("topology", ["pair", pytest.param("ring4", marks=pytest.mark.slow)])
def test_ddp_tensor_scope_survives_ber_1e4_for_every_seed(request, tmp_path, topology):
    tb = request.getfixturevalue(topology)
    for seed in SEEDS:
        s = run(tb, tmp_path / f"s{seed}", "ddp", seed, 1e-4)
        assert_completed_with_corruption(s)
        assert s["world_size"] == len(tb.topo.hosts)
        # The metrics show corrupted values arrived: gradients that differ from the clean reference allreduce.
        assert s["corrupted_values_total"] > 0
        assert all(e["flows_desynced"] == 0 for e in s["engines"])


# Payload scope corrupts gloo's framing and DDP's own metadata too, at random places: at BER 1e-4 on pair
# (~9,000 such bits per step) 10 runs of 2,000 steps broke at steps 0-18, about one step in five after step 1.
# 300 steps make a complete run (ok) improbable for any seed: below 1e-6 even at a quarter of that rate.
PAYLOAD_STEPS = 300


# ring4 (26 s) in the slow suite, to keep `make test` under 20 minutes; pair runs in make test
@pytest.mark.parametrize("topology", ["pair", pytest.param("ring4", marks=pytest.mark.slow)])
def test_ddp_payload_scope_breaks_gloo_and_is_reported(request, tmp_path, topology):
    tb = request.getfixturevalue(topology)
    s = run(tb, tmp_path / "payload", "ddp", 1, 1e-4, scope="payload", steps=PAYLOAD_STEPS)
    # gloo's framing is corrupted too: an abort or an exception in DDP on its corrupted metadata (crashed), or a
    # wait for bytes that never come (hung); never `error`: the wire explains it (docs/training.md)
    assert s["status"] in ("crashed", "hung"), s
    assert s["steps_completed"] < PAYLOAD_STEPS
    assert s["reason"]
    assert s["wall_time_s"] < 200  # within the timeouts, never an endless wait
    assert s["bits_flipped"] > 0


def test_bf16_wire_halves_the_bits_and_the_flips_per_step(pair, tmp_path):
    """DDP on pair at BER 1e-5: with bf16 on the wire the engines see half the tensor bits per step, and the flips
    follow: each run's flip count lies in the 99.9 % binomial interval of its own eligible bits (about 1,500 and
    750 flips expected), and the two intervals do not overlap, so the flips per step scale with the bytes."""
    ber, steps, runs = 1e-5, 10, {}
    for dtype in ("fp32", "bf16"):
        s = run(pair, tmp_path / dtype, "ddp", 1, ber, steps=steps, wire_dtype=dtype, guard="sanitize")
        assert s["status"] == "ok", s
        runs[dtype] = s
    f32, b16 = runs["fp32"], runs["bf16"]
    assert b16["wire_bytes_per_step"] * 2 == f32["wire_bytes_per_step"]
    # eligible bits: the gradient values the allreduce moved, in both directions (gloo's framing is not eligible)
    assert b16["bits_seen"] / f32["bits_seen"] == pytest.approx(0.5, rel=0.01)
    lo_hi = {}
    for dtype, s in runs.items():
        lo_hi[dtype] = binom.interval(0.999, s["bits_seen"], ber)
        assert lo_hi[dtype][0] <= s["bits_flipped"] <= lo_hi[dtype][1], (dtype, s["bits_flipped"], lo_hi[dtype])
    assert lo_hi["bf16"][1] < lo_hi["fp32"][0]


def test_pp_tensor_scope_completes_at_ber_1e5_on_chains_of_2_and_4(pair, tmp_path):
    s = run(pair, tmp_path / "pp2", "pp", 1, 1e-5)
    assert_completed_with_corruption(s)
    assert s["world_size"] == 2
    with up("chain4.yaml") as chain:
        s = run(chain, tmp_path / "pp4", "pp", 1, 1e-5)
    assert_completed_with_corruption(s)
    assert s["world_size"] == 4
    # every stage boundary carried corrupted activations or gradients (both directions of each link): ~50 flips
    # expected per direction, P(none on one of 6) < 6 e^-50
    assert sum(1 for e in s["engines"] if e["bits_flipped"] > 0) >= 3


@pytest.mark.slow  # ~100 s: in `make test-all`, to keep `make test` under 20 minutes
def test_clean_runs_are_identical_and_corruption_deviates_more_at_higher_ber(pair, tmp_path):
    clean = {seed: tmp_path / f"clean{seed}" for seed in (1, 2)}
    for seed, d in clean.items():
        assert run(pair, d, "ddp", seed, 0.0)["status"] == "ok"
    again = tmp_path / "clean1-again"
    s = run(pair, again, "ddp", 1, 0.0)
    assert s["bits_flipped"] == 0
    assert bit_identical(clean[1], again)
    assert run_distance(clean[1], again)["final"][0]["l2"] == 0.0

    # ~300 flips expected per run at 1e-6 (P(none) < e^-100), 100 times more at 1e-4: the order holds by far
    deviation = {}
    for ber in (1e-6, 1e-4):
        devs = []
        for seed in (1, 2):
            d = tmp_path / f"ber{ber:g}-s{seed}"
            assert run(pair, d, "ddp", seed, ber)["status"] == "ok"
            assert not bit_identical(clean[seed], d)
            devs.append(run_distance(clean[seed], d)["final"][0]["l2"])
        deviation[ber] = statistics.mean(devs)
    assert 0 < deviation[1e-6] < deviation[1e-4], deviation


@pytest.mark.slow
def test_gpt2_124m_trains_ddp_on_pair_on_cpu(tmp_path):
    """The real 124M configuration, a few steps across the testbed with the engine on (benchmarks/
    bench_gpt2_testbed.py measures the step time with and without it)."""
    topo = Topology.load(TOPOLOGIES / "pair.yaml", name=unique_name("gpt2"))
    c = TrainSettings(mode="ddp", model="gpt2-124m", steps=3, seed=1, batch_size=1, seq_len=128, timeout=120,
                    stall_timeout=600, run_timeout=1200, reference=False)
    s = train(topo, c, tmp_path / "run", ber=1e-7, scope="tensor", log=quiet)
    assert s["status"] == "ok", s
    assert s["steps_completed"] == 3
    assert s["bits_seen"] > 3 * 124_439_808 * 32 * 0.9  # every step's gradients crossed the engine
