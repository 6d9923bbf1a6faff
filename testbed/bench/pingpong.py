"""TCP ping-pong over real sockets, run inside testbed hosts.

  python -m testbed.bench.pingpong serve PORT
  python -m testbed.bench.pingpong client ADDR PORT --size BYTES --count N [--warmup W]

The client sends a message of BYTES, the server echoes BYTES back, the client records the round-trip time of
each exchange (ns, monotonic clock) and prints one JSON object: sizes, count, RTT percentiles and all samples.
Content is not checked: under corruption the echo carries errored bytes, which is the point.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import numpy as np


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def serve(port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(4)
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            hdr = bytearray(8)
            try:
                _recv_exact(conn, memoryview(hdr))
            except ConnectionError:
                continue
            size = int.from_bytes(hdr, "little")
            buf = bytearray(size)
            try:
                while True:
                    _recv_exact(conn, memoryview(buf))
                    conn.sendall(buf)
            except (ConnectionError, OSError):
                pass


def client(addr: str, port: int, size: int, count: int, warmup: int) -> dict:
    sock = socket.create_connection((addr, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(size.to_bytes(8, "little"))
    msg = bytes(range(256)) * (size // 256) + bytes(size % 256)
    buf = memoryview(bytearray(size))
    rtts = np.empty(count, dtype=np.int64)
    for i in range(warmup + count):
        t0 = time.monotonic_ns()
        sock.sendall(msg)
        _recv_exact(sock, buf)
        if i >= warmup:
            rtts[i - warmup] = time.monotonic_ns() - t0
    sock.close()
    us = rtts / 1e3
    return {"size": size, "count": count, "p50_us": float(np.percentile(us, 50)),
            "p90_us": float(np.percentile(us, 90)), "p99_us": float(np.percentile(us, 99)),
            "p999_us": float(np.percentile(us, 99.9)), "max_us": float(us.max()), "mean_us": float(us.mean()),
            "samples_us": [round(float(x), 2) for x in us]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    c = sub.add_parser("client")
    c.add_argument("addr")
    c.add_argument("port", type=int)
    c.add_argument("--size", type=int, default=4096)
    c.add_argument("--count", type=int, default=1000)
    c.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)
    if args.mode == "serve":
        serve(args.port)
        return 0
    print(json.dumps(client(args.addr, args.port, args.size, args.count, args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
