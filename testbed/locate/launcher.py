"""The launcher's side of fault localisation (`--monitor`), used by testbed/experiments/training.py:

- monitor.json in the run directory: which host each rank runs on and the link directions each probed hop
  crosses (paths.py), so that `testbed locate` can name links. Structure only: no link's settings.
- monitor-engines.jsonl: the engines' counters per link direction (bits flipped, packets modified), sampled
  every SAMPLE_S while the workers run. This is the ground truth of where errors happened (and what a PHY's
  error counters would show); the detectors do not read it, `testbed locate` prints it beside them.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..fileio import write_json_atomic
from .detectors import ENGINES_FILE, MONITOR_FILE
from .paths import hop_paths, link_directions

SAMPLE_S = 0.5
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
    write_json_atomic(run_dir / MONITOR_FILE, describe(tb.topo, hosts))
    stop = threading.Event()

    def sample():
        with open(run_dir / ENGINES_FILE, "a") as f:
            while True:
                try:
                    snap = tb.counters()
                except Exception:  # the topology is going down: the last sample is already written
                    return
                row = {"time": time.time(), "engines": {k: {x: v.get(x) for x in ENGINE_FIELDS}
                                                        for k, v in snap.items()}}
                f.write(json.dumps(row) + "\n")
                f.flush()
                if stop.wait(SAMPLE_S):
                    return

    t = threading.Thread(target=sample, daemon=True, name="engine-sampler")
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)


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
