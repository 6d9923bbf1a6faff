"""The engine's control socket: a Unix stream socket speaking JSON lines.

Requests: ``{"cmd": "stats"}``, ``{"cmd": "set", <setting>: <value>, ...}``, ``{"cmd": "stop"}``.
Each request gets one JSON line back. Non-blocking; driven by the engine's event loop.
"""

from __future__ import annotations

import json
import os
import socket

__all__ = ["ControlServer", "request"]

_MAX_LINE = 1 << 20


class ControlServer:
    def __init__(self, path: str, handler):
        """``handler(request: dict) -> dict`` answers one request."""
        self.path = path
        self.handler = handler
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.clients: dict[int, tuple[socket.socket, bytearray]] = {}

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> socket.socket | None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return None
        conn.setblocking(False)
        self.clients[conn.fileno()] = (conn, bytearray())
        return conn

    def serve(self, fd: int) -> None:
        """Read what a client sent and answer each complete line."""
        conn, buf = self.clients[fd]
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.drop(fd)
            return
        buf += data
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            if line.strip():
                self._answer(conn, line)
        if len(buf) > _MAX_LINE:
            self.drop(fd)

    def _answer(self, conn: socket.socket, line: bytes) -> None:
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("request must be a JSON object")
            resp = self.handler(req)
        except Exception as e:  # a bad request must never take the engine down
            resp = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)
            conn.sendall(json.dumps(resp).encode() + b"\n")
            conn.setblocking(False)
        except OSError:
            pass

    def drop(self, fd: int) -> None:
        conn, _ = self.clients.pop(fd, (None, None))
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for fd in list(self.clients):
            self.drop(fd)
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def request(path: str, req: dict, timeout: float = 2.0) -> dict:
    """Send one request to an engine's control socket and return its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = bytearray()
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"engine control socket {path} closed without answering")
            buf += chunk
        return json.loads(bytes(buf).partition(b"\n")[0])
