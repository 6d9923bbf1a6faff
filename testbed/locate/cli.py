"""`testbed locate RUN_DIR [--json]`: each detector's suspect links for a monitored training run."""

from __future__ import annotations

import json
from pathlib import Path

from testbed.errors import EXIT_INPUT, CliError


def format_result(result: dict, flips: dict[str, int] | None = None, top: int = 3) -> str:
    """Readable text: per detector its confident call (or none) and its top suspects."""
    lines = [f"{result['topology']}: {len(result['hosts'])} ranks ({', '.join(result['hosts'])}), "
             f"{result['steps_observed']} monitored steps"]
    ct = result.get("collective_time_s") or {}
    if ct:
        lines.append("collective time per step (median, per host): "
                     + ", ".join(f"{h} {v * 1e3:.1f} ms" for h, v in ct.items())
                     + " (a ring waits for its slowest hop: these cannot name a link)")
    for name, r in result["detectors"].items():
        det = r["detection"]
        call = (f"confident at step {det['step']}: {det['link']}"
                + (f" ({det['direction'].split('/')[1]})" if det.get("direction") else "")
                if det else "no confident call")
        lines.append(f"{name}: {call}")
        for s in r["suspects"][:top]:
            d = f" {s['direction'].split('/')[1]}" if s.get("direction") else ""
            lines.append(f"    {s['link']}{d}  score {s['score']:.3g}")
        lines.append(f"    score: {r['score_unit']}; sees {r['sees']}")
    if flips is not None:
        hit = {k: v for k, v in flips.items() if v}
        lines.append("engines (ground truth, not read by the detectors): "
                     + (", ".join(f"{k} {v:,} bits flipped" for k, v in sorted(hit.items())) or "no bits flipped"))
    return "\n".join(lines)


def cmd_locate(args) -> int:
    from testbed.locate.detectors import NotMonitored, load, locate
    from testbed.locate.launcher import engine_flips

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CliError(f"{run_dir}: not a directory (a run directory of `testbed train --monitor --out DIR`)",
                       EXIT_INPUT)
    try:
        result = locate(load(run_dir))
    except NotMonitored as e:
        raise CliError(str(e), EXIT_INPUT) from None
    flips = engine_flips(run_dir)
    actions = actions_taken(run_dir)
    if args.json:
        print(json.dumps({**result, "engine_flips": flips, "actions": actions}, indent=2))
    else:
        print(format_result(result, flips))
        for a in actions:
            fmt = lambda v: f"{v:.3f} s" if v is not None else "-"  # noqa: E731
            print(f"action ({a['detector']}, confident at step {a['detection_step']}): {a['action']} {a['link']}, "
                  f"in force from step {a['first_step_after']}; median step time {fmt(a['step_time_before_s'])} "
                  f"over {a['steps_before']} steps before, {fmt(a['step_time_after_s'])} over {a['steps_after']} "
                  "after")
    return 0


def actions_taken(run_dir: Path) -> list[dict]:
    """The launcher's actions on detections (on_detection), each with the step times before and after it."""
    from testbed.fileio import read_jsonl
    from testbed.locate.detectors import ACTIONS_FILE, recovery

    path = run_dir / ACTIONS_FILE
    if not path.exists():
        return []
    files = [run_dir / "metrics.jsonl"] if (run_dir / "metrics.jsonl").exists() else sorted(
        run_dir.glob("metrics-rank*.jsonl"))
    rows = [r for f in files for r in read_jsonl(f)]
    return [recovery(a, rows) for a in read_jsonl(path)]


def register(sub) -> None:
    s = sub.add_parser("locate", help="find the bad link of a monitored training run",
                       description="Print each detector's suspect links (timing: probe times per hop; "
                                   "consistency: checksum mismatches per hop; counters: TCP retransmissions and "
                                   "checksum drops per host) for a run of `testbed train --monitor`, finished or "
                                   "still running. The engines' flip counters are printed beside them as the "
                                   "ground truth; the detectors never read them. Details: docs/locate.md.")
    s.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (`testbed train --out DIR`, or an "
                   "experiment's points/POINT)")
    s.add_argument("--json", action="store_true", help="the detectors' full results as JSON")
    s.set_defaults(fn=cmd_locate)
