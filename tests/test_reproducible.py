"""Reproducible wire runs (docs/engine.md, "Seeds and reproducibility"): on the same topology, with the same seeds
and settings, two trainings get the same flips at the same stream offsets, so they count the same flips and end
every step with the same parameters, for DDP and PP. The engines key a connection's flips on its addresses and
its ordinal among the open connections between them, never on gloo's ephemeral ports (which differ between the
two runs). Both runs use one topology that stays up, as `testbed train NAME` does (the first run's connections
are closed when the second opens its own)."""

from __future__ import annotations

import json

import pytest

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
    runs = []
    for k in ("a", "b"):
        # sanitize: the updates happen despite corrupted values, so the parameters depend on where flips land
        s = train(pair.name, cfg(mode, 5, steps=STEPS, guard="sanitize"), tmp_path / k, ber=BER, scope="tensor",
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
