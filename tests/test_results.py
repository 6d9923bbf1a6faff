"""The results.jsonl schema (testbed/analysis/results.py) and the rows the runner builds from it: a trained
point's row and a set-up failure's row have exactly the schema's fields with the schema's types. Pure: fake run
directories, no namespaces, no training; runs without root."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT
from testbed.experiments import runner
from testbed.analysis import results
from testbed.experiments.spec import Experiment
from testbed.train.fingerprint import encode_sample

STEPS = 4


def test_schema_is_consistent():
    names = [f.name for f in results.FIELDS]
    assert len(names) == len(set(names))
    assert set(results.ERROR_ROW_FIELDS) < set(names)
    assert {"point", "status", "reason", "fingerprint", "finished_at"} <= set(results.ERROR_ROW_FIELDS)
    assert all(results.FIELDS_BY_NAME[c].scalar for c in results.SUMMARY_COLUMNS)
    assert not {"loss_curve", "machine", "collectives"} & set(results.SUMMARY_COLUMNS)
    assert set(results.SETUP_FIELDS) <= set(names) and set(results.CONFIG_FIELDS) <= set(names)
    assert all(f.doc and f.json_type in ("str", "int", "float", "bool", "list", "dict") for f in results.FIELDS)
    table = results.markdown_table()
    assert all(f"| `{n}` |" in table for n in names)


def test_docs_table_is_the_schema():
    """docs/experiments.md's table of results fields is markdown_table(), row for row: a field added to (or
    changed in) FIELDS fails here until the doc is regenerated."""
    doc = (ROOT / "docs" / "experiments.md").read_text().splitlines()
    start = doc.index("| field | type | error row | meaning |")
    end = next((i for i in range(start, len(doc)) if not doc[i].startswith("|")), len(doc))
    documented, table = doc[start:end], results.markdown_table().splitlines()
    assert documented == table, (
        f"docs/experiments.md lists {len(documented) - 2} results fields, the schema has {len(table) - 2}; "
        f"missing or stale in the doc: {sorted(set(table) ^ set(documented))}. Replace the table with the output "
        "of `python -m testbed.analysis.results`")


def test_new_row_refuses_missing_and_unknown_fields():
    full = dict.fromkeys(results.ROW_FIELDS)
    assert list(results.new_row(**full)) == list(results.ROW_FIELDS)
    with pytest.raises(ValueError, match="missing run_dir"):
        results.new_row(**{k: v for k, v in full.items() if k != "run_dir"})
    with pytest.raises(ValueError, match="unknown hostname"):
        results.new_row(**full, hostname="h1")
    with pytest.raises(ValueError, match="missing point"):
        results.error_row(status="error")
    with pytest.raises(KeyError, match="final_evalloss"):
        results.field_names("final_eval_loss", "final_evalloss")


def test_validate_row_names_every_problem():
    row = {**dict.fromkeys(results.ERROR_ROW_FIELDS), "point": "p", "status": "error", "steps_completed": "0"}
    problems = results.row_problems(row)
    assert "steps_completed: expected int, got '0'" in problems
    assert "baseline: expected str, got None" in problems
    assert not [p for p in problems if "missing" in p or "unknown" in p]  # an error row's shape
    with pytest.raises(ValueError, match="results row 'p'"):
        results.validate_row(row)
    assert results.FIELDS_BY_NAME["ber"].accepts(0) and not results.FIELDS_BY_NAME["ber"].accepts(True)
    assert not results.FIELDS_BY_NAME["final_loss"].accepts(float("nan"))
    assert "status: expected one of" in " ".join(results.row_problems({"status": "fine"}))


def _experiment(tmp_path) -> Experiment:
    f = tmp_path / "exp.yaml"
    f.write_text(f"name: rows\nmodel: tiny\nsteps: {STEPS}\ntopologies: {{ddp: {ROOT}/topologies/pair.yaml}}\n"
                 "grid: {mode: [ddp], ber: [0, 1e-5]}\n")
    return Experiment.load(f)


def _fake_run(run_dir, drift: float, shift: float) -> None:
    """metrics.jsonl (rank 0 and 1) and per-rank parameter fingerprints, as the DDP worker writes them: every
    sampled coordinate of rank 0 is `drift` away from the clean run's, rank 1's `shift` more."""
    run_dir.mkdir(parents=True)
    metrics = []
    for rank in (0, 1):
        fingerprints = []
        for step in range(STEPS):
            metrics.append({"step": step, "rank": rank, "loss": 6.0 - step / 10, "grad_norm": 1.0,
                            "step_time_s": 0.1 + rank / 100, **({"eval_loss": 5.5} if step == STEPS - 1 else {})})
            sample = np.full(8, step + drift + shift * rank, dtype=np.float32)
            fingerprints.append({"step": step, "rank": rank, "param_count": 8, "param_sample": encode_sample(sample)})
        (run_dir / f"metrics-rank{rank}.jsonl").write_text("".join(json.dumps(m) + "\n" for m in fingerprints))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def _summary(ber: float) -> dict:
    return {"topology": "pair", "runtime": "netns", "world_size": 2, "status": "ok", "reason": None,
            "steps_completed": STEPS, "skipped_steps": 0, "final_loss": 5.7, "final_eval_loss": 5.5,
            "median_step_time_s": 0.11, "median_comm_time_s": 0.02, "bits_seen": 10_000,
            "bits_flipped": round(ber * 10_000), "realized_ber": ber, "nonfinite_received_total": 0,
            "corrupted_values_total": None, "wall_time_s": 3.2, "image_digest": None,
            "config": {"batch_size": 4, "seq_len": 32, "microbatches": None, "lr": 1e-3, "grad_clip": 1.0}}


def test_a_point_whose_baseline_run_is_missing_has_no_deviation(tmp_path):
    """Only the clean run is 0 away from itself. A BER-0 control or a BER point whose baseline's run directory
    is not here (results resumed without points/) has an unknown deviation: None, not 0 (which the chaos floor
    would read as "bit-identical to the clean run")."""
    f = tmp_path / "ctl.yaml"
    f.write_text(f"name: rows\nmodel: tiny\nsteps: {STEPS}\ntopologies: {{ddp: {ROOT}/topologies/pair.yaml}}\n"
                 "recipes: {ctl: {baseline: default, train: {perturb: order}}}\n"
                 "grid: {mode: [ddp], ber: [0, 1e-5], recipe: [default, ctl]}\n")
    exp = Experiment.load(f)
    clean, noisy, control = (next(p for p in exp.points() if p.recipe == r and (p.ber > 0) == b)
                             for r, b in (("default", False), ("default", True), ("ctl", False)))
    assert control.baseline.id == clean.id
    for p, drift in ((clean, 0.0), (noisy, 0.5), (control, 0.25)):
        _fake_run(tmp_path / "points" / p.id, drift=drift, shift=0.0)
    rows = {p.id: runner.point_row(exp, p, _summary(p.ber), tmp_path / "points" / p.id, None)
            for p in (clean, noisy, control)}
    assert (rows[clean.id]["final_deviation"], rows[clean.id]["final_deviation_exact"]) == (0.0, True)
    assert rows[noisy.id]["final_deviation"] is None and rows[control.id]["final_deviation"] is None
    # with the baseline's run there, the control's deviation is measured
    row = runner.point_row(exp, control, _summary(0.0), tmp_path / "points" / control.id, tmp_path / "points" / clean.id)
    assert row["final_deviation"] == pytest.approx(0.25 * np.sqrt(8)) and row["final_deviation_exact"] is False


def test_point_row_has_exactly_the_schema_fields(tmp_path):
    exp = _experiment(tmp_path)
    clean, noisy = exp.points()
    _fake_run(tmp_path / "points" / clean.id, drift=0.0, shift=0.0)
    _fake_run(tmp_path / "points" / noisy.id, drift=0.25, shift=0.5)
    base = runner.point_row(exp, clean, _summary(0.0), tmp_path / "points" / clean.id, None)
    row = runner.point_row(exp, noisy, _summary(1e-5), tmp_path / "points" / noisy.id, tmp_path / "points" / clean.id)
    for r in (base, row):
        assert list(r) == list(results.ROW_FIELDS)
        r["fingerprint"] = "0123456789abcdef"  # run_point's part
        assert results.row_problems(r) == []
        json.dumps(r, allow_nan=False)  # what ResultsStore writes
    assert base["final_deviation"] == 0.0 and base["final_deviation_exact"] is True
    assert row["loss_curve"] == pytest.approx([6.0, 5.9, 5.8, 5.7]) and row["eval_curve"] == [[3, 5.5]]
    assert row["step_time_curve"] == pytest.approx([0.11] * STEPS)
    assert row["collectives"] == ["allreduce"] and row["run_dir"] == f"points/{noisy.id}"
    # no saved parameters: the last step's estimate, sqrt(N/n * sum of squares) over the 8 sampled coordinates
    assert row["final_deviation"] == pytest.approx(0.25 * np.sqrt(8)) and row["final_deviation_exact"] is False
    assert [s for s, _ in row["deviation_curve"]] == list(range(STEPS))
    assert row["final_replica_divergence"] == pytest.approx(0.5 * np.sqrt(8))
    assert (row["batch_size"], row["seq_len"], row["lr"]) == (4, 32, 1e-3)


def test_a_failed_set_up_gives_an_error_row(tmp_path, monkeypatch):
    exp = _experiment(tmp_path)

    def no_training(*args, **kwargs):
        raise RuntimeError("no namespaces in this test")

    monkeypatch.setattr(runner, "train", no_training)
    row = runner.run_point(exp, exp.points()[0], tmp_path, None, "0123456789abcdef", "rows-0")
    assert list(row) == list(results.ERROR_ROW_FIELDS)
    assert results.row_problems(row) == []
    assert row["status"] == "error" and row["reason"] == "RuntimeError: no namespaces in this test"
    assert row["runtime"] == "netns" and row["steps_completed"] == 0


def test_point_row_carries_the_recipe_tokens_and_engine_fields(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text(f"name: rows\nmodel: tiny\nsteps: {STEPS}\ntokens_per_step: 256\n"
                 f"topologies: {{ddp: {ROOT}/topologies/pair.yaml}}\n"
                 "recipes: {protect: {train: {guard: sanitize}, link: {protect: [sign, exponent]}}}\n"
                 "grid: {recipe: [protect], mode: [ddp], ber: [0, 1e-5]}\ntrain: {seq_len: 32}\n")
    exp = Experiment.load(f)
    clean, noisy = exp.points()
    _fake_run(tmp_path / "points" / noisy.id, drift=0.25, shift=0.5)
    engine = {"flips_sign": 0, "flips_exponent": 0, "flips_mantissa": 3, "bits_exposed": 7_000}
    summary = {**_summary(1e-5), "lost_step_fraction": 0.0, "sanitized_values": 2, "frozen_values": 0,
               "initial_eval_loss": 6.2, "made_progress": True, "wire_bytes_per_step": 947_712.0,
               "engines": [engine, {**engine, "flips_mantissa": 4}],
               "config": {**_summary(1e-5)["config"], **vars(exp.train_settings(noisy))}}
    row = runner.point_row(exp, noisy, summary, tmp_path / "points" / noisy.id, None)
    row["fingerprint"] = exp.fingerprint(None, "protect")
    assert results.row_problems(row) == []
    assert (row["point"], row["baseline"], row["recipe"]) == ("ddp-ber1e-5-tensor-fix-protect-s1",
                                                              "ddp-ber0-tensor-fix-protect-s1", "protect")
    assert (row["tokens_per_step"], row["batch_size"], row["guard"], row["wire_dtype"]) == (256, 4, "sanitize", "fp32")
    assert (row["protect"], row["element"], row["protected_ber"]) == ("sign,exponent", "fp32", None)
    assert (row["flips_mantissa"], row["flips_sign"], row["bits_exposed"]) == (7, 0, 14_000)
    assert (row["sanitized_values"], row["made_progress"], row["initial_eval_loss"]) == (2, True, 6.2)
    # a summary from before these fields: nulls, never a KeyError
    old = runner.point_row(exp, noisy, _summary(1e-5), tmp_path / "points" / noisy.id, None)
    assert old["flips_sign"] is None and old["made_progress"] is None and old["lost_step_fraction"] is None
