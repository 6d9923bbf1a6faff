"""A warm training worker: `python -m testbed.train.serve --inbox DIR --id N` runs point after point in one
process, so torch, DDP and dynamo are imported once per host and sweep instead of once per point.

Protocol (files in DIR, which the controller, testbed/experiments/warm.py, and the host both see):
  N-K.json   the controller's K-th request (K = 0, 1, ...): {"argv": the worker's arguments with --out,
             "env": RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...} or {"stop": true}
  N-K.done   the answer, once the point's process groups are destroyed: {"code": the worker's exit code,
             "exits": whether the service exits now instead of waiting for request K+1}
A point runs exactly as `python -m testbed.train.worker ARGV` would (worker.Worker, its files in --out, its log
in --out/worker-rank{R}.log), from a state reset from the point's seed: environment, RNGs, thread count,
dynamo's caches; the model, optimizer, data order and process groups are the point's own. After a point that
did not end ok or diverged, or whose process groups did not come down, the service exits after answering and
the controller starts a fresh one. It exits too when the controller is gone (new parent, DIR removed).
"""

import argparse
import faulthandler
import gc
import itertools
import json
import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from testbed.train import common, worker
from testbed.train.common import answer_path, request_path

worker.keep_torch_caches()  # this module is a worker process's entry: before torch._dynamo's import makes its cache

import torch._dynamo  # noqa: E402,F401 (what DDP imports: paid once)
import torch.nn.parallel  # noqa: E402,F401

POLL_S = 0.02


@contextmanager
def output_to(path):
    """stdout and stderr (file descriptors 1 and 2: gloo's C++ output and faulthandler's too) into `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(saved, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def fresh_state(args):
    """What a point could inherit from the one before it in this process, set as a fresh worker has it."""
    random.seed(args.seed)
    np.random.seed(args.seed % 2**32)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(False)
    worker.keep_torch_caches()
    worker.set_threads(args)
    torch._dynamo.reset()


def serve_point(msg, base_env, started=None):
    """Run one point (its request seen at `started`); (exit code, whether its process groups came down, the
    seconds that took)."""
    os.environ.clear()
    os.environ.update({**base_env, **msg["env"]})
    try:
        args = worker.parse(msg["argv"])
    except SystemExit as e:  # argparse: the launcher checks the arguments first, so this is a bug
        return int(e.code or common.EXIT_USAGE), True, 0.0
    os.makedirs(args.out, exist_ok=True)
    with output_to(common.log_path(args.out, os.environ.get("RANK", "0"))):
        fresh_state(args)
        w = worker.Worker(args, started=started)
        code = w.run_safely()
        t = time.monotonic()
        closed = w.close()
    del w
    gc.collect()  # the groups' sockets and the store go now, not at some later point
    gc.freeze()  # what is left lives on: later collections need not scan it again (see main)
    return code, closed, time.monotonic() - t


def settled_thread_count(limit_s=0.5):
    """This process's threads once the count stops falling: a thread of the point that is still on its way out
    (it ends within milliseconds) is not counted as kept."""
    count = len(os.listdir("/proc/self/task"))
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = len(os.listdir("/proc/self/task"))
        if now == count:
            break
        count = now
    return count


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m testbed.train.serve", description=__doc__.split("\n")[0])
    p.add_argument("--inbox", required=True, help="directory of requests and answers")
    p.add_argument("--id", required=True, help="this service's name in the inbox")
    a = p.parse_args(argv)
    faulthandler.enable()  # on file descriptor 2: a point's log while it runs
    inbox, parent, base_env = Path(a.inbox), os.getppid(), dict(os.environ)
    # torch's modules are ~280,000 objects that live as long as the process: out of the collector's view, a
    # point's gc.collect() takes milliseconds instead of ~0.1 s
    gc.collect()
    gc.freeze()
    for k in itertools.count():
        req = request_path(inbox, a.id, k)
        while not req.exists():
            if os.getppid() != parent or not inbox.is_dir():
                os._exit(0)
            time.sleep(POLL_S)
        started = time.time()
        msg = json.loads(req.read_text())
        if msg.get("stop"):
            break
        code, closed, close_s = serve_point(msg, base_env, started)
        exits = not closed or code not in (common.EXIT_OK, common.EXIT_DIVERGED)
        # "exits": the controller must not hand this service another point (it waits for it to go instead)
        common.write_json_atomic(answer_path(inbox, a.id, k), {"code": code, "exits": exits})
        # threads: a point's gloo and store threads must be gone with its process groups (tests/test_warm.py)
        print(f"point {k}: exit {code} after {time.time() - started:.2f} s (process groups down in {close_s:.2f} s,"
              f" threads {settled_thread_count()})"
              if closed else f"point {k}: exit {code}, process groups did not come down", flush=True)
        if exits:
            break
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
