"""What an experiment's results say: pure functions on results.jsonl rows and latency.json, no files, no
drawing. The report (report.py) renders what these return; the definitions are written into report.md.

- quality metrics of a grid point (eval loss, skipped updates, weight deviation, replica divergence) average
  over its runs with status ok: a crashed run's last eval is from another step and is not comparable;
- link counters (bits flipped and seen) sum over every run, and step time is the median over every run that
  reported one;
- a grid point is a recipe, mode, scope, checksum and BER; its clean point has the same recipe at BER 0;
- loss gap = mean eval loss - mean eval loss of the clean runs (BER 0, same config); positive is worse;
- the paired rule (pre-registered: the tolerance is written in the experiment file before the run and recorded in
  every row). Per seed, gap = eval loss at BER b - eval loss at BER 0 with the same seed (same recipe, mode,
  scope, checksum). A BER passes when every run of it ended ok with an eval loss and made progress, every seed
  has a clean run to pair with, and the one-sided 95 % upper bound of the mean gap is <= tolerance x the clean
  mean eval loss. The bound is Student's t: mean + t(0.95, n-1) x sd / sqrt(n) over the n paired seeds. t, not a
  bootstrap: with the 3-5 seeds a grid affords, a bootstrap's resampled means can never exceed the largest
  observed gap, so its upper bound under-covers; t is exact for normal gaps, deterministic, and needs >= 2
  seeds (one seed has no bound and cannot pass). The clean runs must all be ok, with an eval loss, and have made
  progress, else the config has no baseline;
- "trains as well as clean up to B" = B and every tested BER below it pass; "fails from F" = the smallest BER
  that does not pass. The threshold lies in (B, F]; a BER above F that passes again is flagged non-monotonic.
  A run that made no progress (its eval loss fell less than 1 %) fails its BER;
- sensitivity: the same rule at tolerances 0.5 %, 1 %, 2 % and 5 % (SENSITIVITY_TOLERANCES);
- lost steps: skipped updates / completed steps, pooled over the seeds (steps are independent trials), with a
  Clopper-Pearson interval; the theory's fraction (theory.predict_recipe) agrees when it lies inside it;
- the theory's tolerated BER: lost steps cost time (the time-shift model: a run that lost a fraction f of its
  K steps ends where the clean run was at step (1-f) K, on the clean runs' mean training-loss curve), so it is
  the BER at which 1 - exp(-lambda) reaches the largest f whose time shift stays within the tolerance.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter

import numpy as np
from scipy import stats

from testbed.train.model import PRESETS, seq_len_of
from testbed.train.settings import default_of
from testbed.vocab import CHECKSUM_MODES, DEFAULT_TOLERANCE
from testbed.analysis import theory
from testbed.analysis.formatting import ber_text, fmt_loss, fmt_signed, status_text
from testbed.analysis.results import (RECIPE_FIELDS, SETUP_FIELDS, STATUSES, ber_of, config_key, config_of, config_sort_key, configs, finite,
                      is_ok, positive, recipe_of, recipe_settings)

SENSITIVITY_TOLERANCES = (0.005, 0.01, 0.02, 0.05)  # the report's sensitivity table
BOUND_LEVEL = 0.95  # one-sided level of the upper bound of the mean paired gap
# Published analysis (GPT-2 124M): DDP trained as well as clean below BER 1e-4, PP needed BER below 1e-5
PUBLISHED_TOLERATED_BER = {"ddp": 1e-4, "pp": 1e-5}
LATENCY_STATS = ("p50_us", "p99_us", "mean_us")
CONFIDENCE = 0.95  # of the binomial intervals on measured fractions
PROGRESS_MARGIN = 0.01  # made progress: the last eval loss at least 1 % below the initial one (as launch.py)


# ---------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------

def skipped_fraction(row: dict) -> float | None:
    """Skipped updates / steps the run completed (all steps when it did not report steps_completed)."""
    skipped = finite(row.get("skipped_steps"))
    steps = finite(row.get("steps_completed")) or finite(row.get("steps"))
    if skipped is None or not steps:
        return None
    return skipped / steps


def lost_steps(row: dict) -> tuple[int, int] | None:
    """(updates lost, steps completed) of a run: skipped_steps, else lost_step_fraction x steps."""
    steps = finite(row.get("steps_completed"))
    if not steps:
        return None
    skipped = finite(row.get("skipped_steps"))
    if skipped is None and finite(row.get("lost_step_fraction")) is not None:
        skipped = round(row["lost_step_fraction"] * steps)
    return None if skipped is None else (int(skipped), int(steps))


def made_progress(row: dict) -> bool | None:
    """The row's made_progress; for rows without it, the last eval loss against the initial one (or the first
    training loss, taken before any update), at least PROGRESS_MARGIN lower. None when unknown."""
    if row.get("made_progress") is not None:
        return bool(row["made_progress"])
    start = finite(row.get("initial_eval_loss"))
    curve = row.get("loss_curve")
    if start is None and isinstance(curve, list) and curve:
        start = finite(curve[0])
    end = finite(row.get("final_eval_loss"))
    if start is None or row.get("final_eval_loss") is None:
        return None
    return end is not None and end < start * (1 - PROGRESS_MARGIN)


def clopper_pearson(k: int, n: int, level: float = CONFIDENCE) -> tuple[float, float]:
    """Exact binomial interval of a fraction k/n: the beta quantiles (Clopper and Pearson, 1934)."""
    a = (1 - level) / 2
    lo = float(stats.beta.ppf(a, k, n - k + 1)) if k > 0 else 0.0
    hi = float(stats.beta.ppf(1 - a, k + 1, n - k)) if k < n else 1.0
    return lo, hi


def poisson_interval(k: int, level: float = CONFIDENCE) -> tuple[float, float]:
    """Exact interval of a Poisson mean from a count k (Garwood)."""
    a = (1 - level) / 2
    lo = float(stats.chi2.ppf(a, 2 * k) / 2) if k > 0 else 0.0
    return lo, float(stats.chi2.ppf(1 - a, 2 * k + 2) / 2)


def run_setup(rows: list[dict], mode: str) -> dict:
    """The training setup of `mode`'s runs (first row that reports each field), for the theory overlays."""
    setup = {}
    for key in SETUP_FIELDS:
        for r in rows:
            if r.get("mode") == mode and r.get(key) is not None:
                setup[key] = r[key]
                break
    return setup


def theory_deviation(bers, setup: dict) -> np.ndarray | None:
    """weight_deviation_estimate (DDP gradient errors, AdamW as the worker trains) at each BER, or None when the
    setup lacks n_params/steps/lr. grad_clip None means the worker's default, 1.0; world_size < 2 has no ring."""
    n_params, steps, lr = setup.get("n_params"), setup.get("steps"), setup.get("lr")
    if not (n_params and steps and lr):
        return None
    clip = setup.get("grad_clip")
    n_ranks = max(int(setup.get("world_size") or 2), 2)
    est = theory.weight_deviation_estimate(np.asarray(bers, dtype=float), int(n_params), int(steps), float(lr),
                                           default_of("optimizer"), n_ranks=n_ranks,
                                           grad_clip=default_of("grad_clip") if clip is None else float(clip))
    return np.atleast_1d(np.asarray(est, dtype=float))


def predict_point(point: dict, train: dict | None = None, ber: float | None = None) -> theory.RecipePrediction | None:
    """theory.predict_recipe for an aggregated point (its recipe settings, setup and BER; `train`: the experiment
    file's train: for what rows lack), or None when the setup does not say enough (model, ranks, PP's batch)."""
    t = {k: v for k, v in (train or {}).items() if v is not None}
    get = lambda k: point.get(k) if point.get(k) is not None else t.get(k)  # noqa: E731
    model, world = get("model"), get("world_size")
    if model not in PRESETS or not world or int(world) < 2:
        return None
    preset = PRESETS[model]
    seq = int(seq_len_of(model, get("seq_len")))
    batch = int(get("batch_size") or default_of("batch_size"))
    if point.get("mode") == "ddp":
        shape = {"n_params": int(get("n_params") or theory.param_count(model))}
    elif point.get("mode") == "pp":
        shape = {"batch_size": batch, "seq_len": seq, "width": preset.n_embd}
    else:
        return None
    clip, grad_clip = point.get("clip") or default_of("clip"), get("grad_clip")
    try:
        return theory.predict_recipe(
            point["ber"] if ber is None else ber, point["mode"], int(world), **shape,
            wire_dtype=point.get("wire_dtype") or default_of("wire_dtype"), protect=point.get("protect"),
            protected_ber=point.get("protected_ber") or 0.0, guard=point.get("guard") or default_of("guard"),
            clip=clip, grad_clip=default_of("grad_clip") if grad_clip is None else float(grad_clip),
            optimizer=point.get("optimizer") or default_of("optimizer"),
            sanitize_threshold=point.get("sanitize_threshold") or default_of("sanitize_threshold"),
            steps=int(get("steps") or 100), lr=float(get("lr") or default_of("lr")))
    except (ValueError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# Aggregation and thresholds
# ---------------------------------------------------------------------------------------------------------------

def values_of(rows: list[dict], field: str, convert=finite) -> list[float]:
    return [v for r in rows if (v := convert(r.get(field))) is not None]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _stdev(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def _status_counts(rows: list[dict]) -> dict[str, int]:
    counts = Counter(str(r.get("status")) for r in rows)
    order = [s for s in STATUSES if s in counts] + sorted(s for s in counts if s not in STATUSES)
    return {s: counts[s] for s in order}


def sum_or_none(values: list[float]) -> float | int | None:
    """The sum; an int when every value is a whole number (counters stay counts in the tables)."""
    if not values:
        return None
    total = sum(values)
    return int(total) if all(float(v).is_integer() for v in values) else total


def _mean_curve(curves: list) -> list[float | None]:
    """Per step, the mean of the curves' finite values (None where none is)."""
    curves = [c for c in curves if isinstance(c, list)]
    out = []
    for step in range(max((len(c) for c in curves), default=0)):
        vals = [v for c in curves if step < len(c) and (v := finite(c[step])) is not None]
        out.append(_mean(vals))
    return out


def _aggregate_point(group: list[dict]) -> dict:
    """The statistics of one grid point (one recipe/mode/scope/checksum/BER, all its seeds)."""
    ok = [r for r in group if is_ok(r)]
    evals = values_of(ok, "final_eval_loss")
    flipped, seen = sum_or_none(values_of(group, "bits_flipped")), sum_or_none(values_of(group, "bits_seen"))
    step_times = values_of(group, "median_step_time_s", positive)
    first = group[0]
    lost = [x for r in group if (x := lost_steps(r)) is not None]
    sanitized = [(int(r["sanitized_values"]), int(r["steps_completed"])) for r in group
                 if finite(r.get("sanitized_values")) is not None and finite(r.get("steps_completed"))]
    frozen = [r["frozen_values"] / r["n_params"] for r in ok
              if finite(r.get("frozen_values")) is not None and finite(r.get("n_params"))]
    progress = [made_progress(r) for r in ok]
    point = {
        "recipe": recipe_of(first), "mode": first.get("mode"), "scope": first.get("scope"),
        "checksum": first.get("checksum"), "ber": ber_of(first),
        "n_seeds": len(group), "seeds": sorted(r.get("seed") for r in group if r.get("seed") is not None),
        "statuses": _status_counts(group), "n_ok": len(ok), "all_ok": len(ok) == len(group),
        "eval_loss_mean": _mean(evals), "eval_loss_std": _stdev(evals), "eval_loss_n": len(evals),
        "eval_by_seed": {r["seed"]: v for r in ok if r.get("seed") is not None
                         and (v := finite(r.get("final_eval_loss"))) is not None},
        "skipped_steps_mean": _mean(values_of(ok, "skipped_steps")),
        "skipped_fraction_mean": _mean([v for r in ok if (v := skipped_fraction(r)) is not None]),
        "deviation_mean": _mean(values_of(ok, "final_deviation")),
        "divergence_mean": _mean(values_of(ok, "final_replica_divergence")),
        "nonfinite_received_total": sum_or_none(values_of(group, "nonfinite_received_total")),
        "bits_flipped_total": flipped, "bits_seen_total": seen,
        "realized_ber": flipped / seen if flipped is not None and seen else None,
        "median_step_time_s": float(np.median(step_times)) if step_times else None,
        "lost_steps_total": sum(k for k, _ in lost) if lost else None,
        "lost_steps_of": sum(n for _, n in lost) if lost else None,
        "sanitized_total": sum(k for k, _ in sanitized) if sanitized else None,
        "sanitized_steps": sum(n for _, n in sanitized) if sanitized else None,
        "frozen_fraction_mean": _mean(frozen),
        "no_progress": sum(1 for x in progress if x is False),
        "tokens_per_step": next((r["tokens_per_step"] for r in group if r.get("tokens_per_step")), None),
        "loss_curve_mean": _mean_curve([r.get("loss_curve") for r in ok]),
        **recipe_settings(first),
    }
    k, n = point["lost_steps_total"], point["lost_steps_of"]
    point["lost_fraction"] = k / n if n else None
    point["lost_fraction_ci"] = clopper_pearson(k, n) if n else None
    for key in SETUP_FIELDS:
        point[key] = next((r[key] for r in group if r.get(key) is not None), None)
    return point


def point_config(point: dict) -> tuple:
    """(mode, scope, checksum, recipe) of an aggregated point."""
    return (point["mode"], point["scope"], point["checksum"], point["recipe"])


def aggregate(rows: list[dict], train: dict | None = None) -> list[dict]:
    """One dict per (recipe, mode, scope, checksum, BER), in grid order, with the loss gap against the clean point
    of the same config (None when that has no ok run with an eval loss) and the theory's prediction
    (`prediction`: theory.RecipePrediction or None; `train`: the experiment's train: for what rows lack)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((*config_of(r), ber_of(r)), []).append(r)
    points = [_aggregate_point(g) for _, g in sorted(groups.items(), key=lambda kv: (*config_sort_key(kv[0][:4]),
                                                                                         kv[0][4]))]
    clean = {point_config(p): p for p in points if p["ber"] == 0}
    # a recipe that shares another's clean runs (its baseline: testbed/experiments/spec.py) has none of its own:
    # its rows name the clean point they pair with
    by_id = {r.get("point"): r for r in rows}
    shared = {config_of(r): config_of(by_id[r["baseline"]]) for r in rows
              if ber_of(r) > 0 and r.get("baseline") in by_id and config_of(by_id[r["baseline"]]) != config_of(r)}
    for p in points:
        p["prediction"] = predict_point(p, train)
        own = point_config(p) if point_config(p) in clean else shared.get(point_config(p))
        p["clean_config"] = own
        base = clean.get(own)
        p["clean_eval_loss_mean"] = base["eval_loss_mean"] if base else None
        p["clean_eval_loss_std"] = base["eval_loss_std"] if base else None
        gap_ok = p["eval_loss_mean"] is not None and p["clean_eval_loss_mean"] is not None
        p["loss_gap"] = p["eval_loss_mean"] - p["clean_eval_loss_mean"] if gap_ok else None
        p["loss_gap_rel"] = (p["loss_gap"] / p["clean_eval_loss_mean"]
                             if gap_ok and p["clean_eval_loss_mean"] else None)
        p.update(paired_gap(p["eval_by_seed"], base["eval_by_seed"] if base else {}))
    return points


def upper_bound(gaps: list[float], level: float = BOUND_LEVEL) -> float | None:
    """One-sided upper confidence bound of the mean of `gaps` (Student's t: mean + t(level, n-1) sd / sqrt(n));
    None with fewer than two values (one seed has no spread to bound the mean by)."""
    if len(gaps) < 2:
        return None
    mean, sd = statistics.fmean(gaps), statistics.stdev(gaps)
    return mean + float(stats.t.ppf(level, len(gaps) - 1)) * sd / math.sqrt(len(gaps))


def paired_gap(evals: dict, clean: dict) -> dict:
    """The paired comparison of a point's eval losses with its clean point's, seed by seed ({seed: eval loss}):
    `gaps` {seed: eval - clean eval of the same seed}, their mean, the one-sided upper bound of the mean
    (upper_bound), and `unpaired_seeds`, the point's seeds without a clean run to pair with."""
    gaps = {seed: v - clean[seed] for seed, v in sorted(evals.items()) if seed in clean}
    values = list(gaps.values())
    return {"gaps": gaps, "gap_mean": _mean(values), "gap_upper": upper_bound(values),
            "unpaired_seeds": sorted(seed for seed in evals if seed not in clean)}


def _config_key(point: dict) -> str:
    return config_key(point_config(point))


def _gaps_text(point: dict) -> str:
    return ", ".join(fmt_signed(g, fmt_loss) for g in point["gaps"].values())


def _failure_reason(point: dict, tolerance_abs: float) -> str | None:
    """Why a BER point does not pass the paired rule (module docstring), or None when it does."""
    failed = {s: n for s, n in point["statuses"].items() if s != "ok"}
    if failed:
        return ", ".join(f"{n} {s}" for s, n in failed.items())
    if point["eval_loss_n"] < point["n_seeds"]:
        return f"{point['n_seeds'] - point['eval_loss_n']} ok run(s) without an eval loss"
    if point["no_progress"]:
        return f"{point['no_progress']} ok run(s) made no progress"
    if point["unpaired_seeds"]:
        return (f"seed(s) {', '.join(map(str, point['unpaired_seeds']))} have no clean run of the same seed to pair "
                "with")
    if point["gap_upper"] is None:
        return f"{len(point['gaps'])} paired seed(s): the upper bound needs at least 2"
    if point["gap_upper"] > tolerance_abs:
        return (f"upper bound of the mean gap {fmt_signed(point['gap_upper'], fmt_loss)} > tolerance "
                f"{fmt_loss(tolerance_abs)}; gaps {_gaps_text(point)}")
    return None


def theory_threshold(mode: str, checksum: str | None, setup: dict) -> tuple[float | None, str]:
    """The theory's catastrophic-hit threshold (one catastrophic fp32 value expected per step) for this setup,
    and what it counts. DDP: errors reaching one rank's gradient through the gloo ring; PP: all activations and
    activation gradients crossing the S-1 boundaries. With checksum 'keep' corrupt segments are dropped and
    resent, so nothing corrupt reaches training and the threshold does not apply."""
    if checksum == "keep":
        return None, "checksum keep: corrupt segments are dropped and retransmitted; no corrupt value reaches training"
    model, n_params, world = setup.get("model"), setup.get("n_params"), int(setup.get("world_size") or 2)
    try:
        if mode == "ddp":
            n = int(n_params) if n_params else theory.param_count(model)
            bits = theory.ddp_ring_flips(0.0, n, max(world, 2)).error_bits_in_rank_gradient
            p = theory.flip_statistics(theory.typical_gradient_values()).p_catastrophic
            return (theory.catastrophic_threshold_ber(bits, p),
                    f"1 catastrophic gradient value per step and rank ({max(world, 2)} ranks, {n:,} parameters)")
        if mode == "pp":
            width = PRESETS[model].n_embd
            batch = int(setup.get("batch_size") or default_of("batch_size"))
            seq = int(seq_len_of(model, setup.get("seq_len")))
            bits = theory.pp_flips(0.0, max(world, 2), batch, seq, width, microbatches=1).bits_per_step
            p = theory.flip_statistics(theory.typical_activation_values()).p_catastrophic
            return (theory.catastrophic_threshold_ber(bits, p),
                    f"1 catastrophic activation value per step ({max(world, 2)} stages, batch {batch} x {seq} "
                    f"tokens, width {width})")
    except (KeyError, ValueError, TypeError) as e:
        return None, f"no theory threshold for this setup ({e})"
    return None, f"no theory threshold for mode {mode!r}"


def thresholds(agg: list[dict], tolerance: float = DEFAULT_TOLERANCE, train: dict | None = None,
               pending: dict[tuple, tuple[int, int]] | None = None) -> dict[str, dict]:
    """Per config ('mode/scope/checksum', '/RECIPE' appended for a recipe other than the default): under the
    paired rule at `tolerance` (relative to the clean mean eval loss), the largest BER up to which training is as
    good as clean, the smallest BER at which it fails, why, the same interval at each of SENSITIVITY_TOLERANCES
    (`sensitivity`: {tolerance: (max_ok, min_fail)}), the theory's thresholds and the published one (see the
    module docstring). `train` (the experiment's train: section) supplies batch_size/seq_len for PP when rows
    lack them. `pending`: {(recipe, mode, scope, checksum, BER): (seeds run, seeds in the grid)} for the BERs of
    a grid still running (report.pending_points): such a BER neither passes nor fails yet (`pending` of the
    result), unless a run of it already failed outright."""
    out: dict[str, dict] = {}
    for key in dict.fromkeys(_config_key(p) for p in agg):
        points = [p for p in agg if _config_key(p) == key]
        clean = next((p for p in points if p["ber"] == 0), None) or next(
            (p for p in agg if p["ber"] == 0 and point_config(p) == points[0].get("clean_config")), None)
        setup = {**{k: v for k, v in (train or {}).items() if v is not None},
                 **{k: v for k, v in points[0].items() if v is not None}}
        result = _threshold_of(points, clean, tolerance, pending or {})
        # the question applies unless every run ended ok without an eval loss (an experiment that does not evaluate)
        result["applies"] = any(p["eval_loss_n"] or not p["all_ok"] for p in points)
        result["sensitivity"] = {}
        for tol in sorted({*SENSITIVITY_TOLERANCES, tolerance}):
            other = _threshold_of(points, clean, tol, pending or {})
            result["sensitivity"][tol] = (other["max_ok_ber"], other["min_fail_ber"])
        result["theory_ber"], result["theory_basis"] = theory_threshold(points[0]["mode"], points[0]["checksum"],
                                                                        setup)
        result.update(theory_tolerated(points, clean, result["tolerance_abs"], train))
        if result["theory_note"] and result["theory_lost_ber"] == math.inf:
            # no catastrophic value costs this recipe a step: the per-rank count does not apply
            result["theory_ber"], result["theory_basis"] = None, result["theory_note"]
        result.update(recipe=points[0]["recipe"], mode=points[0]["mode"], scope=points[0]["scope"],
                      checksum=points[0]["checksum"], steps=setup.get("steps"),
                      **{k: setup.get(k) for k in ("model", "n_params", "lr", "world_size", "batch_size", "seq_len")},
                      settings={k: points[0].get(k) for k in RECIPE_FIELDS},
                      # protected bits' residual as a fraction of the BER (protected_fraction; the settings above
                      # are the clean point's, where it is 0): what tells protect from protect + residual apart
                      residual=max((p["protected_ber"] / p["ber"] for p in points
                                    if p["ber"] > 0 and finite(p.get("protected_ber"))), default=0.0),
                      seeds=max((p["n_seeds"] for p in points), default=0),
                      tokens_per_step=next((p["tokens_per_step"] for p in points if p["tokens_per_step"]), None),
                      published_ber=PUBLISHED_TOLERATED_BER.get(points[0]["mode"]))
        out[key] = result
    return out


def time_shift_fraction(curve: list, tolerance_abs: float | None) -> float | None:
    """The largest fraction f of lost steps whose time shift stays within the tolerance: on the clean mean
    training-loss curve (trailing mean over K/10 steps), L((1-f) K) - L(K) <= tolerance for every smaller f.
    1.0 when even losing every step stays within it; None without a usable curve."""
    vals = np.array([np.nan if finite(v) is None else v for v in curve or []], dtype=float)
    if tolerance_abs is None or len(vals) < 10 or not np.isfinite(vals[-1]):
        return None
    window = max(3, len(vals) // 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # windows without a finite value stay NaN
        smooth = np.array([np.nanmean(vals[max(0, i - window + 1): i + 1]) for i in range(len(vals))])
    end, steps = smooth[-1], len(vals)
    for j in range(1, steps):
        if not smooth[steps - 1 - j] - end <= tolerance_abs:
            return (j - 1) / steps
    return 1.0


def theory_tolerated(points: list[dict], clean: dict | None, tolerance_abs: float | None,
                     train: dict | None = None) -> dict:
    """The theory's verdict for one config: `theory_lost_ber`, the BER at which one update per step is expected
    lost (lambda = 1: 1 - exp(-1) = 63 % of steps), `time_shift_fraction` (f*), and `theory_tolerated_ber`, the
    BER at which 1 - exp(-lambda) = f*; inf when the recipe loses no steps at any BER, None when unknown.
    `theory_note` says what the recipe does instead when it loses no steps."""
    ref = next((p for p in points if p["ber"] > 0), points[0])
    # lambda is linear in BER (first order): read its slope at 1e-6 and 2e-6, or lower where a large model
    # saturates there (every step lost, or every run ended, at both BERs would read as a slope of 0)
    ref_ber = 1e-6
    low, high = predict_point(ref, train, ref_ber), predict_point(ref, train, 2 * ref_ber)
    while (low is not None and high is not None and ref_ber > 1e-15
           and (high.p_step_lost > 0.99 or high.p_run_completes < 0.01)):
        ref_ber /= 10
        low, high = predict_point(ref, train, ref_ber), predict_point(ref, train, 2 * ref_ber)
    out = {"theory_lost_ber": None, "theory_tolerated_ber": None, "time_shift_fraction": None, "theory_note": None,
           "theory_ending_ber": None}
    if low is None or high is None:
        out["theory_note"] = "no prediction: the rows lack the model, the ranks or the batch"
        return out
    lam = lambda p: -math.log1p(-min(p.p_step_lost, 1 - 1e-12))  # noqa: E731
    slope = (lam(high) - lam(low)) / ref_ber
    base = lam(low) - slope * ref_ber  # lost steps that do not depend on the BER (protected bits' residual)
    # run-ending events (guard stop, Inf/NaN under guard none): the BER at which half the runs end early
    end = lambda p: -math.log(max(p.p_run_completes, 1e-300))  # noqa: E731
    end_slope = (end(high) - end(low)) / ref_ber
    ending = (max(0.0, (math.log(2) - (end(low) - end_slope * ref_ber)) / end_slope) if end_slope > 0
              else math.inf)
    f = time_shift_fraction(clean and clean["loss_curve_mean"], tolerance_abs)
    out["time_shift_fraction"], out["theory_ending_ber"] = f, ending
    if slope <= 0:
        out["theory_lost_ber"] = math.inf
        out["theory_tolerated_ber"] = ending
        out["theory_note"] = _no_lost_steps_note(ref, predict_point(ref, train), ending)
        return out
    out["theory_lost_ber"] = max(0.0, (1 - base) / slope)
    if f is not None:
        lost = math.inf if f >= 1 else max(0.0, (-math.log1p(-f) - base) / slope)
        out["theory_tolerated_ber"] = min(lost, ending)
    return out


def _no_lost_steps_note(point: dict, pred: theory.RecipePrediction | None, ending: float = math.inf) -> str:
    """What a recipe that loses no steps does with the catastrophic values (the theory's words)."""
    if point.get("guard") == "sanitize":
        text = "no lost steps: values above the sanitize threshold are zeroed"
    elif point.get("protect"):
        text = "no lost steps: the link protects " + ", ".join(map(str, point["protect"]))
    elif point.get("guard") == "none":
        text = "no lost steps: guard none applies every update"
    else:
        text = "no lost steps predicted"
    if pred is not None and pred.frozen_fraction:
        text += f"; {100 * pred.frozen_fraction:.2g} % of the elements frozen at BER {pred.ber:.0e}"
    if math.isfinite(ending):
        text += (f"; but half the runs end early (Inf/NaN reach the weights, or the guard stops) from BER "
                 f"{ending:.2g}")
    return text


def _pending_key(point: dict) -> tuple:
    return point["recipe"], point["mode"], point["scope"], point["checksum"], float(point["ber"])


def _failed_outright(point: dict) -> bool:
    """A run of the point ended other than ok, or made no progress: it fails whatever its other seeds show."""
    return any(s != "ok" for s in point["statuses"]) or bool(point["no_progress"])


def _threshold_of(points: list[dict], clean: dict | None, tolerance: float,
                  pending: dict[tuple, tuple[int, int]]) -> dict:
    tested = [p for p in points if p["ber"] > 0]
    result = {"tolerance_rel": tolerance, "tested_bers": [p["ber"] for p in tested],
              "clean_eval_loss_mean": clean and clean["eval_loss_mean"],
              "clean_eval_loss_std": clean and clean["eval_loss_std"],
              "tolerance_abs": None, "passing_bers": [], "failing": {}, "max_ok_ber": None, "min_fail_ber": None,
              "non_monotonic": False, "note": None, "pending": {},
              "gaps": {p["ber"]: {"mean": p["gap_mean"], "upper": p["gap_upper"], "n": len(p["gaps"])}
                       for p in tested}}
    if clean is None or not clean["all_ok"] or clean["eval_loss_mean"] is None or clean["no_progress"]:
        result["note"] = ("no clean (BER 0) point" if clean is None else
                          f"the clean runs are not all ok ({status_text(clean['statuses'])}), so there is no "
                          "baseline to compare with" if not clean["all_ok"] else
                          "the clean runs have no eval loss" if clean["eval_loss_mean"] is None else
                          f"{clean['no_progress']} clean run(s) made no progress, so there is no baseline that "
                          "learned")
        return result
    if not tested:
        result["note"] = "no BER > 0 was run"
    tol = tolerance * clean["eval_loss_mean"]
    result["tolerance_abs"] = tol
    clean_todo = pending.get(_pending_key(clean)) if clean is not None else None
    for p in tested:
        reason = _failure_reason(p, tol)
        todo = pending.get(_pending_key(p))
        of_clean = todo is None and bool(clean_todo and p["unpaired_seeds"])  # its clean runs are still to come
        todo = clean_todo if of_clean else todo
        if todo and not _failed_outright(p):
            # seeds still to run move the paired bound either way: neither a pass nor a failure yet
            result["pending"][p["ber"]] = {"run": todo[0], "of": todo[1], "of_clean": of_clean}
        elif reason is None:
            result["passing_bers"].append(p["ber"])
        else:
            result["failing"][p["ber"]] = reason
    failing = sorted(result["failing"])
    result["min_fail_ber"] = failing[0] if failing else None
    below = [b for b in result["passing_bers"] if not failing or b < failing[0]]
    result["max_ok_ber"] = max(below) if below else None
    result["non_monotonic"] = bool(failing) and any(b > failing[0] for b in result["passing_bers"])
    if tested and not result["passing_bers"] and not failing:
        result["note"] = f"no BER decided yet: {pending_text(result['pending'])}"
    return result


def pending_text(pending: dict) -> str:
    """'1e-08 (1 of 3 seeds run), 3e-08 (2 of 3 clean runs)': the BERs that neither pass nor fail yet, their seeds
    (or the clean runs they pair with) not all run."""
    return ", ".join(f"{ber_text(b)} ({pending_seeds_text(v)})" for b, v in sorted(pending.items()))


def pending_seeds_text(v: dict) -> str:
    """'1 of 3 seeds run' (or '2 of 3 clean runs run'): one pending BER's state."""
    return f"{v['run']} of {v['of']} {'clean runs' if v['of_clean'] else 'seeds'} run"


def decided(t: dict) -> bool:
    """A threshold config with a BER that passed or failed (not only BERs whose seeds are still to run)."""
    return t["max_ok_ber"] is not None or t["min_fail_ber"] is not None


def tolerance_of(rows: list[dict], file_tolerance: float | None = None) -> tuple[float, str]:
    """The tolerance the experiment registered, and where it comes from: the rows' `tolerance` (written when
    each point ran); the experiment file's when rows disagree or predate the field; else DEFAULT_TOLERANCE."""
    recorded = sorted({v for r in rows if (v := positive(r.get("tolerance"))) is not None})
    if len(recorded) == 1:
        return recorded[0], "recorded in the results rows"
    if recorded and file_tolerance is not None:
        return file_tolerance, (f"the experiment file's; the rows record {', '.join(f'{v:.3g}' for v in recorded)} "
                                "(the file was edited between runs)")
    if recorded:
        return max(recorded), f"the largest the rows record ({', '.join(f'{v:.3g}' for v in recorded)})"
    if file_tolerance is not None:
        return file_tolerance, "the experiment file's; the rows predate the tolerance field"
    return DEFAULT_TOLERANCE, "the default; neither the rows nor an experiment file record one"


def interval(t: dict) -> tuple[float, float]:
    """Where a config's threshold lies, (max_ok, min_fail]: 0 when no BER passed, inf when none failed."""
    return (t["max_ok_ber"] or 0.0, t["min_fail_ber"] if t["min_fail_ber"] is not None else math.inf)


def published_verdict(t: dict) -> str | None:
    """'more tolerant', 'more fragile' or 'consistent' against the published threshold of t's mode."""
    pub, ok, fail = t["published_ber"], t["max_ok_ber"], t["min_fail_ber"]
    if pub is None or t["tolerance_abs"] is None or not t["tested_bers"] or not decided(t):
        return None
    if ok is not None and ok >= pub:
        return "more tolerant"
    if fail is not None and fail < pub:
        return "more fragile"
    return "consistent"


def orderings(th: dict[str, dict]) -> list[dict]:
    """Per recipe (and scope/checksum) with a DDP and a PP threshold: which mode tolerates more, measured and by
    the theory, whether that is the published ordering (DDP more tolerant than PP) and the published numbers,
    and whether both modes trained on the same tokens per step."""
    out = []
    by_rest: dict[tuple, dict] = {}
    for t in th.values():
        by_rest.setdefault((t["recipe"], t["scope"], t["checksum"]), {})[t["mode"]] = t
    for (recipe, scope, checksum), modes in by_rest.items():
        ddp, pp = modes.get("ddp"), modes.get("pp")
        if ddp is None or pp is None:
            continue
        usable = all(t["tolerance_abs"] is not None and t["tested_bers"] and decided(t) for t in (ddp, pp))
        measured = None
        if usable:
            (d_lo, d_hi), (p_lo, p_hi) = interval(ddp), interval(pp)
            measured = "ddp" if d_lo >= p_hi else "pp" if p_lo >= d_hi else "same"
        d_th, p_th = ddp.get("theory_tolerated_ber"), pp.get("theory_tolerated_ber")
        predicted = None
        if d_th is not None and p_th is not None:
            predicted = "same" if d_th == p_th or (math.isinf(d_th) and math.isinf(p_th)) else (
                "ddp" if d_th > p_th else "pp")
        tokens = (ddp.get("tokens_per_step"), pp.get("tokens_per_step"))
        out.append({"recipe": recipe, "scope": scope, "checksum": checksum, "measured": measured,
                    "predicted": predicted, "published_order": measured == "ddp",
                    "published_numbers": published_verdict(ddp) == "consistent" == published_verdict(pp),
                    "verdicts": {"ddp": published_verdict(ddp), "pp": published_verdict(pp)},
                    "tokens_per_step": tokens, "matched_tokens": None if None in tokens else tokens[0] == tokens[1]})
    return out


def theory_comparison(agg: list[dict]) -> list[dict]:
    """Per BER > 0 point with a prediction: the measured lost-step fraction (pooled over seeds, Clopper-Pearson
    interval), sanitized values per step (Poisson interval) and frozen fraction next to the theory's, each with
    a verdict: 'agrees' (the prediction lies in the interval), 'above' or 'below' (the measurement is)."""
    out = []
    for p in agg:
        pred = p["prediction"]
        if pred is None or p["ber"] == 0:
            continue
        row = {"recipe": p["recipe"], "mode": p["mode"], "scope": p["scope"], "checksum": p["checksum"],
               "ber": p["ber"], "prediction": pred, "lost": None, "sanitized": None, "frozen": None}
        if p["lost_fraction_ci"] is not None:
            row["lost"] = _verdict(p["lost_fraction"], p["lost_fraction_ci"], pred.p_step_skipped,
                                   k=p["lost_steps_total"], n=p["lost_steps_of"])
        if p["sanitized_steps"] and (p["guard"] == "sanitize" or p["sanitized_total"]):
            lo, hi = poisson_interval(p["sanitized_total"])
            n = p["sanitized_steps"]
            row["sanitized"] = _verdict(p["sanitized_total"] / n, (lo / n, hi / n), pred.sanitized_per_step,
                                        k=p["sanitized_total"], n=n)
        if p["frozen_fraction_mean"] is not None and pred.frozen_fraction is not None:
            m = p["frozen_fraction_mean"]
            row["frozen"] = {"measured": m, "predicted": pred.frozen_fraction, "ci": None,
                             "verdict": "agrees" if _within_factor(m, pred.frozen_fraction, 2) else
                             "above" if m > pred.frozen_fraction else "below"}
        out.append(row)
    return out


def _verdict(measured: float, ci: tuple[float, float], predicted: float, **counts) -> dict:
    lo, hi = ci
    verdict = "agrees" if lo <= predicted <= hi else "above" if measured > predicted else "below"
    return {"measured": measured, "ci": ci, "predicted": predicted, "verdict": verdict, **counts}


def _within_factor(a: float, b: float, factor: float) -> bool:
    if a == b == 0:
        return True
    return a > 0 and b > 0 and 1 / factor <= a / b <= factor


# ---------------------------------------------------------------------------------------------------------------
# Weight deviation vs theory, latency
# ---------------------------------------------------------------------------------------------------------------

def _log_log_fit(xs: list[float], ys: list[float]) -> dict | None:
    """Least-squares line through (log10 x, log10 y); None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    fit = stats.linregress(np.log10(xs), np.log10(ys))
    return {"slope": float(fit.slope), "intercept": float(fit.intercept),
            "stderr": float(fit.stderr) if len(xs) > 2 and math.isfinite(fit.stderr) else None,
            "n_points": len(xs), "ber_range": (min(xs), max(xs))}


def deviation_fits(rows: list[dict]) -> dict[str, dict]:
    """Per 'mode/scope/checksum': the log-log fit of final_deviation vs BER over ok runs at BER > 0, the theory's
    slope over the same BER range (DDP; None when the theory gives inf there or lacks the setup), and per BER the
    measured mean next to the theory's value."""
    out = {}
    for config in configs(rows):
        runs = [r for r in rows if config_of(r) == config and is_ok(r) and ber_of(r) > 0
                and positive(r.get("final_deviation")) is not None]
        if not runs:
            continue
        xs, ys = [ber_of(r) for r in runs], [float(r["final_deviation"]) for r in runs]
        bers = sorted(set(xs))
        est = recipe_deviation(bers, [r for r in rows if config_of(r) == config]) if config[0] == "ddp" else None
        per_ber = [{"ber": b, "n": xs.count(b), "mean": _mean([y for x, y in zip(xs, ys) if x == b]),
                    "theory": float(est[i]) if est is not None else None} for i, b in enumerate(bers)]
        finite_theory = [(p["ber"], p["theory"]) for p in per_ber if p["theory"] and math.isfinite(p["theory"])]
        theory_fit = _log_log_fit(*zip(*finite_theory)) if len(finite_theory) >= 2 else None
        out[config_key(config)] = {"config": config, "fit": _log_log_fit(xs, ys), "per_ber": per_ber,
                                   "theory_slope": theory_fit and theory_fit["slope"]}
    return out


def recipe_deviation(bers, rows: list[dict]) -> np.ndarray | None:
    """The analytical deviation of one DDP config's recipe at each BER: recipes that lose no steps to
    catastrophic values (the link protects the exponent, or the receiver sanitizes) move the weights by bounded
    errors only (RecipePrediction.noise_deviation); the others by weight_deviation_estimate (AdamW, clipping as
    the recipe has it)."""
    setup = run_setup(rows, "ddp")
    recipe = recipe_settings(rows[0])
    if recipe["protect"] or recipe["guard"] == "sanitize":
        point = {**setup, **recipe, "mode": "ddp"}
        preds = [predict_point(point, ber=b) for b in bers]
        return None if None in preds else np.array([p.noise_deviation for p in preds], dtype=float)
    if recipe["clip"] == "none":
        setup = {**setup, "grad_clip": 0.0}
    return theory_deviation(bers, setup)


def latency_entries(latency: dict | None) -> list[dict]:
    return [e for e in (latency or {}).get("results") or [] if isinstance(e, dict)]


def retransmission_penalties(latency: dict | None) -> list[dict]:
    """Per BER measured with both 'fix' (errored frames delivered) and 'keep' (dropped and retransmitted):
    keep - fix and keep / fix at p50, p99 and the mean. BER 0 is the control (no errors, so ~ x1)."""
    by_ber: dict[float, dict] = {}
    for e in latency_entries(latency):
        if e.get("engine") and e.get("checksum") in CHECKSUM_MODES:
            by_ber.setdefault(finite(e.get("ber")) or 0.0, {})[e["checksum"]] = e
    out = []
    for ber, pair in sorted(by_ber.items()):
        if len(pair) < 2:
            continue
        row = {"ber": ber, "keep_retrans_segs": pair["keep"].get("retrans_segs")}
        for q in LATENCY_STATS:
            fix, keep = positive(pair["fix"].get(q)), positive(pair["keep"].get(q))
            row[q] = {"fix": fix, "keep": keep, "extra": keep - fix if fix and keep else None,
                      "ratio": keep / fix if fix and keep else None}
        out.append(row)
    return out
