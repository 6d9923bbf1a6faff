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
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from testbed import link, nsutil
from testbed.base import BaseTestbed, Workers
from testbed.clean import teardown  # noqa: F401 (re-exported: `from testbed.net import teardown`)
from testbed.engine.counters import ENGINE_PROCS, engine_procs_default
from testbed.runtime.base import Host, Runtime, get_runtime
from testbed.state import State, claim, state_dir
from testbed.errors import CapabilityMissing
from testbed.link import VXLAN_OVERHEAD
from testbed.topology.topo import Link, Topology

if TYPE_CHECKING:
    from testbed.engine.links import LinkEngines

MGMT_IFNAME = "mgmt0"
MGMT_TUNNEL = "vxmgmt"  # in the management namespace of each machine, when the topology spans machines


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
            raise CapabilityMissing(link.netem_missing_message(f"delay/jitter/loss on {where}"))
        self.engines.preflight()
        if any(l.offloads for l in self.topo.links) and not link.tool_present("ethtool"):
            raise CapabilityMissing("offload settings need ethtool: apt-get install ethtool")

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
            link.add_veth(netns_of[h], MGMT_IFNAME, mgmt_ns, port, 1500 - VXLAN_OVERHEAD if part else 1500,
                          bridge_b=link.BRIDGE)
            link.add_address(netns_of[h], MGMT_IFNAME, str(topo.plan.mgmt[h]))

        def bridge(ep):  # a switch's end is a port of its bridge
            return link.BRIDGE if topo.nodes[ep.node].kind == "switch" else None

        for l in topo.links:
            ends = [ep for ep in (l.a, l.b) if local(ep.node)]
            if len(ends) == 2:
                link.add_veth(netns_of[l.a.node], l.a.iface, netns_of[l.b.node], l.b.iface, l.mtu,
                              bridge_a=bridge(l.a), bridge_b=bridge(l.b))
            elif len(ends) == 1:  # the other end is on another machine: a tunnel end, the same name and role
                t = part["tunnels"][l.name]
                link.add_vxlan(netns_of[ends[0].node], ends[0].iface, t["vni"], [t["remote"]], t["port"], t["mtu"])
                if bridge(ends[0]):
                    link.enslave(netns_of[ends[0].node], ends[0].iface)
            for ep in ends:
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
        self.engines.start_wanted()

    def mtu_of(self, l: Link) -> int:
        """The link's MTU on the wire: its own, or the tunnel's when it crosses machines."""
        t = (self.part or {}).get("tunnels", {}).get(l.name)
        return t["mtu"] if t else l.mtu

    # -- engines (testbed/engine/links.py) -----------------------------------------------------------------

    @property
    def engines(self) -> "LinkEngines":
        """The engines of this topology on this machine."""
        from testbed.engine.links import LinkEngines

        return LinkEngines(self.topo, self.state, self.is_local, capture=self.capture, engine_procs=self.engine_procs)

    def engine_handles(self, links: Iterable[str] | None = None) -> dict[str, Any]:
        """EngineHandle per "link/direction" (of `links` only, if given)."""
        return self.engines.handles(links)

    def stats(self, links: Iterable[str] | None = None) -> list[dict]:
        """Each engine's counters and settings now (`alive: false` and the last saved counters if it died)."""
        return self.engines.stats(links)

    @contextmanager
    def detached(self, link_name: str) -> Iterator["Testbed"]:
        """Inside, the engines of one link see no traffic (the link passes it clean; the engines keep running);
        on leaving they are attached again."""
        with self.engines.detached(link_name):
            yield self

    def status(self) -> dict:
        """What `testbed status` reports: phase, hosts (present or not), engines (alive: the same process
        that was started, by pid and start time) and whether all is healthy, with the problems found."""
        d = self.state.data
        hosts = {}
        for h, hd in d.get("hosts", {}).items():
            present = bool(hd.get("netns")) and self.runtime.host_alive(self.host(h))
            hosts[h] = {"netns": hd.get("netns"), "present": present, "container": hd.get("container_id")}
        engines = self.engines.status()
        dead = [f"{e['link']} {e['direction']}" for e in engines if not e["alive"]]
        missing = [h for h, v in hosts.items() if not v["present"]]
        return {"name": self.name, "file": d.get("file"), "runtime": d.get("runtime"), "phase": d.get("phase"),
                "up_pid": d.get("up_pid"), "created_at": d.get("created_at"), "hosts": hosts, "engines": engines,
                "healthy": d.get("phase") == "up" and not dead and not missing,
                "problems": [f"engine dead: {x} (its link drops all traffic: fail closed)" for x in dead]
                + [f"host gone: {h}: {self.runtime.why_gone(self.host(h))}" for h in missing]}

    def set_link(self, link_name: str, direction: str | None = None, **settings) -> list[str]:
        """Change corruption settings of a running link (one direction or both) without touching its traffic.
        A direction without an engine gets one started."""
        return self.engines.set_link(link_name, direction, **settings)

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
        self.engines.restore(links, saved, report)

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


def text_table(rows: list[list], header: list[str], right: bool = False) -> str:
    """Rows under a header, columns aligned, a rule below the header; `right`: every column but the first
    right-aligned (tables of numbers)."""
    rows = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.rjust(widths[i]) if right and i else c.ljust(widths[i])
                             for i, c in enumerate(r)).rstrip())
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
