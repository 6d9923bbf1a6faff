"""Faults to localise: one link of a topology at an elevated BER, the others at a background BER.

The link is drawn per seed (`pick_link`), reproducibly, among the links that carry an engine; which one it was
is recorded as the ground truth (results' `fault_link`) and never given to the detectors.
"""

from __future__ import annotations

import random

from testbed.topology.topo import Topology


def candidate_links(topo: Topology) -> list[str]:
    return [l.name for l in topo.links if not topo.nodes[l.a.node].kind == topo.nodes[l.b.node].kind == "switch"]


def pick_link(topo: Topology, seed: int, salt: str = "") -> str:
    """One link, uniformly at random from a stream keyed by (salt, topology name in its file, seed): the same
    for a seed's keep and fix points, different across seeds."""
    base = topo.raw.get("name", topo.name)
    return random.Random(f"{salt}/{base}/{seed}").choice(candidate_links(topo))


def with_fault(topo: Topology, link: str, ber: float, background_ber: float = 0.0, **settings) -> Topology:
    """`topo` with `settings` (scope, checksum, collectives, ...) on every link, BER `background_ber` on every
    link and `ber` on both directions of `link`. Every link gets an engine (also at BER 0), so that the bad
    link differs from the others only by its errors, not by the engine's own latency."""
    if link not in candidate_links(topo):
        raise ValueError(f"no link {link!r} that can carry errors in {topo.name} (links: "
                         f"{', '.join(candidate_links(topo))})")
    base = topo.with_overrides(ber=background_ber, **settings)
    raw = {**base.raw, "topology": {**base.raw["topology"], "links": [dict(l) for l in base.raw["topology"]["links"]]}}
    for entry, resolved in zip(raw["topology"]["links"], base.links):
        if resolved.name == link:
            entry["ber"] = ber
    return Topology.from_dict(raw, file=topo.file)
