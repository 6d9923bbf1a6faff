"""Report, analysis and plots of an experiment (testbed/report/report.py, analysis.py, plots.py): pure
logic on synthetic results.jsonl rows (built through the results schema, results.py) shaped like a real run (tiny GPT-2, 30 steps, DDP and PP on 2 hosts, BER 0/1e-6/1e-5/1e-4,
2 seeds, some runs crashed or diverged with null fields), plus valid PNGs and the report's key table."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from testbed.analysis import analysis
from testbed.report import plots
from testbed.report import report
from testbed.analysis import results

TINY_PARAMS = 236_928
STEPS = 30
BERS = (0.0, 1e-6, 1e-5, 1e-4)
SEEDS = (1, 2)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# what goes wrong where (mode, BER, seed) -> status; everything else is ok
FAILURES = {("pp", 1e-5, 2): "crashed", ("pp", 1e-4, 1): "diverged", ("pp", 1e-4, 2): "crashed"}
# extra eval loss a BER costs (DDP at 1e-4 completes but learns much less: a gap, not a crash)
PENALTY = {("ddp", 1e-4): 0.8, ("pp", 1e-6): 0.01}


def _loss_curve(final: float, rng, steps: int = STEPS, stop: int | None = None) -> list:
    start = math.log(512)  # tiny's vocabulary: the initial loss of a uniform prediction
    curve = [final + (start - final) * math.exp(-s / 8) + rng.normal(0, 0.03) for s in range(steps)]
    return curve[:stop] if stop is not None else curve


def make_row(mode: str, ber: float, seed: int, scope: str = "tensor", checksum: str = "fix",
             recipe: str = "default", **fields) -> dict:
    """One results.jsonl row (every field of the schema) with realistic values; failed runs have null fields.
    The recipe fields are null (as if the rows predated them) unless `fields` sets them."""
    rng = np.random.default_rng([int(ber * 1e7), seed, len(mode)])
    status = FAILURES.get((mode, ber, seed), "ok")
    ok = status == "ok"
    final_eval = 4.6 + 0.02 * seed + PENALTY.get((mode, ber), 0.0) + (0.1 if mode == "pp" else 0.0)
    stop = None if ok else 12
    curve = _loss_curve(final_eval - 0.05, rng, stop=stop)
    if status == "diverged":
        curve[-1] = None  # non-finite loss
    bits_seen = 2 * TINY_PARAMS * 32 * (STEPS if ok else 12)
    deviation = 0.3 * math.sqrt(ber / 1e-6) * (1 + 0.05 * seed) if ber > 0 else 0.0
    tag = "" if recipe == "default" else f"-{recipe}"
    point = f"{mode}-ber{ber:g}-{scope}-{checksum}{tag}-s{seed}"
    recipe_fields = dict.fromkeys(("lost_step_fraction", "sanitized_values", "frozen_values", "initial_eval_loss",
                                   "made_progress", "flips_sign", "flips_exponent", "flips_mantissa", "bits_exposed",
                                   "queue_dropped", "user_dropped", "tokens_per_step", "optimizer", "clip", "guard", "sanitize_threshold", "resync_every", "link_seed",
                                   "wire_dtype", "wire_bytes_per_step", "element", "protect", "protected_ber",
                                   "ber_at_lambda", "perturb", "profile", "delay_s", "frames_dropped",
                                   "frames_replayed", "codewords_failed"))
    return results.new_row(**{
        "point": point, "baseline": f"{mode}-ber0-{scope}-{checksum}{tag}-s{seed}", "experiment": "quick",
        "tolerance": 0.01,
        "recipe": recipe, **recipe_fields,
        "fingerprint": "0123456789abcdef", "mode": mode, "ber": ber, "scope": scope, "checksum": checksum,
        "seed": seed, "model": "tiny", "steps": STEPS, "topology": "pair", "runtime": "netns", "injector": "wire", "world_size": 2,
        "status": status, "reason": None if ok else f"rank 1 {status} at step 12",
        "steps_completed": STEPS if ok else 12,
        "skipped_steps": (3 if (mode, ber) == ("ddp", 1e-4) else 0) if ok else None,
        "final_loss": curve[-1] if ok else None, "final_eval_loss": final_eval if ok else None,
        "loss_curve": curve, "eval_curve": [[10, 5.2], [20, 4.8]] + ([[30, final_eval]] if ok else []),
        "grad_norm_curve": [1.0] * len(curve), "step_time_curve": [0.05] * len(curve),
        "median_step_time_s": 0.05 * (1 + 10 * ber * 1e3) if ok else None, "median_comm_time_s": 0.01,
        "bits_seen": bits_seen, "bits_flipped": round(ber * bits_seen), "realized_ber": ber,
        "nonfinite_received_total": 0, "corrupted_values_total": round(ber * bits_seen / 2),
        "deviation_curve": [[s, deviation * s / STEPS] for s in range(0, STEPS, 10)],
        "final_deviation": deviation if ok else None,
        "replica_divergence_curve": [],
        "final_replica_divergence": (deviation / 3 if ber > 0 else 0.0) if ok and mode == "ddp" else None,
        "final_deviation_exact": True if ok else None,
        "n_params": TINY_PARAMS, "lr": 1e-3, "grad_clip": 1.0,
        "batch_size": None, "seq_len": None, "microbatches": None,  # as if the rows predate these fields
        "collectives": ["allreduce" if mode == "ddp" else "p2p"],
        "machine": {"uname": "Linux test 6.1 x86_64", "cpus": 2, "hostname": "test"},
        "wall_time_s": 40.0, "phase_times_s": None, "finished_at": 1.7e9 + 60 * seed, "image_digest": None,
        "placement": None,
        "fault_link": None, "locate": None,  # not a fault-localisation experiment
        "run_dir": f"points/{point}",
    } | fields)


def make_rows(modes=("ddp", "pp")) -> list[dict]:
    return [make_row(m, b, s) for m in modes for b in BERS for s in SEEDS]


def make_latency() -> dict:
    """latency.json as `testbed bench latency` writes it: no engine, engine at BER 0 (fix, keep), then fix and
    keep per BER; keep at 1e-5 waits for TCP's 200 ms RTO in 5 % of round trips."""
    rng = np.random.default_rng(0)

    def entry(engine, ber, checksum, base_us, rto_fraction=0.0):
        samples = base_us * rng.lognormal(0, 0.2, 500)
        samples[: int(rto_fraction * 500)] += 200_000
        label = "no engine" if not engine else f"engine ber 0{' keep' if checksum == 'keep' else ''}" if ber == 0 \
            else f"ber {ber:g} {checksum}"
        q = {f"p{k}_us": float(np.percentile(samples, p)) for k, p in (("50", 50), ("90", 90), ("99", 99),
                                                                        ("999", 99.9))}
        retrans = int(rto_fraction * 500) if checksum == "keep" else 0
        return {"label": label, "engine": engine, "ber": ber, "checksum": checksum, **q,
                "mean_us": float(samples.mean()), "max_us": float(samples.max()),
                "bits_flipped": round(ber * 500 * 2 * 16384 * 8), "retrans_segs": retrans,
                "in_csum_errors": retrans, "rto_timeouts": retrans, "scope": "payload" if engine else None,
                "samples": 500, "errors": [], "samples_us": samples.tolist()}

    return {"topology": "pair", "runtime": "netns", "link": "h1-h2", "size": 16384, "count": 500, "results": [
        entry(False, 0.0, None, 60), entry(True, 0.0, "fix", 90), entry(True, 0.0, "keep", 90),
        entry(True, 1e-6, "fix", 92), entry(True, 1e-6, "keep", 95, 0.002),
        entry(True, 1e-5, "fix", 93), entry(True, 1e-5, "keep", 140, 0.05),
    ]}


def by_key(agg: list[dict]) -> dict:
    return {(p["mode"], p["ber"]): p for p in agg}


# ---------------------------------------------------------------------------------------------------------------
# Inputs and summary.csv
# ---------------------------------------------------------------------------------------------------------------

def test_load_results_tolerates_a_missing_file_and_a_torn_last_line(tmp_path):
    assert report.load_results(tmp_path) == []
    assert report.load_latency(tmp_path) is None
    rows = make_rows(("ddp",))[:3]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"point": "ddp-ber1e-'  # writer killed mid-line
    (tmp_path / "results.jsonl").write_text(text)
    assert [r["point"] for r in report.load_results(tmp_path)] == [r["point"] for r in rows]
    (tmp_path / "latency.json").write_text(json.dumps(make_latency()))
    assert len(report.load_latency(tmp_path)["results"]) == 7


def test_summary_csv_has_scalar_fields_in_a_stable_order(tmp_path):
    rows = make_rows()
    rows[0] = {**rows[0], "hostname": "h1", "engine_stats": {"h1": 3}}  # an extra scalar and a dict
    path = report.write_summary_csv(list(reversed(rows)), tmp_path / "summary.csv")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        lines = list(reader)
    assert reader.fieldnames == list(results.SUMMARY_COLUMNS) + ["hostname"]
    assert not {"loss_curve", "eval_curve", "deviation_curve", "engine_stats"} & set(reader.fieldnames)
    assert len(lines) == len(rows)
    # grid order whatever the input order: mode, scope, checksum, BER, seed
    assert [(r["mode"], float(r["ber"]), r["seed"]) for r in lines[:3]] == [("ddp", 0.0, "1"), ("ddp", 0.0, "2"),
                                                                             ("ddp", 1e-6, "1")]
    crashed = next(r for r in lines if r["point"] == "pp-ber1e-05-tensor-fix-s2")
    assert crashed["status"] == "crashed" and crashed["final_eval_loss"] == "" and crashed["image_digest"] == ""
    assert float(next(r for r in lines if r["point"] == "ddp-ber0.0001-tensor-fix-s1")["final_eval_loss"]) == \
        pytest.approx(5.42)


def test_summary_csv_of_no_rows_is_a_header(tmp_path):
    path = report.write_summary_csv([], tmp_path / "summary.csv")
    assert path.read_text().strip() == ",".join(results.SUMMARY_COLUMNS)


# ---------------------------------------------------------------------------------------------------------------
# aggregate and thresholds
# ---------------------------------------------------------------------------------------------------------------

def test_aggregate_per_point_statistics():
    agg = analysis.aggregate(make_rows())
    assert [(p["mode"], p["ber"]) for p in agg] == [(m, b) for m in ("ddp", "pp") for b in BERS]
    pts = by_key(agg)
    clean = pts[("ddp", 0.0)]
    assert clean["n_seeds"] == 2 and clean["statuses"] == {"ok": 2} and clean["all_ok"]
    assert clean["eval_loss_mean"] == pytest.approx(4.63) and clean["eval_loss_std"] == pytest.approx(0.01414, 1e-3)
    assert clean["loss_gap"] == pytest.approx(0.0)
    hot = pts[("ddp", 1e-4)]
    assert hot["loss_gap"] == pytest.approx(0.8) and hot["loss_gap_rel"] == pytest.approx(0.8 / 4.63)
    assert hot["skipped_steps_mean"] == 3 and hot["skipped_fraction_mean"] == pytest.approx(0.1)
    assert hot["realized_ber"] == pytest.approx(1e-4, rel=1e-3)
    assert hot["bits_flipped_total"] == sum(make_row("ddp", 1e-4, s)["bits_flipped"] for s in SEEDS)
    assert hot["divergence_mean"] == pytest.approx(np.mean([make_row("ddp", 1e-4, s)["final_replica_divergence"]
                                                            for s in SEEDS]))
    # one seed crashed: quality metrics come from the ok seed alone, counters from both
    half = pts[("pp", 1e-5)]
    assert half["statuses"] == {"ok": 1, "crashed": 1} and not half["all_ok"]
    assert half["eval_loss_n"] == 1 and half["eval_loss_std"] is None
    assert half["eval_loss_mean"] == pytest.approx(make_row("pp", 1e-5, 1)["final_eval_loss"])
    assert half["bits_seen_total"] == sum(make_row("pp", 1e-5, s)["bits_seen"] for s in SEEDS)
    dead = pts[("pp", 1e-4)]
    assert dead["statuses"] == {"diverged": 1, "crashed": 1}
    assert dead["eval_loss_mean"] is None and dead["loss_gap"] is None and dead["median_step_time_s"] is None


def test_aggregate_without_a_clean_point_has_no_gap():
    agg = analysis.aggregate([r for r in make_rows(("ddp",)) if r["ber"] > 0])
    assert all(p["loss_gap"] is None and p["clean_eval_loss_mean"] is None for p in agg)
    th = analysis.thresholds(agg)["ddp/tensor/fix"]
    assert th["max_ok_ber"] is None and th["min_fail_ber"] is None and "no clean" in th["note"]


def test_thresholds_find_the_last_passing_and_first_failing_ber():
    th = analysis.thresholds(analysis.aggregate(make_rows()))
    assert set(th) == {"ddp/tensor/fix", "pp/tensor/fix"}
    ddp, pp = th["ddp/tensor/fix"], th["pp/tensor/fix"]
    # DDP completes everywhere but loses 0.8 nats at 1e-4: a loss-gap failure
    assert (ddp["max_ok_ber"], ddp["min_fail_ber"]) == (1e-5, 1e-4)
    assert "gap" in ddp["failing"][1e-4]
    # tolerance = 1 % of the clean mean (the rows' registered tolerance); the gaps per seed are equal, so the
    # upper bound is their mean
    assert ddp["tolerance_abs"] == pytest.approx(0.01 * 4.63, rel=1e-3)
    assert ddp["gaps"][1e-4]["upper"] == pytest.approx(0.8) and ddp["gaps"][1e-4]["n"] == 2
    # PP: one crashed seed at 1e-5 fails the point even though the ok seed's loss is fine
    assert (pp["max_ok_ber"], pp["min_fail_ber"]) == (1e-6, 1e-5)
    assert pp["failing"][1e-5] == "1 crashed" and not pp["non_monotonic"]
    assert pp["published_ber"] == 1e-5 and ddp["published_ber"] == 1e-4
    # theory: one catastrophic value per step; for the tiny model on 2 hosts, between 1e-7 and 1e-4
    for t in (ddp, pp):
        assert 1e-7 < t["theory_ber"] < 1e-4 and t["theory_basis"]


def test_threshold_pairs_seeds_so_clean_seed_noise_cancels():
    rows = make_rows(("ddp",))
    for r in rows:  # seed 2 is 0.5 nats worse at every BER: the clean seeds differ, the paired gaps do not
        if r["seed"] == 2:
            r["final_eval_loss"] += 0.5
    th = analysis.thresholds(analysis.aggregate(rows))["ddp/tensor/fix"]
    assert th["tolerance_abs"] == pytest.approx(0.01 * 4.88, rel=1e-3)
    assert (th["max_ok_ber"], th["min_fail_ber"]) == (1e-5, 1e-4)
    assert th["gaps"][1e-5]["upper"] == pytest.approx(0.0, abs=1e-12)
    # the registered tolerance moves the verdict: at 20 % the 0.8-nat gap at 1e-4 passes
    th = analysis.thresholds(analysis.aggregate(rows), tolerance=0.2)["ddp/tensor/fix"]
    assert (th["max_ok_ber"], th["min_fail_ber"]) == (1e-4, None)
    assert th["sensitivity"][0.05] == (1e-5, 1e-4) and th["sensitivity"][0.2] == (1e-4, None)


def test_thresholds_flag_a_ber_that_passes_again_above_a_failure():
    rows = make_rows(("ddp",))
    for r in rows:
        if r["ber"] == 1e-6 and r["seed"] == 1:
            r.update(status="hung", final_eval_loss=None)
    th = analysis.thresholds(analysis.aggregate(rows))["ddp/tensor/fix"]
    assert th["max_ok_ber"] is None and th["min_fail_ber"] == 1e-6 and th["non_monotonic"]
    assert th["passing_bers"] == [1e-5]
    assert "non-monotonic" in report.threshold_sentence(th)


def test_thresholds_when_the_clean_runs_failed_and_for_checksum_keep():
    rows = [{**r, "status": "crashed", "final_eval_loss": None} for r in make_rows(("pp",))]
    th = analysis.thresholds(analysis.aggregate(rows))["pp/tensor/fix"]
    assert th["tolerance_abs"] is None and "not all ok" in th["note"]
    assert "no threshold" in report.threshold_sentence(th)
    keep = [make_row("ddp", b, s, checksum="keep") for b in BERS for s in SEEDS]
    th = analysis.thresholds(analysis.aggregate(keep))["ddp/tensor/keep"]
    assert th["theory_ber"] is None and "retransmitted" in th["theory_basis"]


def test_theory_threshold_matches_theory_py():
    from testbed.analysis import theory
    ber, _ = analysis.theory_threshold("ddp", "fix", {"n_params": theory.GPT2_124M_PARAMS, "world_size": 4})
    assert ber == pytest.approx(1.79e-9, rel=0.01)  # docs/theory.md: 4 ranks, GPT-2 124M
    ber, _ = analysis.theory_threshold("pp", "fix", {"model": "gpt2-124m", "world_size": 2, "batch_size": 8,
                                                   "seq_len": 1024})
    assert ber == pytest.approx(8.33e-8, rel=0.01)  # docs/theory.md: 2 stages, B 8 x T 1024


# ---------------------------------------------------------------------------------------------------------------
# Deviation fit, latency penalty
# ---------------------------------------------------------------------------------------------------------------

def test_deviation_fit_recovers_the_sqrt_slope_and_carries_the_theory():
    fits = analysis.deviation_fits(make_rows())
    ddp = fits["ddp/tensor/fix"]
    assert ddp["fit"]["slope"] == pytest.approx(0.5, abs=0.02) and ddp["fit"]["n_points"] == 6
    assert [p["ber"] for p in ddp["per_ber"]] == [1e-6, 1e-5, 1e-4]
    assert all(p["theory"] > 0 for p in ddp["per_ber"]) and ddp["theory_slope"] is not None
    pp = fits["pp/tensor/fix"]  # PP at 1e-4 has no ok run; no analytical curve for PP
    assert [p["ber"] for p in pp["per_ber"]] == [1e-6, 1e-5] and pp["per_ber"][0]["theory"] is None
    assert pp["fit"]["slope"] == pytest.approx(0.5, abs=0.05)


def test_theory_deviation_uses_the_runs_setup():
    setup = analysis.run_setup(make_rows(), "ddp")
    assert setup == {"model": "tiny", "n_params": TINY_PARAMS, "steps": STEPS, "lr": 1e-3, "grad_clip": 1.0,
                     "world_size": 2}
    est = analysis.theory_deviation([1e-8, 1e-6], setup)
    assert est.shape == (2,) and 0 < est[0] < est[1]
    assert analysis.theory_deviation([1e-6], {"steps": 30}) is None


def test_retransmission_penalty_compares_keep_with_fix_at_the_same_ber():
    pens = analysis.retransmission_penalties(make_latency())
    assert [p["ber"] for p in pens] == [0.0, 1e-6, 1e-5]  # BER 0: the control
    assert pens[0]["p50_us"]["ratio"] == pytest.approx(1, abs=0.1)
    hot = pens[2]["p99_us"]
    assert hot["extra"] > 1e5 and hot["ratio"] > 100  # 5 % of round trips waited for the 200 ms RTO
    assert analysis.retransmission_penalties(None) == []


# ---------------------------------------------------------------------------------------------------------------
# write_report: plots and report.md
# ---------------------------------------------------------------------------------------------------------------

def assert_valid_png(path):
    import matplotlib.image
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, path


def test_write_report_full(tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows()))
    (tmp_path / "latency.json").write_text(json.dumps(make_latency()))
    (tmp_path / "experiment.yaml").write_text(
        "name: quick\nmodel: tiny\nsteps: 30\ntopologies: {ddp: topologies/pair.yaml, pp: topologies/pair.yaml}\n"
        "grid: {mode: [ddp, pp], ber: [0, 1e-6, 1e-5, 1e-4], seed: [1, 2]}\ntrain: {batch_size: 8, lr: 0.001}\n")
    path = report.write_report(tmp_path)
    assert path == tmp_path / "report.md"
    for name in plots.PLOTS:
        assert_valid_png(tmp_path / name)
    md = path.read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temp files
    assert "# Experiment quick" in md and "could not be drawn" not in md and "not drawn" not in md
    assert ("| config | BER | seeds | status | eval loss (mean ± sd) | gap | gap % | skipped steps | deviation "
            "| replica divergence | bits flipped | realized BER | step time (s) |") in md
    assert "| DDP | 1e-04 | 2 | 2 ok | 5.430 ± 0.014 | +0.800 | +17.3 % | 3 |" in md
    assert "| PP | 1e-04 | 2 | 1 diverged, 1 crashed | — |" in md
    assert "**DDP** (tensor/fix) trains as well as on a clean link up to BER 1e-05 and fails from 1e-04" in md
    assert "consistent with the published analysis of GPT-2 124M (PP fine below 1e-05)" in md
    assert "measured slope 0.50" in md
    assert "| ber 1e-05 keep | 1e-05 | keep |" in md and "| engine ber 0 keep | 0 | keep |" in md
    assert "**Delivering errored frames (fix) instead of retransmitting them (keep) saves" in md
    assert "Retransmission penalty, keep against fix" in md
    assert "| frame (B) | BER |" in md and "KP4" in md
    for name in plots.PLOTS:
        assert f"]({name})" in md
    assert "testbed report DIR" in md and "Grid: mode ddp, pp" in md
    assert (tmp_path / "summary.csv").read_text().count("\n") == len(make_rows()) + 1


def test_write_report_renders_missing_data_as_sentences(tmp_path):
    empty = tmp_path / "empty"
    md = report.write_report(empty).read_text()
    assert "No results" in md and "## Latency" not in md and "## Summary" not in md
    assert not list(empty.glob("*.png"))

    ddp_only = tmp_path / "ddp"
    md = report.write_report(ddp_only, rows=make_rows(("ddp",))).read_text()
    assert "No PP points" not in md and "Latency" not in md.split("## Setup")[0]  # left out, not apologised for
    assert "| DDP | 1e-04 |" in md and "| PP |" not in md
    assert (ddp_only / "eval_loss_vs_ber.png").exists() and not (ddp_only / "latency.png").exists()

    crashed = tmp_path / "crashed"
    rows = [{**r, "status": "crashed", "final_eval_loss": None, "final_loss": None, "final_deviation": None,
             "final_replica_divergence": None, "median_step_time_s": None, "skipped_steps": None,
             "loss_curve": r["loss_curve"][:5]} for r in make_rows()]
    md = report.write_report(crashed, rows=rows, latency={"results": []}).read_text()
    assert "No run finished with status ok" in md and "no threshold" in md
    assert "## Weight deviation" not in md and "could not be drawn" not in md
    assert_valid_png(crashed / "loss_vs_step.png")  # curves up to the crash are still worth seeing


def test_main_writes_the_report(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows(("pp",))))
    assert report.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.md")
    md = (tmp_path / "report.md").read_text()
    assert "at most 1 % of the clean eval loss (tolerance: recorded in the results rows)" in md
    assert "No DDP points" not in md and "| DDP" not in md  # what does not apply is left out


def test_plots_return_none_when_there_is_nothing_to_plot(tmp_path):
    pp_only = make_rows(("pp",))
    assert plots.plot_divergence_vs_ber(pp_only, tmp_path / "d.png") is None  # divergence is DDP only
    assert plots.plot_latency(None, tmp_path / "l.png") is None
    assert plots.plot_latency({"results": [{"label": "no engine", "engine": False}]}, tmp_path / "l.png") is None
    clean_only = [r for r in pp_only if r["ber"] == 0]
    assert plots.plot_eval_loss_vs_ber(clean_only, tmp_path / "e.png") is None
    assert plots.plot_deviation_vs_ber(clean_only, tmp_path / "v.png") is None
    assert not list(tmp_path.iterdir())


def test_plots_survive_exploded_and_non_finite_values(tmp_path):
    rows = make_rows(("ddp",))
    blown = next(r for r in rows if r["ber"] == 1e-4 and r["seed"] == 1)
    blown.update(final_eval_loss=1e6, loss_curve=blown["loss_curve"][:10] + [float("nan"), 3e7, None],
                 median_step_time_s=float("inf"), final_deviation=float("nan"))
    latency = make_latency()
    latency["results"][0]["samples_us"] = None  # quantiles only
    for name, (fn, source) in plots.PLOTS.items():
        path = fn(rows if source == "rows" else latency, tmp_path / name)
        assert path == tmp_path / name
        assert_valid_png(path)


# ---------------------------------------------------------------------------------------------------------------
# Recipes: thresholds per recipe and mode, theory vs measured, orderings, progress
# ---------------------------------------------------------------------------------------------------------------

RECIPE_SETTINGS = {"default": {}, "sanitize": {"guard": "sanitize", "sanitize_threshold": 1e3},
                   "protect": {"protect": "sign,exponent", "element": "fp32"}}


def recipe_rows() -> list[dict]:
    """DDP and PP at matched tokens (1024 per step), three recipes; default DDP loses steps as the theory says,
    default PP fewer than it says, sanitize zeroes values and loses none, protect changes nothing."""
    rows = []
    for recipe, fields in RECIPE_SETTINGS.items():
        for mode in ("ddp", "pp"):
            for ber in BERS:
                for seed in SEEDS:
                    settings = {"tokens_per_step": 1024, "optimizer": "adamw", "clip": "norm", "guard": "skip",
                                "wire_dtype": "fp32", "batch_size": 8 if mode == "ddp" else 16, "seq_len": 64,
                                "initial_eval_loss": 6.2, "made_progress": True} | fields
                    r = make_row(mode, ber, seed, recipe=recipe, **settings)
                    r["status"], r["final_eval_loss"] = "ok", 4.6 + 0.02 * seed + (0.1 if mode == "pp" else 0.0)
                    lost = 0
                    if recipe == "default" and ber > 0:
                        p = analysis.predict_point({**results.recipe_settings(r), **r})
                        lost = round(p.p_step_skipped * STEPS) if mode == "ddp" else 0
                        r["final_eval_loss"] += 2.0 * p.p_step_skipped if mode == "ddp" else (0.5 if ber >= 1e-5 else 0)
                    r["skipped_steps"], r["steps_completed"] = lost, STEPS
                    r["lost_step_fraction"] = lost / STEPS
                    if recipe == "sanitize":
                        r["sanitized_values"] = round(1.5 * 2 * TINY_PARAMS * ber * STEPS) if mode == "ddp" else 0
                    rows.append(r)
    return rows


def test_clopper_pearson_and_time_shift():
    assert analysis.clopper_pearson(0, 10) == (0.0, pytest.approx(1 - 0.025 ** 0.1))
    lo, hi = analysis.clopper_pearson(5, 10)
    assert lo == pytest.approx(0.187, abs=1e-3) and hi == pytest.approx(0.813, abs=1e-3)
    # a loss falling by 0.01 per step: losing f of 100 steps costs 100 f x 0.01; a tolerance of 0.1 allows 10 %
    curve = [5.0 - 0.01 * s for s in range(100)]
    assert analysis.time_shift_fraction(curve, 0.1) == pytest.approx(0.10, abs=0.011)
    assert analysis.time_shift_fraction([5.0] * 100, 0.1) == 1.0  # a flat curve absorbs any loss of steps
    assert analysis.time_shift_fraction(curve[:5], 0.1) is None


def test_recipes_get_their_own_points_thresholds_and_theory():
    rows = recipe_rows()
    agg = analysis.aggregate(rows)
    assert len(agg) == 3 * 2 * len(BERS)
    assert [p["recipe"] for p in agg[:: 2 * len(BERS)]] == ["default", "protect", "sanitize"]
    th = analysis.thresholds(agg)
    assert set(th) == {"ddp/tensor/fix", "pp/tensor/fix", "ddp/tensor/fix/sanitize", "pp/tensor/fix/sanitize",
                       "ddp/tensor/fix/protect", "pp/tensor/fix/protect"}
    assert th["ddp/tensor/fix"]["tokens_per_step"] == 1024 and th["ddp/tensor/fix"]["recipe"] == "default"
    # the default recipe loses steps as lambda says; the time shift turns that into a finite tolerated BER
    t = th["ddp/tensor/fix"]
    assert 0 < t["theory_tolerated_ber"] < t["theory_lost_ber"] < 1e-5 and t["time_shift_fraction"] is not None
    # sanitize and protect lose no steps at any BER, and say why
    assert math.isinf(th["ddp/tensor/fix/sanitize"]["theory_tolerated_ber"])
    assert "sanitize threshold" in th["ddp/tensor/fix/sanitize"]["theory_note"]
    assert "protects sign, exponent" in th["pp/tensor/fix/protect"]["theory_note"]
    comp = {(c["recipe"], c["mode"], c["ber"]): c for c in analysis.theory_comparison(agg)}
    assert comp[("default", "ddp", 1e-6)]["lost"]["verdict"] == "agrees"
    assert comp[("default", "pp", 1e-5)]["lost"]["verdict"] == "below"  # PP loses fewer steps than predicted
    assert comp[("sanitize", "ddp", 1e-5)]["sanitized"]["verdict"] == "agrees"
    assert comp[("sanitize", "ddp", 1e-5)]["lost"]["predicted"] == 0
    # orderings: default has DDP failing first (it loses steps), protect and sanitize cannot tell the modes apart
    ords = {o["recipe"]: o for o in analysis.orderings(th)}
    assert ords["default"]["measured"] == "pp" and not ords["default"]["published_order"]
    assert ords["protect"]["measured"] == "same" and ords["default"]["matched_tokens"] is True


def test_report_renders_the_recipe_x_mode_table_and_the_disagreements(tmp_path):
    rows = recipe_rows()
    md = report.write_report(tmp_path, rows=rows, latency={"results": []}).read_text()
    assert "| recipe | DDP measured | DDP theory | DDP tokens/step | PP measured | PP theory | PP tokens/step |" in md
    assert "| sanitize | ≥ 1e-04 | any (no lost steps) | 1,024 |" in md
    assert "| published (GPT-2 124M) | fine below 1e-04 |" in md
    assert "**DDP** (tensor/fix, recipe sanitize) trains as well as on a clean link at every tested BER" in md
    assert "Recipe **default**: measured, PP tolerates more than DDP" in md
    assert "No recipe reproduces the published ordering (DDP more tolerant than PP; at matched tokens)." in md
    assert "**PP default: the lost-step fraction disagrees with the theory** at 1e-06 measured 0 vs 0.123" in md
    # beside it the backward-only prediction (a forward activation contained by the next LayerNorm): these rows
    # lost no step at all, so they fall below that one too
    assert ("With only the backward part, 1 - exp(-(λ - λ forward)): 0.0634 at 1e-06, 0.481 at 1e-05, 0.999 at "
            "1e-04; inside the measured 95 % interval at 0 of 3; below even it at 3.") in md
    assert "DDP default: the lost-step fraction agrees with the theory at every BER measured" in md
    assert "DDP sanitize: the sanitized count per step agrees with the theory" in md
    assert "Tokens per step: DDP 1,024, PP 1,024" in md
    assert_valid_png(tmp_path / "lost_vs_theory.png")
    assert "![Lost-step fraction vs BER per recipe, measured and theory](lost_vs_theory.png)" in md


def test_a_run_without_progress_is_flagged_and_fails_its_ber(tmp_path):
    rows = make_rows(("ddp",))
    for r in rows:
        if r["ber"] == 1e-6 and r["seed"] == 1:
            r["made_progress"] = False
    agg = analysis.aggregate(rows)
    th = analysis.thresholds(agg)["ddp/tensor/fix"]
    assert th["failing"][1e-6] == "1 ok run(s) made no progress" and th["max_ok_ber"] is None
    md = report.write_report(tmp_path, rows=rows, latency={"results": []}).read_text()
    assert "| DDP | 1e-06 | 2 | 2 ok (1 no progress) |" in md
    # clean runs that learned nothing leave no baseline; rows without made_progress use the loss curve
    flat = [{**r, "final_eval_loss": 6.2} if r["ber"] == 0 else r for r in make_rows(("ddp",))]
    th = analysis.thresholds(analysis.aggregate(flat))["ddp/tensor/fix"]
    assert th["tolerance_abs"] is None and "made no progress" in th["note"]


# ---------------------------------------------------------------------------------------------------------------
# The paired rule on synthetic rows: a known gap passes or fails as the one-sided t bound says
# ---------------------------------------------------------------------------------------------------------------

# five seeds whose clean losses differ by far more than the tolerance (sd 0.16 nats): only pairing can pass them
RULE_SEEDS = (1, 2, 3, 4, 5)
CLEAN = {s: 4.0 + 0.1 * s for s in RULE_SEEDS}  # mean 4.3: the 1 % tolerance is 0.043 nats
RULE_GAPS = {
    1e-7: (0.010, 0.020, 0.000, 0.015, 0.005),  # mean 0.010, bound ~0.018: passes
    3e-7: (0.000, 0.060, 0.010, 0.050, 0.030),  # mean 0.030 < 0.043, but bound ~0.054 > 0.043: fails
    1e-6: (0.040, 0.041, 0.039, 0.040, 0.040),  # mean 0.040, bound ~0.0407 < 0.043: passes again (non-monotonic)
    3e-6: (0.300, 0.250, 0.350, 0.300, 0.280),  # fails at any tolerance of the table
}


def rule_rows(seeds=RULE_SEEDS, gaps=RULE_GAPS, clean_seeds=None) -> list[dict]:
    rows = [make_row("ddp", 0.0, s, final_eval_loss=CLEAN[s], made_progress=True)
            for s in (clean_seeds or seeds)]
    for ber, g in gaps.items():
        rows += [make_row("ddp", ber, s, final_eval_loss=CLEAN[s] + g[i], made_progress=True)
                 for i, s in enumerate(RULE_SEEDS) if s in seeds]
    return rows


def t_bound(values) -> float:
    """The one-sided 95 % upper bound of the mean, written out independently of analysis.upper_bound."""
    from scipy import stats
    v = np.asarray(values, dtype=float)
    return v.mean() + stats.t.ppf(0.95, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))


def test_paired_rule_passes_and_fails_as_the_t_bound_says():
    th = analysis.thresholds(analysis.aggregate(rule_rows()), tolerance=0.01)["ddp/tensor/fix"]
    tol = th["tolerance_abs"]
    assert tol == pytest.approx(0.043)
    for ber, g in RULE_GAPS.items():
        bound = t_bound(g)
        assert th["gaps"][ber]["upper"] == pytest.approx(bound) and th["gaps"][ber]["n"] == 5
        assert th["gaps"][ber]["mean"] == pytest.approx(np.mean(g))
        assert (ber in th["passing_bers"]) == (bound <= tol), (ber, bound)
    assert th["passing_bers"] == [1e-7, 1e-6]
    # the mean gap at 3e-7 is within the tolerance; its upper bound is not
    assert np.mean(RULE_GAPS[3e-7]) < tol < th["gaps"][3e-7]["upper"]
    assert th["failing"][3e-7].startswith("upper bound of the mean gap +0.054 > tolerance 0.043; gaps +0.000")
    # the threshold is the interval (last passing, first failing]; 1e-6 passes above a failure: flagged
    assert (th["max_ok_ber"], th["min_fail_ber"]) == (1e-7, 3e-7) and th["non_monotonic"]
    # sensitivity: 0.5 % (0.0215) fails 1e-7 (bound 0.018 passes) ... and 5 % passes all but 3e-6
    assert th["sensitivity"][0.005] == (1e-7, 3e-7)
    assert th["sensitivity"][0.02] == (1e-6, 3e-6) and th["sensitivity"][0.05] == (1e-6, 3e-6)
    # unpaired, the clean seeds' spread (sd 0.16) would swamp the tolerance: pairing is what makes 1e-7 pass
    assert np.std(list(CLEAN.values()), ddof=1) > 3 * tol


def test_paired_rule_edge_cases():
    # a clean seed missing: the BER runs of that seed have nothing to pair with, so no BER can pass
    th = analysis.thresholds(analysis.aggregate(rule_rows(clean_seeds=(1, 2, 3, 4))))["ddp/tensor/fix"]
    assert th["passing_bers"] == [] and th["max_ok_ber"] is None and th["min_fail_ber"] == 1e-7
    assert th["failing"][1e-7] == "seed(s) 5 have no clean run of the same seed to pair with"
    # a run that made no progress fails its BER, whatever its gap
    rows = rule_rows()
    next(r for r in rows if r["ber"] == 1e-7 and r["seed"] == 3)["made_progress"] = False
    th = analysis.thresholds(analysis.aggregate(rows))["ddp/tensor/fix"]
    assert th["failing"][1e-7] == "1 ok run(s) made no progress" and th["max_ok_ber"] is None
    # a clean run without progress leaves no baseline at all
    rows = rule_rows()
    next(r for r in rows if r["ber"] == 0 and r["seed"] == 2)["made_progress"] = False
    th = analysis.thresholds(analysis.aggregate(rows))["ddp/tensor/fix"]
    assert th["tolerance_abs"] is None and "made no progress" in th["note"] and th["passing_bers"] == []
    # a single seed has no bound: even a zero gap cannot pass
    th = analysis.thresholds(analysis.aggregate(rule_rows(seeds=(1,), gaps={1e-7: (0.0,) * 5})))["ddp/tensor/fix"]
    assert th["failing"][1e-7] == "1 paired seed(s): the upper bound needs at least 2"
    assert analysis.upper_bound([0.0]) is None and analysis.upper_bound([]) is None
    assert analysis.upper_bound([0.02, 0.02, 0.02]) == pytest.approx(0.02)  # no spread: the mean itself
    # a crashed seed fails the BER before any gap is looked at
    rows = rule_rows()
    next(r for r in rows if r["ber"] == 1e-7 and r["seed"] == 1).update(status="crashed", final_eval_loss=None)
    th = analysis.thresholds(analysis.aggregate(rows))["ddp/tensor/fix"]
    assert th["failing"][1e-7] == "1 crashed"


def test_tolerance_comes_from_the_rows_then_the_file():
    rows = rule_rows()
    assert analysis.tolerance_of(rows) == (0.01, "recorded in the results rows")
    assert analysis.tolerance_of([{**r, "tolerance": 0.02} for r in rows], 0.05)[0] == 0.02
    mixed = [{**r, "tolerance": 0.02 if r["seed"] == 1 else 0.01} for r in rows]
    tol, why = analysis.tolerance_of(mixed, 0.05)
    assert tol == 0.05 and "edited" in why
    old = [{**r, "tolerance": None} for r in rows]
    assert analysis.tolerance_of(old, 0.02)[0] == 0.02
    assert analysis.tolerance_of(old) == (0.01, "the default; neither the rows nor an experiment file record one")


def test_report_shows_the_rule_the_sensitivity_and_the_paired_gaps(tmp_path):
    rows = [{**r, "tolerance": 0.02} for r in rule_rows()]
    md = report.write_report(tmp_path, rows=rows, latency={"results": []}).read_text()
    summary = md.split("## Findings")[0]
    assert summary.startswith("# Experiment quick") and "## Summary" in summary
    assert "| default | 1e-06 – 3e-06 |" in summary and "| **paper** (GPT-2 124M) | < 1e-04 |" in summary
    assert "at most 2 % of the clean eval loss (tolerance: recorded in the results rows)" in summary
    assert "| config | 0.5 % | 1 % | 2 % (registered) | 5 % |" in md
    assert "| DDP tensor/fix | 1e-07 – 3e-07 | 1e-07 – 3e-07 | 1e-06 – 3e-06 | 1e-06 – 3e-06 |" in md
    assert "| DDP tensor/fix | 3e-07 | 5 | +0.000, +0.060, +0.010, +0.050, +0.030 | +0.030 | +0.054 | 0.086 | pass |" \
        in md
    assert "| DDP tensor/fix | 3e-06 | 5 | +0.300, +0.250, +0.350, +0.300, +0.280 | +0.296 | +0.331 | 0.086 | " \
           "fail: bound > tolerance |" in md
    assert "Student's t" in md and "last passing" in md
    # the rows' tolerance reaches summary.csv too
    assert "tolerance" in (tmp_path / "summary.csv").read_text().splitlines()[0].split(",")


def test_report_rebuilds_from_summary_csv_when_results_jsonl_was_not_kept(tmp_path):
    report.write_summary_csv(rule_rows(), tmp_path / "summary.csv")
    (tmp_path / "eval_loss_vs_ber.png").write_bytes(PNG_SIGNATURE)  # the original run's plot, kept as it is
    md = report.write_report(tmp_path).read_text()
    assert "rebuilt from summary.csv" in md and "| default | 1e-07 – 3e-07 (non-monotonic) |" in md
    assert "![Final eval loss vs BER](eval_loss_vs_ber.png)" in md
    assert (tmp_path / "eval_loss_vs_ber.png").read_bytes() == PNG_SIGNATURE and not (tmp_path / "results.jsonl").exists()


def test_a_report_without_evals_leaves_the_threshold_sections_out_and_counts_hosts_per_recipe(tmp_path):
    """A locate-like experiment: DDP only, every run ok without an eval loss, two recipes on their own
    topologies (4 and 8 hosts, different tokens per step)."""
    rows = [make_row("ddp", b, s, recipe=rc, final_eval_loss=None, world_size=n, tokens_per_step=64 * n)
            for rc, n in (("ring4", 4), ("star8", 8)) for b in (0.0, 1e-5) for s in SEEDS]
    exp = {"name": "locate", "topologies": {"ddp": "ring4.yaml"}, "grid": {"recipe": ["ring4", "star8"]},
           "recipes": {"ring4": {"topology": "ring4.yaml"}, "star8": {"topology": "star8.yaml"}}}
    md = report.write_report(tmp_path, rows=rows, latency={"results": []}, experiment=exp).read_text()
    assert "Topologies: recipe ring4: ring4.yaml (4 hosts), recipe star8: star8.yaml (8 hosts)" in md
    assert "Tokens per step: DDP 256/512\n" in md  # one mode: nothing to match
    for absent in ("## Summary", "## Thresholds", "no threshold", "No PP points", "clean runs have no eval loss",
                   "## Latency", "Verdicts:", "eval loss (mean ± sd)"):
        assert absent not in md, absent
    assert "| config | BER | seeds | status | skipped steps |" in md


def test_a_locate_report_leads_with_its_detection_table_and_plot(tmp_path):
    """A fault-localisation experiment (one link per faulty point at its BER): report.md opens with the detection
    table per (config, BER), then the detection-vs-BER plot; the theory's comparisons, which assume every link at
    the point's BER, are left out."""
    def scores(ber, seed, fault):
        named = fault if ber >= 1e-6 or seed % 2 else None  # 1e-7: half the faults named
        det = {"detected": named is not None, "link": named, "step": seed if named else None, "top": named,
               "correct": (named == fault) if fault else None, "false_alarm": None if fault else False}
        return {"scores": {d: det for d in ("timing", "consistency", "counters")}}
    rows = []
    for rc, n in (("ring4", 4), ("star8", 8)):
        for b in (0.0, 1e-7, 1e-6, 1e-5):
            for s in range(1, 9):
                fault = None if b == 0 else ("h1-h2" if rc == "ring4" else "h1-s1")
                rows.append(make_row("ddp", b, s, checksum="keep", recipe=rc, final_eval_loss=None, world_size=n,
                                     tokens_per_step=64 * n, fault_link=fault, locate=scores(b, s, fault)))
    exp = {"name": "locate-heldout", "topologies": {"ddp": "ring4.yaml"}, "grid": {"recipe": ["ring4", "star8"]},
           "recipes": {"ring4": {"topology": "ring4.yaml"}, "star8": {"topology": "star8.yaml"}}}
    md = report.write_report(tmp_path, rows=rows, latency={"results": []}, experiment=exp).read_text()
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections[0] == "## Fault localisation", sections
    assert ("| ring4/ddp/keep | 1e-06 | timing | 8 | 8/8 [0.63, 1.00] | 0 | 0 | 8 | 5.5 [2, 9] | "
            "0/8 [0.00, 0.37] |") in md
    assert ("| star8/ddp/keep | 1e-07 | counters | 8 | 4/8 [0.16, 0.84] | 0 | 4 | 4 | 5 [-] | "
            "0/8 [0.00, 0.37] |") in md
    assert "![Fault localisation: detection time and rate vs BER](detection_vs_ber.png)" in md
    assert md.index("## Fault localisation") < md.index("detection_vs_ber.png") < md.index("## Setup")
    assert_valid_png(tmp_path / "detection_vs_ber.png")
    for absent in ("## Summary", "## Thresholds", "## Weight deviation vs theory", "## Lost steps",
                   "Theory vs measurement", "## Findings"):
        assert absent not in md, absent
    assert "theory's predictions" in md and "do not apply" in md
    assert plots.plot_detection_vs_ber(make_rows(), tmp_path / "none.png") is None  # not a locate experiment


def rule_grid(tmp_path) -> list[dict]:
    """rule_rows() as the rows of an experiment file written to tmp_path (the grid the report reads back)."""
    from conftest import ROOT
    from testbed.experiments.spec import Experiment

    bers = ", ".join(f"{b:g}" for b in RULE_GAPS)
    (tmp_path / "experiment.yaml").write_text(
        f"name: quick\nmodel: tiny\nsteps: 30\ntopologies: {{ddp: {ROOT}/topologies/pair.yaml}}\n"
        f"grid: {{mode: [ddp], ber: [0, {bers}], seed: [{', '.join(map(str, RULE_SEEDS))}]}}\n")
    ids = {(p.mode, p.ber, p.seed): p.id for p in Experiment.load(tmp_path / "experiment.yaml").points()}
    rows = [{**r, "point": ids[(r["mode"], r["ber"], r["seed"])]} for r in rule_rows()]
    return rows


def test_a_report_of_part_of_the_grid_marks_its_thresholds_provisional(tmp_path):
    """A run in parts (--recipes) or one stopped early: report.md says which recipe and mode lack points, marks
    their thresholds provisional (an untested BER can neither pass nor fail) and names what to run."""
    from conftest import ROOT
    from testbed.experiments.spec import planned_points

    rows = rule_grid(tmp_path)
    last = max(RULE_GAPS)
    planned = planned_points(tmp_path)
    assert len(planned) == len(rows) and report.coverage(rows, planned) == {}
    part = [r for r in rows if not (r["ber"] == last and r["seed"] > 2)]  # stopped inside the last BER
    assert report.coverage(part, planned) == {("default", "ddp"): (len(part), len(rows))}
    assert report.coverage(part, None) == {}  # grid unknown: nothing claimed missing
    # results read where the copy's absolute topology paths are not (another clone, another machine): the grid
    # still comes from the file (docs/results/paper-regime's copy names /work/main/topologies/...)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "experiment.yaml").write_text((tmp_path / "experiment.yaml").read_text().replace(
        f"{ROOT}/topologies/pair.yaml", "/nonexistent/topologies/pair.yaml"))
    assert planned_points(moved) == planned and planned_points(tmp_path / "nothing-here") is None
    md = report.write_report(tmp_path, rows=part, latency={"results": []}, planned=planned).read_text()
    assert md.split("\n")[2].startswith(f"**Incomplete:** {len(part)} of the grid's {len(rows)} points")
    assert f"(provisional: {len(part)} of {len(rows)} points)" in md.split("## Findings")[0]
    # the last BER has 2 of its 5 seeds: it neither passes nor fails yet (it failed outright before the fix)
    assert f"not decided yet: {last:.0e} (2 of 5 seeds run)" in md
    full = report.write_report(tmp_path, rows=rows, latency={"results": []}, planned=planned).read_text()
    assert "Incomplete" not in full and "provisional" not in full and "not decided" not in full


def test_a_ber_whose_seeds_are_not_all_in_neither_passes_nor_fails(tmp_path):
    """A stopped grid (docs/results/paper-regime, 124M PP: the clean runs and one seed of the smallest BER) was
    reported as failing at every tested BER, because one seed has no paired bound. A BER still missing seeds, or
    whose seeds' clean runs are still to come, is pending: not a pass, not a failure, and no interval is claimed;
    one of its runs that failed outright fails it at once."""
    from testbed.analysis.analysis import aggregate, thresholds
    from testbed.experiments.spec import planned_points

    rows = rule_grid(tmp_path)
    planned = planned_points(tmp_path)
    first = min(RULE_GAPS)

    def judged(part):
        return thresholds(aggregate(part), 0.01, pending=report.pending_points(part, planned))["ddp/tensor/fix"]

    # the clean runs and one seed of the smallest BER: nothing decided, nothing failing
    part = [r for r in rows if r["ber"] == 0 or (r["ber"] == first and r["seed"] == 1)]
    t = judged(part)
    assert t["pending"] == {first: {"run": 1, "of": 5, "of_clean": False}}
    assert (t["max_ok_ber"], t["min_fail_ber"], t["failing"]) == (None, None, {})
    assert thresholds(aggregate(part), 0.01)["ddp/tensor/fix"]["min_fail_ber"] == first  # the grid unknown: as before
    md = report.write_report(tmp_path, rows=part, latency={"results": []}, planned=planned).read_text()
    assert f"no BER decided yet: {first:.0e} (1 of 5 seeds run)" in md
    assert "fails already" not in md and "fails at every" not in md
    # the same BER complete and the next one begun: the first passes, the next is pending
    part = [r for r in rows if r["ber"] in (0, first) or (r["ber"] == 3e-7 and r["seed"] <= 3)]
    t = judged(part)
    assert (t["max_ok_ber"], t["min_fail_ber"], list(t["pending"])) == (first, None, [3e-7])
    # seeds whose clean runs are still to come: pending on the clean runs
    part = [r for r in rows if (r["ber"] == 0 and r["seed"] <= 2) or r["ber"] == first]
    assert judged(part)["pending"] == {first: {"run": 2, "of": 5, "of_clean": True}}
    # a run that crashed fails its BER whatever the seeds still to run show
    part = [r for r in rows if r["ber"] == 0] + [
        {**r, "status": "crashed"} for r in rows if r["ber"] == first and r["seed"] == 1]
    t = judged(part)
    assert t["pending"] == {} and t["min_fail_ber"] == first and "crashed" in t["failing"][first]


def test_loss_plot_of_a_large_grid_stacks_its_panels_and_keeps_the_legend_off_the_curves(tmp_path):
    """A grid of many recipes and BERs (docs/results/thresholds: 36 lines per mode) drew its legends over the
    curves and squeezed the panels; past LEGEND_INSIDE_MAX lines the panels stack and each legend sits beside
    its panel. A small grid keeps its side-by-side panels."""
    import matplotlib.image

    small = [make_row(m, b, s) for m in ("ddp", "pp") for b in BERS for s in SEEDS]
    large = [make_row(m, b, s, recipe=r) for m in ("ddp", "pp") for b in BERS for s in SEEDS
             for r in ("default", "sanitize", "protect")]
    shapes = {}
    for name, rows in (("small", small), ("large", large)):
        path = plots.plot_loss_vs_step(rows, tmp_path / f"{name}.png")
        assert_valid_png(path)
        shapes[name] = matplotlib.image.imread(path).shape[:2]
    assert len({(r["recipe"], r["ber"]) for r in large}) > plots.LEGEND_INSIDE_MAX >= len(BERS)
    assert shapes["small"][1] > shapes["small"][0]  # two panels side by side: wider than tall
    assert shapes["large"][0] > 1.5 * shapes["small"][0]  # two panels one above the other


def test_a_recipe_with_a_topology_per_mode_names_each_and_one_not_run_says_so(tmp_path):
    """paper-regime's r4 recipes train DDP on ring4 and PP on chain4 ({ddp: ..., pp: ...}); its 124m-wire recipe had
    no rows yet. The line read `chain4.yaml'} (4 hosts)` and `pair-bpf.yaml (? hosts)`."""
    rows = [make_row(m, b, s, recipe="r4", world_size=4) for m in ("ddp", "pp") for b in (0.0, 1e-5) for s in SEEDS]
    exp = {"name": "ranks", "topologies": {"ddp": "pair.yaml", "pp": "pair.yaml"}, "grid": {"recipe": ["r4", "wire"]},
           "recipes": {"r4": {"topology": {"ddp": "/x/ring4.yaml", "pp": "/x/chain4.yaml"}},
                       "wire": {"topology": "/x/pair-bpf.yaml"}}}
    md = report.write_report(tmp_path, rows=rows, latency={"results": []}, experiment=exp).read_text()
    assert ("Topologies: recipe r4: DDP ring4.yaml (4 hosts), PP chain4.yaml (4 hosts), "
            "recipe wire: pair-bpf.yaml (not run yet)\n") in md, [l for l in md.splitlines() if "Topologies" in l]
