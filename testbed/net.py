"""Bring a topology up and down on this machine: the local testbed (testbed/base.py's interface; callers get
one from testbed/testbeds.py). On one machine of several it builds that machine's part (testbed/machines).

    with Testbed.open("topologies/pair.yaml") as tb:
        tb.run("h1", ["ping", "-c1", str(tb.address("h2"))])
        before = tb.counters()
        ...                                   # traffic
        per_direction = tb.counters_since(before)

Everything created is recorded in the state file *before* it is created, so a failure at any point (or a
SIGKILL of this process) leaves a record that `down` / `down --all` uses to remove it all. The removal itself
lives in testbed/clean.py (`teardown`, re-exported here), which needs nothing of this module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from testbed import link, nsutil
from testbed.base import BaseTestbed, Workers
from testbed.clean import teardown  # noqa: F401 (re-exported: `from testbed.net import teardown`)
from testbed.runtime.base import Host, Runtime, get_runtime
from testbed.state import State, claim, state_dir
from testbed.machines.placement import VXLAN_OVERHEAD, engine_node
from testbed.topology.topo import Link, LinkImpairment, Topology

MGMT_IFNAME = "mgmt0"
MGMT_TUNNEL = "vxmgmt"  # in the management namespace of each machine, when the topology spans machines
# Counters that `counter_delta` subtracts by default (what a training summary reports per link direction).
# queue_dropped/user_dropped: packets the kernel dropped on the way to an NFQUEUE engine (its queue full, its
# socket overrun): loss the engine caused, kept apart from the link's (docs/engine.md, "Counters").
COUNTER_FIELDS = ("bits_seen", "bits_flipped", "packets_modified", "flows_desynced", "queue_dropped", "user_dropped")
# Tensor-scope engines also count flips by field of the value and the unprotected bits they saw.
FIELD_COUNTERS = ("bits_exposed", "flips_sign", "flips_exponent", "flips_mantissa")
# What `counter_delta` copies as it is from the later snapshot (the settings in force at its end).
COUNTER_KEPT = ("link", "direction", "alive", "ber", "scope", "checksum")
# Live-settable engine settings that `links_restored` puts back.
RESTORED_SETTINGS = ("ber", "error_model", "scope", "checksum", "seed", "collectives", "element", "protect",
                     "protected_ber")
# NFQUEUE engine processes: one per host namespace serving all of its corrupted directions, or one per direction
# (docs/engine.md, "Engine processes"; benchmarks/bench_engine_procs.py measured both). TESTBED_ENGINE_PROCS or
# `up --engine-procs` chooses.
ENGINE_PROCS = ("host", "direction")
DEFAULT_ENGINE_PROCS = "host"


def engine_procs_default() -> str:
    v = os.environ.get("TESTBED_ENGINE_PROCS") or DEFAULT_ENGINE_PROCS
    if v not in ENGINE_PROCS:
        raise ValueError(f"TESTBED_ENGINE_PROCS must be one of {', '.join(ENGINE_PROCS)}, got {v!r}")
    return v


class Testbed(BaseTestbed):
    def __init__(self, topology: Topology, runtime: str | None = None, capture: dict | None = None,
                 results_dir: str | Path | None = None, part: dict | None = None, engine_procs: str | None = None):
        self.topo = topology
        if engine_procs is not None and engine_procs not in ENGINE_PROCS:
            raise ValueError(f"engine_procs must be one of {', '.join(ENGINE_PROCS)}, got {engine_procs!r}")
        self.engine_procs = engine_procs
        # On one machine of several (testbed/machines/cluster.py): the nodes this machine builds and the VXLAN tunnel of
        # each link that leaves them (testbed/machines/placement.py, `parts`). None: every node, here.
        self.part = part
        self.runtime_name = runtime or topology.runtime
        self.capture = capture
        self.results_dir = Path(results_dir) if results_dir else None
        self.state: State | None = None
        self._runtime: Runtime | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, name: str | None = None, runtime: str | None = None,
             capture: dict | None = None, results_dir: str | Path | None = None,
             engine_procs: str | None = None) -> "Testbed":
        """The Testbed of the topology file at `path` (under `name` instead of the file's, if given), not up
        yet: `with Testbed.open(path) as tb:` brings it up and down."""
        return cls(Topology.load(path, name=name), runtime=runtime, capture=capture, results_dir=results_dir,
                   engine_procs=engine_procs)

    def is_local(self, node: str) -> bool:
        """Whether `node` is built on this machine (always, without a part)."""
        return self.part is None or node in self.part["nodes"]

    @property
    def is_up(self) -> bool:
        """Whether this object holds a running topology (after `up` or `attach`, until `down`)."""
        return self.state is not None

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            self._runtime = get_runtime(self.runtime_name)
        return self._runtime

    def preflight(self) -> None:
        """Everything that can be checked before creating anything."""
        if os.geteuid() != 0:
            raise PermissionError("bringing up a topology needs root (namespaces, veths, iptables)")
        self.runtime.check()
        needs_netem = [(l.name, d) for l in self.topo.links for d, _, _, imp in l.directions() if imp.needs_netem]
        if needs_netem and not link.netem_available():
            where = ", ".join(f"{ln} ({d})" for ln, d in needs_netem[:4])
            raise link.CapabilityMissing(link.netem_missing_message(f"delay/jitter/loss on {where}"))
        if any(imp.corrupts for l in self.topo.links for *_, imp in l.directions()):
            if not link.tool_present("iptables"):
                raise link.CapabilityMissing("bit corruption needs iptables (NFQUEUE target): apt-get install iptables")
        asks_bpf = [(l.name, d) for l in self.topo.links for d, _, _, imp in l.directions()
                    if imp.corrupts and imp.engine == "bpf"]
        if asks_bpf:
            from testbed.engine.bpf.engine import available

            ok, why = available()
            if not ok:
                where = ", ".join(f"{ln} ({d})" for ln, d in asks_bpf[:4])
                raise link.CapabilityMissing(f"engine: bpf on {where}, but the bpf engine cannot run here: {why} "
                                             f"(`testbed doctor` checks it; engine: auto falls back to nfqueue)")
            for l in self.topo.links:
                for d, snd, rcv, imp in l.directions():
                    if imp.corrupts and imp.engine == "bpf" and imp.checksum == "keep" and not (
                            self.is_local(snd.node) and self.is_local(rcv.node)):
                        raise link.CapabilityMissing(
                            f"engine: bpf with checksum: keep on {l.name} ({d}) needs both ends of the link on one "
                            f"machine (it corrupts on the receiving end, after the sending end checksummed the "
                            f"frames); use engine: nfqueue or auto there")
        if any(l.offloads for l in self.topo.links) and not link.tool_present("ethtool"):
            raise link.CapabilityMissing("offload settings need ethtool: apt-get install ethtool")

    def up(self) -> "Testbed":
        self.preflight()
        self.engine_procs = self.engine_procs or engine_procs_default()
        claim(self.name)
        self.state = State.new(self.name, file=self.topo.file, runtime=self.runtime_name, topology=self.topo.raw,
                               up_pid=os.getpid(), capture=self.capture,
                               results_dir=str(self.results_dir) if self.results_dir else None, part=self.part,
                               engine_procs=self.engine_procs)
        try:
            with link.batched():
                self._build()
        except BaseException:
            self.down(save_stats=False)
            raise
        self.state.update(phase="up", up_at=time.time())
        return self

    def _record_ns(self, name: str) -> str:
        self.state.data["namespaces"].append(name)
        self.state.save()
        return nsutil.create_netns(name)

    def _build(self) -> None:
        topo, st, local, part = self.topo, self.state, self.is_local, self.part
        sdir = state_dir(self.name)
        mgmt_ns = self._record_ns(nsutil.mgmt_ns_name(self.name))
        link.add_bridge(mgmt_ns)
        if part and part["mgmt"]["remotes"]:  # the management segment spans the machines
            m = part["mgmt"]
            link.add_vxlan(mgmt_ns, MGMT_TUNNEL, m["vni"], m["remotes"], m["port"], 1500 - VXLAN_OVERHEAD)
            link.enslave(mgmt_ns, MGMT_TUNNEL)

        netns_of: dict[str, str] = {}
        for sw in topo.switches:
            if not local(sw):
                continue
            netns_of[sw] = self._record_ns(nsutil.ns_name(self.name, sw))
            link.add_bridge(netns_of[sw])
        for h in topo.hosts:
            if not local(h):
                continue
            st.data["hosts"][h] = {"node": h, "pending": True}
            st.save()
            host = self.runtime.create(self.name, topo.nodes[h], sdir)
            st.data["hosts"][h] = host.to_dict()
            st.save()
            netns_of[h] = host.netns

        for i, h in enumerate(topo.hosts):
            if not local(h):
                continue
            port = f"p{i}"
            # over a tunnelled management segment, frames must fit the tunnel
            link.add_veth(netns_of[h], MGMT_IFNAME, mgmt_ns, port, 1500 - VXLAN_OVERHEAD if part else 1500)
            link.enslave(mgmt_ns, port)
            link.add_address(netns_of[h], MGMT_IFNAME, str(topo.plan.mgmt[h]))

        for l in topo.links:
            ends = [ep for ep in (l.a, l.b) if local(ep.node)]
            if len(ends) == 2:
                link.add_veth(netns_of[l.a.node], l.a.iface, netns_of[l.b.node], l.b.iface, l.mtu)
            elif len(ends) == 1:  # the other end is on another machine: a tunnel end, the same name and role
                t = part["tunnels"][l.name]
                link.add_vxlan(netns_of[ends[0].node], ends[0].iface, t["vni"], [t["remote"]], t["port"], t["mtu"])
            for ep in ends:
                if topo.nodes[ep.node].kind == "switch":
                    link.enslave(netns_of[ep.node], ep.iface)
                link.set_offloads(netns_of[ep.node], ep.iface, l.offloads)
        for h in topo.hosts:
            if local(h):
                for hi in topo.plan.interfaces[h]:
                    link.add_address(netns_of[h], hi.iface, str(hi.address))
        for h in topo.hosts:
            if local(h):
                for r in topo.plan.routes[h]:
                    link.add_route(netns_of[h], str(r.dst), str(r.via), r.dev)
        hosts_text = hosts_file(topo)
        for h in topo.hosts:
            if local(h):
                self.runtime.set_hosts_file(self.host(h), hosts_text)
        for l in topo.links:
            for dname, snd, _rcv, imp in l.directions():
                if local(snd.node):
                    link.apply_impairment(netns_of[snd.node], snd.iface, imp, self.mtu_of(l))
        st.data["netns_of"] = netns_of
        st.save()
        wanted = [(l, dname, imp) for l in topo.links for dname, _, _, imp in l.directions()
                  if imp.corrupts and local(engine_node(topo, l, dname))]
        wanted = self._start_bpf_engines(wanted)
        if self.engine_procs == "host":
            self._start_host_engines(wanted)
        else:
            for l, dname, imp in wanted:
                self._start_engine(l, dname, imp)

    def mtu_of(self, l: Link) -> int:
        """The link's MTU on the wire: its own, or the tunnel's when it crosses machines."""
        t = (self.part or {}).get("tunnels", {}).get(l.name)
        return t["mtu"] if t else l.mtu

    # -- engines -------------------------------------------------------------------------------------------

    def engine_site(self, l: Link, direction: str) -> tuple[str, str, str]:
        """(netns, iface, hook) where a direction's corruption runs: egress of the sending host, or, when a
        switch sends, ingress of the receiving host. Always a host namespace, so switches need no iptables."""
        netns_of = self.state.data["netns_of"]
        _, snd, rcv, _ = l.direction(direction)
        if self.topo.nodes[snd.node].kind == "host":
            return netns_of[snd.node], snd.iface, "egress"
        return netns_of[rcv.node], rcv.iface, "ingress"

    def _engine_spec(self, l: Link, direction: str, imp: LinkImpairment):
        """The EngineSpec of one direction: its site, a queue number free in that namespace, its files."""
        from testbed.engine.manager import EngineSpec

        netns, iface, hook = self.engine_site(l, direction)
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
        peer_netns, peer_iface = self._engine_peer(l, direction, hook)
        kind = self._engine_kind(imp, capture, peer_netns)
        return EngineSpec(
            topology=self.name, link=l.name, direction=direction, netns=netns, iface=iface, hook=hook,
            queue_num=queue_num, ber=imp.ber or 0.0, error_model=dict(imp.error_model), scope=imp.scope,
            checksum=imp.checksum, seed=imp.seed, collectives=list(imp.collectives) if imp.collectives else None,
            element=imp.element, protect=list(imp.protect) if imp.protect else None, protected_ber=imp.protected_ber,
            control_ports=list(self.topo.control_ports), control_socket=str(edir / f"e{idx}.sock"),
            stats_file=str(edir / f"e{idx}.stats.json"), capture=capture if kind == "nfqueue" else None,
            engine=kind, peer_netns=peer_netns, peer_iface=peer_iface,
        )

    def _start_engine(self, l: Link, direction: str, imp: LinkImpairment):
        """Start one direction's engine: its own process (or tc program), or, with engine_procs host, a lane of
        the NFQUEUE process already serving its namespace."""
        from testbed.engine.manager import join_engine, start_engine

        spec = self._engine_spec(l, direction, imp)
        key = f"{l.name}/{direction}"
        running = self._host_engine(spec.netns) if spec.engine == "nfqueue" else None
        return self._recorded([(key, spec)], lambda: [join_engine(running, spec) if running else start_engine(spec)])[0]

    def _start_host_engines(self, wanted: list) -> None:
        """engine_procs host: one NFQUEUE process per namespace for all of its directions (bpf ones alone)."""
        from testbed.engine.manager import start_engine, start_engines

        groups: dict[str, list] = {}
        for l, dname, imp in wanted:
            key = f"{l.name}/{dname}"
            spec = self._engine_spec(l, dname, imp)
            if spec.engine != "nfqueue":  # (up starts bpf ones together, _start_bpf_engines)
                self._recorded([(key, spec)], lambda spec=spec: [start_engine(spec)])
                continue
            self.state.data["engines"][key] = {"spec": spec.to_dict(), "pending": True}  # reserves its queue
            groups.setdefault(spec.netns, []).append((key, spec))
        for members in groups.values():
            self._recorded(members, lambda members=members: start_engines([s for _, s in members]))

    def _start_bpf_engines(self, wanted: list) -> list:
        """Start the bpf directions of `wanted`; returns the others. bpf directions are independent (own maps,
        own filter), and a load is mostly the kernel's verifier (~0.17 s) working in the loading thread: load
        up to 4 at a time. All or nothing: if one fails, those that started are stopped before the error
        propagates."""
        from concurrent.futures import ThreadPoolExecutor

        from testbed.engine.bpf import build, pins
        from testbed.engine.manager import start_engine, stop_engine

        members, rest = [], []
        for l, d, imp in wanted:
            spec = self._engine_spec(l, d, imp)
            if spec.engine != "bpf":
                rest.append((l, d, imp))
                continue
            key = f"{l.name}/{d}"
            self.state.data["engines"][key] = {"spec": spec.to_dict(), "pending": True}  # reserves its files
            members.append((key, spec))
        if not members:
            return rest
        build.object_path()  # compiled (or found) once, before the threads
        pins.ensure_bpffs()

        def start_all() -> list:
            with ThreadPoolExecutor(max_workers=min(4, len(members)), thread_name_prefix="bpf-load") as pool:
                futures = [pool.submit(start_engine, spec) for _, spec in members]
            # leaving the pool waited for every load (also after an interrupt): undo all if one failed
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                for f in futures:
                    if f.exception() is None:
                        try:
                            stop_engine(f.result())
                        except Exception:  # the namespace teardown of the rollback removes what is left
                            pass
                raise errors[0]
            return [f.result() for f in futures]

        self._recorded(members, start_all)
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
            # start_engine(s) removes its own process and rules on failure; forget the records, or `status`
            # would report a dead engine (and a dropping link) that never existed
            for key, _ in members:
                del engines[key]
            self.state.save()
            raise
        for (key, spec), handle in zip(members, handles):
            engines[key] = {"spec": spec.to_dict(), "handle": handle.to_dict()}
        self.state.save()
        return handles

    def _host_engine(self, netns: str):
        """With engine_procs host: the handle of a live NFQUEUE engine process in `netns`, to join; else None."""
        from testbed.engine.manager import handle_alive

        if (self.engine_procs or self.state.data.get("engine_procs") or "direction") != "host":
            return None
        for h in self.engine_handles().values():
            if h.spec.engine == "nfqueue" and h.spec.netns == netns and handle_alive(h):
                return h
        return None

    def _engine_peer(self, l: Link, direction: str, hook: str) -> tuple[str, str]:
        """The link's other end from the engine's site (netns, iface), where it is on this machine ("" if not):
        the bpf engine's checksum keep corrupts on the receiving end with the sending end's tx offload off."""
        netns_of = self.state.data["netns_of"]
        _, snd, rcv, _ = l.direction(direction)
        other = rcv if hook == "egress" else snd
        if not self.is_local(other.node) or other.node not in netns_of:
            return "", ""
        return netns_of[other.node], other.iface

    def _engine_kind(self, imp: LinkImpairment, capture: dict | None, peer_netns: str) -> str:
        """`engine` of a direction resolved: auto is bpf for scopes payload/all where the bpf engine runs (and,
        for checksum keep, the link's other end is on this machine; no --capture), nfqueue otherwise."""
        if imp.engine != "auto":
            return imp.engine
        if imp.scope not in ("payload", "all") or capture or (imp.checksum == "keep" and not peer_netns):
            return "nfqueue"
        from testbed.engine.bpf.engine import available

        return "bpf" if available()[0] else "nfqueue"

    def _stop_engine(self, key: str) -> dict:
        """Stop the engine of `key` ("link/direction") and forget it; its final counters."""
        from testbed.engine.manager import EngineHandle, stop_engine

        rec = self.state.data["engines"][key]
        final = stop_engine(EngineHandle.from_dict(rec["handle"]))
        del self.state.data["engines"][key]
        self.state.save()
        return final

    def engine_handles(self, links: Iterable[str] | None = None) -> dict[str, Any]:
        """EngineHandle per "link/direction" (of `links` only, if given)."""
        from testbed.engine.manager import EngineHandle

        wanted = None if links is None else {self.topo.link(n).name for n in links}
        return {k: EngineHandle.from_dict(v["handle"]) for k, v in self.state.data["engines"].items()
                if "handle" in v and (wanted is None or k.split("/")[0] in wanted)}

    def stats(self, links: Iterable[str] | None = None) -> list[dict]:
        """Each engine's counters and settings now (`alive: false` and the last saved counters if it died)."""
        from testbed.engine.manager import engine_stats
        out = []
        for key, h in self.engine_handles(links).items():
            s = engine_stats(h)
            s.setdefault("link", key.split("/")[0])
            s.setdefault("direction", key.split("/")[1])
            out.append(s)
        return out

    def counters(self, links: Iterable[str] | None = None) -> dict[str, dict]:
        """A snapshot of every engine's stats (of `links` only, if given), keyed "link/direction": take one
        before and one after some traffic and `counter_delta` says what that traffic met."""
        return {f"{s['link']}/{s['direction']}": s for s in self.stats(links)}

    def counters_since(self, before: dict[str, dict], links: Iterable[str] | None = None,
                       fields: Iterable[str] = COUNTER_FIELDS) -> dict[str, dict]:
        """`counter_delta(before, self.counters(links), fields)`."""
        return counter_delta(before, self.counters(links), fields)

    @contextmanager
    def links_restored(self, links: Iterable[str] | None = None,
                       warn: Callable[[str], None] | None = None) -> Iterator["Testbed"]:
        """Change the engines of `links` (every link if None) freely inside; on leaving, each engine that was
        there gets its settings back and engines started inside are stopped, so the topology is as it was.
        An engine that cannot be put back is passed to `warn`, or without one raised as a RuntimeError after
        every other engine was restored (a note on the block's own exception, if it raised)."""
        links = [l.name for l in self.topo.links] if links is None else [self.topo.link(n).name for n in links]
        saved = {k: {f: s.get(f) for f in RESTORED_SETTINGS} for k, s in self.counters(links).items()}
        try:
            yield self
        except BaseException as e:
            self._restore_engines(links, saved, warn or e.add_note)
            raise
        failed: list[str] = []
        self._restore_engines(links, saved, warn or failed.append)
        if failed:
            raise RuntimeError(f"topology {self.name}: " + "; ".join(failed))

    def _restore_engines(self, links: list[str], saved: dict[str, dict], report: Callable[[str], None]) -> None:
        """Put `saved` settings back and stop the engines not in `saved`; `report` each that failed."""
        from testbed.engine.manager import set_engine

        for key, h in self.engine_handles(links).items():
            try:
                if key in saved:
                    # [] puts "every collective" / "nothing protected" back (None would leave the current
                    # setting in force)
                    set_engine(h, **{**saved[key], "collectives": saved[key]["collectives"] or [],
                                     "protect": saved[key].get("protect") or []})
                else:
                    self._stop_engine(key)
            except Exception as e:  # keep restoring the others
                report(f"could not restore engine {key}: {e}")

    @contextmanager
    def detached(self, link_name: str) -> Iterator["Testbed"]:
        """Inside, the engines of one link see no traffic (their NFQUEUE rules are removed, so the link passes
        it clean; the processes keep running); on leaving they are attached again."""
        from testbed.engine.manager import attach_engine, detach_engine

        removed = []
        try:
            for h in self.engine_handles([link_name]).values():
                if h.rule:
                    detach_engine(h)
                    removed.append(h)
            yield self
        finally:
            for h in removed:
                attach_engine(h)

    def status(self) -> dict:
        """What `testbed status` reports: phase, hosts (present or not), engines (alive: the same process
        that was started, by pid and start time) and whether all is healthy, with the problems found."""
        from testbed.engine.manager import handle_alive

        d = self.state.data
        hosts = {}
        for h, hd in d.get("hosts", {}).items():
            present = bool(hd.get("netns")) and self.runtime.host_alive(self.host(h))
            hosts[h] = {"netns": hd.get("netns"), "present": present, "container": hd.get("container_id")}
        engines = []
        for key, rec in d.get("engines", {}).items():
            h = rec.get("handle") or {}
            alive = not rec.get("pending") and bool(h) and handle_alive(h)
            engines.append({"link": key.split("/")[0], "direction": key.split("/")[1], "pid": h.get("pid"),
                            "alive": alive})
        dead = [f"{e['link']} {e['direction']}" for e in engines if not e["alive"]]
        missing = [h for h, v in hosts.items() if not v["present"]]
        return {"name": self.name, "file": d.get("file"), "runtime": d.get("runtime"), "phase": d.get("phase"),
                "up_pid": d.get("up_pid"), "created_at": d.get("created_at"), "hosts": hosts, "engines": engines,
                "healthy": d.get("phase") == "up" and not dead and not missing,
                "problems": [f"engine dead: {x} (its link drops all traffic: fail closed)" for x in dead]
                + [f"host gone: {h}" for h in missing]}

    def set_link(self, link_name: str, direction: str | None = None, **settings) -> list[str]:
        """Change corruption settings of a running link (one direction or both) without touching its traffic.
        A direction without an engine gets one started."""
        from testbed.engine.manager import EngineSpec, set_engine

        l = self.topo.link(link_name)
        names = [d[0] for d in l.directions()]
        if direction is not None:
            direction = normalize_direction(l, direction)
            names = [direction]
        names = [d for d in names if self.is_local(engine_node(self.topo, l, d))]  # the other machine's are its own
        changed = []
        handles = self.engine_handles()
        for key, h in handles.items():
            if key.split("/")[0] == l.name and key.split("/")[1] in names:
                # validate the whole resulting configuration first: a refused setting is bad input (exit 2),
                # and nothing changes on any direction
                EngineSpec.from_dict({**h.spec.to_dict(), **{k: v for k, v in settings.items() if v is not None}}
                                     ).validate()
        for d in names:
            key = f"{l.name}/{d}"
            if key in handles:
                set_engine(handles[key], **settings)
            else:
                base = l.direction(d)[3].to_dict()
                base.update({k: v for k, v in settings.items() if v is not None})
                base["ber"] = base.get("ber") or 0.0
                for k in ("collectives", "protect"):  # lists in to_dict and in settings, tuples in the dataclass
                    base[k] = tuple(base[k]) if base.get(k) else None
                imp = LinkImpairment(**base)
                self._start_engine(l, d, imp)
            changed.append(key)
        return changed

    # -- running things in hosts ---------------------------------------------------------------------------

    def host(self, node: str) -> Host:
        try:
            return Host.from_dict(self.state.data["hosts"][node])
        except KeyError:
            raise KeyError(f"topology {self.name!r} has no host {node!r} (hosts: {', '.join(self.topo.hosts)})") from None

    def popen(self, node: str, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        return self.runtime.popen(self.host(node), argv, env, **kw)

    def run(self, node: str, argv: list[str], env: dict | None = None, check: bool = False,
            timeout: float | None = None, input: str | None = None, text: bool = True) -> subprocess.CompletedProcess:
        """Run to completion inside `node`. On timeout the command itself is killed (in a container too, not
        only the client that started it)."""
        p = self.popen(node, argv, env, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        r = subprocess.CompletedProcess(argv, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    def exec_interactive(self, node: str, argv: list[str]) -> int:
        """Replace this process by argv in `node`: stdout, stderr and the exit code pass straight through."""
        cmd = self.runtime.exec_argv(self.host(node), argv)
        sys.stdout.flush()
        os.execvp(cmd[0], cmd)  # FileNotFoundError if there is no such program
        return 0  # not reached

    def read_json_line(self, proc, key: str, timeout: float = 30) -> dict:
        from testbed.procs import read_json_line

        return read_json_line(proc, key, timeout)

    def read_file(self, node: str, path: str) -> str:
        with open(path) as f:  # the hosts write into this machine's file system
            return f.read()

    @contextmanager
    def host_dir(self, hosts: list[str], local_dir: Path) -> Iterator[Path]:
        yield Path(local_dir)

    def workers(self, out: Path, hosts: list[str], passed: tuple[str, ...]) -> "LocalWorkers":
        return LocalWorkers(self, Path(out), hosts, passed)

    def restore_links(self, links: list[str], saved: dict[str, dict], report: Callable[[str], None]) -> None:
        self._restore_engines(links, saved, report)

    def describe_ranks(self, hosts: list[str]) -> str:
        return f"{self.name} ({self.runtime_name}): {len(hosts)} ranks on {', '.join(hosts)}"

    def describe(self) -> str:
        topo = self.topo
        hosts = []
        for h in topo.hosts:
            ifs = ", ".join(f"{i.iface} {i.address}" for i in topo.plan.interfaces[h])
            hosts.append([h, self.runtime_name, f"mgmt0 {topo.plan.mgmt[h]}", ifs or "-"])
        for s in topo.switches:
            hosts.append([s, "switch", "-", "bridge br0"])
        links = []
        engines = self.state.data.get("engines", {}) if self.state else {}
        for l in topo.links:
            for dname, _, _, imp in l.directions():
                desc = imp.describe()
                if desc.endswith(" engine auto"):  # say what auto resolved to (not started here: another machine's)
                    kind = engines.get(f"{l.name}/{dname}", {}).get("spec", {}).get("engine")
                    desc = desc[: -len("auto")] + (f"{kind} (auto)" if kind else "auto")
                links.append([l.name, f"{l.a} <-> {l.b}", l.mtu, dname, desc])
        return "\n".join([f"topology {topo.name} ({topo.file or 'in memory'}), runtime {self.runtime_name}", "",
                          text_table(hosts, ["node", "runtime", "management", "data interfaces"]), "",
                          text_table(links, ["link", "endpoints", "mtu", "direction", "impairments"])])

    # -- teardown ------------------------------------------------------------------------------------------

    def down(self, save_stats: bool = True) -> dict:
        if self.state is None:
            return {"errors": []}
        result = teardown(self.name, save_stats=save_stats, results_dir=self.results_dir)
        self.state = None
        return result

    @classmethod
    def attach(cls, name: str) -> "Testbed":
        """The Testbed object of a topology that is already up (from its state file)."""
        st = State.load(name)
        if "topology" not in st.data:
            raise LookupError(f"topology {name!r} has no usable state (its `up` was interrupted): remove what it "
                              f"left with `testbed down {name}`")
        topo = Topology.from_dict(st.data["topology"], file=st.data.get("file"))
        tb = cls(topo, runtime=st.data.get("runtime"), capture=st.data.get("capture"),
                 results_dir=st.data.get("results_dir"), part=st.data.get("part"))
        tb.state = st
        return tb


class LocalWorkers(Workers):
    """Training workers in this machine's hosts. They write where they can: anywhere for namespace hosts, the
    runtime's shared work directory for containers (moved into `out` on leaving)."""

    def __init__(self, tb: Testbed, out: Path, hosts: list[str], passed: tuple[str, ...]):
        self.tb, self.out, self.hosts, self.passed = tb, out, hosts, passed
        shared = tb.runtime.shared_dir()
        self.run_dir = out if shared is None else Path(shared) / f"run-{uuid.uuid4().hex[:12]}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.facts: dict = {}

    def spawn(self, rank: int, argv: list[str], env: dict):
        tb = self.tb
        argv = [tb.runtime.python, *argv[1:]]  # the host's python (the image's, in a container)
        with open(self.run_dir / f"worker-rank{rank}.log", "wb") as logf:
            return tb.popen(self.hosts[rank], argv, {k: env[k] for k in self.passed if k in env},
                            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)

    def __exit__(self, *exc) -> None:
        self.facts.update(self.tb.runtime.run_facts(self.tb.host(self.hosts[0])))
        if self.run_dir != self.out:
            for p in self.run_dir.iterdir():
                dest = self.out / p.name
                if dest.exists():
                    dest.unlink() if dest.is_file() else shutil.rmtree(dest)
                shutil.move(str(p), dest)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.facts["run_dir"] = str(self.out)


def text_table(rows: list[list], header: list[str]) -> str:
    """Rows under a header, columns aligned, a rule below the header."""
    rows = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def hosts_file(topo: Topology) -> str:
    """Every host by name: `h2` is its main data address, `h2-mgmt` its management address, `h2-eth2` each
    further data interface."""
    lines = ["127.0.0.1\tlocalhost"]
    for h in topo.hosts:
        ifs = topo.plan.interfaces[h]
        if ifs:
            lines.append(f"{ifs[0].address.ip}\t{h} {h}-{ifs[0].iface}")
        lines += [f"{i.address.ip}\t{h}-{i.iface}" for i in ifs[1:]]
        lines.append(f"{topo.plan.mgmt[h].ip}\t{h}-mgmt")
    return "\n".join(lines) + "\n"


def normalize_direction(l: Link, direction: str) -> str:
    """Accept 'A->B' or 'A-B' (when unambiguous) for one of the link's directions."""
    names = [d[0] for d in l.directions()]
    if direction in names:
        return direction
    for n in names:
        if n.replace("->", "-") == direction:
            return n
    raise KeyError(f"link {l.name} has no direction {direction!r} (directions: {', '.join(names)})")


def counter_delta(before: dict[str, dict], after: dict[str, dict],
                  fields: Iterable[str] = COUNTER_FIELDS) -> dict[str, dict]:
    """Per "link/direction" of `after` (two `Testbed.counters()` snapshots): each of `fields` as after minus
    before (an engine started in between counts from 0), plus link, direction, alive, ber, scope and checksum
    as they were at `after`. An engine gone by `after` is left out."""
    fields = tuple(fields)
    out = {}
    for key, s in after.items():
        b = before.get(key, {})
        d = {f: s.get(f) for f in COUNTER_KEPT}
        d["link"] = d["link"] or key.split("/")[0]
        d["direction"] = d["direction"] or key.split("/")[1]
        d["alive"] = s.get("alive", True)
        d.update({f: (s.get(f) or 0) - (b.get(f) or 0) for f in fields})
        out[key] = d
    return out

