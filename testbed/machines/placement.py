"""Where each node of a topology runs when it is brought up across machines (`--machines FILE`), and what each
machine builds: its nodes, and one VXLAN tunnel end per link whose ends sit on different machines.

Placement is orthogonal to the runtime (netns or docker, on every machine). The rule, deterministic:
  1. a node that names a machine (`machine: m1`) runs there;
  2. the others, in the file's order, each go to the machine that already holds most of its neighbours (the
     far ends of its links), among the machines below their share (nodes // machines, one more for the first
     nodes % machines machines in the inventory's order); ties, and nodes with no placed neighbour, go to the
     least loaded machine, the first in the inventory's order.
So the ends of a link stay together where the shares allow, and a chain or ring is cut into contiguous runs.

Pure logic: nothing here touches the system. testbed/machines/cluster.py carries it out over SSH.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from testbed.link import VXLAN_OVERHEAD
from testbed.topology.topo import Topology, TopologyError

VXLAN_PORT = 4789  # IANA's VXLAN port; `up --vxlan-port` changes it
VNI_BLOCK = 1024  # VNIs per topology: its management segment and up to 1023 links


def place(topo: Topology, machines: list[str]) -> dict[str, str]:
    """node -> machine, by the rule in this module's docstring. Raises TopologyError for a node that names a
    machine the inventory lacks."""
    if not machines:
        raise ValueError("the inventory names no machine")
    problems = [(f"topology.nodes.{n}.machine", f"unknown machine {node.machine!r} (inventory: {', '.join(machines)})")
                for n, node in topo.nodes.items() if node.machine is not None and node.machine not in machines]
    if problems:
        raise TopologyError(topo.file or "<topology>", problems, _lines(topo))
    where = {n: node.machine for n, node in topo.nodes.items() if node.machine is not None}
    # shares: n // k nodes per machine, the first n % k machines one more (so every machine gets used)
    base, extra = divmod(len(topo.nodes), len(machines))
    share = {m: base + (1 if i < extra else 0) for i, m in enumerate(machines)}
    load = {m: sum(1 for v in where.values() if v == m) for m in machines}
    neighbours: dict[str, list[str]] = {n: [] for n in topo.nodes}
    for l in topo.links:
        neighbours[l.a.node].append(l.b.node)
        neighbours[l.b.node].append(l.a.node)
    for n in topo.nodes:
        if n in where:
            continue
        open_ = [m for m in machines if load[m] < share[m]] or machines
        near = {m: sum(1 for x in neighbours[n] if where.get(x) == m) for m in open_}
        best = max(open_, key=lambda m: (near[m], -load[m], -machines.index(m)))
        where[n] = best
        load[best] += 1
    return where


def _lines(topo: Topology) -> dict[str, int]:
    if not topo.file:
        return {}
    try:
        from testbed.topology.yamlfile import read_yaml

        return read_yaml(topo.file).lines
    except Exception:  # the file changed or is gone: the error still names the field
        return {}


def vni_base(topology: str) -> int:
    """The first VNI of a topology's block: the same on every machine, different for different names (a clash
    between two topologies on the same machines is reported by `up` as a VNI in use)."""
    return 1 + (zlib.crc32(topology.encode()) % ((2**24 - 1) // VNI_BLOCK - 1)) * VNI_BLOCK


@dataclass(frozen=True)
class MachineView:
    """What a machine reported about itself (`testbed machine-info`): how tunnels reach it."""

    name: str
    address: str  # underlay address the other machines send tunnels to
    mtu: int  # MTU of the underlay interface


def parts(topo: Topology, where: dict[str, str], views: dict[str, MachineView],
          vxlan_port: int = VXLAN_PORT) -> tuple[dict[str, dict], list[str]]:
    """The part spec of every machine that holds a node, and notes for the user (MTUs lowered).

    A part spec (JSON) says which nodes the machine builds, the tunnel of each cross-machine link that ends
    there (VNI, the far machine's underlay address, UDP port, MTU) and the management segment (VNI, every other
    machine's address). The MTU of a tunnelled link is its own MTU, lowered to fit both underlays less the
    encapsulation: both ends use the same value, and `up` says so."""
    used = sorted(set(where.values()), key=list(views).index)
    if len(topo.links) >= VNI_BLOCK:
        raise ValueError(f"topology {topo.name}: {len(topo.links)} links; across machines at most {VNI_BLOCK - 1}")
    base = vni_base(topo.name)
    notes: list[str] = []
    out: dict[str, dict] = {}
    for m in used:
        out[m] = {"machine": m, "nodes": [n for n in topo.nodes if where[n] == m], "tunnels": {},
                  "mgmt": {"vni": base, "port": vxlan_port,
                           "remotes": [views[o].address for o in used if o != m]},
                  "placement": dict(where)}
    for i, l in enumerate(topo.links):
        ma, mb = where[l.a.node], where[l.b.node]
        if ma == mb:
            continue
        mtu = min(l.mtu, views[ma].mtu - VXLAN_OVERHEAD, views[mb].mtu - VXLAN_OVERHEAD)
        if mtu < 68:
            raise ValueError(f"link {l.name}: the underlay MTUs of {ma} ({views[ma].mtu}) and {mb} ({views[mb].mtu}) "
                             f"leave no room for VXLAN's {VXLAN_OVERHEAD} bytes")
        if mtu < l.mtu:
            notes.append(f"link {l.name} ({ma} <-> {mb}): MTU {mtu} instead of {l.mtu} (VXLAN adds "
                         f"{VXLAN_OVERHEAD} bytes; underlay MTU {min(views[ma].mtu, views[mb].mtu)})")
        vni = base + 1 + i
        out[ma]["tunnels"][l.name] = {"vni": vni, "remote": views[mb].address, "port": vxlan_port, "mtu": mtu}
        out[mb]["tunnels"][l.name] = {"vni": vni, "remote": views[ma].address, "port": vxlan_port, "mtu": mtu}
    return out, notes



