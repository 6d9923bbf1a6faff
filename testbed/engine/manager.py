"""Start, query, change and stop engines (one handle per corrupted link direction), whatever their kind.

Every function here looks the engine kind up in the registry (testbed/engine/registry.py: the spec's or
handle's ``engine``) and calls its interface (testbed/engine/base.py): the NFQUEUE process
(testbed/engine/nfqueue_engine.py) or the in-kernel tc program (testbed/engine/bpf_engine.py). A started
engine is attached to its link only once it runs, and a dead one fails closed: its link drops traffic, never
passes it clean. ``EngineHandle`` is plain data (``to_dict``/``from_dict``) so a later process can stop the
engine.

One NFQUEUE process may serve several directions of one namespace (docs/engine.md, "Engine processes"):
``start_engines`` starts one for several specs, ``join_engine`` adds a direction to a running one.
"""

from __future__ import annotations

import sys

from testbed.engine.base import Engine, EngineHandle
from testbed.engine.config import EngineError, EngineSpec
from testbed.engine.nfqueue_engine import engine_alive, iptables_rule
from testbed.engine.registry import DEFAULT_ENGINE, get_engine

__all__ = [
    "EngineSpec",
    "EngineHandle",
    "EngineError",
    "start_engine",
    "start_engines",
    "join_engine",
    "stop_engine",
    "engine_stats",
    "set_engine",
    "engine_alive",
    "detach_engine",
    "attach_engine",
    "iptables_rule",
    "handle_alive",
]


def _target(h) -> tuple[Engine, object]:
    """The engine kind of `h` (a handle, a spec, their dicts, or the control socket and stats file of a
    process engine) and `h` as that kind takes it (a handle or spec where `h` was one's dict)."""
    if isinstance(h, dict) and "spec" in h:
        h = EngineHandle.from_dict(h)
    elif isinstance(h, dict) and "netns" in h:
        try:
            h = EngineSpec.from_dict(h)
        except (TypeError, ValueError):
            pass
    if isinstance(h, EngineHandle):
        return get_engine(h.spec.engine), h
    if isinstance(h, EngineSpec):
        return get_engine(h.engine), h
    return get_engine(DEFAULT_ENGINE), h  # paths only: a process engine's control socket and stats file


def handle_alive(handle) -> bool:
    """Whether the engine of `handle` (an EngineHandle or its dict) still corrupts its link: the same process
    (nfqueue), or the program still attached with its maps (bpf)."""
    engine, h = _target(handle)
    return engine.alive(h)


def detach_engine(handle: EngineHandle) -> None:
    """Take the engine off its link: the link passes its traffic clean (unlike a dead engine, which drops it)
    while the engine keeps running (nfqueue: its NFQUEUE rule removed; bpf: the tc filter removed, the maps
    stay). `attach_engine` undoes it."""
    get_engine(handle.kind).detach(handle)


def attach_engine(handle: EngineHandle) -> None:
    """Put the engine back on its link (after `detach_engine`): the link's packets go through it again."""
    get_engine(handle.kind).attach(handle)


def start_engine(spec: EngineSpec, python: str = sys.executable, ready_timeout: float = 20.0) -> EngineHandle:
    """Start an engine for ``spec`` (its own process, or a tc program for engine bpf) and attach it to the link;
    raise EngineError (with the engine's stderr) if it does not come up."""
    return get_engine(spec.engine).start([spec], python=python, ready_timeout=ready_timeout)[0]


def start_engines(specs: list[EngineSpec], python: str = sys.executable,
                  ready_timeout: float = 20.0) -> list[EngineHandle]:
    """One NFQUEUE engine process serving every spec (all engine nfqueue, one namespace, distinct queues), each
    direction attached to its link once all are bound; one handle per spec. The process logs into the first
    spec's log. On failure nothing is left: no process, no rule."""
    return get_engine(DEFAULT_ENGINE).start(specs, python=python, ready_timeout=ready_timeout)


def join_engine(running: EngineHandle, spec: EngineSpec, timeout: float = 10.0) -> EngineHandle:
    """Serve `spec` by the running engine process of `running` (another direction of the same namespace): the
    process binds the new queue (`{"cmd": "add"}` on the control socket), then the rule is added. EngineError if
    the process refuses or does not answer (nothing is left then)."""
    return get_engine(running.kind).join(running, spec, timeout=timeout)


def stop_engine(handle: EngineHandle, timeout: float = 10.0) -> dict:
    """Detach the engine from the link (remove the rule while the namespace exists), stop it (SIGTERM, then
    SIGKILL after ``timeout``), and return its final counters (from the stats file, ``alive: false``)."""
    return get_engine(handle.kind).stop(handle, timeout=timeout)


def engine_stats(handle_or_paths, timeout: float = 2.0) -> dict:
    """Live counters from the control socket (``alive: true``). If the engine does not answer: the last
    stats file (written every ~0.5 s) with ``alive: false`` and ``error`` saying why; with ``alive: true,
    responding: false`` instead when its process still runs (busy or stuck)."""
    engine, h = _target(handle_or_paths)
    return engine.stats(h, timeout=timeout)


def set_engine(handle, timeout: float = 5.0, **settings) -> dict:
    """Change corruption settings live (ber, error_model, scope, checksum, seed, collectives, control_ports,
    element, protect, protected_ber; None values are ignored, `protect=[]` clears the protection). Returns the
    settings now in force; raises EngineError if refused."""
    engine, h = _target(handle)
    return engine.set(h, timeout=timeout, **settings)
