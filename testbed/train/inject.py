"""The process injector: the lossy link's error statistics applied inside the training processes.

`--injector process` runs the same DDP and PP trainers with the same world size as local processes on loopback
(no topology brought up, no engine) and corrupts tensors where the wire would:
  - DDP: the gradient allreduce is a ring over send/recv (`ring_allreduce`): reduce-scatter then allgather, one
    chunk per step and hop, as gloo's ring moves them. What rank r receives from its left neighbour r-1 takes
    flips from the hop (r-1 -> r)'s stream before it is added (reduce-scatter: the error reaches the reduced
    chunk, hence every rank) or stored and forwarded (allgather: the receiver and the ranks after it in the
    remaining allgather steps; one rank with 2 ranks). This is the replica divergence the wire shows.
  - PP: activations entering stage s (hop s-1 -> s) and gradients entering stage s (hop s+1 -> s), in the
    receiving stage's hooks, before the counters and the sanitizer see them.
Every hop is one link direction: its own stream, built by the engine's own model code
(testbed/engine/models.py: Bernoulli or Gilbert-Elliott, seeded by (link seed, run seed, hop)), over the bits of
the values in wire order (little-endian bytes, MSB first in each byte, as the engine numbers them), with the
engine's protected bits and residual decisions (testbed/engine/protect.py). The same seed gives the same flips.

Flips are applied as an XOR on an integer (byte) view of the tensor, on its device. On CUDA, Bernoulli gaps are
drawn on the device (torch geometric draws, the same distribution as the engine's numpy draws, not the same
numbers; tests check both against binomial bounds); Gilbert-Elliott positions come from the engine's numpy model.

The controller side (`testbed.experiments.training.train_process`) reads the topology only for its hosts (world size) and the corruption
settings of the link directions the hops map to; docs/injector.md.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from testbed.engine import models, protect
from testbed.vocab import TORCH_DTYPE_NAMES

TAG = 0x1A9E  # mixed into every hop's seed: the process injector's streams are not an engine's
_DTYPE_ELEMENT = {torch_name: name for name, torch_name in TORCH_DTYPE_NAMES.items()}


def inject_path(run_dir, rank):
    return Path(run_dir) / f"inject-rank{rank}.json"


# ---------------------------------------------------------------------------------------------------------------
# One hop's stream
# ---------------------------------------------------------------------------------------------------------------

class TorchBernoulli:
    """Bernoulli flips drawn on a torch device: gaps Geometric(ber) (torch's geometric_, >= 1), cumulated, in
    chunks sized to the request's expected flips; positions beyond the request carry over, so the stream does
    not depend on how it is cut into requests (as models.BernoulliModel)."""

    def __init__(self, ber, seed, device):
        import torch

        self.ber, self.device = float(ber), device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(int(seed))
        self.position = 0  # bits consumed
        self.last = -1  # absolute position of the last flip drawn
        self.buf = torch.empty(0, dtype=torch.int64, device=device)

    def flips(self, n_bits):
        import torch

        start, end = self.position, self.position + n_bits
        self.position = end
        parts = [self.buf]
        while self.last < end:
            expected = (end - self.last) * self.ber
            k = int(expected + 6 * math.sqrt(expected) + 16)
            gaps = torch.empty(k, dtype=torch.float64, device=self.device).geometric_(self.ber, generator=self.gen)
            pos = torch.cumsum(gaps.to(torch.int64), 0) + self.last
            parts.append(pos)
            self.last = int(pos[-1])
        buf = torch.cat(parts)
        n = int(torch.searchsorted(buf, torch.tensor([end], device=self.device)))
        self.buf = buf[n:]
        return buf[:n] - start


class Hop:
    """One link direction (src -> dst): its error stream, protected bits and counters."""

    def __init__(self, src, dst, ber, error_model=None, seed=0, run_seed=0, protect_bits=None, protected_ber=0.0,
                 element=None, draws="numpy", device="cpu"):
        self.src, self.dst, self.ber = int(src), int(dst), float(ber or 0.0)
        self.error_model = models.validate_error_model(error_model, self.ber)
        self.element, self.protect = element, protect.normalize_protect(protect_bits)
        self.protected_ber = float(protected_ber or 0.0)
        if self.protected_ber > self.ber:
            raise ValueError(f"hop {src}->{dst}: protected_ber {self.protected_ber:g} exceeds ber {self.ber:g}")
        key = (int(seed), int(run_seed), TAG, self.src, self.dst)
        self.model = None
        if self.ber > 0:
            if draws == "torch" and self.error_model["type"] == "bernoulli":
                torch_seed = int(models.make_rng(*key).integers(1 << 62))
                self.model = TorchBernoulli(self.ber, torch_seed, device)
            else:
                self.model = models.build_model(self.error_model, self.ber, *key)
        self.salt = protect.flow_salt(seed, run_seed, self.src.to_bytes(6, "big") + self.dst.to_bytes(6, "big"))
        self.layouts = {}
        self.position = 0  # bits of this hop's stream so far
        self.counts = dict.fromkeys(("bits_seen", "bits_flipped", "bits_protected", "flips_protected",
                                     "flips_sign", "flips_exponent", "flips_mantissa"), 0)

    def layout(self, t):
        element = _DTYPE_ELEMENT[str(t.dtype).removeprefix("torch.")]
        if self.protect and self.element and protect.ELEMENTS[self.element][0] != t.element_size():
            raise ValueError(f"hop {self.src}->{self.dst}: protect names bits of {self.element} values but the "
                             f"wire carries {element}: set element to the wire dtype")
        element = self.element if self.protect and self.element else element
        if element not in self.layouts:
            self.layouts[element] = protect.BitLayout(element, self.protect)
        return self.layouts[element]

    def corrupt(self, t):
        """Flip bits of `t` (contiguous, on any device) in place as this hop's link would; returns the flips."""
        import torch

        n_bits = t.numel() * t.element_size() * 8
        start = self.position
        self.position += n_bits
        c = self.counts
        c["bits_seen"] += n_bits
        lay = self.layout(t)
        if lay.any:
            c["bits_protected"] += lay.protected_bits(0, n_bits)  # the hop's stream starts at a value boundary
        if self.model is None:
            return 0
        pos = self.model.flips(n_bits)
        if isinstance(pos, np.ndarray):
            if not pos.size:
                return 0
            slots = pos & lay.mask
            if lay.any:  # flips on protected positions get through at protected_ber / ber (the engine's rule)
                prot = lay.protected[slots]
                keep = ~prot
                if prot.any() and self.protected_ber > 0:
                    keep[prot] = protect.residual_keep(self.salt, start + pos[prot], self.protected_ber / self.ber)
                c["flips_protected"] += int((prot & keep).sum())
                pos, slots = pos[keep], slots[keep]
            fields = np.bincount(lay.field[slots], minlength=3)
            pos = torch.from_numpy(np.ascontiguousarray(pos)).to(t.device)
        else:  # drawn on the device
            if not pos.numel():
                return 0
            slots = pos & lay.mask
            if lay.any:
                prot = torch.as_tensor(lay.protected, device=t.device)[slots]
                keep = ~prot
                if bool(prot.any()) and self.protected_ber > 0:
                    sel = (start + pos[prot]).cpu().numpy()
                    keep[prot] = torch.as_tensor(protect.residual_keep(self.salt, sel, self.protected_ber / self.ber),
                                                 device=t.device)
                c["flips_protected"] += int((prot & keep).sum())
                pos, slots = pos[keep], slots[keep]
            fields = torch.bincount(torch.as_tensor(lay.field, device=t.device).long()[slots], minlength=3).cpu().numpy()
        for name, n in zip(protect.FIELDS, fields.tolist()):
            c["flips_" + name] += n
        n = apply_flips(t, pos)
        c["bits_flipped"] += n
        return n


def apply_flips(t, pos):
    """XOR bits `pos` (int64 tensor on t's device, sorted, distinct; bit p is 0x80 >> (p & 7) of byte p >> 3, as
    the engine numbers them) into `t` in place, on an integer view. Returns how many."""
    import torch

    if not pos.numel():
        return 0
    b = t.view(-1).view(torch.uint8)
    byte = pos >> 3
    mask = torch.tensor(128, dtype=torch.int32, device=t.device) >> (pos & 7).to(torch.int32)
    # several flips in one byte: distinct bits, so their sum is their OR (and their XOR)
    uniq, inv = torch.unique_consecutive(byte, return_inverse=True)
    acc = torch.zeros(uniq.numel(), dtype=torch.int32, device=t.device).index_add_(0, inv, mask)
    b[uniq] = b[uniq] ^ acc.to(torch.uint8)
    return int(pos.numel())


# ---------------------------------------------------------------------------------------------------------------
# In the worker
# ---------------------------------------------------------------------------------------------------------------

def add_worker_arguments(p):
    """The worker's argument that carries the hops (set by train_process, not by users)."""
    p.add_argument("--inject-hops", metavar="JSON", default=None,
                   help="injector process: the link directions as JSON, [{src, dst, ber, error_model, seed, "
                        "protect, protected_ber, element}] (written by testbed train; not for users)")


def resolve_device(name):
    """torch.device for --device; a clear error where CUDA is asked for and absent."""
    import torch

    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is available here (torch "
                               f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); "
                               "use --device cpu")
        rank = int(os.environ.get("RANK", "0"))
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class ProcessInjector:
    """This rank's view of the process injector: the hops into it (it applies their flips to what it receives),
    the ring allreduce for DDP, the receive hooks' corruption for PP, and its counters."""

    def __init__(self, hops_json, rank, world_size, run_seed, run_dir, device):
        import torch.distributed as dist

        self.rank, self.world_size, self.run_dir, self.device = rank, world_size, run_dir, device
        draws = "torch" if device.type == "cuda" else "numpy"
        self.hops = {}
        for h in json.loads(hops_json or "[]"):
            if h["dst"] == rank:  # the receiver applies its incoming hops' flips
                self.hops[h["src"]] = Hop(h["src"], h["dst"], h.get("ber"), h.get("error_model"), h.get("seed", 0),
                                          run_seed, h.get("protect"), h.get("protected_ber"), h.get("element"),
                                          draws=draws, device=device)
        self.dist = dist
        self.step_seen = self.step_flipped = 0

    def _hop(self, src):
        return self.hops.get(src)

    def corrupt_received(self, t, src):
        """Corrupt a tensor just received from rank `src` (PP hooks); counts it."""
        hop = self._hop(src)
        if hop is None:
            return 0
        seen = hop.counts["bits_seen"]
        n = hop.corrupt(t)
        self.step_seen += hop.counts["bits_seen"] - seen
        self.step_flipped += n
        return n

    def allreduce(self, t, group=None, corrupt=True):
        """Sum `t` (contiguous, any shape) over all ranks in place, by a ring of send/recv over `group` (a
        ProcessGroup; default: the default group, the data link). With corrupt, every received chunk first takes
        the flips of the hop it crossed."""
        ring_allreduce(t, group or self.dist.distributed_c10d._get_default_group(), self.rank, self.world_size,
                       self.corrupt_received if corrupt else None)

    def take_step(self):
        """This rank's counters of the step just done (the metrics row's fields), then a fresh step."""
        out = {"injected_bits_seen": self.step_seen, "injected_bits_flipped": self.step_flipped}
        self.step_seen = self.step_flipped = 0
        self.save()
        return out

    def save(self):
        from testbed.train.common import write_json_atomic

        # every step (a rank that dies keeps what it counted), so without fsync: ~3 ms a step on a busy disk
        write_json_atomic(inject_path(self.run_dir, self.rank), {
            "rank": self.rank, "time": time.time(),
            "hops": [{"src": h.src, "dst": h.dst, "ber": h.ber, **h.counts} for h in self.hops.values()]}, fsync=False)


def ring_allreduce(t, group, rank, world, on_receive=None):
    """Ring allreduce of `t` in place over `group` (send/recv only): N-1 reduce-scatter steps, then N-1 allgather
    steps, each moving one of N chunks from every rank r to r+1. on_receive(chunk, src) sees every chunk as it
    arrives (before it is added or stored). A tensor on another device than the CPU is staged through host memory
    (gloo sends CPU tensors)."""
    import torch

    if world == 1:
        return t
    flat = t.view(-1)
    chunks = list(flat.tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world

    def exchange(send, recv_like):
        out = torch.empty(recv_like.shape, dtype=recv_like.dtype)
        works = [group.send([send.contiguous().cpu()], right, 0), group.recv([out], left, 0)]
        for w in works:
            w.wait()
        out = out.to(t.device)
        if on_receive is not None:
            on_receive(out, left)
        return out

    for k in range(world - 1):  # reduce-scatter: an error here is summed into the chunk every rank gets
        s, r = (rank - k) % world, (rank - k - 1) % world
        chunks[r].add_(exchange(chunks[s], chunks[r]))
    for k in range(world - 1):  # allgather: an error here reaches this rank and those it forwards the chunk to
        s, r = (rank + 1 - k) % world, (rank - k) % world
        chunks[r].copy_(exchange(chunks[s], chunks[r]))
    return t


# ---------------------------------------------------------------------------------------------------------------
# The hops of a topology, for the controller (testbed.experiments.training.train_process runs the workers)
# ---------------------------------------------------------------------------------------------------------------

def hop_pairs(mode, world):
    """The (src, dst) rank pairs whose traffic the process injector corrupts: DDP the ring r -> r+1, PP the
    stage boundaries both ways (activations forward, their gradients back)."""
    if mode == "ddp":
        return [(r, (r + 1) % world) for r in range(world)] if world > 1 else []
    return [p for s in range(world - 1) for p in ((s, s + 1), (s + 1, s))]


def hop_settings(topo, hosts, mode):
    """Each hop's corruption settings, from the link direction between its two hosts (a topology whose links
    were overridden like the wire's run). ValueError, naming the hosts, when two ranks share no direct link or a
    setting the process injector does not model is asked for."""
    direct = {}
    for link in topo.links:
        for _, a, b, imp in link.directions():
            direct[(a.node, b.node)] = (link.name, imp)
    out = []
    for src, dst in hop_pairs(mode, len(hosts)):
        key = (hosts[src], hosts[dst])
        if key not in direct:
            raise ValueError(f"injector process: {key[0]} and {key[1]} (ranks {src} and {dst}) share no direct link "
                             f"in {topo.name}; the wire would route over several links, which the process injector "
                             "does not model")
        name, imp = direct[key]
        if imp.ber:
            if imp.scope != "tensor":
                raise ValueError(f"injector process models scope tensor (corrupted tensor values); link {name} has "
                                 f"scope {imp.scope}")
            if imp.checksum != "fix":
                raise ValueError(f"injector process models delivered errors (checksum fix); link {name} has "
                                 f"checksum {imp.checksum}")
            if imp.error_model.get("type") == "profile":
                raise ValueError(f"injector process has no link profiles (codewords, dropped or replayed frames); "
                                 f"link {name} has profile {imp.error_model['profile']}: run it on the wire "
                                 f"(injector wire)")
        out.append({"src": src, "dst": dst, "link": name, "direction": f"{key[0]}->{key[1]}",
                    "ber": imp.ber or 0.0, "error_model": imp.error_model, "seed": imp.seed,
                    "element": imp.element, "protect": list(imp.protect) if imp.protect else None,
                    "protected_ber": imp.protected_ber})
    return out
