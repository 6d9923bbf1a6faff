"""The engine's configuration: one JSON object, written by the manager and read by the engine process.
``EngineSpec`` is that object as a dataclass; its fields are listed in docs/engine.md ("Configuration")."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from testbed.engine.gloo import collective_codes
from testbed.engine.models import validate_error_model
from testbed.engine.protect import ELEMENTS, normalize_protect, protected_positions
from testbed.vocab import CHECKSUM_MODES, ENGINES, SCOPES

__all__ = ["EngineSpec", "EngineError", "SCOPES", "CHECKSUM_MODES", "HOOKS", "SETTABLE", "ENGINES", "BPF_SCOPES",
           "BPF_MAX_PORTS", "bpf_problem"]

BPF_SCOPES = ("payload", "all", "tensor")
BPF_MAX_PORTS = 16
HOOKS = ("egress", "ingress")
# Settings `{"cmd": "set", ...}` may change live.
SETTABLE = ("ber", "error_model", "scope", "checksum", "seed", "collectives", "control_ports", "element", "protect",
            "protected_ber")


class EngineError(RuntimeError):
    """An engine could not be started, changed or reached (re-exported by testbed.engine.manager)."""


def bpf_problem(scope: str, checksum: str, error_model: dict | None, ber: float) -> str | None:
    """Why the bpf engine cannot corrupt a direction with these settings (None: it can). Keyed flips (flips as a
    pure function of stream position: scope tensor, or error_model counter) are TCP with checksum fix, Bernoulli
    (bernoulli and counter are the same law; in keyed mode both are drawn by the counter function), and a count
    table of at most counterflips.MAX_TAIL entries."""
    kind = (error_model or {}).get("type", "bernoulli")
    if scope not in BPF_SCOPES:
        return f"the bpf engine corrupts scopes {', '.join(BPF_SCOPES)}, not {scope!r}"
    if kind == "profile":
        return ("engine bpf has no link profiles (codewords, dropped or replayed frames): profile needs engine "
                "nfqueue (or auto)")
    keyed = scope == "tensor" or kind == "counter"
    if not keyed:
        return None
    what = "scope tensor" if scope == "tensor" else "error_model counter"
    if scope == "all":
        return "engine bpf draws error_model counter in scopes payload and tensor, not all (use engine nfqueue)"
    if checksum != "fix":
        return f"engine bpf draws {what} with checksum fix only (keep needs engine nfqueue)"
    if kind not in ("bernoulli", "counter"):
        return f"engine bpf draws {what} with error_model bernoulli or counter, not {kind} (use engine nfqueue)"
    from testbed.engine import counterflips

    try:
        n = len(counterflips.tail_table(float(ber)))
    except ValueError:
        return None  # the BER's own check names it
    if n > counterflips.MAX_TAIL:
        return (f"engine bpf draws {what} up to a BER of about 1.2e-2 (a count table of {counterflips.MAX_TAIL} "
                f"entries; BER {ber:g} needs {n}): use engine nfqueue")
    return None


@dataclass
class EngineSpec:
    netns: str  # path of the network namespace, e.g. /run/netns/tb.pair.h1
    iface: str
    control_socket: str
    stats_file: str
    topology: str = ""
    link: str = ""
    direction: str = ""
    hook: str = "egress"  # egress: mangle POSTROUTING -o iface; ingress: mangle PREROUTING -i iface
    queue_num: int = 1
    ber: float = 0.0
    error_model: dict = field(default_factory=lambda: {"type": "bernoulli"})
    scope: str = "payload"
    checksum: str = "fix"
    seed: int = 0
    collectives: list[str] | None = None
    control_ports: list[int] = field(default_factory=list)
    element: str = "fp32"  # scope tensor: the values' type, for protect and the flips_<field> counters
    protect: list | None = None  # scope tensor: field names (sign, exponent, mantissa) and/or value bit positions
    protected_ber: float = 0.0  # residual error rate of protected bits, <= ber
    capture: dict | None = None  # {"dir": PATH, "max_bytes": N}
    fail_open: bool = False  # NFQA_CFG_F_FAIL_OPEN: pass packets uncorrupted when the queue is full
    queue_maxlen: int = 4096
    engine: str = "nfqueue"  # nfqueue (a process per direction) or bpf (a tc program, testbed/engine/bpf)
    # The link's other end as seen from (netns, iface): the bpf engine's checksum keep corrupts on the receiving
    # end's ingress, with the sending end's transmit checksum offload off (docs/engine.md, "The bpf engine").
    peer_netns: str = ""
    peer_iface: str = ""

    def __post_init__(self):
        if self.error_model is None:
            self.error_model = {"type": "bernoulli"}
        if self.seed is None:
            self.seed = 0
        self.control_ports = [int(p) for p in (self.control_ports or [])]
        if isinstance(self.collectives, str):
            self.collectives = [self.collectives]
        self.collectives = list(self.collectives) if self.collectives else None
        if self.element is None:
            self.element = "fp32"
        if self.protected_ber is None:
            self.protected_ber = 0.0

    def validate(self) -> "EngineSpec":
        """Raise ValueError naming the first bad field."""
        if self.hook not in HOOKS:
            raise ValueError(f"hook must be one of {HOOKS}, got {self.hook!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.checksum not in CHECKSUM_MODES:
            raise ValueError(f"checksum must be one of {CHECKSUM_MODES}, got {self.checksum!r}")
        if not (0 <= int(self.queue_num) <= 65535):
            raise ValueError(f"queue_num must be in [0, 65535], got {self.queue_num}")
        if not (0 <= int(self.seed) < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not self.iface or len(self.iface) > 15:
            raise ValueError(f"iface must be an interface name (1-15 chars), got {self.iface!r}")
        if len(os.fsencode(self.control_socket)) >= 108:  # sun_path limit
            raise ValueError(f"control_socket path too long for a Unix socket (max 107 bytes): {self.control_socket}")
        for p in self.control_ports:
            if not 0 < p < 65536:
                raise ValueError(f"control port {p} out of range")
        self.error_model = validate_error_model(self.error_model, self.ber)
        if self.capture is not None:
            if not isinstance(self.capture, dict) or not self.capture.get("dir"):
                raise ValueError("capture must be null or {\"dir\": PATH, \"max_bytes\": N}")
            self.capture = {"dir": str(self.capture["dir"]),
                            "max_bytes": int(self.capture.get("max_bytes", 10_000_000))}
        if self.collectives is not None:
            if self.scope != "tensor":
                raise ValueError("collectives filters apply to scope 'tensor' only")
            collective_codes(self.collectives)  # unknown names: ValueError listing the known ones
        self._validate_protection()
        self._validate_engine()
        return self

    def _validate_engine(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine != "bpf":
            return
        problem = bpf_problem(self.scope, self.checksum, self.error_model, self.ber)
        if problem:
            raise ValueError(problem)
        if self.capture is not None:
            raise ValueError("capture (before/after pcaps) needs engine nfqueue")
        if len(self.control_ports) > BPF_MAX_PORTS:
            raise ValueError(f"the bpf engine takes at most {BPF_MAX_PORTS} control ports, "
                             f"got {len(self.control_ports)}")
        if self.checksum == "keep" and not (self.peer_netns and self.peer_iface):
            raise ValueError("the bpf engine's checksum keep needs the link's other end (peer_netns, peer_iface): "
                             "it corrupts frames on the receiving end, after their checksums were completed")

    def _validate_protection(self) -> None:
        if self.element not in ELEMENTS:
            raise ValueError(f"element must be one of {', '.join(ELEMENTS)}, got {self.element!r}")
        self.protect = normalize_protect(self.protect)
        protected_positions(self.element, self.protect)  # names and bit ranges
        pb = float(self.protected_ber)
        if not 0.0 <= pb <= 1.0:
            raise ValueError(f"protected_ber must be a probability in [0, 1], got {self.protected_ber}")
        self.protected_ber = pb
        if self.scope != "tensor" and (self.protect or pb or self.element != "fp32"):
            raise ValueError("element, protect and protected_ber apply to scope 'tensor' only (the bits of "
                             "tensor values), got scope " + repr(self.scope))
        if pb > float(self.ber):
            # residual flips are the line's flips on protected positions, kept with probability protected_ber/ber
            raise ValueError(f"protected_ber {pb:g} must not exceed ber {float(self.ber):g} (protected bits err "
                             f"at most as often as the raw line)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown engine config keys {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EngineSpec":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def config_path(self) -> Path:
        """Where the manager writes this spec: beside the stats file (``X.stats.json`` -> ``X.config.json``)."""
        stats = Path(self.stats_file)
        stem = stats.name[: -len(".stats.json")] if stats.name.endswith(".stats.json") else stats.name
        return stats.with_name(stem + ".config.json")

    def log_path(self) -> Path:
        p = self.config_path()
        return p.with_name(p.name[: -len(".config.json")] + ".log")
