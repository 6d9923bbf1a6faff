"""An experiment's report: summary.csv, the plots and report.md, from results.jsonl and latency.json alone.

    python -m testbed.experiments.report DIR [--tolerance 0.02] [--n-std 3]

Input contract: docs/experiments.md (results.jsonl rows, latency.json). Missing pieces (no PP rows, no
latency.json, every run crashed) give a sentence in the report, never an exception.

Definitions (also written into report.md):
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

import argparse
import csv
import io
import json
import math
import os
import platform
import statistics
import sys
import traceback
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
from scipy import stats

from ..train.common import read_jsonl, write_atomic
from . import plots, theory
from .plots import (PUBLISHED_TOLERATED_BER, ber_of, ber_text, config_label, config_of, config_sort_key, configs, finite,
                    is_ok, latency_label, mode_name, positive, run_setup, skipped_fraction, theory_deviation)

RESULTS_FILE, LATENCY_FILE, EXPERIMENT_FILE = "results.jsonl", "latency.json", "experiment.yaml"
SUMMARY_FILE, REPORT_FILE = "summary.csv", "report.md"
DEFAULT_TOLERANCE, DEFAULT_N_STD = 0.02, 3.0
STATUS_ORDER = ("ok", "diverged", "crashed", "hung", "invalid", "error")
# results.jsonl scalar fields in the order of docs/experiments.md; summary.csv always has these columns
SUMMARY_COLUMNS = (
    "point", "baseline", "experiment", "fingerprint", "mode", "ber", "scope", "checksum", "seed",
    "model", "steps", "topology", "runtime", "world_size", "status", "reason", "steps_completed", "skipped_steps",
    "final_loss", "final_eval_loss", "median_step_time_s", "median_comm_time_s", "bits_seen", "bits_flipped",
    "realized_ber", "nonfinite_received_total", "corrupted_values_total", "final_deviation",
    "final_replica_divergence", "n_params", "lr", "grad_clip", "wall_time_s", "finished_at", "image_digest",
)
LATENCY_STATS = ("p50_us", "p99_us", "mean_us")
LINK_RATE_BPS, LINK_LENGTH_M = 100e9, 10.0  # the theory's link for the latency breakdown
THEORY_FRAME_BYTES = (1500, 4096, 9000)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------

def load_results(out_dir) -> list[dict]:
    """results.jsonl as a list of rows; [] when the file is missing. A torn last line is skipped."""
    return [r for r in read_jsonl(Path(out_dir) / RESULTS_FILE) if isinstance(r, dict)]


def load_latency(out_dir) -> dict | None:
    """latency.json, or None when it is missing or unreadable."""
    try:
        data = json.loads((Path(out_dir) / LATENCY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _experiment_info(out_dir: Path, experiment) -> dict:
    """The experiment file as a dict: from an Experiment / ExperimentFile / dict, else DIR/experiment.yaml."""
    if experiment is not None:
        spec = getattr(experiment, "spec", experiment)
        if hasattr(spec, "model_dump"):
            return spec.model_dump()
        if isinstance(spec, dict):
            return spec
    try:
        import yaml
        data = yaml.safe_load((out_dir / EXPERIMENT_FILE).read_text())
    except Exception:  # a missing or broken copy only costs the setup lines that rows do not carry
        return {}
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------------------------
# summary.csv
# ---------------------------------------------------------------------------------------------------------------

def _is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _grid_order(row: dict) -> tuple:
    return (*config_sort_key(config_of(row)), ber_of(row), str(row.get("seed")))


def write_summary_csv(rows: list[dict], path) -> Path:
    """One line per point, scalar fields only (curves dropped): the schema's columns in schema order, then any
    other scalar fields alphabetically; rows in grid order (mode, scope, checksum, BER, seed)."""
    extra = sorted({k for r in rows for k, v in r.items() if k not in SUMMARY_COLUMNS and _is_scalar(v)})
    columns = list(SUMMARY_COLUMNS) + extra
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in sorted(rows, key=_grid_order):
        writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in columns if _is_scalar(r.get(k))})
    path = Path(path)
    write_atomic(path, buf.getvalue())
    return path


# ---------------------------------------------------------------------------------------------------------------
# Aggregation and thresholds
# ---------------------------------------------------------------------------------------------------------------

def _values(rows: list[dict], field: str, convert=finite) -> list[float]:
    return [v for r in rows if (v := convert(r.get(field))) is not None]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _stdev(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def _status_counts(rows: list[dict]) -> dict[str, int]:
    counts = Counter(str(r.get("status")) for r in rows)
    order = [s for s in STATUS_ORDER if s in counts] + sorted(s for s in counts if s not in STATUS_ORDER)
    return {s: counts[s] for s in order}


def _sum_or_none(values: list[float]) -> float | int | None:
    """The sum; an int when every value is a whole number (counters stay counts in the tables)."""
    if not values:
        return None
    total = sum(values)
    return int(total) if all(float(v).is_integer() for v in values) else total


def _aggregate_point(group: list[dict]) -> dict:
    """The statistics of one grid point (one mode/scope/checksum/BER, all its seeds)."""
    ok = [r for r in group if is_ok(r)]
    evals = _values(ok, "final_eval_loss")
    flipped, seen = _sum_or_none(_values(group, "bits_flipped")), _sum_or_none(_values(group, "bits_seen"))
    step_times = _values(group, "median_step_time_s", positive)
    first = group[0]
    point = {
        "mode": first.get("mode"), "scope": first.get("scope"), "checksum": first.get("checksum"),
        "ber": ber_of(first),
        "n_seeds": len(group), "seeds": sorted(r.get("seed") for r in group if r.get("seed") is not None),
        "statuses": _status_counts(group), "n_ok": len(ok), "all_ok": len(ok) == len(group),
        "eval_loss_mean": _mean(evals), "eval_loss_std": _stdev(evals), "eval_loss_n": len(evals),
        "skipped_steps_mean": _mean(_values(ok, "skipped_steps")),
        "skipped_fraction_mean": _mean([v for r in ok if (v := skipped_fraction(r)) is not None]),
        "deviation_mean": _mean(_values(ok, "final_deviation")),
        "divergence_mean": _mean(_values(ok, "final_replica_divergence")),
        "nonfinite_received_total": _sum_or_none(_values(group, "nonfinite_received_total")),
        "bits_flipped_total": flipped, "bits_seen_total": seen,
        "realized_ber": flipped / seen if flipped is not None and seen else None,
        "median_step_time_s": float(np.median(step_times)) if step_times else None,
    }
    for key in ("model", "steps", "world_size", "n_params", "lr", "grad_clip", "batch_size", "seq_len"):
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
        return f"eval-loss gap +{_fmt_loss(point['loss_gap'])} > tolerance {_fmt_loss(tolerance_abs)}"
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
            _, width, context, _ = theory.GPT2_SHAPES[model]
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
                          f"the clean runs are not all ok ({_status_text(clean['statuses'])}), so there is no "
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


def _latency_entries(latency: dict | None) -> list[dict]:
    return [e for e in (latency or {}).get("results") or [] if isinstance(e, dict)]


def retransmission_penalties(latency: dict | None) -> list[dict]:
    """Per BER measured with both 'fix' (errored frames delivered) and 'keep' (dropped and retransmitted):
    keep - fix and keep / fix at p50, p99 and the mean. BER 0 is the control (no errors, so ~ x1)."""
    by_ber: dict[float, dict] = {}
    for e in _latency_entries(latency):
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


# ---------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------

def _fmt(x, digits: int = 3) -> str:
    """Numbers for tables: — for missing, thousands separators for counts, 3 significant digits otherwise."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if not isinstance(x, float):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e3:
        return f"{x:.{digits}g}"
    return f"{x:,.0f}" if 1e3 <= abs(x) < 1e6 else f"{x:.{digits - 1}e}"


_fmt_ber = ber_text


def _fmt_loss(x) -> str:
    """Losses and loss gaps in nats: three decimals (a 2 % tolerance on a loss of ~5 is ~0.1)."""
    if x is None or not math.isfinite(x) or abs(x) >= 1e4:
        return _fmt(x)
    return f"{x:.3f}"


def _fmt_signed(x, fmt=_fmt) -> str:
    return "—" if x is None else ("+" if x >= 0 else "") + fmt(x)


def _fmt_pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f} %"


def _status_text(statuses: dict) -> str:
    return ", ".join(f"{n} {s}" for s, n in statuses.items()) or "—"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def key_table(agg: list[dict]) -> str:
    """The mode x BER table: status counts, eval loss, gap, skipped steps, deviation, divergence, flips..."""
    all_configs = sorted({(p["mode"], p["scope"], p["checksum"]) for p in agg}, key=config_sort_key)
    header = ["config", "BER", "seeds", "status", "eval loss (mean ± sd)", "gap", "gap %", "skipped steps",
              "deviation", "replica divergence", "bits flipped", "realized BER", "step time (s)"]
    body = []
    for p in agg:
        ev = _fmt_loss(p["eval_loss_mean"]) + (f" ± {_fmt_loss(p['eval_loss_std'])}"
                                               if p["eval_loss_std"] is not None else "")
        body.append([config_label((p["mode"], p["scope"], p["checksum"]), all_configs), _fmt_ber(p["ber"]),
                     str(p["n_seeds"]), _status_text(p["statuses"]), ev,
                     _fmt_signed(p["loss_gap"], _fmt_loss) if p["ber"] > 0 else "(clean)",
                     _fmt_pct(p["loss_gap_rel"]) if p["ber"] > 0 else "",
                     _fmt(p["skipped_steps_mean"]), _fmt(p["deviation_mean"]), _fmt(p["divergence_mean"]),
                     _fmt(p["bits_flipped_total"]), _fmt(p["realized_ber"]), _fmt(p["median_step_time_s"])])
    return _table(header, body)


def _published_comparison(t: dict) -> str:
    """How the measured interval (max_ok, min_fail] sits against the published 'fine below P'."""
    pub, ok, fail = t["published_ber"], t["max_ok_ber"], t["min_fail_ber"]
    name = mode_name(t["mode"])
    if pub is None:
        return ""
    published = f"the published analysis of GPT-2 124M ({name} fine below {_fmt_ber(pub)})"
    if ok is not None and ok >= pub:
        return f"That is more tolerant than {published}: here {name} is still fine at {_fmt_ber(ok)}."
    if fail is not None and fail < pub:
        return f"That is more fragile than {published}: here {name} already fails at {_fmt_ber(fail)}."
    return f"That is consistent with {published}."


def _theory_comparison(t: dict) -> str:
    """The theory's threshold, and how many catastrophic values it expects over a run at the measured BERs:
    catastrophic values per step = BER / threshold (the threshold is where that count is 1)."""
    th, steps = t["theory_ber"], t.get("steps")
    if th is None:
        return f"Theory: {t['theory_basis']}."
    text = f"The theory expects {t['theory_basis']} at BER {_fmt_ber(th)}."
    per_run = (lambda b: b / th * steps) if steps else None
    ok, fail = t["max_ok_ber"], t["min_fail_ber"]
    if per_run and ok is not None:
        text += f" At {_fmt_ber(ok)} that is {_fmt(per_run(ok))} catastrophic values over the {steps} steps"
        text += (", and training still matches clean: they are neutralised (skipped steps, clipping, Adam's "
                 "bounded step), not avoided." if per_run(ok) >= 1 else ", so the passing runs rarely met one.")
    if per_run and fail is not None:
        text += f" At {_fmt_ber(fail)}, where it fails, {_fmt(per_run(fail))}"
        text += (" per run: fewer than one, so catastrophic values do not explain the failure (see its reason)."
                 if per_run(fail) < 1 else " per run.")
    return text


def threshold_sentence(t: dict) -> str:
    """One paragraph per config: the measured threshold, then the published and theory comparisons."""
    label = f"**{mode_name(t['mode'])}** ({t['scope']}/{t['checksum']})"
    if t["note"] and t["tolerance_abs"] is None:
        return f"{label}: no threshold: {t['note']}."
    if not t["tested_bers"]:
        return f"{label}: no threshold: only the clean point was run."
    ok, fail = t["max_ok_ber"], t["min_fail_ber"]
    if ok is not None and fail is None:
        head = f"trains as well as on a clean link at every tested BER, up to {_fmt_ber(ok)}"
    elif ok is not None:
        head = (f"trains as well as on a clean link up to BER {_fmt_ber(ok)} and fails from {_fmt_ber(fail)} "
                f"({t['failing'][fail]})")
    else:
        head = f"fails already at the smallest tested BER, {_fmt_ber(fail)} ({t['failing'][fail]})"
    if t["non_monotonic"]:
        again = [b for b in t["passing_bers"] if fail is not None and b > fail]
        head += f"; non-monotonic: passes again at {', '.join(map(_fmt_ber, again))}"
    return f"{label} {head}. {_published_comparison(t)} {_theory_comparison(t)}".strip()


def thresholds_table(th: dict) -> str:
    header = ["config", "clean eval loss", "tolerance", "trains as well as clean up to", "fails from", "why",
              "theory: catastrophic from", "published: fine below"]
    body = []
    for t in th.values():
        fail = t["min_fail_ber"]
        body.append([f"{mode_name(t['mode'])} {t['scope']}/{t['checksum']}", _fmt_loss(t["clean_eval_loss_mean"]),
                     _fmt_loss(t["tolerance_abs"]), _fmt_ber(t["max_ok_ber"]) if t["max_ok_ber"] is not None else "—",
                     _fmt_ber(fail) if fail is not None else "—", t["failing"].get(fail, t["note"] or ""),
                     _fmt_ber(t["theory_ber"]), _fmt_ber(t["published_ber"])])
    return _table(header, body)


def _slope_sentence(label: str, d: dict) -> str:
    fit = d["fit"]
    if fit is None:
        return f"{label}: deviations at one BER only, no slope."
    lo, hi = fit["ber_range"]
    err = f" ± {fit['stderr']:.2g}" if fit["stderr"] is not None else ""
    text = (f"{label}: measured slope {fit['slope']:.2f}{err} (least squares on log-log, {fit['n_points']} ok runs, "
            f"BER {_fmt_ber(lo)}..{_fmt_ber(hi)}); sqrt(BER) means 0.50")
    if d["theory_slope"] is not None:
        text += f", and the analytical estimate has {d['theory_slope']:.2f} over the same range"
    margin = 2 * fit["stderr"] if fit["stderr"] is not None else 0.1
    verdict = ("consistent with sqrt(BER)" if abs(fit["slope"] - 0.5) <= max(margin, 0.1) else
               "steeper than sqrt(BER)" if fit["slope"] > 0.5 else "flatter than sqrt(BER)")
    return f"{text}: {verdict}."


def deviation_section(rows: list[dict], fits: dict) -> list[str]:
    out = ["## Weight deviation vs theory", ""]
    if not fits:
        return out + ["No ok run at BER > 0 reported a final weight deviation, so there is nothing to compare.", ""]
    all_configs = configs(rows)
    body = []
    for d in fits.values():
        label = config_label(d["config"], all_configs)
        for p in d["per_ber"]:
            ratio = p["mean"] / p["theory"] if p["theory"] and math.isfinite(p["theory"]) else None
            body.append([label, _fmt_ber(p["ber"]), str(p["n"]), _fmt(p["mean"]), _fmt(p["theory"]), _fmt(ratio)])
    out += [_table(["config", "BER", "ok runs", "deviation (mean)", "theory", "measured / theory"], body), ""]
    out += ["- " + _slope_sentence(config_label(d["config"], all_configs), d) for d in fits.values()]
    out += ["", "The analytical curve is `theory.weight_deviation_estimate` (AdamW, the runs' n_params, steps, lr, "
            "grad_clip and world size; gradient errors through the gloo ring, so DDP only). It ignores the "
            "training dynamics, which amplify any perturbation, so measured deviations may exceed it while keeping "
            "the slope; with clipping it saturates once every step is lost (slope < 1/2).", ""]
    return out


# optional latency.json counters (testbed bench latency) -> column title
LATENCY_COUNTERS = {"bits_flipped": "bits flipped", "retrans_segs": "retransmitted segments",
                    "in_csum_errors": "checksum drops", "rto_timeouts": "RTOs"}


def _latency_table(entries: list[dict]) -> str:
    counters = [k for k in LATENCY_COUNTERS if any(e.get(k) is not None for e in entries)]
    with_errors = any(e.get("errors") for e in entries)
    header = ["configuration", "BER", "checksum", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "mean µs", "max µs",
              "samples"] + [LATENCY_COUNTERS[k] for k in counters] + (["errors"] if with_errors else [])
    body = []
    for e in entries:
        samples = e.get("samples_us")
        row = [latency_label(e), _fmt_ber(finite(e.get("ber")) or 0.0) if e.get("engine") else "(no engine)",
               str(e.get("checksum") or "—"),
               *[_fmt(finite(e.get(k))) for k in ("p50_us", "p90_us", "p99_us", "p999_us", "mean_us", "max_us")],
               _fmt(len(samples) if isinstance(samples, list) else e.get("samples"))]
        row += [_fmt(e.get(k)) for k in counters]
        if with_errors:
            row.append("; ".join(map(str, e.get("errors") or []))[:80].replace("|", "/"))
        body.append(row)
    return _table(header, body)


def _penalty_table(penalties: list[dict]) -> str:
    header = ["BER"] + [f"{q} {col}" for q in ("p50", "p99", "mean") for col in ("fix µs", "keep µs", "keep/fix")] \
        + ["retransmitted segments (keep)"]
    body = [[_fmt_ber(p["ber"])] + [_fmt(p[q][k]) for q in LATENCY_STATS for k in ("fix", "keep", "ratio")]
            + [_fmt(p["keep_retrans_segs"])] for p in penalties]
    return _table(header, body)


def latency_section(latency: dict | None, plot_line: str) -> list[str]:
    out = ["## Latency: delivering errored frames vs retransmission", ""]
    entries = _latency_entries(latency)
    if not entries:
        return out + ["No latency measurements: latency.json is missing or empty (the experiment file has no "
                      "`latency:` section, or `testbed bench latency` did not finish).", "", plot_line, ""]
    where = ", ".join(f"{k} {latency[k]}" for k in ("topology", "link", "runtime", "size", "count")
                      if latency.get(k))
    out += [f"Ping-pong round trips over one emulated link ({where}); `fix` delivers errored frames with a "
            "repaired checksum (a relaxed link), `keep` leaves the checksum wrong, so the kernel drops the segment "
            "and TCP retransmits it.", "", _latency_table(entries), ""]
    none = next((e for e in entries if not e.get("engine")), None)
    engine0 = next((e for e in entries if e.get("engine") and not finite(e.get("ber"))), None)
    if none and engine0 and positive(none.get("p50_us")) and positive(engine0.get("p50_us")):
        out += [f"Engine overhead at BER 0: p50 {_fmt(engine0['p50_us'])} µs vs {_fmt(none['p50_us'])} µs without "
                f"the engine ({_fmt_signed(engine0['p50_us'] - none['p50_us'])} µs).", ""]
    penalties = retransmission_penalties(latency)
    if any(p["ber"] > 0 for p in penalties):
        out += ["Retransmission penalty, keep against fix at the same BER (BER 0 is the control):", "",
                _penalty_table(penalties), "", _latency_finding(max(penalties, key=lambda p: p["ber"]))[2:], ""]
    else:
        out += ["No BER > 0 was measured with both `fix` and `keep`, so there is no retransmission penalty to "
                "report.", ""]
    return out + [plot_line, ""]


def theory_latency_section(latency: dict | None) -> list[str]:
    """The link-latency model (theory.latency_comparison) for a few frame sizes at the measured BERs."""
    bers = sorted({b for e in _latency_entries(latency) if (b := positive(e.get("ber"))) is not None}) \
        or [1e-6, 1e-5, 1e-4]
    header = ["frame (B)", "BER", "P(frame errored)", "KP4 FEC", "relaxed (deliver errored)", "link retransmit mean",
              "link retransmit p99", "TCP retransmit mean", "TCP retransmit p99"]
    body = []
    for size in THEORY_FRAME_BYTES:
        for b in bers:
            lat = {x.scheme: x for x in theory.latency_comparison(size, LINK_RATE_BPS, LINK_LENGTH_M, b)}
            body.append([str(size), _fmt_ber(b), _fmt(lat["relaxed"].frame_error_probability),
                         _fmt(lat["kp4"].total_s * 1e9), _fmt(lat["relaxed"].total_s * 1e9),
                         _fmt(lat["link-retransmit"].total_s * 1e9), _fmt(lat["link-retransmit"].tail_s * 1e9),
                         _fmt(lat["tcp-retransmit"].total_s * 1e9), _fmt(lat["tcp-retransmit"].tail_s * 1e9)])
    kp4 = theory.frame_latency(4096, LINK_RATE_BPS, LINK_LENGTH_M, "kp4")
    saved = (kp4.fec_fill_s + kp4.fec_decode_s) * 1e9
    return ["## Link-latency model (theory)", "",
            f"One-way latency per frame in ns on a {LINK_RATE_BPS / 1e9:g} Gbit/s link of {LINK_LENGTH_M:g} m "
            "(`theory.latency_comparison`; retransmission columns are expected values, p99 counts the retries at "
            "that quantile). The measured RTTs above are software round trips on an emulated link, in µs; compare "
            "the structure (delivery vs retransmission), not the absolute numbers.", "",
            _table(header, body), "",
            f"A relaxed link saves {saved:.0f} ns per hop against KP4 (codeword fill + decode) at any BER; a TCP "
            "retransmission costs at least the 200 ms minimum RTO. Full tables: docs/theory.md "
            "(`python -m testbed.experiments.theory`).", ""]


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

def _draw_plots(out_dir: Path, rows: list[dict], latency: dict | None) -> dict[str, Path | None | str]:
    """Every plot; a plot that raises becomes an error string in the report instead of losing the report (it is
    written at the end of a long run)."""
    drawn = {}
    for name, (fn, source) in plots.PLOTS.items():
        try:
            drawn[name] = fn(rows if source == "rows" else latency, out_dir / name)
        except Exception as e:  # noqa: BLE001 - reported below, with the traceback on stderr
            traceback.print_exc(file=sys.stderr)
            drawn[name] = f"{type(e).__name__}: {e}"
    return drawn


PLOT_TITLES = {
    "loss_vs_step.png": ("Training loss per step", "no run has a loss curve"),
    "eval_loss_vs_ber.png": ("Final eval loss vs BER", "no run at BER > 0"),
    "deviation_vs_ber.png": ("Weight deviation from the clean run vs BER",
                             "no run at BER > 0 reported a positive final_deviation"),
    "divergence_vs_ber.png": ("DDP replica divergence vs BER",
                              "no DDP run at BER > 0 reported a positive final_replica_divergence"),
    "step_time_vs_ber.png": ("Median step time vs BER", "no run reported a step time"),
    "skipped_vs_ber.png": ("Skipped updates vs BER", "no run reported skipped steps"),
    "latency.png": ("RTT distribution per latency configuration", "no latency.json"),
}


def _plot_line(name: str, drawn: dict) -> str:
    title, missing = PLOT_TITLES[name]
    result = drawn.get(name)
    if isinstance(result, Path):
        return f"![{title}]({name})"
    if isinstance(result, str):
        return f"*{title}: the plot could not be drawn ({result}).*"
    return f"*{title}: not drawn, {missing}.*"


def _timestamp(value) -> str:
    """finished_at as local ISO time: the runner writes epoch seconds; text passes through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return datetime.fromtimestamp(value).astimezone().isoformat(timespec="seconds")
    return str(value)


def _setup_section(rows: list[dict], exp: dict, latency: dict | None) -> list[str]:
    first = rows[0] if rows else {}
    grid = exp.get("grid") or {}
    train = {k: v for k, v in (exp.get("train") or {}).items() if v is not None}
    topologies = exp.get("topologies") or {m: r.get("topology") for r in rows for m in [r.get("mode")]}
    worlds = {r.get("mode"): r.get("world_size") for r in rows if r.get("world_size")}
    finished = sorted(_timestamp(r["finished_at"]) for r in rows if r.get("finished_at"))
    wall = _sum_or_none(_values(rows, "wall_time_s"))
    digests = sorted({str(r["image_digest"]) for r in rows if r.get("image_digest")})
    u = platform.uname()

    def grid_values(key):
        values = grid.get(key) or sorted({r.get(key) for r in rows if r.get(key) is not None},
                                         key=lambda v: (not isinstance(v, (int, float)), v if isinstance(
                                             v, (int, float)) else str(v)))
        return ", ".join(_fmt_ber(v) if key == "ber" else str(v) for v in values) or "—"

    n_params = first.get("n_params")
    lines = [
        ("Description", exp.get("description")),
        ("Model", f"{exp.get('model') or first.get('model') or '—'}"
                  + (f" ({n_params:,} parameters)" if isinstance(n_params, int) else "")),
        ("Topologies", ", ".join(f"{mode_name(m)}: {t} ({worlds.get(m, '?')} hosts)" for m, t in topologies.items())
         or "—"),
        ("Runtime", exp.get("runtime") or first.get("runtime")),
        ("Steps", exp.get("steps") or first.get("steps")),
        ("Training", ", ".join(f"{k} {v}" for k, v in train.items()) or
         ", ".join(f"{k} {first[k]}" for k in ("lr", "grad_clip") if first.get(k) is not None) or "defaults"),
        ("Grid", f"mode {grid_values('mode')}; BER {grid_values('ber')}; scope {grid_values('scope')}; "
                 f"checksum {grid_values('checksum')}; seeds {grid_values('seed')} ({len(rows)} results)"),
        ("Runs finished", f"{finished[0]} .. {finished[-1]}" if finished else None),
        ("Training wall time", f"{wall / 60:.1f} min over all points" if wall else None),
        ("Worker image", ", ".join(digests) or None),
        ("Fingerprint", ", ".join(sorted({str(r["fingerprint"]) for r in rows if r.get("fingerprint")})) or None),
        ("Latency", "measured (latency.json)" if _latency_entries(latency) else "not measured"),
        ("Report generated", f"{datetime.now().astimezone().isoformat(timespec='seconds')} on "
                             f"{' '.join(u[:5])} ({os.cpu_count()} CPUs)"),
    ]
    return ["## Setup", ""] + [f"- {k}: {v}" for k, v in lines if v not in (None, "")] + [""]


def _latency_finding(pen: dict) -> str:
    """The retransmission penalty at one BER (the highest measured with both fix and keep), as a saving."""
    p50, p99, mean = pen["p50_us"], pen["p99_us"], pen["mean_us"]
    if p50["extra"] is None or p99["extra"] is None:
        return f"- Latency at BER {_fmt_ber(pen['ber'])}: fix or keep lacks p50/p99, no penalty computed."
    if p50["extra"] <= 0 and p99["extra"] <= 0:
        return (f"- At BER {_fmt_ber(pen['ber'])} retransmission (keep) costs no measurable latency over delivering "
                f"errored frames (fix): p50 {_fmt(p50['keep'])} vs {_fmt(p50['fix'])} µs, p99 {_fmt(p99['keep'])} "
                f"vs {_fmt(p99['fix'])} µs.")
    mean_text = f", {_fmt(mean['extra'])} µs on average" if mean["extra"] is not None else ""
    return (f"- **Delivering errored frames (fix) instead of retransmitting them (keep) saves "
            f"{_fmt(p50['extra'])} µs at p50 (keep/fix x{_fmt(p50['ratio'])}) and {_fmt(p99['extra'])} µs at p99 "
            f"(x{_fmt(p99['ratio'])}){mean_text} per round trip at BER {_fmt_ber(pen['ber'])}.**")


def _findings(rows, th: dict, fits: dict, latency) -> list[str]:
    """The answers users look for first, each a sentence from the sections below."""
    out = ["## Findings", ""]
    if not rows:
        return out + ["- No results: results.jsonl is missing or empty, so there is nothing to report on training.",
                      ""]
    present = {r.get("mode") for r in rows}
    out += [f"- No {mode_name(m)} points in this experiment." for m in ("ddp", "pp") if m not in present]
    if not any(is_ok(r) for r in rows):
        out.append("- No run finished with status ok: every point crashed, hung, diverged or failed.")
    out += ["- " + threshold_sentence(t) for t in th.values()]
    all_configs = configs(rows)
    out += ["- Weight deviation, " + _slope_sentence(config_label(d["config"], all_configs), d) for d in fits.values()]
    penalties = [p for p in retransmission_penalties(latency) if p["ber"] > 0]
    if penalties:
        out.append(_latency_finding(penalties[-1]))
    elif not _latency_entries(latency):
        out.append("- Latency was not measured (no latency.json).")
    return out + [""]


def build_markdown(rows: list[dict], agg: list[dict], th: dict, latency: dict | None, exp: dict,
                   drawn: dict, tolerance: float, n_std: float, out_dir: Path) -> str:
    name = exp.get("name") or next((r.get("experiment") for r in rows if r.get("experiment")), None) or out_dir.name
    fits = deviation_fits(rows)
    md = [f"# Experiment {name}: bit errors in distributed GPT-2 training", ""]
    md += _findings(rows, th, fits, latency)
    md += _setup_section(rows, exp, latency)
    md += ["## Results per point", ""]
    if agg:
        md += ["Eval loss, skipped steps, deviation and divergence are means over the point's ok runs; bits flipped "
               "and realized BER sum over all its runs; step time is the median of its runs' median step times. "
               "Gap = eval loss - the clean mean of the same mode/scope/checksum (positive = worse). Deviation: "
               "L2 distance of the final weights from the clean run of the same seed; replica divergence (DDP): "
               "largest L2 distance of a replica from rank 0.", "", key_table(agg), "",
               "Full per-run values: [summary.csv](summary.csv).", ""]
    else:
        md += ["No results: results.jsonl is missing or empty.", ""]
    md += ["## Thresholds: up to which BER does training match a clean link?", "",
           f"A BER passes when every seed ends ok with an eval loss and the mean eval-loss gap to the clean runs is "
           f"at most the tolerance = max({tolerance:g} x the clean mean, {n_std:g} x the clean seeds' standard "
           "deviation). \"Up to\" = the largest BER that passes together with every tested BER below it; "
           "\"fails from\" = the smallest failing BER. Theory: `catastrophic_threshold_ber`, the BER at which one "
           "catastrophic fp32 value (Inf/NaN or > 1e30) is expected per step. Published: DDP fine below 1e-4, PP "
           "below 1e-5 (GPT-2 124M); this experiment's model and step count may differ.", ""]
    md += ([thresholds_table(th), ""] + ["- " + threshold_sentence(t) for t in th.values()] + [""] if th else
           ["No thresholds: no results.", ""])
    md += [_plot_line("eval_loss_vs_ber.png", drawn), "", _plot_line("loss_vs_step.png", drawn), ""]
    md += deviation_section(rows, fits)
    md += [_plot_line("deviation_vs_ber.png", drawn), "", _plot_line("divergence_vs_ber.png", drawn), ""]
    md += ["## Step time and skipped updates", "", _plot_line("step_time_vs_ber.png", drawn), "",
           _plot_line("skipped_vs_ber.png", drawn), ""]
    md += latency_section(latency, _plot_line("latency.png", drawn))
    md += theory_latency_section(latency)
    md += ["## How to reproduce", "",
           f"`testbed run {EXPERIMENT_FILE} --out DIR` (the copy of the experiment file in this directory) runs the "
           "grid and writes results.jsonl and latency.json; `testbed report DIR` (or `python -m "
           f"testbed.experiments.report DIR --tolerance {tolerance:g} --n-std {n_std:g}`) rebuilds summary.csv, "
           "the plots and this report from those two files alone.", ""]
    return "\n".join(md)


def write_report(out_dir, rows: list[dict] | None = None, latency: dict | None = None, experiment=None, *,
                 tolerance: float = DEFAULT_TOLERANCE, n_std: float = DEFAULT_N_STD) -> Path:
    """Write summary.csv, the plots and report.md into out_dir (rows/latency default to its results.jsonl and
    latency.json; experiment: an Experiment, ExperimentFile or dict, default its experiment.yaml)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = load_results(out_dir) if rows is None else rows
    latency = load_latency(out_dir) if latency is None else latency
    exp = _experiment_info(out_dir, experiment)
    write_summary_csv(rows, out_dir / SUMMARY_FILE)
    agg = aggregate(rows)
    th = thresholds(agg, tolerance, n_std, train=exp.get("train"))
    drawn = _draw_plots(out_dir, rows, latency)
    path = out_dir / REPORT_FILE
    write_atomic(path, build_markdown(rows, agg, th, latency, exp, drawn, tolerance, n_std, out_dir))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.experiments.report",
                                description="Rebuild summary.csv, the plots and report.md of an experiment "
                                            "directory from its results.jsonl and latency.json.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"relative eval-loss gap still counted as clean (default {DEFAULT_TOLERANCE})")
    p.add_argument("--n-std", type=float, default=DEFAULT_N_STD,
                   help=f"or this many standard deviations of the clean seeds, if larger (default {DEFAULT_N_STD:g})")
    args = p.parse_args(argv)
    if not Path(args.dir).is_dir():
        p.error(f"{args.dir}: not a directory")
    print(write_report(args.dir, tolerance=args.tolerance, n_std=args.n_std))
    return 0


if __name__ == "__main__":
    sys.exit(main())
