"""Thresholds against model size (experiments/thresholds.yaml): the paired-rule threshold intervals of one
experiment's sizes, a log-log fit of threshold BER against parameter count, the theory's slope beside it, and the
extrapolation to GPT-2 124M. Pure functions on `analysis.thresholds` output, no files, no drawing.

- a **family** is one recipe at several sizes: the configs (mode, scope, checksum) with the same recipe settings
  (guard, wire dtype, protect, clipping, tokens per step, ...; not the model), e.g. `tiny`, `small` and `mini` of
  thresholds.yaml are the DDP default family; a family is fitted when it has at least two sizes;
- a threshold is an **interval** of BER, (last passing, first failing]: two-sided; "< F" when the smallest
  tested BER fails (lo = 0); ">= B" when every tested BER passes (hi = inf). Nothing is fitted through a config
  without a threshold (no baseline, nothing tested);
- **least squares** (`fit.slope`, the point estimate): log10 of the geometric midpoint sqrt(lo x hi) of each
  two-sided interval against log10 parameters (one-sided intervals have no midpoint and are left out of it). Its
  95 % interval is Student's t with n - 2 degrees of freedom, from the residual sd, but never below the midpoints'
  own spread (an interval's midpoint stands for a threshold anywhere in it: sd = log10(hi/lo) / sqrt(12), uniform
  in log), which keeps collinear midpoints on a half-decade grid from giving a zero-width interval. With three
  sizes there is one degree of freedom (t = 12.7): that interval is wide, and says so. It treats the midpoints'
  offsets from the true thresholds as random; on a fixed grid they are not (a grid that aliases with the sizes
  biases the slope), so the consistent slopes below are the interval that holds whenever the power law does;
- **consistent slopes** (`slope_range`): every slope s for which some line log10 b = c + s log10 n passes through
  every interval of the family, one-sided ones included (a linear program in (s, c)). It is not a confidence
  interval: it takes each interval as exact (a pass or fail decided by seed noise moves it), and it is empty
  (None, "no power law fits every interval") when no line fits;
- **124M prediction**: the least-squares line at GPT-2 124M's parameter count, with two intervals: `range`, the
  lowest and highest value at 124M of every line through every interval (the slope range carried to 124M with
  its intercepts; one-sided when the intervals allow it), and `t`, the t prediction interval of one new size's
  midpoint, mean +- t sd sqrt(1 + 1/n + (x - xbar)^2 / Sxx). The prediction is for this experiment's setup (2
  hosts, its tokens per step, steps, lr, tolerance), not for the published one's;
- **theory slope**: per size the theory's tolerated BER (`theory_tolerated_ber`, the report's "theory: tolerated
  up to": lost steps 1 - exp(-lambda) against the time shift the clean loss curve absorbs within the tolerance),
  fitted the same way (`theory_slope`); and the slope at a fixed lambda (`lambda_slope`: log10 of
  theory.ber_at_lambda against log10 parameters; DDP -1 exactly, PP by the width, since PP's wire carries
  activations of width d at fixed tokens per step). The theory's 124M value is the tolerated BER of the largest
  size that has one, carried to 124M at the same lambda (x lambda_per_ber(largest) / lambda_per_ber(124M)). A
  recipe that loses no steps (sanitize, protect) has no theory threshold, so no theory slope. The verdict compares
  the theory's slope with the consistent slopes (and, without them, the t interval).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
from scipy import optimize, stats

from testbed.analysis import theory
from testbed.analysis.formatting import mode_name
from testbed.analysis.scaling import recipe_kind, model_key
from testbed.train.model import PRESETS, seq_len_of

TARGET_MODEL = "gpt2-124m"
LEVEL = 0.95  # two-sided level of the slope's t interval and of the t prediction interval


# ---------------------------------------------------------------------------------------------------------------
# Intervals
# ---------------------------------------------------------------------------------------------------------------

def interval_of(ok: float | None, fail: float | None) -> tuple[float, float] | None:
    """(lo, hi) of BER from the last passing and the first failing BER: lo 0 when none passed, hi inf when none
    failed; None when neither exists (no threshold)."""
    if ok is None and fail is None:
        return None
    return (float(ok) if ok is not None else 0.0, float(fail) if fail is not None else math.inf)


def interval_kind(iv: tuple[float, float]) -> str:
    """'two-sided', 'below' (< hi: the smallest tested BER failed) or 'above' (>= lo: every tested BER passed)."""
    lo, hi = iv
    return "below" if lo <= 0 else "above" if math.isinf(hi) else "two-sided"


def log_bounds(iv: tuple[float, float]) -> tuple[float, float]:
    """log10 of (lo, hi): -inf for lo 0, inf for hi inf."""
    lo, hi = iv
    return (math.log10(lo) if lo > 0 else -math.inf, math.log10(hi) if math.isfinite(hi) else math.inf)


def midpoint(iv: tuple[float, float]) -> float | None:
    """The geometric midpoint of a two-sided interval (None for a one-sided one)."""
    lo, hi = iv
    return math.sqrt(lo * hi) if interval_kind(iv) == "two-sided" else None


# ---------------------------------------------------------------------------------------------------------------
# Fits on (log10 n, interval) pairs
# ---------------------------------------------------------------------------------------------------------------

def _lines_through(xs: list[float], ivs: list[tuple[float, float]], objective: tuple[float, float]) -> tuple:
    """min and max of objective . (s, c) over the lines log10 b = c + s x through every interval; (None, None)
    when no line passes through all of them. A side the intervals leave open is -inf or inf."""
    a_ub, b_ub = [], []
    for x, iv in zip(xs, ivs):
        lo, hi = log_bounds(iv)
        if math.isfinite(hi):
            a_ub.append([x, 1.0])
            b_ub.append(hi)
        if math.isfinite(lo):
            a_ub.append([-x, -1.0])
            b_ub.append(-lo)
    out = []
    for sign in (1.0, -1.0):
        res = optimize.linprog([sign * objective[0], sign * objective[1]], A_ub=a_ub or None, b_ub=b_ub or None,
                               bounds=[(None, None), (None, None)], method="highs")
        if res.status == 2:  # infeasible
            return None, None
        out.append(-sign * math.inf if res.status == 3 else float(sign * res.fun))
    return out[0], out[1]


def slope_range(xs: list[float], ivs: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The slopes of every line through every interval (x = log10 parameters; see the module docstring); None
    when no line fits them all or fewer than two distinct sizes are given."""
    if len(set(xs)) < 2:
        return None
    lo, hi = _lines_through(xs, ivs, (1.0, 0.0))
    return None if lo is None else (lo, hi)


def value_range(xs: list[float], ivs: list[tuple[float, float]], x_star: float) -> tuple[float, float] | None:
    """log10 BER at x_star over every line through every interval; None when none fits or < 2 sizes."""
    if len(set(xs)) < 2:
        return None
    lo, hi = _lines_through(xs, ivs, (x_star, 1.0))
    return None if lo is None else (lo, hi)


def least_squares(xs: list[float], ys: list[float], widths: list[float] | None = None,
                  level: float = LEVEL) -> dict | None:
    """The least-squares line y = intercept + slope x, with its t interval of the slope (n - 2 degrees of
    freedom; None with fewer than 3 points). `widths`: each y's interval width in log10, whose uniform sd
    width / sqrt(12) floors the residual sd. None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    n = len(x)
    sxx = float(((x - x.mean()) ** 2).sum())
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * x.mean())
    out = {"slope": slope, "intercept": intercept, "n": n, "df": n - 2, "x_mean": float(x.mean()), "sxx": sxx,
           "residual_sd": None, "sd": None, "quantization_sd": None, "t": None, "slope_ci": None, "level": level}
    if n < 3:
        return out
    resid = y - (intercept + slope * x)
    out["residual_sd"] = float(math.sqrt((resid ** 2).sum() / (n - 2)))
    if widths:
        out["quantization_sd"] = float(math.sqrt(statistics.fmean(w * w for w in widths) / 12))
    sd = max(out["residual_sd"], out["quantization_sd"] or 0.0)
    t = float(stats.t.ppf(0.5 + level / 2, n - 2))
    half = t * sd / math.sqrt(sxx)
    out.update(sd=sd, t=t, slope_ci=(slope - half, slope + half))
    return out


def predict_log(fit: dict, x_star: float) -> tuple[float, tuple[float, float] | None]:
    """The fitted log10 value at x_star and its t prediction interval for one new size (None without a sd)."""
    y = fit["intercept"] + fit["slope"] * x_star
    if fit.get("sd") is None:
        return y, None
    half = fit["t"] * fit["sd"] * math.sqrt(1 + 1 / fit["n"] + (x_star - fit["x_mean"]) ** 2 / fit["sxx"])
    return y, (y - half, y + half)


def fit_intervals(xs: list[float], ivs: list[tuple[float, float]], x_star: float | None = None) -> dict:
    """Every estimate of one family from (log10 n, interval) pairs: the least-squares fit of the two-sided
    midpoints (`fit`), the consistent slopes (`slope_range`), and at x_star the fitted value, its t interval and
    the range of every line through every interval (all in log10 BER)."""
    two = [(x, iv) for x, iv in zip(xs, ivs) if interval_kind(iv) == "two-sided"]
    fit = least_squares([x for x, _ in two], [math.log10(midpoint(iv)) for _, iv in two],
                        [math.log10(iv[1] / iv[0]) for _, iv in two])
    out = {"fit": fit, "n_two_sided": len(two), "n": len(xs), "slope_range": slope_range(xs, ivs),
           "prediction": None, "prediction_t": None, "prediction_range": None}
    if x_star is not None:
        out["prediction_range"] = value_range(xs, ivs, x_star)
        if fit is not None:
            out["prediction"], out["prediction_t"] = predict_log(fit, x_star)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Families of thresholds
# ---------------------------------------------------------------------------------------------------------------

def _settings_key(settings: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (settings or {}).items()))


def n_params_of(t: dict) -> int | None:
    if t.get("n_params"):
        return int(t["n_params"])
    return theory.param_count(t["model"]) if t.get("model") in PRESETS else None


def lambda_per_ber_of(model: str, t: dict) -> float | None:
    """theory.lambda_per_ber of `model` in t's mode, ranks and (PP) batch and sequence length; None when unknown."""
    world = int(t.get("world_size") or 0)
    if model not in PRESETS or world < 2:
        return None
    wire = (t.get("settings") or {}).get("wire_dtype") or "fp32"
    try:
        if t["mode"] == "ddp":
            return theory.lambda_per_ber("ddp", world, n_params=theory.param_count(model), wire_dtype=wire)
        if t["mode"] == "pp" and t.get("batch_size"):
            return theory.lambda_per_ber("pp", world, batch_size=int(t["batch_size"]),
                                         seq_len=int(seq_len_of(model, t.get("seq_len"))),
                                         width=PRESETS[model].n_embd, wire_dtype=wire)
    except (TypeError, ValueError):
        return None
    return None


def families(th: dict[str, dict], tolerance: float | None = None) -> list[dict]:
    """The configs of `th` (analysis.thresholds) grouped by mode, scope, checksum and recipe settings, each with
    its sizes, smallest first: {kind, mode, scope, checksum, settings, sizes: [{recipe, model, n_params, steps, lr,
    seeds, interval, theory_ber, ...}]}. `tolerance`: the interval at that tolerance of the sensitivity table
    instead of the registered one. Configs without a model or threshold are left out."""
    groups: dict[tuple, dict] = {}
    for t in th.values():
        if not t.get("applies") or t.get("tolerance_abs") is None or not t.get("tested_bers"):
            continue
        n = n_params_of(t)
        if n is None:
            continue
        ok, fail = (t["sensitivity"][tolerance] if tolerance is not None and tolerance in t.get("sensitivity", {})
                    else (t["max_ok_ber"], t["min_fail_ber"]))
        iv = interval_of(ok, fail)
        if iv is None:
            continue
        settings = t.get("settings") or {}
        # the same recipe on another rank count, or with another residual on protected bits, is another family
        key = (t["mode"], t["scope"], t["checksum"], _settings_key(settings), t.get("world_size"),
               float(f"{t.get('residual') or 0.0:.3g}"))
        fam = groups.setdefault(key, {"kind": recipe_kind(settings), "mode": t["mode"], "scope": t["scope"],
                                      "checksum": t["checksum"], "settings": settings, "sizes": []})
        tol_ber = t.get("theory_tolerated_ber")
        fam["sizes"].append({"recipe": t["recipe"], "model": t.get("model"), "n_params": n, "steps": t.get("steps"),
                             "lr": t.get("lr"), "seeds": t.get("seeds"), "interval": iv, "kind": interval_kind(iv),
                             "non_monotonic": t.get("non_monotonic", False),
                             "theory_ber": tol_ber if tol_ber is not None and 0 < tol_ber < math.inf else None,
                             "theory_none": tol_ber is not None and math.isinf(tol_ber),
                             "lambda_per_ber": lambda_per_ber_of(t.get("model"), t), "threshold": t})
    out = []
    for fam in groups.values():
        models = [s["model"] for s in fam["sizes"]]
        if len(set(models)) < len(models):  # a size twice (a long run beside the ladder's): one family per length
            by_steps: dict = {}
            for s in fam["sizes"]:
                by_steps.setdefault(s["steps"], []).append(s)
            split = [{**fam, "sizes": sizes} for _, sizes in sorted(by_steps.items(), key=lambda kv: kv[0] or 0)]
        else:
            split = [fam]
        for f in split:
            f["sizes"].sort(key=lambda s: (s["n_params"], model_key(s["model"])))
            out.append(f)
    return sorted(out, key=lambda f: (("default", "sanitize", "protect", "other").index(f["kind"]),
                                      f["mode"] != "ddp", f["scope"], f["checksum"], str(f["settings"])))


def family_name(fam: dict) -> str:
    """The recipe of a family without its mode: 'default', 'sanitize', the recipes' names for an 'other' kind;
    scope/checksum appended when not tensor/fix."""
    name = fam["kind"] if fam["kind"] != "other" else "/".join(dict.fromkeys(s["recipe"] for s in fam["sizes"]))
    return name + ("" if (fam["scope"], fam["checksum"]) == ("tensor", "fix") else f" {fam['scope']}/{fam['checksum']}")


def family_label(fam: dict) -> str:
    """'default DDP', 'sanitize PP' (family_name and the mode)."""
    return f"{family_name(fam)} {mode_name(fam['mode'])}"


def size_fit(fam: dict, target: str = TARGET_MODEL) -> dict:
    """The fit of one family (module docstring): measured, theory and the prediction at `target`, as BER (not
    log10): {label, sizes, fit, slope_range, theory_slope and theory_basis ('tolerated': the fit of the sizes'
    tolerated BERs; 'lambda': at fixed lambda, when the rows lack the loss curves the tolerated BER needs; None: the
    recipe loses no steps), lambda_slope, verdict, prediction_ber: {ber, range, t, theory}, differs: what differs
    between its sizes (steps, lr, seeds: fewer seeds widen the t bound, a stricter rule at that size)}."""
    sizes = fam["sizes"]
    xs = [math.log10(s["n_params"]) for s in sizes]
    x_star = math.log10(theory.param_count(target))
    est = fit_intervals(xs, [s["interval"] for s in sizes], x_star)
    theory_pts = [(x, math.log10(s["theory_ber"])) for x, s in zip(xs, sizes) if s["theory_ber"]]
    theory_fit = (least_squares(*zip(*theory_pts)) if len(theory_pts) == len(sizes) and len(sizes) >= 2 else None)
    lam = [(x, -math.log10(s["lambda_per_ber"])) for x, s in zip(xs, sizes) if s["lambda_per_ber"]]
    lambda_fit = least_squares(*zip(*lam)) if len(lam) == len(sizes) and len({x for x, _ in lam}) >= 2 else None
    no_lost = any(s["theory_none"] for s in sizes)
    if theory_fit is not None:
        theory_slope, basis = theory_fit["slope"], "tolerated"
    elif lambda_fit is not None and not no_lost:
        # the tolerated BER needs the clean loss curves (rows rebuilt from summary.csv lack them): fixed lambda
        theory_slope, basis = lambda_fit["slope"], "lambda"
    else:
        theory_slope, basis = None, None
    theory_target = None
    largest = next((s for s in reversed(sizes) if s["theory_ber"] and s["lambda_per_ber"]), None)
    per_target = lambda_per_ber_of(target, largest["threshold"]) if largest else None
    if largest and per_target:
        theory_target = largest["theory_ber"] * largest["lambda_per_ber"] / per_target
    ten = lambda v: None if v is None else 10.0 ** v  # noqa: E731
    pred = {"ber": ten(est["prediction"]),
            "range": None if est["prediction_range"] is None else tuple(ten(v) for v in est["prediction_range"]),
            "t": None if est["prediction_t"] is None else tuple(ten(v) for v in est["prediction_t"]),
            "theory": theory_target}
    differs = {k: sorted({s[k] for s in sizes if s[k] is not None}) for k in ("steps", "lr", "seeds")}
    return {"label": family_label(fam), "name": family_name(fam), "family": fam, "sizes": sizes, "target": target,
            "target_n_params": theory.param_count(target), **est, "theory_slope": theory_slope,
            "theory_basis": basis,
            "theory_fit": theory_fit, "lambda_slope": lambda_fit["slope"] if lambda_fit else None,
            "no_lost_steps": no_lost, "verdict": slope_verdict(theory_slope, est), "prediction_ber": pred,
            "differs": {k: v for k, v in differs.items() if len(v) > 1}}


def slope_verdict(theory_slope: float | None, est: dict) -> str | None:
    """'consistent' when the theory's slope is among the consistent slopes (or, without them, inside the t
    interval); 'steeper' when the measured thresholds fall faster with size than the theory says, 'shallower'
    when slower; 'unconstrained' when the intervals allow every slope; 'no power law' when no line fits every
    interval; None when either side is missing."""
    if theory_slope is None:
        return None
    rng = est["slope_range"]
    if rng is not None:
        lo, hi = rng
    elif est["fit"] is not None and est["fit"]["slope_ci"] is not None:
        lo, hi = est["fit"]["slope_ci"]
    elif est["n"] >= 2:
        return "no power law"
    else:
        return None
    if math.isinf(lo) and math.isinf(hi):
        return "unconstrained"  # one-sided intervals only: any slope fits
    if lo <= theory_slope <= hi:
        return "consistent"
    return "steeper" if hi < theory_slope else "shallower"


def size_fits(th: dict[str, dict], target: str = TARGET_MODEL, tolerance: float | None = None) -> list[dict]:
    """size_fit of every family with at least two distinct sizes (at `tolerance`: see families)."""
    return [size_fit(f, target) for f in families(th, tolerance)
            if len({s["n_params"] for s in f["sizes"]}) >= 2]


def sensitivity_fits(th: dict[str, dict], tolerances) -> dict[float, dict[str, dict]]:
    """Per tolerance of the sensitivity table: {family label: its size_fit} (the slope at each tolerance)."""
    return {tol: {f["label"]: f for f in size_fits(th, tolerance=tol)} for tol in tolerances}


def is_size_ladder(th: dict[str, dict]) -> bool:
    """Whether any family has thresholds at two or more sizes (the section applies)."""
    return any(len({s["n_params"] for s in f["sizes"]}) >= 2 for f in families(th))


def matched_seeds(rows: list[dict], th: dict[str, dict]) -> list[int] | None:
    """The seeds every size of a ladder ran, when some size ran more (the paired rule's t bound is wider with
    fewer seeds, so sizes with different seed counts are judged by rules of different strictness); None when the
    seed sets already match or no family has two sizes. The report refits on these seeds alone."""
    models = {s["model"] for f in families(th) if len({x["n_params"] for x in f["sizes"]}) >= 2 for s in f["sizes"]}
    per_model = {m: {r.get("seed") for r in rows if r.get("model") == m and r.get("seed") is not None}
                 for m in models}
    if len(per_model) < 2 or len({frozenset(v) for v in per_model.values()}) == 1:
        return None
    common = sorted(set.intersection(*per_model.values()))
    return common if len(common) >= 2 else None
