"""One topology across several machines: the controller's side (`--machines FILE`).

The controller places the nodes (testbed/machines/placement.py), connects to every machine that holds one (one paramiko
connection each, testbed/machines/remote.py, kept for the whole command), and has each machine build its own part with
its own `testbed` (`testbed part-up SPEC`: the same Testbed code as a local `up`, restricted to its nodes, with
a VXLAN tunnel end for each link that leaves them). Each machine runs the engines of the directions that leave
its hosts, and keeps its own state, so it can be cleaned from there too (`testbed down NAME` on it).

The controller's state records every machine *before* it is contacted, so `testbed down NAME` or `down --all`
on the controller reaches them all after the controller was killed at any point.

`ClusterTestbed` is the testbed interface (testbed/base.py) for such a topology: callers get it from
testbed/testbeds.py and hold it as they hold a local Testbed.
"""

from __future__ import annotations

import json
import shlex
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from testbed.base import BaseTestbed, Workers, quiet
from testbed.machines.placement import VXLAN_PORT, MachineView, parts, place
from testbed.state import State, TopologyNotFound, claim, running_names, state_dir
from testbed.topology.topo import Topology


def cluster_of(name: str) -> dict | None:
    """The `cluster` record of topology `name` on this controller, or None (a local topology, or none)."""
    try:
        return State.load(name).data.get("cluster")
    except (TopologyNotFound, ValueError):
        return None


def _machines_of(record: dict):
    from testbed.machines.inventory import Machine

    return {m: Machine(**d) for m, d in record["machines"].items()}


def _parallel(fn: Callable, items: list) -> list:
    """fn(item) for every item in threads; results in order, exceptions returned in place."""
    out: list = [None] * len(items)

    def one(i, x):
        try:
            out[i] = fn(x)
        except BaseException as e:  # noqa: BLE001 (returned, the caller decides)
            out[i] = e

    threads = [threading.Thread(target=one, args=(i, x)) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _raise_first(results: list, what: str) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        if len(errors) > 1:
            raise RuntimeError(f"{what}: " + "; ".join(str(e) for e in errors)) from errors[0]
        raise errors[0]


MACHINE_INFO_TIMEOUT_S = 120.0


def machine_view(remote, machine, peers: list[str]) -> MachineView:
    """Ask `machine` how tunnels reach it (`testbed machine-info`)."""
    args = ["machine-info", "--json"]
    if machine.underlay_iface:
        args += ["--iface", machine.underlay_iface]
    for p in peers:
        args += ["--peer", p]
    # as long as the version check allows a testbed start: on an emulated (TCG) VM of a loaded host, measured
    # over 30 s
    info = json.loads(remote.testbed(args, timeout=MACHINE_INFO_TIMEOUT_S).stdout)
    return MachineView(name=machine.name, address=info.get("address") or machine.address, mtu=int(info["mtu"]))


def up(topo: Topology, inventory, runtime: str | None = None, vxlan_port: int = VXLAN_PORT,
       log: Callable[[str], None] = print) -> dict:
    """Bring `topo` up across the inventory's machines. Returns the controller's record (placement, machines,
    notes). On any failure every machine's part is removed again, and the error names the machine."""
    from testbed.machines.remote import connect_all

    where = place(topo, list(inventory.machines))
    used = [m for m in inventory.machines if m in set(where.values())]
    record = {"machines": {m: asdict(inventory.machines[m]) for m in used}, "placement": where,
              "inventory": inventory.path, "vxlan_port": vxlan_port, "notes": []}
    claim(topo.name)
    st = State.new(topo.name, file=topo.file, runtime=runtime or topo.runtime, topology=topo.raw, cluster=record)
    remotes: dict = {}
    started: list[str] = []  # machines asked to build their part
    try:
        remotes = connect_all(inventory, used)
        _raise_first(_parallel(lambda m: remotes[m].check(), used), "checking the machines")
        addrs = {m: inventory.machines[m].address for m in used}
        views = dict(zip(used, _parallel(
            lambda m: machine_view(remotes[m], inventory.machines[m], [a for o, a in addrs.items() if o != m]),
            used)))
        _raise_first(list(views.values()), "asking the machines for their underlay")
        specs, notes = parts(topo, where, views, vxlan_port)
        record["notes"] = notes
        st.update(cluster=record)

        def part_up(m):
            started.append(m)
            spec = {**specs[m], "topology": topo.raw, "file": topo.file, "runtime": runtime or topo.runtime}
            path = f"/tmp/testbed-part-{topo.name}-{m}.json"
            remotes[m].put_text(path, json.dumps(spec))
            remotes[m].testbed(["part-up", path], timeout=600)

        _raise_first(_parallel(part_up, used), f"bringing {topo.name} up")
        st.update(phase="up")
        return record
    except BaseException as e:
        # the parts begun so far go again; if one cannot be removed, the controller's record stays, so that
        # `testbed down NAME` can finish the job
        leftover = _down_parts(topo.name, record, remotes, log=lambda _m: None, only=started) if started else []
        if leftover:
            e.add_note(f"not removed: {'; '.join(leftover)}: run `testbed down {topo.name}`")
        else:
            shutil.rmtree(state_dir(topo.name), ignore_errors=True)
        raise
    finally:
        for r in remotes.values():
            r.close()


def _down_parts(name: str, record: dict, remotes: dict | None = None, log: Callable[[str], None] = print,
                only: list[str] | None = None) -> list[str]:
    """`testbed down NAME` on every machine of `record` (of `only`, if given), connecting where `remotes` lacks
    one; the errors."""
    from testbed.machines.remote import Remote

    machines = _machines_of(record)
    if only is not None:
        machines = {m: machines[m] for m in only}
    remotes = dict(remotes or {})
    opened = []

    def one(m):
        r = remotes.get(m)
        if r is None:
            r = Remote.connect(machines[m])
            opened.append(r)
        res = r.testbed(["down", name], check=False, timeout=300)
        # exit 2: nothing of it there (the part never came up): as good as removed
        if res.returncode not in (0, 2):
            raise RuntimeError(f"{m}: `testbed down {name}` failed: {(res.stderr or res.stdout).strip()[-500:]}")
        log(f"down: {name} on {m}")

    results = _parallel(one, list(machines))
    for r in opened:
        r.close()
    return [str(e) for e in results if isinstance(e, BaseException)]


def down(name: str, log: Callable[[str], None] = print) -> list[str]:
    """Remove a cross-machine topology from every machine it recorded, then the controller's state (kept if a
    machine could not be cleaned, so that `down` can be run again). Returns the errors."""
    record = cluster_of(name)
    if record is None:
        raise TopologyNotFound(f"no cross-machine topology named {name!r} is up here")
    errors = _down_parts(name, record, log=log)
    if not errors:
        shutil.rmtree(state_dir(name), ignore_errors=True)
    return errors


def down_all(inventory=None, log: Callable[[str], None] = print) -> list[str]:
    """Every cross-machine topology this controller recorded, and with an inventory `testbed down --all` on
    each of its machines too (what a killed controller may have left before recording it)."""
    from testbed.machines.remote import Remote

    errors = []
    for name in running_names():
        if cluster_of(name) is not None:
            errors += down(name, log=log)
    if inventory is not None:
        def one(m):
            with Remote.connect(inventory.machines[m]) as r:
                r.testbed(["down", "--all"], timeout=300)
            log(f"down --all on {m}")

        errors += [str(e) for e in _parallel(one, list(inventory.machines)) if isinstance(e, BaseException)]
    return errors


def machine_of(name: str, node: str) -> str:
    record = cluster_of(name)
    try:
        return record["placement"][node]
    except KeyError:
        raise KeyError(f"topology {name!r} has no node {node!r}") from None


def on_machine(name: str, machine: str, args: list[str], **kw):
    """Run `testbed ARGS` on one machine of topology `name`; its result."""
    from testbed.machines.remote import Remote

    with Remote.connect(_machines_of(cluster_of(name))[machine]) as r:
        return r.testbed(args, **kw)


def exec_in(name: str, node: str, argv: list[str], timeout: float | None = None):
    """Run argv inside host `node` of a cross-machine topology (on its machine); the remote Result."""
    return on_machine(name, machine_of(name, node), ["exec", "--topo", name, node, "--", *argv], check=False,
                      timeout=timeout)


def status(name: str) -> dict:
    """`testbed status` of every machine's part, merged: hosts and engines carry their machine."""
    record = cluster_of(name)
    machines = list(record["machines"])

    def one(m):
        r = on_machine(name, m, ["status", "--topo", name, "--json"], check=False, timeout=60)
        if r.returncode not in (0, 1):
            raise RuntimeError(f"{m}: {(r.stderr or r.stdout).strip()[-300:]}")
        return json.loads(r.stdout)[0]

    results = _parallel(one, machines)
    st = State.load(name).data
    out = {"name": name, "file": st.get("file"), "runtime": st.get("runtime"), "phase": st.get("phase"),
           "up_pid": None, "created_at": st.get("created_at"), "hosts": {}, "engines": [], "problems": [],
           "machines": {}, "placement": record["placement"]}
    for m, res in zip(machines, results):
        if isinstance(res, BaseException):
            out["problems"].append(f"machine {m}: {res}")
            out["machines"][m] = "unreachable"
            continue
        out["machines"][m] = res.get("phase")
        for h, v in res.get("hosts", {}).items():
            out["hosts"][h] = {**v, "machine": m}
        out["engines"] += [{**e, "machine": m} for e in res.get("engines", [])]
        out["problems"] += [f"{m}: {p}" for p in res.get("problems", [])]
        if res.get("phase") != "up":
            out["problems"].append(f"machine {m}: part is {res.get('phase')}")
    out["healthy"] = out["phase"] == "up" and not out["problems"]
    return out


def stats(name: str, tb: "ClusterTestbed | None" = None) -> list[dict]:
    """Every machine's engine counters (`testbed stats --json` there), each with its machine; over `tb`'s
    open connections if given."""
    record = cluster_of(name)
    machines = list(record["machines"])
    args = ["stats", "--topo", name, "--json"]
    results = _parallel(lambda m: tb._on(m, args, check=False, timeout=60) if tb is not None
                        else on_machine(name, m, args, check=False, timeout=60), machines)
    out = []
    for m, r in zip(machines, results):
        if isinstance(r, BaseException):
            raise r
        if r.stdout.strip().startswith("["):
            out += [{**s, "machine": m} for s in json.loads(r.stdout)]
    return out


def link_set(name: str, link_name: str, args: list[str]) -> str:
    """Forward `testbed link set LINK ARGS` to the machines that run the link's engines; their output."""
    topo = Topology.from_dict(State.load(name).data["topology"])
    l = topo.link(link_name)
    where = cluster_of(name)["placement"]
    machines = sorted({where[topo.engine_node(l, d)] for d, *_ in l.directions()})
    outs = []
    for m in machines:
        r = on_machine(name, m, ["link", "set", "--topo", name, link_name, *args], check=True, timeout=60)
        outs.append(r.stdout.strip())
    return "\n".join(o for o in outs if o)


def describe(name: str) -> str:
    record = cluster_of(name)
    rows = [f"  {node:<12} {m:<10} {record['machines'][m]['address']}" for node, m in record["placement"].items()]
    out = [f"placement of {name} ({len(record['machines'])} machines):", *rows]
    out += [f"note: {n}" for n in record.get("notes", [])]
    return "\n".join(out)


def quote(argv: list[str]) -> str:
    return shlex.join(argv)


# -- one machine's part (what `testbed part-up` and `part-link` run there, for the controller) ------------------


def part_up(spec_path: str) -> str:
    """Build this machine's part of a cross-machine topology from the controller's spec file."""
    from testbed.net import Testbed

    spec = json.loads(Path(spec_path).read_text())
    topo = Topology.from_dict(spec["topology"], file=spec.get("file"))
    part = {k: spec[k] for k in ("machine", "nodes", "tunnels", "mgmt", "placement")}
    Testbed(topo, runtime=spec.get("runtime"), part=part).up()
    return f"up: {topo.name} part {spec['machine']} ({', '.join(spec['nodes'])})"


def part_link(name: str, op: str, link_name: str, payload: dict) -> None:
    """An engine operation on this machine's part of a link (ClusterTestbed._part_link): set (settings, with
    `direction`), detach, attach, restore (saved settings per "link/direction")."""
    from testbed.net import Testbed

    tb = Testbed.attach(name)
    if op == "set":
        payload = dict(payload)
        tb.set_link(link_name, payload.pop("direction", None), **payload)
    elif op in ("detach", "attach"):
        (tb.engines.detach_link if op == "detach" else tb.engines.attach_link)(link_name)
    elif op == "restore":
        failed: list[str] = []
        tb.restore_links([link_name], payload, failed.append)
        if failed:
            raise RuntimeError("; ".join(failed))
    else:
        raise ValueError(f"part-link: unknown operation {op!r}")


# -- the testbed interface across machines ----------------------------------------------------------------------


class ClusterTestbed(BaseTestbed):
    """A topology across the machines of an inventory: `up` places it and has every machine build its part,
    `down` removes every part; the rest reaches the hosts and engines on their machines over one kept SSH
    connection per machine. Workers started on their hosts' machines have their run-directory files mirrored
    here as they are written. `log` gets the placement after `up` and warnings of a `down` left incomplete."""

    def __init__(self, topo: Topology, inventory=None, runtime: str | None = None, vxlan_port: int = VXLAN_PORT,
                 log: Callable[[str], None] = quiet):
        self.topo, self.inventory, self.vxlan_port, self.log = topo, inventory, vxlan_port, log
        self.runtime_name = runtime or topo.runtime
        self.runtime = _RemoteRuntime()
        self.record: dict | None = None
        self._remotes: dict = {}  # machine -> Remote, opened on first use, closed by close()
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, name: str) -> "ClusterTestbed":
        """The testbed of a cross-machine topology that is up (from the controller's state)."""
        record = cluster_of(name)
        if record is None:
            raise TopologyNotFound(f"no cross-machine topology named {name!r} is up here")
        data = State.load(name).data
        tb = cls(Topology.from_dict(data["topology"], file=data.get("file")), runtime=data.get("runtime"))
        tb.record = record
        return tb

    def up(self) -> "ClusterTestbed":
        if self.inventory is None:
            raise ValueError(f"topology {self.name}: bringing it up across machines needs an inventory")
        self.record = up(self.topo, self.inventory, runtime=self.runtime_name, vxlan_port=self.vxlan_port,
                         log=self.log)
        self.log(self.describe())
        return self

    def down(self) -> dict:
        self.close()
        errors = down(self.name, log=quiet) if cluster_of(self.name) is not None else []
        if errors:
            self.log(f"warning: could not remove {self.name} everywhere: {'; '.join(errors)} "
                     f"(run `testbed down {self.name}`)")
        self.record = None
        return {"errors": errors}

    def close(self) -> None:
        with self._lock:
            for r in self._remotes.values():
                r.close()
            self._remotes.clear()

    @property
    def is_up(self) -> bool:
        return cluster_of(self.name) is not None

    def status(self) -> dict:
        return status(self.name)

    def describe(self) -> str:
        return describe(self.name)

    def describe_ranks(self, hosts: list[str]) -> str:
        return (f"{self.name} across machines: {len(hosts)} ranks on "
                + ", ".join(f"{h}@{self.machine_of(h)}" for h in hosts))

    def remote(self, machine: str):
        """The connection to `machine`, kept open until close() (one per machine for the whole command)."""
        from testbed.machines.remote import Remote

        with self._lock:
            r = self._remotes.get(machine)
            if r is None or r.closed:
                r = self._remotes[machine] = Remote.connect(_machines_of(self.record)[machine])
            return r

    def _on(self, machine: str, args: list[str], **kw):
        return self.remote(machine).testbed(args, **kw)

    def machine_of(self, node: str) -> str:
        try:
            return self.record["placement"][node]
        except KeyError:
            raise KeyError(f"topology {self.name!r} has no node {node!r}") from None

    # -- running things in hosts, on their machines -----------------------------------------------------------

    def _host_argv(self, node: str, argv: list[str], env: dict | None) -> tuple:
        """The command line that runs argv in `node` on its machine (argv[0] == runtime.python: that
        machine's testbed Python)."""
        r = self.remote(self.machine_of(node))
        argv = list(argv)
        if argv and argv[0] == self.runtime.python:
            argv[0] = python_of(r.machine)
        kv = [f"{k}={v}" for k, v in (env or {}).items()]
        return r, [*r.machine.testbed_argv, "exec", "--topo", self.name, node, "--", *(["env", *kv] if kv else []),
                   *argv]

    def run(self, node: str, argv: list[str], env: dict | None = None, check: bool = False,
            timeout: float | None = None, input: str | None = None, text: bool = True):
        """Run to completion inside `node` on its machine; a CompletedProcess."""
        import subprocess

        r, cmd = self._host_argv(node, argv, env)
        res = r.run(cmd, check=False, timeout=timeout, input=input)
        out = subprocess.CompletedProcess(argv, res.returncode, res.stdout, res.stderr)
        if check:
            out.check_returncode()
        return out

    def popen(self, node: str, argv: list[str], env: dict | None = None, stdout=None, **_kw) -> "RemotePopen":
        """Start argv inside `node` on its machine; a process object as the benchmarks use one (poll, wait, kill,
        communicate; read_json_line for its output). `stdout` a file: the output is copied into it at the end."""
        r, cmd = self._host_argv(node, argv, env)
        return RemotePopen(r.start(cmd), getattr(stdout, "name", None))

    def exec_interactive(self, node: str, argv: list[str]) -> int:
        import sys

        r = self._on(self.machine_of(node), ["exec", "--topo", self.name, node, "--", *argv], check=False)
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        return r.returncode

    def read_json_line(self, proc, key: str, timeout: float = 30) -> dict:
        return proc.read_json_line(key, timeout)

    def read_file(self, node: str, path: str) -> str:
        """A file that a process in `node` wrote (on its machine)."""
        return self.remote(self.machine_of(node)).get_text(path)

    @contextmanager
    def host_dir(self, hosts: list[str], local_dir: Path) -> Iterator[Path]:
        import uuid

        path = f"/tmp/testbed-bench-{uuid.uuid4().hex[:12]}"
        machines = sorted({self.machine_of(n) for n in hosts})
        try:
            for m in machines:
                self.remote(m).makedirs(path)
            yield Path(path)
        finally:
            for m in machines:
                self.remote(m).run(["rm", "-rf", path], check=False, timeout=60)

    def workers(self, out: Path, hosts: list[str], passed: tuple[str, ...]) -> "RemoteWorkers":
        return RemoteWorkers(self, out, hosts, passed)

    # -- the links' engines, on the machines that run them ----------------------------------------------------

    def stats(self, links=None) -> list[dict]:
        wanted = None if links is None else {self.topo.link(n).name for n in links}
        return [s for s in stats(self.name, self) if wanted is None or s["link"] in wanted]

    def _engine_machines(self, link_name: str) -> list[str]:
        l = self.topo.link(link_name)
        return sorted({self.machine_of(self.topo.engine_node(l, d)) for d, *_ in l.directions()})

    def _part_link(self, op: str, link_name: str, payload=None) -> None:
        args = ["part-link", self.name, op, link_name] + ([json.dumps(payload)] if payload is not None else [])
        errors = [e for e in _parallel(lambda m: self._on(m, args, timeout=120), self._engine_machines(link_name))
                  if isinstance(e, BaseException)]
        if errors:
            raise RuntimeError(f"{op} on link {link_name}: " + "; ".join(str(e) for e in errors))

    def set_link(self, link_name: str, direction: str | None = None, **settings) -> list[str]:
        """As Testbed.set_link, on the machines that run the link's engines (each changes its own)."""
        l = self.topo.link(link_name)
        names = [d for d, *_ in l.directions()] if direction is None else [l.direction_name(direction)]
        self._part_link("set", l.name, {**settings, "direction": direction})
        return [f"{l.name}/{d}" for d in names]

    @contextmanager
    def detached(self, link_name: str):
        """As Testbed.detached: the link's engines see no traffic inside."""
        self._part_link("detach", link_name)
        try:
            yield self
        finally:
            self._part_link("attach", link_name)

    def restore_links(self, links: list[str], saved: dict[str, dict], report: Callable[[str], None]) -> None:
        for name in links:  # each machine restores its own
            try:
                self._part_link("restore", name, {k: v for k, v in saved.items() if k.split("/")[0] == name})
            except Exception as e:
                report(f"could not restore the engines of {name}: {e}")


class RemoteWorkers(Workers):
    """Training workers on other machines: `spawn` for launch.run_workers, and the mirror of their run
    directories into the controller's (the launcher watches those files). Use as a context manager."""

    MIRRORED = ("metrics-rank", "status-rank", "worker-rank", "final-rank", "monitor-ranks")  # rank 0: --monitor

    def __init__(self, tb: ClusterTestbed, run_dir, hosts: list[str], passed: tuple[str, ...]):
        import uuid
        from pathlib import Path

        from testbed.machines.remote import Remote

        self.tb, self.run_dir, self.hosts, self.passed = tb, Path(run_dir), hosts, passed
        self.facts = {"machines": {h: tb.machine_of(h) for h in hosts}}  # where every host ran
        self.remote_dir = f"/tmp/testbed-run-{uuid.uuid4().hex[:12]}"
        machines = _machines_of(tb.record)
        used = sorted({tb.machine_of(h) for h in hosts})
        self.remotes = {m: Remote.connect(machines[m]) for m in used}
        for r in self.remotes.values():
            r.makedirs(self.remote_dir)
        self._seen: dict[tuple[str, str], tuple] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._mirror_loop, daemon=True)

    def __enter__(self) -> "RemoteWorkers":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.mirror()  # the last state of every file
        for r in self.remotes.values():
            r.run(["rm", "-rf", self.remote_dir], check=False, timeout=60)
            r.close()

    def prepare_data(self, model: str, data: str | None) -> None:
        """Each machine prepares (or finds in its cache) the corpus and tokens, as the controller does."""
        args = ["python", "-m", "testbed.train.data", "--model", model] + (["--data", data] if data else [])

        def one(m):
            r = self.remotes[m]
            r.run([python_of(r.machine), *args[1:]], timeout=900)

        _raise_first(_parallel(one, list(self.remotes)), "preparing the training data")

    def spawn(self, rank: int, argv: list[str], env: dict):
        host = self.hosts[rank]
        r = self.remotes[self.tb.machine_of(host)]
        argv = list(argv)
        argv[argv.index("--out") + 1] = self.remote_dir
        kv = [f"{k}={env[k]}" for k in self.passed if k in env]
        cmd = [*r.machine.testbed_argv, "exec", "--topo", self.tb.name, host, "--", "env", *kv, python_of(r.machine),
               *argv[1:]]
        return _RemoteWorker(r.start(cmd, log_path=f"{self.remote_dir}/worker-rank{rank}.log"), self)

    def _mirror_loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.mirror()
            except Exception:  # a transient SFTP failure: the next pass (and the final one) catch up
                pass

    def mirror(self) -> None:
        """Copy every worker file that changed on a machine into the controller's run directory (atomically)."""
        import os
        import stat as stat_

        with self._lock:
            for m, r in self.remotes.items():
                for a in r.sftp().listdir_attr(self.remote_dir):
                    if not a.filename.startswith(self.MIRRORED) or stat_.S_ISDIR(a.st_mode or 0):
                        continue
                    key, sig = (m, a.filename), (a.st_size, a.st_mtime)
                    if self._seen.get(key) == sig:
                        continue
                    tmp = self.run_dir / f".{a.filename}.mirror"
                    r.get(f"{self.remote_dir}/{a.filename}", str(tmp))
                    os.replace(tmp, self.run_dir / a.filename)
                    self._seen[key] = sig


def python_of(machine) -> str:
    """The Python of the testbed installation there: beside its `testbed` command when that is a path (a
    virtual environment's bin/), else `python3` on its PATH."""
    cmd = machine.testbed_argv[0]
    return cmd.rsplit("/", 1)[0] + "/python" if "/" in cmd else "python3"


class _RemoteWorker:
    """A worker on another machine, as launch.run_workers sees a process: pid, poll(), wait(), kill()."""

    def __init__(self, proc, workers: RemoteWorkers):
        self.proc, self.workers = proc, workers
        self.pid = proc.pid
        self.returncode = None

    def poll(self):
        rc = self.proc.poll()
        if rc is not None and self.returncode is None:
            self.workers.mirror()  # its last lines are here before the launcher reads its exit
            self.returncode = rc
        return self.returncode

    def wait(self, timeout=None):
        self.proc.wait(timeout)
        return self.poll()

    def kill(self):
        self.proc.kill(9)


class _RemoteRuntime:
    """What benchmarks ask of a runtime: `python` (replaced by each machine's testbed Python when a command is
    started there) and `shared_dir()` (None: the machines share no directory with the controller)."""

    python = "python3"

    @staticmethod
    def shared_dir():
        return None


class RemotePopen:
    """A process started in a host on another machine (Remote.start), as the benchmarks use a Popen: poll(),
    wait(timeout), kill(), communicate(timeout), and read_json_line(key, timeout) reading its output (its log
    there). `copy_to`: a local file that gets the output when it has ended."""

    def __init__(self, proc, copy_to: str | None = None):
        self.proc, self.copy_to = proc, copy_to
        self.pid = proc.pid
        self.returncode = None
        self._copied = False

    def _output(self) -> str:
        try:
            return self.proc.remote.get_text(self.proc.log_path)
        except Exception:  # noqa: BLE001 (gone with its machine: no output to show)
            return ""

    def _finish(self, rc):
        if rc is not None and self.returncode is None:
            self.returncode = rc
            if self.copy_to and not self._copied:
                self._copied = True
                with open(self.copy_to, "w") as f:
                    f.write(self._output())
        return self.returncode

    def poll(self):
        return self.returncode if self.returncode is not None else self._finish(self.proc.poll())

    def wait(self, timeout=None):
        import subprocess

        from testbed.machines.remote import RemoteTimeoutError

        try:
            return self._finish(self.proc.wait(timeout))
        except RemoteTimeoutError:
            raise subprocess.TimeoutExpired(self.proc.command, timeout) from None

    def kill(self):
        self.proc.kill(9)
        self._finish(self.proc.poll())

    def communicate(self, input=None, timeout=None):
        self.wait(timeout)
        return self._output(), ""

    def read_json_line(self, key: str, timeout: float = 30) -> dict:
        """The first JSON line of its output with `key` (polled); RuntimeError if it ended without one."""
        deadline = time.monotonic() + timeout
        while True:
            from testbed.procs import json_with

            for line in self._output().splitlines():
                obj = json_with(line, key)
                if obj is not None:
                    return obj
            if self.poll() is not None:
                raise RuntimeError(f"pid {self.pid} on {self.proc.remote.machine.name} ended without a {key!r} "
                                   f"line; output:\n{self._output().strip()[-1500:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key!r} line from pid {self.pid} on {self.proc.remote.machine.name} "
                                   f"within {timeout:.0f} s")
            time.sleep(0.05)
