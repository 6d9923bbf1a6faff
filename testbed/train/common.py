"""Things the worker and the launcher agree on: exit codes, run-dir and inbox file names, atomic writes."""

from pathlib import Path

from testbed.fileio import append_jsonl, read_jsonl, write_atomic  # noqa: F401 (the workers' API)
from testbed.fileio import write_json_atomic as _write_json_atomic

# Worker exit codes. A worker killed by a signal has a negative return code (Popen) or 128+signal
# (when a shell or `ip netns exec` wrapper reports it); SIGABRT is how gloo aborts on a bad frame.
EXIT_OK = 0
EXIT_ERROR = 1  # an exception unrelated to communication (bad argument, missing data, bug)
EXIT_USAGE = 2  # argparse
EXIT_DIVERGED = 3  # non-finite loss
EXIT_TIMEOUT = 4  # a collective / send / recv timed out (a peer hung or a frame was lost)
EXIT_COMM_ERROR = 5  # a collective failed (connection reset, peer gone, gloo enforce error)
EXIT_WIRE_LAYER = 6  # DDP, pipelining or torch.distributed raised while training: what corrupted bytes do

# Run statuses written by the launcher (summary.json) and, per rank, by the worker (status-rank{R}.json).
STATUSES = ("ok", "diverged", "crashed", "hung", "error", "invalid")  # invalid: set by testbed train


def metrics_path(run_dir, rank):
    return Path(run_dir) / f"metrics-rank{rank}.jsonl"


def status_path(run_dir, rank):
    return Path(run_dir) / f"status-rank{rank}.json"


def err_path(run_dir, rank):
    return Path(run_dir) / f"worker-rank{rank}.err"


def log_path(run_dir, rank):
    return Path(run_dir) / f"worker-rank{rank}.log"


def final_params_path(run_dir, rank):
    return Path(run_dir) / f"final-rank{rank}.pt"


def request_path(inbox, sid, k):
    """A warm worker service's K-th request from the controller (testbed/train/serve.py, experiments/warm.py)."""
    return Path(inbox) / f"{sid}-{k}.json"


def answer_path(inbox, sid, k):
    """The service's answer to request K."""
    return Path(inbox) / f"{sid}-{k}.done"


def write_json_atomic(path, obj, fsync=True):
    _write_json_atomic(path, obj, sort_keys=True, fsync=fsync)
