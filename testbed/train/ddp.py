"""Data parallel training: DistributedDataParallel over gloo, with a comm hook that counts what the wire did.

The hook allreduces each gradient bucket over the default process group (bound to the data interface, the
link that may be corrupted) and trains on that result. It also counts non-finite values sent and received
and, with a reference, allreduces a copy of the same bucket over the management group (a clean network) and
counts the elements whose bits differ: the gradient values that the data link corrupted. With a 16-bit wire
dtype the bucket crosses the link in that dtype (as torch's bf16/fp16 compression hooks do) and the reference
too, so the comparison is like with like. With guard sanitize the hook zeroes implausible received values.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from testbed.train import recipe
from testbed.train.data import eval_batches, get_batch
from testbed.train.model import logits_of
from testbed.train.recipe import nonfinite

_BITS = {4: torch.int32, 2: torch.int16}


def differing(a, b):
    """Number of elements whose bits differ (NaN == NaN with the same bits; -0.0 != 0.0). Fast path: equal."""
    a, b = a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])
    if torch.equal(a, b):
        return 0
    return int((a != b).sum())


class DDPTrainer:
    def __init__(self, model, args, data, rank, world_size, mgmt, debug, inject=None):
        self.args, self.data, self.rank, self.world_size = args, data, rank, world_size
        self.mgmt = mgmt  # raw ProcessGroupGloo on the management interface
        self.debug = debug  # DebugInjector
        self.inject = inject  # inject.ProcessInjector (injector process): the ring allreduce that corrupts per hop
        self.device = next(model.parameters()).device
        self.module = model
        # init_sync=False: every rank built the same parameters from the same seed, so DDP's setup broadcast
        # is skipped and the only traffic on the data link is the gradient allreduce the hook accounts for.
        # gradient_as_bucket_view: gradients live in the buckets the hook allreduces (no copy in or out)
        self.model = DistributedDataParallel(model, init_sync=False, forward_sync_buffers=False,
                                             gradient_as_bucket_view=True)
        self.model.register_comm_hook(state=None, hook=self._comm_hook)
        self.opt = recipe.make_optimizer(model.parameters(), args)
        self.wire_dtype = recipe.WIRE_DTYPES[args.wire_dtype]
        self.step = 0
        self.stats = {}
        self.clean = {}  # bucket index -> reference buffer
        self.comm_log = []

    def named_parameters(self):
        return list(self.module.named_parameters())

    def _comm_hook(self, state, bucket):
        buf = bucket.buffer()  # flat fp32 gradients of this bucket (the parameters' .grad are views into it)
        buf.div_(self.world_size)  # DDP's default hook averages the same way: divide, then sum
        wire = buf.to(self.wire_dtype)  # buf itself for fp32
        st, a = self.stats, self.args
        st["nonfinite_sent"] += nonfinite(wire)  # fp16 overflows above 65504
        st["allreduce_elements"] += wire.numel()
        st["wire_bytes"] += wire.numel() * wire.element_size()
        clean = None
        if a.reference:  # one persistent copy per bucket: no 500 MB allocation per step
            clean = self.clean.get(bucket.index())
            if clean is None or clean.numel() != wire.numel() or clean.dtype != wire.dtype:
                clean = self.clean[bucket.index()] = torch.empty_like(wire)
            clean.copy_(wire)
        t0 = time.perf_counter()
        # Synchronous on purpose: the result must be known here to count and compare it (no overlap with
        # backward of later buckets; comm_time_s is exactly the time spent waiting for the data link).
        if self.inject is not None:
            self.inject.allreduce(wire)
        else:
            dist.all_reduce(wire)
        dt = time.perf_counter() - t0
        st["comm_time_s"] += dt
        # per bucket, for --monitor (testbed/locate): what each collective moved and how long it took
        self.comm_log.append({"op": "allreduce", "bucket": bucket.index(),
                              "bytes": wire.numel() * wire.element_size(), "time_s": dt})
        if bucket.index() == 0:
            self.debug.corrupt(wire, self.step)  # test hook: simulate a corrupted value arriving from the wire
        st["nonfinite_received"] += nonfinite(wire)
        if clean is not None:
            t0 = time.perf_counter()
            if self.inject is not None:  # the same ring, clean: the same summation order, so like with like
                self.inject.allreduce(clean, self.mgmt, corrupt=False)
            else:
                self.mgmt.allreduce([clean]).wait()
            st["reference_time_s"] += time.perf_counter() - t0
            # compare bits, not values: NaN != NaN and -0.0 == 0.0 would both mislead
            st["corrupted_values"] += differing(wire, clean)
        if wire is not buf:
            buf.copy_(wire)  # back to fp32, into the parameters' gradients
        if a.guard == "sanitize":
            clean_buf, n = recipe.sanitize(buf, a.sanitize_threshold)
            if n:
                buf.copy_(clean_buf)
            st["sanitized"] += n
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def train_step(self, step):
        self.step = step
        self.comm_log = []
        self.stats = {"nonfinite_sent": 0, "nonfinite_received": 0, "allreduce_elements": 0, "wire_bytes": 0,
                      "sanitized": 0, "comm_time_s": 0.0, "reference_time_s": 0.0,
                      "corrupted_values": 0 if self.args.reference else None}
        a = self.args
        x, y = recipe.perturb_order(*get_batch(self.data.train, a.batch_size, a.seq_len, a.seed, step, self.rank),
                                    a.perturb)
        x, y = x.to(self.device), y.to(self.device)
        loss = F.cross_entropy(logits_of(self.model, x).flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # runs the comm hook once per bucket
        params = [p for p in self.module.parameters() if p.grad is not None]
        self.perturbed = None
        if a.perturb == "lsb":  # the allreduced gradient, every replica alike (as a reduce-scatter hit)
            self.perturbed = recipe.perturb_lsb_(params, step)
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # this replica's, before clipping
        grad_norm, loss_local = float(total_norm), float(loss.detach())
        # Every rank reports the mean loss over ranks and whether any rank saw a non-finite loss or gradient,
        # agreed over the clean management network, so that all replicas skip (or take) the update together.
        bad = not (math.isfinite(grad_norm) and math.isfinite(loss_local))
        t = torch.tensor([loss_local, float(bad)], dtype=torch.float64)
        self.mgmt.allreduce([t]).wait()
        skipped = bool(t[1] > 0) and a.guard != "none"  # none: apply whatever the update holds
        lr = recipe.lr_at(step, a)
        if not skipped:
            recipe.clip_(params, a, total_norm)
            recipe.set_lr(self.opt, lr)
            self.opt.step()
        if a.perturb == "weight-lsb":  # one parameter value, after the update
            self.perturbed = recipe.perturb_lsb_(params, step, "weight")
        if a.resync_every and (step + 1) % a.resync_every == 0:
            self.resync()
        return {"loss": float(t[0]) / self.world_size, "loss_local": loss_local, "grad_norm": grad_norm,
                "skipped": skipped, "lr": lr, "perturbed": self.perturbed, **self.stats}

    @torch.no_grad()
    def resync(self):
        """Every replica takes rank 0's parameters and optimizer state (moments, step counts), sent over the
        management network, which corrupts nothing: after it the replicas are bit for bit alike."""
        params = [p for group in self.opt.param_groups for p in group["params"]]  # the same order on every rank
        tensors = params + [v for p in params for _, v in sorted(self.opt.state.get(p, {}).items())
                            if torch.is_tensor(v)]
        for t in tensors:
            self.mgmt.broadcast([t], dist.BroadcastOptions()).wait()  # root 0 by default

    def frozen_values(self):
        return recipe.frozen_values(self.opt)

    def all_finite(self, value):
        """Whether `value` is finite on every rank (agreed over the management network), so that all ranks
        stop together when one replica's eval loss is NaN."""
        t = torch.tensor([0.0 if math.isfinite(value) else 1.0])
        self.mgmt.allreduce([t]).wait()
        return float(t) == 0.0

    @torch.no_grad()
    def eval_loss(self):
        """This replica's loss on fixed validation batches (not averaged: replicas may have diverged)."""
        losses = []
        for x, y in eval_batches(self.data.val, self.args):
            x, y = x.to(self.device), y.to(self.device)
            losses.append(float(F.cross_entropy(logits_of(self.module, x).flatten(0, 1), y.flatten())))
        return sum(losses) / len(losses)
