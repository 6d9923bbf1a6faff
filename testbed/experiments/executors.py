"""Where the points of `testbed run` run (docs/cluster.md): `--executor local -j N` (N points at once on this
machine) and `--executor slurm` (a Slurm job per point through submitit, job arrays). `-j 1` on this machine is
the runner's own sequential, warm loop (testbed/experiments/runner.py); everything here is for points that run
as jobs of their own (testbed/experiments/jobs.py), each on its own topology and writing its own row file.

The controller (`run_jobs`):
- submits the pending points, BER-0 baselines first (a point's deviation needs its baseline's run directory):
  Slurm gets everything at once, the other points as a second array that waits for the baselines' array
  (`--dependency=afterany`); the local executor starts a point when its baseline has ended;
- records what it submitted in DIR/jobs.json, so that a later `testbed run` on DIR (after Ctrl-C with
  `--detach`, or a lost controller) collects those jobs instead of submitting them again;
- merges each job's row file into results.jsonl (atomically, ResultsStore) as the job ends, and shows queued,
  running, done and failed points;
- turns a job that ended without a row (killed by Slurm: time limit, node failure, scancel, out of memory; or a
  local job that died) into an `error` row whose reason says what the scheduler said;
- on Ctrl-C cancels every job it watches, unless `detach`.

Job states: Slurm's squeue (every state while slurmctld remembers the job, MinJobAge), then submitit's sacct
(when the cluster has accounting). A job that neither knows any more and that left no row is failed with a
reason that says so; it never becomes a silent gap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.fileio import write_json_atomic
from testbed.experiments.jobs import failed_row, row_path
from testbed.experiments.spec import Experiment, Point, ResourcesSpec

EXECUTORS = ("local", "slurm")
JOBS_FILE = "jobs.json"
# Slurm job states (squeue, sacct) and what the controller makes of them
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "CONFIGURING"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "STOPPED"}
WHY = {"TIMEOUT": "Slurm killed it at its time limit", "NODE_FAIL": "its node failed",
       "CANCELLED": "it was cancelled (scancel)", "OUT_OF_MEMORY": "it ran out of memory",
       "PREEMPTED": "it was preempted", "BOOT_FAIL": "its node failed to boot", "DEADLINE": "it missed its deadline",
       "FAILED": "it exited with an error", "COMPLETED": "it ended without writing its row"}
ROW_GRACE_S = 30.0  # an ended job's row may reach a shared file system's other clients a little later


@dataclass
class Job:
    point: str
    id: str           # Slurm's job id (123 or 123_4), or local-PID
    state: str = "queued"  # queued, running, ended (row expected), failed (no row: `reason`)
    reason: str | None = None
    node: str | None = None
    ended_at: float | None = None


def load_jobs(out: Path) -> dict:
    try:
        return json.loads((out / JOBS_FILE).read_text())
    except (OSError, ValueError):
        return {"executor": None, "jobs": {}}


def save_jobs(out: Path, executor: str, jobs: dict[str, Job]) -> None:
    write_json_atomic(out / JOBS_FILE, {"executor": executor, "jobs": {p: {"id": j.id} for p, j in jobs.items()}})


# -- local: N points at once on this machine -----------------------------------------------------------------------


class LocalExecutor:
    """Up to `jobs` points at once, each `python -m testbed.experiments.jobs` in a session of its own, with the
    machine's CPUs split between them (torch threads per worker: CPUs / jobs / ranks, at least 1)."""

    name = "local"
    dependencies = False  # a point starts once its baseline has ended (the controller waits for it)
    detachable = False

    def __init__(self, out: Path, jobs: int, runtime: str | None = None):
        self.out, self.slots, self.runtime = out, jobs, runtime
        self.procs: dict[str, subprocess.Popen] = {}
        self.queue: list[str] = []
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def submit(self, points: list[Point], after: list[str] | None = None) -> list[str]:
        self.queue += [p.id for p in points]
        return [f"local-{p.id}" for p in points]

    def _start(self) -> None:
        while self.queue and sum(p.poll() is None for p in self.procs.values()) < self.slots:
            pid = self.queue.pop(0)
            argv = [sys.executable, "-m", "testbed.experiments.jobs", str(self.out), pid,
                    "--cpus", str(max(1, (os.cpu_count() or 1) // self.slots))]
            if self.runtime:
                argv += ["--runtime", self.runtime]
            with open(self.out / "logs" / f"{pid}.log", "wb") as log:
                self.procs[pid] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                   start_new_session=True)

    def states(self, jobs: list[Job]) -> None:
        self._start()
        for j in jobs:
            point = j.id.removeprefix("local-")
            p = self.procs.get(point)
            if p is None:
                if point not in self.queue:  # a local job of an earlier controller: it died with it
                    j.state, j.reason = "failed", "its controller (an earlier `testbed run -j`) ended before it"
                continue
            rc = p.poll()
            if rc is None:
                j.state = "running"
            elif rc in (0, 1):
                j.state = "ended"
            else:
                tail = _tail(self.out / "logs" / f"{point}.log")
                j.state, j.reason = "failed", f"its process exited with status {rc}" + (f": {tail}" if tail else "")

    def cancel(self, jobs: list[Job]) -> None:
        self.queue.clear()
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)  # the job unwinds (its topology comes down) on SIGTERM
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# -- slurm: a job per point through submitit ---------------------------------------------------------------------


def slurm_parameters(resources: ResourcesSpec, name: str) -> dict:
    """submitit's SlurmExecutor parameters for one point's job (docs/cluster.md: the mapping)."""
    r = resources
    params: dict = {"job_name": f"testbed-{name}", "nodes": 1, "ntasks_per_node": 1, "use_srun": False,
                    "cpus_per_task": r.cpus or 1}
    if r.gpus:
        params["gpus_per_node"] = r.gpus
    if r.memory:
        params["mem"] = r.memory
    # submitit's default is 5 minutes; None: no --time, the partition's default limit
    params["time"] = r.time
    if r.partition:
        params["partition"] = r.partition
    if r.account:
        params["account"] = r.account
    if r.sbatch:
        params["additional_parameters"] = dict(r.sbatch)
    return params


class SlurmExecutor:
    """A Slurm job per point through submitit (`sbatch` of the login node this runs on); the job runs
    testbed.experiments.jobs.run_job with this Python (the venv, which must be on the shared file system)."""

    name = "slurm"
    dependencies = True
    detachable = True

    def __init__(self, out: Path, resources: ResourcesSpec, experiment: str, runtime: str | None = None):
        import submitit

        self.out, self.runtime, self.folder = out, runtime, out / "slurm"
        self.params = slurm_parameters(resources, experiment)
        self.submitit = submitit
        self.seen: dict[str, float] = {}

    def _executor(self, after: list[str] | None):
        ex = self.submitit.SlurmExecutor(folder=str(self.folder / "%j"))
        params = dict(self.params)
        if after:
            extra = dict(params.get("additional_parameters") or {})
            extra["dependency"] = "afterany:" + ":".join(sorted({a.split("_")[0] for a in after}))
            params["additional_parameters"] = extra
        ex.update_parameters(**params)
        return ex

    def submit(self, points: list[Point], after: list[str] | None = None) -> list[str]:
        from testbed.experiments.jobs import run_job

        if not points:
            return []
        ex = self._executor(after)
        n = len(points)
        jobs = ex.map_array(run_job, [str(self.out)] * n, [p.id for p in points], [self.runtime] * n, [None] * n)
        return [j.job_id for j in jobs]

    def states(self, jobs: list[Job]) -> None:
        live = [j for j in jobs if j.state in ("queued", "running")]
        if not live:
            return
        known = squeue_states([j.id for j in live])
        for j in live:
            st = known.get(j.id)
            if st is None:
                st = self._sacct(j.id)
            if st is None and row_path(self.out, j.point).exists():
                j.state = "ended"  # forgotten by Slurm, but it left its row
                continue
            if st is None:
                # never in squeue yet (just submitted) for a few seconds; else forgotten without accounting
                first = self.seen.setdefault(j.id, time.time())
                if time.time() - first > ROW_GRACE_S:
                    j.state = "failed"
                    j.reason = (f"Slurm job {j.id} is no longer known to squeue and left no row (no accounting to "
                                "ask how it ended)" + self._job_error(j.id))
                continue
            state, reason, node = st
            j.node = node or j.node
            word = state.split()[0].rstrip("+")
            if word in QUEUED:
                j.state = "queued"
            elif word in RUNNING:
                j.state = "running"
            elif word == "COMPLETED":
                j.state = "ended"
            else:
                j.state = "failed"
                why = WHY.get(word, f"it ended {word}")
                j.reason = (f"Slurm job {j.id} ended {word}{f' on {node}' if node else ''}: {why}"
                            + (f" ({reason})" if reason and reason not in ("None", "") else "") + self._job_error(j.id))

    def _sacct(self, job_id: str):
        """(state, reason, node) from submitit's sacct watcher, when the cluster keeps accounting."""
        try:
            info = self.submitit.SlurmJob(folder=str(self.folder / "%j"), job_id=job_id).get_info(mode="force")
        except Exception:  # noqa: BLE001 - sacct absent or accounting off: no answer
            return None
        return (info["State"], None, info.get("NodeList")) if info.get("State") else None

    def _job_error(self, job_id: str) -> str:
        """The last line of the job's error output (submitit's log), if any."""
        tail = _tail(self.folder / job_id.split("_")[0] / f"{job_id}_0_log.err", keep=("Error", "error", "Killed"))
        return f"; its log: {tail}" if tail else ""

    def cancel(self, jobs: list[Job]) -> None:
        ids = [j.id for j in jobs if j.state in ("queued", "running")]
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)


def squeue_states(ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """Job id -> (state, reason, node) for the jobs squeue still knows (every state, finished ones too while
    slurmctld keeps them: MinJobAge), array tasks by their own ids (123_4)."""
    r = subprocess.run(["squeue", "-h", "--states=all", "-r", "-o", "%i|%T|%r|%N",
                        "-j", ",".join(sorted({i.split("_")[0] for i in ids}))],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        if "Invalid job id" in r.stderr:
            return {}
        raise RuntimeError(f"squeue: {r.stderr.strip()}")
    out = {}
    for line in r.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            out[parts[0]] = (parts[1], parts[2], parts[3])
    return out


def _tail(path: Path, keep: tuple[str, ...] = ()) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    if keep:
        lines = [x for x in lines if any(k in x for k in keep)]
    return lines[-1][:300] if lines else ""


# -- the controller -----------------------------------------------------------------------------------------------


def run_experiment_jobs(exp: Experiment, out: str | Path, executor: str = "slurm", jobs: int = 2,
                        runtime: str | None = None, retry_failed: bool = False, resources: ResourcesSpec | None = None,
                        detach: bool = False, log=None, recipes: list[str] | None = None) -> list[dict]:
    """runner.run_experiment with each point a job of its own: `executor` slurm, or local with `jobs` at once;
    `resources` (slurm): the file's with the flags over it; `detach` (slurm): return once every point is
    submitted, leaving the jobs to a later run. The rows of this experiment's fingerprint, in the grid's order."""
    from tqdm import tqdm

    from testbed.experiments.runner import open_run, run_latency, train_config

    out, runtime, fps, store, points = open_run(exp, out, runtime, recipes)
    if executor == "slurm":
        res = resources or exp.spec.resources
        if res.gpus is None and any(train_config(exp, p).device == "cuda" for p in points):
            res = res.model_copy(update={"gpus": 1})  # device: cuda points ask for a GPU
        ex = SlurmExecutor(out, res, exp.spec.name, runtime)
    else:
        ex = LocalExecutor(out, jobs, runtime)
    try:
        have = sum(1 for p in points if store.done(p, fps[p.recipe]))
        bar = tqdm(total=len(points), initial=have, unit="point", dynamic_ncols=True, desc=exp.spec.name,
                   file=sys.stderr)
        say = log or (lambda m: bar.write(m, file=sys.stderr))
        for note in store.notes:
            say(note)
        if have:
            say(f"{have} of {len(points)} points already in {out / 'results.jsonl'}")
        try:
            try:
                run_jobs(exp, out, ex, points, store, fps, runtime, say, bar, retry_failed=retry_failed,
                         detach=detach)
            finally:  # rows in the grid's order, as a sequential run writes them (jobs end in any order)
                if sys.exc_info()[0] is None:
                    store.order([p.id for p in points])
                else:
                    try:
                        store.order([p.id for p in points])
                    except OSError:
                        pass  # e.g. the disk is full: the error on its way out says so; the file is as it was
            complete = all(store.done(p, fps[p.recipe]) for p in points)
            if exp.spec.latency is not None and complete:
                run_latency(exp, out, runtime, say)  # on this machine (root: a topology)
        finally:
            bar.close()
    finally:
        store.close()
    return list(store.rows.values())



def run_jobs(exp: Experiment, out: Path, executor, points: list[Point], store, fps: dict, runtime: str | None,
             say, bar, retry_failed: bool = False, detach: bool = False) -> None:
    """Run the points of `points` that have no row in `store` (and, `retry_failed`, those whose row is not ok)
    as jobs of `executor`, merging rows into `store` as they end; see the module docstring."""
    from testbed.experiments.runner import output_error, points_to_run

    by_id = {p.id: p for p in exp.points()}
    jobs: dict[str, Job] = {}
    previous = load_jobs(out)
    if previous.get("executor") == executor.name and executor.detachable:
        # jobs an earlier controller submitted: collected (a row they left is merged), never submitted again
        old = [Job(pid, j["id"]) for pid, j in previous["jobs"].items() if pid in by_id]
        executor.states(old)
        for j in old:
            if row_path(out, j.point).exists():
                _merge(out, j, store, say, bar, earlier=True)
            elif j.state in ("queued", "running", "ended"):  # ended: its row may not be visible yet
                jobs[j.point] = j
            elif j.state == "failed":
                _fail(exp, j, store, say, bar, by_id, fps, runtime, earlier=True)
        if old:
            say(f"{len(old)} jobs of an earlier run found in {out / JOBS_FILE}: {len(jobs)} still queued or running")
    for p in points:  # rows that jobs of an earlier run wrote and it did not merge (killed first): merged now
        if p.id not in jobs and not store.done(p, fps[p.recipe]) and row_path(out, p.id).exists():
            try:
                row = json.loads(row_path(out, p.id).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(row, dict) and row.get("point") == p.id and row.get("fingerprint") == fps[p.recipe]:
                store.add(row)
                say(f"{p.id}: {row['status']}: merged the row a job of an earlier run wrote ({row_path(out, p.id)})")
                bar.update(1)
    todo = [p for p in points_to_run(points, store, fps, out, retry_failed)[0] if p.id not in jobs]
    for p in todo:
        if row_path(out, p.id).exists():  # an earlier attempt's row (e.g. failed): the new job writes its own
            row_path(out, p.id).unlink()
    waiting = todo
    finished: set[str] = set()
    try:
        while True:
            waiting = _submit(executor, waiting, jobs, out)
            live = [j for j in jobs.values() if j.point not in finished]
            executor.states(live)
            for j in live:
                if row_path(out, j.point).exists() and j.state not in ("queued", "running"):
                    _merge(out, j, store, say, bar)
                    finished.add(j.point)
                elif j.state == "ended":
                    j.ended_at = j.ended_at or time.time()
                    if time.time() - j.ended_at > ROW_GRACE_S:
                        j.state, j.reason = "failed", f"job {j.id} ended without writing its row"
                if j.state == "failed" and j.point not in finished:
                    _fail(exp, j, store, say, bar, by_id, fps, runtime)
                    finished.add(j.point)
            counts = {s: sum(j.state == s for p, j in jobs.items() if p not in finished) for s in ("queued", "running")}
            done = sum(1 for p in finished if (store.rows.get(p) or {}).get("status") == "ok")
            bar.set_postfix_str(f"queued {counts['queued'] + len(waiting)}, running {counts['running']}, done {done}, "
                                f"failed {len(finished) - done}")
            if detach and executor.detachable and not waiting:
                left = [j for p, j in jobs.items() if p not in finished]
                say(f"detached: {len(left)} jobs left running; `testbed run` on {out} again collects them")
                return
            if not waiting and all(p in finished for p in jobs):
                break
            time.sleep(1.0 if executor.name == "local" else 3.0)
    except BaseException as e:
        left = [j for p, j in jobs.items() if p not in finished]
        if not isinstance(e, KeyboardInterrupt) and executor.detachable:
            # the controller failed (e.g. results.jsonl could not be written): Slurm's jobs go on, a later run
            # collects them
            say(f"{len(left)} jobs left queued or running; `testbed run` on {out} again collects them")
        elif isinstance(e, KeyboardInterrupt) and detach and executor.detachable:
            say(f"detached: {len(left)} jobs left running; `testbed run` on {out} again collects them")
        else:  # Ctrl-C, or a local job's controller failing: nobody would collect them
            say(f"{'interrupted' if isinstance(e, KeyboardInterrupt) else 'stopping'}: cancelling {len(left)} jobs")
            executor.cancel(left)
        raise
    finally:
        try:
            save_jobs(out, executor.name, {p: j for p, j in jobs.items() if p not in finished})
        except OSError as e:
            if sys.exc_info()[0] is None:
                raise output_error(out / JOBS_FILE, e, "the jobs it lists were collected or are still running; "
                                                       "free space, then run the same command again") from e


def _submit(executor, waiting: list[Point], jobs: dict[str, Job], out: Path) -> list[Point]:
    """Submit what may go now; the points that must wait."""
    if not waiting:
        return waiting
    baselines = [p for p in waiting if p.baseline == p]
    others = [p for p in waiting if p.baseline != p]
    ready, later = list(baselines), []
    now = {p.id for p in baselines}
    for p in others:
        b = jobs.get(p.baseline.id)
        if p.baseline.id not in now and (b is None or row_path(out, p.baseline.id).exists() or b.state == "failed"):
            ready.append(p)  # its baseline has ended (or is not run now)
        elif executor.dependencies:
            ready.append(p)
        else:
            later.append(p)
    if executor.dependencies and any(p.baseline != p for p in ready):
        first = [p for p in ready if p.baseline == p]
        ids = executor.submit(first)
        jobs.update({p.id: Job(p.id, i) for p, i in zip(first, ids)})
        rest = [p for p in ready if p.baseline != p]
        after = [jobs[p.baseline.id].id for p in rest if p.baseline.id in jobs
                 and jobs[p.baseline.id].state in ("queued", "running")]
        ids = executor.submit(rest, after=after or None)
        jobs.update({p.id: Job(p.id, i) for p, i in zip(rest, ids)})
    else:
        ids = executor.submit(ready)
        jobs.update({p.id: Job(p.id, i) for p, i in zip(ready, ids)})
    save_jobs(out, executor.name, jobs)
    return later


def _disk_full(job: Job, reason: str | None, store, say, earlier: bool) -> bool:
    """A job that ended because a file system was full: its point did not fail, its disk did, so it gets no row
    (it runs again). In this run's jobs that stops the run (OutputError: every next point would fail the same
    way); a job of an earlier run is only said (its point is submitted again). False: not a full disk."""
    from testbed.experiments.runner import OutputError, disk_full_reason

    if not disk_full_reason(reason):
        return False
    row_path(store.path.parent, job.point).unlink(missing_ok=True)
    if earlier:
        say(f"{job.point}: its job of an earlier run found its disk full ({reason}): it runs again")
        return True
    raise OutputError(f"{job.point}: its job could not write its run directory or row ({reason}); not recorded "
                      f"({store.path} is as it was): free space, then run the same command again", 28)


def _fail(exp, job: Job, store, say, bar, by_id, fps, runtime, earlier: bool = False) -> None:
    point = by_id[job.point]
    if _disk_full(job, job.reason, store, say, earlier):
        return
    store.add(failed_row(exp, point, fps[point.recipe], runtime, job.reason))
    say(f"{job.point}: error: {job.reason}")
    bar.update(1)


def _merge(out, job: Job, store, say, bar, earlier: bool = False) -> None:
    row = json.loads(row_path(out, job.point).read_text())
    if row.get("status") != "ok" and _disk_full(job, row.get("reason"), store, say, earlier):
        return
    store.add(row)
    where = f" [{job.node}]" if job.node else ""
    say(f"{job.point}{where}: {row['status']}: {row.get('reason') or _summary(row)}")
    bar.update(1)


def _summary(row: dict) -> str:
    loss = row.get("final_loss")
    return (f"{row.get('steps_completed')}/{row.get('steps')} steps, final loss "
            f"{'-' if loss is None else f'{loss:.4f}'}, bits flipped {row.get('bits_flipped') or 0:,}")
