"""One corrupted direction of the NFQUEUE engine (docs/engine.md, "Lifecycle and fail-closed semantics"): enter
the namespace, bind the queue, open the control socket, write the stats file, and process the packets queued to
it; the engine process (testbed/engine/__main__.py) runs the loop that serves one or several of them until
SIGTERM or ``{"cmd": "stop"}``.

Fail closed: the queue is bound without NFQA_CFG_F_FAIL_OPEN (unless configured) and the manager adds the
iptables rule without ``--queue-bypass``, so while the rule exists and this process is not reading, the
link drops packets instead of passing them clean.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

from testbed.engine.capture import CaptureWriter
from testbed.engine.config import EngineSpec
from testbed.engine.control import ControlServer
from testbed.engine.corruptor import DROP, Corruptor
from testbed.engine.nfqueue import NF_DROP, NfQueue
from testbed.engine.stats import write_json_atomic

__all__ = ["Engine"]

log = logging.getLogger("testbed.engine")

STATS_INTERVAL = 0.5  # seconds between stats file writes
_BATCH = 64  # packets between verdict flushes under load (bounds the added latency of a batch)
_DRAIN = 512  # packets per wake-up before control requests get a turn


class Engine:
    def __init__(self, spec: EngineSpec):
        self.spec = spec.validate()
        self.capture = None
        if spec.capture:
            self.capture = CaptureWriter(spec.capture["dir"], spec.capture["max_bytes"])
        self.corruptor = Corruptor(spec, self.capture)
        self.queue: NfQueue | None = None
        self.control: ControlServer | None = None
        self.stopping = False
        self.started_at = time.time()
        self._errors_logged = 0

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        from pyroute2 import netns

        netns.setns(self.spec.netns, flags=0)  # flags=0: never create a namespace that is not there
        self.queue = NfQueue(self.spec.queue_num, gso=self.corruptor.gso, fail_open=self.spec.fail_open,
                             maxlen=self.spec.queue_maxlen)
        self.control = ControlServer(self.spec.control_socket, self.handle_request)
        self.write_stats()

    def close(self, final: bool = True) -> None:
        if self.queue is not None:
            try:
                self.queue.flush()
            except OSError:
                pass
        self.write_stats(final=final)
        if self.capture is not None:
            self.capture.close()
        if self.control is not None:
            self.control.close()
        if self.queue is not None:
            self.queue.close()  # the kernel unbinds the queue; with the rule still there, packets drop

    # -- reporting ---------------------------------------------------------------------------------------------

    def stats(self, final: bool = False) -> dict:
        s = self.spec
        d = {"topology": s.topology, "link": s.link, "direction": s.direction, "pid": os.getpid(),
             "alive": not final, "netns": s.netns, "iface": s.iface, "hook": s.hook, "queue_num": s.queue_num,
             "started_at": self.started_at, "updated_at": time.time()}
        d.update(self.corruptor.stats())
        if self.queue is not None:
            d["fail_open"] = self.queue.fail_open
            d["verdict_errors"] = self.queue.errors
        if final:
            d["exited_at"] = d["updated_at"]
        return d

    def write_stats(self, final: bool = False) -> None:
        if self.capture is not None:
            self.capture.flush()
        try:
            write_json_atomic(self.spec.stats_file, self.stats(final))
        except OSError as e:  # a full or vanished state dir must not stop the link
            log.warning("cannot write stats file %s: %s", self.spec.stats_file, e)

    # -- control -----------------------------------------------------------------------------------------------

    def handle_request(self, req: dict) -> dict:
        cmd = req.get("cmd")
        if cmd == "stats":
            return {"ok": True, **self.stats()}
        if cmd == "set":
            settings = {k: v for k, v in req.items() if k != "cmd"}
            new = self.corruptor.set(**settings)
            if self.queue is not None and self.corruptor.gso != self.queue.gso:
                self.queue.flush()
                self.queue.set_flags(gso=self.corruptor.gso, fail_open=self.queue.fail_open)
            log.info("settings changed: %s", settings)
            self.write_stats()
            return {"ok": True, "settings": new}
        if cmd == "stop":
            self.stopping = True
            return {"ok": True}
        raise ValueError(f"unknown cmd {cmd!r} (stats, set, stop)")

    # -- packets -----------------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Process queued packets until none is waiting (or _DRAIN of them), then send the verdicts."""
        q = self.queue
        process = self.corruptor.process
        counters = self.corruptor.counters
        recv = q.recv
        n = 0
        while n < _DRAIN:
            m = recv()
            if m is None:
                break
            pid, payload, info, cap_len = m
            n += 1
            if cap_len:  # the kernel copied only part of it: a verdict payload would truncate it
                counters.packets += 1
                counters.bytes += cap_len
                counters.packets_truncated += 1
                q.accept_upto(pid)
                continue
            try:
                out = process(payload, info)
            except Exception:  # a bug must cost one packet's corruption, not the link
                counters.packets_errors += 1
                out = None
                if self._errors_logged < 10:
                    self._errors_logged += 1
                    log.error("packet processing failed (passed unmodified):\n%s", traceback.format_exc())
            if out is None:
                q.accept_upto(pid)
            elif out is DROP:
                q.verdict(pid, None, NF_DROP)
            else:
                q.verdict(pid, out)
            if not n % _BATCH:
                q.flush()
        q.flush()
