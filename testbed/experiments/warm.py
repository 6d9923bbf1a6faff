"""Warm points (`testbed run` without --cold): the points of a sweep that share a topology, runtime, mode and
hosts run on one topology that stays up, by one worker service per host (testbed/train/serve.py) that stays
alive between points. Between points only the links change, live (BaseTestbed.set_link): every engine gets
the point's settings in full, so nothing of the earlier point's remains. Each point builds its own model,
optimizer, data order and process groups from its seed, on a fresh rendezvous port.

A service that died, was killed by the launcher (crashed, hung) or ended its point in any state but ok or
diverged is replaced by a fresh process at the next point; a point that found an engine dead gets a fresh
topology after it. Process-injector points run on local services the same way.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from testbed import testbeds
from testbed.base import quiet
from testbed.fileio import write_json_atomic
from testbed.train.launch import WORKER_MODULE, local_spawn
from testbed.train.common import answer_path, request_path
from testbed.experiments.training import PASSED_ENV, train_on, worker_hosts

SERVE_MODULE = "testbed.train.serve"


class ServedPoint:
    """One rank's point on a service, as run_workers sees a worker: pid, poll(), wait(timeout), kill()."""

    def __init__(self, proc, answer: Path):
        self.proc, self.answer, self.pid, self.returncode = proc, answer, proc.pid, None

    def poll(self):
        if self.returncode is None:
            rc = self.proc.poll()  # first: a service that answered and then exited has its answer there
            if self.answer.exists():
                self.returncode = json.loads(self.answer.read_text())["code"]
            elif rc is not None:
                self.returncode = rc
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(SERVE_MODULE, timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        self.proc.kill()  # the whole service: the next point gets a fresh one


class WorkerPool:
    """A service per rank, started by `start(rank, argv, env)` (a testbed's Workers.spawn, or
    launch.local_spawn) and replaced when it is gone; `spawn` is run_workers' spawn."""

    def __init__(self, start, inbox: Path):
        self.start, self.inbox = start, Path(inbox)
        self.inbox.mkdir(parents=True, exist_ok=True)
        if any(self.inbox.iterdir()):  # an earlier run's answers would pass for this run's (WarmSweep's dir)
            raise RuntimeError(f"{self.inbox}: the inbox of worker services must start empty")
        self.services: dict[int, list] = {}  # rank -> [process, id, next request number]
        self.ids = itertools.count()

    def reusable(self, svc) -> bool:
        """Whether a service will take another point: it answered its last request and said it stays. One that
        was killed may not have died yet, and one that answered "exits" may not have exited yet: a request
        written to either would never be served (the next point then hung on its peers' rendezvous)."""
        proc, sid, k = svc
        if proc.poll() is not None:
            return False
        if k == 0:
            return True
        try:
            return not json.loads(answer_path(self.inbox, sid, k - 1).read_text()).get("exits", True)
        except (OSError, ValueError):
            return False

    def spawn(self, rank: int, argv: list[str], env: dict) -> ServedPoint:
        svc = self.services.get(rank)
        if svc is not None and not self.reusable(svc):
            try:  # on its way out: let it go (it answers before it exits), then replace it
                svc[0].wait(timeout=10)
            except subprocess.TimeoutExpired:
                svc[0].kill()
                svc[0].wait()
            svc = None
        if svc is None:
            sid = str(next(self.ids))
            svc = self.services[rank] = [self.start(rank, [argv[0], "-m", SERVE_MODULE, "--inbox", str(self.inbox),
                                                           "--id", sid], env), sid, 0]
        proc, sid, k = svc
        svc[2] += 1
        write_json_atomic(request_path(self.inbox, sid, k), {
            "argv": argv[argv.index(WORKER_MODULE) + 1:], "env": {v: env[v] for v in PASSED_ENV if v in env}})
        return ServedPoint(proc, answer_path(self.inbox, sid, k))

    def close(self, wait_s: float = 5.0) -> None:
        for proc, sid, k in self.services.values():
            if proc.poll() is None:
                try:
                    write_json_atomic(request_path(self.inbox, sid, k), {"stop": True})
                except OSError:  # e.g. the disk is full: no request can reach it, so it goes the hard way
                    proc.kill()
        deadline = time.monotonic() + wait_s
        for proc, _, _ in self.services.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.services.clear()
        shutil.rmtree(self.inbox, ignore_errors=True)


def set_links(tb, topo) -> None:
    """Every engine of `tb` gets the settings `topo` (the point's topology, as a cold point would bring it up)
    gives its direction, each of them, so that nothing of an earlier point's remains; a direction `topo` leaves
    without corruption gets BER 0 where an engine runs."""
    running = tb.counters()
    for link in topo.links:
        for d, _, _, imp in link.directions():
            if imp.ber is None and f"{link.name}/{d}" not in running:
                continue
            tb.set_link(link.name, d, ber=imp.ber or 0.0, error_model=imp.error_model, scope=imp.scope,
                        checksum=imp.checksum, seed=imp.seed, collectives=list(imp.collectives or []),
                        element=imp.element, protect=list(imp.protect or []), protected_ber=imp.protected_ber,
                        restart=True)  # the flips a fresh engine gives: the point is its cold twin


class WarmSweep:
    """What stays up between a sweep's points: one group at a time, the topology and services of wire points
    or the local services of process-injector points. `close()` takes it all down."""

    def __init__(self, out: Path):
        # one directory per run: a run that was killed leaves its inboxes with their answers (N-K.done), and a
        # resumed run in the same place would take them for its own points' (they "ended" before they ran)
        self.dir = Path(out) / "warm" / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self.key, self.tb, self.workers, self.pool = None, None, None, None
        self.groups, self.points = itertools.count(), itertools.count()

    def _switch(self, key) -> bool:
        if key == self.key:
            return False
        self.close()
        self.key = key
        return True

    def train(self, topo, cfg, out, runtime=None, log=quiet) -> dict:
        """A wire point on the group's topology (brought up for the first point of a group)."""
        hosts = worker_hosts(topo, cfg)
        try:
            # what cannot change live (a link's rate, delay, jitter, loss: tc set when the topology comes up)
            shaping = tuple((link.name, d, imp.rate_bps, imp.delay_s, imp.jitter_s, imp.loss)
                            for link in topo.links for d, _, _, imp in link.directions())
            if self._switch(("wire", topo.file or topo.name, runtime, cfg.mode, tuple(hosts), shaping)):
                d = self.dir / f"{next(self.groups)}-{topo.name}"
                d.mkdir(parents=True, exist_ok=True)  # the services' logs end here (from a container's shared dir)
                self.tb = testbeds.create(topo, None, runtime=runtime, results_dir=d, log=log).up()
                self.workers = self.tb.workers(d, hosts, PASSED_ENV)
                self.pool = WorkerPool(self.workers.spawn, self.workers.run_dir / "inbox")
            set_links(self.tb, topo)
            port = self.tb.topo.control_ports[0] + 1 + next(self.points) % 1000  # a fresh rendezvous per point
            summary = train_on(self.tb, cfg, out, log=log, pool=self.pool, port=port)
        except BaseException:
            self.close()
            raise
        if not all(e["alive"] for e in summary["engines"]):
            self.close()  # a dead engine stays dead: the next point gets a fresh topology
        return summary

    def local(self, world_size: int) -> WorkerPool:
        """The local services of process-injector points (loopback)."""
        if self._switch(("process", world_size)):
            d = self.dir / f"{next(self.groups)}-local"
            self.pool = WorkerPool(local_spawn(d), d / "inbox")
        return self.pool

    def close(self) -> None:
        pool, workers, tb = self.pool, self.workers, self.tb
        self.key = self.pool = self.workers = self.tb = None
        try:
            if pool is not None:
                pool.close()
            if workers is not None:
                workers.__exit__(None, None, None)
        finally:
            if tb is not None:
                tb.down()
