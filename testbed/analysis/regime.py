"""Where the published thresholds hold (experiments/paper-regime.yaml): per size, mode and recipe the measured
threshold beside the paper's and the chaos floor; the cheapest recipe that reaches the paper's BERs; thresholds
against rank count with their fit beside the theory's; and whether the gap of a 10x-long run grows over training.
Pure functions on results rows and `analysis.thresholds` output, no files, no drawing.

- **chaos floor** of a (model, mode, steps, ranks): the largest final weight deviation of its BER-0 controls
  (`perturb`: one weight's or one gradient value's mantissa LSB, or the batch order), each against the clean run of
  the same seed (docs/results/scaling, "The chaos floor"). The **floor ratio** of a verdict: the smallest final
  deviation among the runs at its last passing BER over the floor. A ratio at most 1 means the link's effect at
  that BER cannot be told from a one-bit perturbation of the same training: the verdict is then "indistinguishable",
  not "tolerated" (the paired rule passed, but so would any perturbation).
- **cost order** of the recipes (`COST_ORDER`): what each needs beyond a plain link and fp32. default, sanitize
  and bf16 need nothing from the link (a compare per received value, or half the bytes); a protection of the sign
  and exponent bits needs an unequal-error-protection code on 9 of 32 bits, a weaker one when it may leave a
  residual (1e-3 x BER) than when it must leave none; sanitize + protect needs both. The cheapest recipe at a size
  and mode is the first in this order whose last passing BER reaches the paper's (DDP 1e-4, PP 1e-5).
- **clean cost** of a recipe: its clean runs (BER 0) against the default recipe's of the same size, mode, steps,
  ranks and seed, by the paired rule (testbed/analysis/analysis.py: the one-sided 95 % t bound of the mean gap at
  most the tolerance). A recipe's threshold is measured against its own clean runs, so a recipe that harms
  training without any error (sanitize zeroing real activations, bf16 rounding) could pass at every BER and still
  train worse than no recipe: "fails" here bars it from being named cheapest; one paired seed cannot be bounded and
  is shown, not judged ("undecided").
- **ranks**: the same recipe at 2, 4 and 8 ranks (stages), fitted like the size ladder (testbed/analysis/sizefit.py:
  least squares through the two-sided intervals' midpoints, and every slope of a line through every interval),
  with x = log10 ranks; the theory's slope is that of its BER at fixed lambda (theory.lambda_per_ber: a DDP rank's
  whole gradient crosses a link every step, so lambda per BER grows with the ring's 2 (N - 1) chunk transfers).
- **length**: per seed the gap between the long run's eval loss and its clean run's at each evaluated step; the
  change of the gap from the first evaluation at or after the ladder's steps to the last, with a two-sided 95 %
  Student-t interval over the seeds: "grows" or "closes" when it excludes 0, else "stays" (unresolved).
"""

from __future__ import annotations

import math
import statistics

from scipy import stats

from testbed.analysis import sizefit
from testbed.analysis.analysis import PUBLISHED_TOLERATED_BER, paired_gap, tolerance_of, upper_bound
from testbed.analysis.results import ber_of, finite, is_ok, recipe_of
from testbed.train.model import PRESETS

# cheapest first (module docstring); a recipe of another kind sorts last
COST_ORDER = ("default", "sanitize", "bf16", "protect + residual", "protect", "sanitize + protect")
LADDER_STEPS = 300  # the size ladder's steps (thresholds.yaml); 124M runs 200
TARGET = sizefit.TARGET_MODEL


def recipe_label(t: dict) -> str:
    """What a threshold config's recipe does, from its settings (not its name): 'default', 'sanitize', 'bf16',
    'protect', 'protect + residual', 'sanitize + protect', ... ('+ clip none' etc. when clipping differs)."""
    s = t.get("settings") or {}
    parts = []
    if s.get("guard") == "sanitize":
        parts.append("sanitize")
    if (s.get("wire_dtype") or "fp32") != "fp32":
        parts.append(s["wire_dtype"])
    if s.get("protect"):
        parts.append("protect" + (" + residual" if (t.get("residual") or 0) > 0 else ""))
    if s.get("clip") not in (None, "norm"):
        parts.append(f"clip {s['clip']}")
    if s.get("guard") not in (None, "skip", "sanitize"):
        parts.append(f"guard {s['guard']}")
    return " + ".join(parts) or "default"


def _cost(label: str) -> int:
    return COST_ORDER.index(label) if label in COST_ORDER else len(COST_ORDER)


def _controls(rows: list[dict]) -> dict[tuple, list[float]]:
    """{(model, mode, steps, world_size): final deviations of its BER-0 controls}."""
    out: dict[tuple, list[float]] = {}
    for r in rows:
        if (r.get("perturb") or "none") != "none" and ber_of(r) == 0 and is_ok(r) \
                and finite(r.get("final_deviation")) is not None:
            out.setdefault((r.get("model"), r.get("mode"), r.get("steps"), r.get("world_size")), []).append(
                float(r["final_deviation"]))
    return out


def has_controls(rows: list[dict]) -> bool:
    return bool(_controls(rows))


def _floor(controls: dict[tuple, list[float]], model, mode, steps, world_size) -> float | None:
    values = controls.get((model, mode, steps, world_size))
    return max(values) if values else None


def _deviations(rows: list[dict], t: dict, ber: float) -> list[float]:
    return [float(r["final_deviation"]) for r in rows
            if recipe_of(r) == t["recipe"] and r.get("mode") == t["mode"] and ber_of(r) == ber and is_ok(r)
            and finite(r.get("final_deviation")) is not None]


def _clean_evals(rows: list[dict]) -> dict[tuple, dict[int, float]]:
    """{(recipe, mode): {seed: final eval loss}} of the clean runs (BER 0, no perturbation)."""
    out: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if ber_of(r) == 0 and (r.get("perturb") or "none") == "none" and is_ok(r) \
                and finite(r.get("final_eval_loss")) is not None:
            out.setdefault((recipe_of(r), r.get("mode")), {})[r["seed"]] = float(r["final_eval_loss"])
    return out


def clean_cost(t: dict, default: dict | None, clean: dict[tuple, dict[int, float]]) -> dict | None:
    """A threshold config's clean runs against the default recipe's config `default` of the same size, mode, steps
    and ranks (module docstring): gaps by seed, mean, bound, tolerance and verdict ('within tolerance', 'fails',
    'undecided'); None for the default recipe itself or without a seed to pair."""
    if default is None or default["recipe"] == t["recipe"]:
        return None
    pair = paired_gap(clean.get((t["recipe"], t["mode"]), {}), clean.get((default["recipe"], t["mode"]), {}))
    if not pair["gaps"]:
        return None
    tol, upper = t["tolerance_abs"], pair["gap_upper"]
    verdict = "undecided" if upper is None else "within tolerance" if upper <= tol else "fails"
    return {"gaps": pair["gaps"], "mean": pair["gap_mean"], "upper": upper, "tolerance": tol, "verdict": verdict}


def predictions(th: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """{(recipe label, mode): the size fit's prediction at GPT-2 124M}, from the 2-rank ladder configs at
    LADDER_STEPS below 124M (what the README predicted); a family needs two sizes."""
    ladder = {k: t for k, t in th.items() if t.get("model") != TARGET and t.get("steps") == LADDER_STEPS
              and t.get("world_size") == 2}
    return {(recipe_label(f["sizes"][0]["threshold"]), f["family"]["mode"]): f["prediction_ber"]
            for f in sizefit.size_fits(ladder)}


def _two_ranks(t: dict) -> bool:
    """A threshold config regime_table and one_seed read: decided BERs at two ranks, of a preset size."""
    return bool(t.get("applies") and t.get("tested_bers") and t.get("tolerance_abs") is not None
                and t.get("world_size") in (None, 2) and t.get("model") in PRESETS)


def regime_table(rows: list[dict], th: dict[str, dict]) -> list[dict]:
    """One entry per threshold config at two ranks (size x mode x recipe x steps): its interval, the paper's BER,
    the floor and floor ratio at the last passing BER, the verdict, and at 124M the size fit's prediction."""
    out, controls, clean = [], _controls(rows), _clean_evals(rows)
    defaults: dict[tuple, dict] = {}  # the default recipe's config with the most seeds
    for t in th.values():
        if recipe_label(t) == "default" and t.get("tested_bers") and t.get("tolerance_abs") is not None:
            k = (t.get("model"), t["mode"], t.get("steps"), t.get("world_size"))
            if k not in defaults or (t.get("seeds") or 0) > (defaults[k].get("seeds") or 0):
                defaults[k] = t
    predicted = predictions(th) if any(t.get("model") == TARGET for t in th.values()) else {}
    for t in th.values():
        if not _two_ranks(t) or (t.get("seeds") or 0) < 2:
            continue  # one seed has no paired-rule bound: no threshold (one_seed lists it)
        label = recipe_label(t)
        ok, fail = t["max_ok_ber"], t["min_fail_ber"]
        floor = _floor(controls, t.get("model"), t["mode"], t.get("steps"), t.get("world_size"))
        devs = _deviations(rows, t, ok) if ok else []
        ratio = (min(devs) / floor) if devs and floor else None
        if ok is None and fail is None:
            verdict = "pending (no BER decided yet)"
        elif ok is None:
            verdict = "fails at every tested BER" + (" decided so far" if t.get("pending") else "")
        elif ratio is None:
            verdict = "tolerated (no floor measured)" if floor is None else "tolerated (no deviation measured)"
        elif ratio <= 1:
            verdict = "indistinguishable"
        else:
            verdict = "tolerated"
        pub = PUBLISHED_TOLERATED_BER.get(t["mode"])
        out.append({"model": t.get("model"), "n_params": sizefit.n_params_of(t), "mode": t["mode"],
                    "recipe": t["recipe"], "label": label, "steps": t.get("steps"), "seeds": t.get("seeds"),
                    # (done, planned) when the grid of this recipe and mode is not complete (the report sets it)
                    "incomplete": t.get("incomplete"),
                    "max_ok": ok, "min_fail": fail, "non_monotonic": t.get("non_monotonic", False),
                    "pending": t.get("pending") or {},
                    "paper": pub, "reaches_paper": ok is not None and pub is not None and ok >= pub,
                    "floor": floor, "floor_ratio": ratio, "verdict": verdict,
                    "clean_cost": clean_cost(t, defaults.get((t.get("model"), t["mode"], t.get("steps"),
                                                              t.get("world_size"))), clean),
                    "prediction": predicted.get((label, t["mode"])) if t.get("model") == TARGET else None})
    return sorted(out, key=lambda e: (sizefit.n_params_of({"model": e["model"]}) or 0, e["mode"] != "ddp",
                                      e["steps"] or 0, _cost(e["label"]), e["recipe"]))


def one_seed(th: dict[str, dict]) -> list[dict]:
    """The configs at two ranks that regime_table leaves out because they ran one seed (a cross-check such as
    paper-regime's 124m-wire, whose points the report's calibration section compares): [{model, mode, recipe}]."""
    return [{"model": t.get("model"), "mode": t["mode"], "recipe": t["recipe"]} for t in th.values()
            if _two_ranks(t) and (t.get("seeds") or 0) < 2]


def fit_check(e: dict) -> str | None:
    """Was the size fit right at 124M? 'inside' when the measured interval overlaps the prediction's 95 % t
    interval, 'above' / 'below' when it lies wholly above or below it (the fit too pessimistic / optimistic);
    None without a prediction or a measured interval."""
    p = e.get("prediction") or {}
    t = p.get("t")
    if not t or (e["max_ok"] is None and e["min_fail"] is None):
        return None
    lo, hi = e["max_ok"] or 0.0, e["min_fail"] if e["min_fail"] is not None else math.inf
    if lo >= t[1]:
        return "above"
    if hi <= t[0]:
        return "below"
    return "inside"


def cheapest(table: list[dict]) -> list[dict]:
    """Per size and mode (at the ladder's steps, or 124M's): the first recipe in COST_ORDER whose last passing BER
    reaches the paper's and whose clean runs do not fail against the default's (clean_cost), or None with the
    recipes tried."""
    out = []
    keys = dict.fromkeys((e["model"], e["mode"]) for e in table if e["steps"] != 10 * LADDER_STEPS)
    for model, mode in keys:
        mine = sorted((e for e in table if (e["model"], e["mode"]) == (model, mode)
                       and e["steps"] in (LADDER_STEPS, 200)), key=lambda e: _cost(e["label"]))
        if not mine:
            continue
        # a provisional threshold (its grid not complete) may still fail at a BER not yet run: not named
        costly = [e["label"] for e in mine if (e["clean_cost"] or {}).get("verdict") == "fails"]
        best = next((e for e in mine if e["reaches_paper"] and not e["incomplete"] and e["label"] not in costly),
                    None)
        out.append({"model": model, "mode": mode, "paper": PUBLISHED_TOLERATED_BER.get(mode), "cheapest": best,
                    "tried": [e["label"] for e in mine if not e["incomplete"]], "costly": costly,
                    "provisional": [e["label"] for e in mine if e["incomplete"]]})
    return out


def rank_fits(th: dict[str, dict]) -> list[dict]:
    """Per model, mode and recipe at the ladder's steps with thresholds at two or more rank counts: the intervals
    by ranks, the least-squares slope and the consistent slopes of log10 threshold against log10 ranks, and the
    theory's slope at fixed lambda."""
    groups: dict[tuple, list[dict]] = {}
    for t in th.values():
        if not t.get("applies") or not t.get("tested_bers") or t.get("tolerance_abs") is None:
            continue
        if t.get("steps") != LADDER_STEPS or not t.get("world_size") or t.get("model") not in PRESETS:
            continue
        iv = sizefit.interval_of(t["max_ok_ber"], t["min_fail_ber"])
        if iv is None:
            continue
        groups.setdefault((t["model"], t["mode"], recipe_label(t)), []).append({**t, "interval": iv})
    out = []
    for (model, mode, label), ts in groups.items():
        ranks = sorted({int(t["world_size"]) for t in ts})
        if len(ranks) < 2:
            continue
        ts = sorted(ts, key=lambda t: t["world_size"])
        xs = [math.log10(t["world_size"]) for t in ts]
        est = sizefit.fit_intervals(xs, [t["interval"] for t in ts])
        lam = [-math.log10(v) for t in ts if (v := sizefit.lambda_per_ber_of(model, t))]
        theory_slope = (stats.linregress(xs, lam).slope if len(lam) == len(ts) else None)
        out.append({"model": model, "mode": mode, "label": label,
                    "points": [{"ranks": int(t["world_size"]), "recipe": t["recipe"], "interval": t["interval"],
                                "seeds": t.get("seeds"), "theory_ber": t.get("theory_tolerated_ber")} for t in ts],
                    **est, "theory_slope": float(theory_slope) if theory_slope is not None else None,
                    "verdict": sizefit.slope_verdict(theory_slope, est)})
    return sorted(out, key=lambda f: (sizefit.n_params_of({"model": f["model"]}) or 0, f["mode"] != "ddp"))


def _eval_by_step(row: dict) -> dict[int, float]:
    """{steps done: eval loss}: eval_curve counts steps from 0 (its entry at step 299 is the 300-step run's end)."""
    return {int(s) + 1: float(v) for s, v in (row.get("eval_curve") or []) if finite(v) is not None}


def long_runs(rows: list[dict], steps: int = 10 * LADDER_STEPS) -> list[dict]:
    """Per (model, mode, recipe) run for `steps` with a BER > 0: the paired gap over training (mean and one-sided
    95 % t bound per evaluation, by steps done, with the tolerance there), its change from the evaluation after
    LADDER_STEPS steps (or the first after) to the last (two-sided 95 % t interval over seeds) and the verdict, and the floor ratio at the end."""
    out, controls, tolerance = [], _controls(rows), tolerance_of(rows)[0]
    long = [r for r in rows if r.get("steps") == steps and is_ok(r) and (r.get("perturb") or "none") == "none"]
    keys = dict.fromkeys((r.get("model"), r.get("mode"), recipe_of(r)) for r in long if ber_of(r) > 0)
    for model, mode, recipe in keys:
        mine = [r for r in long if (r.get("model"), r.get("mode"), recipe_of(r)) == (model, mode, recipe)]
        clean = {r["seed"]: _eval_by_step(r) for r in mine if ber_of(r) == 0}
        for ber in sorted({ber_of(r) for r in mine if ber_of(r) > 0}):
            runs = {r["seed"]: _eval_by_step(r) for r in mine if ber_of(r) == ber and r["seed"] in clean}
            if len(runs) < 2:
                continue
            eval_steps = sorted(set.intersection(*(set(c) for c in runs.values()),
                                                 *(set(clean[s]) for s in runs)))
            curve = []
            for st in eval_steps:
                gaps = [runs[s][st] - clean[s][st] for s in runs]
                mean, upper = statistics.fmean(gaps), upper_bound(gaps)
                tol = tolerance * statistics.fmean(clean[s][st] for s in runs)
                curve.append({"step": st, "mean": mean, "upper": upper, "tolerance": tol, "passes": upper <= tol})
            first = next((st for st in eval_steps if st >= LADDER_STEPS), None)
            change = None
            if first is not None and eval_steps and eval_steps[-1] > first:
                d = [(runs[s][eval_steps[-1]] - clean[s][eval_steps[-1]]) - (runs[s][first] - clean[s][first])
                     for s in runs]
                m, sd = statistics.fmean(d), statistics.stdev(d)
                h = float(stats.t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
                change = {"from": first, "to": eval_steps[-1], "mean": m, "ci": (m - h, m + h),
                          "verdict": "grows" if m - h > 0 else "closes" if m + h < 0 else "stays"}
            devs = [float(r["final_deviation"]) for r in mine if ber_of(r) == ber
                    and finite(r.get("final_deviation")) is not None]
            floor = _floor(controls, model, mode, steps, next((r.get("world_size") for r in mine), None))
            out.append({"model": model, "mode": mode, "recipe": recipe, "ber": ber, "seeds": sorted(runs),
                        "curve": curve, "change": change, "floor": floor,
                        "floor_ratio": (min(devs) / floor) if devs and floor else None})
    return out
