"""Where hosts live. A runtime only creates, starts, execs in, lists and deletes hosts, and hands back each
host's network namespace (as a path). Links, engines and routes work on those paths and never ask which
runtime made a host (containerlab's runtime interface is the model)."""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field


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
        import os
        return os.path.exists(host.netns)

    def shared_dir(self):
        """A directory that the hosts see at the same path as this machine (None: the whole file system)."""
        return None

    def set_hosts_file(self, host: Host, text: str) -> None:
        """Give the host an /etc/hosts naming every host of its topology (optional per runtime)."""

    @abstractmethod
    def list(self, topology: str | None = None) -> list[str]:
        """Identifiers of the hosts this runtime holds for `topology` (all testbed hosts if None)."""

    @abstractmethod
    def delete(self, host: Host) -> None:
        """Remove the host and everything it holds. Idempotent."""

    def delete_all(self, topology: str | None = None) -> list[str]:
        """Remove every host of `topology` (or of all topologies) found by label/prefix; return what went."""
        return []


def get_runtime(name: str) -> Runtime:
    if name == "netns":
        from .netns import NetnsRuntime
        return NetnsRuntime()
    if name == "docker":
        from .docker import DockerRuntime
        return DockerRuntime()
    raise ValueError(f"unknown runtime {name!r} (netns or docker)")
