"""Where hosts live. A runtime only creates, starts, execs in, lists and deletes hosts, and hands back each
host's network namespace (as a path). Links, engines and routes work on those paths and never ask which
runtime made a host (containerlab's runtime interface is the model).

Runtimes register themselves (`@register_runtime`) when their module is imported; testbed/runtime/__init__.py
imports the built-in ones, so importing anything of testbed.runtime makes them all known. Teardown and the
leftover sweeps walk `all_runtimes()` and never name one."""

from __future__ import annotations

import os
import subprocess
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

from testbed import register_kind


# A testbed host has no DNS server: its names come from the hosts file. Without this file a host inherits this
# machine's resolv.conf, whose server is unreachable from inside (and may even fall inside the management
# subnet, where every query waits for ARP to fail): torch's TCPStore does a reverse lookup per connection and
# the rendezvous took 6 s instead of 0.6 s. 127.0.0.1 answers "connection refused" at once.
RESOLV_CONF = "# testbed: no DNS inside a testbed host; names come from /etc/hosts\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class RuntimeUnavailable(RuntimeError):
    """The runtime cannot work on this machine; the message says what to do."""


@dataclass
class Host:
    topology: str
    node: str
    runtime: str
    netns: str  # path of the host's network namespace file
    uts: str | None = None  # netns runtime: bind-mounted UTS namespace (own hostname)
    container_id: str | None = None
    pid: int | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Host":
        return cls(**d)


class Runtime(ABC):
    name: str = ""
    # What this runtime's hosts are called in clean.leftovers() (a key of its result: "netns", "containers").
    leftover_key: str = "hosts"
    # The Python that runs the testbed's own programs (workers, probes) inside this runtime's hosts.
    python: str = "python3"

    def check(self) -> None:
        """Raise RuntimeUnavailable (with what to do) if this runtime cannot run here."""

    @abstractmethod
    def create(self, topology: str, node, state_dir) -> Host:
        """Create and start the host for `node` (a topo.Node); return it with its netns path."""

    @abstractmethod
    def exec_argv(self, host: Host, argv: list[str], env: dict | None = None) -> list[str]:
        """The command line that runs `argv` inside `host` (for Popen or execvp)."""

    def popen(self, host: Host, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(host, argv, env), **kw)

    def host_alive(self, host: Host) -> bool:
        """Whether the host still exists (its network namespace is there)."""
        return os.path.exists(host.netns)

    def why_gone(self, host: Host) -> str:
        """What `status` says of a host that is not alive."""
        return f"its network namespace {host.netns} is gone"

    def shared_dir(self):
        """A directory that the hosts see at the same path as this machine (None: the whole file system)."""
        return None

    def run_facts(self, host: Host) -> dict:
        """What a training summary records of the hosts this runtime made (the docker runtime: the image and
        its digest); {} by default."""
        return {}

    def set_hosts_file(self, host: Host, text: str) -> None:
        """Give the host an /etc/hosts naming every host of its topology, and an /etc/resolv.conf without a
        reachable DNS server (RESOLV_CONF), so that name lookups never wait (optional per runtime)."""

    @abstractmethod
    def list(self, topology: str | None = None) -> list[str]:
        """Identifiers of the hosts this runtime holds for `topology` (all testbed hosts if None), recorded in
        a state file or not. [] when the runtime's daemon is unreachable (then it holds nothing of ours)."""

    @abstractmethod
    def delete(self, host: Host) -> None:
        """Remove the host and everything it holds. Idempotent."""

    def delete_all(self, topology: str | None = None) -> list[str]:
        """Remove every host of `topology` (of all topologies if None) found by label/prefix, also those no
        state file records (a killed `up`); return what went. [] when the daemon is unreachable."""
        return []

    def sweep(self) -> list[str]:
        """`down --all`: remove whatever of the testbed this runtime holds, recorded in a state file or not;
        return what went. By default every testbed host (`delete_all()`); a runtime with more kinds of
        things (networks, volumes) removes those too."""
        return self.delete_all(None)


RUNTIMES: dict[str, type[Runtime]] = {}


def register_runtime(cls: type[Runtime]) -> type[Runtime]:
    """Class decorator: make a runtime known by its `name` (to `get_runtime`, teardown and the sweeps)."""
    return register_kind(RUNTIMES, cls, "runtime")


def get_runtime(name: str) -> Runtime:
    try:
        return RUNTIMES[name]()
    except KeyError:
        raise ValueError(f"unknown runtime {name!r} (known: {', '.join(sorted(RUNTIMES)) or 'none'})") from None


def runtime_names() -> list[str]:
    """The registered runtimes' names (what --runtime accepts), netns first."""
    return list(RUNTIMES)


def all_runtimes() -> list[Runtime]:
    """One instance of every registered runtime, in registration order (netns first)."""
    return [cls() for cls in RUNTIMES.values()]
