"""Things the worker and the launcher agree on: exit codes, run-dir file names, atomic writes."""

import json
import os
import tempfile
from pathlib import Path

# Worker exit codes. A worker killed by a signal has a negative return code (Popen) or 128+signal
# (when a shell or `ip netns exec` wrapper reports it); SIGABRT is how gloo aborts on a bad frame.
EXIT_OK = 0
EXIT_ERROR = 1  # an exception unrelated to communication (bad argument, missing data, bug)
EXIT_USAGE = 2  # argparse
EXIT_DIVERGED = 3  # non-finite loss
EXIT_TIMEOUT = 4  # a collective / send / recv timed out (a peer hung or a frame was lost)
EXIT_COMM_ERROR = 5  # a collective failed (connection reset, peer gone, gloo enforce error)

# Run statuses written by the launcher (summary.json) and, per rank, by the worker (status-rank{R}.json).
STATUSES = ("ok", "diverged", "crashed", "hung", "error")


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


def write_atomic(path, data):
    """Write bytes or text to path via a temp file in the same directory + rename (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache and run dirs are shared between users/containers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path, obj):
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n")


def append_jsonl(path, obj):
    """Append one JSON line with a single write() (O_APPEND), so a reader sees whole lines only."""
    line = json.dumps(obj, sort_keys=True, allow_nan=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_jsonl(path):
    """Read whole lines; a torn last line (writer killed mid-write) is skipped."""
    rows = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows
