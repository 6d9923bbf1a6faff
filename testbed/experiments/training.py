"""Train GPT-2 across a testbed: the glue between a topology (hosts, links, engines) and the workloads
(testbed/train), which know nothing of either.

    summary = train(Topology.load("topologies/pair.yaml"), TrainSettings(mode="ddp", model="tiny", steps=20),
                    out="runs/x", ber=1e-4, scope="tensor")

One worker per host: DDP uses every host; PP puts stage i on the i-th host of the topology (chain4 lists them
in chain order, so activations cross one link per stage boundary). Rendezvous (TCPStore) and the clean
reference group go over the management network; gloo's data group binds the host's first data interface.
The engines' counters are read before and after, so the summary says how many bits the run's traffic lost.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from testbed import testbeds
from testbed.base import BaseTestbed
from testbed.locate.launcher import monitoring
from testbed.engine.counters import COUNTER_FIELDS, FIELD_COUNTERS, PROFILE_COUNTERS
from testbed.net import MGMT_IFNAME
from testbed.state import write_json_atomic
from testbed.topology.topo import Topology
from testbed.train.model import PRESETS
from testbed.train.settings import TrainSettings




def worker_hosts(topo: Topology, cfg: TrainSettings) -> list[str]:
    hosts = topo.hosts[: cfg.hosts] if cfg.hosts else topo.hosts
    if len(hosts) < 2:
        raise ValueError(f"topology {topo.name} has {len(hosts)} host(s); training needs at least 2")
    return hosts


def prepare_data(cfg: TrainSettings, log=print) -> None:
    """Download/tokenize once on this machine: hosts have no route to the package index, and they share the
    cache (the netns hosts see this file system; containers mount the cache)."""
    from testbed.train.data import prepare

    prepare(PRESETS[cfg.model].vocab_size, cfg.data, log=log)


def train_on(tb: BaseTestbed, cfg: TrainSettings, out: str | Path, log=print, pool=None, port=None) -> dict:
    """Run the workers on a topology that is up; return the summary (also written to out/summary.json).
    `pool`: warm worker services (testbed/experiments/warm.py) instead of fresh workers; `port`: the
    rendezvous port (default: the topology's first control port)."""
    from testbed.train.launch import run_workers

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    topo = tb.topo
    hosts = worker_hosts(topo, cfg)
    if cfg.mode == "pp":
        _check_chain(topo, hosts, log)
    prepare_data(cfg, log=lambda m: log(f"data: {m}"))
    before = tb.counters()
    started = time.time()
    log(f"training {cfg.mode} {cfg.model} on {tb.describe_ranks(hosts)}, {cfg.steps} steps")
    with tb.workers(out, hosts, PASSED_ENV) as workers:
        workers.prepare_data(cfg.model, cfg.data)
        with monitoring(tb, cfg, workers.run_dir, hosts):  # --monitor: the engines' counters while it runs
            summary = run_workers(pool.spawn if pool else workers.spawn, len(hosts), cfg.worker_argv(),
                                  workers.run_dir, _rank_env(tb, hosts, port), timeout_s=cfg.run_timeout,
                                  stall_timeout_s=cfg.stall_timeout, log=log)
    _finish(tb, summary, before, hosts, started, cfg)
    summary.update(workers.facts)  # where it ran: the image (docker), the machines (across machines)
    write_json_atomic(out / "summary.json", summary)
    return summary


# What the workers get of the launcher's environment
PASSED_ENV = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TESTBED_MGMT_IFNAME", "RANK", "WORLD_SIZE",
              "PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "TESTBED_CACHE", "TESTBED_TORCH_THREADS")


def _rank_env(tb, hosts: list[str], port=None):
    topo, master, port = tb.topo, tb.mgmt_address(hosts[0]), str(port or tb.topo.control_ports[0])

    def env_for_rank(rank: int) -> dict:
        h = hosts[rank]
        return {"MASTER_ADDR": master, "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": topo.plan.data_iface(h),
                "TESTBED_MGMT_IFNAME": MGMT_IFNAME, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}

    return env_for_rank


def _finish(tb, summary: dict, before: dict, hosts: list[str], started: float, cfg: TrainSettings) -> None:
    """The engines' part of a run's summary, the failure taxonomy, and fail-closed on a dead engine."""
    topo = tb.topo
    engines = list(tb.counters_since(before, fields=COUNTER_FIELDS + FIELD_COUNTERS + PROFILE_COUNTERS).values())
    seen = sum(e["bits_seen"] for e in engines)
    flipped = sum(e["bits_flipped"] for e in engines)
    blame_the_wire(summary, flipped)
    summary.update({
        "topology": topo.name, "topology_file": topo.file, "runtime": tb.runtime_name, "hosts": hosts,
        "ber": sorted({e["ber"] for e in engines if e["ber"] is not None}) or [0.0],
        "bits_seen": seen, "bits_flipped": flipped, "realized_ber": flipped / seen if seen else None,
        # packets the kernel dropped on the way to an NFQUEUE engine: loss the engine caused, never link loss
        "queue_dropped": sum(e.get("queue_dropped") or 0 for e in engines),
        "user_dropped": sum(e.get("user_dropped") or 0 for e in engines),
        "engines": engines, "config": dataclasses.asdict(cfg), "started_at": started,
    })
    dead = [f"{e['link']} {e['direction']}" + (f" ({e['error']})" if e.get("error") else "")
            for e in engines if not e["alive"]]
    if dead:
        # Fail closed: a dead engine dropped its link's traffic; the run cannot claim it saw corruption.
        summary.setdefault("status_workers", summary["status"])
        summary["status"] = "invalid"
        summary["reason"] = f"corruption engine died on {', '.join(dead)}; " + (summary.get("reason") or "")


def blame_the_wire(summary: dict, flipped: int) -> None:
    """The failure taxonomy (docs/training.md): a worker that fails after corrupted bytes reached it failed
    because of the wire. A run that ends in `error` once training started becomes `crashed` when the engines
    flipped bits during the run; the workers are stopped within seconds of the first failure, so the flips
    came before it. With no flips, or a failure in set-up, it stays `error`: the wire cannot explain it."""
    if summary["status"] != "error" or flipped <= 0:
        return
    failed = [(int(r), w) for r, w in sorted(summary.get("worker_status", {}).items())
              if w.get("status") == "error" and w.get("step") is not None]
    if not failed:
        return
    rank, w = failed[0]
    summary["status_workers"] = summary["status"]
    summary["status"] = "crashed"
    summary["reason"] = (f"wire: {flipped:,} bits flipped before rank {rank} failed at step {w['step']}: "
                         f"{summary.get('reason') or w.get('reason')}")


def _check_chain(topo: Topology, hosts: list[str], log) -> None:
    linked = {frozenset((l.a.node, l.b.node)) for l in topo.links}
    far = [f"{a}-{b}" for a, b in zip(hosts, hosts[1:]) if frozenset((a, b)) not in linked]
    if far:
        log(f"note: pipeline neighbours {', '.join(far)} share no direct link; their traffic is routed over "
            "several links")


# What `scope: tensor` corrupts by default when training: the traffic under study (DDP: gradient allreduce;
# PP: activations and their gradients, point-to-point). The rest of gloo's payload is framework metadata, e.g.
# DDP's broadcast of its rebuilt bucket layout after step 0: corrupting that yields garbage indices and an
# error that says nothing about training under bit errors. `--collectives` overrides it.
DEFAULT_COLLECTIVES = {"ddp": ["allreduce"], "pp": ["p2p"]}


def train(topology: Topology | str, cfg: TrainSettings, out: str | Path, *, ber: float | None = None,
          scope: str | None = None, checksum: str | None = None, collectives: list[str] | None = None,
          protect: list[str | int] | None = None, element: str | None = None, protected_ber: float | None = None,
          profile: str | None = None, delay: float | None = None, runtime: str | None = None,
          name: str | None = None, machines=None, log=print, warm=None) -> dict:
    """Train on a topology: a Topology (brought up for the run, then down; across the machines of the inventory
    `machines` if given) or the name of one that is up (corruption overrides are applied live with `link
    set`). `collectives` defaults to cfg.collectives. `warm` (a warm.WarmSweep): run a Topology's point on
    the sweep's topology and worker services that stay up (not across machines). `profile`: a link layer on
    every link (testbed/linklayer.py), `ber` then the pre-FEC BER; `delay` (s): one-way delay on every link
    direction (netem, on a topology brought up for the run)."""
    collectives = collectives if collectives is not None else cfg.collectives
    if scope == "tensor" and collectives is None:
        collectives = DEFAULT_COLLECTIVES[cfg.mode]
        if cfg.monitor and "p2p" not in collectives:  # the monitor's probes are p2p: corrupt them like training
            collectives = [*collectives, "p2p"]
    overrides = {"ber": ber, "scope": scope, "checksum": checksum, "collectives": collectives,
                 "protect": protect, "element": element, "protected_ber": protected_ber, "profile": profile,
                 "delay": None if delay is None else f"{delay * 1e9:.6g}ns"}
    if delay is not None and (cfg.injector == "process" or isinstance(topology, str)):
        raise ValueError("delay is set on the links of a topology brought up for the run (netem): "
                         + ("injector process has no links" if cfg.injector == "process" else
                            f"topology {topology!r} is up already; give its file"))
    if cfg.injector == "process":  # no topology brought up: the error models run inside the workers
        if machines is not None:
            raise ValueError("injector process runs its workers on this machine: --machines does not apply")
        return train_process(topology, cfg, out, overrides, log=log, warm=warm)
    if isinstance(topology, str):  # a topology that is up: the overrides are set live on every link
        if cfg.link_seed == "run":  # its links keep the seeds they have: mixing live would outlast the run
            raise ValueError(f"link_seed run: topology {topology!r} is up and keeps its links' seeds; give the "
                             "topology file (brought up for the run), or set the seeds with `testbed link set`")
        tb = testbeds.attach(topology)
        try:
            settings = {k: v for k, v in overrides.items() if v is not None}
            if settings.get("profile") is not None:  # what the engines take: the profile as their error model
                settings["error_model"] = {"type": "profile", "profile": settings.pop("profile")}
            if settings:
                for link in tb.topo.links:
                    tb.set_link(link.name, **settings)
            return train_on(tb, cfg, out, log=log)
        finally:
            tb.close()
    topo = topology.with_overrides(name=name, runtime=runtime, **overrides)
    if cfg.link_seed == "run":
        topo = topo.with_run_seed(cfg.seed)
    if warm is not None and machines is None:
        return warm.train(topo, cfg, out, runtime=runtime, log=log)
    # up for the run (across the machines of the inventory `machines`, if given), then down
    with testbeds.create(topo, machines, runtime=runtime, results_dir=out, log=log) as tb:
        return train_on(tb, cfg, out, log=log)


def outcome_word(s: dict) -> str:
    """The status, qualified when it says less than the run did: an `ok` run that made no progress (see
    made_progress in docs/training.md) is never a plain `ok`."""
    if s["status"] != "ok" or s.get("made_progress") is True:
        return s["status"]
    if s.get("made_progress") is None:  # e.g. no eval and a non-finite training loss at step 0
        return "ok (progress unknown: no finite loss to compare)"
    skipped, done = s.get("skipped_steps") or 0, s.get("steps_completed", 0)
    if skipped:
        return f"ok (no progress: {skipped}/{done} updates skipped)"
    basis = "eval" if s.get("progress_basis") == "eval" else "training"
    first, last = (s.get("initial_eval_loss"), s.get("final_eval_loss")) if basis == "eval" else (
        s.get("initial_loss"), s.get("final_loss"))
    return f"ok (no progress: {basis} loss {_loss(first)} -> {_loss(last)})"


def _loss(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def summary_line(s: dict) -> str:
    done = s.get("steps_completed", 0)
    parts = [f"{done}/{s.get('steps_requested', '?')} steps", f"final loss {_loss(s.get('final_loss'))}"]
    if s.get("initial_eval_loss") is not None:
        parts.append(f"eval {_loss(s['initial_eval_loss'])} -> {_loss(s['final_eval_loss'])}")
    if s.get("skipped_steps"):
        parts.append(f"skipped {s['skipped_steps']}/{done}")
    for key, word in (("sanitized_values", "sanitized"), ("frozen_values", "frozen")):
        if s.get(key):
            parts.append(f"{word} {s[key]:,}")
    parts.append(f"bits flipped {s.get('bits_flipped', 0):,} of {s.get('bits_seen', 0):,} eligible")
    dropped = (s.get("queue_dropped") or 0) + (s.get("user_dropped") or 0)
    if dropped:
        parts.append(f"{dropped:,} packets dropped by the kernel on the way to an engine (engine-caused loss)")
    return f"{outcome_word(s)}: " + ", ".join(parts) + (f" ({s['reason']})" if s.get("reason") else "")


# -- the process injector (testbed/train/inject.py): the same training, errors applied inside the workers --


def train_process(topology, cfg, out, overrides, log=print, warm=None):
    """Run a training with the process injector: the topology's hosts give the world size, its link directions
    (with `overrides` applied, as the wire's run would) each hop's settings; workers run here on loopback
    (on `warm`'s local worker services, if given)."""
    import json

    from testbed.train.inject import hop_settings, resolve_device
    from testbed.train.launch import local_spawn, loopback_env, run_workers

    if not isinstance(topology, Topology):
        raise ValueError(f"injector process needs a topology file (for its hosts and link settings), not the name "
                         f"of a topology that is up ({topology})")
    collectives = overrides.get("collectives")
    if collectives is not None and sorted(collectives) != DEFAULT_COLLECTIVES[cfg.mode]:
        raise ValueError(f"injector process corrupts {DEFAULT_COLLECTIVES[cfg.mode][0]} traffic in {cfg.mode}; "
                         f"collectives {','.join(collectives)} is not modelled")
    if cfg.device == "cuda":
        resolve_device("cuda")  # fail here, clearly, before any worker starts
    topo = topology.with_overrides(**{k: v for k, v in overrides.items() if k != "collectives"})
    hosts = worker_hosts(topo, cfg)
    hops = hop_settings(topo, hosts, cfg.mode)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("inject-rank*.json"):
        p.unlink()
    prepare_data(cfg, log=lambda m: log(f"data: {m}"))
    bers = sorted({h["ber"] for h in hops})
    log(f"training {cfg.mode} {cfg.model} with the process injector ({len(hosts)} local ranks on loopback, "
        f"{cfg.device}; hops of {topo.name}: BER {', '.join(f'{b:g}' for b in bers)}), {cfg.steps} steps")
    argv = cfg.worker_argv() + ["--inject-hops", json.dumps(hops)]
    started = time.time()
    spawn = warm.local(len(hosts)).spawn if warm is not None else local_spawn(out)
    summary = run_workers(spawn, len(hosts), argv, out, loopback_env(), timeout_s=cfg.run_timeout,
                          stall_timeout_s=cfg.stall_timeout, log=log)
    engines = hop_counters(out, hops)
    seen = sum(e["bits_seen"] for e in engines)
    flipped = sum(e["bits_flipped"] for e in engines)
    blame_the_wire(summary, flipped)
    summary.update({
        "topology": topo.name, "topology_file": topo.file, "runtime": "loopback", "injector": "process",
        "hosts": hosts, "ber": bers, "bits_seen": seen, "bits_flipped": flipped,
        "realized_ber": flipped / seen if seen else None, "engines": engines,
        "config": dataclasses.asdict(cfg), "started_at": started})
    write_json_atomic(out / "summary.json", summary)
    return summary


def hop_counters(run_dir, hops):
    """Per hop, the counters its receiver saved, in the fields the wire's engines report (COUNTER_FIELDS,
    FIELD_COUNTERS); packets and flows do not exist here (null)."""
    import json

    from testbed.engine.protect import FIELDS

    saved = {}
    for p in Path(run_dir).glob("inject-rank*.json"):
        try:
            for h in json.loads(p.read_text())["hops"]:
                saved[(h["src"], h["dst"])] = h
        except (OSError, ValueError, KeyError):
            continue
    out = []
    for h in hops:
        c = saved.get((h["src"], h["dst"]), {})
        seen = c.get("bits_seen", 0)
        out.append({"link": h["link"], "direction": h["direction"], "alive": True, "ber": h["ber"],
                    "scope": "tensor", "checksum": "fix", "bits_seen": seen, "bits_flipped": c.get("bits_flipped", 0),
                    "bits_exposed": seen - c.get("bits_protected", 0), "flips_protected": c.get("flips_protected", 0),
                    **{f"flips_{f}": c.get(f"flips_{f}", 0) for f in FIELDS},
                    "packets_modified": None, "flows_desynced": None})
    return out
