"""Executors of `testbed run` (testbed/experiments/executors.py): `-j 2` on this machine gives the rows of `-j 1`
(root: wire points), and the pure logic: resources from the file and flags, their Slurm parameters."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.topology.yamlfile import InputError
from testbed.experiments.cli import resources_of
from testbed.experiments.executors import slurm_parameters
from testbed.experiments.spec import Experiment, ResourcesSpec
from testbed.analysis.results import TIMING_FIELDS
from testbed.train.fingerprint import bit_identical

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "topologies" / "pair.yaml"
WHERE = {*TIMING_FIELDS, "machine", "topology"}


def experiment(d: Path, extra: str = "", recipes: str = "wire, process") -> Path:
    f = d / "x.yaml"
    f.write_text(f"""name: par
model: tiny
steps: 6
tokens_per_step: 256
topologies: {{ddp: {PAIR}}}
recipes:
  wire: {{train: {{injector: wire}}}}
  process: {{train: {{injector: process}}}}
grid: {{recipe: [{recipes}], mode: [ddp], ber: [0, 1e-4], seed: [1]}}
train: {{seq_len: 64, lr: 0.003, timeout: 20}}
point_timeout: 300
{extra}""")
    return f


def args(**kw):
    base = {k: None for k in ("cpus", "gpus", "mem", "time", "partition", "account", "sbatch")}
    return argparse.Namespace(**{**base, **kw})


def test_resources_from_the_file_and_flags_over_it(tmp_path):
    exp = Experiment.load(experiment(tmp_path, "resources: {cpus: 8, gpus: 1, memory: 32G, time: 240, partition: "
                                               "gpu, sbatch: {qos: high}}"))
    res = resources_of(exp, args(cpus=4, time=60, sbatch=["constraint=a100", "--exclusive"]))
    assert res == ResourcesSpec(cpus=4, gpus=1, memory="32G", time=60, partition="gpu",
                                sbatch={"qos": "high", "constraint": "a100", "exclusive": True})
    p = slurm_parameters(res, "par")
    assert p["cpus_per_task"] == 4 and p["gpus_per_node"] == 1 and p["mem"] == "32G" and p["time"] == 60
    assert p["partition"] == "gpu" and "account" not in p
    assert p["additional_parameters"] == {"qos": "high", "constraint": "a100", "exclusive": True}
    assert slurm_parameters(ResourcesSpec(), "par")["time"] is None  # the partition's limit, not submitit's 5 min


def test_resources_do_not_change_the_fingerprint(tmp_path):
    plain = Experiment.load(experiment(tmp_path))
    (tmp_path / "y").mkdir()
    sized = Experiment.load(experiment(tmp_path / "y", "resources: {cpus: 8}"))
    assert plain.fingerprint(None, "wire") == sized.fingerprint(None, "wire")


def test_bad_resources_name_the_field(tmp_path):
    with pytest.raises(InputError) as e:
        Experiment.load(experiment(tmp_path, "resources: {memory: lots}"))
    assert "x.yaml:12: resources.memory" in str(e.value)


def test_detach_needs_slurm(tmp_path):
    r = subprocess.run([sys.executable, "-m", "testbed", "run", str(experiment(tmp_path)), "--out",
                        str(tmp_path / "o"), "--detach"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--detach needs --executor slurm" in r.stderr


def rows_of(out: Path) -> dict:
    return {r["point"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


@pytest.mark.privileged
@pytest.mark.slow  # make test-all: the suite stays under its 20 minutes on 2 cores (clean-clone run: 22 min with it)
@pytest.mark.skipif(os.geteuid() != 0, reason="privileged: wire points need root")
def test_two_at_once_equals_one_after_another(tmp_path):
    exp = experiment(tmp_path)
    runs = {}
    for j in ("1", "2"):
        out = tmp_path / f"j{j}"
        r = subprocess.run([sys.executable, "-m", "testbed", "run", str(exp), "--out", str(out), "-j", j],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[j] = rows_of(out)
    a, b = runs["1"], runs["2"]
    assert a.keys() == b.keys()  # (in another order: -j 1 runs a warm group's points together)
    for p in a:
        assert b[p]["status"] == "ok", b[p]["reason"]
        diff = {k for k in a[p] if a[p][k] != b[p][k]} - WHERE
        assert not diff, (p, sorted(diff))
        assert bit_identical(tmp_path / "j1" / "points" / p, tmp_path / "j2" / "points" / p), p
    assert b["ddp-ber1e-4-tensor-fix-wire-s1"]["bits_flipped"] > 0
    assert b["ddp-ber1e-4-tensor-fix-process-s1"]["bits_flipped"] > 0
