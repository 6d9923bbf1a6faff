"""Probe traffic for checking a corrupted link end to end (tests, benchmarks, the lead's own checks).

- ``send``/``recv``: a TCP sender of seeded pseudo-random bytes and a receiver that regenerates the same
  bytes and counts the bit errors itself (independently of the engine's counters).
- ``pingpong-server``/``pingpong-client``: TCP round trips of small messages, for latency (``--gloo``: framed as
  gloo frames, so an engine in scope ``tensor`` corrupts their payload).
- ``gloo-send``/``gloo-recv``: bulk TCP for a given time, framed as gloo's pair protocol (the initiator's 8-byte
  handshake, then 48-byte headers of allreduce data frames before their payload): throughput through an engine
  in scope ``tensor`` (which corrupts only such payload), without torch.

Each command prints JSON lines on stdout; the last line is the result. Run inside a namespace with
``nsenter --net=/run/netns/NS python -m testbed.bench.probe ...``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import numpy as np

__all__ = ["CHUNK", "expected_chunk", "tcp_snmp", "popcount", "gloo_header"]

CHUNK = 1 << 20
GLOO_HANDSHAKE = (0).to_bytes(8, "little")  # the initiator's sequence number (gloo's pair handshake)


def gloo_header(length: int, tag: int = 0) -> bytes:
    """A 48-byte gloo frame header (Op::preamble) of an unbound-buffer allreduce data frame of ``length`` bytes."""
    import struct

    return struct.pack("<6Q", 48 + length, 1, (0x04 << 56) | ((tag & 0xFFFFFFFF) << 24), 0, length, 0)


def expected_chunk(seed: int, index: int, size: int = CHUNK) -> bytes:
    """Bytes ``[index * CHUNK, index * CHUNK + size)`` of the probe stream for ``seed``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(index)]))).bytes(size)


def popcount(a: np.ndarray) -> int:
    """Number of set bits in an array of unsigned ints (np.bitwise_count needs numpy >= 2)."""
    if hasattr(np, "bitwise_count"):
        return int(np.bitwise_count(a).sum())
    return int(np.unpackbits(np.ascontiguousarray(a).view(np.uint8)).sum())


def tcp_snmp() -> dict[str, int]:
    """The Tcp counters of /proc/net/snmp of the calling process's network namespace."""
    with open("/proc/net/snmp") as f:
        lines = [line.split() for line in f if line.startswith("Tcp:")]
    return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:])}


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def send(host: str, port: int, nbytes: int, seed: int, sport: int = 0, pause_at: int | None = None,
         timeout: float = 120.0) -> dict:
    before = tcp_snmp()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sport:
        s.bind(("0.0.0.0", sport))
    s.settimeout(timeout)
    s.connect((host, port))
    t0 = time.monotonic()
    sent = 0
    index = 0
    while sent < nbytes:
        size = min(CHUNK, nbytes - sent)
        data = expected_chunk(seed, index, CHUNK)[:size]
        if pause_at is not None and sent < pause_at <= sent + size:
            cut = pause_at - sent
            s.sendall(data[:cut])
            _emit({"paused": pause_at})
            sys.stdin.readline()  # the caller says when to go on
            s.sendall(data[cut:])
        else:
            s.sendall(data)
        sent += size
        index += 1
    s.shutdown(socket.SHUT_WR)
    while s.recv(65536):  # the receiver closes once it has everything: all data is acknowledged
        pass
    seconds = time.monotonic() - t0
    mss = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)  # payload bytes a segment carries at most
    s.close()
    after = tcp_snmp()
    return {"sent": sent, "seconds": seconds, "gbit_s": sent * 8 / seconds / 1e9, "mss": mss,
            "retrans_segs": after["RetransSegs"] - before["RetransSegs"],
            "out_segs": after["OutSegs"] - before["OutSegs"]}


def _listen(port: int, timeout: float) -> socket.socket:
    """A listening socket on every address of the host; announces itself with a `listening` line."""
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(1)
    ls.settimeout(timeout)
    _emit({"listening": port})
    return ls


def recv(port: int, nbytes: int, seed: int, progress: float = 0.0, timeout: float = 120.0,
         max_error_offsets: int = 1000) -> dict:
    ls = _listen(port, timeout)
    conn, peer = ls.accept()
    conn.settimeout(timeout)
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    received = bit_errors = byte_errors = 0
    offsets: list[int] = []
    index = 0
    t0 = time.monotonic()
    next_progress = t0 + progress if progress else float("inf")
    eof = False
    while received < nbytes and not eof:
        want = min(CHUNK, nbytes - received)
        got = 0
        while got < want:
            n = conn.recv_into(mv[got:want])
            if not n:
                eof = True
                break
            got += n
            now = time.monotonic()
            if now >= next_progress:
                _emit({"received": received + got})
                next_progress = now + progress
        if got:
            exp = np.frombuffer(expected_chunk(seed, index, CHUNK), dtype=np.uint8, count=got)
            x = np.frombuffer(buf, dtype=np.uint8, count=got) ^ exp
            bad = np.flatnonzero(x)
            if bad.size:
                bit_errors += popcount(x[bad])
                byte_errors += int(bad.size)
                if len(offsets) < max_error_offsets:
                    offsets.extend((bad[: max_error_offsets - len(offsets)] + received).tolist())
        received += got
        index += 1
    seconds = time.monotonic() - t0
    conn.close()
    ls.close()
    return {"received": received, "bit_errors": bit_errors, "byte_errors": byte_errors, "seconds": seconds,
            "error_byte_offsets": offsets, "peer": list(peer)}


def _read_exactly(conn, n: int) -> bool:
    buf = bytearray(n)
    got = 0
    while got < n:
        k = conn.recv_into(memoryview(buf)[got:])
        if not k:
            return False
        got += k
    return True


def pingpong_server(port: int, size: int, timeout: float = 120.0, gloo: bool = False) -> dict:
    ls = _listen(port, timeout)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if gloo:  # the handshake, then frames of a header and `size` bytes
        _read_exactly(conn, len(GLOO_HANDSHAKE))
        size += 48
    buf = bytearray(size)
    rounds = 0
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(memoryview(buf)[got:])
            if not n:
                conn.close()
                ls.close()
                return {"rounds": rounds}
            got += n
        conn.sendall(buf)
        rounds += 1


def pingpong_client(host: str, port: int, count: int, size: int, warmup: int = 200, gloo: bool = False) -> dict:
    s = socket.create_connection((host, port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = bytes(size)
    if gloo:
        s.sendall(GLOO_HANDSHAKE)
        msg = gloo_header(size) + msg
    buf = bytearray(len(msg))
    size = len(msg)
    rtts = np.empty(count, dtype=np.float64)
    for i in range(warmup + count):
        t0 = time.perf_counter_ns()
        s.sendall(msg)
        got = 0
        while got < size:
            n = s.recv_into(memoryview(buf)[got:])
            if not n:
                raise ConnectionError("server closed")
            got += n
        if i >= warmup:
            rtts[i - warmup] = (time.perf_counter_ns() - t0) / 1e3
    s.close()
    return {"count": count, "size": size, "rtt_p50_us": float(np.percentile(rtts, 50)),
            "rtt_p90_us": float(np.percentile(rtts, 90)), "rtt_p99_us": float(np.percentile(rtts, 99)),
            "rtt_p999_us": float(np.percentile(rtts, 99.9)), "rtt_max_us": float(rtts.max()),
            "rtt_mean_us": float(rtts.mean()), "samples_us": [round(float(x), 1) for x in rtts]}


def gloo_send(host: str, port: int, seconds: float, frame: int = 1 << 20) -> dict:
    """gloo-framed bulk data for ``seconds``: frames of ``frame`` random payload bytes."""
    s = socket.create_connection((host, port), timeout=30)
    payload = np.random.default_rng(0).bytes(frame)
    s.sendall(GLOO_HANDSHAKE)
    sent, tag, t0 = 0, 0, time.monotonic()
    view = memoryview(payload)
    while time.monotonic() - t0 < seconds:
        hdr = gloo_header(frame, tag)
        n = s.sendmsg([hdr, payload])  # one frame per call, as gloo's writev; the rest if it sent part
        if n < 48:
            s.sendall(hdr[n:])
            s.sendall(view)
        elif n < 48 + frame:
            s.sendall(view[n - 48:])
        sent += 48 + frame
        tag += 1
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the receiver closes after the last byte
    s.close()
    return {"sent": sent, "frames": tag}


def gloo_recv(port: int, timeout: float = 120.0) -> dict:
    """Reads until the sender is done; the throughput is the receiver's bytes over its first-to-last byte time."""
    ls = _listen(port, timeout)
    conn, _ = ls.accept()
    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    received, t0 = 0, None
    while True:
        n = conn.recv_into(mv)
        if not n:
            break
        if t0 is None:
            t0 = time.monotonic()
        received += n
    seconds = time.monotonic() - (t0 or time.monotonic())
    conn.close()
    ls.close()
    return {"received": received, "seconds": seconds,
            "gbit_s": received * 8 / seconds / 1e9 if seconds > 0 else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.bench.probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("send")
    a.add_argument("--host", required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--bytes", type=int, required=True)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--sport", type=int, default=0, help="fixed source port (reproducible flow key)")
    a.add_argument("--pause-at", type=int, default=None, help="stop after this many bytes until a stdin line")
    a.add_argument("--timeout", type=float, default=120.0)
    a = sub.add_parser("recv")
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--bytes", type=int, required=True)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--progress", type=float, default=0.0, help="print progress every this many seconds")
    a.add_argument("--timeout", type=float, default=120.0)
    a = sub.add_parser("pingpong-server")
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--size", type=int, default=64)
    a.add_argument("--gloo", action="store_true", help="gloo-framed messages (a handshake, a header each)")
    a = sub.add_parser("pingpong-client")
    a.add_argument("--host", required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--count", type=int, default=5000)
    a.add_argument("--size", type=int, default=64)
    a.add_argument("--warmup", type=int, default=200)
    a.add_argument("--gloo", action="store_true", help="gloo-framed messages (a handshake, a header each)")
    a = sub.add_parser("gloo-send")
    a.add_argument("--host", required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--seconds", type=float, default=3.0)
    a.add_argument("--frame", type=int, default=1 << 20, help="payload bytes per gloo data frame")
    a = sub.add_parser("gloo-recv")
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.cmd == "send":
        r = send(args.host, args.port, args.bytes, args.seed, args.sport, args.pause_at, args.timeout)
    elif args.cmd == "recv":
        r = recv(args.port, args.bytes, args.seed, args.progress, args.timeout)
    elif args.cmd == "pingpong-server":
        r = pingpong_server(args.port, args.size, gloo=args.gloo)
    elif args.cmd == "pingpong-client":
        r = pingpong_client(args.host, args.port, args.count, args.size, args.warmup, gloo=args.gloo)
    elif args.cmd == "gloo-send":
        r = gloo_send(args.host, args.port, args.seconds, args.frame)
    else:
        r = gloo_recv(args.port, args.timeout)
    _emit({"result": r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
