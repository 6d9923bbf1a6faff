"""Calibration of the process injector against the wire: the same points run with both (experiments/calibrate.yaml),
compared point by point with a statistical test per quantity and a verdict. Pure functions on results.jsonl rows;
the report (report.py) renders `calibration_section`. docs/injector.md, "Calibration".

A point is (model, steps, ranks, mode, scope, checksum, BER, the BER-0 perturbation and the recipe's settings but the
injector): experiments/paper-regime.yaml holds four sizes, and its wire cross-check at GPT-2 124M must not pool with
mini's process rows at the same BER. Its wire and process rows are pooled over seeds:
- flips: given the bits each injector carried (B_w, B_p) and the flips (F_w, F_p), equal BERs make F_p, given
  F_w + F_p, Binomial(F_w + F_p, B_p / (B_w + B_p)) (two Poisson counts conditioned on their sum): exact two-sided
  binomial test. Each count is also shown against its expectation BER x bits.
- lost-step fraction: skipped updates over completed steps, pooled over seeds; two-proportion z-test (pooled
  variance); both fractions 0 (or both 1) agree trivially.
- eval loss: the ok runs' final eval losses, Welch's t-test on the two sets (needs 2 runs each); equal means
  with no spread agree.
A test disagrees when its p-value is below ALPHA; the verdict is `agree` when no test disagrees.
"""

from __future__ import annotations

import math
import statistics

from scipy import stats

from testbed.analysis.formatting import ber_text, fmt, fmt_loss, mode_name
from testbed.analysis.results import RECIPE_FIELDS, ber_of, finite, grid_order, is_ok, recipe_settings

# per test: the grid has ~3 tests x ~20 points, so 1e-3 keeps false disagreements of a clean calibration rare
ALPHA = 1e-3


def injector_of(row: dict) -> str:
    return row.get("injector") or "wire"  # rows from before the process injector were all wire


def _key(row: dict) -> tuple:
    setting = tuple((k, str(v)) for k, v in recipe_settings(row).items() if k in RECIPE_FIELDS)
    return (row.get("mode"), row.get("scope"), row.get("checksum"), ber_of(row), row.get("model"), row.get("steps"),
            row.get("world_size"), row.get("perturb") or "none", setting)


def _sum(rows, field):
    return sum(int(r.get(field) or 0) for r in rows)


def _ber(rows):
    return ber_of(rows[0]) if rows else 0.0


def flips_test(wire: list[dict], proc: list[dict]) -> dict:
    bw, bp = _sum(wire, "bits_seen"), _sum(proc, "bits_seen")
    fw, fp = _sum(wire, "bits_flipped"), _sum(proc, "bits_flipped")
    sw, sp = _sum(wire, "steps_completed"), _sum(proc, "steps_completed")
    p = None
    if bw and bp:
        p = 1.0 if fw + fp == 0 else float(stats.binomtest(fp, fw + fp, bp / (bw + bp)).pvalue)
    return {"bits_wire": bw, "bits_process": bp, "flips_wire": fw, "flips_process": fp,
            "per_step_wire": fw / sw if sw else None, "per_step_process": fp / sp if sp else None,
            "expected_per_step": float(_ber(wire)) * bw / sw if sw else None, "p": p}


def two_proportion_p(k1: int, n1: int, k2: int, n2: int) -> float | None:
    """Two-sided p-value of the pooled two-proportion z-test; 1 when both fractions are 0 or both 1."""
    if not n1 or not n2:
        return None
    pooled = (k1 + k2) / (n1 + n2)
    if pooled in (0.0, 1.0):
        return 1.0
    z = (k1 / n1 - k2 / n2) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return float(2 * stats.norm.sf(abs(z)))


def lost_test(wire: list[dict], proc: list[dict]) -> dict:
    kw, nw = _sum(wire, "skipped_steps"), _sum(wire, "steps_completed")
    kp, np_ = _sum(proc, "skipped_steps"), _sum(proc, "steps_completed")
    return {"wire": kw / nw if nw else None, "process": kp / np_ if np_ else None,
            "counts": (kw, nw, kp, np_), "p": two_proportion_p(kw, nw, kp, np_)}


def eval_test(wire: list[dict], proc: list[dict]) -> dict:
    ew = [v for v in (finite(r.get("final_eval_loss")) for r in wire if is_ok(r)) if v is not None]
    ep = [v for v in (finite(r.get("final_eval_loss")) for r in proc if is_ok(r)) if v is not None]
    out = {"wire": statistics.fmean(ew) if ew else None, "process": statistics.fmean(ep) if ep else None,
           "n": (len(ew), len(ep)), "p": None}
    if ew and ep:
        out["gap"] = out["process"] - out["wire"]
    if len(ew) >= 2 and len(ep) >= 2:
        if statistics.pstdev(ew) == statistics.pstdev(ep) == 0:
            out["p"] = 1.0 if out["gap"] == 0 else 0.0
        else:
            out["p"] = float(stats.ttest_ind(ep, ew, equal_var=False).pvalue)
    return out


def calibration(rows: list[dict], alpha: float = ALPHA) -> list[dict]:
    """One entry per point that both injectors ran, in grid order."""
    groups: dict[tuple, dict[str, list]] = {}
    first: dict[tuple, dict] = {}
    for r in sorted(rows, key=grid_order):
        k = _key(r)
        groups.setdefault(k, {"wire": [], "process": []}).setdefault(injector_of(r), []).append(r)
        first.setdefault(k, r)
    out = []
    for k, g in groups.items():
        wire, proc = g["wire"], g["process"]
        if not wire or not proc:
            continue
        tests = {"flips": flips_test(wire, proc), "lost": lost_test(wire, proc), "eval": eval_test(wire, proc)}
        off = [name for name, t in tests.items() if t["p"] is not None and t["p"] < alpha]
        walls = {name: [w for w in (finite(r.get("wall_time_s")) for r in rs) if w is not None]
                 for name, rs in (("wire", wire), ("process", proc))}
        out.append({"mode": k[0], "scope": k[1], "checksum": k[2], "ber": k[3], "model": k[4], "steps": k[5],
                    "seeds": (len(wire), len(proc)),
                    "statuses": ([r.get("status") for r in wire], [r.get("status") for r in proc]), **tests,
                    "wall_wire": statistics.median(walls["wire"]) if walls["wire"] else None,
                    "wall_process": statistics.median(walls["process"]) if walls["process"] else None,
                    "verdict": "agree" if not off else "disagree (" + ", ".join(off) + ")", "alpha": alpha})
    return out


def _p(x):
    return "—" if x is None else f"{x:.3g}"


def calibration_section(rows: list[dict], alpha: float = ALPHA) -> list[str]:
    """The markdown of the calibration: [] when no point ran with both injectors."""
    cal = calibration(rows, alpha)
    if not cal:
        return []
    head = ["size", "steps", "mode", "BER", "seeds w/p", "flips/step wire", "flips/step process", "expected",
            "p (flips)", "lost wire", "lost process", "p (lost)", "eval wire", "eval process", "p (eval)", "wall s w/p",
            "verdict"]
    body = []
    for c in cal:
        f, lo, ev = c["flips"], c["lost"], c["eval"]
        expected = f["expected_per_step"]
        body.append([str(c["model"] or "—"), str(c["steps"] or "—"), mode_name(c["mode"]), ber_text(c["ber"]),
                     f"{c['seeds'][0]}/{c['seeds'][1]}",
                     fmt(f["per_step_wire"]), fmt(f["per_step_process"]), fmt(expected), _p(f["p"]),
                     fmt(lo["wire"]), fmt(lo["process"]), _p(lo["p"]), fmt_loss(ev["wire"]), fmt_loss(ev["process"]),
                     _p(ev["p"]), f"{fmt(c['wall_wire'])}/{fmt(c['wall_process'])}", c["verdict"]])
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(cells) + " |" for cells in body]
    n_off = sum(c["verdict"] != "agree" for c in cal)
    return ["## Calibration: the process injector against the wire", "",
            f"{len(cal)} points ran with both injectors; {len(cal) - n_off} agree, {n_off} disagree (a test "
            f"disagrees below p = {alpha:g}). Flips: exact binomial test of the process injector's share of all "
            "flips against its share of the bits (equal BERs); expected = BER x the wire's bits per step. Lost "
            "steps: skipped / completed steps pooled over seeds, two-proportion z-test. Eval: final eval loss of "
            "the ok runs, Welch's t-test (2 runs each at least). Wall: median training wall time per run (workers "
            "only; the wire's topology up/down is not included). Method: docs/injector.md.", "", *table, ""]
