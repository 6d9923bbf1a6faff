"""Placement of nodes on machines and the part each machine builds (pure logic, no root)."""

from __future__ import annotations

import pytest

from conftest import TOPOLOGIES
from testbed.machines.placement import VNI_BLOCK, MachineView, parts, place, vni_base
from testbed.link import VXLAN_OVERHEAD
from testbed.topology.topo import Topology, TopologyError


def load(name):
    return Topology.load(TOPOLOGIES / name)


def views(*names, mtu=1500):
    return {m: MachineView(m, f"192.0.2.{11 + i}", mtu) for i, m in enumerate(names)}


def test_pair_on_two_machines_is_split_and_a_ring_is_cut_into_runs():
    assert place(load("pair.yaml"), ["m1", "m2"]) == {"h1": "m1", "h2": "m2"}
    assert place(load("ring4.yaml"), ["m1", "m2"]) == {"h1": "m1", "h2": "m1", "h3": "m2", "h4": "m2"}
    # three machines: all used, the ring cut into runs
    assert place(load("ring4.yaml"), ["m1", "m2", "m3"]) == {"h1": "m1", "h2": "m1", "h3": "m2", "h4": "m3"}
    # one machine: everything there; more machines than nodes: one each, the rest unused
    assert set(place(load("ring4.yaml"), ["m1"]).values()) == {"m1"}
    assert sorted(place(load("pair.yaml"), ["a", "b", "c"]).values()) == ["a", "b"]


def test_star_keeps_hosts_near_their_switch_within_shares():
    topo = load("star8.yaml")
    where = place(topo, ["m1", "m2", "m3"])
    share = -(-len(topo.nodes) // 3)
    assert all(0 < list(where.values()).count(m) <= share for m in ("m1", "m2", "m3"))
    assert set(where) == set(topo.nodes)


def test_a_node_that_names_a_machine_runs_there(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("name: t\ntopology:\n  nodes:\n    h1: {machine: m2}\n    h2: {}\n"
                 "  links:\n    - endpoints: [h1:eth1, h2:eth1]\n")
    where = place(Topology.load(f), ["m1", "m2"])
    assert where == {"h1": "m2", "h2": "m1"}
    f.write_text("name: t\ntopology:\n  nodes:\n    h1: {}\n    h2:\n      machine: nowhere\n"
                 "  links:\n    - endpoints: [h1:eth1, h2:eth1]\n")
    with pytest.raises(TopologyError) as e:
        place(Topology.load(f), ["m1", "m2"])
    assert f"{f.resolve()}:6: topology.nodes.h2.machine: unknown machine 'nowhere' (inventory: m1, m2)" in str(e.value)


def test_parts_give_each_cross_machine_link_one_tunnel_with_matching_ends():
    topo = load("ring4.yaml")
    where = place(topo, ["m1", "m2"])
    specs, notes = parts(topo, where, views("m1", "m2"))
    assert specs["m1"]["nodes"] == ["h1", "h2"] and specs["m2"]["nodes"] == ["h3", "h4"]
    crossing = {l.name for l in topo.links if where[l.a.node] != where[l.b.node]}
    assert set(specs["m1"]["tunnels"]) == set(specs["m2"]["tunnels"]) == crossing and len(crossing) == 2
    for name in crossing:
        a, b = specs["m1"]["tunnels"][name], specs["m2"]["tunnels"][name]
        assert a["vni"] == b["vni"] and a["remote"] == "192.0.2.12" and b["remote"] == "192.0.2.11"
        assert a["mtu"] == b["mtu"] == 1500 - VXLAN_OVERHEAD
    assert len({t["vni"] for t in specs["m1"]["tunnels"].values()} | {specs["m1"]["mgmt"]["vni"]}) == 3
    assert specs["m1"]["mgmt"]["remotes"] == ["192.0.2.12"]
    assert len(notes) == 2 and "MTU 1450 instead of 1500" in notes[0]
    # a jumbo underlay leaves the link's own MTU alone
    specs, notes = parts(topo, where, views("m1", "m2", mtu=9000))
    assert {t["mtu"] for t in specs["m1"]["tunnels"].values()} == {1500} and notes == []


def test_vni_blocks_differ_between_topologies_and_stay_in_range():
    bases = {vni_base(f"t{i}") for i in range(200)}
    assert len(bases) >= 195  # these 200 names: 2 pairs share a block (up reports a clash as a VNI in use)
    assert all(1 <= b and b + VNI_BLOCK - 1 < 2**24 for b in bases)
