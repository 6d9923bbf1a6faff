"""The bpf engine kind: the in-kernel tc program of testbed/engine/bpf (scopes payload, all and tensor; no process:
a handle's ``pid`` is 0 and ``handle.bpf`` says where it is pinned and attached). Its module (and clang,
bpftool) is imported only when a bpf engine is used or asked about: the NFQUEUE path needs none of it."""

from __future__ import annotations

import sys
import time

from testbed.engine.base import Engine, EngineHandle, prepared, register_engine
from testbed.engine.config import BPF_SCOPES, EngineSpec, bpf_problem

# How many directions `start` loads at a time: a load is mostly the kernel's verifier (~0.17 s) working in the
# loading thread.
PARALLEL_LOADS = 4


def _bpf():
    from testbed.engine.bpf import engine as bpf_engine  # only for bpf engines: the NFQUEUE path needs none of it
    return bpf_engine


def _target(h) -> tuple[EngineSpec, dict]:
    """(spec, bpf record) of a handle or a spec."""
    if isinstance(h, EngineHandle):
        return h.spec, dict(h.bpf or {})
    return h, {}


@register_engine
class BpfEngine(Engine):
    name = "bpf"
    scopes = BPF_SCOPES
    starts_together = True
    auto_rank = 0  # engine: auto prefers it where it serves and loads

    def available(self) -> tuple[bool, str]:
        return _bpf().available()

    def probe(self, netns: str) -> tuple[bool, str]:
        from pyroute2 import NetNS

        from testbed.engine.bpf import build

        missing = build.missing_tools()
        if missing:
            return False, (f"bpf engine unavailable: missing {', '.join(missing)} (apt-get install "
                           f"{' '.join(sorted(set(missing.values())))}) -> links asking for engine: bpf are refused, "
                           f"engine: auto uses nfqueue")
        with NetNS(netns) as n:
            n.link("add", ifname="dbpf0", kind="veth", peer={"ifname": "dbpf1"})
            for name in ("dbpf0", "dbpf1"):
                n.link("set", index=n.link_lookup(ifname=name)[0], state="up")
        try:
            return True, _bpf().selftest(netns, "dbpf0")
        except Exception as e:
            return False, (f"bpf engine unavailable: {e} -> links asking for engine: bpf are refused, engine: auto "
                           f"uses nfqueue")

    def preflight(self, directions: list, is_local) -> str | None:
        asks = [(ln, d, snd, rcv, imp) for ln, d, snd, rcv, imp in directions if imp.engine == self.name]
        if not asks:
            return None
        ok, why = self.available()
        if not ok:
            where = ", ".join(f"{ln} ({d})" for ln, d, *_ in asks[:4])
            return (f"engine: bpf on {where}, but the bpf engine cannot run here: {why} "
                    f"(`testbed doctor` checks it; engine: auto falls back to nfqueue)")
        for ln, d, snd, rcv, imp in asks:
            if imp.checksum == "keep" and not (is_local(snd.node) and is_local(rcv.node)):
                return (f"engine: bpf with checksum: keep on {ln} ({d}) needs both ends of the link on one "
                        f"machine (it corrupts on the receiving end, after the sending end checksummed the "
                        f"frames); use engine: nfqueue or auto there")
        return None

    def refusals(self, imp) -> list[tuple[str, str]]:
        problem = bpf_problem(imp.scope, imp.checksum, imp.error_model, imp.ber or 0.0)
        return [("engine", problem)] if problem else []

    def serves(self, imp, capture: dict | None, peer_netns: str) -> bool:
        return (not capture and not (imp.checksum == "keep" and not peer_netns)
                and bpf_problem(imp.scope, imp.checksum, imp.error_model, imp.ber or 0.0) is None)

    def _start_one(self, spec: EngineSpec) -> EngineHandle:
        spec = prepared(spec)
        rec = _bpf().start(spec)
        return EngineHandle(spec=spec, pid=0, start_time=None, config_path=str(spec.config_path()),
                            log_path=str(spec.log_path()), started_at=time.time(), bpf=rec,
                            rule=["tc", "filter", rec["attach"]["hook"], "dev", rec["attach"]["iface"], "pref",
                                  str(_bpf().PREF), "bpf", "tb_flip"])

    def start(self, specs: list[EngineSpec], python: str = sys.executable,
              ready_timeout: float = 20.0) -> list[EngineHandle]:
        """Each spec's program loaded and attached. Directions are independent (own maps, own filter): several
        are loaded PARALLEL_LOADS at a time. All or nothing: if one fails, those that started are stopped
        before the error propagates."""
        if len(specs) <= 1:
            return [self._start_one(s) for s in specs]
        from concurrent.futures import ThreadPoolExecutor

        from testbed.engine.bpf import build, pins

        build.object_path()  # compiled (or found) once, before the threads
        pins.ensure_bpffs()
        with ThreadPoolExecutor(max_workers=min(PARALLEL_LOADS, len(specs)), thread_name_prefix="bpf-load") as pool:
            futures = [pool.submit(self._start_one, spec) for spec in specs]
        # leaving the pool waited for every load (also after an interrupt): undo all if one failed
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for f in futures:
                if f.exception() is None:
                    try:
                        self.stop(f.result())
                    except Exception:  # the namespace teardown of the rollback removes what is left
                        pass
            raise errors[0]
        return [f.result() for f in futures]

    def stop(self, handle: EngineHandle, timeout: float = 10.0) -> dict:
        return _bpf().stop(handle.spec, handle.bpf or {})

    def alive(self, handle) -> bool:
        return _bpf().alive(*_target(handle))

    def stats(self, target, timeout: float = 2.0) -> dict:
        return _bpf().stats(*_target(target))

    def set(self, target, timeout: float = 5.0, **settings) -> dict:
        return _bpf().set_settings(*_target(target), **settings)

    def detach(self, handle: EngineHandle) -> None:
        _bpf().detach_engine(handle.spec, handle.bpf or {})

    def attach(self, handle: EngineHandle) -> None:
        _bpf().attach_engine(handle.spec, handle.bpf or {})
