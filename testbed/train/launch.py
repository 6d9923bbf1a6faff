"""Run N training workers, watch them, and decide the run's outcome.

    summary = run_workers(spawn, world_size, worker_argv, run_dir, env_for_rank, timeout_s, stall_timeout_s)

`spawn(rank, argv, env)` starts one worker and returns a subprocess.Popen (or anything with pid, poll(),
wait(timeout) and kill(), where kill() ends the worker itself). The caller decides where the worker runs:
local_spawn() below starts it here; the testbed's runtime starts it inside a host's network namespace.

Outcomes (summary["status"]):
  ok        every worker exited 0
  diverged  a worker saw a non-finite loss (exit 3); the others exit at the same step (the loss is agreed)
  crashed   a worker died of a signal (SIGABRT = gloo aborting on a bad frame), of a communication error, or
            of an exception inside DDP / pipelining / torch.distributed while training (exit 6)
  hung      no progress for stall_timeout_s, the run exceeded timeout_s, or a collective timed out (exit 4)
  error     a worker failed for a reason unrelated to the network (exit 1/2: bad argument, missing data, bug)
When one worker fails the others are killed (after a short grace for "diverged"): the launcher never waits
forever. Then it merges metrics-rank*.jsonl into metrics.jsonl and writes summary.json (atomically).

Local use: python -m testbed.train.launch --world-size 2 --out runs/x -- --mode ddp --model tiny --steps 20
"""

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from testbed.train import common
from testbed.train.common import read_jsonl, write_atomic, write_json_atomic
from testbed.train.fingerprint import bit_identical, replica_divergence, run_distance  # noqa: F401 (API)
from testbed.train.settings import default_of

WORKER_MODULE = "testbed.train.worker"
_EXIT_STATUS = {common.EXIT_DIVERGED: "diverged", common.EXIT_TIMEOUT: "hung", common.EXIT_COMM_ERROR: "crashed",
                common.EXIT_WIRE_LAYER: "crashed", common.EXIT_ERROR: "error", common.EXIT_USAGE: "error"}
# Which failure explains a run when several ranks fail (lower wins). A death by signal is never caused by a
# peer, nor is an exception inside DDP/pipelining on what this rank received; a communication error usually
# is (the peer exited first and closed its sockets), so it ranks last.
_CAUSE_RANK = {"signal": 0, common.EXIT_ERROR: 1, common.EXIT_USAGE: 1, common.EXIT_WIRE_LAYER: 2,
               common.EXIT_DIVERGED: 3, common.EXIT_TIMEOUT: 4, common.EXIT_COMM_ERROR: 5}


def worker_command(worker_argv, run_dir, python=sys.executable):
    if "--out" in worker_argv:
        raise ValueError("worker_argv must not contain --out: run_workers sets it to run_dir")
    return [python, "-m", WORKER_MODULE, *worker_argv, "--out", str(run_dir)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(master_port=None, ifname="lo"):
    """env_for_rank for workers on this host: rendezvous, data and management groups all on loopback."""
    port = master_port or free_port()
    return lambda rank: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "GLOO_SOCKET_IFNAME": ifname, "TESTBED_MGMT_IFNAME": ifname}


def local_spawn(run_dir):
    """spawn() that runs the worker here, its output in run_dir/worker-rank{R}.log, in its own session
    (a signal meant for the caller's process group does not reach it; kill() is by pid)."""

    def spawn(rank, argv, env):
        log = open(common.log_path(run_dir, rank), "wb")
        try:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    return spawn


def signal_of(returncode):
    """Signal number that ended a worker: Popen reports -N; shells and `ip netns exec` wrappers 128+N."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + 65:
        return returncode - 128
    return None


def _signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


_ERROR_LINE = re.compile(r"terminate called|what\(\)|enforce fail|Fatal Python error|Error|error|Abort", re.I)


def _log_excerpt(path, n=3):
    """The last few error-looking lines of a worker log (gloo's abort message, a traceback's last line)."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return ""
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and not ln.startswith(("Extension modules", "File "))]
    return " | ".join((errors or lines)[-n:])[-600:]


def _read_status(run_dir, rank):
    try:
        return json.loads(common.status_path(run_dir, rank).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _failure(run_dir, rank, returncode):
    """(cause rank, status, reason) for a worker that exited with a non-zero code."""
    sig = signal_of(returncode)
    if sig is not None:
        what = " (gloo abort: corrupted header or protocol error)" if sig == signal.SIGABRT else ""
        tail = _log_excerpt(common.log_path(run_dir, rank))
        return 0, "crashed", f"rank {rank} killed by {_signal_name(sig)}{what}" + (f"; log: {tail}" if tail else "")
    status = _EXIT_STATUS.get(returncode, "error")
    reason = _read_status(run_dir, rank).get("reason") or _log_excerpt(common.log_path(run_dir, rank))
    return _CAUSE_RANK.get(returncode, 1), status, f"rank {rank} exited {returncode}: {reason}"


def _root_cause(run_dir, failures):
    """(status, reason) of the failure that explains the run best, from {rank: returncode}."""
    _, status, reason = min(_failure(run_dir, r, rc) for r, rc in sorted(failures.items()))
    return status, reason


def _progress_signature(run_dir, world_size):
    sig = []
    for r in range(world_size):
        for p in (common.metrics_path(run_dir, r), common.status_path(run_dir, r)):
            try:
                st = p.stat()
                sig.append((st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                sig.append(None)
    return tuple(sig)


class LineCounter:
    """Lines of a file that only grows (a worker's metrics), counted from the new bytes only: the launcher
    polls often, and re-reading whole metrics files (each row carries a parameter sample) would cost
    O(steps^2) on the cores the workers need."""

    def __init__(self, path):
        self.path, self.offset, self.lines = Path(path), 0, 0

    def count(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.lines
        self.offset += len(chunk)
        self.lines += chunk.count(b"\n")
        return self.lines


def _clear(run_dir, world_size):
    """A run directory belongs to one run: remove what an earlier run left (stale progress would mislead),
    also files of ranks an earlier, larger run had."""
    run_dir = Path(run_dir)
    for name in ("metrics.jsonl", "summary.json", "monitor-ranks.jsonl"):  # the last: rank 0's --monitor log
        (run_dir / name).unlink(missing_ok=True)
    for pattern in ("metrics-rank*.jsonl", "status-rank*.json", "worker-rank*.err", "final-rank*.pt"):
        for p in run_dir.glob(pattern):
            p.unlink(missing_ok=True)


def merge_metrics(run_dir, world_size):
    rows = []
    for r in range(world_size):
        rows.extend(read_jsonl(common.metrics_path(run_dir, r)))
    rows.sort(key=lambda row: (row["step"], row["rank"]))
    write_atomic(Path(run_dir) / "metrics.jsonl", "".join(_dumps(row) + "\n" for row in rows))
    return rows


def _dumps(row):
    return json.dumps(row, sort_keys=True, allow_nan=True)


def _finite(x):
    return x is not None and abs(x) < float("inf")  # False for NaN too


# made_progress: the last eval loss is at least this fraction below the eval loss before the first step
PROGRESS_MARGIN = 0.01


def made_progress(initial, final):
    """Whether a loss fell from `initial` to `final` by PROGRESS_MARGIN (relative); None when unknown."""
    if not _finite(initial) or final is None:
        return None
    return _finite(final) and final < initial * (1 - PROGRESS_MARGIN)


def summarize_rows(rows, world_size):
    """steps_completed (steps every rank logged), final losses, medians, corruption totals and the honest
    outcome: steps lost, values sanitized and frozen, progress (docs/training.md, "Outcome")."""
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], {})[row["rank"]] = row
    done = 0
    while done in by_step and len(by_step[done]) == world_size:
        done += 1
    out = {"steps_completed": done, "initial_loss": None, "final_loss": None, "final_eval_loss": None,
           "final_eval_loss_per_rank": None, "median_step_time_s": None, "median_comm_time_s": None}
    if done:
        last = by_step[done - 1]
        out["initial_loss"], out["final_loss"] = by_step[0][0]["loss"], last[0]["loss"]
        evals = [s for s in range(done) if by_step[s][0].get("eval_loss") is not None]
        if evals:
            per_rank = {r: by_step[evals[-1]][r]["eval_loss"] for r in sorted(by_step[evals[-1]])}
            out["final_eval_loss_per_rank"] = per_rank
            out["final_eval_loss"] = sum(per_rank.values()) / len(per_rank)
        # a step takes as long as its slowest rank
        out["median_step_time_s"] = statistics.median(max(r["step_time_s"] for r in by_step[s].values())
                                                      for s in range(done))
        comm = [max(r["comm_time_s"] for r in by_step[s].values()) for s in range(done)
                if all(r.get("comm_time_s") is not None for r in by_step[s].values())]
        out["median_comm_time_s"] = statistics.median(comm) if comm else None
    out["nonfinite_received_total"] = sum(row.get("nonfinite_received") or 0 for row in rows)
    out["skipped_steps"] = sum(1 for row in rows if row["rank"] == 0 and row.get("skipped"))
    out["lost_step_fraction"] = out["skipped_steps"] / done if done else None
    out["sanitized_values"] = sum(row.get("sanitized") or 0 for row in rows)
    # frozen: the last step every rank counted it; DDP replicas hold the same parameters (the worst one
    # counts), PP stages different ones (they add up)
    counted = [s for s in range(done) if all(r.get("frozen") is not None for r in by_step[s].values())]
    out["frozen_values"] = None
    if counted:
        frozen = [r["frozen"] for r in by_step[counted[-1]].values()]
        out["frozen_values"] = sum(frozen) if rows[0].get("mode") == "pp" else max(frozen)
    initial = [r.get("initial_eval_loss") for r in by_step[0].values()] if done else []
    out["initial_eval_loss"] = sum(initial) / len(initial) if initial and None not in initial else None
    # without evals: the training loss of the last step against step 0's (taken before any update)
    if out["initial_eval_loss"] is not None:
        out["progress_basis"], first, last = "eval", out["initial_eval_loss"], out["final_eval_loss"]
    else:
        out["progress_basis"], first, last = "train", out["initial_loss"], out["final_loss"]
    out["made_progress"] = made_progress(first, last)
    if done and out["skipped_steps"] == done:
        out["made_progress"] = False  # not one update was applied, whatever the (corrupted) losses say
    # bytes a rank hands to the data link per step (mean over ranks: PP stages differ), median over steps
    wire = [statistics.mean(r["wire_bytes"] for r in by_step[s].values()) for s in range(done)
            if all(r.get("wire_bytes") is not None for r in by_step[s].values())]
    out["wire_bytes_per_step"] = statistics.median(wire) if wire else None
    corrupted = [row.get("corrupted_values") for row in rows]
    out["corrupted_values_total"] = sum(c for c in corrupted if c is not None) if any(
        c is not None for c in corrupted) else None
    out["first_nonfinite_loss_step"] = next((s for s in sorted(by_step) if any(
        not _finite(r["loss"]) or (r.get("eval_loss") is not None and not _finite(r["eval_loss"]))
        for r in by_step[s].values())), None)
    return out


# The phases of a run, in order, from the workers' timelines (status-rank{R}.json "times"): (name, from, to)
PHASES = (("launch", None, "started"), ("import", "started", "data"), ("data", "data", "connecting"),
          ("connect", "connecting", "connected"), ("build", "connected", "training"))


def phase_times(run_dir, world_size, spawned_at, ended_at):
    """Where a run's wall time went, s, each phase the slowest rank's: launch (spawn to the worker's start),
    import (its imports; ~0 on a warm service), data, connect (rendezvous and process groups), build (model,
    optimizer, DDP or pipeline), steps, eval, fingerprint, loop (the rest of the training loop: metrics, logs,
    final parameters), exit (the last rank's end of training to the launcher seeing every exit: process-group
    teardown, the process's exit, the launcher's poll). A phase no rank reached is left out."""
    out = {}
    times = [_read_status(run_dir, r).get("times") or {} for r in range(world_size)]
    for t in times:  # a process's start is known to a clock tick (10 ms): never before its spawn
        if t.get("started") is not None:
            t["started"] = max(t["started"], spawned_at)

    def slowest(f):
        v = [x for x in (f(t) for t in times) if x is not None]
        return max(v) if v else None

    def span(t, a, b):
        start = spawned_at if a is None else t.get(a)
        return t[b] - start if start is not None and t.get(b) is not None else None

    for name, a, b in PHASES:
        out[name] = slowest(lambda t: span(t, a, b))
    for name in ("steps", "eval", "fingerprint"):
        out[name] = slowest(lambda t: t.get(f"{name}_s") if "training" in t else None)
    out["loop"] = slowest(lambda t: span(t, "training", "done") - t["steps_s"] - t["eval_s"] - t["fingerprint_s"]
                          if span(t, "training", "done") is not None else None)
    done = [t["done"] for t in times if t.get("done") is not None]
    out["exit"] = ended_at - max(done) if done else None
    return {k: round(v, 4) for k, v in out.items() if v is not None}


def run_workers(spawn, world_size, worker_argv, run_dir, env_for_rank, timeout_s, stall_timeout_s, *,
                startup_timeout_s=None, settle_s=2.0, diverge_grace_s=15.0, poll_s=0.05, log=None):
    """Start world_size workers, monitor them, write run_dir/metrics.jsonl and run_dir/summary.json.

    worker_argv: the worker's arguments (`python -m testbed.train.worker ARGS`) without --out.
    env_for_rank(rank) -> dict: variables added to this process's environment for that rank (MASTER_ADDR,
        MASTER_PORT, GLOO_SOCKET_IFNAME, TESTBED_MGMT_IFNAME, ...); RANK and WORLD_SIZE are set here.
    timeout_s: limit for the whole run. stall_timeout_s: limit without any new metrics/status line once
        every rank has logged a step; before that startup_timeout_s applies (default max(stall, 300) s:
        data preparation and connecting take a while, a cold cache much longer).
    settle_s: after the first failure, how long to wait for other ranks' exits before naming the cause.
    diverge_grace_s: how long the other ranks get to stop by themselves after one reports "diverged".
    Returns the summary dict (also written to run_dir/summary.json).
    """
    from testbed.train.worker import build_parser

    log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _clear(run_dir, world_size)
    args = build_parser().parse_args([*worker_argv, "--out", str(run_dir)])  # fails early on bad arguments
    argv = worker_command(worker_argv, run_dir)
    startup_timeout_s = startup_timeout_s if startup_timeout_s is not None else max(stall_timeout_s, 300.0)

    t0_wall, t0 = time.time(), time.monotonic()
    procs, exited, killed = {}, {}, []
    outcome, first_failure, kill_at = None, None, None
    try:
        for rank in range(world_size):
            env = {**os.environ, **env_for_rank(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "PYTHONUNBUFFERED": "1"}
            procs[rank] = spawn(rank, argv, env)
        sig, last_change, steps_seen = None, time.monotonic(), 0
        lines = {r: LineCounter(common.metrics_path(run_dir, r)) for r in range(world_size)}
        while True:
            now = time.monotonic()
            for rank, p in procs.items():
                if rank not in exited and p.poll() is not None:
                    exited[rank] = p.returncode
            new_sig = _progress_signature(run_dir, world_size)
            if new_sig != sig:
                sig, last_change = new_sig, now
                counts = [lines[r].count() for r in range(world_size)]
                if min(counts) > steps_seen:
                    steps_seen = min(counts)
                    log(f"[{run_dir.name}] step {steps_seen}/{args.steps} ({now - t0:.1f}s)")
            if len(exited) == world_size:
                break
            failed = {r: rc for r, rc in exited.items() if rc != 0}
            if outcome is None:
                if failed:
                    first_failure = first_failure or now
                    # let the other ranks report first: the rank that caused a failure may exit after the
                    # peers that noticed it ("connection closed")
                    if now - first_failure >= settle_s:
                        outcome = _root_cause(run_dir, failed)
                        # a diverged run stops by itself on every rank at the same step (the loss is agreed)
                        kill_at = first_failure + diverge_grace_s if outcome[0] == "diverged" else now
                elif now - t0 > timeout_s:
                    outcome, kill_at = ("hung", f"run exceeded timeout_s={timeout_s:g}s"), now
                elif now - last_change > (stall_timeout_s if steps_seen else startup_timeout_s):
                    running = [r for r in range(world_size) if r not in exited]
                    outcome = ("hung", f"no progress for {now - last_change:.0f}s "
                                       f"({'after step ' + str(steps_seen) if steps_seen else 'during startup'}); "
                                       f"ranks still running: {running}")
                    kill_at = now
                if outcome is not None:
                    log(f"[{run_dir.name}] {outcome[0]}: {outcome[1]}")
            if outcome is not None and now >= kill_at:
                killed += _kill_rest(procs, exited)
            time.sleep(poll_s)
    finally:
        killed += _kill_rest(procs, exited)  # whatever happened above, leave no worker behind

    if outcome is None:
        failed = {r: rc for r, rc in exited.items() if rc != 0}
        outcome = _root_cause(run_dir, failed) if failed else ("ok", None)
    ended_at = time.time()
    rows = merge_metrics(run_dir, world_size)
    summary = {
        "status": outcome[0],
        "reason": outcome[1],
        "mode": args.mode,
        "model": args.model,
        "seed": args.seed,
        "world_size": world_size,
        "steps_requested": args.steps,
        **summarize_rows(rows, world_size),
        "exit_codes": {str(r): exited[r] for r in sorted(exited)},
        "signals": {str(r): _signal_name(signal_of(rc)) for r, rc in sorted(exited.items())
                    if signal_of(rc) is not None and r not in killed},
        "killed_by_launcher": sorted(set(killed)),
        "worker_status": {str(r): {k: _read_status(run_dir, r).get(k) for k in ("state", "status", "reason", "step")}
                          for r in range(world_size)},
        "wall_time_s": time.monotonic() - t0,
        "started_at": t0_wall,
        "spawned_at": t0_wall,  # (testbed train sets started_at to its own start)
        "phases_s": phase_times(run_dir, world_size, t0_wall, ended_at),
        "run_dir": str(run_dir),
        "worker_argv": list(worker_argv),
    }
    if summary["status"] == "ok" and summary["steps_completed"] != args.steps:
        summary["status"], summary["reason"] = "error", (
            f"workers exited 0 but only {summary['steps_completed']}/{args.steps} steps were logged by every rank")
    write_json_atomic(run_dir / "summary.json", summary)
    log(f"[{run_dir.name}] {summary['status']}: {summary['steps_completed']}/{args.steps} steps, "
        f"final loss {summary['final_loss']}, {summary['wall_time_s']:.1f}s")
    return summary


def _kill_rest(procs, exited, wait_s=10.0):
    """SIGKILL every worker still running (a SIGSTOPped one too) and reap it. Returns the ranks killed."""
    killed = []
    for rank, p in procs.items():
        if rank not in exited and p.poll() is None:
            try:
                p.kill()
            except ProcessLookupError:
                pass
            killed.append(rank)
    for rank, p in procs.items():
        if rank not in exited:
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
            exited[rank] = p.returncode
    return killed


def main():
    p = argparse.ArgumentParser(description="run training workers on this host over loopback")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=default_of("run_timeout"), help="limit for the whole run (s)")
    p.add_argument("--stall-timeout", type=float, default=default_of("stall_timeout"),
                   help="limit without progress (s)")
    p.add_argument("worker_argv", nargs=argparse.REMAINDER, help="-- then the worker's arguments (no --out)")
    a = p.parse_args()
    worker_argv = a.worker_argv[1:] if a.worker_argv[:1] == ["--"] else a.worker_argv
    summary = run_workers(local_spawn(a.out), a.world_size, worker_argv, a.out, loopback_env(), a.timeout,
                          a.stall_timeout)
    print(_dumps({k: summary[k] for k in ("status", "reason", "steps_completed", "final_loss",
                                          "final_eval_loss", "median_step_time_s", "wall_time_s")}))
    sys.exit(0 if summary["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
