"""The default runtime: each host is a network namespace (pyroute2) plus a bind-mounted UTS namespace so
it has its own hostname. Needs no daemon."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from testbed import nsutil
from testbed.runtime.base import RESOLV_CONF, Host, Runtime, RuntimeUnavailable, register_runtime

ETC_NETNS = Path("/etc/netns")


@register_runtime
class NetnsRuntime(Runtime):
    name = "netns"
    leftover_key = "netns"
    python = sys.executable  # hosts share this machine's file system

    def check(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeUnavailable("the netns runtime needs root (run as root or with sudo)")
        for tool in ("nsenter", "unshare"):
            if shutil.which(tool) is None:
                raise RuntimeUnavailable(f"{tool} is missing: apt-get install util-linux")

    def create(self, topology: str, node, state_dir) -> Host:
        name = nsutil.ns_name(topology, node.name)
        path = nsutil.create_netns(name)
        uts_dir = Path(state_dir) / "uts"
        uts_dir.mkdir(parents=True, exist_ok=True)
        uts = uts_dir / node.name
        uts.touch()
        # A persistent UTS namespace, kept alive by its bind mount: hostname without a long-lived process.
        try:
            nsutil.create_uts(str(uts), node.name)
        except OSError as e:
            raise RuntimeError(f"cannot create the UTS namespace of {node.name}: {e}") from None
        return Host(topology=topology, node=node.name, runtime=self.name, netns=path, uts=str(uts))

    def exec_argv(self, host: Host, argv: list[str], env: dict | None = None) -> list[str]:
        cmd = []
        if host.uts and os.path.exists(host.uts):
            cmd = ["nsenter", f"--uts={host.uts}", "--"]
        # `ip netns exec` rather than a bare setns: it also gives the command a /sys of the host's own
        # namespace (so /sys/class/net lists the host's interfaces), as users expect.
        cmd += ["ip", "netns", "exec", os.path.basename(host.netns)]
        if env:
            cmd += ["env", *(f"{k}={v}" for k, v in env.items())]
        return cmd + list(argv)

    def set_hosts_file(self, host: Host, text: str) -> None:
        # `ip netns exec` bind-mounts /etc/netns/NAME/{hosts,resolv.conf} over /etc/ for commands run in the host.
        d = ETC_NETNS / os.path.basename(host.netns)
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text(text)
        (d / "resolv.conf").write_text(RESOLV_CONF)

    def list(self, topology: str | None = None) -> list[str]:
        return nsutil.list_testbed_netns(topology)

    def delete(self, host: Host) -> None:
        nsutil.remove_netns(os.path.basename(host.netns))  # also its /etc/netns files
        if host.uts:
            _release_uts(host.uts)

    def delete_all(self, topology: str | None = None) -> list[str]:
        gone = []
        for name in nsutil.list_testbed_netns(topology):
            nsutil.remove_netns(name)
            gone.append(name)
        return gone


def _release_uts(path: str) -> None:
    if os.path.exists(path):
        nsutil.unmount(path)
        try:
            os.unlink(path)
        except OSError:
            pass
