"""One training process: `python -m testbed.train.worker --mode ddp|pp --model tiny --steps N --out RUN_DIR`.

Distributed settings come from the environment:
  RANK, WORLD_SIZE            this process's rank and the number of workers
  MASTER_ADDR, MASTER_PORT    TCPStore rendezvous (rank 0 hosts it; put it on the clean management network)
  GLOO_SOCKET_IFNAME          interface of the default gloo group: the data link that may be corrupted
  TESTBED_MGMT_IFNAME         interface of the management gloo group: clean reference allreduce, loss, norms
  TESTBED_TORCH_THREADS       torch intra-op threads (default 1: several workers share a small host)

Writes into RUN_DIR: metrics-rank{R}.jsonl (one line per step), status-rank{R}.json, worker-rank{R}.err (on
failure), final-rank{R}.pt (parameters, for small models). Exit codes: see testbed/train/common.py.
"""

import argparse
import datetime
import faulthandler
import math
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from testbed.train import common, inject, settings
from testbed.train.common import append_jsonl, write_atomic, write_json_atomic
from testbed.train.data import prepare
from testbed.train.fingerprint import Fingerprinter
from testbed.train.model import PRESETS, build_model, seq_len_of

SAVE_FINAL_MAX_PARAMS = 50_000_000  # save final parameters by default below this size (tiny, small)


def build_parser():
    """The worker's CLI: every setting passed to workers (testbed/train/settings.py), --out and the test hooks."""
    p = argparse.ArgumentParser(prog="python -m testbed.train.worker", description=__doc__.split("\n")[0])
    settings.add_arguments(p, worker_only=True)
    p.add_argument("--out", required=True, help="run directory (shared by all ranks)")
    # test hooks: simulate what the wire could do, on one rank, inside the process (no network needed)
    p.add_argument("--debug-rank", type=int, default=-1, help="rank that applies --debug-* (default: the last)")
    p.add_argument("--debug-flip-step", type=int, default=None,
                   help="flip one bit of one received value (ddp: allreduce result, pp: activation; on stage 0 "
                        "a gradient) at this step")
    p.add_argument("--debug-flip-bit", type=int, default=0,
                   help="bit to flip, of the value in the wire dtype (fp32: 0 = mantissa LSB, 30 = exponent MSB; "
                        "bf16/fp16: 0-15, 14 = exponent MSB)")
    p.add_argument("--debug-nan-step", type=int, default=None, help="make one received value NaN at this step")
    inject.add_worker_arguments(p)
    return p


class DebugInjector:
    """Changes the largest element of a received tensor, once, at a chosen step, on one rank (test hook)."""

    def __init__(self, args, rank, world_size):
        self.flip_step, self.bit, self.nan_step = args.debug_flip_step, args.debug_flip_bit, args.debug_nan_step
        self.active = rank == (args.debug_rank % world_size) and (self.flip_step, self.nan_step) != (None, None)
        self.done = set()

    def corrupt(self, t, step):
        if not self.active or step in self.done or step not in (self.flip_step, self.nan_step):
            return
        self.done.add(step)
        flat = t.view(-1)
        i = int(flat.abs().argmax())  # the largest value: a flip there always changes the update
        if step == self.nan_step:
            flat[i] = float("nan")
            return
        width = 8 * t.element_size()  # 32 for fp32, 16 for bf16/fp16 on the wire
        if not 0 <= self.bit < width:
            raise ValueError(f"--debug-flip-bit {self.bit}: a {t.dtype} value has bits 0-{width - 1}")
        bits = {32: torch.int32, 16: torch.int16}[width]
        flat[i: i + 1].view(bits).bitwise_xor_(1 << self.bit if self.bit < width - 1 else -(1 << (width - 1)))


# torch's layers that act on bytes from the data link, the most specific first. When one of them raises while
# training, the likely cause is what it received: DDP's bucket layout, pipeline frames, gloo messages.
WIRE_LAYERS = (("/torch/distributed/pipelining/", "pipelining (torch.distributed.pipelining)"),
               ("/torch/nn/parallel/", "DDP (torch.nn.parallel)"),
               ("/torch/csrc/distributed/c10d/reducer", "DDP (torch.nn.parallel)"),
               ("/torch/distributed/", "the collective layer (torch.distributed)"),
               ("/torch/csrc/distributed/", "the collective layer (torch.distributed)"))


def _layer_of(path):
    return next((name for part, name in WIRE_LAYERS if part in path), None)


def wire_layer(exc):
    """The layer of WIRE_LAYERS that raised `exc`, or an exception it chains; None if none did.

    The traceback is read from where the exception was raised outwards, through torch's own frames, up to the
    first frame of a layer. A frame outside torch (the model, this package) ends the search: an
    exception raised by the model inside DDP's forward is not DDP's. C++ assertions name their source file in
    the message (torch/csrc/distributed/c10d/reducer.cpp): that counts as the innermost frame."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cpp = re.search(r"torch/csrc/distributed/\S+", str(exc))
        if cpp:
            return _layer_of("/" + cpp.group(0))
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            path = frame.filename.replace("\\", "/")
            if "/torch/" not in path:
                break
            if _layer_of(path):
                return _layer_of(path)
        exc = exc.__cause__ or exc.__context__
    return None


def classify(exc, phase):
    """(exit code, status, layer) for an exception raised in `phase` (data, connecting, training).

    Timeouts are `hung` and communication failures `crashed` wherever they happen. Any other exception raised
    inside DDP, pipelining or the collective layer while training is `crashed` too (exit 6): those layers act
    on bytes from the data link. The rest (preparing data, arguments, bugs) is `error`."""
    msg = f"{type(exc).__name__}: {exc}"
    if phase in ("starting", "data"):  # preparing the corpus on this host: nothing to do with the network
        return common.EXIT_ERROR, "error", None
    if re.search(r"timed? ?out|timeout", msg, re.I):
        return common.EXIT_TIMEOUT, "hung", None
    if isinstance(exc, dist.DistError) or re.search(r"gloo|connection|broken pipe|peer|socket|pair", msg, re.I):
        return common.EXIT_COMM_ERROR, "crashed", None
    layer = wire_layer(exc) if phase == "training" else None
    if layer:
        return common.EXIT_WIRE_LAYER, "crashed", layer
    return common.EXIT_ERROR, "error", None


def wait_for_listener(addr, port, timeout_s, poll_s=0.005):
    """Wait until something listens on addr:port (rank 0's TCPStore), at most timeout_s; then return, whatever
    happened (TCPStore reports a rendezvous that fails). TCPStore's client, when it finds no listener, backs off
    for 0.1-1 s before it tries again: a rank that came up a few ms before rank 0 (warm services get a point at
    the same moment) lost 0.3-0.6 s per point there."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(poll_s)


def process_start_time():
    """When this process started (unix time), from /proc: a fresh worker's time includes its imports."""
    try:  # field 22, start time: clock ticks since boot (CLOCK_BOOTTIME)
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Worker:
    def __init__(self, args, started=None):
        """`started`: when this rank's point began (a fresh worker: its process's start; default now)."""
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.master_port = int(os.environ.get("MASTER_PORT", "29500"))
        self.data_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        self.mgmt_ifname = os.environ.get("TESTBED_MGMT_IFNAME")
        self.run_dir = args.out
        self.mgmt = None
        self.mgmt_group = None
        self.trainer = None
        self.step = None
        self.phase = "starting"
        self.t_start = time.time()
        # the point's timeline (unix times of its phases, and seconds spent in the loop's parts), in the status
        # file: the launcher's phases_s (testbed/train/launch.py) come from every rank's
        self.times = {"started": started if started is not None else self.t_start,
                      "steps_s": 0.0, "eval_s": 0.0, "fingerprint_s": 0.0}

    # ---- bookkeeping ------------------------------------------------------------------------------------

    def write_status(self, state, status=None, exit_code=None, reason=None, **extra):
        self.phase = state
        self.times[state] = time.time()
        write_json_atomic(common.status_path(self.run_dir, self.rank), {
            "rank": self.rank, "world_size": self.world_size, "state": state, "status": status,
            "exit_code": exit_code, "reason": reason, "step": self.step, "pid": os.getpid(),
            "host": socket.gethostname(), "time": time.time(), "elapsed_s": time.time() - self.t_start,
            "times": self.times, **extra})

    def log(self, msg):
        print(f"[rank {self.rank} +{time.time() - self.t_start:.1f}s] {msg}", flush=True)

    # ---- setup ------------------------------------------------------------------------------------------

    def connect(self):
        """Default gloo group on the data interface (training traffic) + a management gloo group."""
        timeout = datetime.timedelta(seconds=self.args.timeout)
        if self.mgmt_ifname is None:
            if not self.master_addr.startswith("127.") and self.master_addr != "localhost":
                raise ValueError("TESTBED_MGMT_IFNAME is not set (the clean management interface)")
            self.mgmt_ifname = "lo"
        if self.data_ifname is None:
            self.log("warning: GLOO_SOCKET_IFNAME unset, gloo picks the interface of the host name")
        if self.rank != 0:  # (bounded: past it, TCPStore's own retries and timeout apply as before)
            wait_for_listener(self.master_addr, self.master_port, min(5.0, self.args.timeout))
        store = dist.TCPStore(self.master_addr, self.master_port, self.world_size, is_master=self.rank == 0,
                              timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        # gloo connects every pair eagerly in the constructor; this group's sockets are bound to the
        # management interface whatever GLOO_SOCKET_IFNAME says
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=self.mgmt_ifname)]
        opts._timeout = timeout
        opts._threads = 2
        self.mgmt = dist.ProcessGroupGloo(dist.PrefixStore("testbed-mgmt", store), self.rank, self.world_size, opts)
        if self.args.mode == "pp":
            # A registered group on the management interface for the pipeline's evaluation passes: eval measures
            # the model, so its activations must not cross the corrupted link. torch reads GLOO_SOCKET_IFNAME
            # when it constructs a gloo group, so point it at the management interface for this one group.
            saved = os.environ.get("GLOO_SOCKET_IFNAME")
            os.environ["GLOO_SOCKET_IFNAME"] = self.mgmt_ifname
            try:
                self.mgmt_group = dist.new_group(backend="gloo", timeout=timeout)
            finally:
                if saved is None:
                    os.environ.pop("GLOO_SOCKET_IFNAME", None)
                else:
                    os.environ["GLOO_SOCKET_IFNAME"] = saved

    # ---- the run ----------------------------------------------------------------------------------------

    def run(self):
        a = self.args
        os.makedirs(self.run_dir, exist_ok=True)
        common.metrics_path(self.run_dir, self.rank).unlink(missing_ok=True)
        common.err_path(self.run_dir, self.rank).unlink(missing_ok=True)
        self.write_status("data")
        a.seq_len = seq_len_of(a.model, a.seq_len)
        a.microbatches = a.microbatches or self.world_size
        data = prepare(PRESETS[a.model].vocab_size, a.data, log=self.log)
        self.write_status("connecting")
        self.connect()
        self.times["connected"] = time.time()
        self.log(f"connected: world {self.world_size}, data if {self.data_ifname}, mgmt if {self.mgmt_ifname}")
        device = inject.resolve_device(a.device)
        model = build_model(a.model, a.seed).to(device)
        debug = DebugInjector(a, self.rank, self.world_size)
        injector = (inject.ProcessInjector(a.inject_hops, self.rank, self.world_size, a.seed, self.run_dir, device)
                    if a.injector == "process" else None)
        if a.mode == "ddp":
            from testbed.train.ddp import DDPTrainer

            trainer = DDPTrainer(model, a, data, self.rank, self.world_size, self.mgmt, debug, inject=injector)
        else:
            from testbed.train.pp import PPTrainer

            trainer = PPTrainer(model, a, data, self.rank, self.world_size, self.mgmt, debug, self.mgmt_group,
                                inject=injector)
        del model
        self.trainer = trainer  # close() breaks its reference cycles
        monitor = None
        if a.monitor:  # fault localisation (testbed/locate): probes, per-bucket times, TCP counters per step
            from testbed.locate.monitor import Monitor

            monitor = Monitor(self.rank, self.world_size, self.mgmt, a.seed, self.run_dir)
        named = trainer.named_parameters()
        n_params = sum(p.numel() for _, p in named)
        # on a GPU the fingerprint reads a host copy of the parameters, refreshed before each one
        mirror = [p.detach().cpu() for _, p in named] if device.type != "cpu" else [p for _, p in named]
        fingerprint = Fingerprinter(mirror, a.fingerprint_sample)
        save_final = a.save_final if a.save_final is not None else n_params < SAVE_FINAL_MAX_PARAMS
        tokens_per_step = a.batch_size * a.seq_len * (self.world_size if a.mode == "ddp" else 1)
        self.write_status("training", n_params=n_params)
        self.log(f"{a.mode} {a.model}: {n_params:,} parameters on this rank, {a.steps} steps, "
                 f"batch {a.batch_size} x {a.seq_len}")

        # the fixed validation batches before the first update: what made_progress compares the last eval with
        t = time.perf_counter()
        initial_eval = trainer.eval_loss() if a.eval_every > 0 else None
        self.times["eval_s"] += time.perf_counter() - t
        skipped_in_a_row = 0
        for step in range(a.steps):
            self.step = step
            t0 = time.perf_counter()
            m = trainer.train_step(step)
            step_time = time.perf_counter() - t0
            self.times["steps_s"] += step_time
            if monitor:  # rank 0 writes every rank's record of the step (monitor-ranks.jsonl)
                monitor.after_step(step, trainer, m)
            if injector is not None:
                m.update(injector.take_step())
            eval_loss = None
            if a.eval_every > 0 and ((step + 1) % a.eval_every == 0 or step == a.steps - 1):
                t = time.perf_counter()
                eval_loss = trainer.eval_loss()
                self.times["eval_s"] += time.perf_counter() - t
            skipped_in_a_row = skipped_in_a_row + 1 if m["skipped"] else 0
            reason = self.divergence(trainer, m, eval_loss, skipped_in_a_row)
            # frozen: at every eval and at the end of the run (cheap, but not free for 124M)
            frozen = trainer.frozen_values() if eval_loss is not None or step == a.steps - 1 or reason else None
            t1 = time.perf_counter()
            if device.type != "cpu":
                for c, (_, p) in zip(mirror, named):
                    c.copy_(p.detach())
            fp = fingerprint(with_hash=a.fingerprint_every > 0 and (step % a.fingerprint_every == 0
                                                                     or step == a.steps - 1))
            row = {"step": step, "rank": self.rank, "world_size": self.world_size, "mode": a.mode,
                   "model": a.model, "seed": a.seed, "time": time.time(), "tokens": tokens_per_step,
                   "eval_loss": eval_loss, "initial_eval_loss": initial_eval if step == 0 else None,
                   "frozen": frozen, "step_time_s": step_time, "corrupted_values": None, **m, **fp,
                   "fingerprint_time_s": time.perf_counter() - t1}
            self.times["fingerprint_s"] += row["fingerprint_time_s"]
            append_jsonl(common.metrics_path(self.run_dir, self.rank), row)
            self.log(f"step {step + 1}/{a.steps} loss {m['loss']:.4f}"
                     + (f" eval {eval_loss:.4f}" if eval_loss is not None else "")
                     + f" nonfinite {m['nonfinite_received']} corrupted {m.get('corrupted_values')}"
                     + f" sanitized {m['sanitized']}" + (" skipped" if m["skipped"] else "")
                     + f" {step_time:.3f}s")
            if reason:
                self.write_status("done", "diverged", common.EXIT_DIVERGED, reason)
                return common.EXIT_DIVERGED

        if save_final:
            path = common.final_params_path(self.run_dir, self.rank)
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save({n: p.detach().clone() for n, p in named}, tmp)
            os.replace(tmp, path)
        self.write_status("done", "ok", common.EXIT_OK, None)
        return common.EXIT_OK

    def divergence(self, trainer, m, eval_loss, skipped_in_a_row):
        """Why the run ends as diverged after this step, or None. Every rank decides the same at the same step:
        the loss and the skip flag are agreed over the management network, and so is the eval check."""
        a, step = self.args, self.step
        if m["skipped"] and a.guard == "stop":
            return f"non-finite loss or gradient at step {step} (loss {m['loss']}, grad norm {m['grad_norm']})"
        if a.guard == "none" and not math.isfinite(m["loss"]):
            return f"non-finite loss at step {step} ({m['loss']}; guard none applied every update)"
        if a.max_skips and skipped_in_a_row > a.max_skips:
            return (f"{skipped_in_a_row} consecutive steps with a non-finite loss or gradient were skipped "
                    f"(up to step {step}; --max-skips {a.max_skips})")
        if eval_loss is not None and not trainer.all_finite(eval_loss):
            return f"non-finite eval loss at step {step} ({eval_loss}): the parameters are no longer finite"
        return None

    def run_safely(self):
        try:
            return self.run()
        except Exception as exc:
            code, status, layer = classify(exc, self.phase)
            where = f"step {self.step}" if self.step is not None else "setup"
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raised_in = f" in {layer}" if layer else ""
            reason = f"{status} at {where}: {type(exc).__name__}{raised_in}: {first_line}"
            write_atomic(common.err_path(self.run_dir, self.rank), reason + "\n\n" + traceback.format_exc())
            self.write_status("done", status, code, reason)
            self.log(reason)
            return code

    def close(self):
        """Destroy the process groups, bounded (a broken pair must not hang): whether that finished."""

        def teardown():
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
                self.mgmt = self.mgmt_group = None
                # DDP's reducer holds the comm hook, a bound method of the trainer: a cycle through C++ that the
                # collector cannot see, so without this the trainer, its model, its process groups and their gloo
                # threads (7 per point and rank) outlive the point in a warm service (testbed/train/serve.py)
                if self.trainer is not None:
                    vars(self.trainer).clear()
                    self.trainer = None
            except Exception as exc:  # the exit code already says what happened
                self.log(f"teardown: {exc}")

        t = threading.Thread(target=teardown, daemon=True)
        t.start()
        t.join(timeout=min(30.0, self.args.timeout))
        sys.stdout.flush()
        sys.stderr.flush()
        return not t.is_alive()

    def shutdown(self, code):
        """close(), then exit with `code` through os._exit, so that interpreter teardown of gloo cannot turn the
        exit code into an abort."""
        self.close()
        os._exit(code)


def parse(argv=None):
    """The worker's arguments, checked across settings (seq_len within the model's context, ...)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings.from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def keep_torch_caches() -> None:
    """torch's own caches (the inductor's, which torch makes in /tmp/torchinductor_USER on first use even
    without torch.compile) in this worker's cache: a worker writes nothing outside its run directory and the
    cache (docs/cluster.md, "Root, and points that need none").

    Called by a worker process's entry (main, testbed.train.serve) before torch._dynamo is imported, never at
    import: the variable is inherited by every child, so set on import it would send the processes of another
    user or machine (`runuser`, a Slurm job: sbatch exports the environment) to this user's cache. Set, not
    defaulted: a value inherited from a parent is that parent's (torch sets it in every process that imports
    torch._dynamo), not this worker's; move the cache with $TESTBED_CACHE."""
    from testbed.train.data import cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torchinductor")


def set_threads(args):
    torch.set_num_threads(max(1, args.threads or int(os.environ.get("TESTBED_TORCH_THREADS", "1"))))


def main(argv=None):
    faulthandler.enable()  # a gloo SIGABRT then leaves a Python traceback in the log
    args = parse(argv)
    keep_torch_caches()
    set_threads(args)
    worker = Worker(args, started=process_start_time())
    worker.shutdown(worker.run_safely())


if __name__ == "__main__":
    main()
