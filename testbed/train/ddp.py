"""Data parallel training: DistributedDataParallel over gloo, with a comm hook that counts what the wire did.

The hook allreduces each gradient bucket over the default process group (bound to the data interface, the
link that may be corrupted) and trains on that result. It also counts non-finite values sent and received
and, with a reference, allreduces a copy of the same bucket over the management group (a clean network) and
counts the elements whose bits differ: the gradient values that the data link corrupted.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from testbed.train.data import get_batch, get_eval_batch
from testbed.train.model import logits_of


def nonfinite(t):
    """Number of NaN/Inf values. A sum is ~100x faster than isfinite() on 124M values and is finite whenever
    all values are (unless finite values overflow it): count exactly only when it is not."""
    if torch.isfinite(t.sum()):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def differing(a, b):
    """Number of elements whose bits differ (NaN == NaN with the same bits; -0.0 != 0.0). Fast path: equal."""
    a, b = a.view(torch.int32), b.view(torch.int32)
    if torch.equal(a, b):
        return 0
    return int((a != b).sum())


def make_adamw(params, lr):
    """AdamW as in nanoGPT: weight decay on matrices only, betas (0.9, 0.95)."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def clip_or_measure(params, grad_clip):
    """Global gradient norm (before clipping); clips to grad_clip when > 0."""
    params = [p for p in params if p.grad is not None]
    if grad_clip > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    return float(torch.nn.utils.get_total_norm([p.grad for p in params]))


class DDPTrainer:
    def __init__(self, model, args, data, rank, world_size, mgmt, debug):
        self.args, self.data, self.rank, self.world_size = args, data, rank, world_size
        self.mgmt = mgmt  # raw ProcessGroupGloo on the management interface
        self.debug = debug  # DebugInjector
        self.module = model
        # init_sync=False: every rank built the same parameters from the same seed, so DDP's setup broadcast
        # is skipped and the only traffic on the data link is the gradient allreduce the hook accounts for.
        # gradient_as_bucket_view: gradients live in the buckets the hook allreduces (no copy in or out)
        self.model = DistributedDataParallel(model, init_sync=False, forward_sync_buffers=False,
                                             gradient_as_bucket_view=True)
        self.model.register_comm_hook(state=None, hook=self._comm_hook)
        self.opt = make_adamw(model.parameters(), args.lr)
        self.step = 0
        self.stats = {}
        self.clean = {}  # bucket index -> reference buffer

    def named_parameters(self):
        return list(self.module.named_parameters())

    def _comm_hook(self, state, bucket):
        buf = bucket.buffer()  # flat fp32 gradients of this bucket (the parameters' .grad are views into it)
        buf.div_(self.world_size)  # DDP's default hook averages the same way: divide, then sum
        st = self.stats
        st["nonfinite_sent"] += nonfinite(buf)
        st["allreduce_elements"] += buf.numel()
        clean = None
        if self.args.reference:  # one persistent copy per bucket: no 500 MB allocation per step
            clean = self.clean.get(bucket.index())
            if clean is None or clean.numel() != buf.numel():
                clean = self.clean[bucket.index()] = torch.empty_like(buf)
            clean.copy_(buf)
        t0 = time.perf_counter()
        # Synchronous on purpose: the result must be known here to count and compare it (no overlap with
        # backward of later buckets; comm_time_s is exactly the time spent waiting for the data link).
        dist.all_reduce(buf)
        st["comm_time_s"] += time.perf_counter() - t0
        if bucket.index() == 0:
            self.debug.corrupt(buf, self.step)  # test hook: simulate a corrupted value arriving from the wire
        st["nonfinite_received"] += nonfinite(buf)
        if clean is not None:
            t0 = time.perf_counter()
            self.mgmt.allreduce([clean]).wait()
            st["reference_time_s"] += time.perf_counter() - t0
            # compare bits, not values: NaN != NaN and -0.0 == 0.0 would both mislead
            st["corrupted_values"] += differing(buf, clean)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def train_step(self, step):
        self.step = step
        self.stats = {"nonfinite_sent": 0, "nonfinite_received": 0, "allreduce_elements": 0, "comm_time_s": 0.0,
                      "reference_time_s": 0.0, "corrupted_values": 0 if self.args.reference else None}
        a = self.args
        x, y = get_batch(self.data.train, a.batch_size, a.seq_len, a.seed, step, self.rank)
        loss = F.cross_entropy(logits_of(self.model, x).flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # runs the comm hook once per bucket
        grad_norm = clip_or_measure(self.module.parameters(), a.grad_clip)
        loss_local = float(loss.detach())
        # Every rank reports the mean loss over ranks and whether any rank saw a non-finite loss or gradient,
        # agreed over the clean management network, so that all replicas skip (or take) the update together.
        bad = not (math.isfinite(grad_norm) and math.isfinite(loss_local))
        t = torch.tensor([loss_local, float(bad)], dtype=torch.float64)
        self.mgmt.allreduce([t]).wait()
        skipped = bool(t[1] > 0)
        if not skipped:
            self.opt.step()
        return {"loss": float(t[0]) / self.world_size, "loss_local": loss_local, "grad_norm": grad_norm,
                "skipped": skipped, **self.stats}

    def all_finite(self, value):
        """Whether `value` is finite on every rank (agreed over the management network), so that all ranks
        stop together when one replica's eval loss is NaN."""
        t = torch.tensor([0.0 if math.isfinite(value) else 1.0])
        self.mgmt.allreduce([t]).wait()
        return float(t) == 0.0

    @torch.no_grad()
    def eval_loss(self):
        """This replica's loss on fixed validation batches (not averaged: replicas may have diverged)."""
        a = self.args
        losses = []
        for i in range(a.eval_batches):
            x, y = get_eval_batch(self.data.val, a.batch_size, a.seq_len, i)
            losses.append(float(F.cross_entropy(logits_of(self.module, x).flatten(0, 1), y.flatten())))
        return sum(losses) / len(losses)
