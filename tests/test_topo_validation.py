"""Bad topology files: each is refused with exit code 2 and one clear message naming the file, the field path
and the problem; nothing is created. Plus pure unit tests of units, addressing and routes."""

from __future__ import annotations

import ipaddress
import os

import pytest

from conftest import TOPOLOGIES, leftovers, tb_cli, unique_name
from testbed.topology import units
from testbed.topology.topo import Topology, TopologyError

GOOD = """name: {name}
topology:
  nodes:
    h1: {kind: host}
    h2: {kind: host}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
{extra}"""


def good(name: str, extra: str = "") -> str:
    return GOOD.replace("{name}", name).replace("{extra}", extra)

# (id, file text with {name}, field path that must be named, words the message must contain)
CASES = [
    ("unknown-key", GOOD.replace("{extra}", "      bandwidth: 10gbit\n"), "topology.links[0].bandwidth", "unknown key"),
    ("wrong-type", GOOD.replace("{extra}", "      mtu: big\n"), "topology.links[0].mtu", "integer"),
    ("ber-range", GOOD.replace("{extra}", "      ber: 0.7\n"), "topology.links[0].ber", "[0, 0.5]"),
    ("ber-negative", GOOD.replace("{extra}", "      ber: -1e-5\n"), "topology.links[0].ber", "[0, 0.5]"),
    ("negative-delay", GOOD.replace("{extra}", "      delay: -1ms\n"), "topology.links[0].delay", "negative"),
    ("mtu-range", GOOD.replace("{extra}", "      mtu: 40\n"), "topology.links[0].mtu", "68"),
    ("mtu-too-big", GOOD.replace("{extra}", "      mtu: 70000\n"), "topology.links[0].mtu", "65535"),
    ("rate-unparsable", GOOD.replace("{extra}", "      rate: fast\n"), "topology.links[0].rate", "cannot parse rate"),
    ("duration-unparsable", GOOD.replace("{extra}", "      delay: 1ms\n      jitter: 3 parsecs\n"),
     "topology.links[0].jitter", "cannot parse duration"),
    ("loss-range", GOOD.replace("{extra}", "      loss: 150%\n"), "topology.links[0].loss", "between 0 and 1"),
    ("duplicate-node", """name: {name}
topology:
  nodes:
    h1: {kind: host}
    h1: {kind: host}
  links: []
""", "", "duplicate key 'h1'"),
    ("unknown-endpoint-node", GOOD.replace('["h1:eth1", "h2:eth1"]', '["h1:eth1", "h3:eth1"]').replace("{extra}", ""),
     "topology.links[0].endpoints[1]", "unknown node 'h3'"),
    ("interface-used-twice", GOOD.replace("{extra}", '    - endpoints: ["h1:eth1", "h2:eth2"]\n'),
     "topology.links[1].endpoints[0]", "already used"),
    ("ifname-too-long", GOOD.replace('"h2:eth1"', '"h2:averyverylongname"').replace("{extra}", ""),
     "topology.links[0].endpoints[1]", "at most 15"),
    ("missing-name", GOOD.replace("name: {name}\n", "").replace("{extra}", ""), "name", "required"),
    ("bad-topology-name", GOOD.replace("name: {name}", "name: Bad Name!").replace("{extra}", ""), "name", "1-24 characters"),
    ("bad-scope", GOOD.replace("{extra}", "      ber: 1e-5\n      scope: bits\n"), "topology.links[0].scope",
     "'payload', 'all' or 'tensor'"),
    ("unknown-direction", GOOD.replace("{extra}", "      directions:\n        h1->h3: {ber: 1e-4}\n"),
     "topology.links[0].directions.h1->h3", "unknown direction"),
    ("ge-needs-burst", GOOD.replace("{extra}", "      ber: 1e-5\n      error_model: gilbert_elliott\n"),
     "topology.links[0].error_model.burst_length", "burst_length"),
    ("collectives-need-tensor", GOOD.replace("{extra}", "      ber: 1e-5\n      collectives: [allreduce]\n"),
     "topology.links[0].collectives", "scope: tensor"),
    ("nested-key", GOOD.replace("h2: {kind: host}", "{h2: 1}: {kind: host}").replace("{extra}", ""), "",
     "plain name"),
    ("ge-mean-too-high", GOOD.replace("{extra}", "      ber: 0.5\n      error_model: {type: gilbert_elliott, burst_length: 64}\n"),
     "topology.links[0].error_model", "bad_ber"),
    ("not-yaml", "name: {name}\ntopology: [unclosed\n", "", "not valid YAML"),
    ("self-link", GOOD.replace('"h2:eth1"', '"h1:eth2"').replace("{extra}", ""), "topology.links[0].endpoints",
     "two different nodes"),
    ("subnet-overlap", GOOD.replace("{extra}", "      subnet: 10.255.1.0/24\n"), "topology.links[0].subnet",
     "management subnet"),
    ("address-outside-subnet", """name: {name}
topology:
  nodes:
    h1: {addresses: {eth1: 192.168.7.1/24}}
    h2: {}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
""", "topology.nodes.h1.addresses.eth1", "not in this segment's subnet"),
    ("switch-loop", """name: {name}
topology:
  nodes: {s1: {kind: switch}, s2: {kind: switch}, h1: {}}
  links:
    - endpoints: ["s1:p1", "s2:p1"]
    - endpoints: ["s1:p2", "s2:p2"]
    - endpoints: ["h1:eth1", "s1:p3"]
""", "topology.links[1]", "loop"),
]


@pytest.mark.parametrize("case_id,text,field,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_topology_is_refused(tmp_path, case_id, text, field, words):
    name = unique_name("bad")
    path = tmp_path / f"{case_id}.yaml"
    path.write_text(text.replace("{name}", name))
    r = tb_cli("up", str(path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    msg = r.stderr.strip()
    assert str(path) in msg, msg
    assert f": {field}: " in msg or (not field and words in msg), msg
    assert words in msg, msg
    assert "Traceback" not in msg
    assert not leftovers(name)
    assert not os.path.exists(f"/run/testbed/{name}")


def test_error_names_the_line(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(good("x", "      ber: 0.9\n"))
    with pytest.raises(TopologyError) as e:
        Topology.load(path)
    assert f"{path}:8: topology.links[0].ber:" in str(e.value)


def test_shipped_topologies_load():
    for f in ("pair", "ring4", "chain4", "star8"):
        t = Topology.load(TOPOLOGIES / f"{f}.yaml")
        assert t.name == f
    assert len(Topology.load(TOPOLOGIES / "star8.yaml").hosts) == 8


def test_ring_routes_take_shortest_paths():
    t = Topology.load(TOPOLOGIES / "ring4.yaml")
    # h1's neighbours are h2 (eth1) and h4 (eth2); the h3-h4 subnet is one hop away through h4.
    r = {str(x.dst): (str(x.via), x.dev) for x in t.plan.routes["h1"]}
    h4_on_h4h1 = next(i.address.ip for i in t.plan.interfaces["h4"] if i.link == "h4-h1")
    h3h4 = next(i.address.network for i in t.plan.interfaces["h3"] if i.link == "h3-h4")
    assert r[str(h3h4)] == (str(h4_on_h4h1), "eth2")
    assert len(t.plan.routes["h1"]) == 2  # four segments, two direct


def test_addresses_can_be_overridden(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("""name: ov
topology:
  nodes:
    h1: {addresses: {eth1: 192.168.7.10/24}}
    h2: {}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
      subnet: 192.168.7.0/24
""")
    t = Topology.load(path)
    assert t.plan.interfaces["h1"][0].address == ipaddress.IPv4Interface("192.168.7.10/24")
    assert t.plan.interfaces["h2"][0].address.network == ipaddress.IPv4Network("192.168.7.0/24")


def test_per_direction_settings_and_seeds(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(good("d", "      ber: 1e-5\n      directions:\n        h2->h1: {ber: 1e-4, checksum: keep}\n"))
    t = Topology.load(path)
    link = t.link("h1-h2")
    assert (link.forward.ber, link.forward.checksum) == (1e-5, "fix")
    assert (link.reverse.ber, link.reverse.checksum) == (1e-4, "keep")
    assert link.forward.seed != link.reverse.seed
    assert Topology.load(path).link("h1-h2").forward.seed == link.forward.seed  # stable across loads


def test_error_model_forms(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(good("em", "      ber: 1e-5\n      error_model: bernoulli\n"))
    assert Topology.load(path).link("h1-h2").forward.error_model == {"type": "bernoulli"}
    path.write_text(good("em", "      ber: 1e-5\n      error_model: {type: gilbert_elliott, burst_length: 64}\n"))
    assert Topology.load(path).link("h1-h2").forward.error_model == {"type": "gilbert_elliott", "burst_length": 64}


@pytest.mark.parametrize("text,bps", [("10gbit", 10_000_000_000), ("100 Mbit/s", 100_000_000), ("1.5kbit", 1500),
                                      (2_000_000, 2_000_000)])
def test_parse_rate(text, bps):
    assert units.parse_rate(text) == bps


@pytest.mark.parametrize("bad", ["fast", "10gbps", "-5mbit", True])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError):
        units.parse_rate(bad)


@pytest.mark.parametrize("text,s", [("100us", 1e-4), ("1.5ms", 1.5e-3), ("2s", 2.0), (0, 0.0), ("250ns", 2.5e-7)])
def test_parse_duration(text, s):
    assert units.parse_duration(text) == pytest.approx(s)


def test_parse_fraction_and_probability():
    assert units.parse_fraction("0.5%") == pytest.approx(0.005)
    assert units.parse_probability("1e-5", upper=0.5) == 1e-5
    with pytest.raises(ValueError):
        units.parse_duration(5)  # a bare number is ambiguous


def test_with_run_seed_mixes_the_run_seed_into_every_directions_seed():
    """link_seed run (docs/experiments.md, "What a seed varies"): every direction's seed changes with the run seed,
    a link's own `seed:` too, deterministically, and the directions keep distinct streams."""
    from testbed.topology.topo import Topology

    raw = {"name": "rs", "seed": 7, "topology": {
        "nodes": {n: {"kind": "host"} for n in ("a", "b", "c")},
        "links": [{"endpoints": ["a:eth1", "b:eth1"], "ber": 1e-5},
                  {"endpoints": ["b:eth2", "c:eth1"], "ber": 1e-5, "seed": 11}]}}
    topo = Topology.from_dict(raw)

    def seeds(t):
        return [imp.seed for link in t.links for _, _, _, imp in link.directions()]

    base, one, one_again, two = seeds(topo), seeds(topo.with_run_seed(1)), seeds(topo.with_run_seed(1)), seeds(
        topo.with_run_seed(2))
    assert one == one_again
    # the first link's two directions derive their own seeds; the second's `seed: 11` is both directions' (the
    # file's choice, kept): every run seed mixes into each of them, giving values no other run seed gives
    assert base[3] == base[2] == 11 and one[2] == one[3] != 11
    assert len(set(base)) == 3 and len(set(one)) == 3 and len(set(two)) == 3 and not (set(one) & set(two))
    assert not (set(base) & set(one))
