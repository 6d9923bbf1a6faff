"""What engines count, as the rest of the testbed reads it: the counter fields of a stats snapshot, the
settings `links_restored` puts back, `counter_delta` between two snapshots (``Testbed.counters()``), and how
many NFQUEUE engine processes serve a host (``engine_procs``). Plain data: importing this module loads no
engine."""

from __future__ import annotations

import os
from typing import Iterable

# Counters that `counter_delta` subtracts by default (what a training summary reports per link direction).
# queue_dropped/user_dropped: packets the kernel dropped on the way to an NFQUEUE engine (its queue full, its
# socket overrun): loss the engine caused, kept apart from the link's (docs/engine.md, "Counters").
COUNTER_FIELDS = ("bits_seen", "bits_flipped", "packets_modified", "flows_desynced", "queue_dropped", "user_dropped")
# Tensor-scope engines also count flips by field of the value and the unprotected bits they saw.
FIELD_COUNTERS = ("bits_exposed", "flips_sign", "flips_exponent", "flips_mantissa")
# Engines under a link profile (testbed/linklayer.py) also count the frames they dropped (a failed codeword's,
# marked) or had replayed (link-level retry), and a FEC profile's codewords and failed codewords.
PROFILE_COUNTERS = ("frames_dropped", "frames_replayed", "codewords", "codewords_failed")
# What `counter_delta` copies as it is from the later snapshot (the settings in force at its end).
COUNTER_KEPT = ("link", "direction", "alive", "ber", "scope", "checksum")
# Live-settable engine settings that `links_restored` puts back.
RESTORED_SETTINGS = ("ber", "error_model", "scope", "checksum", "seed", "collectives", "element", "protect",
                     "protected_ber")
# NFQUEUE engine processes: one per host namespace serving all of its corrupted directions, or one per direction
# (docs/engine.md, "Engine processes"; benchmarks/bench_engine_procs.py measured both). TESTBED_ENGINE_PROCS or
# `up --engine-procs` chooses.
ENGINE_PROCS = ("host", "direction")
DEFAULT_ENGINE_PROCS = "host"


def engine_procs_default() -> str:
    v = os.environ.get("TESTBED_ENGINE_PROCS") or DEFAULT_ENGINE_PROCS
    if v not in ENGINE_PROCS:
        raise ValueError(f"TESTBED_ENGINE_PROCS must be one of {', '.join(ENGINE_PROCS)}, got {v!r}")
    return v


def counter_delta(before: dict[str, dict], after: dict[str, dict],
                  fields: Iterable[str] = COUNTER_FIELDS) -> dict[str, dict]:
    """Per "link/direction" of `after` (two `Testbed.counters()` snapshots): each of `fields` as after minus
    before (an engine started in between counts from 0), plus link, direction, alive, ber, scope and checksum
    as they were at `after`. An engine gone by `after` is left out."""
    fields = tuple(fields)
    out = {}
    for key, s in after.items():
        b = before.get(key, {})
        d = {f: s.get(f) for f in COUNTER_KEPT}
        d["link"] = d["link"] or key.split("/")[0]
        d["direction"] = d["direction"] or key.split("/")[1]
        d["alive"] = s.get("alive", True)
        d.update({f: (s.get(f) or 0) - (b.get(f) or 0) for f in fields})
        out[key] = d
    return out
