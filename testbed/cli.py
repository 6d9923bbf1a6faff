"""The `testbed` command. Thin: parses arguments, calls the Python API, prints, and maps failures to exit
codes (0 ok, 1 failure, 2 bad input, 3 something this machine lacks)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading

from testbed import __version__
from testbed.errors import EXIT_CAPABILITY, EXIT_FAIL, EXIT_INPUT, CliError  # noqa: F401 (re-exported)
from testbed.linklayer import PROFILE_NAMES
from testbed.vocab import CHECKSUM_MODES, ELEMENT_TYPES, ERROR_MODELS, SCOPES


# -- helpers ---------------------------------------------------------------------------------------------------


def _attach(name: str | None):
    """The testbed of topology `name`, or of the only one that is up."""
    from testbed import testbeds
    from testbed.state import running_names

    if name is None:
        names = running_names()
        if not names:
            raise CliError("no topology is up (testbed up FILE)")
        if len(names) > 1:
            raise CliError(f"several topologies are up ({', '.join(names)}): choose one with --topo", EXIT_INPUT)
        name = names[0]
    try:
        return testbeds.attach(name)
    except LookupError as e:
        raise CliError(str(e), EXIT_INPUT) from None


def _inventory(path):
    from testbed.machines.inventory import load_inventory

    return load_inventory(path)  # InputError (exit 2) names the file, line and field


# -- commands --------------------------------------------------------------------------------------------------


def cmd_up(args) -> int:
    from testbed import testbeds

    capture = {"dir": os.path.abspath(args.capture), "max_bytes": int(args.capture_limit * 1e6)} if args.capture else None
    tb = testbeds.create(args.file, _inventory(args.machines) if args.machines else None, name=args.name,
                         runtime=args.runtime, capture=capture, results_dir=args.out, engine_procs=args.engine_procs,
                         vxlan_port=args.vxlan_port)
    tb.up()
    print(tb.describe())
    print(f"\nup. Run commands with `testbed exec --topo {tb.name} HOST -- CMD`; remove with `testbed down {tb.name}`.")
    return 0


def cmd_down(args) -> int:
    from testbed import testbeds

    if args.all:
        done = testbeds.down_all(_inventory(args.machines) if args.machines else None)
        for n in done["topologies"]:
            print(f"down: {n}")
        for s in done["swept"]:
            print(f"removed leftover: {s}")
        if not done["topologies"] and not done["swept"] and not done["errors"]:
            print("nothing of the testbed was running")
        for e in done["errors"]:
            print(f"  could not clean: {e}", file=sys.stderr)
        return EXIT_FAIL if done["errors"] else 0
    if not args.names:
        raise CliError("name a topology (testbed down NAME) or use --all", EXIT_INPUT)
    from testbed.topology.schema import TOPOLOGY_NAME_RE

    rc = 0
    for name in args.names:
        if not TOPOLOGY_NAME_RE.match(name):  # no topology has it; '' would match every topology's leftovers
            print(f"no topology named {name!r} is up (names are 1-24 characters of a-z, 0-9, '_' or '-')",
                  file=sys.stderr)
            rc = EXIT_INPUT
            continue
        result = testbeds.down(name)
        if not result["found"]:
            print(f"no topology named {name!r} is up", file=sys.stderr)
            rc = EXIT_INPUT
            continue
        errors = result.get("errors", [])
        print(f"down: {name}" + (" (incomplete)" if errors else "")
              + (f" (final counters in {result['stats_file']})" if result.get("stats_file") else ""))
        for e in errors:
            print(f"  could not remove: {e} (state kept: run `testbed down {name}` again)", file=sys.stderr)
            rc = rc or EXIT_FAIL
    return rc


def cmd_status(args) -> int:
    from testbed import testbeds
    from testbed.net import text_table
    from testbed.state import running_names

    names = [args.topo] if args.topo else running_names()
    if args.topo and args.topo not in running_names():
        raise CliError(f"no topology named {args.topo!r} is up (see `testbed status`)", EXIT_INPUT)
    result = [testbeds.status(n) for n in names]
    rc = 0 if all(s["healthy"] for s in result) else EXIT_FAIL
    if args.json:
        print(json.dumps(result, indent=2))
        return rc
    if not result:
        print("no topology is up")
        return 0
    rows = []
    for s in result:
        eng = f"{sum(e['alive'] for e in s['engines'])}/{len(s['engines'])} alive" if s["engines"] else "-"
        where = f"{s['runtime']} on {len(s['machines'])} machines" if s.get("machines") else s["runtime"]
        rows.append([s["name"], s["phase"], where, len(s["hosts"]), eng, "ok" if s["healthy"] else "PROBLEM",
                     s["file"] or "-"])
    print(text_table(rows, ["topology", "phase", "runtime", "hosts", "engines", "health", "file"]))
    for s in result:
        for p in s["problems"]:
            print(f"{s['name']}: {p}")
    return rc


def cmd_exec(args) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CliError("give a command after the host: testbed exec HOST -- CMD ...", EXIT_INPUT)
    tb = _attach(args.topo)
    try:
        return tb.exec_interactive(args.host, argv)
    except KeyError as e:
        raise CliError(str(e.args[0]), EXIT_INPUT) from None
    except FileNotFoundError:
        raise CliError(f"{argv[0]} not found") from None
    finally:
        tb.close()


def cmd_doctor(args) -> int:
    from testbed.doctor import report, run_checks

    checks = run_checks()
    if args.json:
        print(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        print(report(checks))
    return 0 if all(c.ok for c in checks if c.essential) else EXIT_FAIL


def cmd_stats(args) -> int:
    from testbed.net import text_table

    tb = _attach(args.topo)
    try:
        stats = tb.stats()
    finally:
        tb.close()
    rc = 0 if all(s.get("alive", True) for s in stats) else EXIT_FAIL
    if args.json:
        print(json.dumps(stats, indent=2))
        return rc
    if not stats:
        print(f"topology {tb.name} has no corruption engine (no link sets a ber)")
        return 0
    rows = []
    for s in stats:
        rows.append([s.get("link"), s.get("direction"), "yes" if s.get("alive", True) else "DEAD", f"{s.get('ber', 0):g}",
                     s.get("packets", 0), s.get("bits_seen", 0), s.get("bits_flipped", 0),
                     f"{s.get('realized_ber') or 0:.3g}", s.get("packets_modified", 0), s.get("packets_unparsed", 0),
                     s.get("flows_excluded", 0), _dropped(s)])
    print(text_table(rows, ["link", "direction", "alive", "ber", "packets", "bits_seen", "bits_flipped", "realized",
                            "modified", "unparsed", "excluded", "engine_dropped"]))
    if any(s.get("queue_dropped") or s.get("user_dropped") for s in stats):
        print("engine_dropped: packets the kernel dropped because an NFQUEUE engine fell behind (queue full / "
              "socket overrun), not link loss; --json has queue_dropped and user_dropped apart")
    return rc


def _dropped(s: dict) -> str:
    """queue_dropped + user_dropped, or "-" where the engine has no queue (bpf) or the counters are unknown."""
    q, u = s.get("queue_dropped"), s.get("user_dropped")
    return "-" if q is None and u is None else str((q or 0) + (u or 0))


def cmd_link_set(args) -> int:
    from testbed.topology.units import parse_probability

    settings = {}
    if args.ber is not None:
        try:
            settings["ber"] = parse_probability(args.ber, upper=0.5)
        except ValueError as e:
            raise CliError(f"--ber: {e}", EXIT_INPUT) from None
    if args.protected_ber is not None:
        try:
            settings["protected_ber"] = parse_probability(args.protected_ber, upper=0.5)
        except ValueError as e:
            raise CliError(f"--protected-ber: {e}", EXIT_INPUT) from None
    for key in ("scope", "checksum", "seed", "element"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.protect is not None:  # '' protects nothing
        settings["protect"] = [p.strip() for p in args.protect.split(",") if p.strip()]
    if args.error_model:
        settings["error_model"] = _error_model_arg(args)
    if args.profile is not None or args.pre_fec_ber is not None:
        if args.profile is None or args.pre_fec_ber is None:
            raise CliError("--profile and --pre-fec-ber go together (the link layer and the physical link's BER "
                           "before it)", EXIT_INPUT)
        if args.ber is not None or args.error_model:
            raise CliError(f"--profile {args.profile} takes --pre-fec-ber, not --ber or --error-model (what is "
                           "delivered follows from the profile)", EXIT_INPUT)
        try:
            settings["ber"] = parse_probability(args.pre_fec_ber, upper=0.5)
        except ValueError as e:
            raise CliError(f"--pre-fec-ber: {e}", EXIT_INPUT) from None
        settings["error_model"] = {"type": "profile", "profile": args.profile}
    if not settings:
        raise CliError("nothing to change: give --ber, --scope, --checksum, --seed, --error-model, --profile, "
                       "--element, --protect or --protected-ber", EXIT_INPUT)
    tb = _attach(args.topo)
    try:
        changed = tb.set_link(args.link, args.direction, **settings)
    except KeyError as e:
        raise CliError(str(e.args[0]), EXIT_INPUT) from None
    finally:
        tb.close()
    for c in changed:
        print(f"{c}: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return 0


def cmd_part_up(args) -> int:
    """One machine's part of a cross-machine topology (run by the controller over SSH; testbed/machines)."""
    from testbed.machines.cluster import part_up

    print(part_up(args.spec))
    return 0


def cmd_part_link(args) -> int:
    """Engine operations on this machine's part of a cross-machine topology (ClusterTestbed on the controller):
    set (settings as JSON), detach, attach, restore (saved settings as JSON)."""
    from testbed.machines.cluster import part_link

    try:
        part_link(args.topo, args.op, args.link, json.loads(args.settings) if args.settings else {})
    except RuntimeError as e:
        raise CliError(str(e)) from None
    return 0


def cmd_machine_info(args) -> int:
    """How tunnels reach this machine: the underlay interface, its address and MTU (for the controller)."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        idx = None
        if args.iface:
            found = ip.link_lookup(ifname=args.iface)
            if not found:
                raise CliError(f"no interface {args.iface!r} on this machine (underlay_iface in the inventory)")
            idx = found[0]
        elif args.peer:
            routes = ip.route("get", dst=args.peer[0])
            idx = routes[0].get_attr("RTA_OIF") if routes else None
        if idx is None:
            raise CliError("give --iface or --peer: the underlay cannot be guessed", EXIT_INPUT)
        link = ip.link("get", index=idx)[0]
        addrs = [a.get_attr("IFA_ADDRESS") for a in ip.get_addr(index=idx, family=2)]
    info = {"iface": link.get_attr("IFLA_IFNAME"), "mtu": link.get_attr("IFLA_MTU"),
            "address": addrs[0] if addrs else None, "version": __version__}
    print(json.dumps(info) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
    return 0


def cmd_machines_from_ssh_config(args) -> int:
    from testbed.machines.inventory import inventory_from_ssh_config

    text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    print(inventory_from_ssh_config(text, "<stdin>" if args.file == "-" else args.file,
                                    underlay_iface=args.underlay_iface, user=args.user, testbed=args.testbed), end="")
    return 0


def _error_model_arg(args) -> dict:
    if args.error_model == "bernoulli":
        return {"type": "bernoulli"}
    if args.burst_length is None:
        raise CliError("--error-model gilbert_elliott needs --burst-length", EXIT_INPUT)
    return {"type": "gilbert_elliott", "burst_length": args.burst_length, "bad_ber": args.bad_ber, "good_ber": 0.0}


# -- parser ----------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but `--opt=--` gives the option the value '--' (refused or taken like any other value): Python
    before 3.12 drops it, and the option reached the command as an empty list."""

    def _get_values(self, action, arg_strings):
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def number(kind: type, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None):
    """An argparse type: a finite int or float within the bounds given, else an error naming the option."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        for bound, word, holds in ((ge, ">=", lambda b: value >= b), (gt, ">", lambda b: value > b),
                                   (le, "<=", lambda b: value <= b), (lt, "<", lambda b: value < b)):
            if bound is not None and not holds(bound):
                raise argparse.ArgumentTypeError(f"must be {word} {bound:g}, got {text!r}" if isinstance(bound, float)
                                                 else f"must be {word} {bound}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    from testbed.engine.counters import ENGINE_PROCS
    from testbed.runtime.base import runtime_names

    p = _Parser(
        prog="testbed",
        description="Real-network emulation testbed: hosts in namespaces or containers joined by veth links that "
                    "corrupt bits at a set bit error rate, and GPT-2 training across them. Needs root.",
        epilog="Exit codes: 0 ok, 1 failure, 2 bad input (topology file, arguments), 3 this machine lacks a "
               "feature the topology needs. Run `testbed doctor` first on a new machine.")
    p.add_argument("--version", action="version", version=f"testbed {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("up", help="bring a topology up", description="Bring up the topology in FILE: hosts, links, "
                       "addresses, routes, impairments and corruption engines. Prints a table of what was made.")
    s.add_argument("file", metavar="FILE", help="topology YAML (see topologies/)")
    s.add_argument("--name", help="name to use instead of the file's `name` (to run two copies at once)")
    s.add_argument("--runtime", choices=runtime_names(), help="where hosts live (default: the file's, else netns)")
    s.add_argument("--capture", metavar="DIR", help="write corrupted packets, before and after corruption, to pcap "
                   "files under DIR")
    s.add_argument("--capture-limit", type=number(float, gt=0), default=10.0, metavar="MB",
                   help="size bound per pcap file in MB (default 10)")
    s.add_argument("--out", metavar="DIR", help="where `down` saves final engine counters "
                   "(default /var/lib/testbed/history/NAME)")
    s.add_argument("--machines", metavar="FILE", help="inventory of machines (YAML, or `vagrant ssh-config` "
                   "output): place the hosts on them over SSH (docs/machines.md)")
    s.add_argument("--vxlan-port", type=number(int, ge=1, le=65535), default=4789, metavar="PORT",
                   help="UDP port of the VXLAN tunnels between machines (default 4789)")
    s.add_argument("--engine-procs", choices=ENGINE_PROCS, default=None,
                   help="NFQUEUE engine processes: one per host serving all of its corrupted directions, or one "
                        "per direction (default: $TESTBED_ENGINE_PROCS, else host; docs/engine.md)")
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser("down", help="tear a topology down", description="Remove everything a topology made. "
                       "--all removes every testbed topology and sweeps leftovers (e.g. after `up` was killed).")
    s.add_argument("names", nargs="*", metavar="NAME")
    s.add_argument("--all", action="store_true", help="every topology, and any leftover of the testbed")
    s.add_argument("--machines", metavar="FILE", help="with --all: also run `testbed down --all` on every "
                   "machine of this inventory (topologies placed from here are reached without it)")
    s.set_defaults(fn=cmd_down)

    s = sub.add_parser("status", help="what is up", description="List running topologies, their hosts and "
                       "whether every corruption engine is alive (exit 1 if one is not).")
    s.add_argument("--topo", metavar="NAME")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("exec", help="run a command inside a host", description="Run CMD inside HOST; its output "
                       "and exit code pass through. Example: testbed exec h1 -- ping -c1 10.0.0.2")
    s.add_argument("--topo", metavar="NAME", help="topology (optional when one is up)")
    s.add_argument("host", metavar="HOST")
    s.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    s.set_defaults(fn=cmd_exec)

    s = sub.add_parser("doctor", help="check what this machine offers", description="Check root, namespaces, "
                       "veth, bridge, tbf, netem, NFQUEUE, iptables and the tools; say what each missing one means.")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("stats", help="corruption counters of a running topology",
                       description="Per link direction: packets, eligible bits seen, bits flipped, realized BER, "
                                   "packets modified/unparsed, flows excluded, and packets the kernel dropped "
                                   "on the way to an NFQUEUE engine (engine_dropped = queue_dropped + "
                                   "user_dropped: its queue full or its socket overrun; engine-caused loss, not "
                                   "link loss). Exit 1 if an engine is dead.")
    s.add_argument("--topo", metavar="NAME")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_stats)

    s = sub.add_parser("link", help="change a running link", description="Change a running link's corruption.")
    lsub = s.add_subparsers(dest="link_command", metavar="ACTION")
    ls = lsub.add_parser("set", help="change corruption settings live",
                         description="Change corruption settings of a running link without restarting its traffic. "
                                     "Example: testbed link set h1-h2 --direction h1-h2 --ber 1e-4 (the direction h1 -> h2; "
                                     "a shell needs 'h1->h2' quoted)")
    ls.add_argument("link", metavar="LINK", help="link name as `testbed up` printed it (e.g. h1-h2)")
    ls.add_argument("--topo", metavar="NAME")
    ls.add_argument("--direction", metavar="A-B", help="one direction, from A to B (default both); also written "
                    "'A->B' (quoted: > is a shell redirection)")
    ls.add_argument("--ber", help="bit error rate in [0, 0.5]")
    ls.add_argument("--scope", choices=SCOPES)
    ls.add_argument("--checksum", choices=CHECKSUM_MODES)
    ls.add_argument("--seed", type=number(int, ge=0, lt=2**63), help="seed of the corruption (0 to 2**63 - 1)")
    ls.add_argument("--error-model", choices=ERROR_MODELS)
    ls.add_argument("--profile", choices=PROFILE_NAMES,
                    help="a link layer (docs/theory.md, section 6): none, rs544, rs544-pass, rs528, rs272, llr; with "
                         "--pre-fec-ber (the physical link's BER), instead of --ber and --error-model")
    ls.add_argument("--pre-fec-ber", metavar="BER", help="--profile: the physical link's BER before the link layer")
    ls.add_argument("--burst-length", type=number(float, ge=1), help="gilbert_elliott mean burst length in bits")
    ls.add_argument("--bad-ber", type=number(float, ge=0, le=1), default=0.5,
                    help="gilbert_elliott BER in the bad state (default 0.5)")
    ls.add_argument("--element", choices=ELEMENT_TYPES,
                    help="scope tensor: the value type whose bits --protect names")
    ls.add_argument("--protect", metavar="FIELDS", help="scope tensor: bits the link protects, comma-separated "
                    "sign/exponent/mantissa or bit positions (0 = LSB); '' protects nothing")
    ls.add_argument("--protected-ber", metavar="P", help="residual BER of protected bits (<= --ber; default 0)")
    ls.set_defaults(fn=cmd_link_set)

    s = sub.add_parser("machines", help="inventories of machines", description="Inventories of machines for "
                       "--machines (docs/machines.md).")
    msub = s.add_subparsers(dest="machines_command", metavar="ACTION")
    ms = msub.add_parser("from-ssh-config", help="turn `vagrant ssh-config` output into an inventory",
                         description="Print the inventory (YAML) of the Host entries of an OpenSSH client config, "
                                     "e.g. `vagrant ssh-config > machines.ssh; testbed machines from-ssh-config "
                                     "machines.ssh > machines.yaml`.")
    ms.add_argument("file", metavar="FILE", help="OpenSSH client config ('-': standard input)")
    ms.add_argument("--user", help="log in as USER on every machine instead of the config's (Vagrant lists "
                    "`vagrant`; the testbed needs root: --user root)")
    ms.add_argument("--underlay-iface", metavar="IFACE", help="interface of every machine that carries the "
                    "tunnels (Vagrant's private network: eth1 on Debian boxes); default: the route to the others")
    ms.add_argument("--testbed", metavar="CMD", help="the testbed command on every machine (default `testbed` on "
                    "its PATH), e.g. the controller's venv shared into the VMs at the same path "
                    "(TESTBED_VM_SHARE in the Vagrantfile)")
    ms.set_defaults(fn=cmd_machines_from_ssh_config)

    # used by the controller over SSH (testbed/machines/cluster.py); not for people
    s = sub.add_parser("part-up")
    s.add_argument("spec")
    s.set_defaults(fn=cmd_part_up)
    s = sub.add_parser("part-link")
    s.add_argument("topo")
    s.add_argument("op", choices=["set", "detach", "attach", "restore"])
    s.add_argument("link")
    s.add_argument("settings", nargs="?")
    s.set_defaults(fn=cmd_part_link)
    s = sub.add_parser("machine-info")
    s.add_argument("--iface")
    s.add_argument("--peer", action="append")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_machine_info)

    # commands that live with their subsystems (experiments and training, benchmarks, images, locate)
    from testbed.experiments import cli as experiments_cli
    from testbed.locate import cli as locate_cli
    from testbed.runtime import image_cli

    for register in (experiments_cli.register, image_cli.register, locate_cli.register):
        register(sub)
    return p


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return EXIT_INPUT
    # `kill` (SIGTERM) unwinds as Ctrl-C does: a sweep takes its topology and worker services down and keeps
    # what it finished, instead of dying with them up
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


def _run(args) -> int:
    from pyroute2.netlink.exceptions import NetlinkError

    from testbed.errors import CapabilityMissing
    from testbed.runtime.base import RuntimeUnavailable
    from testbed.topology.topo import TopologyError

    def say(e: BaseException, text: str) -> None:  # the message, then what was added to it on the way up
        print("\n".join([text, *getattr(e, "__notes__", ())]), file=sys.stderr)

    try:
        return args.fn(args) or 0
    except TopologyError as e:
        say(e, str(e))
        return EXIT_INPUT
    except (CapabilityMissing, RuntimeUnavailable) as e:
        say(e, f"testbed: {e}")
        return EXIT_CAPABILITY
    except CliError as e:
        say(e, f"testbed: {e}")
        return e.code
    except ValueError as e:  # a setting the engine refuses (e.g. `link set` with impossible parameters)
        say(e, f"testbed: {e}")
        return EXIT_INPUT
    except (FileExistsError, PermissionError, RuntimeError, OSError, NetlinkError) as e:
        say(e, f"testbed: {type(e).__name__ + ': ' if isinstance(e, NetlinkError) else ''}{e}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("testbed: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
