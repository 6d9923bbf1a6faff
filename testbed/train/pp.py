"""Pipeline parallel training: one GPT-2 stage per rank, torch.distributed.pipelining (GPipe or 1F1B) over gloo.

Activations (forward) and their gradients (backward) cross the data link between neighbouring stages, in the
wire dtype (stages.WireCast). The stage counts the non-finite values it receives: activations entering stages
> 0 (a forward pre-hook) and gradients arriving at the outputs of stages < last (a tensor hook); with guard
sanitize the same hooks zero implausible values before the stage uses them. The loss exists on the last stage
only; it is broadcast to every rank over the management group, as is the global gradient norm used for
clipping, so that only pipeline traffic travels on the (possibly corrupted) data link.
"""

import math
import time
import zlib

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import schedules as _schedules

from testbed.train import recipe
from testbed.train.data import eval_batches, get_batch
from testbed.train.recipe import nonfinite
from testbed.train.stages import WireCast, split_stages

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

# Time spent waiting for pipeline send/recv. The schedules wait on their P2P work through this module-level
# function; wrapping it is the one place that sees every wait (a private name: if it disappears, comm time
# is reported as null rather than wrong). Each wait is one batch of p2p operations (a microbatch's sends and
# receives at this stage): for --monitor its time and operation count are logged too.
_p2p_wait = {"seconds": 0.0, "hooked": False, "log": []}
if hasattr(_schedules, "_wait_batch_p2p"):
    _orig_wait = _schedules._wait_batch_p2p

    def _timed_wait(work):
        t0 = time.perf_counter()
        try:
            return _orig_wait(work)
        finally:
            dt = time.perf_counter() - t0
            _p2p_wait["seconds"] += dt
            _p2p_wait["log"].append((dt, len(work) if isinstance(work, (list, tuple)) else 1))

    _schedules._wait_batch_p2p = _timed_wait
    _p2p_wait["hooked"] = True


def crc32(t):
    """crc32 of a tensor's bytes (any dtype, bf16 included)."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class PPTrainer:
    def __init__(self, model, args, data, rank, world_size, mgmt, debug, eval_group=None, inject=None):
        if args.batch_size % args.microbatches:
            raise ValueError(f"--batch-size {args.batch_size} is not a multiple of --microbatches {args.microbatches}")
        self.args, self.data, self.rank, self.world_size = args, data, rank, world_size
        self.mgmt, self.debug = mgmt, debug
        self.inject = inject  # inject.ProcessInjector (injector process): flips what each stage boundary delivers
        self.first, self.last = rank == 0, rank == world_size - 1
        cfg = model.config
        self.module = split_stages(model, world_size)[rank]  # the other stages' tensors are freed with `model`
        # what the data link carries: hidden states in the wire dtype (this stage computes in fp32)
        dtype = recipe.WIRE_DTYPES[args.wire_dtype]
        self.wire = WireCast(self.module, dtype)
        mb, T = args.batch_size // args.microbatches, args.seq_len

        def examples(dtype):
            # Static shapes: no pickled metadata goes over the data link before the first step (torch still
            # exchanges a 4-byte static/dynamic vote per neighbour once). requires_grad on hidden states tells
            # the stages that gradients flow back across the link (in the same dtype).
            x = (torch.zeros(mb, T, dtype=torch.long) if self.first
                 else torch.zeros(mb, T, cfg.n_embd, dtype=dtype, requires_grad=True))
            out = (torch.zeros(mb, T, cfg.vocab_size, requires_grad=True) if self.last
                   else torch.zeros(mb, T, cfg.n_embd, dtype=dtype, requires_grad=True))
            return x, out

        example_in, example_out = examples(dtype)
        self.boundary_bytes = mb * T * cfg.n_embd * torch.empty((), dtype=dtype).element_size()
        self.comm_log = []
        self.stage = PipelineStage(self.wire, rank, world_size, torch.device("cpu"),
                                   input_args=example_in, output_args=example_out)
        self.schedule = SCHEDULES[args.schedule](self.stage, args.microbatches, loss_fn=lm_loss)
        # Evaluation runs the same stages over the management network (eval_group), in fp32: it measures the
        # model, not the link. Without such a group (tests on loopback) it shares the training pipeline.
        self.eval_schedule = self.schedule
        if eval_group is not None:
            eval_in, eval_out = examples(torch.float32)
            eval_stage = PipelineStage(self.module, rank, world_size, torch.device("cpu"), input_args=eval_in,
                                       output_args=eval_out, group=eval_group)
            self.eval_schedule = ScheduleGPipe(eval_stage, args.microbatches, loss_fn=lm_loss)
        self.opt = recipe.make_optimizer(self.module.parameters(), args)
        self.counting, self.step = False, 0
        self.stats = {}
        # --monitor (testbed/locate): crc32 of every activation and gradient each boundary sent and received,
        # compared over the management network after the step (boundary_log): names the hop that changed data
        self.checksums = bool(getattr(args, "monitor", False))
        self.crcs, self.boundary_log = {}, []
        if not self.first:
            self.wire.register_forward_pre_hook(self._on_activations)
        if not self.last:
            self.wire.register_forward_hook(self._on_output)

    def named_parameters(self):
        return list(self.module.named_parameters())

    def _received(self, t, key):
        """Count a tensor received from the data link; sanitize it (guard sanitize). Returns the tensor to use."""
        st, a = self.stats, self.args
        st[key] += nonfinite(t)
        st["received_elements"] += t.numel()
        st["wire_bytes"] += t.numel() * t.element_size()
        if a.guard == "sanitize":
            t, n = recipe.sanitize(t, a.sanitize_threshold)
            st["sanitized"] += n
        return t

    def _on_activations(self, module, inputs):
        x = inputs[0]  # the activation buffer just received from the previous stage
        if self.counting:
            with torch.no_grad():
                self.debug.corrupt(x, self.step)
                if self.inject is not None:
                    self.inject.corrupt_received(x, self.rank - 1)  # hop s-1 -> s
                if self.checksums:
                    self.crcs["fwd_recv"].append(crc32(x))
                    # what this stage sends back to s-1 in the backward pass; the pipeline reuses its receive
                    # buffers from step to step, so the hook is registered once per buffer
                    if x.requires_grad and not getattr(x, "_testbed_crc_hook", False):
                        x.register_hook(self._on_input_grad)
                        x._testbed_crc_hook = True
                clean = self._received(x, "nonfinite_activations")
                if clean is not x:
                    x.copy_(clean)  # in place: the pipeline holds this leaf for the backward pass

    def _on_output(self, module, inputs, output):
        if self.counting and self.checksums:
            self.crcs["fwd_sent"].append(crc32(output))  # the activations sent to s+1
        if self.counting and output.requires_grad:
            output.register_hook(self._on_output_grad)

    def _on_input_grad(self, grad):
        if self.counting:
            self.crcs["bwd_sent"].append(crc32(grad))  # the gradient sent to s-1

    def _on_output_grad(self, grad):
        # the gradient of this stage's output, just received from the next stage
        if self.debug.active:  # test hook, on a copy: a tensor hook must not change its argument
            grad = grad.clone()
            self.debug.corrupt(grad, self.step)
        if self.inject is not None:  # hop s+1 -> s; a copy, as above
            grad = grad.clone()
            self.inject.corrupt_received(grad, self.rank + 1)
        if self.checksums:
            self.crcs["bwd_recv"].append(crc32(grad))
        return self._received(grad, "nonfinite_gradients")

    def _compare_boundaries(self):
        """Each boundary's sent crc32s to everyone (management network, one int64 allreduce); the receiver
        compares them with what it received, as multisets (the order of microbatches is the schedule's)."""
        w, m, r = self.world_size, self.args.microbatches, self.rank
        sent = torch.zeros(w, 2, m, dtype=torch.int64)
        for i, key in enumerate(("fwd_sent", "bwd_sent")):
            v = self.crcs[key][:m]
            sent[r, i, :len(v)] = torch.tensor(v, dtype=torch.int64)
        self.mgmt.allreduce([sent]).wait()
        log = []
        for src, i, key, what in ((r - 1, 0, "fwd_recv", "activations"), (r + 1, 1, "bwd_recv", "gradients")):
            if 0 <= src < w:
                got = self.crcs[key]
                log.append({"src": src, "dst": r, "what": what, "microbatches": len(got),
                            "crc_ok": sorted(got) == sorted(int(x) for x in sent[src, i, :len(got)])
                            and len(got) == m})
        return log

    def _run(self, fn, x, y):
        """Call schedule.step/eval with the arguments this stage takes; returns the mean microbatch loss
        (last stage) or None."""
        losses = [] if self.last else None
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        fn(*args, **kwargs)
        return float(torch.stack(losses).detach().mean()) if self.last else None

    def _share_from_last(self, value):
        """The last stage's scalar, on every rank (management network)."""
        t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64)
        self.mgmt.broadcast(t, self.world_size - 1).wait()
        return float(t)

    def train_step(self, step):
        self.step = step
        self.stats = {"nonfinite_activations": 0, "nonfinite_gradients": 0, "received_elements": 0,
                      "wire_bytes": 0, "sanitized": 0}
        a = self.args
        # every stage draws the same global batch (data-parallel rank 0); stage 0 uses x, the last uses y
        x, y = recipe.perturb_order(*get_batch(self.data.train, a.batch_size, a.seq_len, a.seed, step, 0), a.perturb)
        self.opt.zero_grad(set_to_none=True)
        wait0, log0 = _p2p_wait["seconds"], len(_p2p_wait["log"])
        self.crcs = {k: [] for k in ("fwd_sent", "fwd_recv", "bwd_sent", "bwd_recv")}
        self.counting = True
        try:
            loss = self._run(self.schedule.step, x, y)  # gradients are averaged over microbatches
        finally:
            self.counting = False
        comm = _p2p_wait["seconds"] - wait0 if _p2p_wait["hooked"] else None
        # per transfer, for --monitor (testbed/locate): each p2p batch's time; bytes = its operations x the size
        # of a boundary tensor (every send and receive of a stage moves one microbatch's hidden states)
        waits = _p2p_wait["log"][log0:]
        del _p2p_wait["log"][:]
        self.comm_log = [{"op": "p2p", "transfer": i, "bytes": n * self.boundary_bytes, "time_s": dt}
                         for i, (dt, n) in enumerate(waits)]
        if self.checksums:
            self.boundary_log = self._compare_boundaries()
        # global gradient norm over all stages, agreed over the management network
        params = [p for p in self.module.parameters() if p.grad is not None]
        self.perturbed = None
        if a.perturb == "lsb" and self.first:  # one value of stage 0's gradients
            self.perturbed = recipe.perturb_lsb_(params, step)
        sq = torch.tensor([sum(float(p.grad.pow(2).sum()) for p in params)], dtype=torch.float64)
        self.mgmt.allreduce([sq]).wait()
        grad_norm = float(sq.sqrt())
        shared_loss = self._share_from_last(loss)
        # The norm and the loss are the same on every stage, so all stages skip (or take) the update together.
        skipped = not (math.isfinite(grad_norm) and math.isfinite(shared_loss)) and a.guard != "none"
        lr = recipe.lr_at(step, a)
        if not skipped:
            recipe.clip_(params, a, sq.sqrt()[0])
            recipe.set_lr(self.opt, lr)
            self.opt.step()
        if a.perturb == "weight-lsb" and self.first:  # one parameter value, after the update
            self.perturbed = recipe.perturb_lsb_(params, step, "weight")
        s = self.stats
        return {"loss": shared_loss, "loss_local": loss, "grad_norm": grad_norm, "skipped": skipped, "lr": lr,
                "perturbed": self.perturbed,
                "comm_time_s": comm, "nonfinite_received": s["nonfinite_activations"] + s["nonfinite_gradients"],
                **s}

    def frozen_values(self):
        return recipe.frozen_values(self.opt)

    def all_finite(self, value):
        return math.isfinite(value)  # losses are broadcast from the last stage: the same on every rank

    @torch.no_grad()
    def eval_loss(self):
        losses = [self._run(self.eval_schedule.eval, x, y) for x, y in eval_batches(self.data.val, self.args)]
        return self._share_from_last(sum(losses) / len(losses) if self.last else None)
