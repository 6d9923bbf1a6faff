"""The launcher's side of fault localisation (`--monitor`), used by testbed/experiments/training.py:

- monitor.json in the run directory: which host each rank runs on and the link directions each probed hop
  crosses (paths.py), so that `testbed locate` can name links. Structure only: no link's settings.
- monitor-engines.jsonl: the engines' counters per link direction (bits flipped, packets modified), sampled
  every SAMPLE_S while the workers run. This is the ground truth of where errors happened (and what a PHY's
  error counters would show); the detectors do not read it, `testbed locate` prints it beside them.
- with on_detection clean: the detectors run on rank 0's collection as it grows (looked at every POLL_S); when
  the first becomes confident, the link it names gets BER 0 on both directions (tb.set_link, what `testbed link
  set` does), once, logged in monitor-actions.jsonl. The run goes on: `testbed locate` compares step times
  before and after.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from testbed.fileio import append_jsonl, write_json_atomic
from testbed.locate import detectors
from testbed.locate.detectors import ACTIONS_FILE, ENGINES_FILE, MONITOR_FILE, RANKS_FILE
from testbed.locate.paths import hop_paths, link_directions

SAMPLE_S = 0.5  # the engines' counters
POLL_S = 0.05  # rank 0's collection, while an action on a detection is still to come
ENGINE_FIELDS = ("bits_seen", "bits_flipped", "packets_modified")


def describe(topo, hosts: list[str]) -> dict:
    return {"topology": topo.name, "hosts": list(hosts), "paths": hop_paths(topo, hosts),
            "directions": link_directions(topo)}


@contextmanager
def monitoring(tb, cfg, run_dir, hosts: list[str]):
    """While the workers run: monitor.json written first, the engines' counters sampled into
    monitor-engines.jsonl. Does nothing unless cfg.monitor."""
    if not getattr(cfg, "monitor", False):
        yield
        return
    run_dir = Path(run_dir)
    for name in (ENGINES_FILE, ACTIONS_FILE, RANKS_FILE):  # an earlier run's, in the same directory
        (run_dir / name).unlink(missing_ok=True)
    write_json_atomic(run_dir / MONITOR_FILE, describe(tb.topo, hosts))
    stop = threading.Event()

    act = getattr(cfg, "on_detection", "none") != "none"
    collected = _Collected(run_dir)

    def sample():
        acted = not act
        due = 0.0  # when the engines' counters are sampled next
        with open(run_dir / ENGINES_FILE, "a") as f:
            while True:
                # rank 0's collection first and more often than the counters: an action lands within about a
                # step of its detection, not after the engines of every link were read (slow on a loaded host)
                if not acted and collected.read_new():
                    acted = act_on_detection(tb, run_dir, cfg.on_detection, collected)
                if time.monotonic() >= due:
                    try:
                        snap = tb.counters()
                    except Exception:  # the topology is going down: the last sample is already written
                        return
                    row = {"time": time.time(), "engines": {k: {x: v.get(x) for x in ENGINE_FIELDS}
                                                            for k, v in snap.items()}}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    due = time.monotonic() + SAMPLE_S
                if stop.wait(POLL_S if not acted else max(0.0, due - time.monotonic())):
                    return

    t = threading.Thread(target=sample, daemon=True, name="engine-sampler")
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)


class _Collected:
    """Rank 0's collection as it grows: each call reads only the lines appended since the last one (a whole
    re-read every SAMPLE_S would cost a long run's launcher more and more CPU beside its workers)."""

    def __init__(self, run_dir: Path):
        self.path, self.offset, self.records = run_dir / RANKS_FILE, 0, []
        self.meta = None

    def read_new(self) -> bool:
        """Whether whole new lines arrived."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return False
        end = data.rfind(b"\n") + 1  # a line being written waits for the next call
        if not end:
            return False
        self.records += [json.loads(ln) for ln in data[:end].splitlines() if ln.strip()]
        self.offset += end
        return True


def act_on_detection(tb, run_dir: Path, action: str, collected: _Collected) -> bool:
    """Run the detectors on what rank 0 has collected so far; on the first confident call (the earliest step;
    ties: timing, consistency, counters) clean the link it names. True once acted."""
    if collected.meta is None:
        collected.meta = json.loads((run_dir / MONITOR_FILE).read_text())
    result = detectors.locate(detectors.observations(collected.meta, collected.records))
    calls = [(r["detection"]["step"], i, name, r["detection"]) for i, (name, r) in
             enumerate(result["detectors"].items()) if r["detection"]]
    if not calls:
        return False
    step, _, name, det = min(calls)
    if action == "clean":
        tb.set_link(det["link"], ber=0.0)
    append_jsonl(run_dir / ACTIONS_FILE, {"time": time.time(), "action": action, "link": det["link"],
                                          "detector": name, "detection_step": step,
                                          "steps_observed": result["steps_observed"]})
    return True


def engine_flips(run_dir) -> dict[str, int]:
    """Bits flipped per link direction over the run, from the first and last samples (ground truth)."""
    path = Path(run_dir) / ENGINES_FILE
    if not path.exists():
        return {}
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip().endswith("}")]
    if not rows:
        return {}
    first, last = rows[0]["engines"], rows[-1]["engines"]
    return {k: (v.get("bits_flipped") or 0) - ((first.get(k) or {}).get("bits_flipped") or 0)
            for k, v in last.items()}
