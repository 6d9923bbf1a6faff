"""Plots of an experiment's results: one PNG per question, from results.jsonl rows or latency.json.

Every `plot_*(rows or latency, path)` writes its PNG atomically and returns the path, or returns None when the
data hold nothing to plot (no rows of that kind, every value missing). Figures are built with the object API
(`matplotlib.figure.Figure`, rendered by Agg): no pyplot, no display, no global backend switch, nothing to close.

Conventions shared by all plots:
- a "config" is (mode, scope, checksum, recipe); it has one color per plot set (`config_colors`);
- a BER has one color in every plot that colors by BER (`ber_colors`): the clean run (BER 0) is black;
- on BER axes that need the clean run, BER 0 sits one decade left of the smallest BER, labelled "0";
- "ok" runs are filled circles, every failed status (crashed, hung, diverged, invalid, error) is an x.
"""

from __future__ import annotations

import io
import math
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullLocator

from testbed.fileio import write_atomic
from testbed.analysis import results
from testbed.analysis import analysis
from testbed.analysis.analysis import PUBLISHED_TOLERATED_BER, run_setup, skipped_fraction
from testbed.analysis.formatting import ber_text, config_label, mode_name
from testbed.analysis.results import ber_of, config_of, configs, finite, is_ok, modes, positive, recipes

DPI = 120
FAILED_MARKER, OK_MARKER = "x", "o"
# the results.jsonl fields plotted (checked against the schema when this module loads)
LOSS_CURVE, EVAL_LOSS, DEVIATION, DIVERGENCE, STEP_TIME = results.field_names(
    "loss_curve", "final_eval_loss", "final_deviation", "final_replica_divergence", "median_step_time_s")
LATENCY_QUANTILES = (("p50_us", 0.5), ("p90_us", 0.9), ("p99_us", 0.99), ("p999_us", 0.999))


# ---------------------------------------------------------------------------------------------------------------
# Colors
# ---------------------------------------------------------------------------------------------------------------

def config_colors(all_configs: list[tuple]) -> dict:
    palette = colormaps["tab10"].colors
    return {c: palette[i % len(palette)] for i, c in enumerate(all_configs)}


def ber_colors(bers) -> dict:
    """BER -> color: 0 black, the others spread evenly over 'plasma' in BER order (even spacing keeps
    neighbouring BERs distinguishable however the grid is spaced)."""
    nonzero = sorted({b for b in bers if b > 0})
    cmap = colormaps["plasma"]
    colors = {0.0: "black"}
    for i, b in enumerate(nonzero):
        colors[b] = cmap(0.1 + 0.75 * (i / max(len(nonzero) - 1, 1)))
    return colors


# ---------------------------------------------------------------------------------------------------------------
# Figure helpers
# ---------------------------------------------------------------------------------------------------------------

LEGEND_INSIDE_MAX = 10  # more lines than this and a legend inside covers the curves


def _figure(n_panels: int, width: float = 6.0, height: float = 4.5, stacked: bool = False) -> tuple[Figure, list]:
    """Panels side by side, or one above the other (stacked)."""
    if stacked:
        fig = Figure(figsize=(width, height * n_panels), dpi=DPI, layout="tight")
        return fig, list(fig.subplots(n_panels, 1, squeeze=False)[:, 0])
    fig = Figure(figsize=(width * n_panels, height), dpi=DPI, layout="tight")
    return fig, list(fig.subplots(1, n_panels, squeeze=False)[0])


def save_figure(fig: Figure, path) -> Path:
    """Render to PNG in memory, then write atomically (a reader never sees half an image)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    path = Path(path)
    write_atomic(path, buf.getvalue())
    return path


def _clean_x(bers) -> float:
    """Where BER 0 goes on a log BER axis: one decade left of the smallest non-zero BER."""
    nonzero = [b for b in bers if b > 0]
    return min(nonzero) / 10 if nonzero else 1e-9


def _x_of(ber: float, clean_x: float) -> float:
    return ber if ber > 0 else clean_x


def _ber_ticks(ax, bers, with_clean: bool) -> None:
    """Decade ticks over the BER range, plus '0' at the clean position when the clean run is drawn."""
    nonzero = [b for b in bers if b > 0]
    if not nonzero:
        return
    lo, hi = math.floor(math.log10(min(nonzero))), math.ceil(math.log10(max(nonzero)))
    ticks = [10.0**k for k in range(lo, hi + 1)]
    labels = [f"1e{k}" for k in range(lo, hi + 1)]
    if with_clean:
        clean = _clean_x(nonzero)
        ticks, labels = [clean] + [t for t in ticks if t > clean * 1.5], ["0"] + [
            lab for t, lab in zip(ticks, labels) if t > clean * 1.5]
    ax.set_xticks(ticks, labels)
    ax.xaxis.set_minor_locator(NullLocator())
    # a quarter decade of room on both sides, so markers at the first and last BER are not cut in half
    ax.set_xlim(min(ticks) / 10**0.25, max(ticks) * 10**0.25)


def _mark_at_top(ax, rows: list[dict], y_axes: float, marker: str, color, label: str) -> None:
    """Markers at a BER, at a fixed height in axes coordinates: runs whose value cannot be drawn (none, or
    beyond the cut y limit)."""
    if rows:
        ax.scatter([ber_of(r) for r in rows], [y_axes] * len(rows), transform=ax.get_xaxis_transform(),
                   marker=marker, color=color, s=30, label=label)


def _initial_losses(rows: list[dict], mode: str) -> list[float]:
    return [v for r in rows if r.get("mode") == mode and r.get(LOSS_CURVE)
            if (v := finite(r[LOSS_CURVE][0])) is not None]


def _robust_top(values: list[float], reference: list[float]) -> float | None:
    """An upper y limit that keeps a few exploded values (a loss of 1e6) from flattening everything else:
    1.5 x the largest reference value (e.g. the initial or clean loss) when the data go far beyond it."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    refs = [v for v in reference if v is not None and math.isfinite(v)]
    if not vals or not refs:
        return None
    top = 1.5 * max(refs)
    return top if max(vals) > top else None


def _status_legend_handles(color="gray") -> list:
    return [Line2D([], [], color=color, marker=OK_MARKER, linestyle="", label="run: ok"),
            Line2D([], [], color=color, marker=FAILED_MARKER, linestyle="", label="run: failed")]


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def _geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return float(np.exp(np.mean(np.log(vals)))) if vals else None


def _by_ber(rows: list[dict]) -> dict[float, list[dict]]:
    out: dict[float, list[dict]] = {}
    for r in rows:
        out.setdefault(ber_of(r), []).append(r)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------------

def _curves_array(curves: list[list]) -> np.ndarray:
    """Seeds x steps, NaN where a curve has null or is shorter (a run that stopped early)."""
    length = max(len(c) for c in curves)
    out = np.full((len(curves), length), np.nan)
    for i, c in enumerate(curves):
        out[i, :len(c)] = [v if finite(v) is not None else np.nan for v in c]
    return out


def plot_loss_vs_step(rows: list[dict], path) -> Path | None:
    """Training loss per step: a panel per mode, a line per BER (mean over seeds, band = min..max)."""
    with_curves = [r for r in rows if isinstance(r.get(LOSS_CURVE), list) and r[LOSS_CURVE]]
    if not with_curves:
        return None
    all_configs = configs(with_curves)
    colors = ber_colors({ber_of(r) for r in rows})
    styles = ("-", "--", ":", "-.")
    panel_modes = modes(with_curves)
    lines = max(len({(config_of(r), ber_of(r)) for r in with_curves if config_of(r)[0] == m}) for m in panel_modes)
    stacked = lines > LEGEND_INSIDE_MAX  # a grid of many recipes and BERs: panels one above the other
    fig, axes = (_figure(len(panel_modes), 15.0, max(4.5, 0.17 * -(-lines // 2) + 1.0), stacked=True) if stacked
                 else _figure(len(panel_modes)))
    for ax, mode in zip(axes, panel_modes):
        mode_configs = [c for c in all_configs if c[0] == mode]
        plotted, initial = [], []
        for style, config in zip(styles * 4, mode_configs):
            for ber, group in _by_ber([r for r in with_curves if config_of(r) == config]).items():
                arr = _curves_array([r[LOSS_CURVE] for r in group])
                with warnings.catch_warnings():  # steps where every seed is NaN stay NaN, quietly
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mean, lo, hi = np.nanmean(arr, 0), np.nanmin(arr, 0), np.nanmax(arr, 0)
                steps = np.arange(arr.shape[1])
                label = f"BER {ber_text(ber)}" if ber > 0 else "BER 0 (clean)"
                if len(mode_configs) > 1:
                    label = f"{config_label(config, all_configs)}, {label}"
                ax.plot(steps, mean, color=colors[ber], linestyle=style, linewidth=1.6 if ber == 0 else 1.2,
                        label=f"{label} ({len(group)} seeds)", zorder=3 if ber == 0 else 2)
                if len(group) > 1:
                    ax.fill_between(steps, lo, hi, color=colors[ber], alpha=0.15, linewidth=0)
                plotted.extend(arr[np.isfinite(arr)].tolist())
                initial.extend(arr[:, 0][np.isfinite(arr[:, 0])].tolist())
        top = _robust_top(plotted, initial)
        if top is not None:
            ax.set_ylim(top=top)
        ax.set_title(f"{mode_name(mode)}: training loss (mean over seeds, band = min..max)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/token)")
        ax.grid(alpha=0.3)
    _legends(axes, stacked)
    return save_figure(fig, path)


def _legends(axes, stacked: bool) -> None:
    """Inside each panel when short; stacked panels (many lines) get theirs on the right, in two columns."""
    for ax in axes:
        if stacked:
            ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
        else:
            ax.legend(fontsize=8)


def _plot_per_run(ax, rows: list[dict], field: str, color, clean_x: float | None, value=finite) -> list[float]:
    """Per-run markers (ok: o, failed: x) of `field`; returns the values drawn. clean_x None skips BER 0."""
    drawn = []
    for r in rows:
        v = value(r.get(field))
        if v is None or (clean_x is None and ber_of(r) == 0):
            continue
        marker = OK_MARKER if is_ok(r) else FAILED_MARKER
        ax.scatter([_x_of(ber_of(r), clean_x or 0.0)], [v], color=color, marker=marker, s=28,
                   facecolors="none" if marker == OK_MARKER else color, zorder=3)
        drawn.append(v)
    return drawn


def _plot_mean_line(ax, rows: list[dict], field: str, color, label: str, clean_x: float | None,
                    value=finite, average=_mean) -> list[tuple[float, float]]:
    """Line through the per-BER average of `field` over ok runs; returns the (BER, average) points."""
    points = []
    for ber, group in _by_ber([r for r in rows if is_ok(r)]).items():
        if clean_x is None and ber == 0:
            continue
        avg = average([value(r.get(field)) for r in group])
        if avg is not None:
            points.append((ber, avg))
    if points:
        ax.plot([_x_of(b, clean_x or 0.0) for b, _ in points], [v for _, v in points], color=color,
                linewidth=1.5, label=label, zorder=2)
    return points


def plot_eval_loss_vs_ber(rows: list[dict], path) -> Path | None:
    """Final eval loss vs BER (log x), a panel per mode; the clean runs are a horizontal band (min..max of the
    seeds, line at the mean). Failed runs without an eval loss are marked at the top edge. None when no run
    evaluates (e.g. locate.yaml: its report has no threshold section to show it)."""
    if not any(ber_of(r) > 0 for r in rows) or not any(finite(r.get(EVAL_LOSS)) is not None for r in rows):
        return None
    all_configs = configs(rows)
    colors = config_colors(all_configs)
    panel_modes = [m for m in modes(rows) if any(r.get("mode") == m and ber_of(r) > 0 for r in rows)]
    fig, axes = _figure(len(panel_modes))
    for ax, mode in zip(axes, panel_modes):
        losses = [v for r in rows if r.get("mode") == mode and ber_of(r) > 0
                  if (v := finite(r.get(EVAL_LOSS))) is not None]
        top = _robust_top(losses, _initial_losses(rows, mode))
        for config in [c for c in all_configs if c[0] == mode]:
            group = [r for r in rows if config_of(r) == config]
            color, label = colors[config], config_label(config, all_configs)
            clean = [v for r in group if ber_of(r) == 0 and is_ok(r)
                     if (v := finite(r.get(EVAL_LOSS))) is not None]
            if clean:
                ax.axhspan(min(clean), max(clean), color=color, alpha=0.15, linewidth=0)
                ax.axhline(float(np.mean(clean)), color=color, linestyle="--", linewidth=1,
                           label=f"{label} clean (BER 0), {len(clean)} seeds")
            _plot_per_run(ax, group, EVAL_LOSS, color, clean_x=None)
            _plot_mean_line(ax, group, EVAL_LOSS, color, f"{label}: mean of ok runs", clean_x=None)
            runs = [r for r in group if ber_of(r) > 0]
            _mark_at_top(ax, [r for r in runs if finite(r.get(EVAL_LOSS)) is None], 0.97, "v", color,
                         f"{label}: no eval loss (failed)")
            if top is not None:
                _mark_at_top(ax, [r for r in runs if (finite(r.get(EVAL_LOSS)) or 0) > top], 0.92, "^",
                             color, f"{label}: eval loss above the cut")
        if mode in PUBLISHED_TOLERATED_BER:
            ax.axvline(PUBLISHED_TOLERATED_BER[mode], color="gray", linestyle=":",
                       label=f"published: {mode_name(mode)} fine below {ber_text(PUBLISHED_TOLERATED_BER[mode])}")
        if top is not None:
            ax.set_ylim(top=top)
        ax.set_xscale("log")
        _ber_ticks(ax, [ber_of(r) for r in rows if r.get("mode") == mode] + [PUBLISHED_TOLERATED_BER.get(mode, 0)],
                   with_clean=False)
        ax.set_title(f"{mode_name(mode)}: final eval loss vs BER"
                     + ("\n(y cut at 1.5 x the initial loss)" if top is not None else ""), fontsize=10)
        ax.set_xlabel("bit error rate (per bit)")
        ax.set_ylabel("final eval loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(handles=ax.get_legend_handles_labels()[0] + _status_legend_handles(), fontsize=8)
    return save_figure(fig, path)


def _slope_half_reference(ax, points: list[tuple[float, float]], bers: list[float]) -> None:
    """A line of slope 1/2 (deviation ~ sqrt(BER)) through the lowest-BER measured point."""
    if not points or len(bers) < 2:
        return
    b0, y0 = points[0]
    xs = np.array([min(bers), max(bers)])
    ax.plot(xs, y0 * np.sqrt(xs / b0), color="gray", linestyle="--", linewidth=1, label="∝ √BER (slope 1/2)")


def _plot_log_log_metric(rows: list[dict], path, field: str, ylabel: str, title: str,
                         with_theory: bool) -> Path | None:
    """Per-run markers and a geometric-mean line of a positive metric vs BER > 0, log-log, a panel per mode."""
    data = [r for r in rows if ber_of(r) > 0 and positive(r.get(field)) is not None]
    if not data:
        return None
    all_configs = configs(rows)
    colors = config_colors(all_configs)
    panel_modes = modes(data)
    fig, axes = _figure(len(panel_modes))
    for ax, mode in zip(axes, panel_modes):
        mode_rows = [r for r in data if r.get("mode") == mode]
        bers = sorted({ber_of(r) for r in mode_rows})
        first_points = []
        for config in [c for c in all_configs if c[0] == mode]:
            group = [r for r in mode_rows if config_of(r) == config]
            if not group:
                continue
            _plot_per_run(ax, group, field, colors[config], clean_x=None, value=positive)
            first_points += _plot_mean_line(ax, group, field, colors[config],
                                            f"{config_label(config, all_configs)}: geometric mean of ok runs",
                                            clean_x=None, value=positive, average=_geomean)[:1]
        _slope_half_reference(ax, sorted(first_points), bers)
        note = ""
        if with_theory:
            note = _draw_theory_deviation(ax, rows, mode, bers)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _ber_ticks(ax, bers, with_clean=False)
        ax.set_title(f"{mode_name(mode)}: {title}" + (f"\n{note}" if note else ""), fontsize=10)
        ax.set_xlabel("bit error rate (per bit)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(handles=ax.get_legend_handles_labels()[0] + _status_legend_handles(), fontsize=8)
    return save_figure(fig, path)


def _draw_theory_deviation(ax, rows: list[dict], mode: str, bers: list[float]) -> str:
    """The analytical curve of each DDP config (gradient errors through the ring, the recipe's guard and
    protection: analysis.recipe_deviation); returns a note for the title."""
    if mode != "ddp":
        return "(no analytical curve: the model covers DDP gradient errors only)"
    grid = np.logspace(math.log10(min(bers)) - 0.5, math.log10(max(bers)) + 0.5, 60)
    all_configs = [c for c in configs(rows) if c[0] == mode]
    colors, notes = config_colors(configs(rows)), []
    for config in all_configs:
        group = [r for r in rows if config_of(r) == config]
        est = analysis.recipe_deviation(grid, group)
        if est is None:
            notes.append("no analytical curve: rows lack n_params, steps or lr")
            continue
        shown = np.isfinite(est) & (est > 0)
        if not shown.any():
            notes.append("analytical estimate: a run-ending event is expected at every BER (inf)")
            continue
        setup = run_setup(group, mode)
        clip = setup.get("grad_clip")
        what = (f"theory (AdamW, clip {1.0 if clip is None else clip:g}, {setup.get('world_size', '?')} ranks)"
                if len(all_configs) == 1 else f"theory, {config_label(config, configs(rows))}")
        ax.plot(grid[shown], est[shown], color="black" if len(all_configs) == 1 else colors[config],
                linestyle="-" if len(all_configs) == 1 else "--", linewidth=1.5, label=what)
    return "; ".join(dict.fromkeys(notes)) if len(notes) == len(all_configs) else ""


def plot_deviation_vs_ber(rows: list[dict], path) -> Path | None:
    """Final L2 distance of the weights from the clean run vs BER, log-log, with the analytical estimate (DDP)."""
    return _plot_log_log_metric(rows, path, DEVIATION, "||w − w_clean|| at the end (L2, weight units)",
                                "weight deviation from the clean run", with_theory=True)


def plot_divergence_vs_ber(rows: list[dict], path) -> Path | None:
    """DDP replica divergence (max over ranks of the L2 distance from rank 0) vs BER, log-log."""
    ddp = [r for r in rows if r.get("mode") == "ddp"]
    return _plot_log_log_metric(ddp, path, DIVERGENCE, "max over ranks ||w_r − w_0|| (L2)",
                                "replica divergence at the end", with_theory=False)


def _plot_vs_ber_with_clean(rows: list[dict], path, value, ylabel: str, title: str,
                            log_y_if_spread: bool, ylim=None, average=_mean) -> Path | None:
    """One panel: a metric vs BER (BER 0 at the clean position), per-run markers and a line per config."""
    data = [r for r in rows if value(r) is not None]
    if not data:
        return None
    all_configs = configs(rows)
    colors = config_colors(all_configs)
    bers = sorted({ber_of(r) for r in data})
    clean_x = _clean_x(bers)
    fig, (ax,) = _figure(1, width=7.0)
    values = []
    for config in all_configs:
        group = [r for r in data if config_of(r) == config]
        if not group:
            continue
        wrapped = [{**r, "_v": value(r)} for r in group]  # the helpers read a field; give them the computed value
        values += _plot_per_run(ax, wrapped, "_v", colors[config], clean_x)
        _plot_mean_line(ax, wrapped, "_v", colors[config], config_label(config, all_configs), clean_x,
                        average=average)
    ax.set_xscale("log")
    _ber_ticks(ax, bers, with_clean=any(b == 0 for b in bers))
    positive_values = [v for v in values if v > 0]
    if log_y_if_spread and positive_values and max(positive_values) > 20 * min(positive_values):
        ax.set_yscale("log")
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_xlabel("bit error rate (per bit; 0 = clean link)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(handles=ax.get_legend_handles_labels()[0] + _status_legend_handles(), fontsize=8)
    return save_figure(fig, path)


def plot_step_time_vs_ber(rows: list[dict], path) -> Path | None:
    """Median step time (slowest rank) vs BER, per mode and checksum mode; line = median over ok runs."""
    return _plot_vs_ber_with_clean(rows, path, lambda r: positive(r.get(STEP_TIME)),
                                   "median step time (s, slowest rank)", "step time vs BER",
                                   log_y_if_spread=True, average=_median)


def plot_skipped_vs_ber(rows: list[dict], path) -> Path | None:
    """Fraction of updates skipped (non-finite loss or gradient) vs BER, per mode."""
    return _plot_vs_ber_with_clean(rows, path, skipped_fraction, "skipped updates / completed steps",
                                   "skipped updates vs BER", log_y_if_spread=False, ylim=(-0.03, 1.03))


def plot_lost_vs_ber(rows: list[dict], path) -> Path | None:
    """Lost-step fraction vs BER, a panel per recipe: measured (skipped updates / steps, pooled over seeds, with
    the Clopper-Pearson 95 % interval) as markers, the theory's (theory.predict_recipe) as a line, per mode."""
    agg = [p for p in analysis.aggregate(rows) if p["lost_fraction"] is not None]
    if not any(p["ber"] > 0 for p in agg):
        return None
    panel_recipes = [r for r in recipes(rows) if any(p["recipe"] == r for p in agg)]
    all_configs = configs(rows)
    colors = config_colors(all_configs)
    bers = sorted({p["ber"] for p in agg})
    clean_x = _clean_x(bers)
    fig, axes = _figure(len(panel_recipes), width=5.5)
    for ax, recipe in zip(axes, panel_recipes):
        for config in [c for c in all_configs if c[3] == recipe]:
            points = [p for p in agg if analysis.point_config(p) == config]
            if not points:
                continue
            color, label = colors[config], config_label(config[:3], [c[:3] for c in all_configs])
            xs = [_x_of(p["ber"], clean_x) for p in points]
            ys = [p["lost_fraction"] for p in points]
            err = [[y - p["lost_fraction_ci"][0] for y, p in zip(ys, points)],
                   [p["lost_fraction_ci"][1] - y for y, p in zip(ys, points)]]
            ax.errorbar(xs, ys, yerr=err, color=color, marker=OK_MARKER, linestyle="", capsize=3,
                        label=f"{label}: measured (95 % interval)")
            ref = next((p for p in points if p["ber"] > 0), points[0])
            grid = np.logspace(math.log10(min(b for b in bers if b > 0)) - 0.5, math.log10(max(bers)) + 0.3, 50)
            preds = [analysis.predict_point(ref, ber=b) for b in grid]
            if None not in preds:
                ax.plot(grid, [q.p_step_skipped for q in preds], color=color, linewidth=1.3,
                        label=f"{label}: theory 1 - exp(-λ)")
        ax.set_xscale("log")
        _ber_ticks(ax, bers, with_clean=0 in bers)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"recipe {recipe}: lost steps (skipped updates / steps)", fontsize=10)
        ax.set_xlabel("bit error rate (per bit; 0 = clean link)")
        ax.set_ylabel("fraction of steps lost")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _latency_style(entry: dict, colors: dict) -> tuple:
    """(color, linestyle): no engine gray dotted, engine at BER 0 black, else the BER's color, keep dashed."""
    if not entry.get("engine"):
        return "gray", ":"
    ber = finite(entry.get("ber")) or 0.0
    return colors.get(ber, "black"), "--" if entry.get("checksum") == "keep" else "-"


def latency_label(entry: dict) -> str:
    """A configuration's name: its label, or one built from engine/BER/checksum."""
    if entry.get("label"):
        return str(entry["label"])
    if not entry.get("engine"):
        return "no engine"
    ber = finite(entry.get("ber")) or 0.0
    return f"engine BER {ber_text(ber)}" + (f" {entry['checksum']}" if entry.get("checksum") and ber > 0 else "")


def plot_latency(latency: dict | None, path) -> Path | None:
    """RTT empirical CDF per latency configuration (log x), p50 (o) and p99 (s) marked; configurations without
    samples show their reported quantiles only."""
    entries = [e for e in (latency or {}).get("results") or [] if isinstance(e, dict)]
    if not entries:
        return None
    colors = ber_colors({finite(e.get("ber")) or 0.0 for e in entries})
    fig, (ax,) = _figure(1, width=8.0, height=5.0)
    drawn = False
    for e in entries:
        color, style = _latency_style(e, colors)
        samples = np.sort([v for v in e.get("samples_us") or [] if positive(v) is not None])
        p50, p99 = positive(e.get("p50_us")), positive(e.get("p99_us"))
        if samples.size:
            p50 = p50 or float(np.percentile(samples, 50))
            p99 = p99 or float(np.percentile(samples, 99))
            ax.step(samples, np.arange(1, samples.size + 1) / samples.size, where="post", color=color,
                    linestyle=style, label=f"{latency_label(e)}: p50 {p50:.3g} µs, p99 {p99:.3g} µs")
        else:
            qs = [(v, q) for key, q in LATENCY_QUANTILES if (v := positive(e.get(key))) is not None]
            if not qs:
                continue
            ax.plot([v for v, _ in qs], [q for _, q in qs], color=color, linestyle=style, marker=".",
                    label=f"{latency_label(e)} (quantiles only)")
        for value, q, marker in ((p50, 0.5, "o"), (p99, 0.99, "s")):
            if value is not None:
                ax.plot([value], [q], marker=marker, color=color, markersize=6, linestyle="")
        drawn = True
    if not drawn:
        return None
    for q in (0.5, 0.99):
        ax.axhline(q, color="gray", linewidth=0.6, alpha=0.5)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.01)
    details = ([f"{latency['size']} B messages"] if latency.get("size") else []) + [
        str(latency[k]) for k in ("topology", "link") if latency.get(k)]
    ax.set_title("round-trip time per configuration" + (f" ({', '.join(details)})" if details else "")
                 + "\n(o = p50, s = p99)", fontsize=10)
    ax.set_xlabel("round-trip time (µs)")
    ax.set_ylabel("fraction of round trips ≤ x")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path)


def plot_lambda_collapse(rows: list[dict], path) -> Path | None:
    """(Drawn by the size-ladder section, testbed/report/scaling.py, only for experiments that have one.) The size
    ladder (testbed/analysis/scaling.py): measured lost-step fraction (pooled over the seeds that drew their own
    flips, Clopper-Pearson 95 % interval) against the theory's lambda of the unprotected wire at the point's BER,
    every model on the one curve 1 - exp(-lambda); a color per model, DDP filled and PP open markers; the protect and sanitize recipes
    (predicted: no lost step) as small gray markers at the same lambda."""
    from testbed.analysis import scaling

    cells = [c for c in scaling.lambda_cells(rows) if c["lost_fraction"] is not None and c["wire_lambda"]]
    if not cells:
        return None
    fig, (ax,) = _figure(1, width=7.5, height=5.0)
    lams = [c["wire_lambda"] for c in cells]
    grid = np.logspace(math.log10(min(lams)) - 0.3, math.log10(max(lams)) + 0.3, 100)
    ax.plot(grid, scaling.fraction_curve(grid), color="black", linewidth=1.4, label="theory: 1 - exp(-λ)")
    models = sorted({c["model"] for c in cells}, key=scaling.model_key)
    palette = colormaps["viridis"]
    colors = {m: palette(0.1 + 0.75 * i / max(len(models) - 1, 1)) for i, m in enumerate(models)}
    shown = set()
    for c in cells:
        y, (lo, hi) = c["lost_fraction"], c["lost_ci"]
        # every model and mode at one lambda side by side (log axis: a factor per slot)
        slot = 2 * models.index(c["model"]) + (c["mode"] == "pp") - (2 * len(models) - 1) / 2
        dodge = 1.035 ** slot
        if c["kind"] == "default":
            key = (c["model"], c["mode"])
            label = None if key in shown else f"{c['model']} {mode_name(c['mode'])}"
            shown.add(key)
            ax.errorbar([c["wire_lambda"] * dodge], [y], yerr=[[y - lo], [hi - y]], color=colors[c["model"]],
                        marker="o" if c["mode"] == "ddp" else "s", markersize=6, linestyle="", capsize=3,
                        markerfacecolor=colors[c["model"]] if c["mode"] == "ddp" else "white", label=label)
        else:
            label = None if "other" in shown else "protect / sanitize recipes (theory: no lost step)"
            shown.add("other")
            ax.errorbar([c["wire_lambda"] * dodge], [y], yerr=[[y - lo], [hi - y]], color="gray", marker=".",
                        linestyle="", capsize=2, alpha=0.7, label=label)
    ax.set_xscale("log")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("λ: catastrophic values per step the theory expects (unprotected fp32 wire, at the point's BER)")
    ax.set_ylabel("fraction of steps lost (skipped updates / steps)")
    ax.set_title("Lost steps vs λ, every model size on one curve (95 % Clopper-Pearson intervals)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)


def plot_size_thresholds(fits: list[dict], path) -> Path | None:
    """(Drawn by the size-threshold section, testbed/report/scaling.py, from `sizefit.size_fits`.) Threshold BER
    against parameter count, log-log, a panel per mode: each size's paired-rule interval as a bar (last passing
    to first failing BER; an arrow where it is one-sided), a color per family (recipe); the least-squares line
    through the midpoints (solid) extended to GPT-2 124M, the theory's tolerated BER per size and its fixed-lambda
    extension (dashed), the 124M prediction with the range of every line through every interval (diamond), and
    the published figure at 124M (gray bar: fine below it)."""
    fits = [f for f in fits if f["sizes"]]
    if not fits:
        return None
    modes_present = [m for m in ("ddp", "pp") if any(f["family"]["mode"] == m for f in fits)]
    modes_present += sorted({f["family"]["mode"] for f in fits} - set(modes_present))
    fig, axes = _figure(len(modes_present), width=6.5, height=5.0)
    palette = colormaps["tab10"].colors
    colors = {k: palette[i % len(palette)] for i, k in enumerate(dict.fromkeys(f["name"] for f in fits))}
    for ax, mode in zip(axes, modes_present):
        mine = [f for f in fits if f["family"]["mode"] == mode]
        xmax = max(f["target_n_params"] for f in mine)
        xmin = min(s["n_params"] for f in mine for s in f["sizes"])
        xs_line = np.logspace(math.log10(xmin) - 0.15, math.log10(xmax) + 0.1, 50)
        ys_all = []
        for i, f in enumerate(mine):
            color = colors[f["name"]]
            dodge = 1.06 ** (i - (len(mine) - 1) / 2)
            for s in f["sizes"]:
                lo, hi = s["interval"]
                x = s["n_params"] * dodge
                bottom = lo if lo > 0 else hi / 10
                top = hi if math.isfinite(hi) else lo * 10
                ys_all += [bottom, top]
                ax.plot([x, x], [bottom, top], color=color, linewidth=3, alpha=0.8, solid_capstyle="butt")
                if lo <= 0:
                    ax.plot([x], [bottom], marker="v", color=color, linestyle="")
                if not math.isfinite(hi):
                    ax.plot([x], [top], marker="^", color=color, linestyle="")
                if s["theory_ber"]:
                    ax.plot([x], [s["theory_ber"]], marker="_", markersize=12, color=color, linestyle="")
                    ys_all.append(s["theory_ber"])
            fit = f["fit"]
            if fit is not None:
                slope_text = f"{f['fit']['slope']:.2f}"
                ax.plot(xs_line, 10 ** (fit["intercept"] + fit["slope"] * np.log10(xs_line)), color=color,
                        linewidth=1.2, label=f"{f['label']}: fit, slope {slope_text}")
            else:
                ax.plot([], [], color=color, linewidth=3, label=f"{f['label']}: intervals (no fit)")
            th = [(s["n_params"], s["theory_ber"]) for s in f["sizes"] if s["theory_ber"]]
            pred = f["prediction_ber"]
            if th:
                tx = [n for n, _ in th] + ([f["target_n_params"]] if pred["theory"] else [])
                ty = [b for _, b in th] + ([pred["theory"]] if pred["theory"] else [])
                ys_all += ty
                ax.plot(tx, ty, color=color, linestyle="--", linewidth=1.0,
                        label=f"{f['label']}: theory" + (f", slope {f['theory_slope']:.2f}"
                                                         if f["theory_slope"] is not None else ""))
            x124 = f["target_n_params"] * dodge
            rng = pred["range"]
            if rng is not None and (rng[0] > 0 or math.isfinite(rng[1])):
                lo = rng[0] if rng[0] > 0 else (rng[1] / 100)
                hi = rng[1] if math.isfinite(rng[1]) else rng[0] * 100
                ys_all += [lo, hi]
                ax.plot([x124, x124], [lo, hi], color=color, linewidth=1.2, linestyle=":")
                if rng[0] <= 0:
                    ax.plot([x124], [lo], marker="v", color=color, linestyle="", markersize=4)
                if not math.isfinite(rng[1]):
                    ax.plot([x124], [hi], marker="^", color=color, linestyle="", markersize=4)
            if pred["ber"] is not None:
                ys_all.append(pred["ber"])
                ax.plot([x124], [pred["ber"]], marker="D", color=color, linestyle="", markersize=7)
        pub = PUBLISHED_TOLERATED_BER.get(mode)
        if pub is not None:
            ax.plot([xmax], [pub], marker="_", markersize=22, color="gray", linestyle="",
                    label=f"paper (GPT-2 124M): fine below {ber_text(pub)}")
            ys_all.append(pub)
        ax.set_xscale("log")
        ax.set_yscale("log")
        finite_ys = [y for y in ys_all if y > 0 and math.isfinite(y)]
        if finite_ys:
            ax.set_ylim(min(finite_ys) / 3, max(finite_ys) * 3)
        ax.axvline(xmax, color="gray", linewidth=0.6, alpha=0.5)
        ax.set_xlabel("parameters")
        ax.set_ylabel("threshold BER (bar: last passing – first failing)")
        ax.set_title(f"{mode_name(mode)}: threshold vs model size (◆ 124M prediction, dotted: every line "
                     "through every interval)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower left")
    return save_figure(fig, path)


DETECTOR_COLORS = {"timing": "tab:blue", "consistency": "tab:orange", "counters": "tab:green"}
TOPOLOGY_MARKERS = ("o", "s", "^", "D", "v")


def plot_detection_vs_ber(rows: list[dict], path) -> Path | None:
    """(Drawn by the report's fault-localisation section, only for experiments with monitored points.) A
    fault-localisation experiment (testbed/locate/scores.py): left, the median step of the first correct call
    against the faulty link's BER (log x), error bars its order-statistic 95 % interval (none drawn with fewer than
    6 correct calls: open marker); right, the top-1 detection rate with its Clopper-Pearson 95 % interval. One line
    per (topology, checksum, detector): a color per detector, solid keep / dashed fix, a marker per topology."""
    from testbed.locate.scores import score_table

    table = [t for t in score_table(rows) if t["ber"] > 0]
    if not table:
        return None
    lines: dict[tuple, list[dict]] = {}
    for t in table:
        lines.setdefault((t["recipe"], t["mode"], t["checksum"], t["detector"]), []).append(t)
    topologies = sorted({k[0] for k in lines}, key=str)
    multi_mode = len({k[1] for k in lines}) > 1
    fig, (ax_t, ax_r) = _figure(2, width=6.5, height=5.0)
    ordered = sorted(lines.items(), key=lambda kv: tuple(map(str, kv[0])))
    for i, ((recipe, mode, checksum, detector), ts) in enumerate(ordered):
        ts = sorted(ts, key=lambda t: t["ber"])
        dodge = 1.06 ** (i - (len(lines) - 1) / 2)  # side by side at one BER (log axis: a factor per line)
        style = dict(color=DETECTOR_COLORS.get(detector, "gray"), linestyle="-" if checksum == "keep" else "--",
                     marker=TOPOLOGY_MARKERS[topologies.index(recipe) % len(TOPOLOGY_MARKERS)], capsize=3,
                     markersize=5)
        label = f"{recipe}{' ' + mode_name(mode) if multi_mode else ''} {checksum}: {detector}"
        timed = [t for t in ts if t["steps_median"] is not None]
        if timed:
            xs = [t["ber"] * dodge for t in timed]
            ys = [t["steps_median"] for t in timed]
            err = [[y - t["steps_ci"][0] if t["steps_ci"] else 0 for y, t in zip(ys, timed)],
                   [t["steps_ci"][1] - y if t["steps_ci"] else 0 for y, t in zip(ys, timed)]]
            ax_t.errorbar(xs, ys, yerr=err, label=label, **style)
            bare = [(x, y) for x, y, t in zip(xs, ys, timed) if not t["steps_ci"]]
            if bare:
                ax_t.plot(*zip(*bare), linestyle="", marker=style["marker"], markersize=8, markerfacecolor="white",
                          color=style["color"])
        rate = [t["correct"] / t["faulty"] for t in ts]
        ax_r.errorbar([t["ber"] * dodge for t in ts], rate,
                      yerr=[[y - t["correct_ci"][0] for y, t in zip(rate, ts)],
                            [t["correct_ci"][1] - y for y, t in zip(rate, ts)]], label=label, **style)
    bers = sorted({t["ber"] for t in table})
    for ax in (ax_t, ax_r):
        ax.set_xscale("log")
        ax.set_xlim(bers[0] / 3, bers[-1] * 3)
        ax.set_xlabel("BER of the faulty link (per bit)")
        ax.grid(alpha=0.3, which="both")
    ax_t.set_ylabel("step of the first correct call (median; 1 = after the first step)")
    ax_t.set_title("detection time vs BER (95 % order-statistic interval;\nopen marker: < 6 correct calls, no "
                   "interval)", fontsize=10)
    ax_r.set_ylim(-0.03, 1.03)
    ax_r.set_ylabel("top-1 detection rate (correct calls / faulty runs)")
    ax_r.set_title("detection rate vs BER (95 % Clopper-Pearson)", fontsize=10)
    handles, labels = ax_r.get_legend_handles_labels()
    ax_r.legend(handles, labels, fontsize=7, loc="best")
    if ax_t.get_legend_handles_labels()[0]:
        ax_t.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def plot_wall_to_target(table: list[dict], path) -> Path | None:
    """Wall time to the target loss against pre-FEC BER, one line per link profile, one panel per (model, mode)
    (testbed/analysis/timetotarget.decision_table entries): modelled where a slope was measured (solid), measured
    (dashed) otherwise; a profile whose seeds did not all reach the target, or whose modelled wall is past the
    point timeout (a link down in effect), has no point there."""
    panels = sorted({(e["model"], e["mode"]) for e in table}, key=str)
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    palette = colormaps["tab10"].colors
    profiles = list(dict.fromkeys(e["profile"] for e in table))
    drew = False
    for ax, (model, mode) in zip(axes, panels):
        for i, prof in enumerate(profiles):
            pts = sorted((e["pre_fec_ber"], None if e.get("modelled_past_timeout") else e["wall_modelled_s"],
                          e["wall_measured_s"]) for e in table
                         if (e["model"], e["mode"], e["profile"]) == (model, mode, prof) and e["pre_fec_ber"] > 0)
            for col, style in ((1, "-"), (2, "--")):
                xy = [(b, v[col - 1]) for b, *v in pts if v[col - 1] is not None and math.isfinite(v[col - 1])]
                if xy:
                    ax.plot(*zip(*xy), style, marker="o", color=palette[i % len(palette)],
                            label=f"{prof} ({'modelled' if col == 1 else 'measured'})")
                    drew = True
        ax.set_xscale("log")
        ax.set_yscale("log")  # a retry profile's modelled wall spans decades
        ax.set_xlabel("pre-FEC BER")
        ax.set_ylabel("wall time to target (s)")
        ax.set_title(f"{model}, {mode_name(mode)}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return save_figure(fig, path) if drew else None


def plot_or_sentence(draw, data, out_dir, file: str, title: str, empty: str) -> str:
    """report.md's line for a plot a section draws itself: its image, or a sentence saying why it is not there
    (`empty`: why `draw` drew nothing). A plot that raises does not lose the report of a long run."""
    try:
        drawn = draw(data, Path(out_dir) / file)
    except Exception as e:  # noqa: BLE001 - reported in the line, with the traceback on stderr
        traceback.print_exc(file=sys.stderr)
        return f"*{title}: the plot could not be drawn ({type(e).__name__}: {e}).*"
    return f"![{title}]({file})" if drawn else f"*{title}: not drawn, {empty}.*"


# file name -> (function, input): report.py draws them all in this order
PLOTS = {
    "loss_vs_step.png": (plot_loss_vs_step, "rows"),
    "eval_loss_vs_ber.png": (plot_eval_loss_vs_ber, "rows"),
    "deviation_vs_ber.png": (plot_deviation_vs_ber, "rows"),
    "divergence_vs_ber.png": (plot_divergence_vs_ber, "rows"),
    "step_time_vs_ber.png": (plot_step_time_vs_ber, "rows"),
    "skipped_vs_ber.png": (plot_skipped_vs_ber, "rows"),
    "lost_vs_theory.png": (plot_lost_vs_ber, "rows"),
    "latency.png": (plot_latency, "latency"),
}
