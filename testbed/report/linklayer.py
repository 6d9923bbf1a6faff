"""The report's link-layer section (experiments/linklayer.yaml): the decision table, which profile reaches the
target loss soonest for each pre-FEC BER, with the GPT-2 124M column predicted from the size fit; [] when no row
has a link profile. The analysis: testbed/analysis/timetotarget.py; the profiles: testbed/linklayer.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

from testbed import linklayer
from testbed.analysis import timetotarget as ttt
from testbed.analysis.formatting import ber_text as fmt_ber

SLOPE_FILE = "delay_slope.json"  # benchmarks/bench_delay_slope.py --out DIR/delay_slope.json
SIZEFIT_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "thresholds" / "results.jsonl"


def load_slopes(out_dir: Path) -> dict:
    """{mode: {slope, slope_ci, topology, ...}} from the experiment directory's delay_slope.json, {} if none."""
    try:
        d = json.loads((Path(out_dir) / SLOPE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    # a slope whose interval holds 0 (`resolved: false`, benchmarks/bench_delay_slope.py) says nothing to model with
    return {m: v for m, v in (d.get("slopes") or {}).items()
            if isinstance(v, dict) and v.get("slope") is not None and v.get("resolved", True) is not False}


def predictions_124m(path: Path = SIZEFIT_RESULTS) -> dict:
    """{mode: {ber, t}}: the delivered BER GPT-2 124M tolerates under the default recipe, predicted by the size fit
    of the published thresholds (docs/results/thresholds); {} when they are not there."""
    from testbed.analysis.analysis import aggregate, thresholds, tolerance_of
    from testbed.analysis.sizefit import size_fits
    from testbed.fileio import read_jsonl

    rows = read_jsonl(path)
    if not rows:
        return {}
    tol, _ = tolerance_of(rows)
    th = thresholds(aggregate(rows), tol)
    out = {}
    for fit in size_fits(th, tolerance=tol):
        fam = fit["family"]
        if fam["kind"] != "default" or (fam["scope"], fam["checksum"]) != ("tensor", "fix"):
            continue
        pred = fit["prediction_ber"]
        if pred["ber"] is not None:
            out.setdefault(fam["mode"], {"ber": pred["ber"], "t": pred["t"], "label": fit["label"]})
    return out


def _steps(v) -> str:
    return "-" if v is None else f"{v:g}"


def _wall(v) -> str:
    if v is None:
        return "-"
    return "∞" if not math.isfinite(v) else f"{v:.1f} s" if v < 1e4 else f"{v:.2g} s"


def _latency(v: float) -> str:
    """A per-hop latency in ns up to 100 µs, then in seconds."""
    if not math.isfinite(v):
        return "∞"
    return f"{v * 1e9:,.0f} ns" if v < 1e-4 else f"{v:.2g} s"


def _names(profiles: tuple) -> str:
    return " = ".join(profiles) + (" (tie)" if len(profiles) > 1 else "") if profiles else ""


def _verdict_124m(e: dict, pred: dict | None) -> str:
    """Predicted for GPT-2 124M (default recipe): the profile's delivered BER (the model's) against the size fit's
    tolerated BER and its t interval."""
    prof = linklayer.profile(e["profile"])
    if prof.kind == "retry" or (prof.kind == "fec" and prof.on_failure == "drop"):
        lost = linklayer.frame_drop_probability(prof, e["pre_fec_ber"], 1500 * 8)
        what = "replayed" if prof.kind == "retry" else "dropped"
        return f"no errors delivered; {lost:.2g} of 1500-B frames {what}"
    if pred is None:
        return "no size fit"
    delivered = linklayer.delivered_ber(prof, e["pre_fec_ber"])
    lo, hi = pred["t"] or (pred["ber"], pred["ber"])
    if delivered <= 0 or delivered < lo:
        word = "tolerated"
    elif delivered > hi:
        word = "not tolerated"
    else:
        word = "inside the prediction's interval"
    return f"{word} (delivers {fmt_ber(delivered) if delivered else '0'}; fit {fmt_ber(pred['ber'])})"


def linklayer_section(rows: list[dict], out_dir: Path, point_timeout: float | None = None) -> list[str]:
    """The section's lines; `point_timeout`: the experiment's (a modelled wall past it is a link down in effect)."""
    if not any(r.get("profile") for r in rows):
        return []
    slopes = load_slopes(out_dir)
    timeout = float(point_timeout) if isinstance(point_timeout, (int, float)) and point_timeout > 0 else None
    table = ttt.decision_table(rows, {m: v["slope"] for m, v in slopes.items()}, timeout)
    win_meas = ttt.winners(table, "wall_measured_s")
    win_mod = ttt.winners(table, "wall_modelled_s")
    preds = predictions_124m()
    from testbed.report import plots

    plot = plots.plot_or_sentence(plots.plot_wall_to_target, table, out_dir, "wall_to_target.png",
                                  "Wall time to the target loss vs pre-FEC BER, per link profile", "no point reached "
                                  "the target")
    md = ["## Choosing a link layer: time to the target loss", "",
          "For each physical link's pre-FEC BER, the profile that reaches the target (the clean run's final eval loss "
          "+ the paired rule's tolerance) soonest in wall time. Steps and wall times: medians over the seeds, given "
          "only when every seed reached the target. **Measured**: this machine's step times summed to the target "
          "(the emulator's own per-packet costs included). **Modelled**: the raw link's clean step time plus the "
          "profile's per-hop latency times the measured slope of step time against per-hop delay, plus the raw "
          "link's clean communication time stretched by 1/goodput - 1 (link-level retry's go-back-N replays: "
          "every errored 1500-B frame costs its replay round trip of link time at 100 Gb/s), plus what the "
          "errors cost the point over its own clean run (testbed/analysis/timetotarget.py). A modelled wall past "
          "the point timeout" + (f" ({timeout:g} s)" if timeout else "") + " is a link that is down in effect "
          "and wins nothing. **Fastest**: the least median wall; a profile whose seeds' range overlaps the "
          "fastest one's ties with it (3 seeds cannot order them). The 124M column is "
          "**predicted**, not measured: the model's delivered BER against the size fit of the published thresholds "
          "(default recipe).", ""]
    if slopes:
        md += ["Slopes (step seconds per second of per-hop one-way delay, measured where netem exists): "
               + "; ".join(f"{m} {v['slope']:.3g}" + (f" [{v['slope_ci'][0]:.3g}, {v['slope_ci'][1]:.3g}]"
                                                      if v.get("slope_ci") else "")
                           + (f" ({v['topology']})" if v.get("topology") else "") for m, v in sorted(slopes.items())),
               ""]
    else:
        md += [f"No slope of step time against delay in this directory ({SLOPE_FILE}): the modelled wall time is "
               "left out.", ""]
    for model in sorted({e["model"] for e in table}, key=str):
        for mode in sorted({e["mode"] for e in table if e["model"] == model}):
            entries = [e for e in table if e["model"] == model and e["mode"] == mode and e["pre_fec_ber"] > 0]
            if not entries:
                continue
            md += [f"### {model}, {mode.upper()}", "",
                   "| profile | pre-FEC BER | delivered BER / drops | added latency | steps to target | "
                   "wall to target (measured, modelled) | verdict | 124M (predicted) |", "|---|---|---|---|---|---|---|---|"]
            for e in entries:
                key = (model, mode, e["pre_fec_ber"])
                verdict = []
                for word, win in (("measured", win_meas.get(key, ())), ("modelled", win_mod.get(key, ()))):
                    if e["profile"] in win:
                        verdict.append(("fastest, " if len(win) == 1 else "tied fastest, ") + word)
                if e.get("modelled_past_timeout") and e["reached"] == e["n_seeds"]:
                    verdict.append("modelled past the point timeout: down in effect"
                                   + (f" (goodput {e['goodput']:.2g})" if e.get("goodput", 1) < 1 else ""))
                if e["reached"] < e["n_seeds"]:
                    verdict.append(f"target not reached by {e['n_seeds'] - e['reached']}/{e['n_seeds']} seeds"
                                   + (f" ({', '.join(s for s in e['statuses'] if s != 'ok')})"
                                      if any(s != 'ok' for s in e['statuses']) else ""))
                delivered = fmt_ber(e["delivered_ber"]) if e["delivered_ber"] else "0"
                extra = (f", {e['frames_dropped']:,} frames dropped" if e["frames_dropped"] else "") + (
                    f", {e['frames_replayed']:,} replayed" if e["frames_replayed"] else "")
                lat_text = _latency(e["hop_latency_s"]) + (
                    f"; goodput {e['goodput']:.2g}" if e.get("goodput", 1) < 1 else "")
                md.append(f"| {e['profile']} | {fmt_ber(e['pre_fec_ber'])} | {delivered}{extra} | {lat_text} | "
                          f"{_steps(e['steps_to_target'])} | "
                          f"{_wall(e['wall_measured_s'])}, {_wall(e['wall_modelled_s'])} | "
                          f"{'; '.join(verdict) or '-'} | {_verdict_124m(e, preds.get(mode))} |")
            md.append("")
            bers = sorted({e["pre_fec_ber"] for e in entries})
            win = win_mod if slopes.get(mode) else win_meas
            md += [f"Fastest per pre-FEC BER ({'modelled' if slopes.get(mode) else 'measured'}): "
                   + ", ".join(f"{fmt_ber(b)}: {_names(win.get((model, mode, b), ())) or 'none reached'}"
                               for b in bers), ""]
    return md + [plot, ""]
