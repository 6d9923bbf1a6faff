"""An experiment's report: summary.csv, the plots and report.md, from results.jsonl and latency.json alone.

    python -m testbed.report.report DIR

The verdicts follow the paired rule at the tolerance the experiment registered (analysis.py; no flag changes it).

Input contract: docs/experiments.md (results.jsonl rows: testbed/analysis/results.py, latency.json).
Missing pieces (no PP rows, no latency.json, every run crashed) give a sentence in the report or leave out the
section they concern, never an exception. A directory with summary.csv but no results.jsonl (reference results
that kept only the CSV) is rebuilt from the CSV: the analysis, not the curves; its plots are left as they are. This module renders: what the numbers mean is computed in analysis.py (definitions there, and
written into report.md), the figures are drawn by plots.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import platform
import sys
import traceback
from datetime import datetime
from pathlib import Path

from testbed.fileio import read_jsonl, write_atomic
from testbed.locate.scores import locate_section
from testbed.report import plots
from testbed.analysis import theory
from testbed.report.linklayer import linklayer_section
from testbed.report.calibration import calibration_section
from testbed.report.scaling import ladder_headline, scaling_section, size_threshold_section
from testbed.report.paperregime import paper_regime_section
from testbed.analysis.analysis import (BOUND_LEVEL, LATENCY_STATS, PUBLISHED_TOLERATED_BER, SENSITIVITY_TOLERANCES,
                                      aggregate, decided, deviation_fits, interval, latency_entries, orderings,
                                      pending_seeds_text, pending_text, point_config, published_verdict,
                                      retransmission_penalties, sum_or_none, theory_comparison, thresholds,
                                      tolerance_of, values_of)
from testbed.analysis.formatting import (ber_text, config_label, fmt, fmt_loss, fmt_pct, fmt_signed, fraction_ci_text,
                                         md_table, mode_name, status_text)
from testbed.report.plots import latency_label
from testbed.analysis.results import (DEFAULT_RECIPE, FIELDS_BY_NAME, MODE_ORDER, SUMMARY_COLUMNS, config_key,
                                     config_sort_key, configs, finite, grid_order, is_ok, positive, recipe_of,
                                     row_from_summary)

RESULTS_FILE, LATENCY_FILE, EXPERIMENT_FILE = "results.jsonl", "latency.json", "experiment.yaml"
SUMMARY_FILE, REPORT_FILE = "summary.csv", "report.md"
LINK_RATE_BPS, LINK_LENGTH_M = 100e9, 10.0  # the theory's link for the latency breakdown
THEORY_FRAME_BYTES = (1500, 4096, 9000)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------

def load_results(out_dir) -> list[dict]:
    """results.jsonl as a list of rows; [] when the file is missing. A torn last line is skipped."""
    return [r for r in read_jsonl(Path(out_dir) / RESULTS_FILE) if isinstance(r, dict)]


def load_summary_rows(out_dir) -> list[dict]:
    """summary.csv's lines as rows (results.row_from_summary); [] when the file is missing."""
    try:
        text = (Path(out_dir) / SUMMARY_FILE).read_text()
    except OSError:
        return []
    return [row_from_summary(r) for r in csv.DictReader(io.StringIO(text))]


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


def coverage(rows: list[dict], planned) -> dict[tuple, tuple[int, int]]:
    """(recipe, mode) -> (points with a row, points in the grid) for every cell of the experiment's grid that
    lacks rows: a run in parts (`--recipes`) or one that was stopped. planned: the grid's Experiment.planned() tuples
    (point id, recipe, mode, BER, scope, checksum), from the sweep that owns the experiment file
    (`testbed.experiments.spec.planned_points`; the report does not load experiment files). {} when all ran, or
    when the grid is not known (planned None)."""
    counts = _planned_counts(rows, planned, lambda recipe, mode, *_: (recipe, mode))
    return {k: (a, n) for k, (a, n) in counts.items() if a < n}


def _planned_counts(rows: list[dict], planned, key) -> dict[tuple, tuple[int, int]]:
    """key(recipe, mode, BER, scope, checksum) -> (points of it with a row, points of it in the grid)."""
    have = {r.get("point") for r in rows}
    cells: dict[tuple, list[int]] = {}
    for pid, *fields in planned or []:
        c = cells.setdefault(key(*fields), [0, 0])
        c[0] += pid in have
        c[1] += 1
    return {k: tuple(c) for k, c in cells.items()}


def pending_points(rows: list[dict], planned) -> dict[tuple, tuple[int, int]]:
    """(recipe, mode, scope, checksum, BER) -> (seeds with a row, seeds in the grid) for every BER of the grid
    that has some of its seeds but not all: such a BER neither passes nor fails yet (analysis.thresholds), since
    the seeds still to run move its paired bound. {} when the grid is not known (planned None)."""
    counts = _planned_counts(rows, planned, lambda recipe, mode, ber, scope, checksum: (recipe, mode, scope,
                                                                                       checksum, float(ber)))
    return {k: (a, n) for k, (a, n) in counts.items() if 0 < a < n}


def coverage_lines(missing: dict[tuple, tuple[int, int]], rows: list[dict]) -> list[str]:
    """The report's first lines when part of the grid has no results yet."""
    if not missing:
        return []
    planned = len({r.get("point") for r in rows}) + sum(n - a for a, n in missing.values())
    cells = ", ".join(f"{recipe} {mode_name(mode)} {a} of {n}" for (recipe, mode), (a, n) in missing.items())
    return [f"**Incomplete:** {planned - sum(n - a for a, n in missing.values())} of the grid's {planned} points "
            f"have results (points run, per recipe and mode: {cells}). A threshold of an incomplete recipe and mode "
            "is marked provisional (a BER not yet run can neither pass nor fail; one with some of its seeds run is "
            "pending, neither a pass nor a failure) and is left out of the size fit. "
            "Run the same `testbed run` again to finish the grid.", ""]


# ---------------------------------------------------------------------------------------------------------------
# summary.csv
# ---------------------------------------------------------------------------------------------------------------

def _is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def write_summary_csv(rows: list[dict], path) -> Path:
    """One line per point, scalar fields only (curves dropped): the schema's columns in schema order, then any
    other scalar fields alphabetically; rows in grid order (mode, scope, checksum, BER, seed)."""
    # schema fields that are not scalars (curves, dicts) stay out even when a row holds null there
    extra = sorted({k for r in rows for k, v in r.items()
                    if k not in SUMMARY_COLUMNS and k not in FIELDS_BY_NAME and _is_scalar(v)})
    columns = list(SUMMARY_COLUMNS) + extra
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in sorted(rows, key=grid_order):
        writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in columns if _is_scalar(r.get(k))})
    path = Path(path)
    write_atomic(path, buf.getvalue())
    return path


# ---------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(md_table(header, rows))


def key_table(agg: list[dict]) -> str:
    """The mode x BER table: status counts, eval loss, gap, skipped steps, deviation, divergence, flips..."""
    all_configs = sorted({point_config(p) for p in agg}, key=config_sort_key)
    header = ["config", "BER", "seeds", "status", "eval loss (mean ± sd)", "gap", "gap %", "skipped steps",
              "deviation", "replica divergence", "bits flipped", "realized BER", "step time (s)"]
    body = []
    for p in agg:
        ev = fmt_loss(p["eval_loss_mean"]) + (f" ± {fmt_loss(p['eval_loss_std'])}"
                                               if p["eval_loss_std"] is not None else "")
        status = status_text(p["statuses"]) + (f" ({p['no_progress']} no progress)" if p["no_progress"] else "")
        body.append([config_label(point_config(p), all_configs), ber_text(p["ber"]),
                     str(p["n_seeds"]), status, ev,
                     fmt_signed(p["loss_gap"], fmt_loss) if p["ber"] > 0 else "(clean)",
                     fmt_pct(p["loss_gap_rel"]) if p["ber"] > 0 else "",
                     fmt(p["skipped_steps_mean"]), fmt(p["deviation_mean"]), fmt(p["divergence_mean"]),
                     fmt(p["bits_flipped_total"]), fmt(p["realized_ber"]), fmt(p["median_step_time_s"])])
    if not any(p["eval_loss_n"] for p in agg):  # an experiment without evals: no eval or gap columns
        keep = [i for i, h in enumerate(header) if h not in ("eval loss (mean ± sd)", "gap", "gap %")]
        header, body = [header[i] for i in keep], [[row[i] for i in keep] for row in body]
    return _table(header, body)


def _published_comparison(t: dict) -> str:
    """How the measured interval (max_ok, min_fail] sits against the published 'fine below P'."""
    pub, ok, fail = t["published_ber"], t["max_ok_ber"], t["min_fail_ber"]
    name = mode_name(t["mode"])
    if pub is None or not decided(t):
        return ""
    published = f"the published analysis of GPT-2 124M ({name} fine below {ber_text(pub)})"
    verdict = published_verdict(t) or "consistent"
    if verdict == "more tolerant":
        return f"That is more tolerant than {published}: here {name} is still fine at {ber_text(ok)}."
    if verdict == "more fragile":
        return f"That is more fragile than {published}: here {name} already fails at {ber_text(fail)}."
    return f"That is consistent with {published}."


def theory_agreement(t: dict) -> str | None:
    """How the theory's tolerated BER sits in the measured interval: 'consistent' (max_ok <= it < min_fail),
    'optimistic' (it tolerates a BER that failed) or 'pessimistic' (the runs matched clean above it)."""
    b = t.get("theory_tolerated_ber")
    if b is None or t["tolerance_abs"] is None or not t["tested_bers"] or not decided(t):
        return None
    lo, hi = interval(t)
    return "consistent" if lo <= b < hi or b == hi == math.inf else "optimistic" if b >= hi else "pessimistic"


def _tolerated_sentence(t: dict) -> str:
    """The recipe-aware theory: lost steps 1 - exp(-lambda) and the time shift they cost."""
    b, f = t.get("theory_tolerated_ber"), t.get("time_shift_fraction")
    if t.get("theory_note"):
        text = f"Theory: {t['theory_note']}"
    elif b is None:
        return ""
    else:
        text = (f"Theory: λ, the catastrophic values per step over all ranks and hops, reaches 1 (63 % of the "
                f"steps lost) at BER {ber_text(t['theory_lost_ber'])}; the clean loss curve absorbs losing "
                f"{fmt_pct(f)[1:]} of the steps within the tolerance, which the theory reaches at BER {ber_text(b)}")
    verdict = theory_agreement(t)
    words = {"consistent": "consistent with the measurement",
             "optimistic": f"more optimistic than the measurement, which fails from {ber_text(t['min_fail_ber'])}",
             "pessimistic": f"more pessimistic than the measurement, which still matches clean at "
                            f"{ber_text(t['max_ok_ber'])}"}
    return text + (f": {words[verdict]}." if verdict else ".")


def _theory_comparison(t: dict) -> str:
    """The theory's threshold, and how many catastrophic values it expects over a run at the measured BERs:
    catastrophic values per step = BER / threshold (the threshold is where that count is 1)."""
    th, steps = t["theory_ber"], t.get("steps")
    if t.get("theory_note"):
        return _tolerated_sentence(t)
    if th is None:
        return f"Theory: {t['theory_basis']}."
    text = f"The theory expects {t['theory_basis']} at BER {ber_text(th)}."
    per_run = (lambda b: b / th * steps) if steps else None
    ok, fail = t["max_ok_ber"], t["min_fail_ber"]
    if per_run and ok is not None:
        text += f" At {ber_text(ok)} that is {fmt(per_run(ok))} catastrophic values over the {steps} steps"
        text += (", and training still matches clean: they are neutralised (skipped steps, clipping, Adam's "
                 "bounded step), not avoided." if per_run(ok) >= 1 else ", so the passing runs rarely met one.")
    if per_run and fail is not None:
        text += f" At {ber_text(fail)}, where it fails, {fmt(per_run(fail))}"
        text += (" per run: fewer than one, so catastrophic values do not explain the failure (see its reason)."
                 if per_run(fail) < 1 else " per run.")
    return f"{text} {_tolerated_sentence(t)}".strip()


def _config_name(t: dict) -> str:
    recipe = "" if t.get("recipe", DEFAULT_RECIPE) == DEFAULT_RECIPE else f", recipe {t['recipe']}"
    return f"**{mode_name(t['mode'])}** ({t['scope']}/{t['checksum']}{recipe})"


def threshold_sentence(t: dict) -> str:
    """One paragraph per config: the measured threshold, then the published and theory comparisons."""
    label = _config_name(t)
    if t["note"] and t["tolerance_abs"] is None:
        return f"{label}: no threshold: {t['note']}."
    if not t["tested_bers"]:
        return f"{label}: no threshold: only the clean point was run."
    ok, fail = t["max_ok_ber"], t["min_fail_ber"]
    if not decided(t):
        return f"{label}: no BER decided yet: {pending_text(t['pending'])} (provisional)."
    if ok is not None and fail is None:
        head = f"trains as well as on a clean link at every tested BER, up to {ber_text(ok)}"
    elif ok is not None:
        head = (f"trains as well as on a clean link up to BER {ber_text(ok)} and fails from {ber_text(fail)} "
                f"({t['failing'][fail]})")
    else:
        head = f"fails already at the smallest tested BER, {ber_text(fail)} ({t['failing'][fail]})"
    if t["non_monotonic"]:
        again = [b for b in t["passing_bers"] if fail is not None and b > fail]
        head += f"; non-monotonic: passes again at {', '.join(map(ber_text, again))}"
    if t.get("pending"):
        head += f"; not decided yet: {pending_text(t['pending'])}"
    return f"{label} {head}. {_published_comparison(t)} {_theory_comparison(t)}".strip()


def interval_text(ok: float | None, fail: float | None) -> str:
    """The threshold as an interval: '1e-06 – 3e-06' (last passing – first failing BER), '< 1e-06' (the smallest
    tested BER fails), '≥ 1e-04' (every tested BER passes)."""
    if ok is not None and fail is not None:
        return f"{ber_text(ok)} – {ber_text(fail)}"
    if fail is not None:
        return f"< {ber_text(fail)}"
    return f"≥ {ber_text(ok)}" if ok is not None else "no threshold"


def _has_threshold(t: dict) -> bool:
    """A threshold to report: the config has a baseline and a BER > 0."""
    return t["tolerance_abs"] is not None and bool(t["tested_bers"])


def reported(th: dict) -> dict:
    """The configs the threshold tables and sentences cover: every one the paired rule applies to, less those run
    at BER 0 alone (the chaos floor's controls) when other configs have BERs to judge: such a config has no
    threshold by design, and a row of "no threshold" per control only hides the answer (issue 22, item 7)."""
    # a size ladder reads smallest model first; within a size (or with one model) the configs keep their order
    applies = dict(sorted(((k, t) for k, t in th.items() if t["applies"]),
                          key=lambda kt: kt[1].get("n_params") or 0))
    if not any(t["tested_bers"] for t in applies.values()):
        return applies
    return {k: t for k, t in applies.items() if t["tested_bers"]}


def clean_only_line(th: dict) -> str | None:
    """One line naming the recipes that ran at BER 0 only, when reported() left them out; None otherwise."""
    kept = reported(th)
    names = sorted({t["recipe"] for k, t in th.items() if t["applies"] and k not in kept})
    if not names:
        return None
    return (f"Run at BER 0 only, so without a threshold (controls: the chaos floor below): {', '.join(names)}.")


def _orderings(th: dict) -> list[dict]:
    """orderings() of the reported configs: a control recipe (BER 0 in both modes) has no ordering to state."""
    return orderings(reported(th))


def _measured_cell(t: dict) -> str:
    """'1e-05 – 1e-04': the measured interval (last pass, first fail]; 'no threshold' when there is none."""
    if not _has_threshold(t):
        return "no threshold"
    if not decided(t):
        return f"pending: {pending_text(t['pending'])}"
    return (interval_text(t["max_ok_ber"], t["min_fail_ber"]) + (" (non-monotonic)" if t["non_monotonic"] else "")
            + (" (provisional: {} of {} points)".format(*t["incomplete"]) if t.get("incomplete") else ""))


def _theory_cell(t: dict) -> str:
    b = t.get("theory_tolerated_ber")
    if b is None:
        return "—"
    if math.isinf(b):
        return "any (no lost steps)"
    ends = t.get("theory_ending_ber") is not None and b == t["theory_ending_ber"]
    return f"up to {ber_text(b)}" + (" (runs end)" if ends else "")


def threshold_matrix(th: dict) -> str:
    """The recipe x mode table: measured and predicted tolerated BER per recipe and mode, tokens per step."""
    rows: dict[tuple, dict] = {}
    for t in th.values():
        rows.setdefault((t["recipe"], t["scope"], t["checksum"]), {})[t["mode"]] = t
    modes_present = [m for m in MODE_ORDER if any(m in v for v in rows.values())]
    several = len({k[1:] for k in rows}) > 1
    header = ["recipe"] + [f"{mode_name(m)} {what}" for m in modes_present
                           for what in ("measured", "theory", "tokens/step")]
    body = []
    for (recipe, scope, checksum), by_mode in rows.items():
        cells = [recipe + (f" ({scope}/{checksum})" if several else "")]
        for m in modes_present:
            t = by_mode.get(m)
            cells += (["—", "—", "—"] if t is None else
                      [_measured_cell(t), _theory_cell(t), fmt(t.get("tokens_per_step"))])
        body.append(cells)
    published = ["published (GPT-2 124M)"] + [c for m in modes_present for c in (
        f"fine below {ber_text(PUBLISHED_TOLERATED_BER.get(m))}", "", "")]
    return _table(header, body + [published])


def thresholds_table(th: dict) -> str:
    header = ["config", "clean eval loss", "tolerance", "last passing BER", "first failing BER", "why",
              "theory: catastrophic from", "theory: tolerated up to", "theory vs measured", "published: fine below"]
    body = []
    for t in th.values():
        fail = t["min_fail_ber"]
        recipe = "" if t["recipe"] == DEFAULT_RECIPE else f" {t['recipe']}"
        body.append([f"{mode_name(t['mode'])} {t['scope']}/{t['checksum']}{recipe}",
                     fmt_loss(t["clean_eval_loss_mean"]), fmt_loss(t["tolerance_abs"]),
                     ber_text(t["max_ok_ber"]) if t["max_ok_ber"] is not None else "—",
                     ber_text(fail) if fail is not None else "—", t["failing"].get(fail, t["note"] or ""),
                     ber_text(t["theory_ber"]), _theory_cell(t), theory_agreement(t) or "—",
                     ber_text(t["published_ber"])])
    return _table(header, body)


def _pct(tol: float) -> str:
    return f"{100 * tol:g} %"


def sensitivity_table(th: dict, tolerance: float) -> str:
    """The threshold interval per config at each of SENSITIVITY_TOLERANCES (and the registered tolerance)."""
    tols = sorted({*SENSITIVITY_TOLERANCES, tolerance})
    header = ["config"] + [_pct(t) + (" (registered)" if t == tolerance else "") for t in tols]
    body = [[_short_name(t)] + [interval_text(*t["sensitivity"][tol]) if decided(t) else "pending" for tol in tols]
            for t in th.values() if _has_threshold(t)]
    return _table(header, body)


def paired_table(agg: list[dict], th: dict) -> str:
    """Per BER > 0 point: the per-seed gaps to the clean run of the same seed, their mean, the upper bound, and
    the verdict at the registered tolerance."""
    body = []
    for p in agg:
        t = th.get(_key_of(p))
        if p["ber"] == 0 or t is None or not _has_threshold(t):
            continue
        reason, todo = t["failing"].get(p["ber"]), t.get("pending", {}).get(p["ber"])
        body.append([_short_name(t), ber_text(p["ber"]), str(len(p["gaps"])),
                     ", ".join(fmt_signed(g, fmt_loss) for g in p["gaps"].values()) or "—",
                     fmt_signed(p["gap_mean"], fmt_loss), fmt_signed(p["gap_upper"], fmt_loss),
                     fmt_loss(t["tolerance_abs"]),
                     f"pending: {pending_seeds_text(todo)}" if todo else
                     "pass" if reason is None else
                     "fail: bound > tolerance" if reason.startswith("upper bound") else f"fail: {reason}"])
    return _table(["config", "BER", "paired seeds", "gaps (per seed)", "mean gap",
                   f"{100 * BOUND_LEVEL:g} % upper bound", "tolerance", "verdict"], body)


def _key_of(point: dict) -> str:
    return config_key(point_config(point))


def _short_name(t: dict) -> str:
    recipe = "" if t["recipe"] == DEFAULT_RECIPE else f" {t['recipe']}"
    return f"{mode_name(t['mode'])} {t['scope']}/{t['checksum']}{recipe}"


def ordering_sentence(o: dict) -> str:
    """Which mode tolerates more under one recipe, against the published ordering and the theory."""
    words = {"ddp": "DDP tolerates more than PP", "pp": "PP tolerates more than DDP",
             "same": "DDP and PP are not distinguishable in this grid", None: "no ordering (a threshold is missing)"}
    rest = (o["scope"], o["checksum"])
    name = o["recipe"] + ("" if rest == ("tensor", "fix") else f" ({rest[0]}/{rest[1]})")
    text = f"Recipe **{name}**: measured, {words[o['measured']]}"
    text += (" (the published ordering)" if o["published_order"] else "")
    if o["published_order"] and o["published_numbers"]:
        text += ", and both thresholds are consistent with the published ones"
    text += f"; the theory: {words[o['predicted']]}" if o["predicted"] else ""
    if o["matched_tokens"] is False:
        d, p = o["tokens_per_step"]
        text += f". Not at matched tokens (DDP {fmt(d)}, PP {fmt(p)} tokens per step): not a fair comparison"
    return text + "."


def ordering_summary(ords: list[dict]) -> str:
    """Which recipes, if any, reproduce the published ordering (DDP more tolerant than PP) at matched tokens."""
    if not ords:
        return "No recipe ran both DDP and PP, so there is no ordering to compare with the published one."
    fair = [o for o in ords if o["matched_tokens"] is not False]
    tokens = ("at matched tokens" if all(o["matched_tokens"] for o in fair) else
              "tokens per step not recorded for every mode")
    reproduce = [o["recipe"] for o in fair if o["published_order"]]
    numbers = [o["recipe"] for o in fair if o["published_order"] and o["published_numbers"]]
    if not fair:
        return "No recipe ran DDP and PP at matched tokens per step, so no ordering is a fair comparison."
    if not reproduce:
        return f"No recipe reproduces the published ordering (DDP more tolerant than PP; {tokens})."
    text = (f"Recipes that reproduce the published ordering (DDP more tolerant than PP; {tokens}): "
            f"{', '.join(reproduce)}")
    return text + (f"; with thresholds consistent with the published numbers too: {', '.join(numbers)}."
                   if numbers else "; none also matches the published numbers.")


def _slope_sentence(label: str, d: dict) -> str:
    fit = d["fit"]
    if fit is None:
        return f"{label}: deviations at one BER only, no slope."
    lo, hi = fit["ber_range"]
    err = f" ± {fit['stderr']:.2g}" if fit["stderr"] is not None else ""
    text = (f"{label}: measured slope {fit['slope']:.2f}{err} (least squares on log-log, {fit['n_points']} ok runs, "
            f"BER {ber_text(lo)}..{ber_text(hi)}); sqrt(BER) means 0.50")
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
            body.append([label, ber_text(p["ber"]), str(p["n"]), fmt(p["mean"]), fmt(p["theory"]), fmt(ratio)])
    out += [_table(["config", "BER", "ok runs", "deviation (mean)", "theory", "measured / theory"], body), ""]
    out += ["- " + _slope_sentence(config_label(d["config"], all_configs), d) for d in fits.values()]
    out += ["", "The analytical curve is `theory.weight_deviation_estimate` (AdamW, the runs' n_params, steps, lr, "
            "grad_clip and world size; gradient errors through the gloo ring, so DDP only); for a recipe that "
            "protects the exponent or sanitizes, the deviation from its bounded errors "
            "(`RecipePrediction.noise_deviation`). It ignores the training dynamics, which amplify any "
            "perturbation, so measured deviations may exceed it while keeping the slope; with clipping it "
            "saturates once every step is lost (slope < 1/2).", ""]
    return out


def _count_cell(c: dict | None) -> str:
    if c is None:
        return "—"
    return f"{fraction_ci_text(c['measured'], c['ci'])} vs {fmt(float(c['predicted']))} ({c['verdict']})"


def theory_section(agg: list[dict], plot_line: str) -> list[str]:
    """Measured against predicted per point: lost-step fraction, sanitized values per step, frozen fraction; then
    in words where they disagree."""
    out = ["## Lost steps, sanitized and frozen values: measured vs theory", ""]
    comp = theory_comparison(agg)
    if not comp:
        return out + ["No point at BER > 0 has both measurements and a prediction.", "", plot_line, ""]
    all_configs = sorted({(c["mode"], c["scope"], c["checksum"], c["recipe"]) for c in comp}, key=config_sort_key)
    body = []
    for c in comp:
        pred = c["prediction"]
        body.append([config_label((c["mode"], c["scope"], c["checksum"], c["recipe"]), all_configs),
                     ber_text(c["ber"]), fmt(pred.lost), _count_cell(c["lost"]), _count_cell(c["sanitized"]),
                     _count_cell(c["frozen"]), fmt(pred.p_run_completes)])
    out += ["Measured with a 95 % interval (lost steps: Clopper-Pearson on the skipped updates pooled over seeds; "
            "sanitized values per step: Poisson) against `theory.predict_recipe`: λ = expected catastrophic values "
            "per step over every rank and hop, lost fraction 1 - exp(-λ) (0 where the guard skips nothing), "
            "sanitized = catastrophic values zeroed per step summed over ranks, frozen = elements of a replica "
            "whose Adam state a hit pushed above 1e6 (guard none without clipping; agrees within a factor 2). "
            "Derivations: docs/theory.md, section 4.", "",
            _table(["config", "BER", "λ (theory)", "lost fraction: measured vs theory", "sanitized per step",
                    "frozen fraction", "P(run completes), theory"], body), ""]
    out += [f"- {line}" for line in disagreements(comp, all_configs)] + ["", plot_line, ""]
    return out


def disagreements(comp: list[dict], all_configs: list[tuple]) -> list[str]:
    """One sentence per config and quantity where the measurement falls outside the theory (or 'agrees')."""
    lines = []
    for config in all_configs:
        rows = [c for c in comp if (c["mode"], c["scope"], c["checksum"], c["recipe"]) == config]
        label = config_label(config, all_configs)
        for key, what in (("lost", "lost-step fraction"), ("sanitized", "sanitized count per step"),
                          ("frozen", "frozen fraction")):
            judged = [c for c in rows if c[key] is not None]
            if not judged:
                continue
            off = [c for c in judged if c[key]["verdict"] != "agrees"]
            if not off:
                lines.append(f"{label}: the {what} agrees with the theory at every BER measured "
                             f"({', '.join(ber_text(c['ber']) for c in judged)}).")
                continue
            parts = [f"{ber_text(c['ber'])} measured {fmt(float(c[key]['measured']))} vs "
                     f"{fmt(float(c[key]['predicted']))} ({c[key]['verdict']} the theory)" for c in off]
            lines.append(f"**{label}: the {what} disagrees with the theory** at " + "; ".join(parts) + "."
                         + _why(key, off))
    return lines


def _why(key: str, off: list[dict]) -> str:
    """What a disagreement says about the model's assumptions (the candidates, not a diagnosis)."""
    pred = off[0]["prediction"]
    below = all(c[key]["verdict"] == "below" for c in off)
    if key == "lost" and pred.mode == "pp" and below and pred.lost_forward:
        share = pred.lost_forward / pred.lost if pred.lost else 0
        back = [(c, c["prediction"].p_step_lost_backward) for c in off]
        where = [("inside" if c[key]["ci"][0] <= p <= c[key]["ci"][1] else "above" if c[key]["ci"][0] > p
                  else "below") for c, p in back]
        rest = [text.format(where.count(kind)) for kind, text in (
            ("above", "above it at {}, between the two predictions (some forward values arrive as Inf or NaN)"),
            ("below", "below even it at {}")) if kind in where]
        return (f" The theory counts every catastrophic activation as a lost step ({share:.0%} of λ); the next "
                "stage's pre-LayerNorm contains a huge but finite activation, and only an Inf or NaN one (from "
                "|x| in [1, 2)) passes it (docs/theory.md, section 4). With only the backward part, 1 - exp(-(λ - "
                "λ forward)): " + ", ".join(f"{fmt(p)} at {ber_text(c['ber'])}" for c, p in back)
                + f"; inside the measured 95 % interval at {where.count('inside')} of {len(back)}"
                + "".join(f"; {r}" for r in rest) + ".")
    if key == "lost" and pred.p_step_skipped == 0 and not below:
        return " The theory expects this guard to skip nothing."
    if key == "lost" and not below:
        return " More steps are lost than catastrophic flips explain: moderate flips, or faults beyond the model."
    if key == "lost":
        return (" Fewer steps are lost than predicted: not every catastrophic value reaches the gradient norm or "
                "the loss.")
    return ""


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
        row = [latency_label(e), ber_text(finite(e.get("ber")) or 0.0) if e.get("engine") else "(no engine)",
               str(e.get("checksum") or "—"),
               *[fmt(finite(e.get(k))) for k in ("p50_us", "p90_us", "p99_us", "p999_us", "mean_us", "max_us")],
               fmt(len(samples) if isinstance(samples, list) else e.get("samples"))]
        row += [fmt(e.get(k)) for k in counters]
        if with_errors:
            row.append("; ".join(map(str, e.get("errors") or []))[:80].replace("|", "/"))
        body.append(row)
    return _table(header, body)


def _penalty_table(penalties: list[dict]) -> str:
    header = ["BER"] + [f"{q} {col}" for q in ("p50", "p99", "mean") for col in ("fix µs", "keep µs", "keep/fix")] \
        + ["retransmitted segments (keep)"]
    body = [[ber_text(p["ber"])] + [fmt(p[q][k]) for q in LATENCY_STATS for k in ("fix", "keep", "ratio")]
            + [fmt(p["keep_retrans_segs"])] for p in penalties]
    return _table(header, body)


def latency_section(latency: dict | None, plot_line: str) -> list[str]:
    out = ["## Latency: delivering errored frames vs retransmission", ""]
    entries = latency_entries(latency)
    if not entries:
        return out + ["No latency measurements: latency.json is missing or empty (the experiment file has no "
                      "`latency:` section, or `testbed bench latency` did not finish).", "", plot_line, ""]
    where = ", ".join(f"{k} {latency[k]}" for k in ("topology", "link", "runtime", "engine", "size", "count")
                      if latency.get(k))
    out += [f"Ping-pong round trips over one emulated link ({where}); `fix` delivers errored frames with a "
            "repaired checksum (a relaxed link), `keep` leaves the checksum wrong, so the kernel drops the segment "
            "and TCP retransmits it.", "", _latency_table(entries), ""]
    none = next((e for e in entries if not e.get("engine")), None)
    engine0 = next((e for e in entries if e.get("engine") and not finite(e.get("ber"))), None)
    if none and engine0 and positive(none.get("p50_us")) and positive(engine0.get("p50_us")):
        out += [f"Engine overhead at BER 0: p50 {fmt(engine0['p50_us'])} µs vs {fmt(none['p50_us'])} µs without "
                f"the engine ({fmt_signed(engine0['p50_us'] - none['p50_us'])} µs).", ""]
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
    bers = sorted({b for e in latency_entries(latency) if (b := positive(e.get("ber"))) is not None}) \
        or [1e-6, 1e-5, 1e-4]
    header = ["frame (B)", "BER", "P(frame errored)", "KP4 FEC", "relaxed (deliver errored)", "link retransmit mean",
              "link retransmit p99", "TCP retransmit mean", "TCP retransmit p99"]
    body = []
    for size in THEORY_FRAME_BYTES:
        for b in bers:
            lat = {x.scheme: x for x in theory.latency_comparison(size, LINK_RATE_BPS, LINK_LENGTH_M, b)}
            body.append([str(size), ber_text(b), fmt(lat["relaxed"].frame_error_probability),
                         fmt(lat["kp4"].total_s * 1e9), fmt(lat["relaxed"].total_s * 1e9),
                         fmt(lat["link-retransmit"].total_s * 1e9), fmt(lat["link-retransmit"].tail_s * 1e9),
                         fmt(lat["tcp-retransmit"].total_s * 1e9), fmt(lat["tcp-retransmit"].tail_s * 1e9)])
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
            "(`python -m testbed.analysis.theory`).", ""]


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------

# the plots of the sections that compare with the theory (left out with one_link_faults)
THEORY_PLOTS = ("deviation_vs_ber.png", "divergence_vs_ber.png", "lost_vs_theory.png")


def _draw_plots(out_dir: Path, rows: list[dict], latency: dict | None) -> dict[str, Path | None | str]:
    """Every plot; a plot that raises becomes an error string in the report instead of losing the report (it is
    written at the end of a long run)."""
    drawn = {}
    for name, (fn, source) in plots.PLOTS.items():
        if name in THEORY_PLOTS and one_link_faults(rows):
            continue  # their sections are left out (one_link_faults)
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
    "lost_vs_theory.png": ("Lost-step fraction vs BER per recipe, measured and theory",
                           "no run at BER > 0 reported skipped steps"),
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


LOCATE_PLOT, LOCATE_PLOT_TITLE = "detection_vs_ber.png", "Fault localisation: detection time and rate vs BER"


def _locate_plot_line(rows: list[dict], out_dir: Path) -> str | None:
    """The detection-vs-BER plot of a fault-localisation experiment (into out_dir) as report.md's line; None
    when no row was monitored (no locate section)."""
    if not any(r.get("locate") for r in rows):
        return None
    return plots.plot_or_sentence(plots.plot_detection_vs_ber, rows, out_dir, LOCATE_PLOT, LOCATE_PLOT_TITLE,
                                  "no faulty run")


def _timestamp(value) -> str:
    """finished_at as local ISO time: the runner writes epoch seconds; text passes through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return datetime.fromtimestamp(value).astimezone().isoformat(timespec="seconds")
    return str(value)


def _setup_section(rows: list[dict], exp: dict, latency: dict | None, tolerance: float, tol_source: str,
                   source: str) -> list[str]:
    first = rows[0] if rows else {}
    grid = exp.get("grid") or {}
    train = {k: v for k, v in (exp.get("train") or {}).items() if v is not None}
    finished = sorted(_timestamp(r["finished_at"]) for r in rows if r.get("finished_at"))
    wall = sum_or_none(values_of(rows, "wall_time_s"))
    digests = sorted({str(r["image_digest"]) for r in rows if r.get("image_digest")})
    u = platform.uname()

    def grid_values(key):
        values = grid.get(key) or sorted({r.get(key) for r in rows if r.get(key) is not None},
                                         key=lambda v: (not isinstance(v, (int, float)), v if isinstance(
                                             v, (int, float)) else str(v)))
        return ", ".join(ber_text(v) if key == "ber" else str(v) for v in values) or "—"

    # what the rows ran (recipes may set their own model and steps; process points run on loopback)
    models = sorted({(r.get("n_params") or 0, r.get("model")) for r in rows if r.get("model")})
    model_text = ", ".join(f"{m} ({n:,} parameters)" if n else str(m) for n, m in models) or exp.get("model")
    steps = sorted({r["steps"] for r in rows if r.get("steps")})
    lines = [
        ("Description", exp.get("description")),
        ("Model" if len(models) < 2 else "Models", model_text or "—"),
        ("Topologies", _topologies_text(rows, exp)),
        ("Runtime", ", ".join(sorted({str(r["runtime"]) for r in rows if r.get("runtime")}))
         or exp.get("runtime")),
        ("Steps", ", ".join(map(str, steps)) or exp.get("steps")),
        ("Training", ", ".join(f"{k} {v}" for k, v in train.items()) or
         ", ".join(f"{k} {first[k]}" for k in ("lr", "grad_clip") if first.get(k) is not None) or "defaults"),
        ("Grid", f"mode {grid_values('mode')}; BER {grid_values('ber')}; scope {grid_values('scope')}; "
                 f"checksum {grid_values('checksum')}; seeds {grid_values('seed')}; recipe {grid_values('recipe')} "
                 f"({len(rows)} results)"),
        ("Recipes", _recipes_text(exp.get("recipes") or {})),
        ("Tokens per step", _tokens_text(exp, rows)),
        ("Verdicts", f"the paired rule at tolerance {_pct(tolerance)} of the clean eval loss ({tol_source})"
         if any(r.get("final_eval_loss") is not None for r in rows) else None),
        ("Rows", "rebuilt from summary.csv (results.jsonl was not kept): the analysis is redone, the curves are "
                 "not, so the plots are the original run's and the theory's time shift is not computed"
         if source == SUMMARY_FILE else None),
        ("Runs finished", f"{finished[0]} .. {finished[-1]}" if finished else None),
        ("Training wall time", f"{wall / 60:.1f} min over all points" if wall else None),
        ("Worker image", ", ".join(digests) or None),
        ("Fingerprint", ", ".join(sorted({str(r["fingerprint"]) for r in rows if r.get("fingerprint")})) or None),
        ("Latency", "measured (latency.json)" if latency_entries(latency) else "not measured"),
        ("Report generated", f"{datetime.now().astimezone().isoformat(timespec='seconds')} on "
                             f"{' '.join(u[:5])} ({os.cpu_count()} CPUs)"),
    ]
    return ["## Setup", ""] + [f"- {k}: {v}" for k, v in lines if v not in (None, "")] + [""]


def _recipes_text(recipes: dict) -> str | None:
    """'sanitize: guard sanitize; protect: link protect sign, exponent' from the file's recipes."""
    parts = []
    for name, r in recipes.items():
        r = r or {}
        items = [f"{k} {r[k]}" for k in ("model", "steps") if r.get(k) is not None]
        items += [f"{k} {v}" for k, v in (r.get("train") or {}).items() if v is not None]
        if r.get("seed"):
            items.append(f"seeds {', '.join(map(str, r['seed']))}")
        if isinstance(r.get("ber"), dict):
            items.append("BER " + "; ".join(f"{mode_name(m)} {', '.join(ber_text(b) for b in v)}"
                                           for m, v in r["ber"].items()))
        elif r.get("ber"):
            items.append(f"BER {', '.join(ber_text(b) for b in r['ber'])}")
        items += [f"link {k} {', '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in (r.get("link") or {}).items() if v is not None]
        parts.append(f"{name}: {', '.join(items) or 'as train:'}")
    return "; ".join(parts) or None


def _topologies_text(rows: list[dict], exp: dict) -> str:
    """'DDP: pair.yaml (2 hosts), PP: ...'; recipes with their own topology listed by recipe, each with the hosts
    its rows trained on."""
    worlds: dict[tuple, set] = {}
    for r in rows:
        if r.get("world_size"):
            worlds.setdefault((r.get("mode"), recipe_of(r)), set()).add(r["world_size"])
    recipes = (exp.get("grid") or {}).get("recipe") or sorted({recipe_of(r) for r in rows}) or [DEFAULT_RECIPE]
    own = {n: (rc or {}).get("topology") for n, rc in (exp.get("recipes") or {}).items()
           if (rc or {}).get("topology") and n in recipes}
    plain = [n for n in recipes if n not in own]
    topologies = exp.get("topologies") or {r.get("mode"): r.get("topology") for r in rows}

    def hosts(pairs) -> str:
        n = sorted(set().union(*(worlds.get(p, set()) for p in pairs)))
        return f"{'/'.join(map(str, n))} hosts" if n else "not run yet"

    def name(t) -> str:  # the file's name: the run directory's copy of the experiment has absolute paths
        return Path(str(t)).name

    def recipe_text(n, t) -> str:  # a recipe's topology: one file, or one per mode ({ddp: ..., pp: ...})
        if isinstance(t, dict):
            return f"recipe {n}: " + ", ".join(f"{mode_name(m)} {name(f)} ({hosts([(m, n)])})" for m, f in t.items())
        return f"recipe {n}: {name(t)} ({hosts([(m, n) for m in topologies])})"

    parts = [f"{mode_name(m)}: {name(t)} ({hosts([(m, n) for n in plain])})" for m, t in topologies.items() if plain]
    parts += [recipe_text(n, t) for n, t in own.items()]
    return ", ".join(parts) or "—"


def _tokens_text(exp: dict, rows: list[dict]) -> str | None:
    per_mode: dict[str, set] = {}
    per_recipe: dict[str, dict[str, set]] = {}
    for r in rows:
        if r.get("tokens_per_step"):
            per_mode.setdefault(r.get("mode"), set()).add(r["tokens_per_step"])
            per_recipe.setdefault(recipe_of(r), {}).setdefault(r.get("mode"), set()).add(r["tokens_per_step"])
    if not per_mode:
        return None
    text = ", ".join(f"{mode_name(m)} {'/'.join(map(fmt, sorted(v)))}" for m, v in sorted(per_mode.items()))
    unmatched = [n for n, by_mode in per_recipe.items()
                 if len(by_mode) > 1 and len({t for v in by_mode.values() for t in v}) > 1]
    if exp.get("tokens_per_step"):
        text += f" (tokens_per_step {exp['tokens_per_step']}: batch sizes derived per mode)"
    elif unmatched:
        text += f" (not matched: DDP and PP see different tokens per step in recipe(s) {', '.join(unmatched)})"
    return text


def _latency_finding(pen: dict) -> str:
    """The retransmission penalty at one BER (the highest measured with both fix and keep), as a saving."""
    p50, p99, mean = pen["p50_us"], pen["p99_us"], pen["mean_us"]
    if p50["extra"] is None or p99["extra"] is None:
        return f"- Latency at BER {ber_text(pen['ber'])}: fix or keep lacks p50/p99, no penalty computed."
    if p50["extra"] <= 0 and p99["extra"] <= 0:
        return (f"- At BER {ber_text(pen['ber'])} retransmission (keep) costs no measurable latency over delivering "
                f"errored frames (fix): p50 {fmt(p50['keep'])} vs {fmt(p50['fix'])} µs, p99 {fmt(p99['keep'])} "
                f"vs {fmt(p99['fix'])} µs.")
    mean_text = f", {fmt(mean['extra'])} µs on average" if mean["extra"] is not None else ""
    return (f"- **Delivering errored frames (fix) instead of retransmitting them (keep) saves "
            f"{fmt(p50['extra'])} µs at p50 (keep/fix x{fmt(p50['ratio'])}) and {fmt(p99['extra'])} µs at p99 "
            f"(x{fmt(p99['ratio'])}){mean_text} per round trip at BER {ber_text(pen['ber'])}.**")


def _comp_configs(comp: list[dict]) -> list[tuple]:
    return sorted({(c["mode"], c["scope"], c["checksum"], c["recipe"]) for c in comp}, key=config_sort_key)


def summary_table(th: dict) -> str:
    """Recipe x mode: the threshold interval under the paired rule, the published numbers in the last row."""
    rows: dict[tuple, dict] = {}
    for t in th.values():
        if t["applies"]:
            rows.setdefault((t["recipe"], t["scope"], t["checksum"]), {})[t["mode"]] = t
    modes_present = [m for m in MODE_ORDER if any(m in v for v in rows.values())]
    several = len({k[1:] for k in rows}) > 1
    body = [[recipe + (f" ({scope}/{checksum})" if several else "")]
            + [_measured_cell(by_mode[m]) if m in by_mode else "—" for m in modes_present]
            for (recipe, scope, checksum), by_mode in rows.items()]
    body.append(["**paper** (GPT-2 124M)"] + [f"< {ber_text(PUBLISHED_TOLERATED_BER[m])}"
                                               if m in PUBLISHED_TOLERATED_BER else "—" for m in modes_present])
    return _table(["recipe"] + [f"{mode_name(m)}: last passing – first failing BER" for m in modes_present], body)


def _headline(th: dict, setup: str) -> str:
    """Sentence 1: per mode, the default recipe's interval and the most tolerant recipe's, against the paper."""
    parts = []
    for mode in MODE_ORDER:
        ts = [t for t in th.values() if t["mode"] == mode and _has_threshold(t)]
        if not ts:
            continue
        default = next((t for t in ts if t["recipe"] == DEFAULT_RECIPE), ts[0])
        best = max(ts, key=lambda t: (t["max_ok_ber"] or 0.0, t["min_fail_ber"] or math.inf))
        text = f"{mode_name(mode)} {default['recipe']} {_passes_text(default)}"
        if best is not default and (best["max_ok_ber"] or 0) > (default["max_ok_ber"] or 0):
            text += f", while the most tolerant recipe, {best['recipe']}, {_passes_text(best)}"
        pub = PUBLISHED_TOLERATED_BER.get(mode)
        if pub is not None:
            text += f" (paper: < {ber_text(pub)}; {default['recipe']} here is {published_verdict(default) or 'consistent'})"
        parts.append(text)
    return f"Under the paired rule, on {setup}: {'; '.join(parts)}." if parts else ""


def _passes_text(t: dict) -> str:
    ok, fail = t["max_ok_ber"], t["min_fail_ber"]
    if not decided(t):
        return f"has no BER decided yet ({pending_text(t['pending'])})"
    if ok is None:
        return f"fails already at the smallest tested BER, {ber_text(fail)}"
    if fail is None:
        return f"passes every tested BER, up to {ber_text(ok)}"
    return f"passes up to {ber_text(ok)} and fails from {ber_text(fail)}"


SENSITIVITY_NAMED = 4  # the summary names at most this many moving intervals, else counts them


def _sensitivity_sentence(th: dict, tolerance: float) -> str:
    """Sentence 3: how far the intervals move between the smallest and the largest tolerance of the table."""
    ts = [t for t in th.values() if _has_threshold(t)]
    if not ts:
        return ""
    lo, hi = min(SENSITIVITY_TOLERANCES), max(SENSITIVITY_TOLERANCES)
    moved = [t for t in ts if len(set(t["sensitivity"].values())) > 1]
    if not moved:
        return (f"The intervals do not depend on the tolerance: each is the same from {_pct(lo)} to {_pct(hi)} of "
                "the clean eval loss.")
    still = (f"{len(ts) - len(moved)} of {len(ts)} intervals stay put" if len(moved) < len(ts)
             else "No interval stays put")
    if len(moved) > SENSITIVITY_NAMED:  # a one-screen summary: the table under "Thresholds" has them all
        return (f"{still} from {_pct(lo)} to {_pct(hi)} tolerance; the {len(moved)} that move are in the "
                "sensitivity table under \"Thresholds\".")
    words = [f"{_short_name(t)} {interval_text(*t['sensitivity'][lo])} at {_pct(lo)} to "
             f"{interval_text(*t['sensitivity'][hi])} at {_pct(hi)}" for t in moved]
    return f"{still} from {_pct(lo)} to {_pct(hi)} tolerance; moving: {'; '.join(words)}."


def summary_section(rows: list[dict], th: dict, tolerance: float, source: str) -> list[str]:
    """The one-screen summary: the threshold table with the paper's numbers, and three sentences (headline,
    the DDP/PP ordering, the sensitivity to the tolerance). Empty when no config has a threshold to report, or no
    run evaluated (a fault-localisation sweep: the paired rule has nothing to judge)."""
    if not any(t["applies"] for t in th.values()) or not any_eval(rows):
        return []
    first = next((r for r in rows if r.get("model")), {})
    seeds = sorted({r.get("seed") for r in rows if r.get("seed") is not None})
    n_params = first.get("n_params")
    setup = (f"{first.get('model', '?')} GPT-2" + (f" ({n_params:,} parameters)" if isinstance(n_params, int) else "")
             + f", {first.get('steps', '?')} steps, {len(seeds)} seed(s)")
    sizes = dict(sorted({r["model"]: r for r in rows if r.get("model")}.items(),
                        key=lambda kv: kv[1].get("n_params") or 0))  # smallest first, as the table
    if len(sizes) > 1:  # a size ladder: every model, its parameters, steps and seeds
        setup = "; ".join(f"{m} GPT-2" + (f" ({r['n_params']:,} parameters)" if isinstance(r.get("n_params"), int)
                                          else "") + f", {r.get('steps', '?')} steps, "
                          f"{len({x.get('seed') for x in rows if x.get('model') == m})} seed(s)"
                          for m, r in sizes.items())
    out = ["## Summary", "",
           f"Paired rule: per seed, gap = eval loss at the BER - eval loss at BER 0 with the same seed; a BER passes "
           f"when every run made progress and the one-sided {100 * BOUND_LEVEL:g} % upper bound (Student's t) of the mean "
           f"gap is at most {_pct(tolerance)} of the clean eval loss (tolerance: {source}). The threshold lies "
           "between the last passing and the first failing BER.", "", summary_table(reported(th)), ""]
    clean_only = clean_only_line(th)
    out += [clean_only, ""] if clean_only else []
    ladder = ladder_headline(th) if len(sizes) > 1 else None  # a size ladder: the answer is the trend with size
    sentences = [f"On {setup}. {ladder}" if ladder else _headline(th, setup)]
    ords = _orderings(th)
    if ords:
        sentences.append(ordering_summary(ords))
    sentences.append(_sensitivity_sentence(th, tolerance))
    out += [f"- {x}" for x in sentences if x]
    return out + [""]


def any_eval(rows: list[dict]) -> bool:
    """Whether the paired rule has eval losses to judge: false when runs finished but none evaluated (a
    fault-localisation sweep); true when none finished (the report says why there is no threshold)."""
    return any(r.get("final_eval_loss") is not None for r in rows) or not any(is_ok(r) for r in rows)


def one_link_faults(rows: list[dict]) -> bool:
    """An experiment with a `fault:` (docs/locate.md): one link per point carries its BER, the others the
    background. The theory's predictions (weight deviation, lost steps: every link and hop at the point's BER)
    do not describe it, so the report leaves its comparisons with them out."""
    return any(r.get("fault_link") for r in rows)


def _findings(rows, agg: list[dict], th: dict, fits: dict, latency) -> list[str]:
    """The answers users look for first, each a sentence from the sections below."""
    out = ["## Findings", ""]
    if not rows:
        return out + ["- No results: results.jsonl is missing or empty, so there is nothing to report on training.",
                      ""]
    if not any(is_ok(r) for r in rows):
        out.append("- No run finished with status ok: every point crashed, hung, diverged or failed.")
    out += ["- " + threshold_sentence(t) for t in reported(th).values() if any_eval(rows)]
    ords = _orderings(th)
    if ords:
        out += ["- " + ordering_sentence(o) for o in ords] + ["- " + ordering_summary(ords)]
    comp = [] if one_link_faults(rows) else theory_comparison(agg)
    off = [line for line in disagreements(comp, _comp_configs(comp)) if "disagrees" in line]
    if comp:
        out.append("- Theory vs measurement: " + (f"{len(off)} disagreement(s), listed under \"Lost steps, "
                                                   "sanitized and frozen values\"." if off else
                                                   "lost steps, sanitized and frozen values agree with the "
                                                   "theory wherever both exist."))
    off_th = [t for t in th.values() if theory_agreement(t) in ("optimistic", "pessimistic")]
    out += [f"- {_config_name(t)}: the theory's tolerated BER ({_theory_cell(t)}) is more "
            f"{theory_agreement(t)} than the measurement ({_measured_cell(t)})." for t in off_th]
    all_configs = configs(rows)
    out += ["- Weight deviation, " + _slope_sentence(config_label(d["config"], all_configs), d) for d in fits.values()
            if d["fit"] is not None]
    penalties = [p for p in retransmission_penalties(latency) if p["ber"] > 0]
    if penalties:
        out.append(_latency_finding(penalties[-1]))
    return out + [""] if len(out) > 2 else []


def build_markdown(rows: list[dict], agg: list[dict], th: dict, latency: dict | None, exp: dict,
                   drawn: dict, tolerance: float, out_dir: Path, tol_source: str = "",
                   source: str = RESULTS_FILE, missing: dict | None = None) -> str:
    """report.md: the one-screen summary first (a locate experiment's detection table, the threshold table with
    the paper's numbers and three sentences), then the details; a section that does not apply is left out."""
    name = exp.get("name") or next((r.get("experiment") for r in rows if r.get("experiment")), None) or out_dir.name
    faults = one_link_faults(rows)
    fits = {} if faults else deviation_fits(rows)
    md = [f"# Experiment {name}: bit errors in distributed GPT-2 training", ""]
    md += coverage_lines(missing or {}, rows)
    # experiments/paper-regime.yaml: thresholds beside the paper's and the chaos floor lead; [] otherwise
    regime = paper_regime_section(rows, th)
    md += regime
    # experiments with monitored points (docs/locate.md): their detection table and plot lead; [] otherwise
    md += locate_section(rows, _locate_plot_line(rows, out_dir))
    # rows with link profiles (experiments/linklayer.yaml); [] otherwise
    md += linklayer_section(rows, out_dir, exp.get("point_timeout"))
    if faults:
        md += ["One link per faulty point carries its BER, so the theory's predictions (weight deviation, lost "
               "steps: every link at the point's BER) do not apply and their sections are left out.", ""]
    md += summary_section(rows, th, tolerance, tol_source)
    md += _findings(rows, agg, th, fits, latency)
    md += _setup_section(rows, exp, latency, tolerance, tol_source, source)
    md += ["## Results per point", ""]
    if agg:
        evals = any(p["eval_loss_n"] for p in agg)
        md += [("Eval loss, skipped" if evals else "Skipped") + " steps, deviation and divergence are means over the "
               "point's ok runs; bits flipped and realized BER sum over all its runs; step time is the median of its "
               "runs' median step times. " + ("Gap = eval loss - the clean mean of the same mode/scope/checksum "
                                              "(positive = worse; the verdicts use the gaps paired by seed, below). "
                                              if evals else "") +
               "Deviation: L2 distance of the final weights from the clean run of the same seed; replica divergence "
               "(DDP): largest L2 distance of a replica from rank 0.", "",
               key_table(agg), "", f"Full per-run values: [summary.csv]({SUMMARY_FILE}).", "",
               _plot_line("loss_vs_step.png", drawn), ""]
    else:
        md += ["No results: results.jsonl is missing or empty.", ""]
    md += calibration_section(rows)  # points run with both injectors (experiments/calibrate.yaml); [] otherwise
    # size ladder and BER-0 controls (experiments/scaling.yaml); [] otherwise, and where the paper-regime section
    # reads the controls per size, mode and steps
    md += [] if regime else scaling_section(rows, out_dir)
    if any_eval(rows):  # the paired rule judges eval losses: without any (a locate sweep) it has nothing to say
        md += thresholds_section(agg, th, tolerance, tol_source, drawn)
    md += size_threshold_section(th, tolerance, out_dir, rows, exp.get("train"))  # several sizes; [] otherwise
    if fits:
        md += deviation_section(rows, fits)
        md += [_plot_line("deviation_vs_ber.png", drawn), "", _plot_line("divergence_vs_ber.png", drawn), ""]
    if theory_comparison(agg) and not faults:
        md += theory_section(agg, _plot_line("lost_vs_theory.png", drawn))
    if agg:
        md += ["## Step time and skipped updates", "", _plot_line("step_time_vs_ber.png", drawn), "",
               _plot_line("skipped_vs_ber.png", drawn), ""]
    if latency_entries(latency) or exp.get("latency"):
        md += latency_section(latency, _plot_line("latency.png", drawn))
        md += theory_latency_section(latency)
    md += ["## How to reproduce", "",
           f"`testbed run {EXPERIMENT_FILE} --out DIR` (the copy of the experiment file in this directory) runs the "
           "grid and writes results.jsonl and latency.json; `testbed report DIR` (or `python -m "
           "testbed.report.report DIR`) rebuilds summary.csv, the plots and this report from those two files "
           "alone, with the tolerance the rows record.", ""]
    return "\n".join(md)


def thresholds_section(agg: list[dict], th: dict, tolerance: float, tol_source: str, drawn: dict) -> list[str]:
    """The rule, the recipe x mode table, the detail table, the sensitivity table, the paired gaps, a sentence
    per config and the orderings; [] when no config has a threshold question (no run evaluates)."""
    if not agg:
        return ["## Thresholds", "", "No thresholds: no results.", ""]
    if not any(t["applies"] for t in th.values()):
        return []
    md = ["## Thresholds: up to which BER does training match a clean link?", "",
          f"The paired rule, fixed before the run: per seed, gap = eval loss at BER b - eval loss at BER 0 with the "
          f"same seed (same recipe, mode, scope, checksum). BER b passes when every run ended ok with an eval loss "
          f"and made progress (eval loss at least 1 % below the initial one), every seed has its clean run, and the "
          f"one-sided {100 * BOUND_LEVEL:g} % upper bound of the mean gap, mean + t({BOUND_LEVEL:g}, n-1) x sd / sqrt(n) "
          f"(Student's t; one seed has no bound and cannot pass), is at most the tolerance, {_pct(tolerance)} of the "
          f"clean mean eval loss (tolerance: {tol_source}). Student's t rather than a bootstrap: with a handful of seeds a "
          "bootstrap's upper bound never exceeds the largest observed gap. The threshold is the interval between "
          "the last passing BER (every tested BER below it passes too) and the first failing one. Theory: "
          "\"catastrophic from\" is `catastrophic_threshold_ber`, the BER at which one catastrophic fp32 value "
          "(Inf/NaN or > 1e30) is expected per step and rank; \"tolerated up to\" is the recipe's: lost steps "
          "1 - exp(-λ) with λ summed over every rank and hop, and the time shift they cost on the clean loss "
          "curve (docs/theory.md, section 4). Published: DDP fine below 1e-4, PP below 1e-5 (GPT-2 124M); this "
          "experiment's model and step count may differ.", "",
          "Tolerated BER per recipe and mode (measured: last passing – first failing BER; theory: as above; "
          "tokens/step: tokens per optimizer step, equal for both modes when the comparison is fair):", "",
          threshold_matrix(reported(th)), "", thresholds_table(reported(th)), ""]
    clean_only = clean_only_line(th)
    md += [clean_only, ""] if clean_only else []
    if any(_has_threshold(t) for t in th.values()):
        md += ["Sensitivity: the same rule at other tolerances (percent of the clean mean eval loss):", "",
               sensitivity_table(th, tolerance), "", "Paired gaps per BER (nats; positive = worse than clean):", "",
               paired_table(agg, th), ""]
    md += ["- " + threshold_sentence(t) for t in reported(th).values()]
    ords = _orderings(th)
    md += (["- " + ordering_sentence(o) for o in ords] + ["- " + ordering_summary(ords)] if ords else []) + [""]
    return md + [_plot_line("eval_loss_vs_ber.png", drawn), ""]


def write_report(out_dir, rows: list[dict] | None = None, latency: dict | None = None, experiment=None,
                 planned=None) -> Path:
    """Write summary.csv, the plots and report.md into out_dir (rows/latency default to its results.jsonl and
    latency.json, rows to summary.csv when only that was kept; experiment: an Experiment, ExperimentFile or
    dict, default its experiment.yaml; planned: the grid's (point id, recipe, mode) triples, which let the report
    say what is missing: see coverage). The tolerance is the one the rows record (analysis.tolerance_of)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = RESULTS_FILE
    if rows is None:
        rows = load_results(out_dir)
        if not rows and not (out_dir / RESULTS_FILE).exists() and (rows := load_summary_rows(out_dir)):
            source = SUMMARY_FILE
    latency = load_latency(out_dir) if latency is None else latency
    exp = _experiment_info(out_dir, experiment)
    tolerance, tol_source = tolerance_of(rows, finite(exp.get("tolerance")))
    write_summary_csv(rows, out_dir / SUMMARY_FILE)
    agg = aggregate(rows, train=exp.get("train"))
    missing = coverage(rows, planned) if source == RESULTS_FILE else {}
    th = thresholds(agg, tolerance, train=exp.get("train"),
                    pending=pending_points(rows, planned) if source == RESULTS_FILE else None)
    for t in th.values():
        if (t["recipe"], t["mode"]) in missing:
            t["incomplete"] = missing[(t["recipe"], t["mode"])]
    drawn = _draw_plots(out_dir, rows, latency) if source == RESULTS_FILE else _kept_plots(out_dir)
    path = out_dir / REPORT_FILE
    write_atomic(path, build_markdown(rows, agg, th, latency, exp, drawn, tolerance, out_dir, tol_source, source,
                                      missing))
    return path


def _kept_plots(out_dir: Path) -> dict:
    """The plots already in out_dir (rows from summary.csv have no curves to redraw them from)."""
    return {name: out_dir / name for name in PLOT_TITLES if (out_dir / name).exists()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.report.report",
                                description="Rebuild summary.csv, the plots and report.md of an experiment "
                                            "directory from its results.jsonl and latency.json (the verdicts use "
                                            "the tolerance the rows record: the experiment file's "
                                            "`tolerance:`; `testbed report DIR` also says which points of the "
                                            "grid have not run yet).")
    p.add_argument("dir", metavar="DIR")
    args = p.parse_args(argv)
    if not Path(args.dir).is_dir():
        p.error(f"{args.dir}: not a directory")
    print(write_report(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
