"""`testbed doctor`: what this machine offers the testbed, each item present or missing and what that means."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from pyroute2 import NetNS

from testbed import link, nsutil
from testbed.engine.registry import all_engines


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    essential: bool = True


def _probe_ns(fn) -> tuple[bool, str]:
    """Run `fn(netns_path)` in a throwaway namespace; never on the host's own interfaces."""
    try:
        with nsutil.scratch_netns("doctor") as path:
            return fn(path)
    except Exception as e:  # doctor reports; it never fails with a traceback
        return False, str(e) or type(e).__name__


def _veth(path: str) -> tuple[bool, str]:
    with NetNS(path) as n:
        n.link("add", ifname="dveth0", kind="veth", peer={"ifname": "dveth1"})
    return True, "veth pairs can be created"


def _bridge(path: str) -> tuple[bool, str]:
    with NetNS(path) as n:
        n.link("add", ifname="dbr0", kind="bridge")
    return True, "Linux bridges (switches) can be created"


def _tbf(path: str) -> tuple[bool, str]:
    with NetNS(path) as n:
        n.tc("add", "tbf", n.link_lookup(ifname="lo")[0], handle="1:", rate=125000, burst=10000, latency="50ms")
    return True, "rate limits (tbf) work"


def _docker() -> tuple[bool, str]:
    try:
        from testbed.runtime.docker import engine_status
        return engine_status()
    except ImportError:
        return False, "the docker runtime is not installed in this build"


def run_checks() -> list[Check]:
    checks = [Check("root", os.geteuid() == 0,
                    "running as root" if os.geteuid() == 0 else "not root: namespaces, veths and iptables need root")]
    if os.geteuid() != 0:
        return checks
    ok, d = _probe_ns(lambda p: (True, "network namespaces can be created"))
    checks.append(Check("netns", ok, d))
    checks.append(Check("veth", *_probe_ns(_veth)))
    checks.append(Check("bridge", *_probe_ns(_bridge)))
    checks.append(Check("tbf", *_probe_ns(_tbf), essential=False))
    try:
        netem = link.netem_available()
    except Exception:  # namespaces cannot be made: the netns check above already says so
        netem = False
    checks.append(Check("netem", netem, "delay, jitter and loss via tc netem work" if netem else
                        "sch_netem is missing from this kernel: topologies asking for delay/jitter/loss are refused "
                        "with a message; rate limits and bit corruption still work", essential=False))
    for engine in all_engines():  # each engine kind's own check (nfqueue, bpf)
        checks.append(Check(engine.name, *_probe_ns(engine.probe), essential=engine.essential))
    for tool, why in (("nsenter", "running commands in hosts"), ("unshare", "per-host hostnames"),
                      ("ethtool", "offload settings"), ("iperf3", "throughput benchmarks"),
                      ("tcpdump", "captures for inspection")):
        present = shutil.which(tool) is not None
        essential = tool in ("nsenter", "unshare")
        checks.append(Check(tool, present, f"{tool} present ({why})" if present else
                            f"{tool} missing: needed for {why} (apt-get install "
                            f"{'util-linux' if essential else tool})", essential=essential))
    ok, d = _docker()
    checks.append(Check("docker", ok, d, essential=False))
    return checks


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = "ok     " if c.ok else ("MISSING" if c.essential else "missing")
        lines.append(f"{c.name:<{width}}  {mark}  {c.detail}")
    bad = [c.name for c in checks if c.essential and not c.ok]
    lines.append("")
    lines.append("essentials missing: " + ", ".join(bad) if bad else "all essentials present")
    return "\n".join(lines)
