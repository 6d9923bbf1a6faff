"""The resolved elements of a topology: nodes, links, and how each direction of a link behaves.

Plain immutable data, built by `testbed.topology.topo` from a validated file; the rest of the testbed reads these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.topology import units


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
    # scope tensor: the values' type and the bits of each value the link protects (docs/engine.md)
    element: str = "fp32"
    protect: tuple[str | int, ...] | None = None
    protected_ber: float = 0.0
    engine: str = "nfqueue"  # nfqueue | bpf | auto (resolved when the engine starts: testbed/engine/registry.py)

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
            extra = "" if model in ("bernoulli", "profile") else f" {model}(burst {self.error_model.get('burst_length')})"
            coll = f" [{','.join(self.collectives)}]" if self.collectives else ""
            prot = ""
            if self.protect:
                prot = f" protect {','.join(map(str, self.protect))}/{self.element}"
                if self.protected_ber:
                    prot += f" at {self.protected_ber:g}"
            from testbed.engine.registry import describe_engine

            eng = describe_engine(self.engine)
            what = (f"profile {self.error_model['profile']} at pre-FEC ber {self.ber:g}" if model == "profile"
                    else f"ber {self.ber:g}{extra}")
            parts.append(f"{what} {self.scope}/{self.checksum}{coll}{prot} seed {self.seed}{eng}")
        return ", ".join(parts) or "-"

    def to_dict(self) -> dict:
        return {
            "rate_bps": self.rate_bps, "delay_s": self.delay_s, "jitter_s": self.jitter_s, "loss": self.loss,
            "ber": self.ber, "error_model": dict(self.error_model), "scope": self.scope,
            "checksum": self.checksum, "seed": self.seed,
            "collectives": list(self.collectives) if self.collectives else None,
            "element": self.element, "protect": list(self.protect) if self.protect else None,
            "protected_ber": self.protected_ber, "engine": self.engine,
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
    machine: str | None = None  # placement asked for in the file (`--machines`); None: automatic


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

    def direction_name(self, direction: str) -> str:
        """One of the link's directions, written 'A->B' or 'A-B' (when unambiguous); KeyError naming them."""
        names = [d[0] for d in self.directions()]
        if direction in names:
            return direction
        for n in names:
            if n.replace("->", "-") == direction:
                return n
        raise KeyError(f"link {self.name} has no direction {direction!r} (directions: {', '.join(names)})")

    def direction(self, name: str) -> tuple[str, Endpoint, Endpoint, LinkImpairment]:
        for d in self.directions():
            if d[0] == name:
                return d
        raise KeyError(name)
