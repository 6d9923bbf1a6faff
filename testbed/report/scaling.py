"""The report's size-ladder sections. experiments/scaling.yaml: lost steps against lambda for every model size,
the measured-vs-predicted table with a verdict per cell, the chaos floor (BER-0 controls beside the BER runs) and
the time per size (numbers from testbed/analysis/scaling.py; nothing is written for an experiment without
`ber_at_lambda` points or controls). experiments/thresholds.yaml: the paired-rule thresholds of every size, the
log-log slope of threshold against parameters beside the theory's, and the GPT-2 124M prediction beside the
published figures (numbers from testbed/analysis/sizefit.py; nothing is written unless one recipe has thresholds
at two sizes or more)."""

from __future__ import annotations

from pathlib import Path

import math

from testbed.analysis import scaling, sizefit
from testbed.analysis.analysis import PUBLISHED_TOLERATED_BER, SENSITIVITY_TOLERANCES
from testbed.analysis.formatting import ber_text, fmt, md_table, mode_name
from testbed.report.plots import plot_lambda_collapse, plot_or_sentence, plot_size_thresholds

PLOT_FILE = "lambda_collapse.png"
PLOT_TITLE = "Lost-step fraction vs λ, every model size"
SIZE_PLOT_FILE = "threshold_vs_size.png"
SIZE_PLOT_TITLE = "Threshold BER vs parameters, with the fit, the theory and the 124M prediction"

VERDICT_WORDS = {"agrees": "agrees", "above": "**above**", "below": "**below**", None: "—"}


def _ci(ci) -> str:
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "—"


def _count_interval(iv) -> str:
    return f"{iv[0]}–{iv[1]}" if iv else "—"


def lambda_table(cells: list[dict]) -> list[str]:
    rows = []
    for c in cells:
        pred = c["prediction"]
        forward = (f"{fmt(pred.lost_forward / pred.lost)}" if pred is not None and c["mode"] == "pp" and pred.lost
                   else "—")
        san = (f"{fmt(c['sanitized'] / c['sanitized_steps'])} / {fmt(c['predicted_sanitized'])} "
               f"({VERDICT_WORDS[c['sanitized_verdict']]})" if c["sanitized_steps"] and c["predicted_sanitized"]
               is not None else "—")
        rows.append([c["model"], f"{c['n_params']:,}" if c["n_params"] else "—", c["recipe"], mode_name(c["mode"]),
                     fmt(c["lambda_target"]), ber_text(c["ber"]), c["injector"] or "—", f"{c['ok']}/{c['runs']}",
                     f"{c['lost']}/{c['steps']}" + (" ‡" if c["shared_flips"] else ""),
                     f"{fmt(c['lost_fraction'])} {_ci(c['lost_ci'])}",
                     fmt(c["predicted_lost"]), _count_interval(c["lost_interval"]), forward,
                     VERDICT_WORDS[c["lost_verdict"]], san])
    return md_table(["model", "parameters", "recipe", "mode", "λ", "BER", "injector", "ok runs", "lost / steps",
                   "lost fraction (95 % CI)", "predicted", "99 % interval of lost steps", "PP: forward share of λ",
                   "verdict", "sanitized per step: measured / predicted"], rows)


def _backward_bracket(cells: list[dict]) -> str:
    """Whether PP cells below the prediction lie between its two ends: every catastrophic value lost (the
    prediction, 1 - exp(-λ)) and only the backward ones (1 - exp(-λ (1 - forward share))): each count against
    the lower end of the 99 % interval of the second and the upper end of the first's."""
    inside, contained = [], []
    for c in cells:
        pred = c["prediction"]
        lam_back = pred.lost - pred.lost_forward
        lo, _ = scaling.binomial_interval(c["steps"], pred.p_step_lost_backward)
        inside.append(lo <= c["lost"] <= c["lost_interval"][1])
        if pred.lost_forward and c["lost"] < c["steps"]:  # the measured λ, -ln(1 - fraction), split as predicted
            lam_measured = -math.log1p(-c["lost"] / c["steps"])
            contained.append(min(1.0, max(0.0, 1 - (lam_measured - lam_back) / pred.lost_forward)))
    text = (f"{sum(inside)} of these {len(cells)} cells lie between the backward-only prediction, "
            "1 - exp(-λ (1 - forward share)) (every forward catastrophic value contained), and the full one (the "
            "count at least the lower end of the first's 99 % interval)"
            + ("" if all(inside) else "; the others are below even the backward-only prediction"))
    if contained:
        text += (f". Read as the share of forward catastrophic values contained (measured λ = -ln(1 - lost "
                 f"fraction), less the backward part): {fmt(min(contained))} to {fmt(max(contained))}")
    return text + "."


def _disagreement_lines(summary: dict) -> list[str]:
    if not summary["judged"]:
        return ["- No cell has both lost-step counts and a prediction."]
    out = [f"- {summary['agree']} of {summary['judged']} cells agree with the theory (the measured lost-step count "
           "inside the central 99 % interval of the predicted binomial)."]
    off = summary["disagree"]
    if off:
        pp_fwd = [c for c in off if c["mode"] == "pp" and c["lost_verdict"] == "below" and c["kind"] == "default"]
        out.append("- Disagreeing: " + "; ".join(
            f"{c['model']} (recipe {c['recipe']}) {mode_name(c['mode'])} λ {fmt(c['lambda_target'])}: "
            f"{c['lost']}/{c['steps']} " + ("(one draw of the link: its seeds share the flips) " if c["shared_flips"]
                                             else "") +
            f"lost against {fmt(c['predicted_lost'])} predicted ({c['lost_verdict']}; 99 % interval "
            f"{_count_interval(c['lost_interval'])})" for c in off) + ".")
        chance = (1 - scaling.PREDICTION_LEVEL) * summary["judged"]
        out.append(f"- By chance alone, {fmt(chance)} of the {summary['judged']} judged cells are expected outside "
                   f"their {100 * scaling.PREDICTION_LEVEL:g} % interval (each count taken alone).")
        if pp_fwd:
            out.append("- PP cells below the prediction: the prediction counts a catastrophic activation going "
                       "forward as a lost step, and the next stage's pre-LayerNorm can contain it (docs/theory.md, "
                       "section 4); the column \"forward share\" is the part of λ that arrives forward. "
                       + _backward_bracket(pp_fwd))
    return out


def _dev(x) -> str:
    return fmt(x) if x is not None else "—"


def floor_table(floor: list[dict]) -> list[str]:
    out = []
    for e in floor:
        ctl = e["controls"]
        head = (f"**{e['model']}, {mode_name(e['mode'])}** ({e['n_params']:,} parameters): controls at BER 0 "
                if e["n_params"] else f"**{e['model']}, {mode_name(e['mode'])}**: controls at BER 0 ")
        parts = [f"{p} {', '.join(fmt(v) for v in c['values'])}"
                 + (f" (theory without amplification ≤ {fmt(c['bound'])})" if c["bound"] is not None else "")
                 for p, c in sorted(ctl.items())]
        out.append(head + ("; ".join(parts) if parts else "none ran") + ".")
        out.append("")
        rows = [[e2["kind"], fmt(e2["lambda"]), ber_text(e2["ber"]), str(e2["n"]), _dev(e2["mean"]),
                 _dev(e2["theory"]), (f"{fmt(e2['vs_floor'])}x" if e2["vs_floor"] is not None else "—"),
                 ("yes" if e2["distinguishable"] else "no") if e2["distinguishable"] is not None else "—"]
                for e2 in e["ber_runs"]]
        if rows:
            out += md_table(["recipe", "λ", "BER", "runs", "deviation (mean)", "theory (noise_deviation)",
                           "smallest run / largest control", "above every control"], rows)
            out.append("")
    return out


def _floor_sentences(floor: list[dict]) -> list[str]:
    out = []
    for e in floor:
        if e["floor"] is None:
            continue
        where = {k: scaling.first_distinguishable(e, k) for k in ("default", "protect", "sanitize")}
        said = "; ".join(f"{k} from λ {fmt(v['lambda'])} (BER {ber_text(v['ber'])})" if v else f"{k} at no λ tested"
                         for k, v in where.items() if any(x["kind"] == k for x in e["ber_runs"]))
        zero = [p for p, c in e["controls"].items() if c["values"] and max(c["values"]) == 0]
        slopes = ", ".join(f"{k} {fmt(v)}" for k, v in e.get("slopes", {}).items())
        out.append(f"- {e['model']} {mode_name(e['mode'])}: the largest control deviation is {fmt(e['floor'])}"
                   + (f" ({', '.join(zero)}: bit-identical to the clean run, the flip never reached the weights)"
                      if zero else "") + (f"; every run deviates more than every control: {said}" if said else "")
                   + (f"; log-log slope of deviation against BER: {slopes} (bounded noise without amplification: "
                      "1/2)." if slopes else "."))
    return out


def time_table(times: list[dict]) -> list[str]:
    rows = [[t["model"], mode_name(t["mode"]), str(t["points"]), _dev(t["median_step_time_s"]),
             _dev(t["wall_time_s"]), ", ".join(t["injectors"])] for t in times]
    return md_table(["model", "mode", "points", "median step time (s)", "training wall time, all points (s)",
                   "injector"], rows)


def scaling_section(rows: list[dict], out_dir: Path) -> list[str]:
    """The section's markdown lines (and its plot, into out_dir); [] when the experiment has no lambda points
    and no controls."""
    if not scaling.is_scaling(rows):
        return []
    cells = scaling.lambda_cells(rows)
    plot_line = (plot_or_sentence(plot_lambda_collapse, rows, out_dir, PLOT_FILE, PLOT_TITLE,
                            "no cell has lost-step counts") if cells else "")
    md = ["## Size ladder: lost steps against λ for every model size", ""]
    if cells:
        # Say how seeds were pooled in the terms of this run: the ‡ convention only where a cell uses it.
        pooling = "Lost steps are pooled over seeds (Clopper-Pearson 95 % interval)" + (
            ", except where the seeds drew the same flips (‡: wire points at `link_seed: topology`, whose engines "
            "are seeded by the topology's link seeds, not the run seed; the seeds' counts differ only where a flip "
            "lands on another value): there a cell counts one run's worth of trials, the mean of its seeds' counts."
            if any(c["shared_flips"] for c in cells) else
            ": each seed drew its own flips (the process injector mixes the run seed in, and so does the wire at "
            "`link_seed: run`; docs/experiments.md, \"What a seed varies\").")
        md += ["Each size, mode and recipe ran at the BERs where the theory expects λ catastrophic values per step "
               "on the unprotected fp32 wire (grid `ber_at_lambda`; theory.ber_at_lambda from that size's values "
               "on the wire: DDP 2(N-1) n gradient values, PP (S-1) B T d activations and as many gradients). "
               + pooling + " The verdict asks whether the "
               "measured count lies inside the central 99 % interval of Binomial(steps, the recipe's predicted "
               "P(step lost)) (protect and sanitize: 0, so any lost step is **above**). Sanitized values per "
               "step: the count against the 99 % interval of Poisson(steps x the predicted rate).", "", plot_line,
               ""]
        md += lambda_table(cells) + [""]
        md += _disagreement_lines(scaling.lambda_summary(cells)) + [""]
    floor = scaling.chaos_floor(rows)
    if any(e["controls"] for e in floor):
        md += ["### The chaos floor: BER-0 controls beside the BER runs", "",
               "Final weight deviation (L2 distance from the clean run of the same seed; exact from saved "
               "parameters below 50M parameters, else the last step's sampled estimate). Controls, each against "
               "the unperturbed clean run: `lsb` flips the mantissa LSB of one gradient value at step 1, "
               "`weight-lsb` that bit of one weight after step 1, `order` reverses every batch's sequence order "
               "(docs/training.md). Theory: `noise_deviation` (docs/theory.md, section 4) for the BER runs, and "
               "for one flipped LSB its own size without amplification (a gradient: D lr 2^-23, a weight: "
               "2^-23 |w| <= 2^-23). \"Above every control\": the smallest deviation of the cell's runs exceeds the "
               "largest control's (few seeds: an indication, not a test).", ""]
        md += floor_table(floor)
        md += _floor_sentences(floor) + [""]
    md += ["### Time per size", "", *time_table(scaling.time_per_size(rows)), ""]
    return md


# ---------------------------------------------------------------------------------------------------------------
# Thresholds against model size (experiments/thresholds.yaml)
# ---------------------------------------------------------------------------------------------------------------

def range_text(lo: float | None, hi: float | None) -> str:
    """A BER interval: '[1e-09, 3e-08]', '< 3e-08' (no lower end), '≥ 1e-09' (no upper end), 'any' (neither)."""
    if lo is None or hi is None:
        return "—"
    if lo <= 0 and math.isinf(hi):
        return "unbounded"
    if lo <= 0:
        return f"< {ber_text(hi)}"
    if math.isinf(hi):
        return f"≥ {ber_text(lo)}"
    return f"[{ber_text(lo)}, {ber_text(hi)}]"


def _interval_cell(iv: tuple[float, float] | None) -> str:
    """The measured threshold as report.py writes it: '1e-06 – 3e-06', '< 1e-06', '≥ 1e-04'."""
    if iv is None:
        return "no threshold"
    lo, hi = iv
    if lo > 0 and math.isfinite(hi):
        return f"{ber_text(lo)} – {ber_text(hi)}"
    return f"< {ber_text(hi)}" if lo <= 0 else f"≥ {ber_text(lo)}"


def _slope_text(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}"


def _slope_interval(iv) -> str:
    if iv is None:
        return "—"
    lo, hi = iv
    return f"[{_slope_text(lo) if math.isfinite(lo) else '-inf'}, {_slope_text(hi) if math.isfinite(hi) else 'inf'}]"


def size_threshold_table(fits: list[dict], tolerance: float) -> list[str]:
    """Per family and size: the interval at the registered tolerance and at each sensitivity tolerance, and the
    theory's tolerated BER."""
    tols = sorted({*SENSITIVITY_TOLERANCES, tolerance})
    rows = []
    for f in fits:
        for s in f["sizes"]:
            t = s["threshold"]
            sens = [_interval_cell(sizefit.interval_of(*t["sensitivity"][tol])) if tol in t.get("sensitivity", {})
                    else "—" for tol in tols]
            theory_cell = (ber_text(s["theory_ber"]) if s["theory_ber"] else
                           "any (no lost steps)" if s["theory_none"] else "—")
            rows.append([f["label"], s["recipe"], s["model"] or "—", f"{s['n_params']:,}", fmt(s["steps"]),
                         fmt(s["seeds"]), _interval_cell(s["interval"])
                         + (" (non-monotonic)" if s["non_monotonic"] else ""), *sens, theory_cell])
    return md_table(["recipe, mode", "recipe name", "model", "parameters", "steps", "seeds",
                     f"threshold at {100 * tolerance:g} % (registered)"]
                    + [f"{100 * tol:g} %" for tol in tols] + ["theory: tolerated up to"], rows)


def size_fit_table(fits: list[dict]) -> list[str]:
    rows = []
    for f in fits:
        fit = f["fit"]
        ls = (f"{_slope_text(fit['slope'])} {_slope_interval(fit['slope_ci'])}" if fit and fit["slope_ci"]
              else f"{_slope_text(fit['slope'])} (no interval: {fit['n']} two-sided)" if fit
              else f"— ({f['n_two_sided']} two-sided interval(s))")
        theory = (f"{_slope_text(f['theory_slope'])}" + (" (at fixed λ)" if f["theory_basis"] == "lambda" else "")
                  if f["theory_slope"] is not None else
                  "none: no lost steps predicted" if f["no_lost_steps"] else "—")
        rows.append([f["label"], ", ".join(s["model"] or "?" for s in f["sizes"]), ls,
                     _slope_interval(f["slope_range"]) if f["slope_range"]
                     else "none: no power law fits every interval",
                     theory, _slope_text(f["lambda_slope"]), f["verdict"] or "—"])
    return md_table(["recipe, mode", "sizes", "least squares on midpoints [95 % t]",
                     "slopes consistent with every interval", "theory slope", "theory at fixed λ",
                     "measured vs theory"], rows)


# the verdict says how the measured slope stands to the theory's ("steeper": the measured thresholds fall faster)
SLOPE_VERDICT_TEXT = {"steeper": "the measured thresholds fall faster with size than the theory's (steeper)",
                      "shallower": "the measured thresholds fall more slowly with size than the theory's (shallower)",
                      "consistent": "consistent with every measured interval"}


def prediction_table(fits: list[dict]) -> list[str]:
    rows = []
    for f in fits:
        p = f["prediction_ber"]
        pub = PUBLISHED_TOLERATED_BER.get(f["family"]["mode"])
        rows.append([f["label"], ber_text(p["ber"]) if p["ber"] is not None else "—",
                     range_text(*p["range"]) if p["range"] else "none (no line fits every interval)",
                     range_text(*p["t"]) if p["t"] else "—",
                     ber_text(p["theory"]) if p["theory"] else ("any (no lost steps)" if f["no_lost_steps"] else "—"),
                     f"< {ber_text(pub)}" if pub is not None else "—"])
    return md_table(["recipe, mode", "124M: fitted", "every line through every interval", "95 % t prediction",
                     "theory", "paper (GPT-2 124M)"], rows)


def sensitivity_fit_table(th: dict, tolerance: float) -> list[str]:
    tols = sorted({*SENSITIVITY_TOLERANCES, tolerance})
    by_tol = sizefit.sensitivity_fits(th, tols)
    labels = list(dict.fromkeys(lbl for fits in by_tol.values() for lbl in fits))
    rows = []
    for label in labels:
        cells = []
        for tol in tols:
            f = by_tol[tol].get(label)
            cells.append("—" if f is None else
                         f"{_slope_text(f['fit']['slope']) if f['fit'] else '—'} "
                         f"{_slope_interval(f['slope_range']) if f['slope_range'] else '(no power law)'}")
        rows.append([label] + cells)
    return md_table(["recipe, mode"] + [f"{100 * t:g} %" + (" (registered)" if t == tolerance else "") for t in tols],
                    rows)


def _fit_sentence(f: dict) -> str:
    fit, rng, pred = f["fit"], f["slope_range"], f["prediction_ber"]
    parts = [f"**{f['label']}**"]
    if fit is not None:
        parts.append(f"threshold ∝ parameters^{_slope_text(fit['slope'])} (least squares through "
                     f"{fit['n']} midpoints" + (f", 95 % t interval {_slope_interval(fit['slope_ci'])} with "
                                                f"{fit['df']} degree(s) of freedom" if fit["slope_ci"] else "") + ")")
    else:
        parts.append(f"no least-squares slope ({f['n_two_sided']} two-sided interval(s) of {f['n']})")
    parts.append(f"slopes consistent with every interval {_slope_interval(rng)}" if rng else
                 "no power law passes through every interval")
    if f["theory_slope"] is not None:
        basis = " at fixed λ" if f["theory_basis"] == "lambda" else ""
        verdict = SLOPE_VERDICT_TEXT.get(f["verdict"], f["verdict"])
        parts.append(f"theory {_slope_text(f['theory_slope'])}{basis}: {verdict}")
    elif f["no_lost_steps"]:
        parts.append("the theory predicts no lost steps for this recipe, so it has no threshold and no slope")
    pub = PUBLISHED_TOLERATED_BER.get(f["family"]["mode"])
    pred_text = (f"{ber_text(pred['ber'])}" if pred["ber"] is not None else "no fitted value")
    pred_text += (f", every line through every interval gives {range_text(*pred['range'])}" if pred["range"] else "")
    parts.append(f"at GPT-2 124M: {pred_text}" + (f" (theory {ber_text(pred['theory'])})" if pred["theory"] else "")
                 + (f"; paper < {ber_text(pub)}" if pub is not None else ""))
    text = f"{parts[0]}: " + "; ".join(parts[1:]) + "."
    if f["differs"]:
        text += " Caution: the sizes differ in " + ", ".join(f"{k} ({'/'.join(map(fmt, v))})"
                                                             for k, v in f["differs"].items()) + "."
    return text




def _complete(th: dict) -> dict:
    """The thresholds of complete recipes and modes: a provisional one (an incomplete grid's) is not in the fit."""
    return {k: t for k, t in th.items() if not t.get("incomplete")}


def ladder_headline(th: dict) -> str | None:
    """The summary's first sentence for a size ladder: per recipe kind and mode, the interval at each size,
    smallest first, and the fitted 124M value with its every-line range beside the paper's number; None when no
    recipe has thresholds at two sizes (provisional ones, of an incomplete grid, are left out as in the fit)."""
    fits = sizefit.size_fits(_complete(th))
    if not fits:
        return None
    parts = []
    for f in fits:
        sizes = ", ".join(f"{s['model']} {_interval_cell(s['interval'])}" for s in f["sizes"])
        p, pub = f["prediction_ber"], PUBLISHED_TOLERATED_BER.get(f["family"]["mode"])
        pred = "" if p["ber"] is None else f"; 124M {ber_text(p['ber'])}" + (
            f" (every line {range_text(*p['range'])})" if p["range"] else "")
        parts.append(f"{f['label']}: {sizes}{pred}" + (f" (paper: < {ber_text(pub)})" if pub is not None else ""))
    return ("Threshold per size (last passing – first failing BER), and GPT-2 124M extrapolated by the size fit "
            "(section \"Thresholds against model size\"): " + "; ".join(parts) + ".")


def size_threshold_section(th: dict, tolerance: float, out_dir: Path, rows: list[dict] | None = None,
                           train: dict | None = None) -> list[str]:
    """The section's markdown lines (and its plot, into out_dir); [] unless a recipe has thresholds at two sizes
    or more (analysis.thresholds output `th`, at the registered `tolerance`). With the `rows` (and the
    experiment's `train:`), a ladder whose sizes ran different seeds is refitted on the seeds they share."""
    left_out = set(th) - set(_complete(th))
    th = _complete(th)
    fits = sizefit.size_fits(th)
    if not fits:
        return []
    md = ["## Thresholds against model size, and the GPT-2 124M prediction", "",
          "Each size's threshold is its paired-rule interval (last passing – first failing BER; \"< F\": the "
          "smallest tested BER failed, \"≥ B\": every tested BER passed). The fit is log10 threshold BER against "
          "log10 parameters per recipe and mode: least squares through the geometric midpoints of the two-sided "
          "intervals, with a Student-t interval (n - 2 degrees of freedom; the residual sd, floored by the "
          "midpoints' own spread, interval width / sqrt(12) in log10; with three sizes one degree of freedom, "
          "t = 12.7, so that interval is wide), and the range of slopes of every line that passes through every "
          "interval, one-sided ones included (not a confidence interval: each interval is taken as exact). The "
          "theory's slope fits the theory's tolerated BER of each size (the report's \"theory: tolerated up to\"); "
          "\"at fixed λ\" is the slope of theory.ber_at_lambda (DDP -1, PP by the width at fixed tokens per step). "
          "The 124M value extrapolates the fit; its range is the lowest and highest value at 124M of every line "
          "through every interval, its t interval the prediction interval of one new size. It holds for this "
          "experiment's setup (hosts, tokens per step, steps, lr, tolerance), not the published one's "
          "(testbed/analysis/sizefit.py).", "",
          plot_or_sentence(plot_size_thresholds, fits, out_dir, SIZE_PLOT_FILE, SIZE_PLOT_TITLE, "no fit"), "",
          "Thresholds per size (and at the sensitivity table's tolerances):", "",
          *size_threshold_table(fits, tolerance), "", "The size slope, measured and by the theory:", "",
          *size_fit_table(fits), "", "GPT-2 124M (124,439,808 parameters), predicted from the sizes measured here, "
          "beside the published figures:", "", *prediction_table(fits), "",
          "The slope at each tolerance (least squares; in brackets the slopes consistent with every interval):", "",
          *sensitivity_fit_table(th, tolerance), ""]
    md += [f"- {_fit_sentence(f)}" for f in fits] + [""]
    seeds = sizefit.matched_seeds(rows or [], th)
    if seeds:
        from testbed.analysis.analysis import aggregate, thresholds

        same = [r for r in rows if r.get("seed") in seeds]
        matched = sizefit.size_fits({k: t for k, t in thresholds(aggregate(same, train=train), tolerance,
                                                                  train=train).items() if k not in left_out})
        if matched:
            md += [f"The sizes ran different seeds, and the paired rule's t bound is wider with fewer (t(0.95, n-1): "
                   "2.92 for 3 seeds, 2.13 for 5), so the smaller seed count is a stricter rule. The same fit on "
                   f"the seeds every size ran ({', '.join(map(str, seeds))}):", "",
                   *size_fit_table(matched), "", *prediction_table(matched), ""]
    return md
