"""Probe traffic for checking a corrupted link end to end (tests, benchmarks, the lead's own checks).

- ``send``/``recv``: a TCP sender of seeded pseudo-random bytes and a receiver that regenerates the same
  bytes and counts the bit errors itself (independently of the engine's counters).
- ``pingpong-server``/``pingpong-client``: TCP round trips of small messages, for latency.

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

__all__ = ["CHUNK", "expected_chunk", "tcp_snmp", "popcount"]

CHUNK = 1 << 20


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
    s.close()
    after = tcp_snmp()
    return {"sent": sent, "seconds": seconds, "gbit_s": sent * 8 / seconds / 1e9,
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


def pingpong_server(port: int, size: int, timeout: float = 120.0) -> dict:
    ls = _listen(port, timeout)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def pingpong_client(host: str, port: int, count: int, size: int, warmup: int = 200) -> dict:
    s = socket.create_connection((host, port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = bytes(size)
    buf = bytearray(size)
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
    a = sub.add_parser("pingpong-client")
    a.add_argument("--host", required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--count", type=int, default=5000)
    a.add_argument("--size", type=int, default=64)
    a.add_argument("--warmup", type=int, default=200)
    args = p.parse_args(argv)
    if args.cmd == "send":
        r = send(args.host, args.port, args.bytes, args.seed, args.sport, args.pause_at, args.timeout)
    elif args.cmd == "recv":
        r = recv(args.port, args.bytes, args.seed, args.progress, args.timeout)
    elif args.cmd == "pingpong-server":
        r = pingpong_server(args.port, args.size)
    else:
        r = pingpong_client(args.host, args.port, args.count, args.size, args.warmup)
    _emit({"result": r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
