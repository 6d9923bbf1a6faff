"""`testbed run` and `testbed report` end to end: a small experiment on real topologies, its outputs'
schema, valid PNGs, resumption after SIGINT, and a report rebuilt from results alone."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, TESTBED, tb_cli
from testbed.analysis import results

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {"point", "baseline", "experiment", "fingerprint", "mode", "ber", "scope", "checksum", "seed", "model",
            "steps", "topology", "runtime", "world_size", "status", "reason", "steps_completed", "skipped_steps",
            "final_loss", "final_eval_loss", "loss_curve", "eval_curve", "grad_norm_curve", "step_time_curve",
            "median_step_time_s", "bits_seen", "bits_flipped", "realized_ber", "nonfinite_received_total",
            "corrupted_values_total", "deviation_curve", "final_deviation", "replica_divergence_curve",
            "final_replica_divergence", "n_params", "lr", "grad_clip", "wall_time_s", "finished_at"}


def experiment(tmp_path: Path, name: str, bers: str, steps: int = 4, extra: str = "") -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"""name: {name}
model: tiny
steps: {steps}
topologies: {{ddp: {ROOT}/topologies/pair.yaml}}
grid: {{mode: [ddp], ber: [{bers}], scope: [tensor], checksum: [fix], seed: [1]}}
train: {{batch_size: 4, seq_len: 32, eval_every: 2, timeout: 15}}
{extra}""")
    return f


def leftovers_named(prefix: str) -> dict:
    """What `clean.leftovers()` finds of topologies whose name starts with `prefix`: namespaces, /etc/netns
    files, containers, state directories (under the real state root, TESTBED_STATE_DIR included) and engines
    (by their config under that root). Other topologies (concurrent test runs) are not looked at."""
    from testbed import clean, procs
    from testbed.state import state_dir

    mine = {}
    for kind, found in clean.leftovers().items():
        if kind == "engines":
            root = str(state_dir(prefix))  # the state directory of such a topology starts with this
            hits = [pid for pid in found if any(a.startswith(root) for a in procs.cmdline(pid) or [])]
        else:
            hits = [x for x in found if x.startswith((prefix, f"tb.{prefix}"))]
        if hits:
            mine[kind] = hits
    return mine


def rows_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def assert_valid_pngs(out: Path, at_least: int) -> None:
    import matplotlib.image

    pngs = sorted(out.glob("*.png"))
    assert len(pngs) >= at_least, pngs
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_SIGNATURE, p
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, p


def test_two_point_experiment_outputs(tmp_path, runtime):
    out = tmp_path / "out"
    r = tb_cli("run", str(experiment(tmp_path, "two", "0, 1e-5")), "--out", str(out), "--runtime", runtime,
               timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "report:" in r.stdout
    rows = rows_of(out)
    assert [x["point"] for x in rows] == ["ddp-ber0-tensor-fix-s1", "ddp-ber1e-5-tensor-fix-s1"]
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
        assert list(row) == list(results.ROW_FIELDS)  # the one results schema, in its order
        assert results.row_problems(row) == [], results.row_problems(row)
        assert row["status"] == "ok" and row["runtime"] == runtime
        assert len(row["loss_curve"]) == 4 and row["eval_curve"]
        if runtime == "docker":
            assert row["image_digest"].startswith("sha256:")
    clean, noisy = rows
    assert clean["bits_flipped"] == 0 and noisy["bits_flipped"] > 0
    assert clean["final_deviation"] == 0.0 and noisy["final_deviation"] > 0
    assert (out / "summary.csv").read_text().count("\n") == 3
    report = (out / "report.md").read_text()
    assert "| config | BER |" in report and "ddp" in report.lower()
    assert_valid_pngs(out, at_least=4)
    for row in rows:
        assert (out / row["run_dir"] / "metrics.jsonl").exists()

    # `testbed report` rebuilds everything from results.jsonl alone (no run directories).
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "results.jsonl", alone)
    r = tb_cli("report", str(alone))
    assert r.returncode == 0, r.stderr
    assert (alone / "report.md").read_text().splitlines()[0].startswith("# ")
    assert (alone / "summary.csv").exists()
    assert_valid_pngs(alone, at_least=4)
    r = tb_cli("report", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no results.jsonl" in r.stderr


def test_a_recipe_reaches_the_engine_and_the_rows(tmp_path):
    # one recipe, two points: the link protects sign and exponent, so only mantissa bits flip; equal tokens
    extra = "recipes: {protect: {link: {protect: [sign, exponent]}}}\ntokens_per_step: 256\n"
    f = experiment(tmp_path, "rcp", "0, 1e-4", extra=extra)
    f.write_text(f.read_text().replace("grid: {mode: [ddp],", "grid: {recipe: [protect], mode: [ddp],")
                 .replace("batch_size: 4, ", ""))
    out = tmp_path / "out"
    r = tb_cli("run", str(f), "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(out)
    assert [x["point"] for x in rows] == ["ddp-ber0-tensor-fix-protect-s1", "ddp-ber1e-4-tensor-fix-protect-s1"]
    for row in rows:
        assert results.row_problems(row) == [] and row["recipe"] == "protect" and row["status"] == "ok"
        assert (row["tokens_per_step"], row["batch_size"], row["protect"]) == (256, 4, "sign,exponent")
    clean, noisy = rows
    assert noisy["baseline"] == clean["point"] and clean["protected_ber"] is None
    assert noisy["flips_mantissa"] > 0 and noisy["flips_sign"] == noisy["flips_exponent"] == 0
    assert noisy["skipped_steps"] == 0 and noisy["made_progress"] in (True, False)
    assert "| protect |" in (out / "report.md").read_text()


def test_sigint_then_rerun_completes_only_missing_points(tmp_path):
    exp = experiment(tmp_path, "intr", "0, 1e-6, 1e-5", steps=60)  # the last two points outlast the checks below
    out = tmp_path / "out"
    # SIGINT at its default: a suite started in the background by a non-interactive shell has it ignored, and
    # an ignored SIGINT is inherited, so the run would never see the Ctrl-C this test sends
    p = subprocess.Popen([*TESTBED, "run", str(exp), "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if (out / "results.jsonl").exists() and len(rows_of(out)) >= 1:
            break
        time.sleep(0.2)
    # The runner names its topologies EXPERIMENT[:8] + its pid + "-POINT": those of this run start with
    prefix = f"intr{p.pid % 10000}-"
    # Interrupt while a topology is up (so that the check below has something to find if SIGINT leaked it): in
    # the second point (warm points keep the first point's topology up; a fixed sleep here could outlast the run)
    deadline = time.monotonic() + 60
    while not leftovers_named(prefix) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers_named(prefix), f"no topology {prefix}* is up to interrupt"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0
    first = rows_of(out)
    assert 1 <= len(first) < 3, err[-2000:]
    assert first[0]["topology"].startswith(prefix), first[0]["topology"]  # the prefix above is the real one
    # Nothing half-written: every line parses (checked above), no temp files, no topology left behind.
    assert not [f for f in out.iterdir() if f.name.startswith(".")]
    left = leftovers_named(prefix)
    assert not left, f"the interrupted run left {left}"

    r = tb_cli("run", str(exp), "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(first)} of 3 points already" in r.stderr
    final = rows_of(out)
    assert [x["point"] for x in final] == ["ddp-ber0-tensor-fix-s1", "ddp-ber1e-6-tensor-fix-s1",
                                           "ddp-ber1e-5-tensor-fix-s1"]
    assert final[: len(first)] == first  # finished points were not run again


def test_bad_experiment_file_is_a_clear_error(tmp_path):
    f = experiment(tmp_path, "bad", "0, 0.9")
    r = tb_cli("run", str(f), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "grid.ber" in r.stderr and str(f) in r.stderr
    f = tmp_path / "nomode.yaml"
    f.write_text(experiment(tmp_path, "nm", "0").read_text().replace("mode: [ddp]", "mode: [ddp, pp]"))
    r = tb_cli("run", str(f), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "topologies.pp" in r.stderr


@pytest.mark.parametrize("file", ["quick.yaml", "recipes.yaml", "thresholds.yaml", "resync.yaml", "paper-ddp.yaml", "paper-pp.yaml"])
def test_shipped_experiments_load(file):
    from testbed.experiments.spec import Experiment

    exp = Experiment.load(ROOT / "experiments" / file)
    assert exp.points() and all(p.ber == 0 for p in exp.points()[: len({(q.mode, q.seed) for q in exp.points()})])
