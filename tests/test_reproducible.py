"""Reproducible wire runs (docs/engine.md, "Seeds and reproducibility"): on the same topology, with the same seeds
and settings, two trainings get the same flips at the same stream offsets, so they count the same flips and end
every step with the same parameters, for DDP and PP. The engines key a connection's flips on its addresses and
its ordinal among the open connections between them, never on gloo's ephemeral ports (which differ between the
two runs). Both runs use one topology that stays up, as `testbed train NAME` does (the first run's connections
are closed when the second opens its own)."""

from __future__ import annotations

import json

import pytest

from conftest import running
from test_training_testbed import cfg, quiet, up
from testbed.experiments.training import train

BER, STEPS = 1e-5, 8


@pytest.fixture(scope="module")
def pair():
    with up("pair.yaml") as tb:
        yield tb


def steps_of(run_dir) -> dict:
    """rank -> [(step, param_sha256, loss, corrupted_values)] from metrics-rank*.jsonl (corrupted_values: DDP only)"""
    out = {}
    for f in sorted(run_dir.glob("metrics-rank*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out[f.name] = [(r["step"], r["param_sha256"], r["loss"], r["corrupted_values"]) for r in rows]
    return out


@pytest.mark.parametrize("mode", ["ddp", "pp"])
def test_same_seeds_give_the_same_flips_and_parameters_at_every_step(pair, tmp_path, mode):
    two_runs_agree(pair, tmp_path, mode)


@pytest.fixture(scope="module")
def pair_bpf():
    with up("pair.yaml", engine="bpf") as tb:
        yield tb


def test_bpf_scope_tensor_gives_the_same_flips_per_field_and_parameters_at_every_step(pair_bpf, tmp_path):
    """The bpf engine in scope tensor (flips a pure function of each connection's identity and eligible offset,
    computed in the kernel): two DDP runs count the same flips per engine and field and end every step with the
    same parameters."""
    runs = two_runs_agree(pair_bpf, tmp_path, "ddp")
    now = pair_bpf.counters()
    assert len(now) == 2 and all(e["engine"] == "bpf" and e["keyed"] and e["flows_desynced"] == 0
                                 for e in now.values()), now
    assert engine_flips(runs[0]) == engine_flips(runs[1])
    assert sum(f[0] for f in engine_flips(runs[0])) > 0


@pytest.mark.docker
def test_docker_hosts_give_the_same_flips_and_parameters_at_every_step(worker_image, load_topology, tmp_path):
    """The same on container hosts (the runtime changes who owns the namespaces, not the engines' keys)."""
    with running(load_topology("pair.yaml", ber=0.0, scope="tensor"), runtime="docker") as tb:
        two_runs_agree(tb, tmp_path, "ddp")


def two_runs_agree(tb, tmp_path, mode: str) -> list[dict]:
    """Two trainings with the same seeds agree step by step; returns their summaries."""
    runs = []
    for k in ("a", "b"):
        # sanitize: the updates happen despite corrupted values, so the parameters depend on where flips land
        s = train(tb.name, cfg(mode, 5, steps=STEPS, guard="sanitize"), tmp_path / k, ber=BER, scope="tensor",
                  log=quiet)
        assert s["status"] == "ok", s
        assert s["steps_completed"] == STEPS
        assert s["bits_flipped"] > 0, s["engines"]
        runs.append((s, steps_of(tmp_path / k)))
    (a, steps_a), (b, steps_b) = runs
    assert (a["bits_seen"], a["bits_flipped"]) == (b["bits_seen"], b["bits_flipped"])
    assert [e["bits_flipped"] for e in a["engines"]] == [e["bits_flipped"] for e in b["engines"]]
    assert len(steps_a) == 2 and all(len(rows) == STEPS for rows in steps_a.values())
    assert steps_a == steps_b
    assert all(len({row[1] for row in rows}) == STEPS for rows in steps_a.values())  # the parameters moved
    if mode == "ddp":  # corrupted gradients arrived (compared with the clean reference allreduce)
        assert sum(row[3] for rows in steps_a.values() for row in rows) > 0
    return [a, b]


def hashes(run_dir) -> dict:
    """rank -> [(step, param_sha256, perturbed)]"""
    out = {}
    for f in sorted(run_dir.glob("metrics-rank*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out[int(f.name.removeprefix("metrics-rank").removesuffix(".jsonl"))] = [
            (r["step"], r["param_sha256"], r["perturbed"]) for r in rows]
    return out


@pytest.mark.parametrize("mode", ["ddp", pytest.param("pp", marks=pytest.mark.slow)])  # pp: make test-all (time)
def test_perturb_controls_at_ber_0_are_reproducible_and_minimal(pair, tmp_path, mode):
    """The chaos-floor controls (--perturb, docs/training.md) on real gloo across pair at BER 0: each control run
    twice gives the same parameters at every step; weight-lsb changes the parameters of the ranks holding the
    flipped value from step 1 on and not at step 0; lsb flips one gradient value at step 1 and, measured, never
    reaches the weights (Adam's moments absorb a one-ulp change of one gradient value: the run stays bit-identical
    to the unperturbed one); order changes the parameters from the first update."""
    steps = 4
    runs = {}
    for perturb in ("none", "lsb", "weight-lsb", "order"):
        for k in ("a", "b") if perturb != "none" else ("a",):
            out = tmp_path / f"{perturb}-{k}"
            s = train(pair.name, cfg(mode, 3, steps=steps, perturb=perturb), out, ber=0.0, scope="tensor", log=quiet)
            assert s["status"] == "ok", s
            assert s["bits_flipped"] == 0
            runs.setdefault(perturb, []).append(hashes(out))
    clean = runs["none"][0]
    assert len(clean) == 2 and all(len(rows) == steps for rows in clean.values())
    for perturb in ("lsb", "weight-lsb", "order"):
        assert runs[perturb][0] == runs[perturb][1], perturb  # repeat runs are identical, step by step
    holders = [0, 1] if mode == "ddp" else [0]  # DDP: every replica alike; PP: stage 0 holds wte
    for perturb in ("lsb", "weight-lsb"):
        got = runs[perturb][0]
        for rank, rows in got.items():
            flipped = [step for step, _, index in rows if index is not None]
            assert flipped == ([1] if rank in holders else []), (perturb, rank, rows)
            assert rows[0][1] == clean[rank][0][1], (perturb, rank)  # step 0: nothing perturbed yet
    w = runs["weight-lsb"][0]
    for rank in holders:
        assert all(w[rank][s][1] != clean[rank][s][1] for s in range(1, steps)), w[rank]
    assert [h for _, h, _ in runs["lsb"][0][0]] == [h for _, h, _ in clean[0]]  # absorbed (see the docstring)
    order = runs["order"][0]
    assert order[0][0][1] != clean[0][0][1]  # another summation order: other rounding from the first update


def engine_flips(s: dict) -> list[tuple]:
    """Per engine: bits flipped and the flips per field (sign, exponent, mantissa)."""
    return [tuple(e.get(k) for k in ("bits_flipped", "flips_sign", "flips_exponent", "flips_mantissa"))
            for e in s["engines"]]


def test_link_seed_run_makes_each_seed_its_own_draw_of_the_link(load_topology, tmp_path):
    """The default, link_seed topology: two run seeds get the same flips (per engine and field), since the
    engines are seeded by the topology's link seeds alone (docs/experiments.md, "What a seed varies");
    link_seed run mixes the run seed into every direction's seed, so another seed draws other flips."""
    topo = load_topology("pair.yaml")
    runs = {}
    for k, seed, link_seed in (("a", 1, "topology"), ("b", 2, "topology"), ("c", 2, "run")):
        s = train(topo, cfg("ddp", seed, steps=4, guard="sanitize", link_seed=link_seed), tmp_path / k, ber=BER,
                  scope="tensor", log=quiet)
        assert s["status"] == "ok", s
        runs[k] = engine_flips(s)
        assert sum(f[0] for f in runs[k]) > 0, s["engines"]
    assert runs["a"] == runs["b"]
    assert runs["c"] != runs["b"]
