"""A tiny TCP traffic checker run inside testbed hosts.

  server: python tcpcheck.py serve PORT          (prints READY, then for each connection replies
                                                  "<bytes> <sha256>" after the sender half-closes)
  client: python tcpcheck.py send NBYTES ADDR:PORT [ADDR:PORT ...]   (exit 0 iff every reply matches)
"""

import hashlib
import os
import socket
import sys
import threading


def serve(port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(64)
    print("READY", flush=True)

    def handle(conn):
        h, n = hashlib.sha256(), 0
        with conn:
            while True:
                b = conn.recv(1 << 16)
                if not b:
                    break
                h.update(b)
                n += len(b)
            conn.sendall(f"{n} {h.hexdigest()}".encode())

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def send(nbytes: int, targets: list[str]) -> int:
    data = os.urandom(nbytes)
    want = f"{nbytes} {hashlib.sha256(data).hexdigest()}"
    bad = 0
    for t in targets:
        host, port = t.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                got = b""
                while True:
                    b = s.recv(4096)
                    if not b:
                        break
                    got += b
            ok = got.decode() == want
        except OSError as e:
            ok, got = False, str(e).encode()
        print(f"{t} {'ok' if ok else 'FAIL ' + got.decode(errors='replace')}", flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        sys.exit(send(int(sys.argv[2]), sys.argv[3:]))
