"""Commands of the experiment layer: `train`, `run`, `report`, `bench latency`, `bench collective`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from testbed.train import settings
from testbed.vocab import CHECKSUM_MODES, ELEMENT_TYPES, SCOPES


def _ber(text: str) -> float:
    from testbed.topology.units import parse_probability
    try:
        return parse_probability(text, upper=0.5)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_train(args) -> int:
    from testbed.topology.topo import Topology
    from testbed.experiments.training import summary_line, train

    try:
        cfg = settings.from_args(args)
    except ValueError as e:
        print(f"testbed train: {e}", file=sys.stderr)
        return 2
    if os.path.exists(args.topology):
        target = Topology.load(args.topology, name=args.name)
    else:
        from testbed.state import running_names

        if args.topology not in running_names():
            print(f"testbed train: {args.topology}: no such topology file, and no topology of that name is up "
                  "(see `testbed status`)", file=sys.stderr)
            return 2
        target = args.topology  # the name of a topology that is up
    protect = [p.strip() for p in args.protect.split(",") if p.strip()] if args.protect is not None else None
    machines = None
    if args.machines:
        from testbed.machines.inventory import load_inventory

        if not isinstance(target, Topology):
            print("testbed train: --machines needs a topology file (a topology that is up is already placed)",
                  file=sys.stderr)
            return 2
        machines = load_inventory(args.machines)
    s = train(target, cfg, args.out, ber=args.ber, scope=args.scope, checksum=args.checksum, runtime=args.runtime,
              protect=protect, element=args.element, protected_ber=args.protected_ber, machines=machines,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(s, indent=2, default=str))
    else:
        print(summary_line(s))
        print(f"run directory: {os.path.abspath(args.out)} (metrics.jsonl, summary.json)")
    return 0 if s["status"] == "ok" else 1


def cmd_run(args) -> int:
    from testbed.experiments.spec import Experiment

    exp = Experiment.load(args.experiment)  # bad input is refused before the runner (and torch) is imported
    machines = None
    if args.machines:
        from testbed.machines.inventory import load_inventory

        machines = load_inventory(args.machines)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()] if args.recipes else None
    if args.detach and args.executor != "slurm":
        print("testbed run: --detach needs --executor slurm (local jobs end with their controller)", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"testbed run: -j {args.jobs}: give 1 or more points at once", file=sys.stderr)
        return 2
    import fnmatch

    chosen = [p for p in exp.points() if not recipes or any(fnmatch.fnmatchcase(p.recipe, r) for r in recipes)]
    if args.executor == "local" and any(exp.train_settings(p).device == "cuda" for p in chosen):
        # refused before any point runs (each would end in an error row); a Slurm job's node may have a GPU
        from testbed.train.inject import resolve_device

        try:
            resolve_device("cuda")
        except RuntimeError as e:
            print(f"testbed run: {args.experiment}: {e}", file=sys.stderr)
            return 3
    try:
        resources = resources_of(exp, args)
        if args.executor == "slurm" or args.jobs > 1:
            from testbed.experiments.executors import run_experiment_jobs

            if machines is not None:
                print("testbed run: --machines spreads one topology over machines; it does not combine with "
                      "--executor slurm or -j", file=sys.stderr)
                return 2
            rows = run_experiment_jobs(exp, args.out, executor=args.executor, jobs=args.jobs, runtime=args.runtime,
                                       retry_failed=args.retry_failed, resources=resources, detach=args.detach,
                                       recipes=recipes)
        else:
            from testbed.experiments.runner import run_experiment

            rows = run_experiment(exp, args.out, runtime=args.runtime, retry_failed=args.retry_failed,
                                  machines=machines, cold=args.cold, recipes=recipes)
    except ValueError as e:
        print(f"testbed run: {e}", file=sys.stderr)
        return 2
    # a part (--recipes) leaves the other recipes' points pending on purpose; only queued jobs are announced
    pending = 0 if recipes or (args.executor == "local" and args.jobs == 1) else len(exp.points()) - len(rows)
    if pending:
        print(f"{pending} points still queued or running: run the same command again to collect them")
    from testbed.report.report import write_report

    report = write_report(args.out, planned=exp.planned())  # the grid already loaded, not its copy again
    ok = sum(1 for r in rows if r["status"] == "ok")
    print(f"{len(rows)} points ({ok} ok) in {os.path.abspath(args.out)}/results.jsonl")
    print(f"report: {report}")
    return 0


RESOURCE_FLAGS = ("cpus", "gpus", "mem", "time", "partition", "account")


def resources_of(exp, args):
    """The experiment's `resources:` with the flags over it (ValueError naming a bad flag or --sbatch)."""
    from pydantic import ValidationError

    from testbed.experiments.spec import ResourcesSpec
    from testbed.topology.yamlfile import pydantic_problems

    update = {("memory" if k == "mem" else k): getattr(args, k) for k in RESOURCE_FLAGS if getattr(args, k) is not None}
    extra = dict(exp.spec.resources.sbatch)
    for opt in args.sbatch or []:
        key, eq, value = opt.partition("=")
        if not key.strip().lstrip("-"):
            raise ValueError(f"--sbatch {opt!r}: give NAME=VALUE (or NAME for a flag), e.g. --sbatch qos=high")
        extra[key.strip().lstrip("-")] = value if eq else True
    try:
        return ResourcesSpec(**{**exp.spec.resources.model_dump(), **update, "sbatch": extra})
    except ValidationError as e:  # only a flag can be wrong here: the file's resources were checked on loading
        flags = {"memory": "--mem"}
        raise ValueError("; ".join(f"{flags.get(field, '--' + field)}: {msg}"
                                   for field, msg in pydantic_problems(e))) from None


def cmd_report(args) -> int:
    from testbed.report.report import write_report

    if not any(os.path.exists(os.path.join(args.dir, f)) for f in ("results.jsonl", "summary.csv")):
        print(f"testbed: {args.dir} has no results.jsonl (run `testbed run EXPERIMENT --out {args.dir}` first)",
              file=sys.stderr)
        return 2
    from testbed.experiments.spec import planned_points

    print(f"report: {write_report(args.dir, planned=planned_points(args.dir))}")
    return 0


def register(sub) -> None:
    from testbed.bench.commands import register_bench

    register_bench(sub)
    s = sub.add_parser("run", help="run an experiment (a grid of training points) and write its report",
                       description="Run every point of EXPERIMENT's grid (BER x mode x scope x checksum x seed), one "
                                   "after another (or -j N at once, or as Slurm jobs: docs/cluster.md); then summary.csv, plots and "
                                   "report.md. "
                                   "Results are saved after every point: interrupt with Ctrl-C and run the same "
                                   "command again to finish only the missing points. See experiments/quick.yaml.")
    s.add_argument("experiment", metavar="EXPERIMENT.yaml")
    s.add_argument("--out", required=True, metavar="DIR")
    s.add_argument("--runtime", choices=["netns", "docker"], help="override the experiment's runtime")
    s.add_argument("--retry-failed", action="store_true", help="also re-run points that did not end ok")
    s.add_argument("--cold", action="store_true", help="a fresh topology and fresh workers for every point (default: "
                   "warm, the points of one topology, runtime and mode on one topology and workers that stay up; "
                   "--machines is always cold)")
    s.add_argument("--machines", metavar="FILE", help="inventory of machines: every point's topology is placed "
                   "across them (docs/machines.md); each row records where every host ran")
    s.add_argument("--recipes", metavar="PATTERNS", help="only the points of these recipes (comma-separated shell "
                   "patterns, e.g. 'tiny*,small*') and their clean points: a long experiment in parts; the report "
                   "covers every point in --out")
    g = s.add_argument_group("executors (docs/cluster.md)")
    g.add_argument("--executor", choices=["local", "slurm"], default="local",
                   help="local: on this machine (default); slurm: a Slurm job per point through submitit, from a "
                        "login node, the venv and DIR on a shared file system")
    g.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                   help="local: up to N points at once, each a process with its own topology, the CPUs split "
                        "between them (default 1: one after another, warm)")
    g.add_argument("--detach", action="store_true", help="slurm: submit and return (Ctrl-C leaves the jobs "
                   "running too); the same command later collects them")
    g.add_argument("--cpus", type=int, help="slurm: CPUs per point (overrides resources.cpus)")
    g.add_argument("--gpus", type=int, help="slurm: GPUs per point (resources.gpus; device: cuda asks 1 by default)")
    g.add_argument("--mem", help="slurm: memory per point, e.g. 16G (resources.memory)")
    g.add_argument("--time", type=int, metavar="MIN", help="slurm: time limit per point in minutes (resources.time)")
    g.add_argument("--partition", help="slurm: partition (resources.partition)")
    g.add_argument("--account", help="slurm: account (resources.account)")
    g.add_argument("--sbatch", action="append", metavar="NAME=VALUE", help="slurm: another sbatch option (repeat; "
                   "added to resources.sbatch), e.g. --sbatch qos=high")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("report", help="rebuild plots and report from results",
                       description="Rebuild summary.csv, the plots and report.md of DIR from its results.jsonl (and "
                                   "latency.json) alone; from summary.csv where only that was kept (the analysis, "
                                   "not the plots). The verdicts use the tolerance the rows record.")
    s.add_argument("dir", metavar="DIR")
    s.set_defaults(fn=cmd_report)


    s = sub.add_parser("train", help="train GPT-2 across a topology",
                       description="Train GPT-2 with DDP (one rank per host) or PP (one stage per host, in the "
                                   "topology's host order) over gloo across the testbed's links. TOPOLOGY is a "
                                   "YAML file (brought up for the run and down after) or the name of a topology "
                                   "that is up. Writes metrics.jsonl and summary.json (status ok, crashed, hung, "
                                   "diverged, invalid or error) to --out. Exit 0 only when the status is ok.")
    s.add_argument("topology", metavar="TOPOLOGY")
    s.add_argument("--out", required=True, metavar="DIR", help="run directory (metrics.jsonl, summary.json)")
    s.add_argument("--ber", type=_ber, help="override every link's bit error rate (both directions)")
    s.add_argument("--scope", choices=SCOPES, help="override every link's scope")
    s.add_argument("--checksum", choices=CHECKSUM_MODES, help="override every link's checksum mode")
    s.add_argument("--protect", metavar="FIELDS", help="scope tensor: bits of each value every link protects, e.g. "
                   "sign,exponent (field names or bit positions, 0 = LSB); '' protects nothing")
    s.add_argument("--element", choices=ELEMENT_TYPES, help="scope tensor: the values' type (default fp32)")
    s.add_argument("--protected-ber", type=_ber, help="scope tensor: residual BER of protected bits (default 0, "
                   "at most --ber)")
    s.add_argument("--runtime", choices=["netns", "docker"])
    s.add_argument("--name", help="topology name to bring the file up under")
    s.add_argument("--machines", metavar="FILE", help="inventory of machines: bring the topology up across them "
                   "for the run (docs/machines.md)")
    s.add_argument("--json", action="store_true", help="print the whole summary as JSON")
    settings.add_arguments(s.add_argument_group("training settings (testbed/train/settings.py)"))
    s.set_defaults(fn=cmd_train)
