"""What a topology is: a validated topology file resolved into nodes, links and the address/route plan.

Pure: nothing here touches the system. `Topology.load(path)` either returns a fully validated topology or
raises `TopologyError` naming the file, the line, the field path and the problem, so nothing is ever half-built
from bad input. The parts live in their own modules and are importable from here too:

- `testbed.topology.yamlfile`  reading YAML input files: duplicate keys refused, line numbers, `InputError`;
- `testbed.topology.schema`    the file's keys, types and ranges (pydantic);
- `testbed.topology.elements`  the resolved nodes, links and per-direction impairments;
- `testbed.topology.plan`      subnets, addresses and routes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.topology.elements import Endpoint, Link, LinkImpairment, Node
from testbed.topology.plan import HostInterface, Plan, Route, build_plan
from testbed.topology.schema import (COLLECTIVES, DEFAULT_CONTROL_PORTS, DEFAULT_DATA_POOL, DEFAULT_MGMT_SUBNET, TOPOLOGY_NAME_RE,
                     ErrorModelSpec, ImpairmentSpec, LinkModel, MgmtModel, NodeModel, OffloadSpec, TopologyBody,
                     TopologyFile)
from testbed.topology.yamlfile import InputError, YamlDocument, read_yaml

__all__ = [
    "COLLECTIVES", "DEFAULT_CONTROL_PORTS", "DEFAULT_DATA_POOL", "DEFAULT_MGMT_SUBNET", "IFNAMSIZ", "IFNAME_RE",
    "NODE_NAME_RE", "OFFLOAD_FEATURES", "RESERVED_IFNAMES", "TOPOLOGY_NAME_RE",
    "Endpoint", "ErrorModelSpec", "HostInterface", "ImpairmentSpec", "Link", "LinkImpairment", "LinkModel",
    "MgmtModel", "Node", "NodeModel", "OffloadSpec", "Plan", "Route", "Topology", "TopologyBody",
    "TopologyError", "TopologyFile",
]

NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
IFNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
IFNAMSIZ = 15  # the kernel's interface names hold at most 15 characters
RESERVED_IFNAMES = {"lo", "mgmt0", "br0"}
OFFLOAD_FEATURES = {"tso": "tso", "gso": "gso", "gro": "gro", "tx_checksum": "tx", "rx_checksum": "rx",
                    "sg": "sg"}

# Bad topology input. One error type for every input file of the project (experiment files too), so that the
# command line maps each to exit code 2; the historic name stays for the many callers that catch it.
TopologyError = InputError


@dataclass(frozen=True)
class Topology:
    name: str
    file: str | None
    runtime: str
    seed: int
    nodes: dict[str, Node]
    links: list[Link]
    control_ports: tuple[int, ...]
    mgmt_subnet: ipaddress.IPv4Network
    plan: Plan
    raw: dict = field(repr=False, compare=False, default_factory=dict)
    description: str | None = None

    @property
    def hosts(self) -> list[str]:
        return [n for n, v in self.nodes.items() if v.kind == "host"]

    @property
    def switches(self) -> list[str]:
        return [n for n, v in self.nodes.items() if v.kind == "switch"]

    def link(self, name: str) -> Link:
        for link in self.links:
            if link.name == name:
                return link
        raise KeyError(f"topology {self.name!r} has no link {name!r} (links: {', '.join(l.name for l in self.links)})")

    def engine_node(self, l: Link, direction: str) -> str:
        """The node whose namespace runs a direction's corruption (LinkEngines.site): the sending host, or the
        receiving host when a switch sends. Across machines, the machine of that node runs the engine."""
        _, snd, rcv, _ = l.direction(direction)
        return snd.node if self.nodes[snd.node].kind == "host" else rcv.node

    def with_overrides(self, name: str | None = None, runtime: str | None = None, **impairment: Any) -> "Topology":
        """A copy with another name/runtime and corruption settings applied to every link direction
        (e.g. `ber=1e-5, scope="tensor"`), validated like the file itself."""
        raw = _deepcopy(self.raw)
        if name:
            raw["name"] = name
        if runtime:
            raw["runtime"] = runtime
        settings = {k: v for k, v in impairment.items() if v is not None}
        cleared = set(settings)
        if settings.get("profile") is not None:  # a link layer: the BER given is the pre-FEC BER
            if "ber" in settings:
                settings["pre_fec_ber"] = settings.pop("ber")
            cleared |= {"ber", "error_model", "pre_fec_ber"}
        elif "ber" in settings:  # a plain BER replaces a profile the file may give
            cleared |= {"profile", "pre_fec_ber"}
        if settings:
            for link, resolved in zip(raw.get("topology", {}).get("links", []) or [], self.links):
                if self.nodes[resolved.a.node].kind == self.nodes[resolved.b.node].kind == "switch":
                    continue  # corruption runs in host namespaces; bridges between switches carry none
                for k in cleared:
                    link.pop(k, None)
                link.update(settings)
                for d in (link.get("directions") or {}).values():
                    for k in cleared:
                        d.pop(k, None)
        return Topology.from_dict(raw, file=self.file)

    def with_run_seed(self, run_seed: int) -> "Topology":
        """A copy whose every link direction's corruption seed has `run_seed` mixed in (a training run's
        `link_seed: run`): the file's `seed` and any link's or direction's own `seed:` alike, so that another run
        seed draws other flips on every link, and the same run seed the same ones."""
        raw = _deepcopy(self.raw)
        raw["seed"] = mix_run_seed(self.seed, run_seed)
        for link in raw.get("topology", {}).get("links", []) or []:
            for where in (link, *(link.get("directions") or {}).values()):
                if isinstance(where, dict) and where.get("seed") is not None:
                    where["seed"] = mix_run_seed(int(where["seed"]), run_seed)
        return Topology.from_dict(raw, file=self.file)

    # -- loading -------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> "Topology":
        doc = read_yaml(path)
        if name is not None and isinstance(doc.data, dict):
            doc.data["name"] = name
        topo = cls.from_dict(doc.data, file=doc.file, lines=doc.lines)
        return dataclasses.replace(topo, file=str(Path(path).resolve()))

    @classmethod
    def from_dict(cls, raw: Any, file: str | None = None, lines: dict[str, int] | None = None) -> "Topology":
        doc = YamlDocument(file if file is not None else "<topology>", raw, lines or {})
        if not isinstance(raw, dict):
            raise doc.error([("", "the file must hold a mapping with 'name' and 'topology'")])
        spec = doc.validate(TopologyFile)
        problems: list[tuple[str, str]] = []
        topo = _resolve(spec, raw, file, problems)
        if problems:
            raise doc.error(problems)
        return topo


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------------------
# Cross-field checks and resolution.


def _merge(base: ImpairmentSpec, over: ImpairmentSpec | None) -> dict:
    d = base.model_dump(include=set(ImpairmentSpec.model_fields))
    if over is not None:
        for k, v in over.model_dump(include=set(ImpairmentSpec.model_fields)).items():
            if v is not None:
                d[k] = v
    return d


def _impairment(d: dict, seed: int) -> LinkImpairment:
    em = d.get("error_model") or {"type": "bernoulli"}
    if not isinstance(em, dict):
        em = em.model_dump()
    em = {k: v for k, v in em.items() if v is not None}
    ber = d.get("ber")
    if d.get("profile") is not None and ber is None and d.get("error_model") is None:
        # a link layer over the pre-FEC BER: the engine draws at that BER and applies the profile (its model)
        ber, em = d.get("pre_fec_ber"), {"type": "profile", "profile": d["profile"]}
    return LinkImpairment(
        rate_bps=d.get("rate"), delay_s=d.get("delay"), jitter_s=d.get("jitter"), loss=d.get("loss"),
        ber=ber, error_model=em, scope=d.get("scope") or "payload", checksum=d.get("checksum") or "fix",
        seed=d["seed"] if d.get("seed") is not None else seed,
        collectives=tuple(d["collectives"]) if d.get("collectives") else None,
        element=d.get("element") or "fp32", protect=tuple(d["protect"]) if d.get("protect") else None,
        protected_ber=d.get("protected_ber") or 0.0, engine=d.get("engine") or "nfqueue",
    )


def _resolve(spec: TopologyFile, raw: dict, file: str | None, problems: list) -> Topology | None:
    body = spec.topology
    nodes: dict[str, Node] = {}
    for name, n in body.nodes.items():
        p = f"topology.nodes.{name}"
        if not NODE_NAME_RE.match(str(name)):
            problems.append((p, "node names are 1-32 characters of letters, digits, '_' or '-', "
                                "starting with a letter or digit"))
            continue
        if n.kind == "switch" and (n.image or n.cpus or n.memory or n.addresses or n.env):
            problems.append((p, "a switch is a Linux bridge: image, cpus, memory, addresses and env apply to hosts only"))
        if n.kind == "host" and n.subnet is not None:
            problems.append((f"{p}.subnet", "only a switch has a subnet (set a host-to-host link's subnet on the link)"))
        nodes[name] = Node(name=name, kind=n.kind, image=n.image, cpus=n.cpus, memory=n.memory, env=dict(n.env or {}),
                           machine=n.machine)
    if not any(n.kind == "host" for n in nodes.values()) and not problems:
        problems.append(("topology.nodes", "needs at least one node of kind host"))

    used_ifaces: dict[tuple[str, str], str] = {}
    links: list[Link] = []
    names: dict[str, str] = {}
    pair_count: dict[tuple[str, str], int] = {}
    for i, lm in enumerate(body.links):
        p = f"topology.links[{i}]"
        eps: list[Endpoint] = []
        for j, ep in enumerate(lm.endpoints):
            ep_path = f"{p}.endpoints[{j}]"
            if not isinstance(ep, str) or ep.count(":") != 1:
                problems.append((ep_path, f"endpoint must be written 'node:interface', got {ep!r}"))
                continue
            node, iface = ep.split(":")
            if node not in body.nodes:
                problems.append((ep_path, f"unknown node {node!r} (nodes: {', '.join(body.nodes)})"))
                continue
            if len(iface) > IFNAMSIZ:
                problems.append((ep_path, f"interface name {iface!r} is {len(iface)} characters; the kernel allows "
                                          f"at most {IFNAMSIZ}"))
                continue
            if not IFNAME_RE.match(iface) or iface in RESERVED_IFNAMES:
                problems.append((ep_path, f"invalid interface name {iface!r}" +
                                 (" (reserved by the testbed)" if iface in RESERVED_IFNAMES else "")))
                continue
            if (node, iface) in used_ifaces:
                problems.append((ep_path, f"interface {node}:{iface} is already used by {used_ifaces[(node, iface)]}"))
                continue
            used_ifaces[(node, iface)] = p
            eps.append(Endpoint(node, iface))
        if len(eps) != 2:
            continue
        a, b = eps
        if a.node == b.node:
            problems.append((f"{p}.endpoints", f"a link must join two different nodes (both ends on {a.node!r})"))
            continue
        both_switches = nodes.get(a.node) and nodes.get(b.node) and nodes[a.node].kind == nodes[b.node].kind == "switch"
        key = tuple(sorted((a.node, b.node)))
        pair_count[key] = pair_count.get(key, 0) + 1
        name = lm.name or (f"{a.node}-{b.node}" + (f".{pair_count[key]}" if pair_count[key] > 1 else ""))
        if name in names:
            problems.append((f"{p}.name", f"link name {name!r} is already used by {names[name]}"))
            continue
        names[name] = p
        if lm.subnet is not None and any(nodes.get(e.node) and nodes[e.node].kind == "switch" for e in eps):
            problems.append((f"{p}.subnet", "a link to a switch takes the switch's subnet (set it on the switch node)"))

        directions = {f"{a.node}->{b.node}": None, f"{b.node}->{a.node}": None}
        for dname, dspec in (lm.directions or {}).items():
            if dname not in directions:
                problems.append((f"{p}.directions.{dname}",
                                 f"unknown direction; this link's directions are {' and '.join(directions)}"))
                continue
            directions[dname] = dspec
        base_seed = _derive_seed(spec.seed, name)
        resolved = []
        for k, (dname, dspec) in enumerate(directions.items()):
            merged = _merge(lm, dspec)
            imp = _impairment(merged, base_seed + k)
            dp = f"{p}.directions.{dname}" if dspec is not None else p
            _check_profile(merged, dp, problems)
            _check_impairment(imp, dp, problems)
            if both_switches and imp.corrupts:
                problems.append((dp, "corruption runs in a host's namespace; a link between two switches cannot carry "
                                     "a ber (put the corruption on a host's link)"))
            resolved.append(imp)
        offloads = {k: v for k, v in (lm.offloads.model_dump() if lm.offloads else {}).items() if v is not None}
        links.append(Link(name=name, a=a, b=b, mtu=lm.mtu, offloads=offloads, forward=resolved[0], reverse=resolved[1]))

    if problems:
        return None
    _check_switch_loops(nodes, links, problems)
    plan = build_plan(spec, nodes, links, problems)
    if problems or plan is None:
        return None
    return Topology(
        name=spec.name, file=file, runtime=spec.runtime, seed=spec.seed, nodes=nodes, links=links,
        control_ports=tuple(spec.control_ports), mgmt_subnet=spec.mgmt.subnet, plan=plan, raw=_deepcopy(raw),
        description=spec.description,
    )


def mix_run_seed(seed: int, run_seed: int) -> int:
    """A link seed with a run seed mixed in (Topology.with_run_seed): stable across processes, below 2**61."""
    return _derive_seed(seed, f"run-seed/{run_seed}")


def _derive_seed(seed: int, link_name: str) -> int:
    # Stable across runs and Python processes (no hash randomisation): each link direction gets its own stream.
    h = 1469598103934665603
    for ch in f"{seed}/{link_name}".encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 61)
    return h


def _check_profile(d: dict, p: str, problems: list) -> None:
    """`profile` takes `pre_fec_ber` (the physical link's BER before the link layer), never `ber` (what is
    delivered follows from the profile) nor `error_model` (a profile's errors are its own)."""
    prof, pre = d.get("profile"), d.get("pre_fec_ber")
    if prof is None:
        if pre is not None:
            problems.append((f"{p}.pre_fec_ber", "pre_fec_ber needs a profile (none, rs544, rs544-pass, rs528, "
                                                 "rs272, llr); without one, give ber"))
        return
    if d.get("ber") is not None:
        problems.append((f"{p}.ber", f"profile {prof} takes pre_fec_ber (the physical link's BER), not ber"))
    elif pre is None:
        problems.append((f"{p}.pre_fec_ber", f"profile {prof} needs pre_fec_ber (the physical link's BER before "
                                             f"the link layer)"))
    if d.get("error_model") is not None:
        problems.append((f"{p}.error_model", f"profile {prof} draws its own errors (independent bits at the "
                                             f"pre-FEC BER, then the code): no error_model"))


def _check_impairment(imp: LinkImpairment, p: str, problems: list) -> None:
    if imp.jitter_s and not imp.delay_s:
        problems.append((f"{p}.jitter", "jitter needs a delay"))
    if imp.jitter_s and imp.delay_s and imp.jitter_s > imp.delay_s:
        problems.append((f"{p}.jitter", "jitter larger than the delay would need negative delays"))
    em = imp.error_model
    if imp.ber is not None:
        # The engine's own validation, so that what passes here also starts (no second, weaker copy).
        from testbed.engine.models import validate_error_model

        try:
            validate_error_model(em, imp.ber)
        except ValueError as e:
            field = "error_model.burst_length" if "burst_length" in str(e) else "error_model"
            problems.append((f"{p}.{field}", str(e)))
    elif em.get("type", "bernoulli") not in ("bernoulli", "profile"):  # (a profile without pre_fec_ber: said)
        problems.append((f"{p}.error_model", "an error model needs a 'ber'"))
    if imp.collectives and imp.scope != "tensor":
        problems.append((f"{p}.collectives", "collectives filters apply to scope: tensor only"))
    from testbed.engine.registry import engine_names, get_engine  # the kinds' own rules

    if imp.engine in engine_names():  # what the kind asked for cannot serve (auto picks one that can)
        problems += [(f"{p}.{field}", why) for field, why in get_engine(imp.engine).refusals(imp)]
    _check_protection(imp, p, problems)


def _check_protection(imp: LinkImpairment, p: str, problems: list) -> None:
    """element / protect / protected_ber: scope tensor only, bit positions within the element, residual BER
    at most the line's (the engine's own checks)."""
    from testbed.engine.protect import protected_positions

    used = [k for k, on in (("protect", imp.protect), ("protected_ber", imp.protected_ber),
                            ("element", imp.element != "fp32")) if on]
    if not used:
        return
    if imp.scope != "tensor":
        problems.append((f"{p}.{used[0]}", "element, protect and protected_ber apply to scope: tensor only (the "
                                           "bits of tensor values)"))
        return
    if imp.ber is None:
        problems.append((f"{p}.{used[0]}", "protected bits need a 'ber' (the raw line's bit error rate)"))
        return
    try:
        protected_positions(imp.element, imp.protect)
    except ValueError as e:
        problems.append((f"{p}.protect", str(e)))
    if imp.protected_ber > imp.ber:
        problems.append((f"{p}.protected_ber", f"protected_ber {imp.protected_ber:g} must not exceed ber "
                                               f"{imp.ber:g} (protected bits err at most as often as the raw line)"))


def _check_switch_loops(nodes: dict[str, Node], links: list[Link], problems: list) -> None:
    # Linux bridges here run without STP: a loop of switches would flood forever.
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for i, link in enumerate(links):
        if nodes[link.a.node].kind == nodes[link.b.node].kind == "switch":
            ra, rb = find(link.a.node), find(link.b.node)
            if ra == rb:
                problems.append((f"topology.links[{i}]", f"switches {link.a.node} and {link.b.node} are already "
                                                        "connected: a loop of bridges floods (no STP)"))
            parent[ra] = rb

