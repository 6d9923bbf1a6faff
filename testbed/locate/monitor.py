"""The worker's side of fault localisation (`--monitor`): what a C4-like agent would see from each rank.

After every training step (outside `step_time_s`), each rank:
  1. probes its ring neighbours over the data link: a PROBE_BYTES tensor of fp32 values (seeded, gradient-like
     magnitudes) sent with isend to rank r+1 while receiving from r-1, then the same towards r-1 (one phase for
     two ranks). Each phase starts right after a barrier on the management network, so the receiver's wait is
     the hop's transfer time (plus the barrier's skew, ~0.1 ms). In a ring allreduce every rank waits for the
     slowest hop, so collective times alone are homogeneous and cannot name a link; a per-hop probe can.
  2. exchanges the crc32 of what it sent over the management network (one int64 allreduce) and compares the
     crc32 of what it received: a mismatch names the hop whose data changed on the way (delivered errors).
  3. reads its host's TCP counters (/proc/net/snmp, /proc/net/netstat of its network namespace): RetransSegs
     and InCsumErrors, what a host's NIC/stack counters would show.
  4. sends the step's record (1-3) to rank 0 over the management network (two allgathers), as an agent reports
     to a collector: rank 0 appends every rank's record of the step to RUN_DIR/monitor-ranks.jsonl
     (docs/locate.md), which `testbed locate` reads. Nothing of it crosses a data link; when rank 0 runs on
     another machine its file is mirrored like its metrics (over SSH, the management underlay).

Under `scope: tensor` the engines corrupt the probe only if `p2p` is among the corrupted collectives;
`testbed train --monitor` adds it (testbed/experiments/training.py).
"""

import json
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from testbed.fileio import append_jsonl
from testbed.locate.detectors import RANKS_FILE  # {"step", "ranks": [record of rank 0, 1, ...]} per line
from testbed.locate.paths import phases

PROBE_BYTES = 64 * 1024  # 524,288 bits: at BER 1e-5 ~5 flips per hop and step, P(no flip) ~ e^-5
PROBE_TAG = 0x7E57  # p2p tag of the probe (gloo slot = tag, top byte 0: what the engines call p2p)
TCP_FIELDS = ("RetransSegs", "InCsumErrors", "InErrs", "InSegs", "OutSegs")
TCPEXT_FIELDS = ("TCPTimeouts", "TCPLostRetransmit", "TCPFastRetrans")


def _table(path, prefix, fields):
    """Named counters of one protocol from a /proc/net/{snmp,netstat} file (header line, then values)."""
    try:
        lines = [ln.split() for ln in open(path).read().splitlines() if ln.startswith(prefix + ":")]
    except OSError:
        return {}
    for head, vals in zip(lines[::2], lines[1::2]):
        row = dict(zip(head[1:], vals[1:]))
        return {f: int(row[f]) for f in fields if f in row}
    return {}


def tcp_counters():
    """This network namespace's TCP counters (cumulative since the namespace was made)."""
    return {**_table("/proc/net/snmp", "Tcp", TCP_FIELDS), **_table("/proc/net/netstat", "TcpExt", TCPEXT_FIELDS)}


def probe_payload(seed, step, rank, offset, n):
    """The values rank `rank` sends in phase `offset` of `step`: fp32 of gradient-like size (engines at scope
    tensor see fp32 values, as in training)."""
    g = torch.Generator().manual_seed(hash((seed, step, rank, offset)) & 0x7FFFFFFF)
    return torch.randn(n, generator=g) * 0.01


def crc(t):
    return zlib.crc32(t.numpy().tobytes())


class Monitor:
    def __init__(self, rank, world_size, mgmt, seed, run_dir, probe_bytes=PROBE_BYTES):
        self.rank, self.world_size, self.mgmt, self.seed = rank, world_size, mgmt, seed
        self.path = Path(run_dir) / RANKS_FILE
        self.n = probe_bytes // 4
        self.recv = torch.empty(self.n)

    def _barrier(self):
        self.mgmt.allreduce([torch.zeros(1)]).wait()

    def probe(self, step):
        """One probe per ring hop into this rank: [{src, dst, bytes, time_s, crc_ok}]."""
        r, w = self.rank, self.world_size
        offs = phases(w)
        sent = torch.zeros(w, len(offs), dtype=torch.int64)
        hops = []
        for i, off in enumerate(offs):
            dst, src = (r + off) % w, (r - off) % w
            buf = probe_payload(self.seed, step, r, off, self.n)
            sent[r, i] = crc(buf)
            self._barrier()
            t0 = time.perf_counter()
            send = dist.isend(buf, dst, tag=PROBE_TAG)
            recv = dist.irecv(self.recv, src, tag=PROBE_TAG)
            recv.wait()
            hops.append({"src": src, "dst": r, "bytes": self.n * 4, "time_s": time.perf_counter() - t0,
                         "crc": crc(self.recv), "phase": i})
            send.wait()
        # every sender's crc32, over the clean management network; the receiver compares
        self.mgmt.allreduce([sent]).wait()
        for h in hops:
            h["crc_ok"] = h.pop("crc") == int(sent[h["src"], h.pop("phase")])
        return hops

    def gather(self, record):
        """Every rank's record, on rank 0 (None elsewhere): JSON bytes, padded to the longest, allgathered over
        the management group (gloo has no gather of unequal sizes)."""
        data = json.dumps(record).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.mgmt.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        n = max(int(x) for x in sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        self.mgmt.allgather([out], [buf]).wait()
        if self.rank != 0:
            return None
        return [json.loads(o[:int(k)].numpy().tobytes()) for o, k in zip(out, sizes)]

    def after_step(self, step, trainer, m):
        """Probe, record and report this step (rank 0 writes every rank's record). Returns this rank's record."""
        t0 = time.perf_counter()
        hops = self.probe(step)
        log = getattr(trainer, "comm_log", None)  # DDP: one entry per bucket allreduce; PP: per p2p batch
        if not log:
            log = [{"op": "allreduce" if m.get("allreduce_elements") is not None else "p2p",
                    "bytes": m.get("wire_bytes"), "time_s": m.get("comm_time_s")}]
        record = {"rank": self.rank, "probe": hops, "collectives": list(log), "tcp": tcp_counters(),
                  "boundaries": getattr(trainer, "boundary_log", None) or [],
                  "probe_time_s": time.perf_counter() - t0}
        ranks = self.gather(record)
        if ranks is not None:
            append_jsonl(self.path, {"step": step, "time": time.time(), "ranks": ranks})
        return record
