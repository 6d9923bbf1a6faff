"""How the wire behaves: veth pairs between namespaces, bridges, MTU, offloads, and tc qdiscs for rate,
delay, jitter and loss. Everything is addressed by netns path, whichever runtime made the host.

Bit corruption is not here: it is the engine's job (testbed/engine), attached to the same interfaces.
"""

from __future__ import annotations

import contextlib
import functools
import shutil

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from testbed import nsutil
from testbed.errors import CapabilityMissing
from testbed.topology.topo import OFFLOAD_FEATURES, LinkImpairment

VXLAN_OVERHEAD = 50  # outer Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8 bytes

BRIDGE = "br0"


# Opening a netlink socket inside a namespace costs a thread (nsutil.iproute); building a topology makes hundreds of
# changes, so `batched()` keeps one socket per namespace open for a whole build (and the bridges' indexes).
_open_sockets: dict[str, IPRoute] | None = None
_bridge_index: dict[tuple[str, str], int] = {}


@contextlib.contextmanager
def batched():
    global _open_sockets
    if _open_sockets is not None:  # already batching
        yield
        return
    _open_sockets = {}
    try:
        yield
    finally:
        for sock in _open_sockets.values():
            sock.close()
        _open_sockets = None
        _bridge_index.clear()


@contextlib.contextmanager
def _netns(path: str):
    if _open_sockets is None:
        with nsutil.iproute(path) as n:
            yield n
        return
    if path not in _open_sockets:
        _open_sockets[path] = nsutil.iproute(path)
    yield _open_sockets[path]


def _bridge(n: IPRoute, ns: str, bridge: str) -> int:
    """The index of `bridge` in namespace `ns` (remembered while batching: a bridge keeps its index)."""
    if _open_sockets is None:
        return n.link_lookup(ifname=bridge)[0]
    key = (ns, bridge)
    if key not in _bridge_index:
        _bridge_index[key] = n.link_lookup(ifname=bridge)[0]
    return _bridge_index[key]


def add_veth(ns_a: str, if_a: str, ns_b: str, if_b: str, mtu: int, bridge_a: str | None = None,
             bridge_b: str | None = None) -> None:
    """A veth pair created directly with one end in each namespace: nothing ever appears in the root
    namespace, so names cannot collide with the host's own interfaces. Both ends get `mtu` and come up; an
    end with a bridge (`bridge_a`, `bridge_b`: a bridge of that end's namespace) becomes its port."""
    with _netns(ns_a) as a:
        # One request: end a up with its MTU (and master), the peer with its MTU (a peer's flags and master
        # cannot be given at creation: the kernel applies neither).
        kw = {"master": _bridge(a, ns_a, bridge_a)} if bridge_a else {}
        a.link("add", ifname=if_a, kind="veth", mtu=mtu, state="up", **kw,
               peer={"ifname": if_b, "net_ns_fd": ns_b, "mtu": mtu})
    with _netns(ns_b) as b:
        kw = {"master": _bridge(b, ns_b, bridge_b)} if bridge_b else {}
        b.link("set", ifname=if_b, state="up", **kw)  # by name: the kernel looks it up


def add_vxlan(ns: str, ifname: str, vni: int, remotes: list[str], port: int, mtu: int) -> None:
    """A VXLAN tunnel end named `ifname`, created directly inside namespace `ns` while its UDP socket stays in
    this process's namespace (the machine's own network, where the underlay is): the device never appears
    among the machine's interfaces. One remote: a point-to-point tunnel; several (the management segment):
    head-end replication to each (all-zero fdb entries), MACs learnt as on a switch."""
    import pyroute2

    # Created under a name of its own, renamed inside the namespace: older kernels (Debian 12's 6.1) refuse a new
    # device whose name exists in the creating namespace even when it is made in another one ("File exists"), and
    # the machine's own interfaces are often named like the topology's (a Vagrant VM's eth1).
    tmp = f"tbvx{vni:06x}"
    with pyroute2.IPRoute() as ip:
        kw = {"vxlan_group": remotes[0]} if len(remotes) == 1 else {}
        try:
            ip.link("add", ifname=tmp, kind="vxlan", vxlan_id=vni, vxlan_port=port, net_ns_fd=ns, **kw)
        except NetlinkError as e:
            if e.code == 17:  # EEXIST: another tunnel of this machine has the same VNI on the same port
                raise RuntimeError(f"VXLAN VNI {vni} on UDP port {port} is already in use on this machine (another "
                                   "topology between the same machines?): choose another --name or --vxlan-port") from None
            raise
    with _netns(ns) as n:
        idx = n.link_lookup(ifname=tmp)[0]
        n.link("set", index=idx, ifname=ifname)
        if len(remotes) > 1:
            for r in remotes:
                n.fdb("append", ifindex=idx, lladdr="00:00:00:00:00:00", dst=r)
        n.link("set", index=idx, mtu=mtu, state="up")


def add_address(ns: str, iface: str, address: str) -> None:
    with _netns(ns) as n:
        idx = n.link_lookup(ifname=iface)[0]
        ip, prefix = address.split("/")
        n.addr("add", index=idx, address=ip, prefixlen=int(prefix))


def add_route(ns: str, dst: str, via: str, dev: str) -> None:
    with _netns(ns) as n:
        idx = n.link_lookup(ifname=dev)[0]
        n.route("add", dst=dst, gateway=via, oif=idx)


def add_bridge(ns: str, name: str = BRIDGE) -> None:
    with _netns(ns) as n:
        # No STP (loops are refused at validation); ports forward at once.
        n.link("add", ifname=name, kind="bridge", br_stp_state=0, br_forward_delay=0)
        idx = n.link_lookup(ifname=name)[0]
        n.link("set", index=idx, state="up")


def enslave(ns: str, iface: str, bridge: str = BRIDGE) -> None:
    with _netns(ns) as n:
        n.link("set", ifname=iface, master=_bridge(n, ns, bridge))


def set_offloads(ns: str, iface: str, offloads: dict[str, bool]) -> None:
    if not offloads:
        return
    args = []
    for key, on in offloads.items():
        args += [OFFLOAD_FEATURES[key], "on" if on else "off"]
    r = nsutil.nsexec(ns, ["ethtool", "-K", iface, *args], check=False)
    if r.returncode != 0:
        raise CapabilityMissing(f"ethtool -K {iface} {' '.join(args)} failed: {(r.stderr or r.stdout).strip()}"
                                " (is ethtool installed? apt-get install ethtool)")


def apply_impairment(ns: str, iface: str, imp: LinkImpairment, mtu: int) -> None:
    """Shape egress of `iface` in `ns` for one direction: netem (delay/jitter/loss) with tbf (rate) below."""
    if not (imp.rate_bps or imp.needs_netem):
        return
    with _netns(ns) as n:
        idx = n.link_lookup(ifname=iface)[0]
        parent_kw: dict = {"handle": "1:"}
        if imp.needs_netem:
            kw = {}
            if imp.delay_s:
                kw["delay"] = int(imp.delay_s * 1e6)  # pyroute2 takes microseconds
            if imp.jitter_s:
                kw["jitter"] = int(imp.jitter_s * 1e6)
            if imp.loss:
                kw["loss"] = imp.loss * 100  # percent
            # netem's own queue must hold a bandwidth-delay product, or it drops at high rate x delay.
            kw["limit"] = 100000
            n.tc("add", "netem", idx, handle="1:", **kw)
            parent_kw = {"handle": "10:", "parent": "1:1"}
        if imp.rate_bps:
            # TBF: burst large enough for one super-packet (TSO) plus a rate-proportional share.
            burst = max(64 * 1024 + mtu, imp.rate_bps // 8 // 250)
            n.tc("add", "tbf", idx, rate=imp.rate_bps // 8, burst=burst, latency="50ms", **parent_kw)


@functools.lru_cache(maxsize=1)
def netem_available() -> bool:
    """Probe for sch_netem in a throwaway namespace (never on the host's own interfaces)."""
    with nsutil.scratch_netns("probe") as path, nsutil.iproute(path) as n:
        try:
            n.tc("add", "netem", n.link_lookup(ifname="lo")[0], handle="1:", delay=1000)
            return True
        except NetlinkError:
            return False


def netem_missing_message(what: str) -> str:
    return (f"{what} needs tc's netem qdisc, and this kernel has none (sch_netem is not built: "
            f"`tc qdisc add ... netem` fails with 'Specified qdisc kind is unknown'). The testbed will not "
            f"silently ignore it. Remove delay/jitter/loss from the topology, or run on a kernel with "
            f"sch_netem (`modprobe sch_netem`; most Ubuntu/Debian distribution kernels have it; the Vagrantfile "
            f"brings up such a VM). Rate limits (tbf) and bit corruption work without netem.")


def tool_present(tool: str) -> bool:
    return shutil.which(tool) is not None
