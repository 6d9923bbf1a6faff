"""The score table of a fault-localisation experiment (report.md's "Fault localisation" section), from the
results rows alone: per config (recipe = topology here, checksum) and detector, top-1 accuracy on the faulty
points, steps to detection, false alarms on the clean ones."""

from __future__ import annotations

import statistics

from scipy.stats import beta

from testbed.locate.detectors import DETECTORS


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    a = (1 - conf) / 2
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def score_table(rows: list[dict]) -> list[dict]:
    """[{recipe, mode, checksum, detector, faulty, correct, wrong, missed, steps_median, clean, false_alarms}]"""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("locate") and r.get("status") in ("ok", "diverged"):
            groups.setdefault((r.get("recipe"), r.get("mode"), r.get("checksum")), []).append(r)
    out = []
    for (recipe, mode, checksum), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        faulty = [r for r in rs if r.get("fault_link")]
        clean = [r for r in rs if not r.get("fault_link") and not r.get("ber")]
        for d in DETECTORS:
            sc = [r["locate"]["scores"].get(d) or {} for r in faulty]
            correct = [s for s in sc if s.get("correct")]
            wrong = [s for s in sc if s.get("detected") and not s.get("correct")]
            fa = [r for r in clean if (r["locate"]["scores"].get(d) or {}).get("detected")]
            out.append({"recipe": recipe, "mode": mode, "checksum": checksum, "detector": d,
                        "ber": sorted({r.get("ber") for r in faulty}), "faulty": len(faulty),
                        "correct": len(correct), "wrong": len(wrong), "missed": len(faulty) - len(correct) - len(wrong),
                        "steps_median": statistics.median(s["step"] + 1 for s in correct) if correct else None,
                        "ranked_first": sum(1 for r, s in zip(faulty, sc) if s.get("top") == r.get("fault_link")),
                        "clean": len(clean), "false_alarms": len(fa)})
    return out


def _frac(k: int, n: int) -> str:
    if not n:
        return "-"
    lo, hi = clopper_pearson(k, n)
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def format_table(table: list[dict]) -> str:
    head = ["config", "detector", "faulty runs (BER)", "top-1 correct [95% CI]", "wrong call", "no call",
            "ranked first", "steps to detection (median)", "false alarms on clean runs [95% CI]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        ber = ",".join(f"{b:g}" for b in t["ber"]) or "-"
        steps = "-" if t["steps_median"] is None else f"{t['steps_median']:g}"
        lines.append(f"| {t['recipe']}/{t['mode']}/{t['checksum']} | {t['detector']} | {t['faulty']} ({ber}) | "
                     f"{_frac(t['correct'], t['faulty'])} | {t['wrong']} | {t['missed']} | {t['ranked_first']} | "
                     f"{steps} | {_frac(t['false_alarms'], t['clean'])} |")
    return "\n".join(lines)


def locate_section(rows: list[dict]) -> list[str]:
    """report.md's section; empty when no point was monitored."""
    table = score_table(rows)
    if not table:
        return []
    return ["## Fault localisation", "",
            "Each faulty point had one link (drawn per seed, both directions) at its BER and every other link at the "
            "background BER; clean points had every link at BER 0 (engines on every link either way). A detector "
            "is *correct* when the first link it became confident about is the bad one, *wrong* when it named "
            "another, *no call* when it never became confident; *ranked first*: its final top suspect was the bad "
            "link, confident or not. Steps to detection: the monitored steps it needed (1 = after the first). A "
            "false alarm: any confident call on a clean point. Intervals: Clopper-Pearson 95 %. Detectors and "
            "what each can see: docs/locate.md.", "", format_table(table), ""]
