"""The topology file's schema (pydantic): which keys exist, their types, units and ranges.

Cross-field rules (endpoints name known nodes, interfaces are used once, subnets do not overlap, ...) are
checked when the file is resolved into a `testbed.topology.topo.Topology`. The format follows containerlab
(`name`, `topology.nodes`, `topology.links[].endpoints`); docs: README "Topology files".
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from testbed.topology import units
from testbed.linklayer import PROFILE_NAMES
from testbed.vocab import CHECKSUM_MODES, ELEMENT_TYPES, ENGINE_CHOICES, ERROR_MODELS, PROTECT_FIELDS, SCOPES

TOPOLOGY_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,23}$")
DEFAULT_DATA_POOL = ipaddress.IPv4Network("10.0.0.0/16")
DEFAULT_MGMT_SUBNET = ipaddress.IPv4Network("10.255.0.0/16")
DEFAULT_CONTROL_PORTS = (29500,)
COLLECTIVES = ("allreduce", "allgather", "broadcast", "barrier", "reduce", "reduce_scatter", "gather",
               "scatter", "alltoall", "p2p")


def _wrap(fn):
    def v(x):
        return None if x is None else fn(x)
    return BeforeValidator(v)


Rate = Annotated[int | None, _wrap(units.parse_rate)]
Duration = Annotated[float | None, _wrap(units.parse_duration)]
Fraction = Annotated[float | None, _wrap(units.parse_fraction)]
Ber = Annotated[float | None, _wrap(lambda x: units.parse_probability(x, upper=0.5))]
Size = Annotated[int | None, _wrap(units.parse_size)]


def _address_text(value: Any) -> Any:
    # YAML reads 10.0.0.0/24 as text; ipaddress would take a number (or true) as an address (1 -> 0.0.0.1/32)
    if isinstance(value, (bool, int, float)):
        raise ValueError(f"write an address as text, such as '10.0.0.0/24', got {value!r}")
    return value


Network = Annotated[ipaddress.IPv4Network, BeforeValidator(_address_text)]
Interface = Annotated[ipaddress.IPv4Interface, BeforeValidator(_address_text)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorModelSpec(_Strict):
    """`bernoulli`, `counter` (bernoulli drawn as a pure function of the stream position: engine nfqueue), or
    `gilbert_elliott` with a mean burst length in bits (mean BER is the link's `ber`)."""

    type: Literal[ERROR_MODELS] = "bernoulli"
    burst_length: float | None = Field(default=None, ge=1.0)
    # None: the engine's defaults (bad 0.5, good 0); the engine's own check decides what combinations are valid
    bad_ber: Annotated[float | None, _wrap(lambda x: units.parse_probability(x, upper=1.0))] = None
    good_ber: Annotated[float | None, _wrap(lambda x: units.parse_probability(x, upper=0.5))] = None


def _error_model(value: Any) -> Any:
    if isinstance(value, str):
        return {"type": value}
    return value


def _comma_list(value: Any) -> Any:
    # `protect: sign,exponent` as well as `protect: [sign, exponent]`
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list) and any(isinstance(v, bool) for v in value):
        raise ValueError("protect takes field names (sign, exponent, mantissa) or bit positions, not booleans")
    return value


# A protected bit: a field name or a value bit position (0 = LSB; the upper bound depends on the element and is
# checked when the file is resolved).
ProtectItem = Literal[PROTECT_FIELDS] | Annotated[int, Field(ge=0, le=31)]  # type: ignore[valid-type]


class ImpairmentSpec(_Strict):
    rate: Rate = None
    delay: Duration = None
    jitter: Duration = None
    loss: Fraction = None
    ber: Ber = None
    error_model: Annotated[ErrorModelSpec | None, BeforeValidator(_error_model)] = None
    scope: Literal[SCOPES] | None = None  # type: ignore[valid-type]
    checksum: Literal[CHECKSUM_MODES] | None = None  # type: ignore[valid-type]
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    collectives: list[Literal[COLLECTIVES]] | None = None  # type: ignore[valid-type]
    element: Literal[ELEMENT_TYPES] | None = None  # type: ignore[valid-type]
    protect: Annotated[list[ProtectItem] | None, BeforeValidator(_comma_list)] = None
    protected_ber: Ber = None
    # which corruption engine: the NFQUEUE process (default), the in-kernel tc program (scopes payload and all),
    # or auto (bpf for payload/all where it loads, nfqueue otherwise); docs/engine.md, "The bpf engine"
    engine: Literal[ENGINE_CHOICES] | None = None  # type: ignore[valid-type]
    # a link layer (testbed/linklayer.py: none, rs544, rs544-pass, rs528, rs272, llr) over the physical link's
    # pre-FEC BER, instead of `ber` (docs/theory.md, "Link layers")
    profile: Literal[PROFILE_NAMES] | None = None  # type: ignore[valid-type]
    pre_fec_ber: Ber = None


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
    subnet: Network | None = None
    offloads: OffloadSpec | None = None
    directions: dict[str, ImpairmentSpec] | None = None


class NodeModel(_Strict):
    kind: Literal["host", "switch"] = "host"
    image: str | None = None
    cpus: float | None = Field(default=None, gt=0, le=1024)
    memory: Size = None
    addresses: dict[str, Interface] | None = None
    subnet: Network | None = None
    env: dict[str, str] | None = None
    # where the node runs when the topology is brought up with an inventory (`--machines FILE`): a machine's
    # name there; unplaced nodes are spread automatically (testbed/machines/placement.py). Ignored without one.
    machine: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")


class TopologyBody(_Strict):
    nodes: dict[str, NodeModel] = Field(min_length=1)
    links: list[LinkModel] = Field(default_factory=list)


class MgmtModel(_Strict):
    subnet: Network = DEFAULT_MGMT_SUBNET


class TopologyFile(_Strict):
    name: str
    description: str | None = None
    runtime: Literal["netns", "docker"] = "netns"
    seed: int = Field(default=0, ge=0, lt=2**62)
    control_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=lambda: list(DEFAULT_CONTROL_PORTS))
    mgmt: MgmtModel = Field(default_factory=MgmtModel)
    data_subnet: Network = DEFAULT_DATA_POOL
    topology: TopologyBody

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOPOLOGY_NAME_RE.match(v):
            raise ValueError("must be 1-24 characters of a-z, 0-9, '_' or '-', starting with a letter or digit")
        return v

