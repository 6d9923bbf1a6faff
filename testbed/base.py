"""The one testbed interface: what every caller (the CLI, training, benchmarks, locate) holds of a topology,
whether it runs on this machine (testbed/net.py `Testbed`) or across several (testbed/machines/cluster.py
`ClusterTestbed`). Callers get one from testbed/testbeds.py and never ask which kind it is (Mininet Cluster
Edition's way: a MininetCluster is a Mininet).

    with testbeds.create("topologies/pair.yaml") as tb:      # up on entry, down on exit
        tb.run("h1", ["ping", "-c1", tb.address("h2")])
        before = tb.counters()
        ...
        per_direction = tb.counters_since(before)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from testbed.topology.topo import Topology


class Workers(AbstractContextManager):
    """Training workers on a testbed's hosts, for testbed/train/launch.run_workers: `spawn(rank, argv, env)`
    starts rank's worker in its host; `run_dir` is where the workers' files appear on this machine while they
    run; `facts` are what the run's summary records of where it ran. Used as a context manager: on leaving,
    every worker file is in the run's `out` directory."""

    run_dir: Path
    facts: dict

    def prepare_data(self, model: str, data: str | None) -> None:
        """Have every machine that runs a worker find (or make) the training data (this machine's is ready)."""

    @abstractmethod
    def spawn(self, rank: int, argv: list[str], env: dict): ...


class BaseTestbed(ABC):
    """A topology and what can be done with it: bring it up and down, run programs in its hosts, read and change
    its links' engines. `with tb:` brings a testbed made from a topology up and down; one attached to a topology
    that is up (testbeds.attach) is released with `close()` and left as it was."""

    topo: Topology
    runtime_name: str

    @property
    def name(self) -> str:
        return self.topo.name

    def __enter__(self) -> "BaseTestbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- lifecycle ------------------------------------------------------------------------------------------

    @abstractmethod
    def up(self) -> "BaseTestbed": ...

    @abstractmethod
    def down(self) -> dict:
        """Remove everything; {"errors": [...], "stats_file": ...} (what could not be removed, where the final
        engine counters went)."""

    def close(self) -> None:
        """Release what this object holds (connections) without touching the topology."""

    @property
    @abstractmethod
    def is_up(self) -> bool: ...

    @abstractmethod
    def status(self) -> dict:
        """What `testbed status` reports: phase, hosts, engines (alive or not), healthy, problems."""

    @abstractmethod
    def describe(self) -> str:
        """A table of what the topology is made of (what `testbed up` prints)."""

    @abstractmethod
    def describe_ranks(self, hosts: list[str]) -> str:
        """Where processes on `hosts` run, for a log line: "pair (netns): 2 ranks on h1, h2"."""

    # -- running things in hosts ------------------------------------------------------------------------------

    @abstractmethod
    def run(self, node: str, argv: list[str], env: dict | None = None, check: bool = False,
            timeout: float | None = None, input: str | None = None, text: bool = True): ...

    @abstractmethod
    def popen(self, node: str, argv: list[str], env: dict | None = None, **kw):
        """Start argv in `node`: a process object with pid, poll(), wait(timeout), kill(), communicate()."""

    @abstractmethod
    def exec_interactive(self, node: str, argv: list[str]) -> int:
        """Run argv in `node` with this process's terminal (`testbed exec`); its exit code. May replace this
        process (a local host)."""

    @abstractmethod
    def read_json_line(self, proc, key: str, timeout: float = 30) -> dict:
        """The first JSON line with `key` that `proc` (from popen) prints."""

    @abstractmethod
    def read_file(self, node: str, path: str) -> str:
        """A file that a process in `node` wrote."""

    @abstractmethod
    def host_dir(self, hosts: list[str], local_dir: Path) -> AbstractContextManager[Path]:
        """A directory that processes in `hosts` write into and `read_file` reads: `local_dir` where the hosts
        see this machine's files, else one of the same name on each of their machines (removed on leaving)."""

    @abstractmethod
    def workers(self, out: Path, hosts: list[str], passed: tuple[str, ...]) -> Workers:
        """Training workers for `hosts` whose files end up in `out`; `passed`: the environment they get."""

    def address(self, node: str) -> str:
        return str(self.topo.plan.data_address(node))

    def mgmt_address(self, node: str) -> str:
        return str(self.topo.plan.mgmt[node].ip)

    # -- the links' engines ----------------------------------------------------------------------------------

    @abstractmethod
    def stats(self, links: Iterable[str] | None = None) -> list[dict]:
        """Each engine's counters and settings now (of `links` only, if given)."""

    def counters(self, links: Iterable[str] | None = None) -> dict[str, dict]:
        """A snapshot of every engine's stats, keyed "link/direction": take one before and one after some
        traffic and `counters_since` says what that traffic met."""
        return {f"{s['link']}/{s['direction']}": s for s in self.stats(links)}

    def counters_since(self, before: dict[str, dict], links: Iterable[str] | None = None,
                       fields: Iterable[str] | None = None) -> dict[str, dict]:
        """`counter_delta(before, self.counters(links), fields)`; with the machine that ran each engine, where
        the testbed spans machines."""
        from testbed.engine.counters import COUNTER_FIELDS, counter_delta

        after = self.counters(links)
        out = counter_delta(before, after, COUNTER_FIELDS if fields is None else fields)
        for key, d in out.items():
            if "machine" in after[key]:
                d["machine"] = after[key]["machine"]
        return out

    @abstractmethod
    def set_link(self, link_name: str, direction: str | None = None, **settings) -> list[str]:
        """Change corruption settings of a running link (one direction or both) without touching its traffic;
        the "link/direction" keys changed."""

    @abstractmethod
    def detached(self, link_name: str) -> AbstractContextManager["BaseTestbed"]:
        """Inside, the engines of one link see no traffic (the link passes it clean)."""

    @abstractmethod
    def restore_links(self, links: list[str], saved: dict[str, dict], report: Callable[[str], None]) -> None:
        """Put `saved` engine settings (of a `counters()` snapshot) back on `links` and stop the engines that
        are not in `saved`; `report` each that failed."""

    @contextmanager
    def links_restored(self, links: Iterable[str] | None = None,
                       warn: Callable[[str], None] | None = None) -> Iterator["BaseTestbed"]:
        """Change the engines of `links` (every link if None) freely inside; on leaving, each engine that was
        there gets its settings back and engines started inside are stopped, so the topology is as it was.
        An engine that cannot be put back is passed to `warn`, or without one raised as a RuntimeError after
        every other engine was restored (a note on the block's own exception, if it raised)."""
        from testbed.engine.counters import RESTORED_SETTINGS

        links = [l.name for l in self.topo.links] if links is None else [self.topo.link(n).name for n in links]
        saved = {k: {f: s.get(f) for f in RESTORED_SETTINGS} for k, s in self.counters(links).items()}
        try:
            yield self
        except BaseException as e:
            self.restore_links(links, saved, warn or e.add_note)
            raise
        failed: list[str] = []
        self.restore_links(links, saved, warn or failed.append)
        if failed:
            raise RuntimeError(f"topology {self.name}: " + "; ".join(failed))


def quiet(_msg: str) -> None:
    """A log that says nothing."""


Log = Callable[[str], Any]
