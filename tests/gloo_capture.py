"""Record real torch.distributed gloo TCP streams for the gloo stream tracker's tests.

Two network namespaces ``tbG-a`` (10.98.0.1/24) and ``tbG-b`` (10.98.0.2/24) are joined by a veth
(``tbG-va`` <-> ``tbG-vb``), both created with pyroute2 (nothing is created in, or changed on, the root
namespace). One torch gloo process runs in each namespace (``ip netns exec``), with
``GLOO_SOCKET_IFNAME`` set to its veth and the rendezvous (TCPStore) on ``10.98.0.1:MASTER_PORT``. They run
``SCRIPT``, a fixed list of collectives and point-to-point transfers whose tensor contents are known
(``op_values``). ``tcpdump -s 0`` records ``tbG-va`` while they run; the rendezvous connection is excluded by
the capture filter (``tcp and not port MASTER_PORT``). The pcap is read back with Scapy's ``rdpcap`` and split
into connections and directions (``Capture``).

Two recording modes:

- ``"tso"``: default veth offloads (TSO/GSO on, MTU 1500): segments of up to 64 KiB as the stack hands them
  over.
- ``"mtu1280"``: ``ethtool -K tso off gso off gro off`` on both veth ends, MTU 1280 and a tbf rate limit
  (``SMALL_MTU_RATE``): MSS-sized (1228-byte) segments. gloo writes each frame with one ``writev`` and TCP
  usually sends it at once, so frames mostly start segments; the asynchronous point-to-point burst at the end
  of ``SCRIPT`` is written while a large frame is still queued behind the rate limit, so TCP packs those
  frames into full segments and some 48-byte headers really straddle packets.

The session-scoped pytest fixture ``gloo_captures`` records both once per test session into a temporary
directory, returns ``{"tso": Capture, "mtu1280": Capture}``, and always removes the namespaces, the processes
it started and the files afterwards. Running this file with ``--record DIR`` records by hand (for debugging);
``--worker`` is the per-rank entry point used by the recorder itself.

Needs root, ``ip``, ``tc``, ``tcpdump`` and ``ethtool``; the fixture skips the tests when one is missing.
Recordings take ~4 s each; concurrent test sessions on one machine are serialised by a lock file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NS_A, NS_B = "tbG-a", "tbG-b"
IF_A, IF_B = "tbG-va", "tbG-vb"
IP_A, IP_B = "10.98.0.1", "10.98.0.2"
MASTER_PORT = 29517
RANK_OF_IP = {IP_A: 0, IP_B: 1}
WORLD_SIZE = 2
PG_TIMEOUT_S = 30
RUN_TIMEOUT_S = 120
SMALL_MTU_RATE = "200mbit"  # tbf rate of the "mtu1280" recording
LOCK_FILE = "/tmp/tbG-capture.lock"
ASYNC_PAUSE_S = 0.3  # between posting the irecvs and the isends of an asynchronous group

# The workload, in call order, identical on both ranks. Every entry is one torch.distributed call (send/recv
# pairs count as one entry). ``n`` is the number of float32 elements of each rank's input.
SCRIPT: list[dict] = [
    {"op": "barrier"},
    {"op": "allreduce", "n": 1000},
    {"op": "allreduce", "n": 65_536},
    {"op": "allreduce", "n": 400_000},  # 1.6 MB: gloo cuts it into several frames, TCP into many segments
    {"op": "broadcast", "n": 300_000, "root": 0},  # 1.2 MB
    {"op": "allgather", "n": 20_000},
    {"op": "sendrecv", "n": 300_000, "src": 0, "dst": 1, "tag": 7},  # 1.2 MB point-to-point
    {"op": "sendrecv", "n": 1000, "src": 1, "dst": 0, "tag": 0},
    {"op": "reduce_scatter", "n": 40_000},
    {"op": "alltoall", "n": 10_000},
    {"op": "barrier"},
]
# A burst of asynchronous point-to-point transfers of odd sizes in both directions: every irecv is posted
# first, then (after a pause that lets the receive-ready notifications arrive) every isend, a large one
# first. gloo writes the frames back to back while the large one is still queued behind the rate limit of
# the "mtu1280" recording, so TCP packs them into MSS-sized segments: frame headers land anywhere inside
# segments and straddle segment boundaries.
SCRIPT += [{"op": "sendrecv", "n": 262_147, "src": 0, "dst": 1, "tag": 99, "async": True}]
SCRIPT += [{"op": "sendrecv", "n": 100 + 29 * k, "src": 0, "dst": 1, "tag": 100 + k, "async": True}
           for k in range(48)]
SCRIPT += [{"op": "sendrecv", "n": 200_003, "src": 1, "dst": 0, "tag": 199, "async": True}]
SCRIPT += [{"op": "sendrecv", "n": 150 + 31 * k, "src": 1, "dst": 0, "tag": 200 + k, "async": True}
           for k in range(48)]
SCRIPT += [{"op": "barrier"}]


def op_values(index: int, rank: int) -> np.ndarray:
    """The float32 input of ``rank`` for ``SCRIPT[index]``: ``4*i + rank + 1``.

    All values are integers below 2**24, so float32 sums are exact. A sum over both ranks is ``8*i + 3``.
    Inputs of rank 0 are 1 mod 4, of rank 1 2 mod 4, and sums 3 mod 8: a payload slice tells which it is.
    """
    n = SCRIPT[index]["n"]
    return (np.arange(n, dtype=np.float64) * 4 + rank + 1).astype(np.float32)


def op_sum(index: int) -> np.ndarray:
    """Element-wise sum of both ranks' inputs of ``SCRIPT[index]`` (``8*i + 3``)."""
    return sum(op_values(index, r) for r in range(WORLD_SIZE)).astype(np.float32)


# --------------------------------------------------------------------------------------------------------------
# Worker (runs inside a namespace)
# --------------------------------------------------------------------------------------------------------------


def _worker(rank: int, out_path: str) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{IP_A}:{MASTER_PORT}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    results = []
    group_start = None  # first entry of the current asynchronous group
    try:
        for i, step in enumerate(SCRIPT):
            op = step["op"]
            if step.get("async"):
                if group_start is None:
                    group_start = i
                if i + 1 < len(SCRIPT) and SCRIPT[i + 1].get("async"):
                    continue  # run the group at its last entry
                group = range(group_start, i + 1)
                group_start = None
                recvs = {}
                for j in group:
                    st = SCRIPT[j]
                    if rank == st["dst"]:
                        y = torch.empty(st["n"])
                        recvs[j] = (dist.irecv(y, src=st["src"], tag=st["tag"]), y)
                time.sleep(ASYNC_PAUSE_S)
                sends = []
                for j in group:
                    st = SCRIPT[j]
                    if rank == st["src"]:
                        x = torch.from_numpy(op_values(j, rank).copy())
                        sends.append((dist.isend(x, dst=st["dst"], tag=st["tag"]), x))
                for work, _x in sends:
                    work.wait()
                for j in group:
                    st = SCRIPT[j]
                    ok = True
                    if j in recvs:
                        recvs[j][0].wait()
                        ok = bool(np.array_equal(recvs[j][1].numpy(), op_values(j, st["src"])))
                    results.append({"op": st["op"], "ok": ok})
                continue
            if op == "barrier":
                dist.barrier()
                results.append({"op": op, "ok": True})
                continue
            x = torch.from_numpy(op_values(i, rank).copy())
            if op == "allreduce":
                dist.all_reduce(x)
                ok = bool(np.array_equal(x.numpy(), op_sum(i)))
            elif op == "broadcast":
                dist.broadcast(x, src=step["root"])
                ok = bool(np.array_equal(x.numpy(), op_values(i, step["root"])))
            elif op == "allgather":
                outs = [torch.empty_like(x) for _ in range(WORLD_SIZE)]
                dist.all_gather(outs, x)
                ok = all(np.array_equal(o.numpy(), op_values(i, r)) for r, o in enumerate(outs))
            elif op == "sendrecv":
                if rank == step["src"]:
                    dist.send(x, dst=step["dst"], tag=step["tag"])
                    ok = True
                else:
                    y = torch.empty_like(x)
                    dist.recv(y, src=step["src"], tag=step["tag"])
                    ok = bool(np.array_equal(y.numpy(), op_values(i, step["src"])))
            elif op == "reduce_scatter":
                n = step["n"]
                out = torch.empty(n // WORLD_SIZE)
                dist.reduce_scatter_tensor(out, x)
                part = n // WORLD_SIZE
                ok = bool(np.array_equal(out.numpy(), op_sum(i)[rank * part:(rank + 1) * part]))
            elif op == "alltoall":
                out = torch.empty_like(x)
                dist.all_to_all_single(out, x)
                part = step["n"] // WORLD_SIZE
                expect = np.concatenate(
                    [op_values(i, r)[rank * part:(rank + 1) * part] for r in range(WORLD_SIZE)])
                ok = bool(np.array_equal(out.numpy(), expect))
            else:  # pragma: no cover - SCRIPT is fixed
                raise ValueError(op)
            results.append({"op": op, "ok": ok})
    finally:
        dist.destroy_process_group()
        Path(out_path).write_text(json.dumps(results))
    return 0


# --------------------------------------------------------------------------------------------------------------
# Recorded data
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Segment:
    seq: int  # raw 32-bit TCP sequence number
    flags: str  # Scapy flag string, e.g. "S", "SA", "PA", "FA"
    payload: bytes


@dataclass
class Direction:
    src: tuple[str, int]
    dst: tuple[str, int]
    initiator: bool  # this direction belongs to the side that sent the SYN
    isn: int  # sequence number of this direction's SYN (or SYN-ACK)
    src_rank: int
    dst_rank: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.src[0]}:{self.src[1]}->{self.dst[0]}:{self.dst[1]}"

    def offset_of(self, seq: int) -> int:
        """Stream offset of a sequence number (the recordings are far below 4 GiB: no unwrapping needed)."""
        return (seq - self.isn - 1) & 0xFFFFFFFF

    def data_segments(self) -> list[tuple[int, bytes]]:
        """(stream offset, payload) of every segment that carries payload, in capture order."""
        return [(self.offset_of(s.seq), s.payload) for s in self.segments if s.payload]

    def stream(self) -> bytes:
        """The direction's byte stream reassembled from its segments (retransmissions included once)."""
        buf = bytearray()
        for off, data in sorted(self.data_segments(), key=lambda t: t[0]):
            end = off + len(data)
            if off > len(buf):
                raise ValueError(f"{self.name}: hole in the capture at offset {len(buf)}")
            if end > len(buf):
                buf += data[len(buf) - off:]
        return bytes(buf)


@dataclass
class Connection:
    initiator: Direction  # the SYN sender's direction: starts with gloo's 8-byte handshake
    responder: Direction  # the other direction: starts directly with frames

    @property
    def directions(self) -> tuple[Direction, Direction]:
        return (self.initiator, self.responder)


@dataclass
class Capture:
    mode: str
    mtu: int
    offloads: bool
    packets: int
    connections: list[Connection]
    results: dict[int, list]  # per rank: [{"op", "ok"}] as reported by the workers
    script: list[dict] = field(default_factory=lambda: SCRIPT)

    def directions(self) -> list[Direction]:
        return [d for c in self.connections for d in c.directions]

    @staticmethod
    def tensor(index: int, rank: int) -> np.ndarray:
        """Known input of ``rank`` for ``SCRIPT[index]`` (see ``op_values``)."""
        return op_values(index, rank)

    @staticmethod
    def reduced(index: int) -> np.ndarray:
        """Known element-wise sum over the ranks for ``SCRIPT[index]`` (allreduce / reduce_scatter results)."""
        return op_sum(index)

    def data_connections(self) -> list[Connection]:
        """Connections that carried payload (gloo's pair connections, not failed connect attempts)."""
        return [c for c in self.connections if any(d.data_segments() for d in c.directions)]


def parse_pcap(path: str | os.PathLike, mode: str = "", mtu: int = 0, offloads: bool = True,
               results: dict | None = None) -> Capture:
    """Split a pcap into TCP connections and directions with Scapy's rdpcap."""
    from scapy.all import IP, TCP, rdpcap

    pkts = rdpcap(str(path))
    conns: dict[tuple, dict] = {}
    for p in pkts:
        if IP not in p or TCP not in p:
            continue
        ip, tcp = p[IP], p[TCP]
        src, dst = (ip.src, int(tcp.sport)), (ip.dst, int(tcp.dport))
        key = tuple(sorted((src, dst)))
        c = conns.setdefault(key, {"dirs": {}, "syn": None})
        d = c["dirs"].setdefault((src, dst), {"isn": None, "segs": []})
        flags = str(tcp.flags)
        # Payload from the IP length: Scapy keeps Ethernet padding after the TCP payload.
        plen = ip.len - ip.ihl * 4 - tcp.dataofs * 4 if ip.len else None
        data = bytes(tcp.payload)
        if plen is not None:
            data = data[:max(plen, 0)]
        if "S" in flags:
            d["isn"] = int(tcp.seq)
            if "A" not in flags:
                c["syn"] = src
        d["segs"].append(Segment(int(tcp.seq), flags, data))
    out = []
    for key, c in conns.items():
        if c["syn"] is None:
            continue  # connection that started before the capture: no ISN, not a recording
        a, b = key
        init_src = c["syn"]
        resp_src = b if init_src == a else a
        dirs = []
        for src, dst in ((init_src, resp_src), (resp_src, init_src)):
            raw = c["dirs"].get((src, dst), {"isn": None, "segs": []})
            dirs.append(Direction(src=src, dst=dst, initiator=(src == init_src), isn=raw["isn"],
                                  src_rank=RANK_OF_IP.get(src[0], -1), dst_rank=RANK_OF_IP.get(dst[0], -1),
                                  segments=raw["segs"]))
        if dirs[1].isn is None:
            continue  # refused attempt (SYN answered by RST)
        out.append(Connection(initiator=dirs[0], responder=dirs[1]))
    return Capture(mode=mode, mtu=mtu, offloads=offloads, packets=len(pkts), connections=out,
                   results=results or {})


# --------------------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------------------


def tools_missing() -> list[str]:
    missing = [t for t in ("ip", "tc", "tcpdump", "ethtool") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def _remove_namespaces() -> None:
    from pyroute2 import netns

    for name in (NS_A, NS_B):
        if name in netns.listnetns():
            try:
                netns.remove(name)  # deleting the namespace deletes the veth end inside it (and its peer)
            except OSError:
                pass


def _setup_namespaces(mtu: int) -> None:
    from pyroute2 import NetNS, netns

    _remove_namespaces()  # leftovers of an interrupted run
    netns.create(NS_A)
    netns.create(NS_B)
    with NetNS(NS_A) as a:
        a.link("add", ifname=IF_A, kind="veth", peer={"ifname": IF_B, "net_ns_fd": NS_B})
    for ns, ifname, addr in ((NS_A, IF_A, IP_A), (NS_B, IF_B, IP_B)):
        with NetNS(ns) as n:
            lo = n.link_lookup(ifname="lo")[0]
            n.link("set", index=lo, state="up")
            idx = n.link_lookup(ifname=ifname)[0]
            n.link("set", index=idx, mtu=mtu)
            n.addr("add", index=idx, address=addr, prefixlen=24)
            n.link("set", index=idx, state="up")


def _set_offloads(on: bool) -> None:
    state = "on" if on else "off"
    for ns, ifname in ((NS_A, IF_A), (NS_B, IF_B)):
        subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", ifname, "tso", state, "gso", state,
                        "gro", state], check=True, capture_output=True)


def _rate_limit(rate: str) -> None:
    """tbf on both veth ends: the sender's TCP write queue backs up, so back-to-back gloo frames are packed
    into MSS-sized segments with frame boundaries anywhere inside them (headers straddle packets)."""
    for ns, ifname in ((NS_A, IF_A), (NS_B, IF_B)):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ifname, "root", "tbf",
                        "rate", rate, "burst", "16kb", "latency", "100ms"], check=True, capture_output=True)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait: float = 5.0) -> None:
    """Stop one process this module started (by its pid), escalating to SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    except ProcessLookupError:
        pass


def record(workdir: str | os.PathLike, mode: str = "tso", attempts: int = 3) -> Capture:
    """Record one run of ``SCRIPT`` between two namespaces; returns the parsed capture.

    A recording must be complete (tcpdump lost nothing, every direction's stream has no hole and ends with a
    FIN or RST): an incomplete one is recorded again, up to ``attempts`` times. The namespaces and every process
    started here are removed before returning (also on error).
    """
    import fcntl

    problem = ""
    # the namespace names are fixed: serialise recordings of concurrent test sessions on this machine
    with open(LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(attempts):
            cap, stats = _record_once(workdir, mode)
            problem = _incomplete(cap, stats)
            if not problem:
                return cap
    raise RuntimeError(f"gloo capture ({mode}) incomplete after {attempts} attempts: {problem}")


def _incomplete(cap: Capture, tcpdump_log: str) -> str:
    import re

    m = re.search(r"(\d+) packets captured\s+(\d+) packets received by filter\s+(\d+) packets dropped", tcpdump_log)
    if not m:
        return "no tcpdump statistics"
    captured, received, dropped = map(int, m.groups())
    if dropped or captured != received:
        return f"tcpdump: {captured} captured, {received} received, {dropped} dropped"
    conns = cap.data_connections()
    if not conns:
        return "no gloo connection recorded"
    for c in conns:
        for d in c.directions:
            try:
                d.stream()
            except ValueError as e:
                return str(e)
            if not any("F" in s.flags or "R" in s.flags for s in d.segments):
                return f"{d.name}: no FIN/RST recorded (capture stopped early?)"
    return ""


def _record_once(workdir: str | os.PathLike, mode: str) -> tuple[Capture, str]:
    if mode not in ("tso", "mtu1280"):
        raise ValueError(mode)
    mtu, offloads = (1500, True) if mode == "tso" else (1280, False)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    pcap = workdir / f"gloo-{mode}.pcap"
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        _setup_namespaces(mtu)
        _set_offloads(offloads)
        if not offloads:
            _rate_limit(SMALL_MTU_RATE)
        tlog = open(workdir / f"tcpdump-{mode}.log", "w+")
        logs.append(tlog)
        tcpdump = subprocess.Popen(
            ["ip", "netns", "exec", NS_A, "tcpdump", "-i", IF_A, "-s", "0", "-U", "-n", "--immediate-mode",
             "-B", "65536", "-w", str(pcap), f"tcp and not port {MASTER_PORT}"],
            stdout=subprocess.DEVNULL, stderr=tlog)
        procs.append(tcpdump)
        deadline = time.monotonic() + 10
        while "listening on" not in (workdir / f"tcpdump-{mode}.log").read_text():
            if tcpdump.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tcpdump did not start: " + (workdir / f"tcpdump-{mode}.log").read_text())
            time.sleep(0.05)

        workers = []
        for rank, (ns, ifname) in enumerate(((NS_A, IF_A), (NS_B, IF_B))):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=ifname, OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                os.environ.get("PYTHONPATH")])))
            wlog = open(workdir / f"worker{rank}-{mode}.log", "w+")
            logs.append(wlog)
            p = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), "--worker",
                 "--rank", str(rank), "--out", str(workdir / f"result{rank}-{mode}.json")],
                env=env, stdout=wlog, stderr=subprocess.STDOUT)
            procs.append(p)
            workers.append(p)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for rank, p in enumerate(workers):
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                log = (workdir / f"worker{rank}-{mode}.log").read_text()[-4000:]
                raise RuntimeError(f"gloo worker {rank} ({mode}) failed (rc={rc}):\n{log}")
        time.sleep(0.3)  # let the last FIN/ACKs reach the capture
        _stop(tcpdump, signal.SIGINT)
        results = {r: json.loads((workdir / f"result{r}-{mode}.json").read_text()) for r in range(WORLD_SIZE)}
    finally:
        for p in reversed(procs):
            _stop(p)
        for f in logs:
            f.close()
        _remove_namespaces()
    stats = (workdir / f"tcpdump-{mode}.log").read_text()
    return parse_pcap(pcap, mode=mode, mtu=mtu, offloads=offloads, results=results), stats


# --------------------------------------------------------------------------------------------------------------
# pytest fixture
# --------------------------------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the recorder also runs without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def gloo_captures() -> dict[str, Capture]:
        """``{"tso": Capture, "mtu1280": Capture}``: real gloo streams recorded once per session."""
        missing = tools_missing()
        if missing:
            pytest.skip(f"cannot record gloo traffic, missing: {', '.join(missing)}")
        tmp = tempfile.mkdtemp(prefix="tbG-capture-")
        try:
            caps = {mode: record(tmp, mode) for mode in ("tso", "mtu1280")}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        yield caps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--out")
    ap.add_argument("--record", metavar="DIR", help="record both modes into DIR and print a summary")
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.rank, args.out)
    if args.record:
        for mode in ("tso", "mtu1280"):
            cap = record(args.record, mode)
            print(f"{mode}: {cap.packets} packets, {len(cap.connections)} connections, results={cap.results}")
            for c in cap.connections:
                for d in c.directions:
                    segs = d.data_segments()
                    print(f"  {d.name} initiator={d.initiator} segments={len(segs)} "
                          f"bytes={sum(len(s) for _, s in segs)} max={max((len(s) for _, s in segs), default=0)}")
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
