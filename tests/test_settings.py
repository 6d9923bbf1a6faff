"""One source of training settings (testbed/train/settings.py) and what is derived from it: the worker's CLI,
`testbed train`'s flags, the experiment file's `train:` schema, the runner's config and the workers' argv.

Pure logic: no root, no workers started."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from conftest import ROOT
from testbed.experiments.spec import Experiment, ExperimentFile, TrainSpec
from testbed.train import settings
from testbed.train.settings import TrainSettings, default_of, described
from testbed.train.worker import build_parser as worker_parser

WORKER_REQUIRED = ["--mode", "ddp", "--steps", "1", "--out", "run"]


def experiment_file(tmp_path, train="{}"):
    f = tmp_path / "exp.yaml"
    f.write_text(f"name: t\nsteps: 3\ntopologies: {{ddp: {ROOT}/topologies/pair.yaml}}\n"
                 f"grid: {{mode: [ddp], ber: [0], seed: [2]}}\ntrain: {train}\n")
    return f


def train_subparser():
    from testbed.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_defaults_are_the_same_everywhere(tmp_path):
    from testbed.experiments.runner import train_config

    base = TrainSettings(mode="ddp", steps=1)
    # the worker's CLI
    args = worker_parser().parse_args(WORKER_REQUIRED)
    for s in described():
        if s.worker and not s.required:
            assert getattr(args, s.name) == s.default == getattr(base, s.name), s.name
    # `testbed train`
    cli = train_subparser().parse_args(["pair.yaml", "--out", "o", "--mode", "ddp", "--steps", "1"])
    assert settings.from_args(cli) == base
    # the experiment file's train: section
    assert TrainSpec().model_dump() == {s.name: s.default for s in described() if s.file}
    # the runner's config of a point whose experiment sets nothing under train:
    exp = Experiment.load(experiment_file(tmp_path))
    point = exp.points()[0]
    assert train_config(exp, point) == TrainSettings(mode="ddp", steps=3, seed=2, model=exp.spec.model,
                                                     run_timeout=exp.spec.point_timeout)
    assert exp.spec.model == default_of("model")
    # one process-group timeout default
    assert default_of("timeout") == args.timeout == 30.0


def test_worker_argv_round_trips_through_the_worker_cli():
    cfg = TrainSettings(mode="pp", steps=5, model="small", seed=3, batch_size=6, seq_len=100, lr=2.5e-4,
                        microbatches=3, schedule="1f1b", reference=False, save_final=True, max_skips=2,
                        data="/tmp/x.txt", threads=2, hosts=3, collectives=["p2p"], stall_timeout=9,
                        optimizer="sgd", momentum=0.5, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0,
                        lr_schedule="cosine", warmup_steps=2, clip="value", grad_clip=0.5, guard="sanitize",
                        sanitize_threshold=50.0, wire_dtype="bf16")
    args = worker_parser().parse_args([*cfg.worker_argv(), "--out", "run"])
    parsed = settings.from_args(args)
    for s in described():
        if s.worker:
            assert getattr(parsed, s.name) == getattr(cfg, s.name), s.name
        else:  # the launcher's own settings never reach the worker
            assert s.flag not in cfg.worker_argv() and not hasattr(args, s.name)
    # None means "the worker decides": left out
    assert "--seq-len" not in TrainSettings(mode="ddp", steps=1).worker_argv()


@pytest.mark.parametrize("field,value,problem", [
    ("batch_size", 0, ">= 1"), ("lr", 0.0, "> 0"), ("timeout", -1.0, "> 0"), ("schedule", "zigzag", "one of"),
    ("model", "gpt5", "one of"), ("max_skips", -1, ">= 0"), ("steps", 0, ">= 1"), ("batch_size", "8", "int"),
    ("guard", "ignore", "one of"), ("clip", "global", "one of"), ("wire_dtype", "fp8", "one of"),
    ("optimizer", "lion", "one of"), ("lr_schedule", "linear", "one of"), ("warmup_steps", -1, ">= 0"),
    ("sanitize_threshold", 0.0, "> 0"), ("eps", 0.0, "> 0"), ("momentum", 1.5, "<= 1"),
    ("weight_decay", -0.1, ">= 0"),
])
def test_range_errors_name_the_field(tmp_path, capsys, field, value, problem):
    with pytest.raises(ValueError, match=rf"^{field}: must .*{problem}"):
        TrainSettings(**{"mode": "ddp", "steps": 1, field: value})
    if isinstance(value, str) and field == "batch_size":
        return  # a command line is all strings; a file has types
    flag = "--" + field.replace("_", "-")
    with pytest.raises(SystemExit):
        worker_parser().parse_args([*WORKER_REQUIRED, flag, str(value)])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and (problem in err or "invalid choice" in err), err
    if described()[[s.name for s in described()].index(field)].file:
        with pytest.raises(ValidationError) as e:
            TrainSpec.model_validate({field: value})
        assert e.value.errors()[0]["loc"] == (field,)
        with pytest.raises(Exception, match=rf"train\.{field}"):
            Experiment.load(experiment_file(tmp_path, f"{{{field}: {value}}}"))


def test_settings_across_fields_and_unknown_ones_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^seq_len: must be <= 64 \(the context of tiny\)"):
        TrainSettings(mode="ddp", steps=1, seq_len=65)
    with pytest.raises(ValueError, match=r"^microbatches: must divide batch_size 8"):
        TrainSettings(mode="pp", steps=1, microbatches=3)
    with pytest.raises(ValueError, match=r"^resync_every: only ddp has replicas"):
        TrainSettings(mode="pp", steps=1, resync_every=1)
    with pytest.raises(Exception, match=r"train\.batch_sise"):
        Experiment.load(experiment_file(tmp_path, "{batch_sise: 4}"))
    for unset in ("mode", "steps"):  # set outside train: in an experiment file
        with pytest.raises(ValidationError):
            ExperimentFile.model_validate({"name": "t", "steps": 1, "topologies": {}, "grid": {"mode": ["ddp"],
                                           "ber": [0]}, "train": {unset: 1}})


def test_betas_are_two_floats_everywhere(tmp_path, capsys):
    """A tuple of floats: comma-separated on a command line, a list in a file, a tuple in the settings."""
    assert default_of("betas") == (0.9, 0.95)
    assert worker_parser().parse_args([*WORKER_REQUIRED, "--betas", "0.8, 0.99"]).betas == (0.8, 0.99)
    cfg = TrainSettings(mode="ddp", steps=1, betas=[0.8, 0.99])  # as a file or JSON gives it
    assert cfg.betas == (0.8, 0.99) and cfg.worker_argv()[cfg.worker_argv().index("--betas") + 1] == "0.8,0.99"
    for bad, problem in (("0.9", "2 floats"), ("0.9,x", "2 comma-separated floats"), ("0.9,0.9,0.9", "2 floats")):
        with pytest.raises(SystemExit):
            worker_parser().parse_args([*WORKER_REQUIRED, "--betas", bad])
        assert problem in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^betas: must be in \[0, 1\)"):
        TrainSettings(mode="ddp", steps=1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"^betas: must be 2 floats"):
        TrainSettings(mode="ddp", steps=1, betas=("a", "b"))
    assert "--betas" in train_subparser().format_help()
    exp = Experiment.load(experiment_file(tmp_path, "{betas: [0.8, 0.99], guard: sanitize, wire_dtype: bf16}"))
    from testbed.experiments.runner import train_config

    cfg = train_config(exp, exp.points()[0])
    assert (cfg.betas, cfg.guard, cfg.wire_dtype) == ((0.8, 0.99), "sanitize", "bf16")


def test_nonfinite_is_gone():
    """`guard` replaced it: an old flag is an error, not silently ignored."""
    assert "nonfinite" not in {s.name for s in described()}
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        worker_parser().parse_args([*WORKER_REQUIRED, "--nonfinite", "stop"])


def test_setting_types_are_checked_when_the_settings_are_defined():
    import dataclasses

    bad = dataclasses.make_dataclass("Bad", [("odd", dict, settings.setting(None, "?"))], bases=(TrainSettings,),
                                     frozen=True)
    with pytest.raises(TypeError, match="setting odd"):
        described(bad)


# A field added to the settings dataclass (here at test time, by a subclass put in the registry before the rest
# of testbed is imported) appears in `testbed train --help`, is accepted under an experiment file's train:
# and reaches the worker's parsed arguments: adding a setting is adding a field.
EXTENDED = """
import contextlib, dataclasses, io, json, sys
from testbed.train import settings
settings.TrainSettings = dataclasses.make_dataclass(
    "TrainSettings", [("probe_every", int, settings.setting(5, "probe the wire every K steps", ge=1))],
    bases=(settings.TrainSettings,), frozen=True)

from testbed.cli import main
from testbed.experiments.runner import train_config
from testbed.experiments.spec import Experiment
from testbed.train.worker import build_parser

out = {}
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    main(["train", "--help"])
out["help"] = help_text.getvalue()
exp = Experiment.load(sys.argv[1])
out["spec"] = exp.spec.train.probe_every
cfg = train_config(exp, exp.points()[0])
out["argv"] = cfg.worker_argv()
out["worker"] = build_parser().parse_args([*cfg.worker_argv(), "--out", "run"]).probe_every
out["worker_default"] = build_parser().parse_args(["--mode", "ddp", "--steps", "1", "--out", "r"]).probe_every
try:
    Experiment.load(sys.argv[2])
except Exception as e:
    out["bad"] = str(e)
print(json.dumps(out))
"""


def test_a_new_field_reaches_cli_experiment_file_and_worker(tmp_path):
    good = experiment_file(tmp_path, "{probe_every: 7}")
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("probe_every: 7", "probe_every: 0"))
    r = subprocess.run([sys.executable, "-c", EXTENDED, str(good), str(bad)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert "--probe-every" in out["help"] and "probe the wire every K steps (default: 5)" in out["help"]
    assert out["spec"] == 7
    assert out["argv"][out["argv"].index("--probe-every") + 1] == "7"
    assert out["worker"] == 7 and out["worker_default"] == 5
    assert "train.probe_every" in out["bad"]


def test_the_new_field_is_not_known_without_it():
    """The registry's subclass lived only in that subprocess."""
    assert "probe_every" not in {s.name for s in described()}
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        worker_parser().parse_args([*WORKER_REQUIRED, "--probe-every", "3"])
