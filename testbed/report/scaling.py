"""The report's size-ladder section (experiments/scaling.yaml): lost steps against lambda for every model size,
the measured-vs-predicted table with a verdict per cell, the chaos floor (BER-0 controls beside the BER runs) and
the time per size. The numbers come from testbed/analysis/scaling.py; nothing is written for an experiment
without `ber_at_lambda` points or controls."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from testbed.analysis import scaling
from testbed.analysis.formatting import ber_text, fmt, md_table, mode_name
from testbed.report.plots import plot_lambda_collapse

PLOT_FILE = "lambda_collapse.png"
PLOT_TITLE = "Lost-step fraction vs λ, every model size"

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
                     f"{c['lost']}/{c['steps']}", f"{fmt(c['lost_fraction'])} {_ci(c['lost_ci'])}",
                     fmt(c["predicted_lost"]), _count_interval(c["lost_interval"]), forward,
                     VERDICT_WORDS[c["lost_verdict"]], san])
    return md_table(["model", "parameters", "recipe", "mode", "λ", "BER", "injector", "ok runs", "lost / steps",
                   "lost fraction (95 % CI)", "predicted", "99 % interval of lost steps", "PP: forward share of λ",
                   "verdict", "sanitized per step: measured / predicted"], rows)


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
            f"{c['lost']}/{c['steps']} "
            f"lost against {fmt(c['predicted_lost'])} predicted ({c['lost_verdict']})" for c in off) + ".")
        if pp_fwd:
            out.append("- PP cells below the prediction: the prediction counts a catastrophic activation going "
                       "forward as a lost step, and the next stage's pre-LayerNorm can contain it (docs/theory.md, "
                       "section 4); the column \"forward share\" is the part of λ that arrives forward.")
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


def _plot_line(rows: list[dict], out_dir: Path) -> str:
    try:
        drawn = plot_lambda_collapse(rows, Path(out_dir) / PLOT_FILE)
    except Exception as e:  # noqa: BLE001 - the report of a long run must not be lost to a plot
        traceback.print_exc(file=sys.stderr)
        return f"*{PLOT_TITLE}: the plot could not be drawn ({type(e).__name__}: {e}).*"
    return f"![{PLOT_TITLE}]({PLOT_FILE})" if drawn else f"*{PLOT_TITLE}: not drawn, no cell has lost-step counts.*"


def scaling_section(rows: list[dict], out_dir: Path) -> list[str]:
    """The section's markdown lines (and its plot, into out_dir); [] when the experiment has no lambda points
    and no controls."""
    if not scaling.is_scaling(rows):
        return []
    cells = scaling.lambda_cells(rows)
    plot_line = _plot_line(rows, out_dir) if cells else ""
    md = ["## Size ladder: lost steps against λ for every model size", ""]
    if cells:
        md += ["Each size, mode and recipe ran at the BERs where the theory expects λ catastrophic values per step "
               "on the unprotected fp32 wire (grid `ber_at_lambda`; theory.ber_at_lambda from that size's values "
               "on the wire: DDP 2(N-1) n gradient values, PP (S-1) B T d activations and as many gradients). "
               "Lost steps are pooled over seeds (Clopper-Pearson 95 % interval); the verdict asks whether the "
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
