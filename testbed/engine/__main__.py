"""``python -m testbed.engine --config FILE [--config FILE ...]``: one NFQUEUE engine process serving one link
direction per config, all in one network namespace (docs/engine.md, "Engine processes").

Each direction is a *lane*: shim.Engine (its queue, corruptor, control socket and stats file) plus the kernel's
drop counters of its queue. One epoll loop serves every lane; a lane's ``{"cmd": "stop"}`` closes that lane
(final stats written) and the process exits when no lane is left; ``{"cmd": "add", "config": FILE}`` on any
lane's socket binds one more. SIGTERM stops every lane.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import select
import signal
import sys
import time
import traceback

from testbed.engine.config import EngineSpec
from testbed.engine.nfqueue import queue_drops
from testbed.engine.shim import STATS_INTERVAL, Engine

log = logging.getLogger("testbed.engine")


class Lane(Engine):
    """One link direction served by an engine process."""

    def __init__(self, spec: EngineSpec, proc: "EngineProcess"):
        super().__init__(spec)
        self.proc = proc

    def stats(self, final: bool = False) -> dict:
        d = super().stats(final)
        # Loss the engine caused (queue overflow, socket overrun): the kernel counts it per queue, in this
        # namespace; engine-caused loss must never pass for link loss.
        d.update(queue_drops(self.spec.queue_num) if self.queue is not None else
                 {"queue_dropped": None, "user_dropped": None, "queue_total": None})
        d["process_lanes"] = len(self.proc.lanes)
        return d

    def handle_request(self, req: dict) -> dict:
        if req.get("cmd") == "add":
            return self.proc.add(str(req.get("config") or ""))
        resp = super().handle_request(req)
        if req.get("cmd") == "stop":
            resp["lanes_left"] = sum(1 for ln in self.proc.lanes if not ln.stopping)
        return resp


def _same_netns(path: str) -> bool:
    a, b = os.stat(path), os.stat("/proc/self/ns/net")
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class EngineProcess:
    """Every lane of this process, and the loop that serves them."""

    def __init__(self):
        self.lanes: list[Lane] = []
        self.by_queue: dict[int, Lane] = {}  # queue socket fd -> lane
        self.by_control: dict[int, Lane] = {}  # listening control socket fd -> lane
        self.ep = None
        self.stopping = False

    def add(self, config_path: str) -> dict:
        """Bind one more direction (raises if its config is bad, its namespace is another, or its queue is
        taken; nothing is left half-started)."""
        spec = EngineSpec.load(config_path)
        if spec.engine != "nfqueue":
            raise ValueError(f"{config_path}: engine {spec.engine!r} has no process (only nfqueue lanes run here)")
        if self.lanes and not _same_netns(spec.netns):
            raise ValueError(f"{config_path}: netns {spec.netns} is not this process's ({self.lanes[0].spec.netns});"
                             " one engine process serves one namespace")
        lane = Lane(spec, self)
        try:
            lane.start()
        except BaseException:
            for part in (lane.control, lane.queue):
                if part is not None:
                    part.close()
            raise
        self.lanes.append(lane)
        self.by_queue[lane.queue.fileno()] = lane
        self.by_control[lane.control.fileno()] = lane
        if self.ep is not None:
            self.ep.register(lane.queue.fileno(), select.EPOLLIN)
            self.ep.register(lane.control.fileno(), select.EPOLLIN)
        log.info("bound queue %d in %s (iface %s, %s, scope %s, checksum %s, ber %g, gso %s)", spec.queue_num,
                 spec.netns, spec.iface, spec.hook, spec.scope, spec.checksum, spec.ber, lane.corruptor.gso)
        return {"ok": True, "pid": os.getpid(), "queue_num": spec.queue_num, "lanes": len(self.lanes)}

    def remove(self, lane: Lane) -> None:
        """Close one lane: verdicts flushed, final stats written, queue unbound (its rule, if still there,
        then drops its packets: fail closed)."""
        for fd in (lane.queue.fileno(), lane.control.fileno(), *lane.control.clients):
            try:
                self.ep.unregister(fd)
            except (OSError, ValueError):
                pass
        self.by_queue.pop(lane.queue.fileno(), None)
        self.by_control.pop(lane.control.fileno(), None)
        self.lanes.remove(lane)
        lane.close(final=True)
        c = lane.corruptor.counters
        log.info("stopped queue %d: %d packets, %d bits flipped", lane.spec.queue_num, c.packets, c.bits_flipped)

    def _control_client(self, fd: int) -> Lane | None:
        for lane in self.lanes:
            if fd in lane.control.clients:
                return lane
        return None

    def run(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)

        def on_signal(signum, frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.set_wakeup_fd(wake_w)  # wakes epoll; the handler itself runs between bytecodes
        self.ep = ep = select.epoll()
        for lane in self.lanes:
            ep.register(lane.queue.fileno(), select.EPOLLIN)
            ep.register(lane.control.fileno(), select.EPOLLIN)
        ep.register(wake_r, select.EPOLLIN)
        # Per-packet objects form no cycles; keep the cyclic GC from pausing the hot loop.
        gc.collect()
        gc.freeze()
        gc.disable()
        next_stats = time.monotonic() + STATS_INTERVAL
        try:
            while not self.stopping and self.lanes:
                timeout = max(0.0, next_stats - time.monotonic())
                for fd, _ev in ep.poll(timeout):
                    lane = self.by_queue.get(fd)
                    if lane is not None:
                        lane.drain()
                        continue
                    lane = self.by_control.get(fd)
                    if lane is not None:
                        conn = lane.control.accept()
                        if conn is not None:
                            ep.register(conn.fileno(), select.EPOLLIN)
                        continue
                    if fd == wake_r:
                        try:
                            os.read(wake_r, 512)
                        except BlockingIOError:
                            pass
                        continue
                    lane = self._control_client(fd)
                    if lane is not None:
                        lane.control.serve(fd)  # closing a client also removes it from the epoll set
                for lane in [ln for ln in self.lanes if ln.stopping]:
                    self.remove(lane)
                now = time.monotonic()
                if now >= next_stats:
                    for lane in self.lanes:
                        lane.write_stats()
                    gc.collect(0)
                    next_stats = now + STATS_INTERVAL
        finally:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)

    def close(self) -> None:
        for lane in list(self.lanes):
            try:
                self.remove(lane)
            except Exception:  # keep closing the others: each lane's final stats matter
                log.error("closing queue %d failed:\n%s", lane.spec.queue_num, traceback.format_exc())
        if self.ep is not None:
            self.ep.close()


def main(config_paths: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    proc = EngineProcess()
    try:
        for path in config_paths:
            proc.add(path)
    except Exception as e:
        log.error("engine failed to start: %s\n%s", e, traceback.format_exc())
        proc.close()
        return 2
    print("READY", flush=True)
    # Nothing more goes to stdout: the manager stops reading it after READY (a write could hit a closed pipe).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    profile = os.environ.get("TESTBED_ENGINE_PROFILE")  # dev aid: cProfile the loop into this file
    try:
        if profile:
            import cProfile

            cProfile.runctx("proc.run()", globals(), {"proc": proc}, profile)
        else:
            proc.run()
    finally:
        proc.close()
    return 0


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.engine",
                                description="NFQUEUE bit-corruption engine: one process serving one link direction "
                                            "per --config, all in one network namespace.")
    p.add_argument("--config", required=True, action="append",
                   help="engine config JSON of one direction (written by testbed.engine.manager); repeat it for "
                        "every direction this process serves")
    args = p.parse_args(argv)
    return main(args.config)


if __name__ == "__main__":
    sys.exit(cli())
