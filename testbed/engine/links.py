"""The engines of one topology on this machine: where each corrupted direction's engine runs, starting them
at `up` (and later ones, `set_link`), stopping, querying, changing, detaching and restoring them. The state
file records every engine before it starts (a pending record, which also reserves its queue number and
files) and its handle once it runs, so that `down` and later processes find it.

`Testbed.engines` (testbed/net.py) is one of these; the engine kinds themselves are reached only through the
registry (testbed/engine/registry.py), never by name."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from testbed.engine.manager import (EngineHandle, EngineSpec, attach_engine, detach_engine, engine_stats,
                                    handle_alive, join_engine, set_engine, start_engine, stop_engine)
from testbed.engine.registry import all_engines, get_engine, resolve_engine
from testbed.errors import CapabilityMissing
from testbed.state import State, state_dir
from testbed.topology.topo import Link, LinkImpairment, Topology


class LinkEngines:
    def __init__(self, topology: Topology, state: State | None, is_local: Callable[[str], bool],
                 capture: dict | None = None, engine_procs: str | None = None):
        """`state`: the topology's state file (None before `up`: `preflight` only); `is_local(node)`: whether a
        node is built on this machine; `capture`: `up --capture` ({"dir", "max_bytes"}); `engine_procs`: host
        or direction (None: what the state file says)."""
        self.topo = topology
        self.state = state
        self.is_local = is_local
        self.capture = capture
        self.engine_procs = engine_procs

    @property
    def name(self) -> str:
        return self.topo.name

    def preflight(self) -> None:
        """What `up` checks of the engines before creating anything (errors.CapabilityMissing)."""
        directions = [(l.name, d, snd, rcv, imp) for l in self.topo.links for d, snd, rcv, imp in l.directions()
                      if imp.corrupts]
        for engine in all_engines():
            why = engine.preflight(directions, self.is_local)
            if why:
                raise CapabilityMissing(why)

    # -- starting ------------------------------------------------------------------------------------------

    def site(self, l: Link, direction: str) -> tuple[str, str, str]:
        """(netns, iface, hook) where a direction's corruption runs: egress of the sending host, or, when a
        switch sends, ingress of the receiving host. Always a host namespace, so switches need no iptables."""
        netns_of = self.state.data["netns_of"]
        _, snd, rcv, _ = l.direction(direction)
        if self.topo.nodes[snd.node].kind == "host":
            return netns_of[snd.node], snd.iface, "egress"
        return netns_of[rcv.node], rcv.iface, "ingress"

    def spec(self, l: Link, direction: str, imp: LinkImpairment) -> EngineSpec:
        """The EngineSpec of one direction: its site, a queue number free in that namespace, its files."""
        netns, iface, hook = self.site(l, direction)
        engines = self.state.data["engines"]
        # free in the namespace even after engines were stopped (links_restored stops those it started)
        queue_num = 1 + max([e.get("spec", {}).get("queue_num", 0) for e in engines.values()
                             if e.get("spec", {}).get("netns") == netns], default=0)
        edir = state_dir(self.name) / "engines"
        edir.mkdir(exist_ok=True)
        idx = 1 + max([int(Path(e["spec"]["stats_file"]).name.split(".")[0][1:]) for e in engines.values()
                       if e.get("spec")], default=-1)
        capture = None
        if self.capture:
            capture = {"dir": str(Path(self.capture["dir"]) / f"{l.name}.{direction.replace('->', '_to_')}"),
                       "max_bytes": int(self.capture.get("max_bytes", 10_000_000))}
        peer_netns, peer_iface = self._peer(l, direction, hook)
        kind = resolve_engine(imp, capture, peer_netns)
        return EngineSpec(
            topology=self.name, link=l.name, direction=direction, netns=netns, iface=iface, hook=hook,
            queue_num=queue_num, ber=imp.ber or 0.0, error_model=dict(imp.error_model), scope=imp.scope,
            checksum=imp.checksum, seed=imp.seed, collectives=list(imp.collectives) if imp.collectives else None,
            element=imp.element, protect=list(imp.protect) if imp.protect else None, protected_ber=imp.protected_ber,
            control_ports=list(self.topo.control_ports), control_socket=str(edir / f"e{idx}.sock"),
            stats_file=str(edir / f"e{idx}.stats.json"), capture=capture if get_engine(kind).captures else None,
            engine=kind, peer_netns=peer_netns, peer_iface=peer_iface,
        )

    def _peer(self, l: Link, direction: str, hook: str) -> tuple[str, str]:
        """The link's other end from the engine's site (netns, iface), where it is on this machine ("" if not):
        the bpf engine's checksum keep corrupts on the receiving end with the sending end's tx offload off."""
        netns_of = self.state.data["netns_of"]
        _, snd, rcv, _ = l.direction(direction)
        other = rcv if hook == "egress" else snd
        if not self.is_local(other.node) or other.node not in netns_of:
            return "", ""
        return netns_of[other.node], other.iface

    def start_wanted(self) -> None:
        """`up`: start the engine of every corrupted direction that runs on this machine. The kinds that start
        together go first (bpf: loaded in parallel, all or nothing); then, with engine_procs host, one NFQUEUE
        process per namespace for all of its directions, else one per direction."""
        wanted = [(l, dname, imp) for l in self.topo.links for dname, _, _, imp in l.directions()
                  if imp.corrupts and self.is_local(self.topo.engine_node(l, dname))]
        wanted = self._start_together(wanted)
        if self.engine_procs == "host":
            self._start_host_engines(wanted)
        else:
            for l, dname, imp in wanted:
                self.start(l, dname, imp)

    def start(self, l: Link, direction: str, imp: LinkImpairment) -> EngineHandle:
        """Start one direction's engine: its own process (or tc program), or, with engine_procs host, a lane of
        the NFQUEUE process already serving its namespace."""
        spec = self.spec(l, direction, imp)
        key = f"{l.name}/{direction}"
        running = self._host_engine(spec)
        return self._recorded([(key, spec)], lambda: [join_engine(running, spec) if running else start_engine(spec)])[0]

    def _start_host_engines(self, wanted: list) -> None:
        """engine_procs host: one process per namespace for all of its directions of a kind that shares one
        (nfqueue); the others alone."""
        groups: dict[tuple[str, str], list] = {}
        for l, dname, imp in wanted:
            key = f"{l.name}/{dname}"
            spec = self.spec(l, dname, imp)
            if not get_engine(spec.engine).shares_process:  # (up starts bpf ones together, _start_together)
                self._recorded([(key, spec)], lambda spec=spec: [start_engine(spec)])
                continue
            self.state.data["engines"][key] = {"spec": spec.to_dict(), "pending": True}  # reserves its queue
            groups.setdefault((spec.engine, spec.netns), []).append((key, spec))
        for (kind, _), members in groups.items():
            self._recorded(members, lambda kind=kind, members=members: get_engine(kind).start([s for _, s in members]))

    def _start_together(self, wanted: list) -> list:
        """Start the directions of `wanted` whose kind starts them together (bpf: independent directions, own
        maps, own filter, loaded 4 at a time, all or nothing); returns the others."""
        groups: dict[str, list] = {}
        rest = []
        for l, d, imp in wanted:
            spec = self.spec(l, d, imp)
            if not get_engine(spec.engine).starts_together:
                rest.append((l, d, imp))
                continue
            key = f"{l.name}/{d}"
            self.state.data["engines"][key] = {"spec": spec.to_dict(), "pending": True}  # reserves its files
            groups.setdefault(spec.engine, []).append((key, spec))
        for kind, members in groups.items():
            self._recorded(members, lambda kind=kind, members=members: get_engine(kind).start([s for _, s in members]))
        return rest

    def _recorded(self, members: list, start: Callable[[], list]) -> list:
        """Record `members` ((key, spec)) as pending, run `start` (their handles), record the handles."""
        engines = self.state.data["engines"]
        for key, spec in members:
            engines[key] = {"spec": spec.to_dict(), "pending": True}
        self.state.save()
        try:
            handles = start()
        except BaseException:
            # the engine's start removes its own process and rules on failure; forget the records, or `status`
            # would report a dead engine (and a dropping link) that never existed
            for key, _ in members:
                del engines[key]
            self.state.save()
            raise
        for (key, spec), handle in zip(members, handles):
            engines[key] = {"spec": spec.to_dict(), "handle": handle.to_dict()}
        self.state.save()
        return handles

    def _host_engine(self, spec: EngineSpec) -> EngineHandle | None:
        """With engine_procs host: the handle of a live engine process of the kind of `spec` in its namespace,
        to join; else None."""
        if not get_engine(spec.engine).shares_process:
            return None
        if (self.engine_procs or self.state.data.get("engine_procs") or "direction") != "host":
            return None
        for h in self.handles().values():
            if h.kind == spec.engine and h.spec.netns == spec.netns and handle_alive(h):
                return h
        return None

    # -- running engines -----------------------------------------------------------------------------------

    def stop(self, key: str) -> dict:
        """Stop the engine of `key` ("link/direction") and forget it; its final counters."""
        rec = self.state.data["engines"][key]
        final = stop_engine(EngineHandle.from_dict(rec["handle"]))
        del self.state.data["engines"][key]
        self.state.save()
        return final

    def handles(self, links: Iterable[str] | None = None) -> dict[str, EngineHandle]:
        """EngineHandle per "link/direction" (of `links` only, if given)."""
        wanted = None if links is None else {self.topo.link(n).name for n in links}
        return {k: EngineHandle.from_dict(v["handle"]) for k, v in self.state.data["engines"].items()
                if "handle" in v and (wanted is None or k.split("/")[0] in wanted)}

    def stats(self, links: Iterable[str] | None = None) -> list[dict]:
        """Each engine's counters and settings now (`alive: false` and the last saved counters if it died)."""
        out = []
        for key, h in self.handles(links).items():
            s = engine_stats(h)
            s.setdefault("link", key.split("/")[0])
            s.setdefault("direction", key.split("/")[1])
            out.append(s)
        return out

    def restore(self, links: list[str], saved: dict[str, dict], report: Callable[[str], None]) -> None:
        """Put `saved` settings (per "link/direction", RESTORED_SETTINGS) back on the engines of `links` and stop
        those not in `saved`; `report` each that failed."""
        for key, h in self.handles(links).items():
            try:
                if key in saved:
                    # [] puts "every collective" / "nothing protected" back (None would leave the current
                    # setting in force)
                    set_engine(h, **{**saved[key], "collectives": saved[key]["collectives"] or [],
                                     "protect": saved[key].get("protect") or []})
                else:
                    self.stop(key)
            except Exception as e:  # keep restoring the others
                report(f"could not restore engine {key}: {e}")

    @contextmanager
    def detached(self, link_name: str) -> Iterator["LinkEngines"]:
        """Inside, the engines of one link see no traffic (taken off the link, so it passes it clean; they keep
        running); on leaving they are attached again."""
        removed = []
        try:
            for h in self.handles([link_name]).values():
                if h.rule:
                    detach_engine(h)
                    removed.append(h)
            yield self
        finally:
            for h in removed:
                attach_engine(h)

    def detach_link(self, link_name: str) -> None:
        """Take every engine of the link off it until `attach_link` (the link passes its traffic clean)."""
        for h in self.handles([link_name]).values():
            if h.rule:
                detach_engine(h)

    def attach_link(self, link_name: str) -> None:
        """Put the engines of the link back on it (after `detach_link`)."""
        for h in self.handles([link_name]).values():
            if h.rule:
                attach_engine(h)

    def set_link(self, link_name: str, direction: str | None = None, **settings) -> list[str]:
        """Change corruption settings of a running link (one direction or both) without touching its traffic.
        A direction without an engine gets one started."""
        l = self.topo.link(link_name)
        names = [d[0] for d in l.directions()]
        if direction is not None:
            direction = l.direction_name(direction)
            names = [direction]
        names = [d for d in names if self.is_local(self.topo.engine_node(l, d))]  # the other machine's are its own
        changed = []
        handles = self.handles()
        given = {k: v for k, v in settings.items() if v is not None and k != "restart"}  # restart: not a setting
        for key, h in handles.items():
            if key.split("/")[0] == l.name and key.split("/")[1] in names:
                # validate the whole resulting configuration first: a refused setting is bad input (exit 2),
                # and nothing changes on any direction
                EngineSpec.from_dict({**h.spec.to_dict(), **given}).validate()
        for d in names:
            key = f"{l.name}/{d}"
            if key in handles:
                set_engine(handles[key], **settings)
            else:
                base = l.direction(d)[3].to_dict()  # a new engine starts afresh anyway
                base.update(given)
                base["ber"] = base.get("ber") or 0.0
                for k in ("collectives", "protect"):  # lists in to_dict and in settings, tuples in the dataclass
                    base[k] = tuple(base[k]) if base.get(k) else None
                imp = LinkImpairment(**base)
                self.start(l, d, imp)
            changed.append(key)
        return changed

    def status(self) -> list[dict]:
        """The engines' part of `testbed status`: link, direction, pid and whether each is alive (the same
        process that was started, by pid and start time; the same program attached, for bpf)."""
        engines = []
        for key, rec in self.state.data.get("engines", {}).items():
            h = rec.get("handle") or {}
            alive = not rec.get("pending") and bool(h) and handle_alive(h)
            engines.append({"link": key.split("/")[0], "direction": key.split("/")[1], "pid": h.get("pid"),
                            "alive": alive})
        return engines
