"""Time to a target loss: which link layer (testbed/linklayer.py) trains fastest for a physical link's pre-FEC BER.

For each point with a link profile (results rows with `profile`):
- the target: its clean run's final eval loss (the baseline row: BER 0, same recipe, mode and seed) plus the
  paired rule's tolerance, tolerance x that loss (the row's `tolerance`, default 1 %);
- steps_to_target: the steps done when an evaluation first reached the target (eval_curve; None: never);
- the measured step time (median over the run's steps, the slowest rank's) and wall_to_target, measured: the sum of
  the measured step times up to that step (what this machine took, the testbed's own costs included: engines,
  TCP's retransmissions of dropped frames);
- wall_to_target, modelled: steps_to_target x (the raw link's clean step time + slope x hop_latency + the raw
  link's clean communication time x (1 / goodput - 1)) plus what the errors cost this point over its own clean
  run (its measured wall time minus steps x its clean run's median step time: TCP's waits for dropped frames, at
  this machine's speed). hop_latency is the one-way latency the profile
  adds per hop (linklayer.added_latency_s: FEC fill and decode, replay delays), far below what a software testbed
  resolves; slope is the measured growth of step time with per-hop delay (seconds of step per second of delay per
  hop, fitted from delay points: `fit_delay_slope`). goodput (linklayer.goodput_fraction) is the share of the
  link's rate left for new frames: below 1 only for retry, whose go-back-N replays resend every frame sent during
  the replay round trip; the step's communication time stretches by 1 / goodput (a model: this machine's
  communication time is set by its CPUs, not by a line rate). The raw link's clean step time (profile none, BER 0)
  stands for every profile's: the emulator's own per-packet costs differ between profiles (drop and retry take MTU-sized
  frames, the others GSO super-packets) and are no part of a real link layer.

A verdict per (mode, pre-FEC BER): the profile with the least median wall time, among those that reached the
target with every seed and, modelled, within the point timeout (a modelled wall past it is a link that is down in
effect, as a measured point past it ends hung); every profile whose seeds' range overlaps the fastest one's ties
with it (3 seeds cannot order them).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
from scipy import stats

from testbed import linklayer
from testbed.analysis.results import field_names, finite

FIELDS = field_names("profile", "ber", "mode", "seed", "recipe", "eval_curve", "final_eval_loss", "tolerance",
                     "step_time_curve", "median_step_time_s", "status", "realized_ber", "frames_dropped",
                     "frames_replayed", "codewords_failed", "bits_seen", "baseline", "point", "model")
DEFAULT_TOLERANCE = 0.01


def target_of(clean: dict, tolerance: float | None = None) -> float | None:
    """The target eval loss: the clean run's final eval loss x (1 + tolerance)."""
    loss = finite(clean.get("final_eval_loss"))
    if loss is None:
        return None
    tol = tolerance if tolerance is not None else (finite(clean.get("tolerance")) or DEFAULT_TOLERANCE)
    return loss * (1 + tol)


def steps_to_target(row: dict, target: float) -> int | None:
    """Steps done when an evaluation first reached `target` (eval_curve steps are 0-based), None if none did."""
    for step, loss in row.get("eval_curve") or []:
        if loss is not None and loss <= target:
            return int(step) + 1
    return None


def measured_wall(row: dict, steps: int) -> float | None:
    """The measured step times of the first `steps` steps, summed."""
    curve = row.get("step_time_curve") or []
    if len(curve) < steps:
        return None
    return float(sum(curve[:steps]))


def point_time(row: dict, clean: dict | None, slope: float | None, raw_step_s: float | None = None,
               frame_bits: int = 1500 * 8, raw_comm_s: float | None = None) -> dict:
    """Time to target of one row (see the module docstring). `clean`: its baseline row; `raw_step_s` and
    `raw_comm_s`: the median step and communication times of the raw link's clean run (profile none, BER 0) of
    the same model, mode and seed. A modelled wall of a link that delivers nothing (goodput 0) is inf."""
    prof = linklayer.profile(row.get("profile") or "none")
    p = finite(row.get("ber")) or 0.0
    latency = linklayer.added_latency_s(prof, p, frame_bits)
    goodput = linklayer.goodput_fraction(prof, p, frame_bits)
    out = {"profile": prof.name, "pre_fec_ber": p, "hop_latency_s": latency, "goodput": goodput,
           "delivered_ber": finite(row.get("realized_ber")), "frames_dropped": row.get("frames_dropped"),
           "frames_replayed": row.get("frames_replayed"), "codewords_failed": row.get("codewords_failed"),
           "step_time_s": finite(row.get("median_step_time_s")), "steps_to_target": None,
           "wall_measured_s": None, "wall_modelled_s": None, "status": row.get("status")}
    target = target_of(clean, finite(row.get("tolerance"))) if clean else None
    out["target"] = target
    if target is None or row.get("status") != "ok":
        return out
    steps = steps_to_target(row, target)
    out["steps_to_target"] = steps
    if steps is None:
        return out
    wall = measured_wall(row, steps)
    out["wall_measured_s"] = wall
    own = finite(clean.get("median_step_time_s"))
    if None not in (wall, slope, raw_step_s, own):
        if not math.isfinite(latency) or goodput <= 0:
            out["wall_modelled_s"] = math.inf
        else:
            stretch = (raw_comm_s or 0.0) * (1 / goodput - 1)
            out["wall_modelled_s"] = (steps * (raw_step_s + slope * latency + stretch)
                                      + max(0.0, wall - steps * own))
    return out


def fit_delay_slope(points: list[tuple[float, float]], level: float = 0.95) -> dict | None:
    """Least squares of step time (s) against per-hop one-way delay (s): {slope, intercept, slope_ci, n}, the
    interval Student's t with n - 2 degrees of freedom; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    x = np.array([d for d, _ in points], dtype=float)
    y = np.array([t for _, t in points], dtype=float)
    res = stats.linregress(x, y)
    t = float(stats.t.ppf(0.5 + level / 2, len(points) - 2))
    return {"slope": float(res.slope), "intercept": float(res.intercept), "slope_se": float(res.stderr),
            "slope_ci": (float(res.slope - t * res.stderr), float(res.slope + t * res.stderr)), "n": len(points),
            "r2": float(res.rvalue ** 2)}


def decision_table(rows: list[dict], slopes: dict[str, float | None], timeout_s: float | None = None) -> list[dict]:
    """One entry per (mode, profile, pre-FEC BER) over the rows with a profile, seeds pooled: the medians of the
    seeds' steps and wall times and their ranges over the seeds (None where a seed never reached the target), the
    delivered BER, the frames dropped or replayed, the goodput, `reached` (seeds that reached it / seeds) and
    `modelled_past_timeout` (the median modelled wall is past `timeout_s`, the experiment's point timeout).
    `slopes`: per mode."""
    by_id = {r["point"]: r for r in rows}
    raw = {(r.get("model"), r.get("mode"), r.get("seed")): (finite(r.get("median_step_time_s")),
                                                             finite(r.get("median_comm_time_s"))) for r in rows
           if r.get("profile") == "none" and finite(r.get("ber")) == 0 and r.get("status") == "ok"}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("profile") is None or finite(r.get("ber")) is None:
            continue
        clean = by_id.get(r.get("baseline"))
        raw_step, raw_comm = raw.get((r.get("model"), r.get("mode"), r.get("seed")), (None, None))
        t = point_time(r, clean, slopes.get(r.get("mode")), raw_step, raw_comm_s=raw_comm)
        t["seed"] = r.get("seed")
        groups.setdefault((r.get("model"), r.get("mode"), t["profile"], t["pre_fec_ber"]), []).append(t)
    out = []
    for (model, mode, prof, p), ts in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]),
                                                                               linklayer.PROFILE_NAMES.index(kv[0][2]),
                                                                               kv[0][3])):
        reached = [t for t in ts if t["steps_to_target"] is not None]

        def vals(key):
            v = [t[key] for t in reached if t[key] is not None]
            return v if v and len(v) == len(ts) else []

        def med(key):
            v = vals(key)
            return statistics.median(v) if v else None

        def span(key):
            v = vals(key)
            return (min(v), max(v)) if v else None

        delivered = [t["delivered_ber"] for t in ts if t["delivered_ber"] is not None]
        out.append({"model": model, "mode": mode, "profile": prof, "pre_fec_ber": p, "n_seeds": len(ts),
                    "reached": len(reached), "hop_latency_s": ts[0]["hop_latency_s"],
                    "delivered_ber": statistics.fmean(delivered) if delivered else None,
                    "frames_dropped": sum(t["frames_dropped"] or 0 for t in ts),
                    "frames_replayed": sum(t["frames_replayed"] or 0 for t in ts),
                    "steps_to_target": med("steps_to_target"), "step_time_s": med("step_time_s"),
                    "wall_measured_s": med("wall_measured_s"), "wall_modelled_s": med("wall_modelled_s"),
                    "wall_measured_range": span("wall_measured_s"), "wall_modelled_range": span("wall_modelled_s"),
                    "goodput": ts[0]["goodput"], "statuses": sorted({t["status"] for t in ts}),
                    "modelled_past_timeout": bool(timeout_s and (med("wall_modelled_s") or 0.0) > timeout_s)})
    return out


def winners(table: list[dict], key: str = "wall_modelled_s") -> dict[tuple, tuple[str, ...]]:
    """Per (model, mode, pre-FEC BER): the fastest profiles by `key`, among those every seed of which reached the
    target and whose modelled wall is within the point timeout (measured too: this machine replays frames at no
    cost, so a link that is down in effect can look fast here): the one with the least median first, then every
    other whose range over the seeds overlaps its range (a tie); () when none reached it."""

    def span(e: dict) -> tuple[float, float]:
        return e.get(key.removesuffix("_s") + "_range") or (e[key], e[key])

    cands: dict[tuple, list[dict]] = {}
    for e in table:
        k = (e["model"], e["mode"], e["pre_fec_ber"])
        cands.setdefault(k, [])
        v = e.get(key)
        if (v is not None and math.isfinite(v) and e["reached"] == e["n_seeds"]
                and not e.get("modelled_past_timeout")):
            cands[k].append(e)
    out = {}
    for k, es in cands.items():
        if not es:
            out[k] = ()
            continue
        es.sort(key=lambda e: e[key])
        hi = span(es[0])[1]
        out[k] = tuple(e["profile"] for e in es if e is es[0] or span(e)[0] <= hi)
    return out
