"""`testbed run EXPERIMENT.yaml --out DIR`: run an experiment's grid point by point (warm: the points of one
topology, runtime and mode on one topology and worker services that stay up; --cold: each on a freshly
brought up topology with fresh workers), and keep results safe across interruptions.

- results.jsonl is rewritten atomically after every point (temp file + rename): an interrupted run loses only
  the point in progress, and a re-run skips every point already there (same experiment fingerprint).
- One run per DIR (RunLock). A run starts by taking down what a run of DIR killed outright left running on this
  machine (sweep_earlier_runs); a damaged results.jsonl is reported line by line and its bad lines kept in
  results-damaged.txt (ResultsStore); a full disk stops the run with OutputError, recording no row for the
  point it broke (docs/experiments.md, "Faults").
- BER-0 baselines run first: every other point is compared with its baseline (weight deviation).
- A progress bar shows points done and the ETA; each point's outcome is printed as it finishes.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path

from testbed.fileio import DISK_FULL, read_jsonl, read_jsonl_objects, write_atomic, write_json_atomic
from testbed.train.model import seq_len_of
from testbed.train.settings import TrainSettings, default_of
from testbed.analysis.results import error_row, new_row
from testbed.experiments.spec import Experiment, Point
from testbed.experiments.training import DEFAULT_COLLECTIVES, summary_line, train
from testbed.experiments.warm import WarmSweep


RESULTS_FILE = "results.jsonl"
DAMAGED_FILE = "results-damaged.txt"  # lines of results.jsonl that were no row, kept as they were
LOCK_FILE = ".run.lock"  # held (flock) by the one `testbed run` that writes into DIR


class OutputError(OSError):
    """The run directory cannot take what the run must write (its file system full, over quota, read-only): the
    sweep stops with results.jsonl as it was on disk, every complete row in it, and says what to do."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_

    def __str__(self) -> str:
        return self.args[0]


class RunDirectoryBusy(RuntimeError):
    """Another `testbed run` is writing into the same directory."""


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def output_error(path: Path, e: OSError, what: str, needed: int | None = None) -> OutputError:
    """An OutputError for a failed write of `path` (`what`: what was lost, what stays, what to do; `needed`: the
    bytes the write needed)."""
    free = _free_bytes(path.parent if not path.is_dir() else path)
    why = e.strerror or str(e)
    if e.errno in DISK_FULL and free is not None:
        why += f" ({free:,} bytes free on its file system{f', {needed:,} needed' if needed else ''})"
    return OutputError(f"cannot write {path}: [Errno {e.errno}] {why}; {what}", e.errno)


def disk_full_reason(text: str | None) -> bool:
    """Whether a failure's reason says that a file system was full (a worker's write of its metrics or
    parameters, a summary): the point did not fail, its disk did."""
    return bool(text) and any(k in text for k in ("No space left on device", "Disk quota exceeded", "[Errno 28]",
                                                  "[Errno 122]"))


class ResultsStore:
    """results.jsonl: one row per finished point of the current experiment, always complete on disk.

    Rows of another fingerprint (the model, steps, training settings, a recipe, topologies or runtime changed)
    are not this experiment's results: they move to results-<fingerprint>.jsonl instead of mixing into the
    report. `fingerprints`: those of the experiment's recipes (one string: a single one). `aliases`: {another
    experiment's fingerprint: this one's} for rows this experiment reuses (its `reuse:`): kept, and done() counts
    them as rows of the recipe they alias.

    A line that is no row (cut off, not JSON, JSON but not an object, an object without a point id: the file was
    damaged outside the testbed, which only ever replaces it whole) is never dropped silently: it moves to
    results-damaged.txt as it was, under a line that says where it came from, and `notes` says what was found
    (file, line, problem, the point a cut-off row still names); a point left without a row runs again.
    A failed write (disk full) raises OutputError; the file on disk keeps its earlier complete version."""

    def __init__(self, out: Path, fingerprints: str | set[str], aliases: dict[str, str] | None = None):
        self.aliases = dict(aliases or {})
        fingerprints = ({fingerprints} if isinstance(fingerprints, str) else set(fingerprints)) | set(self.aliases)
        self.path = out / RESULTS_FILE
        self.rows: dict[str, dict] = {}
        self.notes: list[str] = []  # what was found and done on opening, for the run to print
        self.lock: RunLock | None = None  # DIR's, when open_run opened the store (released by close())
        stale: dict[str, list[dict]] = {}
        rows, bad = read_jsonl_objects(self.path, check=lambda r: None if isinstance(r.get("point"), str)
                                       and r["point"] else "a JSON object without a point id")
        if bad:
            self._keep_aside(out / DAMAGED_FILE, bad)
        for row in rows:
            if row.get("fingerprint") in fingerprints:
                self.rows[row["point"]] = row
            else:
                stale.setdefault(row.get("fingerprint") or "unknown", []).append(row)
        for fp, rows in stale.items():
            old = out / f"results-{fp}.jsonl"
            keep = read_jsonl(old) + rows
            try:
                write_atomic(old, "".join(json.dumps(r, default=str) + "\n" for r in keep))
            except OSError as e:
                raise output_error(old, e, f"{self.path} is as it was; free space, then run the same command "
                                           "again") from e
            self.notes.append(f"{len(rows)} rows of another fingerprint (the experiment changed) moved from "
                              f"{self.path} to {old}")
        if stale or bad:
            self._save()

    def _keep_aside(self, side: Path, bad: list) -> None:
        """The bad lines into `side` (appended to what it holds), each under a '#' line naming its origin."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        text = "".join(f"# {self.path} line {b.line}, found {stamp}: {b.problem}"
                       f"{f' (a row of point {b.point})' if b.point else ''}\n{b.text}\n" for b in bad)
        try:
            before = side.read_text(errors="replace")
        except FileNotFoundError:
            before = ""
        try:
            write_atomic(side, before + text)
        except OSError as e:
            raise output_error(side, e, f"{self.path} is as it was (its damaged lines too); free space, then run "
                                        "the same command again") from e
        for b in bad:
            self.notes.append(f"{self.path} line {b.line}: {b.problem}"
                              + (f"; it was a row of point {b.point}" if b.point else "")
                              + f": moved to {side}")
        lost = sorted({b.point for b in bad if b.point})
        self.notes.append(f"{len(bad)} damaged line{'s' if len(bad) > 1 else ''} of {self.path} kept as "
                          f"{'they were' if len(bad) > 1 else 'it was'} in {side}"
                          + (f"; without a complete row, point{'s' if len(lost) > 1 else ''} {', '.join(lost)} "
                             f"run{'' if len(lost) > 1 else 's'} again" if lost else ""))

    def close(self) -> None:
        """Release the directory's lock (open_run took it): the run that held it has ended."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def done(self, point: Point, fingerprint: str | None = None) -> dict | None:
        """The point's row, if it is there (and has `fingerprint`, when given: that of the point's recipe)."""
        row = self.rows.get(point.id)
        if row is None or fingerprint is None:
            return row
        return row if self.aliases.get(row.get("fingerprint"), row.get("fingerprint")) == fingerprint else None

    def add(self, row: dict) -> None:
        before = self.rows.get(row["point"], _MISSING)
        self.rows[row["point"]] = row
        try:
            self._save()
        except OutputError:
            if before is _MISSING:  # not saved: not a row of this run either (the point runs again)
                del self.rows[row["point"]]
            else:
                self.rows[row["point"]] = before
            raise

    def order(self, ids: list[str]) -> None:
        """Put the rows in the order of `ids` (others after them) and save."""
        rank = {p: i for i, p in enumerate(ids)}
        self.rows = dict(sorted(self.rows.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        self._save()

    def _save(self) -> None:
        data = "".join(json.dumps(r, allow_nan=False, default=str) + "\n" for r in self.rows.values()).encode()
        try:
            write_atomic(self.path, data)
        except OSError as e:
            on_disk = len(read_jsonl(self.path))
            rows = f"{on_disk} complete row{'' if on_disk == 1 else 's'}"
            raise output_error(self.path, e, f"the file on disk is as it was before this write ({rows}); a point "
                                             "without a row there runs again: free space, then run the same command "
                                             "again", needed=len(data)) from e


_MISSING = object()


class RunLock:
    """DIR/.run.lock, flock'ed by the one `testbed run` that writes into DIR (two would each rewrite
    results.jsonl from the rows they know and lose the other's). The kernel drops the lock when its holder dies,
    SIGKILL included, so a killed run never blocks the next; the file names the holder for the message."""

    def __init__(self, out: Path):
        import fcntl

        self.path = out / LOCK_FILE
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise output_error(self.path, e, "nothing was run") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = json.loads(os.read(fd, 4096) or b"{}")
                except ValueError:
                    holder = {}
                os.close(fd)
                who = (f" (pid {holder.get('pid')} on {holder.get('host')}, since "
                       f"{time.strftime('%H:%M:%S', time.localtime(holder['since']))})" if holder.get("since") else "")
                raise RunDirectoryBusy(f"{out} is in use by another `testbed run`{who}: two runs in one directory "
                                       "would overwrite each other's rows; wait for it to end or stop it, then run "
                                       "this command again") from None
            except OSError:  # a file system without locks (some network ones): run unlocked, as before locks
                os.close(fd)
                self.fd = None
                return
            try:  # the file we locked must still be the one at the path (a holder that ended removes it)
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(), "since": time.time()}).encode())
        except OSError:
            pass  # a full disk: the lock holds all the same, the message will name no holder

    def release(self) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None


def _orphan(pid: int) -> bool:
    """Whether `pid`'s parent is gone: it was handed to init (or a subreaper), which runs no testbed and no
    Slurm job (a Slurm job's workers have the job as parent)."""
    from testbed import procs

    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    if ppid <= 1:
        return True
    args = " ".join(procs.cmdline(ppid) or [])
    return "testbed" not in args and "submitit" not in args


def _under(arg: str, out: Path) -> bool:
    return arg == str(out) or arg.startswith(f"{out}/")


def _wait_gone(pids, timeout: float) -> None:
    from testbed import procs

    deadline = time.monotonic() + timeout
    while any(procs.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def sweep_earlier_runs(out: Path, grace_s: float = 30.0) -> list[str]:
    """What a `testbed run` of DIR that was killed outright (SIGKILL, the OOM killer) left on this machine, taken
    down before this run starts (the caller holds DIR's RunLock, so no other run of DIR is alive): its `-j`
    jobs (`python -m testbed.experiments.jobs DIR ...`, each in a session of its own: SIGTERM, so that a job
    takes its topology down, SIGKILL after `grace_s`), the worker services and workers it started on this
    machine (their parent gone; --inbox or --out under DIR), and every topology whose state names a results
    directory under DIR and whose `up` process is gone (namespaces, veths, iptables rules and qdiscs inside
    them, engines, state). Slurm jobs are left alone (a later run collects them) and so are processes with a
    live parent. What was taken down, one line each."""
    from testbed import procs, testbeds
    from testbed.state import State, running_names

    done: list[str] = []

    def ours(args: list[str], modules: tuple[str, ...]) -> bool:
        return any(a == "-m" and i + 1 < len(args) and args[i + 1] in modules for i, a in enumerate(args)) \
            and any(_under(a, out) for a in args)

    jobs = {p: procs.cmdline(p) or [] for p in procs.pids_with_cmdline(lambda a: ours(a, ("testbed.experiments.jobs",)))
            if _orphan(p)}
    for pid in jobs:
        procs.kill_group(pid, signal.SIGTERM)  # a job leads its own session (LocalExecutor)
        procs.kill_group(pid, signal.SIGCONT)  # a stopped one too (it acts on the SIGTERM once it runs)
    _wait_gone(jobs, grace_s)
    for pid, args in jobs.items():
        if procs.alive(pid):
            procs.kill_group(pid, signal.SIGKILL)
        point = args[args.index(str(out)) + 1] if str(out) in args[:-1] else "?"
        done.append(f"-j job pid {pid} (point {point})")
    _wait_gone(jobs, 10)  # its topology is swept below once its `up` process is gone
    workers = [p for p in procs.pids_with_cmdline(lambda a: ours(a, ("testbed.train.serve", "testbed.train.worker")))
               if _orphan(p)]
    for pid in workers:
        procs.kill(pid, signal.SIGKILL)
        done.append(f"worker pid {pid}")
    _wait_gone(workers, 10)
    for name in running_names():
        try:
            data = State.load(name).data
        except LookupError:
            continue
        where = data.get("results_dir")
        if where and _under(str(where), out) and not procs.alive(data.get("up_pid")):
            result = testbeds.down(name)
            done.append(f"topology {name} (its `up` pid {data.get('up_pid')} is gone)"
                        + (f": {'; '.join(result['errors'])}" if result.get("errors") else ""))
    return done


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def train_config(exp: Experiment, point: Point) -> TrainSettings:
    """The point's settings (Experiment.train_settings): the experiment's `train:` with the recipe's over it,
    the batch size from tokens_per_step, model and steps at the top, mode and seed from the grid."""
    return exp.train_settings(point)


def point_row(exp: Experiment, point: Point, summary: dict, run_dir: Path, baseline_dir: Path | None,
              started: float | None = None) -> dict:
    """Everything the report needs about one point, from its summary and metrics (the report never reads
    run directories, so results.jsonl alone rebuilds it). `started`: when the point began (its phase times)."""
    from testbed.train.fingerprint import replica_divergence, run_distance
    from testbed.analysis.theory import param_count

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    by_step: dict[int, list[dict]] = {}
    for m in metrics:
        by_step.setdefault(m["step"], []).append(m)
    steps = sorted(by_step)
    link = exp.link_settings(point)
    rank0 = {s: next((m for m in by_step[s] if m["rank"] == 0), by_step[s][0]) for s in steps}
    # every field of the results schema (testbed/analysis/results.py), in its order; run_point adds the
    # fingerprint, the deviation and divergence fields are filled in below
    row = new_row(
        point=point.id, baseline=point.baseline.id, experiment=exp.spec.name, tolerance=exp.spec.tolerance,
        fingerprint=None,
        **point.params(), ber_at_lambda=point.lam, model=exp.model_of(point.recipe), steps=exp.steps_of(point.recipe),
        topology=summary.get("topology"), runtime=summary.get("runtime"), injector=cfg_field(summary, "injector"),
        world_size=summary.get("world_size"),
        status=summary.get("status"), reason=summary.get("reason"),
        steps_completed=summary.get("steps_completed", 0), skipped_steps=summary.get("skipped_steps", 0),
        lost_step_fraction=_finite(summary.get("lost_step_fraction")),
        sanitized_values=summary.get("sanitized_values"), frozen_values=summary.get("frozen_values"),
        initial_eval_loss=_finite(summary.get("initial_eval_loss")), made_progress=summary.get("made_progress"),
        final_loss=_finite(summary.get("final_loss")), final_eval_loss=_finite(summary.get("final_eval_loss")),
        loss_curve=[_finite(rank0[s].get("loss")) for s in steps],
        eval_curve=[[s, _finite(rank0[s]["eval_loss"])] for s in steps if rank0[s].get("eval_loss") is not None],
        grad_norm_curve=[_finite(rank0[s].get("grad_norm")) for s in steps],
        step_time_curve=[max(m.get("step_time_s") or 0.0 for m in by_step[s]) for s in steps],
        median_step_time_s=summary.get("median_step_time_s"), median_comm_time_s=summary.get("median_comm_time_s"),
        bits_seen=summary.get("bits_seen"), bits_flipped=summary.get("bits_flipped"),
        realized_ber=summary.get("realized_ber"),
        **{k: engine_total(summary, k) for k in ("flips_sign", "flips_exponent", "flips_mantissa", "bits_exposed",
                                                 "queue_dropped", "user_dropped")},
        nonfinite_received_total=summary.get("nonfinite_received_total"),
        corrupted_values_total=summary.get("corrupted_values_total"),
        deviation_curve=[], final_deviation=None, final_deviation_exact=None,
        replica_divergence_curve=[], final_replica_divergence=None,
        perturb=cfg_field(summary, "perturb"), n_params=param_count(exp.model_of(point.recipe)),
        lr=cfg_field(summary, "lr"), grad_clip=cfg_field(summary, "grad_clip"),
        batch_size=cfg_field(summary, "batch_size"), seq_len=cfg_field(summary, "seq_len"),
        microbatches=cfg_field(summary, "microbatches"), tokens_per_step=exp.tokens_per_step(point),
        optimizer=cfg_field(summary, "optimizer"), clip=cfg_field(summary, "clip"), guard=cfg_field(summary, "guard"),
        sanitize_threshold=cfg_field(summary, "sanitize_threshold"), resync_every=cfg_field(summary, "resync_every"),
        link_seed=cfg_field(summary, "link_seed") if cfg_field(summary, "injector") == "wire" else None,
        wire_dtype=cfg_field(summary, "wire_dtype"),
        wire_bytes_per_step=_finite(summary.get("wire_bytes_per_step")),
        element=link.get("element"), protect=",".join(map(str, link["protect"])) if link.get("protect") else None,
        protected_ber=link.get("protected_ber"), profile=link.get("profile"), delay_s=link.get("delay"),
        **{k: engine_total(summary, k) for k in ("frames_dropped", "frames_replayed", "codewords_failed")},
        collectives=(train_config(exp, point).collectives or DEFAULT_COLLECTIVES[point.mode])
        if point.scope == "tensor" else None,
        machine=dict(this_machine()),
        wall_time_s=summary.get("wall_time_s"), phase_times_s=phase_times(summary, started),
        finished_at=time.time(), image_digest=summary.get("image_digest"),
        placement=summary.get("machines"),
        fault_link=exp.fault_link(point), locate=locate_fields(run_dir, exp.fault_link(point)),
        run_dir=str(run_dir.relative_to(run_dir.parent.parent)),
    )
    if baseline_dir is not None and baseline_dir != run_dir and (baseline_dir / "metrics.jsonl").exists():
        d = run_distance(baseline_dir, run_dir)
        per: dict[int, float] = {}
        for e in d["per_step"]:
            # PP: each rank holds other parameters, so the model's distance adds up over ranks; DDP: rank 0.
            if point.mode == "pp" or e["rank"] == 0:
                per[e["step"]] = per.get(e["step"], 0.0) + e["l2_estimate"] ** 2
        row["deviation_curve"] = [[s, _finite(math.sqrt(v))] for s, v in sorted(per.items())]
        wanted = list(range(summary.get("world_size") or 1)) if point.mode == "pp" else [0]
        if all(r in d["final"] for r in wanted):
            # exact: every rank whose parameters count saved them (small models, or save_final)
            row["final_deviation"] = _finite(math.sqrt(sum(d["final"][r]["l2"] ** 2 for r in wanted)))
            row["final_deviation_exact"] = True
        elif row["deviation_curve"] and row["deviation_curve"][-1][0] == summary.get("steps_completed", 0) - 1:
            # estimated from the sampled coordinates at the last step (large models save no parameters)
            row["final_deviation"] = row["deviation_curve"][-1][1]
            row["final_deviation_exact"] = False
    elif point.baseline.id == point.id:  # the clean run itself: its own baseline
        row["final_deviation"], row["final_deviation_exact"] = 0.0, True
    # else (a BER point or a BER-0 control whose baseline's run directory is not here, e.g. results resumed
    # without points/): the deviation is unknown, None, never 0
    if point.mode == "ddp":
        div = replica_divergence(run_dir)
        worst: dict[int, float] = {}
        for e in div["per_step"]:
            # max() would hide a NaN distance (a replica with non-finite parameters): keep it as inf
            v = e["l2_estimate"] if math.isfinite(e["l2_estimate"]) else math.inf
            worst[e["step"]] = max(worst.get(e["step"], 0.0), v)
        row["replica_divergence_curve"] = [[s, _finite(v)] for s, v in sorted(worst.items())]
        ranks = range(1, summary.get("world_size") or 1)
        if div["final"] and all(r in div["final"] for r in ranks):
            row["final_replica_divergence"] = _finite(max(v["l2"] for v in div["final"].values()))
        elif row["replica_divergence_curve"]:
            row["final_replica_divergence"] = row["replica_divergence_curve"][-1][1]
    return row


@functools.cache  # one machine per process: /proc/cpuinfo read once, not for every point's row
def this_machine() -> dict:
    """The row's `machine`: what decides whether two runs of one point can be bit-identical. Across CPU kinds or
    torch versions float kernels may round differently (docs/experiments.md), so the CPU's model and widest vector
    extension and torch's version are kept beside the kernel and host (torch's version read without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    cpu, flags = None, set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu is None:
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    return {"uname": " ".join(platform.uname()), "cpus": os.cpu_count(), "hostname": platform.node(), "cpu": cpu,
            "vector": next((f for f in ("avx512f", "avx2", "sse4_2") if f in flags), None), "torch": torch_version}


def phase_times(summary: dict, started: float | None) -> dict | None:
    """The row's phase_times_s: the launcher's phases_s with the point's set-up before them and its finish
    after (up to now, when its row is made)."""
    phases, spawned, wall = summary.get("phases_s"), summary.get("spawned_at"), summary.get("wall_time_s")
    if phases is None or spawned is None or wall is None or started is None:
        return None
    now = time.time()
    return {"setup": round(spawned - started, 4), **phases, "finish": round(now - spawned - wall, 4),
            "total": round(now - started, 4)}


def locate_fields(run_dir: Path, fault_link: str | None) -> dict | None:
    """The detectors' verdicts on a monitored point (testbed/locate), scored against its fault link; None when
    the point was not monitored."""
    from testbed.locate.detectors import NotMonitored, load, locate, score

    try:
        result = locate(load(run_dir))
    except (NotMonitored, FileNotFoundError, ValueError, KeyError):
        return None
    return {"steps_observed": result["steps_observed"], "scores": score(result, fault_link),
            "suspects": {d: r["suspects"][:3] for d, r in result["detectors"].items()}}


def engine_total(summary: dict, key: str) -> int | None:
    """An engine counter summed over the run's engines; None when no engine reports it."""
    values = [e[key] for e in summary.get("engines") or [] if isinstance(e.get(key), int)]
    return sum(values) if values else None


def cfg_field(summary: dict, key: str):
    """A setting as the run used it: the run's config (every setting; the default for one it lacks, None for
    one that does not exist), with the defaults decided at run time resolved (seq_len: the model's context;
    microbatches: PP's world size)."""
    config = summary.get("config") or {}
    try:
        v = config[key] if key in config else default_of(key)
    except KeyError:
        return None
    if key == "seq_len" and v is None:
        v = seq_len_of(summary.get("model") or default_of("model"))
    if key == "microbatches" and v is None and summary.get("mode") == "pp":
        v = summary.get("world_size")
    return v


def open_run(exp: Experiment, out: str | Path, runtime: str | None, recipes: list[str] | None = None):
    """The run directory made ready (points/, the experiment's portable copy) and its results: (out, runtime,
    fingerprint per recipe, the ResultsStore, the points). `recipes`: only the points of recipes matching one of
    these shell patterns (and the clean points they are compared with), checked before anything is written."""
    points = exp.points()
    if recipes:
        chosen = [p for p in points if any(fnmatch.fnmatchcase(p.recipe, pat) for pat in recipes)]
        if not chosen:
            raise ValueError(f"--recipes {','.join(recipes)}: no recipe of the grid matches "
                             f"({', '.join(exp.spec.grid.recipe)})")
        wanted = set(chosen) | {p.baseline for p in chosen}
        points = [p for p in points if p in wanted]
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out)  # one run per directory; it also makes what an earlier run left safe to sweep
    try:
        swept = sweep_earlier_runs(out)
        (out / "points").mkdir(exist_ok=True)
        runtime = runtime or exp.spec.runtime
        copy = out / "experiment.yaml"
        if not (copy.exists() and os.path.samefile(exp.file, copy)):
            try:
                write_atomic(copy, exp.portable_copy())
            except OSError as e:
                raise output_error(copy, e, "nothing was run; free space, then run the same command again") from e
        # every recipe of the grid (a part keeps the others' rows), and a control's baseline recipe even outside it
        fps = {r: exp.fingerprint(runtime, r)
               for r in dict.fromkeys([*exp.spec.grid.recipe, *(p.recipe for p in points)])}
        aliases = {alt: fp for r, fp in fps.items() for alt in exp.reused_fingerprints(runtime, r)}
        store = ResultsStore(out, set(fps.values()), aliases)
    except BaseException:
        lock.release()
        raise
    store.lock = lock
    if swept:
        store.notes.insert(0, f"an earlier run of {out} was killed outright; taken down what it left: "
                              f"{', '.join(swept)}")
    return out, runtime, fps, store, points


def points_to_run(points: list[Point], store: "ResultsStore", fps: dict[str, str], out: Path,
                  retry_failed: bool = False) -> tuple[list[Point], list[Point]]:
    """(todo, rerun): the points without a row of their recipe's fingerprint (with retry_failed, or whose row
    failed), in grid order; plus the clean runs among them that have a row but no run directory in `out` (rows
    reused from another experiment, `reuse:`) and that a point to run needs: its weight deviation is measured
    against its baseline's saved parameters, so those run again (the same run, bit for bit), before it."""
    done = {p: store.done(p, fps[p.recipe]) for p in points}
    todo = {p for p in points if not done[p] or (retry_failed and done[p]["status"] != "ok")}
    rerun = {p.baseline for p in todo if p.baseline != p and p.baseline not in todo and done.get(p.baseline)
             and not (out / (done[p.baseline].get("run_dir") or "-") / "metrics.jsonl").exists()}
    return [p for p in points if p in todo or p in rerun], [p for p in points if p in rerun]


def run_experiment(exp: Experiment, out: str | Path, runtime: str | None = None, retry_failed: bool = False,
                   log=None, machines=None, cold: bool = False, recipes: list[str] | None = None) -> list[dict]:
    """Every point of the grid (those not already in results.jsonl), across the inventory `machines` if given.
    Warm (the default on this machine): points that share a topology, runtime and mode run on one topology
    and worker services that stay up (testbed/experiments/warm.py); `cold`: a fresh topology and fresh
    workers per point. `recipes`: a long experiment in parts (open_run), each run resuming the results of the
    others. Several points at once, or on Slurm: testbed/experiments/executors.py."""
    from testbed.experiments.warm import WarmSweep

    from tqdm import tqdm

    out, runtime, fps, store, points = open_run(exp, out, runtime, recipes)
    try:
        todo, rerun = points_to_run(points, store, fps, out, retry_failed)
        bar = tqdm(total=len(points), initial=len(points) - len(todo), unit="point", dynamic_ncols=True,
                   desc=exp.spec.name, file=sys.stderr)
        say = log or (lambda m: bar.write(m, file=sys.stderr))
        for note in store.notes:
            say(note)
        if len(todo) < len(points):
            say(f"{len(points) - len(todo)} of {len(points)} points already in {out / 'results.jsonl'}: skipped")
        if rerun:
            say(f"{len(rerun)} clean runs have a row but no run directory in {out} (rows reused from another "
                "experiment, or results copied without their points/) and run again, the same runs bit for bit: "
                "the points compared with them need their parameters")
        warm = None if cold or machines is not None else WarmSweep(out)
        if warm is not None:
            todo = warm_order(exp, todo)
        try:
            for point in todo:
                bar.set_postfix_str(point.id)
                row = run_point(exp, point, out, runtime, fps[point.recipe],
                                f"{exp.spec.name[:8]}{os.getpid() % 10000}-{points.index(point)}", machines, warm)
                line = row.pop("_line", None) or f"{row['status']}: {row.get('reason')}"
                if row["status"] != "ok" and disk_full_reason(row.get("reason")):
                    # the point did not fail, its disk did: no row (it runs again once there is space)
                    raise OutputError(f"{point.id} could not write its run directory {out / row['run_dir']}: "
                                      f"{row['reason']}; not recorded ({_free_bytes(out) or 0:,} bytes free on its "
                                      f"file system): {out / 'results.jsonl'} keeps its {len(store.rows)} rows; "
                                      "free space, then run the same command again", DISK_FULL[0])
                if point in rerun and (before := store.rows.get(point.id)) is not None:
                    line += f"; {rerun_check(before, row)}"
                store.add(row)
                say(f"{point.id}: {line}")
                bar.update(1)
            if warm is not None:
                warm.close()
            if exp.spec.latency is not None:
                run_latency(exp, out, runtime, say)
        finally:
            if warm is not None:
                warm.close()
            bar.close()
    finally:
        store.close()
    return list(store.rows.values())


# what a run computes (not when, where or how fast): a clean run trained again gives these bit for bit
REPRODUCED_FIELDS = ("status", "steps_completed", "final_loss", "final_eval_loss", "loss_curve", "eval_curve",
                     "grad_norm_curve", "deviation_curve", "replica_divergence_curve", "skipped_steps",
                     "bits_flipped", "flips_sign", "flips_exponent", "flips_mantissa", "corrupted_values_total")


def rerun_check(before: dict, after: dict) -> str:
    """Whether a clean run trained again (its run directory gone) reproduced its row: REPRODUCED_FIELDS compared
    exactly. Another CPU kind or torch build can change the floats (docs/experiments.md): said, with both."""
    diff = [k for k in REPRODUCED_FIELDS if before.get(k) != after.get(k)]
    if not diff:
        return "the same run bit for bit as its row (losses, eval and gradient-norm curves, flips)"
    cpu = [(r.get("machine") or {}).get(k) for r in (before, after) for k in ("cpu", "vector", "torch")]
    return (f"NOT the same as its row in {', '.join(diff)} (row: {' '.join(map(str, cpu[:3]))}; here: "
            f"{' '.join(map(str, cpu[3:]))}); its new row replaces it, and the points paired with it pair with "
            "this run")


def warm_order(exp: Experiment, todo: list[Point]) -> list[Point]:
    """`todo` (in grid order) with each warm group's points together, in grid order within a group (a point's
    baseline is in its group and stays before it). Groups go in the order of their first point to run that is
    not a clean run: the grid lists every mode's clean runs first, so a resumed run carries on with the group it
    stopped in rather than starting another whose clean runs are still missing."""
    group = {p: warm_group(exp, p) for p in todo}
    groups = list(dict.fromkeys([group[p] for p in todo if p.baseline != p] + list(group.values())))
    return sorted(todo, key=lambda p: groups.index(group[p]))


def warm_group(exp: Experiment, point: Point) -> tuple:
    """What the points that share a warm topology or local services share: injector, topology, mode, hosts."""
    cfg = train_config(exp, point)
    return cfg.injector, exp.topology_file(point.mode, point.recipe), point.mode, cfg.hosts


def run_point(exp: Experiment, point: Point, out: Path, runtime: str | None, fp: str, name: str,
              machines=None, warm=None) -> dict:
    """Train one point; a failure of the set-up (not of the training) becomes an `error` row, so one bad
    point does not end the sweep (`--retry-failed` runs it again)."""
    started = time.time()
    run_dir = out / "points" / point.id
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted attempt: start the point afresh
    try:  # the collectives a tensor-scope point corrupts come with its config (train_config)
        topo, ber, fault = exp.topology(point.mode, point.recipe), point.ber, exp.fault_link(point)
        if fault:  # one link at the point's BER, the others at the background (docs/locate.md)
            from testbed.locate.faults import with_fault

            topo, ber = with_fault(topo, fault, point.ber, exp.spec.fault.background_ber), None
        summary = train(topo, train_config(exp, point), run_dir, ber=ber,
                        scope=point.scope, checksum=point.checksum, runtime=runtime, name=name, log=lambda m: None,
                        machines=machines, warm=warm, **exp.link_settings(point))
    except KeyboardInterrupt:
        raise
    except OSError as e:
        if e.errno not in DISK_FULL:
            return error_for(exp, point, fp, runtime, e)
        # the point did not fail, its disk did: no error row (it would not run again), the sweep stops
        where = Path(e.filename) if e.filename else run_dir
        raise output_error(where, e, f"{point.id} is not recorded ({out / RESULTS_FILE} is as it was) and runs "
                                     "again: free space, then run the same command again") from e
    except Exception as e:
        return error_for(exp, point, fp, runtime, e)
    base = out / "points" / point.baseline.id
    row = point_row(exp, point, summary, run_dir, base if base.exists() else None, started)
    row["fingerprint"] = fp
    return {**row, "_line": summary_line(summary)}


def error_for(exp: Experiment, point: Point, fp: str, runtime: str | None, e: Exception) -> dict:
    """The `error` row of a point whose set-up failed."""
    return error_row(point=point.id, baseline=point.baseline.id, experiment=exp.spec.name,
                     tolerance=exp.spec.tolerance, fingerprint=fp,
                     **point.params(), ber_at_lambda=point.lam, model=exp.model_of(point.recipe),
                     steps=exp.steps_of(point.recipe), runtime=runtime or "netns",
                     injector=train_config(exp, point).injector,
                     status="error", reason=f"{type(e).__name__}: {e}", steps_completed=0,
                     finished_at=time.time(), run_dir=f"points/{point.id}")


def run_latency(exp: Experiment, out: Path, runtime: str | None, say) -> None:
    from testbed.bench.commands import measure_latency
    from testbed.topology.topo import Topology

    lat = exp.spec.latency
    path = out / "latency.json"
    want = {"topology": lat.topology, "link": lat.link, "bers": list(lat.bers), "size": lat.size, "count": lat.count}
    if lat.engine is not None:
        want["engine"] = lat.engine
    if path.exists() and json.loads(path.read_text()).get("config") == want:
        say("latency: already measured")
        return
    say(f"latency: ping-pong on {lat.topology}, {lat.count} x {lat.size} B per configuration")
    topo = Topology.load(exp.resolve(lat.topology), name=f"{exp.spec.name[:8]}{os.getpid() % 10000}-lat")
    if runtime:
        topo = topo.with_overrides(runtime=runtime)
    result = measure_latency(topo, lat.link, list(lat.bers), lat.size, lat.count, log=say, engine=lat.engine)
    result["config"] = want
    write_json_atomic(path, result)
