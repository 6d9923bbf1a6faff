"""The report's section for experiments/paper-regime.yaml: one table, size | mode | recipe | measured threshold
[interval] | paper | chaos floor ratio, then the cheapest recipe that reaches the paper's BERs, thresholds against
rank count with their fit, and the 10x-long runs (the statistics: testbed/analysis/regime.py)."""

from __future__ import annotations

import math

from testbed.analysis import regime, scaling
from testbed.analysis.analysis import pending_text
from testbed.analysis.formatting import ber_text, fmt, fmt_signed, md_table, mode_name
from testbed.analysis.results import finite
from testbed.report.scaling import range_text


def _interval(e: dict) -> str:
    if e["max_ok"] is None and e["min_fail"] is None:
        return f"pending: {pending_text(e['pending'])}"
    text = range_text(e["max_ok"] or 0.0, e["min_fail"] if e["min_fail"] is not None else math.inf)
    text += " (non-monotonic)" if e["non_monotonic"] else ""
    text += f"; pending: {pending_text(e['pending'])}" if e.get("pending") else ""
    return text + (" (provisional: {} of {} points)".format(*e["incomplete"]) if e.get("incomplete") else "")


def _ratio(e: dict) -> str:
    if e["floor"] is None:
        return "— (no controls)"
    if e["floor_ratio"] is None:
        return f"— (floor {fmt(e['floor'])})"
    return f"{fmt(e['floor_ratio'])}x (floor {fmt(e['floor'])})"


def _clean_cell(c: dict | None) -> str:
    if c is None:
        return "—"
    n = len(c["gaps"])
    if not any(c["gaps"].values()):
        return f"0 (the same runs, {n} seed{'s' if n > 1 else ''})"
    text = fmt_signed(c["mean"]) + (f" (bound {fmt_signed(c['upper'])})" if c["upper"] is not None else "")
    return text + {"within tolerance": "", "fails": ": **fails**", "undecided": f" ({n} seed: undecided)"}[c["verdict"]]


def _prediction(p: dict | None) -> str:
    if not p or p.get("ber") is None:
        return "—"
    t = p.get("t")
    return f"{ber_text(p['ber'])}" + (f" (95 % t [{ber_text(t[0])}, {ber_text(t[1])}])" if t else "")


def _theory(p: dict) -> str:
    v = p.get("theory_ber")
    return f" (theory ≤ {ber_text(v)})" if v is not None and 0 < v < math.inf else ""


def _slope_cell(f: dict) -> str:
    fit, rng = f.get("fit"), f.get("slope_range")
    ls = f"{fit['slope']:+.2f}" if fit else "—"
    return ls + (f"; every line [{rng[0]:+.2f}, {rng[1]:+.2f}]" if rng else "; no power law fits every interval")


def paper_regime_section(rows: list[dict], th: dict[str, dict]) -> list[str]:
    """[] unless the rows hold BER-0 controls beside paired-rule thresholds (and no lambda grid: scaling.yaml's
    controls have their own section)."""
    if not regime.has_controls(rows) or any(finite(r.get("ber_at_lambda")) is not None for r in rows):
        return []
    table = regime.regime_table(rows, th)
    if not table:
        return []
    md = ["## Where the published thresholds hold", "",
          "Paired rule at the registered tolerance (last passing – first failing BER); paper: the published "
          "analysis of GPT-2 124M (DDP < 1e-4, PP < 1e-5). Chaos floor ratio: the smallest final weight deviation "
          "among the runs at the last passing BER over the largest deviation of the BER-0 controls (one weight's "
          "mantissa LSB after step 1, the batch order reversed) of the same size, mode and steps; at most 1x the "
          "verdict is \"indistinguishable\" (the link's effect there cannot be told from a one-bit perturbation), "
          "not \"tolerated\". Clean vs default: the recipe's clean runs (BER 0) against the default recipe's of "
          "the same seeds, by the paired rule (mean eval-loss gap, its one-sided 95 % t bound): a recipe's "
          "threshold is measured against its own clean runs, so one whose clean runs fail here costs training "
          "without any error and is never named cheapest. 124M: beside it the size fit's prediction from "
          "tiny/small/mini (the README's).", ""]
    md += md_table(["size", "mode", "recipe", "steps", "seeds", "measured threshold [interval]", "paper",
                    "chaos floor ratio", "verdict", "clean vs default", "predicted (size fit)"],
                   [[e["model"], mode_name(e["mode"]), e["label"], str(e["steps"]), str(e["seeds"]), _interval(e),
                     f"< {ber_text(e['paper'])}", _ratio(e), e["verdict"], _clean_cell(e["clean_cost"]),
                     _prediction(e["prediction"])]
                    for e in table]) + [""]
    single = regime.one_seed(th)
    if single:
        md.append("- Not in the table, one seed (the paired rule cannot pass one seed, so no threshold): "
                  + ", ".join(f"{s['model']} {mode_name(s['mode'])} {s['recipe']}" for s in single)
                  + " (where both injectors ran a point, the section \"Calibration\" compares them).")
    for e in table:
        check = regime.fit_check(e)
        if check:
            md.append(f"- {e['model']} {mode_name(e['mode'])} {e['label']}: measured {_interval(e)} against the "
                      f"size fit's {_prediction(e['prediction'])}: " + {
                          "inside": "the measurement lies inside the prediction's interval",
                          "above": "the measurement lies above the prediction's interval (the fit was too "
                                   "pessimistic)",
                          "below": "the measurement lies below the prediction's interval (the fit was too "
                                   "optimistic)"}[check] + ".")
    for e in table:
        c = e["clean_cost"]
        if c and (c["verdict"] == "fails" or c["verdict"] == "undecided" and c["mean"] > c["tolerance"]):
            gaps = ", ".join(f"seed {s} {fmt_signed(g)}" for s, g in c["gaps"].items())
            md.append(f"- {e['model']} {mode_name(e['mode'])} {e['label']}: its clean runs train worse than the "
                      f"default recipe's without any error ({gaps}; tolerance {fmt(c['tolerance'])}): "
                      + ("the bound exceeds the tolerance, so it is never named cheapest."
                         if c["verdict"] == "fails" else
                         "one paired seed has no bound; its other clean seeds decide it."))
    for c in regime.cheapest(table):
        pub = ber_text(c["paper"])
        tried = [x + (" (clean runs fail against the default's)" if x in c["costly"] else "") for x in c["tried"]]
        tried += [f"{x} (provisional, not counted)" for x in c["provisional"]]
        if c["cheapest"]:
            e = c["cheapest"]
            md.append(f"- {c['model']} {mode_name(c['mode'])}: the cheapest recipe that reaches the paper's "
                      f"{pub} is **{e['label']}** (last passing {ber_text(e['max_ok'])}; {e['verdict']}, floor "
                      f"ratio {_ratio(e)}); tried, cheapest first: {', '.join(tried)}.")
        else:
            md.append(f"- {c['model']} {mode_name(c['mode'])}: no recipe tried reaches the paper's {pub} "
                      f"({', '.join(tried)}).")
    md.append("")
    fits = regime.rank_fits(th)
    if fits:
        md += ["### Thresholds against rank count", "",
               "The same recipe on 2 hosts (pair), 4 (DDP ring4, PP chain4) and 8 (DDP ring8), at the same tokens "
               "per step: slope of log10 threshold against log10 ranks, least squares through the two-sided "
               "intervals' midpoints and the slopes of every line through every interval; theory: the slope of "
               "its BER at fixed λ (a DDP ring of N moves 2 (N - 1) chunks of the gradient a step; PP's hops grow "
               "with the stage boundaries).", ""]
        md += md_table(["size", "mode", "recipe", "thresholds by ranks", "slope (measured)", "theory slope",
                        "verdict"],
                       [[f["model"], mode_name(f["mode"]), f["label"],
                         "; ".join(f"{p['ranks']}: {range_text(*p['interval'])}" + _theory(p) for p in f["points"]),
                         _slope_cell(f), f"{f['theory_slope']:+.2f}" if f["theory_slope"] is not None else "—",
                         f["verdict"] or "—"] for f in fits]) + [""]
    longs = regime.long_runs(rows)
    if longs:
        md += ["### 10x longer at the threshold BER", "",
               "Per seed, gap = eval loss of the long run at the BER - its clean run's at the same step; the "
               "change of the gap from the evaluation after 300 steps to the last (two-sided 95 % t "
               "over seeds): grows or closes when the interval excludes 0, else stays.", ""]
        rows_md = []
        for e in longs:
            at = {c["step"]: c for c in e["curve"]}
            first = e["change"]["from"] if e["change"] else None
            last = e["curve"][-1] if e["curve"] else None
            ch = e["change"]
            rows_md.append([e["model"], mode_name(e["mode"]), ber_text(e["ber"]), str(len(e["seeds"])),
                            (f"{fmt_signed(at[first]['mean'])} (bound {fmt_signed(at[first]['upper'])}, tol "
                             f"{fmt(at[first]['tolerance'])})" if first in at else "—"),
                            (f"{fmt_signed(last['mean'])} (bound {fmt_signed(last['upper'])}, tol "
                             f"{fmt(last['tolerance'])})" if last else "—"),
                            (f"{fmt_signed(ch['mean'])} [{fmt_signed(ch['ci'][0])}, {fmt_signed(ch['ci'][1])}]: "
                             f"**{ch['verdict']}**" if ch else "—"),
                            f"{fmt(e['floor_ratio'])}x" if e["floor_ratio"] is not None else "—"])
        md += md_table(["size", "mode", "BER", "seeds", "gap after 300 steps", "gap at the end", "change",
                        "floor ratio"],
                       rows_md) + [""]
    times = [e for e in scaling.time_per_size(rows, by=("model", "mode", "steps", "world_size")) if e["timed"]]
    if times:
        md += ["### Wall time of the runs", "",
               "Per size, mode, steps and ranks: the points whose rows are here (reused rows as they ran), the sum "
               "of their wall times and the median per point, on the machine that ran them (each row's `machine`).",
               ""]
        md += md_table(["size", "mode", "steps", "ranks", "points", "wall time", "median per point"],
                       [[e["model"], mode_name(e["mode"]), str(e["steps"]), str(e["world_size"]), str(e["timed"]),
                         _duration(e["wall_time_s"]), _duration(e["median_wall_time_s"])] for e in times]) + [""]
    return md


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"
