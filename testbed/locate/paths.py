"""Which link directions a rank-to-rank hop crosses, from the topology's address plan and routes.

The detectors see hops (rank a -> rank b); a fault lives on a link. `hop_paths` maps each probed hop to the
directions it crosses ("LINK/A->B", as `testbed stats` names them), following the routes that `testbed up`
installs (testbed/topology/plan.py). Only the structure is used, never a link's BER: the detectors are not told which
link is bad. A segment behind several bridged switches is crossed on its two host links only (switch-to-switch
links carry no engine).
"""

from __future__ import annotations



def phases(world_size: int) -> list[int]:
    """Ring offsets the monitor probes each step: +1 (rank r sends to r+1) and -1; with two ranks +1 already
    covers both ways."""
    return [1] if world_size <= 2 else [1, -1]


def _owner(plan):
    return {hi.address.ip: (h, hi) for h, his in plan.interfaces.items() for hi in his}


def _switch_end(link, host):
    return link.b.node if link.a.node == host else link.a.node


def hop_path(topo, src: str, dst: str) -> list[str]:
    """Link directions from host src to host dst's data address (the one gloo binds)."""
    plan, owner = topo.plan, _owner(topo.plan)
    target = plan.data_address(dst)
    out, at = [], src
    for _ in range(len(topo.hosts) + 1):
        if at == dst:
            return out
        direct = next((hi for hi in plan.interfaces[at] if target in hi.address.network), None)
        if direct is not None:
            nh, out_if = dst, direct
        else:
            route = next((r for r in plan.routes[at] if target in r.dst), None)
            if route is None:
                raise ValueError(f"no route from {src} to {dst} in {topo.name}")
            nh = owner[route.via][0]
            out_if = next(hi for hi in plan.interfaces[at] if route.via in hi.address.network)
        link = topo.link(out_if.link)
        far = _switch_end(link, at)
        if topo.nodes[far].kind == "host":
            out.append(f"{link.name}/{at}->{far}")
        else:  # through a switch: our link into it, then the next host's link out of it
            in_if = next(hi for hi in plan.interfaces[nh] if hi.address.ip in out_if.address.network)
            link2 = topo.link(in_if.link)
            out += [f"{link.name}/{at}->{far}", f"{link2.name}/{_switch_end(link2, nh)}->{nh}"]
        at = nh
    raise ValueError(f"routes from {src} to {dst} in {topo.name} loop")


def hop_paths(topo, hosts: list[str]) -> dict[str, list[str]]:
    """{"a->b" (ranks): [link directions]} for every hop the monitor probes (testbed/locate/monitor.py)."""
    w = len(hosts)
    out = {}
    for off in phases(w):
        for src in range(w):
            dst = (src + off) % w
            out[f"{src}->{dst}"] = hop_path(topo, hosts[src], hosts[dst])
    return out


def link_directions(topo) -> list[str]:
    """Every direction that can carry an engine (not switch-to-switch)."""
    return [f"{l.name}/{d}" for l in topo.links for d, *_ in l.directions()
            if not topo.nodes[l.a.node].kind == topo.nodes[l.b.node].kind == "switch"]
