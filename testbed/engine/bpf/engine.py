"""Start, query, change and stop a bpf engine: the tc program of flip.c on one link direction.

There is no process: `start` compiles the object (cached), loads it with bpftool (program and maps pinned
under the engine's pin directory, pins.py), writes the configuration into the config map, and attaches the
program with iproute2's tc inside the namespace (a clsact qdisc, a filter at preference PREF). From then on
the program runs in the kernel until `stop` detaches it, restores what it changed and removes the pins.
Stats are read from the maps; `set` writes a new configuration slot that the program applies at the next
packet boundary with nothing in flight.

Where the program sits (docs/engine.md, "The bpf engine"):

- checksum ``fix``: where the NFQUEUE engine sits (``spec.netns``/``spec.iface``/``spec.hook``: egress of
  the sending host, or ingress of the receiving host when a switch sends). Locally sent packets are
  CHECKSUM_PARTIAL there (the receiver treats them as verified) and GSO super-packets are corrupted whole.
- checksum ``keep``: on the ingress of the link's receiving end, with transmit checksum offload turned off
  on the sending end while the BER is above 0 (ethtool -K tx off, restored on stop, on detach and at BER 0:
  nothing is flipped then), so that the kernel segments and completes every
  checksum before the program corrupts the frame; the receiver then verifies it and drops exactly the
  corrupted frames (TcpInCsumErrors). A tc program cannot turn a CHECKSUM_PARTIAL skb into one the receiver
  verifies (bpf_csum_level only resets CHECKSUM_UNNECESSARY), hence the move.

Current settings, configuration version and attachment live in the sidecar ``X.bpf.json`` beside the stats
file (a later process, e.g. `testbed link set`, changes them), under an advisory lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from testbed import nsutil
from testbed.fileio import write_json_atomic
from testbed.engine.config import EngineError, EngineSpec
from testbed.engine.bpf import build, maps, pins
from testbed.engine.bpf import syscall as sc

__all__ = ["PREF", "start", "stop", "stats", "set_settings", "detach", "attach", "alive", "sites", "available",
           "sidecar_path", "FrameRunner"]

PREF = 49152  # tc filter preference of the engine's filter (one per device and hook)
_ZERO = b"\0\0\0\0"
SETTINGS = ("ber", "error_model", "scope", "checksum", "seed", "control_ports", "collectives", "element", "protect",
            "protected_ber")


def _error(msg: str) -> Exception:
    return EngineError(msg)


def sidecar_path(spec: EngineSpec) -> Path:
    p = spec.config_path()
    return p.with_name(p.name[: -len(".config.json")] + ".bpf.json")


# -- where the program sits ---------------------------------------------------------------------------------


def sites(spec: EngineSpec, checksum: str) -> tuple[dict, dict | None]:
    """(attachment, tx-offload site) for `checksum`: {netns, iface, hook} and {netns, iface} or None."""
    if checksum == "fix":
        return {"netns": spec.netns, "iface": spec.iface, "hook": spec.hook}, None
    if not (spec.peer_netns and spec.peer_iface):
        raise _error("the bpf engine's checksum keep needs the link's other end (peer_netns, peer_iface): it "
                     "corrupts after the kernel completed the checksums, on the receiving end's ingress")
    if spec.hook == "egress":  # the spec names the sending end
        return ({"netns": spec.peer_netns, "iface": spec.peer_iface, "hook": "ingress"},
                {"netns": spec.netns, "iface": spec.iface})
    return ({"netns": spec.netns, "iface": spec.iface, "hook": "ingress"},
            {"netns": spec.peer_netns, "iface": spec.peer_iface})


def _tc(netns: str, args: list[str], check: bool = True):
    r = nsutil.nsexec(netns, ["tc", *args], check=False, timeout=60)
    if check and r.returncode != 0:
        raise _error(f"tc {' '.join(args)} in {netns} failed: {(r.stderr or r.stdout).strip()}")
    return r


def attach(att: dict, pin_dir: Path) -> None:
    """Attach the pinned program at `att` (a clsact qdisc is added if the device has none)."""
    netns, iface, hook = att["netns"], att["iface"], att["hook"]
    if not os.path.exists(netns):
        raise _error(f"network namespace {netns} does not exist")
    if "clsact" not in _tc(netns, ["qdisc", "show", "dev", iface]).stdout:
        _tc(netns, ["qdisc", "add", "dev", iface, "clsact"])
    _tc(netns, ["filter", "replace", "dev", iface, hook, "pref", str(PREF), "handle", "1", "bpf", "da",
                "object-pinned", str(pin_dir / "prog")])


def detach(att: dict) -> None:
    """Remove the program from `att`, and the clsact qdisc when no filter is left on it. Idempotent; nothing to
    do when the namespace is gone (its devices and qdiscs went with it)."""
    netns, iface, hook = att["netns"], att["iface"], att["hook"]
    if not os.path.exists(netns):
        return
    _tc(netns, ["filter", "del", "dev", iface, hook, "pref", str(PREF)], check=False)
    left = [_tc(netns, ["filter", "show", "dev", iface, h], check=False).stdout.strip() for h in ("ingress", "egress")]
    if not any(left) and "clsact" in _tc(netns, ["qdisc", "show", "dev", iface], check=False).stdout:
        _tc(netns, ["qdisc", "del", "dev", iface, "clsact"], check=False)


def attached(att: dict) -> bool:
    if not os.path.exists(att["netns"]):
        return False
    out = _tc(att["netns"], ["filter", "show", "dev", att["iface"], att["hook"]], check=False).stdout
    return f"pref {PREF} " in out and "tb_flip" in out


def _tx_get(site: dict) -> bool | None:
    r = nsutil.nsexec(site["netns"], ["ethtool", "-k", site["iface"]], check=False, timeout=30)
    for line in r.stdout.splitlines():
        if line.startswith("tx-checksumming:"):
            return "on" in line.split(":", 1)[1]
    return None


def _tx_set(site: dict, on: bool, check: bool = True) -> None:
    if not os.path.exists(site["netns"]):
        return
    r = nsutil.nsexec(site["netns"], ["ethtool", "-K", site["iface"], "tx", "on" if on else "off"], check=False,
                      timeout=30)
    if check and r.returncode != 0:
        raise _error(f"ethtool -K {site['iface']} tx {'on' if on else 'off'} failed: {(r.stderr or r.stdout).strip()}"
                     " (apt-get install ethtool)")


def _tx_off(site: dict | None) -> dict | None:
    """Turn transmit checksum offload off at `site`; what to restore."""
    if site is None:
        return None
    was = _tx_get(site)
    if was is None:
        raise _error(f"cannot read the offloads of {site['iface']} in {site['netns']} (apt-get install ethtool)")
    if was:
        _tx_set(site, False)
    return {**site, "was_on": was}


def _tx_restore(rec: dict | None) -> None:
    if rec and rec.get("was_on"):
        _tx_set(rec, True, check=False)


# -- maps ---------------------------------------------------------------------------------------------------


class _Maps:
    def __init__(self, pin_dir: Path):
        self.dir = pin_dir
        self.fds: dict[str, int] = {}

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = sc.obj_get(str(self.dir / name))
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def write_config(self, version: int, slot: bytes) -> None:
        cur = sc.map_lookup(self.fd("tb_config"), _ZERO, maps.CONFIG_SIZE)
        _, slots = maps.split_config(cur)
        slots[version % maps.NSLOTS] = slot
        sc.map_update(self.fd("tb_config"), _ZERO, maps.config_value(version, slots))

    def config_version(self) -> int:
        return maps.decode_config_version(sc.map_lookup(self.fd("tb_config"), _ZERO, maps.CONFIG_SIZE))

    def state(self) -> dict:
        return maps.decode_state(sc.map_lookup(self.fd("tb_state"), _ZERO, maps.STATE_SIZE, sc.BPF_F_LOCK))

    def counters(self) -> dict:
        n = sc.possible_cpus()
        return maps.sum_counters(sc.map_lookup(self.fd("tb_counters"), _ZERO, maps.COUNTERS_SIZE * n), n)


def _slot(version: int, s: dict, generation: int, new_epoch: bool) -> bytes:
    return maps.encode_cfg(version, ber=s["ber"], error_model=s["error_model"], seed=s["seed"], generation=generation,
                           scope=s["scope"], checksum=s["checksum"], control_ports=list(s["control_ports"]),
                           new_epoch=new_epoch, collectives=s.get("collectives"), element=s.get("element", "fp32"),
                           protect=s.get("protect"), protected_ber=s.get("protected_ber", 0.0))


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load_side(spec: EngineSpec) -> dict:
    return json.loads(sidecar_path(spec).read_text())


# -- availability -------------------------------------------------------------------------------------------

_AVAILABLE: tuple[bool, str] | None = None


def available(refresh: bool = False) -> tuple[bool, str]:
    """Whether the bpf engine can run here: tools present, object built, bpffs mounted, program accepted by
    this kernel's verifier (a real load into a scratch pin directory, ~0.1 s; cached per process)."""
    global _AVAILABLE
    if _AVAILABLE is not None and not refresh:
        return _AVAILABLE
    _AVAILABLE = _probe()
    return _AVAILABLE


def _probe() -> tuple[bool, str]:
    if os.environ.get("TESTBED_BPF_ENGINE", "").lower() in ("off", "0", "no"):
        return False, "turned off by TESTBED_BPF_ENGINE=off"
    if os.geteuid() != 0:
        return False, "needs root"
    missing = build.missing_tools()
    if missing:
        pkgs = " ".join(sorted(set(missing.values())))
        return False, f"missing {', '.join(missing)} (apt-get install {pkgs})"
    try:
        obj = build.object_path()
        pins.ensure_bpffs()
    except Exception as e:
        return False, str(e)
    d = pins.PIN_ROOT / f"probe-{os.getpid()}"
    try:
        _load(obj, d)
    except Exception as e:
        return False, str(e)
    finally:
        pins.remove_pins(d)
    kernel = os.uname().release
    return True, f"tc program builds (clang), loads (bpftool) and is accepted by kernel {kernel}"


def selftest(netns: str, iface: str) -> str:
    """Load the program, configure it, attach it to `iface`'s egress in `netns` and detach it again (doctor)."""
    obj = build.object_path()
    pins.ensure_bpffs()
    d = pins.PIN_ROOT / f"probe-{os.getpid()}"
    att = {"netns": netns, "iface": iface, "hook": "egress"}
    try:
        _load(obj, d)
        with _Maps(d) as m:
            m.write_config(1, _slot(1, {"ber": 1e-6, "error_model": {"type": "bernoulli"}, "scope": "payload",
                                        "checksum": "fix", "seed": 0, "control_ports": []}, 0, True))
        attach(att, d)
        ok = attached(att)
    finally:
        detach(att)
        pins.remove_pins(d)
    if not ok:
        raise _error(f"tc shows no bpf filter on {iface} after attaching")
    return (f"tc program builds (clang), loads (bpftool), attaches (tc clsact) on kernel {os.uname().release}; "
            f"object {obj}")


def _load(obj: Path, pin_dir: Path) -> None:
    import subprocess

    pin_dir.mkdir(parents=True, exist_ok=True)
    # the programs (tb_flip; tb_apply, tb_keyed and tb_kapply, which libbpf puts into tb_progs for the tail
    # calls), pinned by name; tb_flip is the one tc attaches, as `prog`
    r = subprocess.run(["bpftool", "prog", "loadall", str(obj), str(pin_dir), "type", "classifier",
                        "pinmaps", str(pin_dir)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-12:]
        raise _error(f"bpftool could not load {obj.name} (kernel {os.uname().release}):\n" + "\n".join(tail))
    os.rename(pin_dir / "tb_flip", pin_dir / "prog")


# -- lifecycle ----------------------------------------------------------------------------------------------


def settings_of(spec: EngineSpec) -> dict:
    return {"ber": float(spec.ber), "error_model": dict(spec.error_model), "scope": spec.scope,
            "checksum": spec.checksum, "seed": int(spec.seed), "control_ports": sorted(spec.control_ports),
            "collectives": None if spec.collectives is None else list(spec.collectives), "element": spec.element,
            "protect": None if spec.protect is None else list(spec.protect), "protected_ber": float(spec.protected_ber)}


def start(spec: EngineSpec) -> dict:
    """Load, configure and attach; returns the handle's `bpf` record. Raises EngineError, leaving nothing."""
    spec = spec.validate()
    if not os.path.exists(spec.netns):
        raise _error(f"network namespace {spec.netns} does not exist")
    att, tx_site = sites(spec, spec.checksum)
    obj = build.object_path()
    pins.ensure_bpffs()
    pin_dir = pins.pin_dir_for(spec.stats_file)
    pins.remove_pins(pin_dir)  # a stale one (a killed run with the same stats path)
    Path(spec.stats_file).parent.mkdir(parents=True, exist_ok=True)
    spec.config_path().write_text(json.dumps(spec.to_dict(), indent=1))
    tx = None
    try:
        _load(obj, pin_dir)
        s = settings_of(spec)
        with _Maps(pin_dir) as m:
            m.write_config(1, _slot(1, s, 0, True))
        tx = _tx_off(tx_site) if _flips_possible(s) else None
        side = {"settings": s, "version": 1, "generation": 0, "attach": att, "tx_off": tx, "set_at": time.time(),
                "pin_dir": str(pin_dir), "object": str(obj)}
        write_json_atomic(sidecar_path(spec), side, indent=1)
        attach(att, pin_dir)
    except BaseException:
        try:
            detach(att)
        finally:
            _tx_restore(tx)
            pins.remove_pins(pin_dir)
        raise
    return {"pin_dir": str(pin_dir), "sidecar": str(sidecar_path(spec)), "attach": att, "tx_off": tx}


def _flips_possible(settings: dict) -> bool:
    """keep turns the sending end's transmit checksum offload off only while a frame can be flipped: at BER 0
    nothing is, and the offload stays on (no software segmentation at the sender, as without an engine)."""
    return float(settings["ber"]) > 0.0


def _side_or_handle(spec: EngineSpec, rec: dict) -> dict:
    try:
        return _load_side(spec)
    except (OSError, ValueError):
        return {"settings": settings_of(spec), "attach": rec.get("attach"), "tx_off": rec.get("tx_off"),
                "pin_dir": rec.get("pin_dir"), "version": 1, "generation": 0}


def stop(spec: EngineSpec, rec: dict) -> dict:
    """Detach, restore the offload, read the final counters, unpin. Idempotent."""
    side = _side_or_handle(spec, rec)
    pin_dir = Path(side.get("pin_dir") or rec.get("pin_dir") or pins.pin_dir_for(spec.stats_file))
    if side.get("attach"):
        detach(side["attach"])
    _tx_restore(side.get("tx_off"))
    final = None
    if (pin_dir / "tb_state").exists():
        try:
            final = _stats(spec, side, pin_dir)
        except OSError:
            final = None
    if final is None:
        try:
            final = json.loads(Path(spec.stats_file).read_text())
        except (OSError, ValueError):
            final = {"link": spec.link, "direction": spec.direction, "engine": "bpf"}
    final["alive"] = False
    final["exited_at"] = time.time()
    try:
        write_json_atomic(spec.stats_file, final, indent=1)
    except OSError:
        pass
    pins.remove_pins(pin_dir)
    return final


def alive(spec: EngineSpec, rec: dict) -> bool:
    side = _side_or_handle(spec, rec)
    pin_dir = Path(side.get("pin_dir") or rec.get("pin_dir") or "")
    return (pin_dir / "tb_state").exists() and bool(side.get("attach")) and attached(side["attach"])


def stats(spec: EngineSpec, rec: dict) -> dict:
    side = _side_or_handle(spec, rec)
    pin_dir = Path(side.get("pin_dir") or rec.get("pin_dir") or pins.pin_dir_for(spec.stats_file))
    if not (pin_dir / "tb_state").exists():
        try:
            d = json.loads(Path(spec.stats_file).read_text())
        except (OSError, ValueError):
            d = {"link": spec.link, "direction": spec.direction, "engine": "bpf"}
        d["alive"] = False
        d["error"] = f"bpf engine pins {pin_dir} are gone"
        return d
    d = _stats(spec, side, pin_dir)
    att = side.get("attach")
    # no process can die, but the filter can go (deleted by hand, the device gone): then the link passes clean,
    # and a run cannot claim the engine's BER (fail closed reads `alive`); a detach_engine() is no death
    d["alive"] = bool(side.get("detached")) or not att or attached(att)
    if not d["alive"]:
        d["error"] = f"its tc filter is gone from {att['iface']} {att['hook']} (the link passes clean)"
    return d


def _wall(ktime_ns: int) -> float:
    if not ktime_ns:
        return 0.0
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ktime_ns / 1e9)


def _stats(spec: EngineSpec, side: dict, pin_dir: Path) -> dict:
    with _Maps(pin_dir) as m:
        st = m.state()
        cn = m.counters()
        version = m.config_version()
    s = {"collectives": None, "element": "fp32", "protect": None, "protected_ber": 0.0, **side["settings"]}
    # flips below gen_pos are all drawn: a consistent pair; keyed flips (tb_keyed) count apart
    bits, flips = st["gen_pos"] + st["kbits"], st["gen_idx"] + st["kflips"]
    prot = None if not s["protect"] else {"element": s["element"], "protect": list(s["protect"]),
                                          "protected_ber": s["protected_ber"]}
    bits_exposed = bits - cn["bits_protected"]
    flips_exposed = flips - cn["flips_protected"]
    epochs = []
    eps = st["epochs"]
    for i, ep in enumerate(eps):
        nb = eps[i + 1]["start_bits"] if i + 1 < len(eps) else bits
        nf = eps[i + 1]["start_flips"] if i + 1 < len(eps) else flips
        eb, ef = nb - ep["start_bits"], nf - ep["start_flips"]
        epochs.append({"ber": ep["ber"], "since": _wall(ep["ktime"]), "bits_seen": eb, "bits_flipped": ef,
                       "realized_ber": ef / eb if eb else None, "protection": None, "bits_exposed": eb,
                       "bits_flipped_exposed": ef, "exposed_ber": ef / eb if eb else None})
    if st["applied"] != version and (not eps or eps[-1]["ber"] != s["ber"]):
        # set, not applied yet (no packet since): the epoch it will start, with nothing in it yet
        epochs.append({"ber": s["ber"], "since": side.get("set_at", 0.0), "bits_seen": 0, "bits_flipped": 0,
                       "realized_ber": None, "protection": None, "bits_exposed": 0, "bits_flipped_exposed": 0,
                       "exposed_ber": None, "pending": True})
    unparsed = {name: cn[k] for k, name in maps.UNPARSED.items() if cn[k]}
    ratio = flips / bits if bits else None
    d = {
        "engine": "bpf",
        "packets": cn["packets"], "bytes": cn["bytes"], "bits_seen": bits, "bits_flipped": flips, "realized_ber": ratio,
        "packets_modified": cn["packets_modified"], "packets_multiflip": cn["packets_multiflip"],
        "packets_unparsed": cn["packets_unparsed"], "unparsed_reasons": unparsed, "packets_truncated": 0,
        "packets_errors": cn["packets_errors"], "flows": cn["flows"], "flows_excluded": cn["flows_excluded"],
        "flows_desynced": cn["flows_desynced"], "flows_midstream": cn["flows_midstream"],
        "retransmitted_bits": cn["retransmitted_bits"],
        "retransmitted_flips": cn["retransmitted_flips"], "forgotten_bits": 0, "verdict_errors": 0,
        "bits_protected": cn["bits_protected"], "flips_protected": cn["flips_protected"],
        "flips_corrected": cn["flips_corrected"], "flips_sign": cn["flips_sign"],
        "flips_exponent": cn["flips_exponent"], "flips_mantissa": cn["flips_mantissa"],
        "bits_exposed": bits_exposed, "bits_flipped_exposed": flips_exposed,
        "exposed_ber": flips_exposed / bits_exposed if bits_exposed else None,
        "effective_ber": ratio,
        "protected_realized_ber": (cn["flips_protected"] / cn["bits_protected"]) if cn["bits_protected"] else None,
        "epochs": epochs,
        # the bpf engine's own
        "packets_gso": cn["packets_gso"], "keep_gso_passed": cn["keep_gso_passed"],
        "ring_overruns": cn["ring_overruns"], "flips_on_checksum": cn["flips_on_checksum"],
        "flips_applied": cn["flips_applied"], "ring_shared": cn["ring_shared"],
        "bits_gso": cn["bits_gso"], "flips_gso": cn["flips_gso"],
        "packets_unclone_failed": cn["packets_unclone_failed"], "hole_bits": cn["hole_bits"],
        "holes_lost": cn["holes_lost"], "bits_reserved": st["cursor"],
        "keyed": maps.keyed(s["scope"], s["error_model"]), "desync_out_of_order": cn["desync_out_of_order"],
        "stale_bits": cn["stale_bits"], "ranges_lost_bits": cn["ranges_lost_bits"], "header_bytes": cn["header_bytes"],
        "frames": cn["frames"], "data_frames": cn["data_frames"], "kflows_lost": cn["kflows_lost"],
        "tensor_holes": cn["tensor_holes"],
        "bad_sojourns": st["bad_sojourns"],
        "bad_sojourn_bits": st["bad_sojourn_bits"], "epochs_lost": st["epochs_lost"],
        "config_version": version, "config_applied": st["applied"],
        # settings and identity, as the NFQUEUE engine reports them
        "ber": s["ber"], "error_model": dict(s["error_model"]), "scope": s["scope"], "checksum": s["checksum"],
        "seed": s["seed"], "collectives": s["collectives"], "control_ports": list(s["control_ports"]),
        "element": s["element"], "protect": s["protect"], "protected_ber": s["protected_ber"],
        "gso": s["checksum"] == "fix", "fail_open": False,
        "topology": spec.topology, "link": spec.link, "direction": spec.direction, "pid": 0, "netns": spec.netns,
        "iface": spec.iface, "hook": spec.hook, "queue_num": None, "attached": side.get("attach"),
        "tx_checksum_off": side.get("tx_off"), "pin_dir": str(pin_dir),
    }
    return d


def set_settings(spec: EngineSpec, rec: dict, **settings) -> dict:
    """Change settings live (ber, error_model, scope, checksum, seed, control_ports). A change of checksum moves
    the program (see the module docstring). Returns the settings now in force; EngineError if refused."""
    settings = {k: v for k, v in settings.items() if v is not None}
    # restart (a warm sweep's next point): a new epoch. The program's flips are one stream per direction in
    # packet order (docs/engine.md, "Seeds and reproducibility"), so there is no fresh engine's stream to go back to
    restart = bool(settings.pop("restart", False))
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise _error(f"cannot set {sorted(unknown)} on a bpf engine; settable: {', '.join(SETTINGS)}")
    side_path = sidecar_path(spec)
    with _locked(side_path):
        side = _side_or_handle(spec, rec)
        cur = side["settings"]
        new = {**cur, **settings}
        try:
            probe = replace(spec, engine="bpf", ber=new["ber"], error_model=new["error_model"], scope=new["scope"],
                            checksum=new["checksum"], seed=new["seed"], control_ports=list(new["control_ports"]),
                            collectives=new.get("collectives"), element=new.get("element", "fp32"),
                            protect=new.get("protect"), protected_ber=new.get("protected_ber", 0.0),
                            capture=None).validate()
        except ValueError as e:
            raise _error(f"engine refused {settings}: {e}") from e
        new = settings_of(probe)
        rebuild = new["error_model"] != cur["error_model"] or new["seed"] != cur["seed"]
        new_epoch = rebuild or restart or new["ber"] != cur["ber"]
        # restart: keyed flips as a fresh engine's (generation 0: the same keys); the sequential stream only
        # starts a new epoch (its position is not a fresh engine's anyway)
        generation = 0 if restart and maps.keyed(new["scope"], new["error_model"]) else (
            side.get("generation", 0) + (1 if rebuild else 0))
        version = side.get("version", 1) + 1
        pin_dir = Path(side.get("pin_dir") or pins.pin_dir_for(spec.stats_file))
        moved = new["checksum"] != cur["checksum"]
        if moved:
            new_att, new_tx_site = sites(probe, new["checksum"])
        need_off = new["checksum"] == "keep" and _flips_possible(new)
        if not moved and new["checksum"] == "keep" and need_off and not side.get("tx_off"):
            # keep from BER 0 to a BER: frames must arrive segmented, with completed checksums, before any flip
            side["tx_off"] = _tx_off(sites(probe, "keep")[1])
        with _Maps(pin_dir) as m:
            m.write_config(version, _slot(version, new, generation, new_epoch))
        if moved:
            old_att, old_tx = side.get("attach"), side.get("tx_off")
            tx = None
            try:
                tx = _tx_off(new_tx_site) if need_off else None
                if old_att:
                    detach(old_att)
                _tx_restore(old_tx)
                attach(new_att, pin_dir)
            except BaseException:
                _tx_restore(tx)
                raise
            side["attach"], side["tx_off"] = new_att, tx
        elif not need_off and side.get("tx_off"):  # keep back to BER 0: the offload as it was
            _tx_restore(side["tx_off"])
            side["tx_off"] = None
        side.update(settings=new, version=version, generation=generation, set_at=time.time())
        write_json_atomic(side_path, side, indent=1)
    return dict(new)


def detach_engine(spec: EngineSpec, rec: dict) -> None:
    """Take the program off the link; a detached link is a clean link, so keep's transmit checksum offload change
    is undone too (a "no engine" measurement after a keep round measured the sender's software segmentation)."""
    _mark_detached(spec, True)
    side = _side_or_handle(spec, rec)
    if side.get("attach"):
        detach(side["attach"])
    _tx_restore(side.get("tx_off"))


def attach_engine(spec: EngineSpec, rec: dict) -> None:
    side = _side_or_handle(spec, rec)
    tx = side.get("tx_off")
    if tx and tx.get("was_on"):
        _tx_set(tx, False)
    attach(side["attach"], Path(side.get("pin_dir") or rec["pin_dir"]))
    _mark_detached(spec, False)


def _mark_detached(spec: EngineSpec, detached: bool) -> None:
    """Record in the sidecar that the program is off its link on purpose (stats() then does not call it dead)."""
    side_path = sidecar_path(spec)
    with _locked(side_path):
        try:
            side = _load_side(spec)
        except (OSError, ValueError):
            return
        side["detached"] = detached
        write_json_atomic(side_path, side, indent=1)


def u64_to_double(x: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", x))[0]


class FrameRunner:
    """The program loaded but attached nowhere, configured from an EngineSpec's settings, run on frames one at a
    time (BPF_PROG_TEST_RUN): the same program, maps and counters as on a link, fed packets chosen by a test
    (recorded gloo streams, cut and replayed at will). A context manager: the pins go on exit."""

    def __init__(self, spec: EngineSpec, pin_dir: Path):
        self.spec = spec.validate()
        self.pin_dir = Path(pin_dir)
        pins.ensure_bpffs()
        pins.remove_pins(self.pin_dir)
        _load(build.object_path(), self.pin_dir)
        with _Maps(self.pin_dir) as m:
            m.write_config(1, _slot(1, settings_of(self.spec), 0, True))
        self._fd = sc.obj_get(str(self.pin_dir / "prog"))

    def run(self, frame: bytes) -> bytes:
        """The frame as the program leaves it (it never drops one in fix mode: a drop raises)."""
        rc, out = sc.prog_test_run(self._fd, frame)
        if rc != 0:
            raise _error(f"the program returned {rc} for a frame of {len(frame)} bytes")
        return out

    def stats(self) -> dict:
        side = {"settings": settings_of(self.spec)}
        return _stats(self.spec, side, self.pin_dir)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        pins.remove_pins(self.pin_dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
