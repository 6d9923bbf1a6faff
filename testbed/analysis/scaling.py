"""The size ladder and the chaos floor (experiments/scaling.yaml): pure functions on results.jsonl rows.

- lambda cells: the points of a grid `ber_at_lambda` grouped by model, recipe, mode and lambda. Lost steps are
  pooled over the seeds (steps are independent trials) where the seeds drew independent flips (the process
  injector); on the wire every seed gets the same flips (shares_flips), so a cell counts one run's worth of
  trials, the mean over its seeds; the measured fraction has a Clopper-Pearson interval
  (95 %, as the rest of the report); the verdict asks whether the measured count of lost steps lies inside the
  central 99 % interval of Binomial(steps, the theory's P(step lost)), the prediction's own spread. Sanitized
  values per step: the count against the central 99 % interval of Poisson(steps x the predicted rate);
- lambda on the x axis is the theory's for the unprotected fp32 wire at the point's BER
  (theory.lambda_per_ber x BER: the grid's target to 3 significant digits), the same for the three recipes of a
  size; the predicted lost fraction is the recipe's own (0 for protect and sanitize);
- chaos floor: per model and mode, the final weight deviation of the BER-0 controls (perturb lsb, weight-lsb,
  order: each against the unperturbed clean run of the same seed) beside the BER runs' deviation, and the
  theory's estimate without dynamical amplification (docs/theory.md: noise_deviation; one flipped LSB moves a
  value by at most 2^-23 of itself).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
from scipy import stats

from testbed.analysis import theory
from testbed.analysis.analysis import clopper_pearson, lost_steps, predict_point
from testbed.analysis.results import (ber_of, field_names, finite, is_ok, mode_key, recipe_of, recipe_settings)
from testbed.train.model import PRESETS, seq_len_of

PREDICTION_LEVEL = 0.99  # the verdict: the measured count inside this central interval of the prediction
READS = field_names("ber_at_lambda", "perturb", "model", "n_params", "world_size", "batch_size", "seq_len",
                    "sanitized_values", "steps_completed", "final_deviation", "injector", "median_step_time_s",
                    "wall_time_s", "lr", "steps")
MODEL_ORDER = tuple(sorted(PRESETS, key=lambda m: theory.param_count(m)))  # smallest first


def model_key(model) -> tuple:
    return (MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER), str(model))


def binomial_interval(n: int, p: float, level: float = PREDICTION_LEVEL) -> tuple[int, int]:
    """Central `level` interval of Binomial(n, p) counts."""
    a = (1 - level) / 2
    if p <= 0:
        return 0, 0
    if p >= 1:
        return n, n
    return int(stats.binom.ppf(a, n, p)), int(stats.binom.ppf(1 - a, n, p))


def poisson_count_interval(mean: float, level: float = PREDICTION_LEVEL) -> tuple[int, int]:
    """Central `level` interval of Poisson(mean) counts."""
    a = (1 - level) / 2
    if mean <= 0:
        return 0, 0
    return int(stats.poisson.ppf(a, mean)), int(stats.poisson.ppf(1 - a, mean))


def wire_lambda(row: dict) -> float | None:
    """The theory's lambda of the unprotected fp32 wire at the row's BER and shape (None without the shape)."""
    model, world = row.get("model"), row.get("world_size")
    if model not in PRESETS or not world or int(world) < 2:
        return None
    try:
        if row.get("mode") == "ddp":
            per = theory.lambda_per_ber("ddp", int(world), n_params=int(row.get("n_params") or
                                                                         theory.param_count(model)))
        else:
            per = theory.lambda_per_ber("pp", int(world), batch_size=int(row["batch_size"]),
                                        seq_len=int(seq_len_of(model, row.get("seq_len"))),
                                        width=PRESETS[model].n_embd)
    except (TypeError, ValueError, KeyError):
        return None
    return per * ber_of(row)


def _verdict(k: int, interval: tuple[int, int]) -> str:
    lo, hi = interval
    return "agrees" if lo <= k <= hi else "above" if k > hi else "below"


def shares_flips(group: list[dict]) -> bool:
    """Whether the runs of a cell drew the same flips, so that their seeds are not independent trials of the
    link: on the wire each link direction's stream is seeded by the topology's seeds alone (its `seed`, derived
    per link and direction), the same for every run seed, so every seed of a cell gets the same flips at the same
    eligible offsets (measured: equal bits_flipped and flips per field in every wire cell of
    docs/results/scaling); the process injector mixes the run seed into every hop's stream (docs/injector.md), and
    so does the wire with `link_seed: run` (rows' `link_seed`; rows from before that field are `topology`)."""
    return len(group) > 1 and all(r.get("injector") == "wire" and (r.get("link_seed") or "topology") != "run"
                                  for r in group)


def _trials(counts: list[tuple[int, int]], shared: bool) -> tuple[int, int]:
    """(events, trials) of a cell from its runs' (count, steps): summed over runs when their flips are
    independent; one run's worth (the mean, rounded) when they share the flips, since a second seed then repeats
    the same draw of the link (the events differ only where the same flip lands on another value)."""
    if not counts:
        return 0, 0
    if not shared:
        return sum(a for a, _ in counts), sum(b for _, b in counts)
    return (round(statistics.fmean(a for a, _ in counts)), round(statistics.fmean(b for _, b in counts)))


def lambda_cells(rows: list[dict]) -> list[dict]:
    """One cell per (model, recipe, mode, lambda) of the rows with `ber_at_lambda`, smallest model first."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if finite(r.get("ber_at_lambda")) is not None:
            groups.setdefault((r.get("model"), recipe_of(r), r.get("mode"), float(r["ber_at_lambda"])), []).append(r)
    cells = []
    for (model, recipe, mode, lam), group in sorted(groups.items(), key=lambda kv: (
            model_key(kv[0][0]), recipe_kind(recipe_settings(kv[1][0])), mode_key(kv[0][2]), kv[0][3])):
        first = group[0]
        lost = [x for r in group if (x := lost_steps(r)) is not None]
        shared = shares_flips(group)
        k, n = _trials(lost, shared)
        point = {**{f: first.get(f) for f in ("mode", "model", "n_params", "world_size", "batch_size", "seq_len",
                                              "steps", "lr", "grad_clip")},
                 **recipe_settings(first), "ber": ber_of(first)}
        pred = predict_point(point)
        cell = {"model": model, "n_params": first.get("n_params"), "recipe": recipe, "kind": recipe_kind(point),
                "mode": mode, "lambda_target": lam, "ber": ber_of(first), "wire_lambda": wire_lambda(first),
                "injector": first.get("injector"), "runs": len(group), "ok": sum(1 for r in group if is_ok(r)),
                "shared_flips": shared,
                "lost": k, "steps": n, "prediction": pred,
                "lost_fraction": k / n if n else None, "lost_ci": clopper_pearson(k, n) if n else None,
                "predicted_lost": pred.p_step_skipped if pred else None, "lost_interval": None, "lost_verdict": None,
                "sanitized": None, "sanitized_steps": None, "predicted_sanitized": None, "sanitized_interval": None,
                "sanitized_verdict": None}
        if pred is not None and n:
            cell["lost_interval"] = binomial_interval(n, pred.p_step_skipped)
            cell["lost_verdict"] = _verdict(k, cell["lost_interval"])
        san = [(int(r["sanitized_values"]), int(r["steps_completed"])) for r in group
               if finite(r.get("sanitized_values")) is not None and finite(r.get("steps_completed"))]
        if san and point.get("guard") == "sanitize":
            cell["sanitized"], cell["sanitized_steps"] = _trials(san, shared)
            if pred is not None:
                cell["predicted_sanitized"] = pred.sanitized_per_step
                cell["sanitized_interval"] = poisson_count_interval(pred.sanitized_per_step * cell["sanitized_steps"])
                cell["sanitized_verdict"] = _verdict(cell["sanitized"], cell["sanitized_interval"])
        cells.append(cell)
    return cells


def recipe_kind(settings: dict) -> str:
    """default / protect / sanitize / other, from the recipe's settings (not its name); a recipe that clips
    otherwise than by norm (clip value or none) is "other": its sizes fit as a family of their own, by name."""
    if settings.get("clip") not in (None, "norm"):
        return "other"
    if settings.get("protect"):
        return "protect"
    if settings.get("guard") == "sanitize":
        return "sanitize"
    if settings.get("guard") in (None, "skip") and settings.get("wire_dtype") in (None, "fp32"):
        return "default"
    return "other"


def lambda_summary(cells: list[dict]) -> dict:
    """How many cells agree, and which disagree."""
    judged = [c for c in cells if c["lost_verdict"] is not None]
    return {"cells": len(cells), "judged": len(judged), "agree": sum(c["lost_verdict"] == "agrees" for c in judged),
            "disagree": [c for c in judged if c["lost_verdict"] != "agrees"]}


# ---------------------------------------------------------------------------------------------------------------
# The chaos floor
# ---------------------------------------------------------------------------------------------------------------

def _mean(xs):
    return statistics.fmean(xs) if xs else None


def lsb_bound(row: dict) -> float | None:
    """The theory's deviation of one LSB flip without dynamical amplification: the value moves by at most 2^-23
    of itself. A gradient value: Adam turns a relative error eps into at most D lr eps (D = adam_hit_displacement,
    5.8 for (0.9, 0.95)). A weight: 2^-23 |w| <= 2^-23 (GPT-2's weights are < 1 here)."""
    lr = finite(row.get("lr"))
    if row.get("perturb") == "lsb" and lr:
        return theory.adam_hit_displacement(1.0) * lr * 2.0 ** -23
    if row.get("perturb") == "weight-lsb":
        return 2.0 ** -23
    return None


def chaos_floor(rows: list[dict]) -> list[dict]:
    """Per model and mode: the controls' final deviations (per perturbation: values over seeds and their mean),
    the BER runs' (per recipe kind and lambda, mean over ok runs), the theory beside each, and per recipe kind the
    log-log slope of the runs' deviation against BER (`slopes`; bounded noise predicts 1/2)."""
    out = []
    keys = sorted({(r.get("model"), r.get("mode")) for r in rows if (r.get("perturb") or "none") != "none"
                   or finite(r.get("ber_at_lambda")) is not None}, key=lambda k: (model_key(k[0]), mode_key(k[1])))
    for model, mode in keys:
        mine = [r for r in rows if r.get("model") == model and r.get("mode") == mode and is_ok(r)]
        controls = {}
        for r in mine:
            p = r.get("perturb") or "none"
            if p != "none" and ber_of(r) == 0 and finite(r.get("final_deviation")) is not None:
                c = controls.setdefault(p, {"values": [], "bound": lsb_bound(r)})
                c["values"].append(float(r["final_deviation"]))
        for c in controls.values():
            c["mean"] = _mean(c["values"])
        floor = max((max(c["values"]) for c in controls.values() if c["values"]), default=None)
        ber_runs = {}
        for r in mine:
            lam = finite(r.get("ber_at_lambda"))
            if lam is None or finite(r.get("final_deviation")) is None:
                continue
            kind = recipe_kind(recipe_settings(r))
            e = ber_runs.setdefault((kind, lam), {"kind": kind, "lambda": lam, "ber": ber_of(r), "values": [],
                                                  "rows": []})
            e["values"].append(float(r["final_deviation"]))
            e["rows"].append(r)
        entries = []
        for (kind, lam), e in sorted(ber_runs.items(), key=lambda kv: (("default", "protect", "sanitize", "other")
                                                                         .index(kv[0][0]), kv[0][1])):
            r = e["rows"][0]
            pred = predict_point({**{f: r.get(f) for f in ("mode", "model", "n_params", "world_size", "batch_size",
                                                         "seq_len", "steps", "lr", "grad_clip")},
                                  **recipe_settings(r), "ber": ber_of(r)})
            mean = _mean(e["values"])
            entries.append({"kind": kind, "lambda": lam, "ber": e["ber"], "n": len(e["values"]), "mean": mean,
                            "min": min(e["values"]), "theory": pred.noise_deviation if pred else None,
                            "vs_floor": (min(e["values"]) / floor) if floor else None,
                            "distinguishable": (min(e["values"]) > floor) if floor is not None else None})
        slopes = {}
        for kind in ("default", "protect", "sanitize"):
            pts = [(e2["ber"], v) for (k, _), e2 in ber_runs.items() if k == kind for v in e2["values"] if v > 0]
            if len({b for b, _ in pts}) >= 2:
                fit = stats.linregress(np.log10([b for b, _ in pts]), np.log10([v for _, v in pts]))
                slopes[kind] = float(fit.slope)
        out.append({"model": model, "mode": mode, "n_params": next((r.get("n_params") for r in mine), None),
                    "controls": controls, "floor": floor, "ber_runs": entries, "slopes": slopes})
    return out


def first_distinguishable(entry: dict, kind: str) -> dict | None:
    """The smallest lambda of a recipe kind whose every run deviates more than every control (None: none)."""
    return next((e for e in entry["ber_runs"] if e["kind"] == kind and e["distinguishable"]), None)


def time_per_size(rows: list[dict], by: tuple[str, ...] = ("model", "mode")) -> list[dict]:
    """Per model and mode (and any further row fields in `by`, e.g. steps and world_size): the median of the runs'
    median step times, the summed wall time and the median per point (over the `timed` points), the injector(s)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in by), []).append(r)
    out = []
    for key, group in sorted(groups.items(), key=lambda kv: (model_key(kv[0][0]), mode_key(kv[0][1]),
                                                             *(v or 0 for v in kv[0][2:]))):
        times = [t for r in group if (t := finite(r.get("median_step_time_s"))) is not None]
        walls = [w for r in group if (w := finite(r.get("wall_time_s"))) is not None]
        out.append({**dict(zip(by, key)), "points": len(group), "timed": len(walls),
                    "median_step_time_s": statistics.median(times) if times else None,
                    "wall_time_s": sum(walls) if walls else None,
                    "median_wall_time_s": statistics.median(walls) if walls else None,
                    "injectors": sorted({str(r.get("injector")) for r in group})})
    return out


def is_scaling(rows: list[dict]) -> bool:
    """Whether the rows hold lambda points or BER-0 controls (the section applies)."""
    return any(finite(r.get("ber_at_lambda")) is not None or (r.get("perturb") or "none") != "none" for r in rows)


def fraction_curve(lams) -> list[float]:
    """1 - exp(-lambda)."""
    return [-math.expm1(-x) for x in lams]
