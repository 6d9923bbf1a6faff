"""The address and route plan of a topology: which subnet each L2 segment gets, each host interface's address,
each host's management address, and the routes that let every host reach every other host, multi-hop included.

Pure: computed from the validated file and its resolved nodes and links; problems are appended to `problems`
as (field path, message), like the rest of the validation.
"""

from __future__ import annotations

import ipaddress
import re
from collections import deque
from dataclasses import dataclass

from testbed.topology.elements import Link, Node
from testbed.topology.schema import TopologyFile


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


def build_plan(spec: TopologyFile, nodes: dict[str, Node], links: list[Link], problems: list) -> Plan | None:
    """The plan, or None when a problem (overlapping subnets, an address outside its segment, ...) was found."""
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
