"""Thresholds against model size (issue 22, item 4): recipe `ber:`/`seed:`, experiments/thresholds.yaml, the log-log
fit of threshold intervals against parameter count (testbed/analysis/sizefit.py) and the report's section on
synthetic rows. Pure: no root, no namespaces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import ROOT
from testbed.analysis import analysis, formatting, results, sizefit, theory
from testbed.experiments.spec import Experiment
from testbed.topology.yamlfile import InputError
from testbed.train.model import PRESETS

PAIR = ROOT / "topologies" / "pair.yaml"
HALF_DECADES = [10 ** (k / 2) for k in range(-24, 0)]  # 1e-12, 3.16e-12, ... 0.316 (exact half-decades)


def bracket(b: float, grid=HALF_DECADES) -> tuple[float, float]:
    """The half-decade interval (last passing, first failing] a run of the grid would find for threshold b."""
    return max(g for g in grid if g < b), min(g for g in grid if g >= b)


def log_n(*models) -> list[float]:
    return [math.log10(theory.param_count(m)) for m in models]


# ---- the fit on synthetic intervals -----------------------------------------------------------------------------

def test_least_squares_recovers_a_known_slope():
    xs = [5.0 + 0.4 * i for i in range(8)]  # 8 sizes over 2.8 decades
    for slope, intercept in ((-1.0, -0.5), (-0.5, -3.2), (0.0, -5.7), (-1.3, 1.1)):
        exact = [intercept + slope * x for x in xs]
        # (near-)exact thresholds: the midpoints are the truth, the fit returns it
        tight = sizefit.fit_intervals(xs, [(10 ** (y - 1e-4), 10 ** (y + 1e-4)) for y in exact])
        assert tight["fit"]["slope"] == pytest.approx(slope, abs=1e-6)
        assert tight["fit"]["intercept"] == pytest.approx(intercept, abs=1e-5)
        # half-decade intervals: each midpoint is off by at most a quarter decade, which bounds the slope's error
        # by 0.25 sum |x - xbar| / Sxx (0.24 here). (The t interval treats that error as random; where the grid
        # aliases with the sizes it is not, and at -1.3 the interval misses: the consistent slopes do not.)
        est = sizefit.fit_intervals(xs, [bracket(10 ** y) for y in exact])
        assert est["n_two_sided"] == 8 and est["fit"]["df"] == 6
        x = np.asarray(xs)
        assert abs(est["fit"]["slope"] - slope) <= 0.25 * np.abs(x - x.mean()).sum() / ((x - x.mean()) ** 2).sum()
        s_lo, s_hi = est["slope_range"]  # the true line passes through every interval
        assert s_lo <= slope <= s_hi and s_hi - s_lo < 0.5


def test_collinear_midpoints_keep_an_interval_of_their_own_width():
    # three half-decade intervals whose midpoints lie on one line: residual 0, the quantization floor remains
    xs = [5.0, 6.0, 7.0]
    ivs = [(1e-6, 10 ** -5.5), (1e-7, 10 ** -6.5), (1e-8, 10 ** -7.5)]
    fit = sizefit.fit_intervals(xs, ivs)["fit"]
    assert fit["slope"] == pytest.approx(-1.0) and fit["residual_sd"] == pytest.approx(0.0, abs=1e-12)
    assert fit["quantization_sd"] == pytest.approx(0.5 / math.sqrt(12))
    lo, hi = fit["slope_ci"]
    half = 12.706 * 0.5 / math.sqrt(12) / math.sqrt(2)  # t(0.975, 1) x sd / sqrt(Sxx)
    assert (hi - lo) / 2 == pytest.approx(half, rel=1e-3)


def brute_force(xs, ivs, x_star, slopes=np.linspace(-4, 2, 60001)):
    """Every line through every interval, by a scan over slopes: for each slope the intercepts that fit, written
    out independently of the linear program. (slope range, value range at x_star), or None when none fits."""
    lo_b = [math.log10(lo) if lo > 0 else -math.inf for lo, _ in ivs]
    hi_b = [math.log10(hi) if math.isfinite(hi) else math.inf for _, hi in ivs]
    fit_s, vals = [], []
    for s in slopes:
        c_lo = max(lo - s * x for lo, x in zip(lo_b, xs))
        c_hi = min(hi - s * x for hi, x in zip(hi_b, xs))
        if c_lo <= c_hi:
            fit_s.append(s)
            vals += [c_lo + s * x_star, c_hi + s * x_star]
    return ((min(fit_s), max(fit_s)), (min(vals), max(vals))) if fit_s else None


def test_one_sided_intervals():
    xs = [5.0, 6.0, 7.0]
    # the largest size fails at its smallest BER (< 3e-8): left out of least squares, but it bounds the lines
    ivs = [(1e-6, 10 ** -5.5), (1e-7, 10 ** -6.5), (0.0, 10 ** -7.5)]
    est = sizefit.fit_intervals(xs, ivs, x_star=8.0)
    assert [sizefit.interval_kind(iv) for iv in ivs] == ["two-sided", "two-sided", "below"]
    assert est["n_two_sided"] == 2 and est["fit"]["slope"] == pytest.approx(-1.0) and est["fit"]["slope_ci"] is None
    # by hand: the steepest line joins the bottom of [6] and the top of [5] (-1.5); the flattest joins the bottom
    # of [5] and the top of "< 3e-8" at x = 7 ((-7.5 + 6) / 2 = -0.75); at x = 8 they give -10 and -8.25
    assert est["slope_range"] == pytest.approx((-1.5, -0.75))
    assert est["prediction_range"] == pytest.approx((-10.0, -8.25))
    (s_rng, v_rng) = brute_force(xs, ivs, 8.0)
    assert s_rng == pytest.approx(est["slope_range"], abs=2e-4) and v_rng == pytest.approx((-10, -8.25), abs=1e-3)
    # the smallest size passes everything (>= 1e-6): open above
    ivs2 = [(1e-6, math.inf), (1e-7, 10 ** -6.5), (1e-8, 10 ** -7.5)]
    est2 = sizefit.fit_intervals(xs, ivs2, x_star=8.0)
    assert est2["n_two_sided"] == 2 and sizefit.interval_kind(ivs2[0]) == "above"
    (s_rng, v_rng) = brute_force(xs, ivs2, 8.0)
    assert est2["slope_range"] == pytest.approx(s_rng, abs=2e-4) and est2["prediction_range"] == pytest.approx(
        v_rng, abs=1e-3)
    assert est2["slope_range"] == pytest.approx((-1.5, -0.75))  # (-8 + 6.5) / 1 and (-7.5 + 6) / 2
    # only one-sided intervals on one side: nothing bounds the slope or the prediction
    open_ = sizefit.fit_intervals([5.0, 6.0], [(0.0, 1e-6), (0.0, 1e-7)], x_star=8.0)
    assert open_["fit"] is None and open_["slope_range"] == (-math.inf, math.inf)
    assert open_["prediction_range"] == (-math.inf, math.inf)
    # a "< F" at the largest size and a ">= B" at the smallest: the slope is bounded above only
    mixed = sizefit.fit_intervals(xs, [(1e-6, math.inf), (1e-7, 10 ** -6.5), (0.0, 1e-8)], x_star=8.0)
    assert mixed["slope_range"][0] == -math.inf and mixed["prediction_range"][0] == -math.inf
    assert mixed["slope_range"][1] == pytest.approx(-1.0)  # (-8 + 6) / 2
    # intervals no line passes through: no range, said so
    bad = sizefit.fit_intervals(xs, [(1e-6, 3e-6), (1e-4, 3e-4), (1e-6, 3e-6)], x_star=8.0)
    assert bad["slope_range"] is None and bad["prediction_range"] is None
    assert brute_force(xs, [(1e-6, 3e-6), (1e-4, 3e-4), (1e-6, 3e-6)], 8.0) is None
    assert sizefit.slope_verdict(-1.0, bad) == "consistent"  # then the t interval decides (slope 0 +- 12.7 sd)
    two = sizefit.fit_intervals([5.0, 6.0], [(0.0, 1e-8), (1e-6, math.inf)])  # falls faster than any line allows?
    assert two["slope_range"] == (pytest.approx(2.0), math.inf)  # no: it rises, at least 2 decades per decade
    two = sizefit.fit_intervals([5.0, 5.0, 6.0], [(1e-6, 3e-6), (1e-4, 3e-4), (0.0, 1e-7)])  # one size twice
    assert two["slope_range"] is None and two["fit"] is None
    assert sizefit.slope_verdict(-1.0, two) == "no power law"
    assert sizefit.interval_of(None, 1e-6) == (0.0, 1e-6) and sizefit.interval_of(1e-6, None) == (1e-6, math.inf)
    assert sizefit.interval_of(None, None) is None


@pytest.mark.parametrize("slope, lam", [(-1.0, 0.2), (-0.5, 0.05), (-0.8, 0.5), (0.0, 0.3), (-1.2, 0.1)])
def test_prediction_interval_contains_the_truth_of_an_exact_power_law(slope, lam):
    """Thresholds b(n) = b(tiny) (n / n_tiny)^slope, measured on a half-decade grid at tiny, small and mini: the
    range of every line through every interval, and the t prediction interval, contain b(124M)."""
    b_tiny = lam / theory.lambda_per_ber("ddp", 2, n_params=theory.param_count("tiny"))
    xs = log_n("tiny", "small", "mini")
    truth = lambda x: math.log10(b_tiny) + slope * (x - xs[0])  # noqa: E731
    est = sizefit.fit_intervals(xs, [bracket(10 ** truth(x)) for x in xs], x_star=log_n("gpt2-124m")[0])
    y = truth(log_n("gpt2-124m")[0])
    lo, hi = est["prediction_range"]
    assert lo <= y <= hi
    t_lo, t_hi = est["prediction_t"]
    assert t_lo <= y <= t_hi
    assert est["slope_range"][0] <= slope <= est["slope_range"][1]


# ---- families from thresholds of synthetic rows -------------------------------------------------------------------

MODELS = ("tiny", "small", "mini")
SEEDS = (1, 2, 3)
STEPS = 300


def _curve(final: float, steps: int = STEPS) -> list[float]:
    return [final + (9.0 - final) * math.exp(-s / 40) for s in range(steps)]


def row(model: str, mode: str, recipe: str, ber: float, seed: int, eval_loss: float, guard: str = "skip") -> dict:
    tag = f"-{recipe}"
    point = f"{mode}-ber{ber:g}-tensor-fix{tag}-s{seed}"
    values = dict.fromkeys(results.ROW_FIELDS)
    return results.new_row(**values | {
        "point": point, "baseline": f"{mode}-ber0-tensor-fix{tag}-s{seed}", "experiment": "thresholds",
        "tolerance": 0.01, "recipe": recipe, "fingerprint": "0123456789abcdef", "mode": mode, "ber": ber,
        "scope": "tensor", "checksum": "fix", "seed": seed, "model": model, "steps": STEPS, "topology": "pair",
        "runtime": "loopback", "injector": "process", "world_size": 2, "status": "ok", "steps_completed": STEPS,
        "skipped_steps": 0, "final_eval_loss": eval_loss, "initial_eval_loss": 9.0, "made_progress": True,
        "loss_curve": _curve(eval_loss), "n_params": theory.param_count(model), "lr": 1e-3, "grad_clip": 1.0,
        "batch_size": 4 if mode == "ddp" else 8, "seq_len": 64, "tokens_per_step": 512, "guard": guard,
        "machine": {"uname": "Linux test", "cpus": 2, "hostname": "test"}, "wall_time_s": 60.0,
        "finished_at": 1.7e9 + seed, "run_dir": f"points/{point}"})


def ladder_rows(thresholds: dict, grids: dict) -> list[dict]:
    """Per (model, mode): clean runs per seed, and at each BER of the grid a gap of 0.001 nats below the
    threshold, 0.5 above it (so the paired rule finds exactly the bracketing interval)."""
    rows = []
    for (model, mode), b in thresholds.items():
        recipe = model
        clean = {s: 5.0 + 0.3 * MODELS.index(model) + 0.05 * s for s in SEEDS}
        rows += [row(model, mode, recipe, 0.0, s, clean[s]) for s in SEEDS]
        for ber in grids[(model, mode)]:
            rows += [row(model, mode, recipe, ber, s, clean[s] + (0.001 * s if ber < b else 0.5)) for s in SEEDS]
    return rows


def lam1(model: str, mode: str) -> float:
    if mode == "ddp":
        return theory.ber_at_lambda(1, "ddp", 2, n_params=theory.param_count(model))
    return theory.ber_at_lambda(1, "pp", 2, batch_size=8, seq_len=64, width=PRESETS[model].n_embd)


def synthetic_ladder(slope_ddp=-1.0, slope_pp=-0.5):
    """DDP thresholds at lambda 0.2 of tiny scaled by slope_ddp per decade of parameters; PP likewise; every size
    on the half-decade grid four BERs around it."""
    x0 = log_n("tiny")[0]
    th, grids = {}, {}
    for model in MODELS:
        x = log_n(model)[0]
        for mode, slope in (("ddp", slope_ddp), ("pp", slope_pp)):
            b = 0.2 * lam1("tiny", mode) * 10 ** (slope * (x - x0))
            th[(model, mode)] = b
            lo, hi = bracket(b)
            grids[(model, mode)] = [lo / 10 ** 0.5, lo, hi, hi * 10 ** 0.5]
    return th, grids


@pytest.mark.parametrize("model", MODELS + ("gpt2-124m",))
def test_the_theorys_tolerated_ber_does_not_saturate_for_large_models(model):
    """lambda is read off the prediction at two BERs; at 1e-6 a mini or 124M DDP step is always lost, which once
    read as a slope of 0 ("no lost steps predicted"). The tolerated BER is where 1 - exp(-lambda) = f*."""
    rows = [row(model, "ddp", model, 0.0, s, 5.0 + 0.05 * s) for s in SEEDS]
    rows += [row(model, "ddp", model, 1e-9, s, 5.5) for s in SEEDS]
    (t,) = analysis.thresholds(analysis.aggregate(rows), tolerance=0.01).values()
    f = t["time_shift_fraction"]
    assert 0 < f < 1 and t["theory_note"] is None
    assert t["theory_lost_ber"] == pytest.approx(lam1(model, "ddp"), rel=1e-3)
    assert t["theory_tolerated_ber"] == pytest.approx(-math.log1p(-f) * lam1(model, "ddp"), rel=1e-3)


def test_families_group_sizes_and_fit_against_the_theory():
    truth, grids = synthetic_ladder()
    rows = ladder_rows(truth, grids)
    th = analysis.thresholds(analysis.aggregate(rows), tolerance=0.01)
    fits = sizefit.size_fits(th)
    assert [f["label"] for f in fits] == ["default DDP", "default PP"]
    for f in fits:
        mode = f["family"]["mode"]
        assert [s["model"] for s in f["sizes"]] == list(MODELS)
        for s in f["sizes"]:  # the paired rule found the bracketing interval
            assert s["interval"] == pytest.approx(bracket(truth[(s["model"], mode)]))
            assert s["kind"] == "two-sided" and s["seeds"] == 3 and s["steps"] == STEPS
        # the theory: the same time shift at every size (the same clean curve shape), so its slope is that of
        # lambda_per_ber: DDP -1 exactly, PP the width's log ratio against the parameters'
        lam_slope = np.polyfit(log_n(*MODELS), [math.log10(lam1(m, mode)) for m in MODELS], 1)[0]
        assert f["lambda_slope"] == pytest.approx(lam_slope)
        assert f["theory_basis"] == "tolerated" and f["theory_slope"] == pytest.approx(lam_slope, abs=0.05)
        if mode == "ddp":
            assert f["theory_slope"] == pytest.approx(-1.0, abs=0.05)
        s_lo, s_hi = f["slope_range"]
        true_slope = -1.0 if mode == "ddp" else -0.5
        assert s_lo <= true_slope <= s_hi
        p = f["prediction_ber"]
        b124 = 0.2 * lam1("tiny", mode) * (theory.param_count("gpt2-124m") / theory.param_count("tiny")) ** true_slope
        assert p["range"][0] <= b124 <= p["range"][1] and p["t"][0] <= b124 <= p["t"][1]
        # the theory's 124M value is mini's tolerated BER at the same lambda on 124M's wire
        mini = f["sizes"][-1]
        assert p["theory"] == pytest.approx(mini["theory_ber"] * lam1("gpt2-124m", mode) / lam1("mini", mode))
        assert f["verdict"] == ("consistent" if s_lo <= f["theory_slope"] <= s_hi else
                                "steeper" if s_hi < f["theory_slope"] else "shallower")
    # a sensitivity tolerance reuses the same fit on that tolerance's intervals
    by_tol = sizefit.sensitivity_fits(th, (0.005, 0.05))
    assert set(by_tol[0.05]) == {"default DDP", "default PP"}


def test_a_recipe_without_lost_steps_has_no_theory_slope():
    truth, grids = synthetic_ladder(slope_ddp=0.0)
    rows = [dict(r, guard="sanitize", recipe=r["recipe"] + "-sanitize") for r in ladder_rows(truth, grids)
            if r["mode"] == "ddp"]
    th = analysis.thresholds(analysis.aggregate(rows), tolerance=0.01)
    (f,) = sizefit.size_fits(th)
    assert f["label"] == "sanitize DDP" and f["no_lost_steps"] and f["theory_slope"] is None
    assert f["verdict"] is None and f["prediction_ber"]["theory"] is None
    assert f["slope_range"][0] <= 0.0 <= f["slope_range"][1]


def test_one_sided_sizes_leave_the_slope_unconstrained_and_differing_steps_are_flagged():
    truth, grids = synthetic_ladder()
    rows = [r for r in ladder_rows(truth, grids) if r["mode"] == "ddp"]
    # every size fails at its smallest BER: "< F" only, and tiny ran 100 steps, not 300
    rows = [dict(r, final_eval_loss=r["final_eval_loss"] + 1.0) if r["ber"] > 0 else r for r in rows]
    rows = [dict(r, steps=100, steps_completed=100) if r["model"] == "tiny" else r for r in rows]
    (f,) = sizefit.size_fits(analysis.thresholds(analysis.aggregate(rows), tolerance=0.01))
    assert [s["kind"] for s in f["sizes"]] == ["below"] * 3 and f["fit"] is None
    assert f["slope_range"] == (-math.inf, math.inf) and f["verdict"] == "unconstrained"
    # upper bounds alone bound no extrapolation (a steep enough rising line passes under every one of them)
    assert f["prediction_ber"]["range"] == (0.0, math.inf) and f["prediction_ber"]["ber"] is None
    assert f["differs"] == {"steps": [100, 300]}
    from testbed.report.scaling import _fit_sentence
    assert "Caution: the sizes differ in steps (100/300)." in _fit_sentence(f)


def test_report_section_renders_from_synthetic_rows(tmp_path):
    from testbed.report.report import write_report

    truth, grids = synthetic_ladder()
    rows = ladder_rows(truth, grids)
    md = write_report(tmp_path, rows=rows, latency={}, experiment={"name": "thresholds"}).read_text()
    head = "## Thresholds against model size, and the GPT-2 124M prediction"
    assert head in md
    section = md[md.index(head):]
    assert "![Threshold BER vs parameters" in section and (tmp_path / "threshold_vs_size.png").stat().st_size > 0
    assert "| default DDP | tiny | tiny | 236,928 | 300 | 3 |" in section
    assert "| default PP | mini | mini | 13,891,584 | 300 | 3 |" in section
    assert "< 1e-04" in section and "< 1e-05" in section  # the paper's numbers beside the prediction
    assert "slopes consistent with every interval" in section and "theory slope" in section
    assert "- **default DDP**: threshold ∝ parameters^" in section and "paper < 1e-04." in section
    # the sensitivity of the slope: a column per tolerance
    assert "| recipe, mode | 0.5 % | 1 % (registered) | 2 % | 5 % |" in section
    # mini with fewer seeds: flagged, and the fit again on the seeds every size ran
    fewer = [r for r in rows if not (r["model"] == "mini" and r["seed"] == 3)]
    assert sizefit.matched_seeds(fewer, analysis.thresholds(analysis.aggregate(fewer))) == [1, 2]
    assert sizefit.matched_seeds(rows, analysis.thresholds(analysis.aggregate(rows))) is None
    md2 = write_report(tmp_path / "fewer", rows=fewer, latency={}, experiment={}).read_text()
    assert "Caution: the sizes differ in seeds (2/3)." in md2
    assert "The same fit on the seeds every size ran (1, 2):" in md2
    # one size only: no section
    one = [r for r in rows if r["model"] == "tiny"]
    plain = write_report(tmp_path / "one", rows=one, latency={}, experiment={}).read_text()
    assert head not in plain


def test_a_ladders_summary_leads_with_the_trend_and_leaves_its_controls_out(tmp_path):
    """The one-screen summary of a size ladder (issue 22, item 7): rows smallest model first, the headline gives
    each size's interval and the 124M extrapolation beside the paper's number, and a recipe run at BER 0 alone (a
    chaos-floor control) has no "no threshold" row, finding or ordering: one line names it."""
    from testbed.report.report import write_report

    truth, grids = synthetic_ladder()
    rows = ladder_rows(truth, grids)
    for mode in ("ddp", "pp"):  # a control: BER 0 only, against tiny's clean run
        for s in SEEDS:
            r = row("tiny", mode, "tiny-lsb", 0.0, s, 5.0 + 0.05 * s)
            rows.append(r | {"baseline": f"{mode}-ber0-tensor-fix-tiny-s{s}", "perturb": "lsb"})
    md = write_report(tmp_path, rows=rows, latency={}, experiment={"name": "ladder"}).read_text()
    summary = md[md.index("## Summary"):md.index("## Findings")]
    table = [line.split(" |")[0] for line in summary.splitlines() if line.startswith("| ") and "paper" not in line]
    assert table[1:] == ["| tiny", "| small", "| mini"], table
    assert "no threshold" not in summary and "tiny-lsb" not in "".join(table)
    assert "Run at BER 0 only, so without a threshold (controls: the chaos floor below): tiny-lsb." in summary
    fits = {f["label"]: f for f in sizefit.size_fits(analysis.thresholds(analysis.aggregate(rows)))}
    ddp = fits["default DDP"]
    assert ddp["prediction_ber"]["ber"] is not None
    assert (f"default DDP: tiny {'{} – {}'.format(*map(formatting.ber_text, ddp['sizes'][0]['interval']))}"
            in summary)
    assert f"124M {formatting.ber_text(ddp['prediction_ber']['ber'])}" in summary and "(paper: < 1e-04)" in summary
    findings = md[md.index("## Findings"):md.index("## Setup")]
    assert "tiny-lsb" not in findings and "threshold is missing" not in md


# ---- recipe ber: and seed:, experiments/thresholds.yaml ---------------------------------------------------------

FILE = f"""name: t
model: tiny
steps: 10
tokens_per_step: 512
topologies: {{ddp: {PAIR}, pp: {PAIR}}}
recipes:
  a: {{model: tiny, ber: {{ddp: [1e-7, 3e-7], pp: [1e-6]}}}}
  b: {{model: small, seed: [1], ber: [1e-8]}}
grid: {{recipe: [default, a, b], mode: [ddp, pp], ber: [0, 1e-5], seed: [1, 2]}}
train: {{seq_len: 64}}
"""


def test_recipe_bers_and_seeds_replace_the_grids(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(FILE)
    exp = Experiment.load(f)
    pts = exp.points()
    got = {(p.recipe, p.mode): sorted({p.ber for q in [p] for _ in [0]} | {x.ber for x in pts if
                                                                       (x.recipe, x.mode) == (p.recipe, p.mode)})
           for p in pts}
    assert got[("default", "ddp")] == [0.0, 1e-5]
    assert got[("a", "ddp")] == [0.0, 1e-7, 3e-7] and got[("a", "pp")] == [0.0, 1e-6]  # the clean runs are added
    assert got[("b", "ddp")] == got[("b", "pp")] == [0.0, 1e-8]
    assert {p.seed for p in pts if p.recipe == "b"} == {1} and {p.seed for p in pts if p.recipe == "a"} == {1, 2}
    assert len(pts) == 2 * 2 * 2 + (3 + 2) * 2 + 2 * 2 * 1
    # the fingerprint does not change with the grid's BERs or seeds
    g = tmp_path / "g.yaml"
    g.write_text(FILE.replace("ber: [1e-8]", "ber: [1e-9, 1e-8]").replace("seed: [1], ", "seed: [3], "))
    assert Experiment.load(g).fingerprint(recipe="b") == exp.fingerprint(recipe="b")


@pytest.mark.parametrize("recipe, expect", [
    ("{model: tiny, ber: {ddp: [1e-7]}}", "recipes.a.ber: names no BERs for mode pp, which the grid runs"),
    ("{model: tiny, ber: []}", "recipes.a.ber"),
    ("{model: tiny, ber: [0.7]}", "recipes.a.ber"),
    ("{model: tiny, seed: []}", "recipes.a.seed"),
    ("{model: tiny, seed: [-1]}", "recipes.a.seed"),
    ("{model: tiny, baseline: b, ber: [1e-7], train: {perturb: lsb}}", "recipes.a.ber: a control runs at BER 0"),
])
def test_bad_recipe_bers_and_seeds_name_the_field(tmp_path, recipe, expect):
    f = tmp_path / "t.yaml"
    f.write_text(FILE.replace("  a: {model: tiny, ber: {ddp: [1e-7, 3e-7], pp: [1e-6]}}", f"  a: {recipe}"))
    with pytest.raises(InputError) as e:
        Experiment.load(f)
    assert expect in str(e.value), str(e.value)
    assert ":7: " in str(e.value) or ":6: " in str(e.value)  # the recipe's line


def test_thresholds_yaml_loads_and_expands_to_the_documented_grid():
    exp = Experiment.load(ROOT / "experiments" / "thresholds.yaml")
    pts = exp.points()
    assert len(pts) == 318  # the count the file's header gives: 300, then the 18 of the two extensions
    by_model = {m: [p for p in pts if exp.model_of(p.recipe) == m] for m in MODELS}
    assert {m: len(v) for m, v in by_model.items()} == {"tiny": 120, "small": 120, "mini": 78}
    assert exp.spec.tolerance == 0.01 and {exp.tokens_per_step(p) for p in pts} == {512}
    assert {exp.train_settings(p).injector for p in pts} == {"process"}
    assert {exp.steps_of(p.recipe) for p in pts} == {300}  # one step count at every size
    assert {f"{p.ber:.0e}"[0] for p in pts if p.ber > 0} == {"1", "3"}  # 1eK and 3eK only: half-decades
    assert all(float(f"{p.ber:.0e}") == p.ber for p in pts)
    for model, pts_m in by_model.items():
        for recipe in {p.recipe for p in pts_m}:
            guard = exp.train_settings(next(p for p in pts_m if p.recipe == recipe)).guard
            assert guard == ("sanitize" if recipe.endswith("-sanitize") else "skip")
            for mode in ("ddp", "pp"):
                mine = [p for p in pts_m if p.recipe == recipe and p.mode == mode]
                seeds = {p.seed for p in mine}
                bers = sorted({p.ber for p in mine if p.ber > 0})
                assert all(b2 / b1 == pytest.approx(10 ** 0.5, rel=0.06) for b1, b2 in zip(bers, bers[1:]))
                assert len(mine) == len(seeds) * (len(bers) + 1)  # every BER and the clean run, every seed
                if model == "mini":  # DDP two half-decades lower (the extension), sanitize two more (the second)
                    want = {"ddp": 8 if guard == "sanitize" else 6, "pp": 4}[mode]
                    assert len(seeds) >= 3 and len(bers) == want, (recipe, mode, bers)
                else:
                    assert len(seeds) >= 5
                if guard == "skip":  # the default grid spans lambda ~0.02-0.05 up to ~1
                    lams = [b / lam1(model, mode) for b in bers]
                    assert min(lams) <= 0.05 and max(lams) >= 0.8, (model, mode, lams)
