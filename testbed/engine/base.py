"""What corrupts one link direction: an engine kind. A kind starts engines (one direction or several), stops
them, tells whether one still corrupts its link, reads its counters, changes its settings live, and detaches
it from its link (the link passes clean) and attaches it back. Everything outside testbed/engine/ reaches
engines through this interface and never asks which kind one is (testbed/runtime/base.py is the model).

Kinds register themselves (`@register_engine`) when their module is imported; testbed/engine/registry.py
imports the built-in ones (nfqueue, bpf) and looks them up (`get_engine`, `engine_names`, `resolve_engine`).

`EngineHandle` names one started direction; it is plain data (``to_dict``/``from_dict``) kept in the state
file, so that a later process can query, change or stop the engine."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Callable

from testbed import register_kind
from testbed.engine.config import SCOPES, EngineError, EngineSpec

# `engine: auto` in a topology: resolved per direction when its engine starts (registry.resolve_engine).
AUTO = "auto"


@dataclass
class EngineHandle:
    spec: EngineSpec
    pid: int
    start_time: int | None  # /proc/PID/stat starttime: tells our engine from a later process reusing the pid
    config_path: str
    log_path: str
    rule: list[str] = field(default_factory=list)  # iptables arguments after -A / -D (bpf: the tc filter, for show)
    started_at: float = 0.0
    bpf: dict | None = None  # engine bpf: pin directory, sidecar, attachment, offload changed (bpf/engine.py)

    @property
    def kind(self) -> str:
        return self.spec.engine

    def to_dict(self) -> dict:
        d = {"spec": self.spec.to_dict(), "pid": self.pid, "start_time": self.start_time,
             "config_path": self.config_path, "log_path": self.log_path, "rule": list(self.rule),
             "started_at": self.started_at}
        if self.bpf is not None:
            d["bpf"] = dict(self.bpf)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineHandle":
        return cls(spec=EngineSpec.from_dict(d["spec"]), pid=int(d["pid"]), start_time=d.get("start_time"),
                   config_path=d["config_path"], log_path=d["log_path"], rule=list(d.get("rule") or []),
                   started_at=float(d.get("started_at") or 0.0), bpf=d.get("bpf"))


def prepared(spec: EngineSpec) -> EngineSpec:
    """`spec` with absolute paths (an engine runs in /), validated; EngineError if its namespace is gone."""
    spec = replace(spec, stats_file=os.path.abspath(spec.stats_file),
                   control_socket=os.path.abspath(spec.control_socket)).validate()  # the engine runs in /
    if not os.path.exists(spec.netns):
        raise EngineError(f"network namespace {spec.netns} does not exist")
    return spec


class Engine(ABC):
    """One engine kind. The methods taking a `target` accept an EngineHandle or an EngineSpec (the handle's
    or spec's dict is turned into one by testbed.engine.manager; a kind that runs a process also takes a
    ``{"control_socket", "stats_file", "pid"?, "start_time"?}`` dict or a ``(control_socket, stats_file)``
    pair)."""

    name: str = ""
    scopes: tuple[str, ...] = SCOPES  # the scopes it corrupts
    captures: bool = False  # it writes before/after pcaps of what it corrupts (`up --capture`)
    # Directions of one namespace can share one engine process: with engine_procs host `up` starts one
    # process per namespace for them (`start` of several specs), and later ones `join` it.
    shares_process: bool = False
    # `up` starts all of this kind's directions in one `start` call, before the other kinds' (bpf: loaded in
    # parallel, all or nothing).
    starts_together: bool = False
    # engine: auto takes the first kind by rank (lowest first) that serves the direction and is available.
    auto_rank: int = 100
    essential: bool = False  # `testbed doctor`: whether bit corruption needs this kind

    def available(self) -> tuple[bool, str]:
        """(whether this kind can run here, why not / what was checked)."""
        return True, ""

    def probe(self, netns: str) -> tuple[bool, str]:
        """`testbed doctor`'s check of this kind, in the scratch namespace `netns` (never the host's own)."""
        return self.available()

    def preflight(self, directions: list, is_local: Callable[[str], bool]) -> str | None:
        """Before `up` creates anything: why this kind cannot serve what the topology asks (None: it can).
        `directions`: (link name, direction, sender, receiver, impairment) of every corrupting direction (the
        kind picks those it concerns); `is_local(node)`: whether a node is on this machine."""
        return None

    def refusals(self, imp) -> list[tuple[str, str]]:
        """Topology validation: (field, problem) for each setting of a direction asking for this kind that the
        kind cannot serve (`imp`: a LinkImpairment)."""
        return []

    def serves(self, imp, capture: dict | None, peer_netns: str) -> bool:
        """Whether engine: auto may give this kind to a direction (`imp`: its LinkImpairment; `capture`: the
        direction's capture, if any; `peer_netns`: the link's other end where it is on this machine, else "")."""
        return True

    @abstractmethod
    def start(self, specs: list[EngineSpec], python: str, ready_timeout: float) -> list[EngineHandle]:
        """Start and attach engines for `specs` (all of this kind), one handle per spec; EngineError if one
        does not come up, and then nothing of them is left."""

    def join(self, running: EngineHandle, spec: EngineSpec, timeout: float) -> EngineHandle:
        """Serve `spec` by the running engine process of `running` (`shares_process` kinds only)."""
        prepared(spec)
        raise EngineError("only NFQUEUE directions share an engine process")

    @abstractmethod
    def stop(self, handle: EngineHandle, timeout: float) -> dict:
        """Detach and stop the engine; its final counters (``alive: false``)."""

    @abstractmethod
    def alive(self, handle) -> bool:
        """Whether the engine of `handle` (an EngineHandle or its dict) still corrupts its link."""

    @abstractmethod
    def stats(self, target, timeout: float) -> dict:
        """Counters and settings now (``alive``: whether it still runs)."""

    @abstractmethod
    def set(self, target, timeout: float, **settings) -> dict:
        """Change settings live; the settings now in force. EngineError if refused."""

    @abstractmethod
    def detach(self, handle: EngineHandle) -> None:
        """The link passes its traffic clean while the engine stays (its state kept); `attach` undoes it."""

    @abstractmethod
    def attach(self, handle: EngineHandle) -> None:
        """The link's packets go through the engine again (after `detach`)."""


ENGINES: dict[str, type[Engine]] = {}


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make an engine kind known by its `name` (to registry.get_engine and engine: auto)."""
    return register_kind(ENGINES, cls, "engine")
