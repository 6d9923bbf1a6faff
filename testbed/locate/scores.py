"""The score table of a fault-localisation experiment (report.md's "Fault localisation" section), from the
results rows alone. A cell is (recipe = topology here, mode, checksum, BER): its faulty runs, one link at that BER
each; the clean runs (BER 0) of the same (recipe, mode, checksum) are shared by that config's cells. Per cell and
detector: top-1 detection rate with a Clopper-Pearson interval, wrong calls, no calls, the step of the first
correct call (median, with a distribution-free interval) and the false alarms on the clean runs."""

from __future__ import annotations

import statistics

from scipy.stats import beta, binom

from testbed.locate.detectors import DETECTORS

CONFIDENCE = 0.95


def clopper_pearson(k: int, n: int, conf: float = CONFIDENCE) -> tuple[float, float]:
    a = (1 - conf) / 2
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def median_interval(values, conf: float = CONFIDENCE) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval of the median from order statistics: [x(l), x(n+1-l)] of the
    sorted sample, with the largest l whose coverage, 1 - 2 P(B <= l-1) for B ~ Binomial(n, 1/2), is at least
    `conf` (exact for any continuous distribution, conservative for ties). Returns (lo, hi, coverage), or None
    when even [min, max] covers less than `conf` (n < 6 at 95 %)."""
    x = sorted(values)
    n = len(x)
    best = None
    for l in range(1, n // 2 + 1):
        coverage = 1 - 2 * float(binom.cdf(l - 1, n, 0.5))
        if coverage < conf:
            break
        best = (x[l - 1], x[n - l], coverage)
    return best


def score_table(rows: list[dict]) -> list[dict]:
    """One entry per cell and detector: {recipe, mode, checksum, ber, detector, faulty, correct, correct_ci,
    wrong, missed, ranked_first, steps (of the correct calls, 1 = after the first monitored step), steps_median,
    steps_ci, clean, false_alarms, false_alarm_ci}."""
    configs: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("locate") and r.get("status") in ("ok", "diverged"):
            configs.setdefault((r.get("recipe"), r.get("mode"), r.get("checksum")), []).append(r)
    out = []
    for (recipe, mode, checksum), rs in sorted(configs.items(), key=lambda kv: tuple(map(str, kv[0]))):
        clean = [r for r in rs if not r.get("fault_link") and not r.get("ber")]
        by_ber: dict[float, list[dict]] = {}
        for r in rs:
            if r.get("fault_link"):
                by_ber.setdefault(float(r.get("ber") or 0.0), []).append(r)
        for ber, faulty in sorted(by_ber.items()):
            for d in DETECTORS:
                sc = [r["locate"]["scores"].get(d) or {} for r in faulty]
                correct = [s for s in sc if s.get("correct")]
                wrong = [s for s in sc if s.get("detected") and not s.get("correct")]
                fa = sum(1 for r in clean if (r["locate"]["scores"].get(d) or {}).get("detected"))
                steps = sorted(s["step"] + 1 for s in correct)
                ci = median_interval(steps)
                out.append({"recipe": recipe, "mode": mode, "checksum": checksum, "ber": ber, "detector": d,
                            "faulty": len(faulty), "correct": len(correct),
                            "correct_ci": clopper_pearson(len(correct), len(faulty)),
                            "wrong": len(wrong), "missed": len(faulty) - len(correct) - len(wrong),
                            "ranked_first": sum(1 for r, s in zip(faulty, sc) if s.get("top") == r.get("fault_link")),
                            "steps": steps, "steps_median": statistics.median(steps) if steps else None,
                            "steps_ci": ci[:2] if ci else None, "clean": len(clean), "false_alarms": fa,
                            "false_alarm_ci": clopper_pearson(fa, len(clean)) if clean else None})
    return out


def _frac(k: int, n: int, ci) -> str:
    if not n:
        return "-"
    return f"{k}/{n} [{ci[0]:.2f}, {ci[1]:.2f}]"


def _steps(t: dict) -> str:
    if t["steps_median"] is None:
        return "-"
    ci = t["steps_ci"]
    return f"{t['steps_median']:g} [{ci[0]:g}, {ci[1]:g}]" if ci else f"{t['steps_median']:g} [-]"


def format_table(table: list[dict]) -> str:
    head = ["config", "BER", "detector", "faulty runs", "top-1 correct [95% CI]", "wrong call", "no call",
            "ranked first", "step of first correct call: median [95% CI]", "false alarms on clean runs [95% CI]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        cells = [f"{t['recipe']}/{t['mode']}/{t['checksum']}", f"{t['ber']:g}", t["detector"], str(t["faulty"]),
                 _frac(t["correct"], t["faulty"], t["correct_ci"]), str(t["wrong"]), str(t["missed"]),
                 str(t["ranked_first"]), _steps(t), _frac(t["false_alarms"], t["clean"], t["false_alarm_ci"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _totals(table: list[dict]) -> list[str]:
    """One line per detector: its correct calls per checksum mode (every topology and BER together) and its
    false alarms over every clean run."""
    out = []
    for d in DETECTORS:
        ts = [t for t in table if t["detector"] == d]
        clean = {(t["recipe"], t["mode"], t["checksum"]): (t["false_alarms"], t["clean"]) for t in ts}
        fa, n = sum(v[0] for v in clean.values()), sum(v[1] for v in clean.values())
        calls = []
        for checksum in sorted({t["checksum"] for t in ts}, key=str):
            cs = [t for t in ts if t["checksum"] == checksum]
            calls.append(f"{checksum} {sum(t['correct'] for t in cs)}/{sum(t['faulty'] for t in cs)}")
        alarms = f"{_frac(fa, n, clopper_pearson(fa, n))} false alarms on the clean runs" if n else "no clean run"
        out.append(f"- {d}: correct calls {', '.join(calls)} (every topology and BER together); {alarms}.")
    return out


def locate_section(rows: list[dict], plot_line: str | None = None) -> list[str]:
    """report.md's section; empty when no point was monitored. plot_line: the detection-vs-BER plot's line."""
    table = score_table(rows)
    if not table:
        return []
    return ["## Fault localisation", "",
            "Each faulty point had one link (drawn per seed, both directions) at its BER and every other link at the "
            "background BER; clean points had every link at BER 0 (engines on every link either way). A cell is "
            "(config, BER); the clean runs of a config are shared by its BERs (the false-alarm column repeats). A "
            "detector is *correct* when the first link it became confident about is the bad one, *wrong* when it "
            "named another, *no call* when it never became confident; *ranked first*: its final top suspect was the "
            "bad link, confident or not. Step of the first correct call: the monitored steps it needed (1 = after "
            "the first), over the correct calls; its interval is the distribution-free order-statistic interval of "
            "the median ([x(l), x(n+1-l)], l from the Binomial(n, 1/2) quantile; \"[-]\" with fewer than 6 correct "
            "calls, where even [min, max] covers less than 95 %). A false alarm: any confident call on a clean point. "
            "Rates: Clopper-Pearson 95 %. Detectors, their frozen parameters and what each can see: docs/locate.md.",
            "", format_table(table), ""] + _totals(table) + [""] + ([plot_line, ""] if plot_line else [])
