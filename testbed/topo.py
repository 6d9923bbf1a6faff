"""What a topology is: the YAML schema, its validation, and the resolved plan (addresses, routes).

Pure: nothing here touches the system. `Topology.load(path)` either returns a fully validated topology or
raises `TopologyError` naming the file, the field path and the problem, so nothing is ever half-built from
bad input. The file format follows containerlab (`name`, `topology.nodes`, `topology.links[].endpoints`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from . import units

TOPOLOGY_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,23}$")
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
IFNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
IFNAMSIZ = 15  # the kernel's interface names hold at most 15 characters
RESERVED_IFNAMES = {"lo", "mgmt0", "br0"}
DEFAULT_DATA_POOL = ipaddress.IPv4Network("10.0.0.0/16")
DEFAULT_MGMT_SUBNET = ipaddress.IPv4Network("10.255.0.0/16")
DEFAULT_CONTROL_PORTS = (29500,)
COLLECTIVES = ("allreduce", "allgather", "broadcast", "barrier", "reduce", "reduce_scatter", "gather",
               "scatter", "alltoall", "p2p")
OFFLOAD_FEATURES = {"tso": "tso", "gso": "gso", "gro": "gro", "tx_checksum": "tx", "rx_checksum": "rx",
                    "sg": "sg"}


class TopologyError(Exception):
    """Bad topology input. `problems` is a list of (field path, message); str() is the full report."""

    def __init__(self, file: str | Path | None, problems: list[tuple[str, str]], lines: dict[str, int] | None = None):
        self.file = str(file) if file is not None else "<topology>"
        self.problems = list(dict.fromkeys(problems))  # both directions of a link may report the same problem
        self.lines = lines or {}
        super().__init__(self.render())

    def render(self) -> str:
        out = []
        for path, msg in sorted(self.problems, key=lambda p: self.lines.get(p[0], 0)):
            line = self.lines.get(path)
            where = f"{self.file}:{line}" if line else self.file
            out.append(f"{where}: {path or '(top level)'}: {msg}" if path else f"{where}: {msg}")
        return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------
# Schema (pydantic): types and ranges. Cross-field rules are checked afterwards in _check().


def _wrap(fn):
    def v(x):
        return None if x is None else fn(x)
    return BeforeValidator(v)


Rate = Annotated[int | None, _wrap(units.parse_rate)]
Duration = Annotated[float | None, _wrap(units.parse_duration)]
Fraction = Annotated[float | None, _wrap(units.parse_fraction)]
Ber = Annotated[float | None, _wrap(lambda x: units.parse_probability(x, upper=0.5))]
Size = Annotated[int | None, _wrap(units.parse_size)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorModelSpec(_Strict):
    """`bernoulli`, or `gilbert_elliott` with a mean burst length in bits (mean BER is the link's `ber`)."""

    type: Literal["bernoulli", "gilbert_elliott"] = "bernoulli"
    burst_length: float | None = Field(default=None, ge=1.0)
    # None: the engine's defaults (bad 0.5, good 0); the engine's own check decides what combinations are valid
    bad_ber: Annotated[float | None, _wrap(lambda x: units.parse_probability(x, upper=1.0))] = None
    good_ber: Annotated[float | None, _wrap(lambda x: units.parse_probability(x, upper=0.5))] = None


def _error_model(value: Any) -> Any:
    if isinstance(value, str):
        return {"type": value}
    return value


class ImpairmentSpec(_Strict):
    rate: Rate = None
    delay: Duration = None
    jitter: Duration = None
    loss: Fraction = None
    ber: Ber = None
    error_model: Annotated[ErrorModelSpec | None, BeforeValidator(_error_model)] = None
    scope: Literal["payload", "all", "tensor"] | None = None
    checksum: Literal["fix", "keep"] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    collectives: list[Literal[COLLECTIVES]] | None = None  # type: ignore[valid-type]


class OffloadSpec(_Strict):
    tso: bool | None = None
    gso: bool | None = None
    gro: bool | None = None
    tx_checksum: bool | None = None
    rx_checksum: bool | None = None
    sg: bool | None = None


class LinkModel(ImpairmentSpec):
    endpoints: list[str] = Field(min_length=2, max_length=2)
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
    mtu: int = Field(default=1500, ge=68, le=65535)
    subnet: ipaddress.IPv4Network | None = None
    offloads: OffloadSpec | None = None
    directions: dict[str, ImpairmentSpec] | None = None


class NodeModel(_Strict):
    kind: Literal["host", "switch"] = "host"
    image: str | None = None
    cpus: float | None = Field(default=None, gt=0, le=1024)
    memory: Size = None
    addresses: dict[str, ipaddress.IPv4Interface] | None = None
    subnet: ipaddress.IPv4Network | None = None
    env: dict[str, str] | None = None


class TopologyBody(_Strict):
    nodes: dict[str, NodeModel] = Field(min_length=1)
    links: list[LinkModel] = Field(default_factory=list)


class MgmtModel(_Strict):
    subnet: ipaddress.IPv4Network = DEFAULT_MGMT_SUBNET


class TopologyFile(_Strict):
    name: str
    description: str | None = None
    runtime: Literal["netns", "docker"] = "netns"
    seed: int = Field(default=0, ge=0, lt=2**62)
    control_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=lambda: list(DEFAULT_CONTROL_PORTS))
    mgmt: MgmtModel = Field(default_factory=MgmtModel)
    data_subnet: ipaddress.IPv4Network = DEFAULT_DATA_POOL
    topology: TopologyBody

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOPOLOGY_NAME_RE.match(v):
            raise ValueError("must be 1-24 characters of a-z, 0-9, '_' or '-', starting with a letter or digit")
        return v


# ----------------------------------------------------------------------------------------------------------
# Resolved, immutable description used by the rest of the testbed.


@dataclass(frozen=True)
class LinkImpairment:
    """How one direction of one link behaves. `ber is None` means no corruption engine on it."""

    rate_bps: int | None = None
    delay_s: float | None = None
    jitter_s: float | None = None
    loss: float | None = None
    ber: float | None = None
    error_model: dict = field(default_factory=lambda: {"type": "bernoulli"})
    scope: str = "payload"
    checksum: str = "fix"
    seed: int = 0
    collectives: tuple[str, ...] | None = None

    @property
    def corrupts(self) -> bool:
        return self.ber is not None

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay_s or self.jitter_s or self.loss)

    def describe(self) -> str:
        parts = []
        if self.rate_bps:
            parts.append(f"rate {units.format_rate(self.rate_bps)}")
        if self.delay_s:
            d = f"delay {units.format_duration(self.delay_s)}"
            if self.jitter_s:
                d += f"±{units.format_duration(self.jitter_s)}"
            parts.append(d)
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        if self.ber is not None:
            model = self.error_model.get("type", "bernoulli")
            extra = "" if model == "bernoulli" else f" {model}(burst {self.error_model.get('burst_length')})"
            coll = f" [{','.join(self.collectives)}]" if self.collectives else ""
            parts.append(f"ber {self.ber:g}{extra} {self.scope}/{self.checksum}{coll} seed {self.seed}")
        return ", ".join(parts) or "-"

    def to_dict(self) -> dict:
        return {
            "rate_bps": self.rate_bps, "delay_s": self.delay_s, "jitter_s": self.jitter_s, "loss": self.loss,
            "ber": self.ber, "error_model": dict(self.error_model), "scope": self.scope,
            "checksum": self.checksum, "seed": self.seed,
            "collectives": list(self.collectives) if self.collectives else None,
        }


@dataclass(frozen=True)
class Endpoint:
    node: str
    iface: str

    def __str__(self) -> str:
        return f"{self.node}:{self.iface}"


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # host | switch
    image: str | None = None
    cpus: float | None = None
    memory: int | None = None
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Link:
    name: str
    a: Endpoint
    b: Endpoint
    mtu: int
    offloads: dict  # feature name -> bool, only those the file set
    forward: LinkImpairment  # a -> b
    reverse: LinkImpairment  # b -> a

    def directions(self) -> list[tuple[str, Endpoint, Endpoint, LinkImpairment]]:
        """(name, sending endpoint, receiving endpoint, impairment) for both directions."""
        return [
            (f"{self.a.node}->{self.b.node}", self.a, self.b, self.forward),
            (f"{self.b.node}->{self.a.node}", self.b, self.a, self.reverse),
        ]

    def direction(self, name: str) -> tuple[str, Endpoint, Endpoint, LinkImpairment]:
        for d in self.directions():
            if d[0] == name:
                return d
        raise KeyError(name)


@dataclass(frozen=True)
class HostInterface:
    iface: str
    address: ipaddress.IPv4Interface
    link: str


@dataclass(frozen=True)
class Route:
    dst: ipaddress.IPv4Network
    via: ipaddress.IPv4Address
    dev: str


@dataclass(frozen=True)
class Plan:
    """Addresses and routes: every host reaches every other host's data addresses, multi-hop included."""

    interfaces: dict[str, list[HostInterface]]  # host -> data interfaces
    mgmt: dict[str, ipaddress.IPv4Interface]  # host -> management address
    routes: dict[str, list[Route]]  # host -> routes to non-adjacent subnets
    segments: list[ipaddress.IPv4Network]

    def data_address(self, host: str) -> ipaddress.IPv4Address:
        return self.interfaces[host][0].address.ip

    def data_iface(self, host: str) -> str:
        return self.interfaces[host][0].iface


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

    def with_overrides(self, name: str | None = None, runtime: str | None = None, **impairment: Any) -> "Topology":
        """A copy with another name/runtime and corruption settings applied to every link direction
        (e.g. `ber=1e-5, scope="tensor"`), validated like the file itself."""
        raw = _deepcopy(self.raw)
        if name:
            raw["name"] = name
        if runtime:
            raw["runtime"] = runtime
        settings = {k: v for k, v in impairment.items() if v is not None}
        if settings:
            for link, resolved in zip(raw.get("topology", {}).get("links", []) or [], self.links):
                if self.nodes[resolved.a.node].kind == self.nodes[resolved.b.node].kind == "switch":
                    continue  # corruption runs in host namespaces; bridges between switches carry none
                link.update(settings)
                for d in (link.get("directions") or {}).values():
                    for k in settings:
                        d.pop(k, None)
        return Topology.from_dict(raw, file=self.file)

    # -- loading -------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> "Topology":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise TopologyError(path, [("", f"cannot read file: {e.strerror or e}")]) from None
        raw, lines = _parse_yaml(text, path)
        if name is not None and isinstance(raw, dict):
            raw["name"] = name
        topo = cls.from_dict(raw, file=str(path), lines=lines)
        return dataclasses.replace(topo, file=str(path.resolve()))

    @classmethod
    def from_dict(cls, raw: Any, file: str | None = None, lines: dict[str, int] | None = None) -> "Topology":
        if not isinstance(raw, dict):
            raise TopologyError(file, [("", "the file must hold a mapping with 'name' and 'topology'")], lines)
        try:
            spec = TopologyFile.model_validate(raw)
        except ValidationError as e:
            raise TopologyError(file, _pydantic_problems(e), lines) from None
        problems: list[tuple[str, str]] = []
        topo = _resolve(spec, raw, file, problems)
        if problems:
            raise TopologyError(file, problems, lines)
        return topo


# ----------------------------------------------------------------------------------------------------------
# YAML with duplicate-key detection and line numbers for every field path.


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain name, not a {type(key).__name__}", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, path: Path) -> tuple[Any, dict[str, int]]:
    try:
        node = yaml.compose(text, Loader=_UniqueKeyLoader)
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise TopologyError(path, [("", f"not valid YAML{where}: {problem}")]) from None
    if raw is None:
        raise TopologyError(path, [("", "the file is empty")])
    lines: dict[str, int] = {}
    if node is not None:
        _index_lines(node, "", lines)
    return raw, lines


def _index_lines(node: yaml.Node, path: str, out: dict[str, int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            sub = f"{path}.{key}" if path else str(key)
            out[sub] = k.start_mark.line + 1
            _index_lines(v, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _index_lines(v, f"{path}[{i}]", out)


def _path(loc: tuple) -> str:
    s = ""
    for part in loc:
        if isinstance(part, int):
            s += f"[{part}]"
        else:
            s += ("." if s else "") + str(part)
    return s


def _pydantic_problems(e: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for err in e.errors():
        # Drop pydantic's internal union/validator tags from the location.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling and the documented fields)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] != "value_error" and "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        problems.append((_path(loc), msg))
    return problems


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
    return LinkImpairment(
        rate_bps=d.get("rate"), delay_s=d.get("delay"), jitter_s=d.get("jitter"), loss=d.get("loss"),
        ber=d.get("ber"), error_model=em, scope=d.get("scope") or "payload", checksum=d.get("checksum") or "fix",
        seed=d["seed"] if d.get("seed") is not None else seed,
        collectives=tuple(d["collectives"]) if d.get("collectives") else None,
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
        nodes[name] = Node(name=name, kind=n.kind, image=n.image, cpus=n.cpus, memory=n.memory, env=dict(n.env or {}))
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
    plan = _plan(spec, nodes, links, raw, problems)
    if problems or plan is None:
        return None
    return Topology(
        name=spec.name, file=file, runtime=spec.runtime, seed=spec.seed, nodes=nodes, links=links,
        control_ports=tuple(spec.control_ports), mgmt_subnet=spec.mgmt.subnet, plan=plan, raw=_deepcopy(raw),
        description=spec.description,
    )


def _derive_seed(seed: int, link_name: str) -> int:
    # Stable across runs and Python processes (no hash randomisation): each link direction gets its own stream.
    h = 1469598103934665603
    for ch in f"{seed}/{link_name}".encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 61)
    return h


def _check_impairment(imp: LinkImpairment, p: str, problems: list) -> None:
    if imp.jitter_s and not imp.delay_s:
        problems.append((f"{p}.jitter", "jitter needs a delay"))
    if imp.jitter_s and imp.delay_s and imp.jitter_s > imp.delay_s:
        problems.append((f"{p}.jitter", "jitter larger than the delay would need negative delays"))
    em = imp.error_model
    if imp.ber is not None:
        # The engine's own validation, so that what passes here also starts (no second, weaker copy).
        from .engine.models import validate_error_model

        try:
            validate_error_model(em, imp.ber)
        except ValueError as e:
            field = "error_model.burst_length" if "burst_length" in str(e) else "error_model"
            problems.append((f"{p}.{field}", str(e)))
    elif em.get("type", "bernoulli") != "bernoulli":
        problems.append((f"{p}.error_model", "an error model needs a 'ber'"))
    if imp.collectives and imp.scope != "tensor":
        problems.append((f"{p}.collectives", "collectives filters apply to scope: tensor only"))


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


def _plan(spec: TopologyFile, nodes: dict[str, Node], links: list[Link], raw: dict, problems: list) -> Plan | None:
    # L2 segments: a host-to-host link is one segment; a switch and everything bridged to it is one segment.
    seg_of_switch: dict[str, int] = {}
    segments: list[dict] = []  # {"members": [(host, iface, linkname)], "subnet": net|None, "path": str}

    def switch_segment(sw: str) -> int:
        if sw in seg_of_switch:
            return seg_of_switch[sw]
        # flood through switch-switch links
        comp, todo = {sw}, [sw]
        while todo:
            s = todo.pop()
            for link in links:
                for x, y in ((link.a.node, link.b.node), (link.b.node, link.a.node)):
                    if x == s and nodes[y].kind == "switch" and y not in comp:
                        comp.add(y)
                        todo.append(y)
        idx = len(segments)
        subnets = [(s, spec.topology.nodes[s].subnet) for s in sorted(comp) if spec.topology.nodes[s].subnet]
        if len({str(n) for _, n in subnets}) > 1:
            problems.append((f"topology.nodes.{subnets[1][0]}.subnet",
                             f"switches {', '.join(sorted(comp))} form one segment but set different subnets"))
        segments.append({"members": [], "subnet": subnets[0][1] if subnets else None,
                         "path": f"topology.nodes.{subnets[0][0]}.subnet" if subnets else None,
                         "name": "+".join(sorted(comp))})
        for s in comp:
            seg_of_switch[s] = idx
        return idx

    for i, link in enumerate(links):
        ka, kb = nodes[link.a.node].kind, nodes[link.b.node].kind
        if ka == kb == "host":
            segments.append({"members": [(link.a.node, link.a.iface, link.name), (link.b.node, link.b.iface, link.name)],
                             "subnet": spec.topology.links[i].subnet,
                             "path": f"topology.links[{i}].subnet", "name": link.name})
        elif ka == "host" or kb == "host":
            host_ep = link.a if ka == "host" else link.b
            sw = link.b.node if ka == "host" else link.a.node
            segments[switch_segment(sw)]["members"].append((host_ep.node, host_ep.iface, link.name))
    for sw in (n for n, v in nodes.items() if v.kind == "switch"):
        switch_segment(sw)

    # Subnets: explicit ones first, then the pool in order, skipping any that overlap.
    pool = spec.data_subnet
    taken: list[ipaddress.IPv4Network] = []
    for seg in segments:
        if seg["subnet"] is not None:
            net = seg["subnet"]
            for t in taken:
                if net.overlaps(t):
                    problems.append((seg["path"], f"subnet {net} overlaps {t} of another segment"))
            if net.overlaps(spec.mgmt.subnet):
                problems.append((seg["path"], f"subnet {net} overlaps the management subnet {spec.mgmt.subnet}"))
            taken.append(net)
    if spec.data_subnet.overlaps(spec.mgmt.subnet):
        problems.append(("data_subnet", f"{spec.data_subnet} overlaps the management subnet {spec.mgmt.subnet}"))
        return None
    if pool.prefixlen > 24:
        problems.append(("data_subnet", f"the data address pool must be /24 or larger, got {pool}"))
        return None
    candidates = iter(pool.subnets(new_prefix=24))
    for seg in segments:
        if seg["subnet"] is None:
            for net in candidates:
                if not any(net.overlaps(t) for t in taken):
                    seg["subnet"] = net
                    taken.append(net)
                    break
            else:
                problems.append(("data_subnet", f"{pool} has too few /24 subnets for {len(segments)} segments"))
                return None

    overrides = {h: dict(spec.topology.nodes[h].addresses or {}) for h in nodes if nodes[h].kind == "host"}
    for h, addrs in overrides.items():
        for iface in addrs:
            if (h, iface) not in {(m[0], m[1]) for seg in segments for m in seg["members"]}:
                problems.append((f"topology.nodes.{h}.addresses.{iface}", f"{h} has no data interface {iface!r}"))
    interfaces: dict[str, list[HostInterface]] = {h: [] for h in overrides}
    seg_addr: list[dict[str, ipaddress.IPv4Interface]] = []
    for seg in segments:
        net: ipaddress.IPv4Network = seg["subnet"]
        used: set[ipaddress.IPv4Address] = set()
        addrs: dict[str, ipaddress.IPv4Interface] = {}
        for host, iface, _ in seg["members"]:
            want = overrides.get(host, {}).get(iface)
            if want is not None:
                path = f"topology.nodes.{host}.addresses.{iface}"
                if want.network != net:
                    problems.append((path, f"{want} is not in this segment's subnet {net}"))
                elif want.ip in (net.network_address, net.broadcast_address):
                    problems.append((path, f"{want.ip} is the network or broadcast address"))
                elif want.ip in used:
                    problems.append((path, f"{want.ip} is already assigned in {net}"))
                used.add(want.ip)
        hosts_iter = (ip for ip in net.hosts() if ip not in used)
        for host, iface, linkname in seg["members"]:
            want = overrides.get(host, {}).get(iface)
            if want is None:
                ip = next(hosts_iter, None)
                if ip is None:
                    problems.append((seg["path"] or "data_subnet", f"subnet {net} has too few addresses"))
                    return None
                want = ipaddress.IPv4Interface(f"{ip}/{net.prefixlen}")
            addrs[f"{host}:{iface}"] = want
            interfaces[host].append(HostInterface(iface=iface, address=want, link=linkname))
        seg_addr.append(addrs)
    if problems:
        return None
    for h, ifs in interfaces.items():
        if not ifs and len(interfaces) > 1:
            # A lone host is legal (e.g. one worker); a host without data links in a multi-host topology is not.
            problems.append((f"topology.nodes.{h}", "host has no data link"))
    # Interfaces in the order the links list them; the first is the host's data interface.
    mgmt_net = spec.mgmt.subnet
    mgmt_hosts = mgmt_net.hosts()
    mgmt: dict[str, ipaddress.IPv4Interface] = {}
    for h in interfaces:
        ip = next(mgmt_hosts, None)
        if ip is None:
            problems.append(("mgmt.subnet", f"{mgmt_net} has too few addresses for {len(interfaces)} hosts"))
            return None
        mgmt[h] = ipaddress.IPv4Interface(f"{ip}/{mgmt_net.prefixlen}")

    # A host's first data interface (natural name order: eth1 before eth2 before eth10) is its main one:
    # workloads bind there (GLOO_SOCKET_IFNAME).
    for h in interfaces:
        interfaces[h].sort(key=lambda i: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", i.iface)])
    routes = _routes(interfaces, segments, seg_addr)
    return Plan(interfaces=interfaces, mgmt=mgmt, routes=routes, segments=[s["subnet"] for s in segments])


def _routes(interfaces: dict[str, list[HostInterface]], segments: list[dict],
            seg_addr: list[dict[str, ipaddress.IPv4Interface]]) -> dict[str, list[Route]]:
    """Shortest paths (BFS, deterministic tie-break by declaration order) from every host to every segment.
    Hosts forward for each other, so rings and chains work multi-hop."""
    host_segs: dict[str, list[int]] = {h: [] for h in interfaces}
    for i, seg in enumerate(segments):
        for host, _, _ in seg["members"]:
            host_segs[host].append(i)
    routes: dict[str, list[Route]] = {}
    for src in interfaces:
        # BFS over hosts; first_hop[h] = (neighbour address on a shared segment, our iface) to reach h.
        first_hop: dict[str, tuple[ipaddress.IPv4Address, str]] = {}
        dist: dict[str, int] = {src: 0}
        seen = {src}
        queue: deque[str] = deque()
        for si in host_segs[src]:
            my_iface = next(m[1] for m in segments[si]["members"] if m[0] == src)
            for host, iface, _ in segments[si]["members"]:
                if host not in seen:
                    seen.add(host)
                    first_hop[host] = (seg_addr[si][f"{host}:{iface}"].ip, my_iface)
                    dist[host] = 1
                    queue.append(host)
        while queue:
            h = queue.popleft()
            for si in host_segs[h]:
                for host, _, _ in segments[si]["members"]:
                    if host not in seen:
                        seen.add(host)
                        first_hop[host] = first_hop[h]
                        dist[host] = dist[h] + 1
                        queue.append(host)
        direct = set(host_segs[src])
        rts = []
        for si, seg in enumerate(segments):
            if si in direct or not seg["members"]:
                continue
            # Reach segment si through the nearest host on it.
            reachable = [host for host, _, _ in seg["members"] if host in first_hop]
            if reachable:
                nearest = min(reachable, key=lambda host: dist[host])
                via, dev = first_hop[nearest]
                rts.append(Route(dst=seg["subnet"], via=via, dev=dev))
        routes[src] = rts
    return routes
