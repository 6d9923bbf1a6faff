"""What an experiment's results say: pure functions on results.jsonl rows and latency.json, no files, no
drawing. The report (report.py) renders what these return; the definitions are written into report.md.

- quality metrics of a grid point (eval loss, skipped updates, weight deviation, replica divergence) average
  over its runs with status ok: a crashed run's last eval is from another step and is not comparable;
- link counters (bits flipped and seen) sum over every run, and step time is the median over every run that
  reported one;
- loss gap = mean eval loss - mean eval loss of the clean runs (BER 0, same mode/scope/checksum); positive is worse;
- tolerance = max(`tolerance` x clean mean, `n_std` x the clean seeds' stdev): the larger of a relative margin
  and the run-to-run noise of the clean runs themselves;
- a BER passes when every seed has status ok, every seed has an eval loss, and the gap is <= the tolerance.
  "Trains as well as clean up to B" = B and every tested BER below it pass; "fails from F" = the smallest
  failing BER. The true threshold lies in (B, F]; a BER above F that passes again is flagged non-monotonic.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

import numpy as np
from scipy import stats

from ..train.model import PRESETS
from . import theory
from .formatting import fmt_loss, status_text
from .results import (SETUP_FIELDS, STATUSES, ber_of, config_of, config_sort_key, configs, finite, is_ok,
                      positive)

DEFAULT_TOLERANCE, DEFAULT_N_STD = 0.02, 3.0
# Published analysis (GPT-2 124M): DDP trained as well as clean below BER 1e-4, PP needed BER below 1e-5
PUBLISHED_TOLERATED_BER = {"ddp": 1e-4, "pp": 1e-5}
LATENCY_STATS = ("p50_us", "p99_us", "mean_us")


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
                                           "adamw", grad_clip=1.0 if clip is None else float(clip), n_ranks=n_ranks)
    return np.atleast_1d(np.asarray(est, dtype=float))


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


def _aggregate_point(group: list[dict]) -> dict:
    """The statistics of one grid point (one mode/scope/checksum/BER, all its seeds)."""
    ok = [r for r in group if is_ok(r)]
    evals = values_of(ok, "final_eval_loss")
    flipped, seen = sum_or_none(values_of(group, "bits_flipped")), sum_or_none(values_of(group, "bits_seen"))
    step_times = values_of(group, "median_step_time_s", positive)
    first = group[0]
    point = {
        "mode": first.get("mode"), "scope": first.get("scope"), "checksum": first.get("checksum"),
        "ber": ber_of(first),
        "n_seeds": len(group), "seeds": sorted(r.get("seed") for r in group if r.get("seed") is not None),
        "statuses": _status_counts(group), "n_ok": len(ok), "all_ok": len(ok) == len(group),
        "eval_loss_mean": _mean(evals), "eval_loss_std": _stdev(evals), "eval_loss_n": len(evals),
        "skipped_steps_mean": _mean(values_of(ok, "skipped_steps")),
        "skipped_fraction_mean": _mean([v for r in ok if (v := skipped_fraction(r)) is not None]),
        "deviation_mean": _mean(values_of(ok, "final_deviation")),
        "divergence_mean": _mean(values_of(ok, "final_replica_divergence")),
        "nonfinite_received_total": sum_or_none(values_of(group, "nonfinite_received_total")),
        "bits_flipped_total": flipped, "bits_seen_total": seen,
        "realized_ber": flipped / seen if flipped is not None and seen else None,
        "median_step_time_s": float(np.median(step_times)) if step_times else None,
    }
    for key in SETUP_FIELDS:
        point[key] = next((r[key] for r in group if r.get(key) is not None), None)
    return point


def aggregate(rows: list[dict]) -> list[dict]:
    """One dict per (mode, scope, checksum, BER), in grid order, with the loss gap against the clean point of the
    same mode/scope/checksum (None when that has no ok run with an eval loss)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((*config_of(r), ber_of(r)), []).append(r)
    points = [_aggregate_point(g) for _, g in sorted(groups.items(), key=lambda kv: (*config_sort_key(kv[0][:3]),
                                                                                         kv[0][3]))]
    clean = {(p["mode"], p["scope"], p["checksum"]): p for p in points if p["ber"] == 0}
    for p in points:
        base = clean.get((p["mode"], p["scope"], p["checksum"]))
        p["clean_eval_loss_mean"] = base["eval_loss_mean"] if base else None
        p["clean_eval_loss_std"] = base["eval_loss_std"] if base else None
        gap_ok = p["eval_loss_mean"] is not None and p["clean_eval_loss_mean"] is not None
        p["loss_gap"] = p["eval_loss_mean"] - p["clean_eval_loss_mean"] if gap_ok else None
        p["loss_gap_rel"] = (p["loss_gap"] / p["clean_eval_loss_mean"]
                             if gap_ok and p["clean_eval_loss_mean"] else None)
    return points


def _config_key(point: dict) -> str:
    return f"{point['mode']}/{point['scope']}/{point['checksum']}"


def _failure_reason(point: dict, tolerance_abs: float) -> str | None:
    """Why a BER point does not train as well as clean, or None when it does."""
    failed = {s: n for s, n in point["statuses"].items() if s != "ok"}
    if failed:
        return ", ".join(f"{n} {s}" for s, n in failed.items())
    if point["eval_loss_n"] < point["n_seeds"]:
        return f"{point['n_seeds'] - point['eval_loss_n']} ok run(s) without an eval loss"
    if point["loss_gap"] > tolerance_abs:
        return f"eval-loss gap +{fmt_loss(point['loss_gap'])} > tolerance {fmt_loss(tolerance_abs)}"
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
            width, context = PRESETS[model].n_embd, PRESETS[model].n_positions
            batch, seq = int(setup.get("batch_size") or 8), int(setup.get("seq_len") or context)
            bits = theory.pp_flips(0.0, max(world, 2), batch, seq, width, microbatches=1).bits_per_step
            p = theory.flip_statistics(theory.typical_activation_values()).p_catastrophic
            return (theory.catastrophic_threshold_ber(bits, p),
                    f"1 catastrophic activation value per step ({max(world, 2)} stages, batch {batch} x {seq} "
                    f"tokens, width {width})")
    except (KeyError, ValueError, TypeError) as e:
        return None, f"no theory threshold for this setup ({e})"
    return None, f"no theory threshold for mode {mode!r}"


def thresholds(agg: list[dict], tolerance: float = DEFAULT_TOLERANCE, n_std: float = DEFAULT_N_STD,
               train: dict | None = None) -> dict[str, dict]:
    """Per 'mode/scope/checksum': the largest BER up to which training is as good as clean, the smallest BER at
    which it fails, why, and the theory's and the published thresholds (see the module docstring).
    `train` (the experiment's train: section) supplies batch_size/seq_len for PP when rows lack them."""
    out: dict[str, dict] = {}
    for key in dict.fromkeys(_config_key(p) for p in agg):
        points = [p for p in agg if _config_key(p) == key]
        clean = next((p for p in points if p["ber"] == 0), None)
        setup = {**{k: v for k, v in (train or {}).items() if v is not None},
                 **{k: v for k, v in points[0].items() if v is not None}}
        result = _threshold_of(points, clean, tolerance, n_std)
        result["theory_ber"], result["theory_basis"] = theory_threshold(points[0]["mode"], points[0]["checksum"],
                                                                        setup)
        result.update(mode=points[0]["mode"], scope=points[0]["scope"], checksum=points[0]["checksum"],
                      steps=setup.get("steps"), published_ber=PUBLISHED_TOLERATED_BER.get(points[0]["mode"]))
        out[key] = result
    return out


def _threshold_of(points: list[dict], clean: dict | None, tolerance: float, n_std: float) -> dict:
    tested = [p for p in points if p["ber"] > 0]
    result = {"tolerance_rel": tolerance, "n_std": n_std, "tested_bers": [p["ber"] for p in tested],
              "clean_eval_loss_mean": clean and clean["eval_loss_mean"],
              "clean_eval_loss_std": clean and clean["eval_loss_std"],
              "tolerance_abs": None, "passing_bers": [], "failing": {}, "max_ok_ber": None, "min_fail_ber": None,
              "non_monotonic": False, "note": None}
    if clean is None or not clean["all_ok"] or clean["eval_loss_mean"] is None:
        result["note"] = ("no clean (BER 0) point" if clean is None else
                          f"the clean runs are not all ok ({status_text(clean['statuses'])}), so there is no "
                          "baseline to compare with")
        return result
    if not tested:
        result["note"] = "no BER > 0 was run"
    tol = max(tolerance * clean["eval_loss_mean"], n_std * (clean["eval_loss_std"] or 0.0))
    result["tolerance_abs"] = tol
    for p in tested:
        reason = _failure_reason(p, tol)
        if reason is None:
            result["passing_bers"].append(p["ber"])
        else:
            result["failing"][p["ber"]] = reason
    failing = sorted(result["failing"])
    result["min_fail_ber"] = failing[0] if failing else None
    below = [b for b in result["passing_bers"] if not failing or b < failing[0]]
    result["max_ok_ber"] = max(below) if below else None
    result["non_monotonic"] = bool(failing) and any(b > failing[0] for b in result["passing_bers"])
    return result


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
        est = theory_deviation(bers, run_setup(rows, config[0])) if config[0] == "ddp" else None
        per_ber = [{"ber": b, "n": xs.count(b), "mean": _mean([y for x, y in zip(xs, ys) if x == b]),
                    "theory": float(est[i]) if est is not None else None} for i, b in enumerate(bers)]
        finite_theory = [(p["ber"], p["theory"]) for p in per_ber if p["theory"] and math.isfinite(p["theory"])]
        theory_fit = _log_log_fit(*zip(*finite_theory)) if len(finite_theory) >= 2 else None
        out["/".join(map(str, config))] = {"config": config, "fit": _log_log_fit(xs, ys), "per_ber": per_ber,
                                           "theory_slope": theory_fit and theory_fit["slope"]}
    return out


def latency_entries(latency: dict | None) -> list[dict]:
    return [e for e in (latency or {}).get("results") or [] if isinstance(e, dict)]


def retransmission_penalties(latency: dict | None) -> list[dict]:
    """Per BER measured with both 'fix' (errored frames delivered) and 'keep' (dropped and retransmitted):
    keep - fix and keep / fix at p50, p99 and the mean. BER 0 is the control (no errors, so ~ x1)."""
    by_ber: dict[float, dict] = {}
    for e in latency_entries(latency):
        if e.get("engine") and e.get("checksum") in ("fix", "keep"):
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
