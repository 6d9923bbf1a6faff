"""The engine kinds this testbed knows (base.py's interface). Importing this module registers the built-in
ones, nfqueue first (the default) and bpf; `engine: auto` is resolved here and nowhere else."""

from __future__ import annotations

from testbed.engine import nfqueue_engine  # noqa: F401 (registers itself; first: the default)
from testbed.engine import bpf_engine  # noqa: F401 (registers itself; its bpf module is imported only when used)
from testbed.engine.base import AUTO, ENGINES, Engine

DEFAULT_ENGINE = nfqueue_engine.NfqueueEngine.name  # what a direction without `engine:` gets


def get_engine(name: str) -> Engine:
    try:
        return ENGINES[name]()
    except KeyError:
        raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {name!r}") from None


def engine_names() -> list[str]:
    """The registered kinds' names, nfqueue first (a topology's `engine:` also takes `auto`)."""
    return list(ENGINES)


def engine_choices() -> list[str]:
    """What a direction's `engine` may ask for: every kind, then auto (the choices of --engine)."""
    return engine_names() + [AUTO]


def all_engines() -> list[Engine]:
    """One instance of every registered kind, in registration order."""
    return [cls() for cls in ENGINES.values()]


def describe_engine(kind: str) -> str:
    """What a link's description says of its engine: nothing for the default kind, else " engine KIND"."""
    return "" if kind == DEFAULT_ENGINE else f" engine {kind}"


def resolve_engine(imp, capture: dict | None, peer_netns: str) -> str:
    """`imp.engine` of a direction (a LinkImpairment) resolved: auto is the kind of lowest `auto_rank` that
    serves the direction and runs here (bpf for scopes payload/all where the bpf engine runs and, for checksum
    keep, the link's other end is on this machine, without a capture), else the default (nfqueue)."""
    if imp.engine != AUTO:
        return imp.engine
    for e in sorted(all_engines(), key=lambda e: e.auto_rank):
        if e.serves(imp, capture, peer_netns) and e.available()[0]:
            return e.name
    return DEFAULT_ENGINE
