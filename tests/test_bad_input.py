"""Bad input, tried systematically (issue 36, item 3): property-based tests (hypothesis) that throw thousands of
malformed topology files, experiment files and out-of-range command-line values at the validators.

Every case must end in exit code 2 with a message that names the file (for files), its line (where the
validators give one: every problem of a file that parses as YAML, and YAML syntax errors) and the field (a field
of the format or a key of the file; the file as a whole for syntax, emptiness, a document that is no mapping) --
or for the command line the option or argument -- or else be accepted. A traceback (any exception that is not
the validators' own error) is a defect, so is a Python warning on the way, and so is anything created: no network
namespace, no state under /run/testbed, no file outside the test's tmp directory (hypothesis's caches included).

How the cases run. In-process, through `testbed.cli.main(argv)` -- the same argument parsing, the same commands
and the same mapping of errors to exit codes as the `testbed` command -- with the first step that would build
something replaced by a sentinel (`Accepted`): `Testbed.up` (for `up`, and for `train` from a file: `up` builds
nothing before it, `train` nothing before bringing its topology up), `train_process` (`train` with the process
injector), `run_experiment` / `run_experiment_jobs` (`run`), the attach to a running topology (`link set`) and
`down --all`; `testbeds.down` answers "not up" and records the names `down` gave it (a name no topology can have
must never get there: `down ''` swept every topology's leftovers). Everything before that point -- loading and
checking the topology or experiment file, the settings, the flags -- runs as it does for a user: an accepted case
is one that got through all of it. The state directory is an empty one under tmp (no topology is up), namespaces
would be named with a prefix of this test's own. The parser is built once. Then a sample of the refused cases goes
through the real `testbed` command as subprocesses: exit code 2, the same stderr as in-process, no traceback, and
`ip netns list`, /etc/netns and /run/testbed without anything of theirs (other tests may run beside this one, so
only what these cases could have made is compared).

The malformed files: (1) a sweep of every leaf value of two rich files (nearly every field; below) set to each
edge of its kind in turn: NaN, inf, huge, negative, zero, wrong types, a unit's number at those ('1e999gbit');
(2) hypothesis mutations of those and of the shipped files (topologies/*.yaml, experiments/*.yaml whose loading
takes under 0.2 s: scaling.yaml reloads its topology hundreds of times and would dominate the run): keys deleted,
duplicated and added, values replaced by wrong types, edge numbers, odd strings and nested junk, text cut or
broken (YAML syntax, tabs, control characters, tags), empty files, non-mapping documents, undecodable bytes,
recursive and exploding aliases, deep nesting, and experiments that name a malformed topology file. Hypothesis runs
derandomized (the same cases every run) without a database.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import types
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, TESTBED

TOPOLOGIES = ROOT / "topologies"
EXPERIMENTS = ROOT / "experiments"

# Cases per property (their sum is the "at least 2,000"; the CLI sample is on top).
TOPOLOGY_CASES = 600
EXPERIMENT_CASES = 400
ARGUMENT_CASES = 600
SUBPROCESS_CASES = 30

RICH_TOPOLOGY = """\
name: rich
description: nearly every field of a topology file
runtime: netns
seed: 7
control_ports: [29500, 29501]
mgmt: {subnet: 10.255.0.0/16}
data_subnet: 10.0.0.0/16
topology:
  nodes:
    h1: {kind: host, cpus: 1.5, memory: 512m, env: {A: "1"}, machine: m1, addresses: {eth1: 10.0.7.1/24}}
    h2: {kind: host, image: testbed-worker}
    h3: {kind: host}
    s1: {kind: switch, subnet: 10.0.9.0/24}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
      name: l12
      mtu: 9000
      subnet: 10.0.7.0/24
      rate: 1gbit
      delay: 1ms
      jitter: 100us
      loss: 0.1%
      ber: 1e-5
      error_model: {type: gilbert_elliott, burst_length: 8, bad_ber: 0.5, good_ber: 0}
      scope: tensor
      checksum: fix
      seed: 3
      collectives: [allreduce, p2p]
      element: bf16
      protect: [sign, exponent]
      protected_ber: 1e-7
      offloads: {tso: false, gro: false, tx_checksum: true}
      directions:
        h1->h2: {ber: 1e-6, seed: 5}
    - endpoints: ["h2:eth2", "s1:p1"]
      ber: 1e-4
      scope: payload
      engine: auto
    - endpoints: ["h3:eth1", "s1:p2"]
      error_model: bernoulli
"""

RICH_EXPERIMENT = """\
name: rich
description: nearly every field of an experiment file
model: tiny
steps: 8
runtime: netns
tokens_per_step: 512
topologies: {ddp: ../topologies/pair.yaml, pp: ../topologies/pair.yaml}
recipes:
  sanitize: {description: guard sanitize, train: {guard: sanitize, sanitize_threshold: 100.0}}
  protect: {link: {element: fp32, protect: [sign, exponent, 30], protected_ber: 1e-7}, train: {guard: sanitize}}
  chain: {topology: ../topologies/chain4.yaml, steps: 4, seed: [3], ber: {ddp: [1e-5], pp: [1e-4]}}
  lsb: {baseline: default, train: {perturb: lsb}}
grid:
  recipe: [default, sanitize, protect, chain, lsb]
  mode: [ddp, pp]
  ber: [0, 1e-5]
  scope: [tensor]
  checksum: [fix, keep]
  seed: [1, 2]
train:
  seq_len: 64
  lr: 0.003
  lr_schedule: cosine
  warmup_steps: 2
  betas: [0.9, 0.99]
  eval_every: 4
  eval_batches: 2
  timeout: 20
  collectives: [allreduce, p2p]
  microbatches: 2
latency: {topology: ../topologies/pair.yaml, link: h1-h2, bers: [0, 1e-6], size: 1024, count: 20, engine: auto}
fault: {link: random, background_ber: 0}
point_timeout: 600
tolerance: 2%
resources: {cpus: 2, gpus: 0, memory: 16G, time: 30, partition: cpu, account: lab, sbatch: {qos: high}}
"""

# grid.ber_at_lambda (the theory's BER for a lambda) is costly to check: a small file of its own
LAMBDA_EXPERIMENT = """\
name: lambda
model: tiny
steps: 4
topologies: {ddp: ../topologies/pair.yaml}
recipes:
  small: {model: small, train: {wire_dtype: bf16}}
grid: {recipe: [default, small], mode: [ddp], ber: [0], ber_at_lambda: [0.5, 2]}
"""

# an experiment whose topologies.ddp, recipe topology or latency topology is replaced by a malformed topology file
NESTED_EXPERIMENT = """\
name: nested
model: tiny
steps: 2
topologies: {ddp: ../topologies/pair.yaml}
recipes: {r: {topology: ../topologies/pair.yaml}}
grid: {recipe: [default, r], mode: [ddp], ber: [0]}
latency: {topology: ../topologies/pair.yaml}
"""
NESTED_SLOTS = [("topologies", "ddp"), ("recipes", "r", "topology"), ("latency", "topology")]


# -- running the command line in-process, stopped where it would start building ----------------------------------


class Accepted(BaseException):
    """Raised where a command would start building (or touch a running topology): its input was accepted. A
    BaseException, so that no `except Exception` on the way can take it for a failure."""


def _accept(*args, **kwargs):
    raise Accepted()


DOWN_REACHED: list[str] = []  # the names `testbed down` passed on to testbeds.down


def _down(name: str) -> dict:
    DOWN_REACHED.append(name)
    return {"found": False, "errors": []}  # as when nothing of it is up


PREFIX = f"tbbad{os.getpid() % 100000}."  # the namespaces a wrongly accepted case would create start with it


@functools.cache
def _parser():
    from testbed.cli import build_parser  # imported before stopped_before_building replaces it with this

    return build_parser()


@contextlib.contextmanager
def stopped_before_building(state_dir: Path):
    """The command line as it is, but stopped with Accepted at the first step that would build something (or
    reach a running topology); the state directory `state_dir` (no topology is up), namespaces named with
    PREFIX. The parser is built once (building it is most of the time of a case; parse_args keeps no state)."""
    import testbed.cli
    import testbed.experiments.executors
    import testbed.experiments.training
    import testbed.machines.cluster
    import testbed.net
    import testbed.nsutil
    import testbed.state
    import testbed.testbeds

    _parser()
    with contextlib.ExitStack() as stack:
        runner = sys.modules.get("testbed.experiments.runner")
        if runner is None:  # a stand-in: the real one imports torch (seconds), and `run` needs only this of it
            runner = types.ModuleType("testbed.experiments.runner")
            stack.callback(sys.modules.pop, runner.__name__, None)
            sys.modules[runner.__name__] = runner
        for target, name in ((testbed.net.Testbed, "up"), (testbed.machines.cluster.ClusterTestbed, "up"),
                             (testbed.experiments.training, "train_process"), (runner, "run_experiment"),
                             (testbed.experiments.executors, "run_experiment_jobs"),
                             (testbed.cli, "_attach"), (testbed.testbeds, "down_all")):
            stack.enter_context(mock.patch.object(target, name, _accept, create=target is runner))
        stack.enter_context(mock.patch.object(testbed.testbeds, "down", _down))
        stack.enter_context(mock.patch.object(testbed.cli, "build_parser", _parser))
        stack.enter_context(mock.patch.object(testbed.state, "STATE_ROOT", state_dir))
        stack.enter_context(mock.patch.object(testbed.nsutil, "PREFIX", PREFIX))
        stack.enter_context(mock.patch.dict(os.environ, {"TESTBED_STATE_DIR": str(state_dir),
                                                         "TESTBED_PREFIX": PREFIX}))
        yield


def run_in_process(argv: list[str]) -> tuple[str, str]:
    """(outcome, stderr) of `testbed ARGV`: outcome is "accepted", "exit N", "traceback" (stderr then holds it) or
    "warning" (a Python warning on the way, e.g. ipaddress taking `true` for an address: stderr holds it too)."""
    from testbed.cli import main

    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse refuses an argument with exit code 2
                rc = e.code if isinstance(e.code, int) else 1
    except Accepted:
        outcome = "accepted"
    except BaseException:  # noqa: BLE001 - what we are looking for
        return "traceback", err.getvalue() + traceback.format_exc()
    else:
        outcome = f"exit {rc}"
    if caught:
        return "warning", f"{outcome}, with warnings:\n" + "\n".join(
            f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught) + "\n" + err.getvalue()
    return outcome, err.getvalue()


class Tally:
    """Counts of outcomes, and the cases that broke the rules: one example of each kind of defect (kept, not
    raised at once, so that one run reports every kind and the full counts)."""

    def __init__(self, what: str):
        self.what, self.counts, self.defects = what, Counter(), {}
        self.started = (time.monotonic(), time.process_time(), self._children())

    @staticmethod
    def _children() -> float:
        t = os.times()
        return t.children_user + t.children_system

    def add(self, outcome: str, problem: str | None, case: str) -> None:
        self.counts["cases"] += 1
        # exit 0: `status` read; exit 3: the validators accepted it, this machine lacks what it needs (CUDA)
        self.counts["tracebacks" if outcome == "traceback" else "exit 2" if outcome == "exit 2" else
                    "accepted" if outcome in ("accepted", "exit 0", "exit 3") else "other"] += 1
        if problem:
            self.counts["defects"] += 1
            lines = problem.strip().splitlines()
            kind = f"{lines[0]} ... {lines[-1]}" if outcome == "traceback" else lines[0]
            if outcome == "warning":
                kind = next((line for line in lines if "Warning: " in line), kind)
            kind = re.sub(r"/\S+|\d+", "#", kind)[:200]  # one kind whatever the file and the numbers
            n, example = self.defects.get(kind, (0, f"{problem}\n--- case ---\n{case}"))
            self.defects[kind] = (n + 1, example)

    def report(self) -> str:
        c = self.counts
        wall, cpu = time.monotonic() - self.started[0], time.process_time() - self.started[1]
        children = self._children() - self.started[2]
        return (f"{self.what}: {c['cases']} cases tried, {c['exit 2']} exit 2, {c['accepted']} accepted, "
                f"{c['tracebacks']} tracebacks, {c['other']} other outcomes, {c['defects']} defects "
                f"({wall:.1f} s, {cpu:.1f} s CPU in this process" + (f", {children:.1f} s in subprocesses)"
                                                                      if children > 0.05 else ")"))

    def check(self, minimum: int) -> None:
        print(self.report())
        assert not self.defects, self.report() + "".join(
            f"\n\n=== {n} x {kind}\n{example}" for kind, (n, example) in self.defects.items())
        assert self.counts["tracebacks"] == 0 and self.counts["other"] == 0
        assert self.counts["cases"] >= minimum, self.report()


# -- malformed files ------------------------------------------------------------------------------------------

ODD_STRINGS = ["", " ", "\t", "~", "null", "yes", "no", "on", "1e-5", "-1e-5", "1e400", "-1e400", "nan", "NaN", ".nan",
               "inf", "-inf", ".inf", "0x10", "0o7", "1_000", "1,5", "½", "١٢", "-1ms", "1ms", "0s", "1e999s", "10gbit",
               "-10gbit", "1e999gbit", "0.5%", "150%", "-1%", "nan%", "inf%", "2g", "1e999g", "-2g", "0b", "h1:eth1",
               "h9:eth1", "h1:", ":eth1", "h1:eth1:x", "h1->h2", "10.0.0.0/8", "10.0.0.1/33", "::1/128", "999.1.1.1/24",
               "../topologies/pair.yaml", "/nonexistent/topology.yaml", "/", ".", "tensor", "payload", "ddp", "pp",
               "gilbert_elliott", "bernoulli", "sign,exponent", "sign,,", "fp32", "tiny", "random", "auto", "a" * 300,
               "${HOME}", "'quoted'", "\u202e", "é", "\U0001f600", "line\nbreak", "#", "key: value", "- item"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, -1, 1, 2, 7, 68, 65535, 65536, 2**31, 2**62, 2**63, 2**64, -2**63, 10**30, -10**30]),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0.0, -0.0, 0.5, 0.7, 1.0, 1.5, -1e-5, 1e-300, 5e-324, 1e308, -1e308, math.nan, math.inf,
                     -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(ODD_STRINGS),
    st.text(max_size=10),
)
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(ODD_STRINGS[:30]), st.integers(-3, 3)),
                                                  inner, max_size=3)), max_leaves=6)
key_names = st.one_of(st.from_regex(r"[a-z_][a-z0-9_-]{0,12}", fullmatch=True),
                      st.sampled_from(["ber", "name", "topology", "links", "nodes", "grid", "train", "seed", "mode",
                                       "Name", "BER", "ber ", "1", "null", "true", "h1->h2", "é"]))


def _paths(data, prefix=()):
    """Every (path to a value) in data, the root included."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _paths(v, prefix + (i,))
    return out


def _get(data, path):
    for p in path:
        data = data[p]
    return data


def _set(data, path, value):
    if not path:
        return value
    _get(data, path[:-1])[path[-1]] = value
    return data


def _delete(data, path):
    if not path:
        return None
    parent = _get(data, path[:-1])
    del parent[path[-1]]
    return data


EDGE_NUMBERS = [-1, 0, 1, -0.0, 0.5, 1.5, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -10**30, 1e308, -1e-5, 5e-324,
                math.inf, -math.inf, math.nan]
EDGE_TEXTS = ["-1", "0", "-0", "1e999", "-1e999", "1e-999", "nan", "inf", "-inf", "99999999999999999999", ".5", "5.",
              "1e", "0x1", ""]
NUMBER_WITH_UNIT = re.compile(r"^\s*[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(.*)$")


def edge_value(value):
    """Values of the kind `value` is, at the edges: a number as NaN, inf, huge, negative or zero; a number with a
    unit ('1gbit', '1ms', '0.1%', '512m') the same with those numbers before the unit."""
    if isinstance(value, bool):
        return st.sampled_from([0, 1, 2, "true", "on", None])
    if isinstance(value, (int, float)):
        return st.sampled_from(EDGE_NUMBERS)
    if isinstance(value, str) and (m := NUMBER_WITH_UNIT.match(value)):
        return st.sampled_from(EDGE_TEXTS).map(lambda n: n + m.group(1))
    return st.one_of(st.sampled_from(EDGE_NUMBERS), st.sampled_from(EDGE_TEXTS))


@st.composite
def mutated_data(draw, data):
    """A deep copy of `data` with 1-3 structural mutations (and a description of each)."""
    data = copy.deepcopy(data)
    done = []
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        leaves = [p for p in paths if not isinstance(_get(data, p), (dict, list))] or paths
        path = draw(st.sampled_from(leaves if draw(st.booleans()) else paths))
        op = draw(st.sampled_from(["replace", "replace", "replace", "edge", "edge", "delete", "add key", "wrap",
                                   "stringify", "empty container"]))
        where = ".".join(map(str, path)) or "<root>"
        if op == "edge":  # the same kind of value at an edge: its number (keeping a unit) NaN, inf, huge, < 0, 0
            data = _set(data, path, draw(edge_value(_get(data, path))))
        elif op == "delete" and path:
            data = _delete(data, path)
        elif op == "add key":
            target = _get(data, path)
            if isinstance(target, dict):
                target[draw(key_names)] = draw(junk)
            else:
                data = _set(data, path, {draw(key_names): draw(junk)})
        elif op == "wrap":
            value = _get(data, path)
            data = _set(data, path, draw(st.sampled_from([[value], {"value": value}, [value, value]])))
        elif op == "stringify":
            data = _set(data, path, str(_get(data, path)))
        elif op == "empty container":
            data = _set(data, path, draw(st.sampled_from([[], {}, None, ""])))
        else:
            op = "replace"
            data = _set(data, path, draw(junk))
        done.append(f"{op} {where}")
    return data, done


@st.composite
def mutated_text(draw, text):
    """The file's text broken as text: cut, a line duplicated/deleted/re-indented, characters inserted."""
    lines = text.splitlines(keepends=True)
    op = draw(st.sampled_from(["cut", "duplicate line", "delete line", "indent", "insert", "replace char"]))
    i = draw(st.integers(0, max(len(lines) - 1, 0)))
    if op == "cut":
        text = text[:draw(st.integers(0, len(text)))]
    elif op == "duplicate line":
        text = "".join(lines[:i + 1] + lines[i:])
    elif op == "delete line":
        text = "".join(lines[:i] + lines[i + 1:])
    elif op == "indent":
        text = "".join(lines[:i] + [draw(st.sampled_from([" ", "  ", "\t", "    "])) + lines[i]] + lines[i + 1:])
    else:
        pos = draw(st.integers(0, len(text)))
        ch = draw(st.sampled_from([":", "[", "]", "{", "}", "-", "&a", "*a", "!!python/object:os.system", "!!binary",
                                   "\t", "'", '"', "%", "@", "`", "|", ">", "#", ",", "?", "\x00", "\x1b", "\ufeff",
                                   "\n", " ", "<<: *a", "!!float", "!!int"]))
        text = text[:pos] + ch + text[pos + (op == "replace char"):]
    return text, [op]


WHOLE_FILES = [b"", b"\n", b"   \n\t\n", b"# only a comment\n", b"---\n", b"--- \n...\n", b"~\n", b"null\n",
               b"42\n", b"-1e400\n", b".nan\n", b"just a string\n", b"- a\n- list\n", b"[1, 2, 3]\n", b"{}\n",
               b"[]\n", b"---\nname: a\n---\nname: b\n", b"\xff\xfe\x00garbage", b"name: caf\xe9\n", b"\x00\x00",
               b"name: x\ntopology: !!python/object/apply:os.system [true]\n", b"a: &x [*x]\n",
               b"&a [*a, *a]\n", b"? [1, 2]\n: v\n", b"{[1]: 2}\n", b"1: 2\n", b"true: 1\nnull: 2\n", b"'': 1\n",
               b"[" * 1000 + b"]" * 1000, b"a: " + b"{b: " * 1000 + b"1" + b"}" * 1000 + b"\n",
               b"name: !!float abc\n", b"name: x\nseed: !!int 1.5\n", b"steps: !!timestamp 2020-13-45\n",
               b"name: x\n\x00\n", b"a: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
               b"c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
               b"e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"]


@functools.cache
def _parsed(text: str):
    return yaml.load(text, Loader=yaml.CSafeLoader)


@st.composite
def malformed_file(draw, bases: dict[str, str]):
    """(file bytes, what was done) from one of the base files."""
    how = draw(st.sampled_from(["data"] * 6 + ["text"] * 3 + ["whole"]))
    if how == "whole":
        return draw(st.sampled_from(WHOLE_FILES)), ["whole file"]
    base = draw(st.sampled_from(sorted(bases) + ["rich.yaml"] * 2 * ("rich.yaml" in bases)))  # the most fields
    if how == "text":
        text, done = draw(mutated_text(bases[base]))
        return text.encode("utf-8", "surrogatepass"), [f"{base}: text"] + done
    data, done = draw(mutated_data(_parsed(bases[base])))
    text = yaml.dump(data, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=draw(st.booleans()),
                     width=draw(st.sampled_from([80, 10**6])))
    return text.encode("utf-8", "surrogatepass"), [f"{base}: data"] + done


FILE_LEVEL = ("not valid YAML", "the file is empty", "the file must hold a mapping", "cannot read file",
              "not a text file")


def file_problem(path: Path, text: bytes, outcome: str, err: str, model_fields: set[str]) -> str | None:
    """What is wrong with the outcome of a malformed file, or None. Exit 2 must name the file on every line of
    its report; each problem a field (a known top-level field or key of the file, then its path) or the file as
    a whole (syntax, emptiness, not a mapping); a line number wherever the file parsed as YAML."""
    if outcome == "accepted" or (outcome == "exit 3" and "no CUDA device is available here" in err):
        return None  # (exit 3: accepted, then refused for what this machine lacks: a file asking for device cuda)
    if outcome != "exit 2":
        return f"{outcome}:\n{err[-3000:]}"
    try:
        data = yaml.load(text.decode("utf-8"), Loader=yaml.CSafeLoader)
    except Exception:  # noqa: BLE001 - not YAML (or not even text): a file-level problem
        data = yaml  # a marker: did not parse
    prefix = f"{path}:"
    lines = err.rstrip("\n").splitlines()
    if not lines or not lines[0].startswith(prefix):
        return f"the report does not start with the file's name {path}:\n{err}"
    for line in lines:
        if not line.startswith(prefix):
            continue  # the report of a topology file the experiment names, embedded in the experiment's
        rest = line[len(prefix):]
        m = re.match(r"(\d+): ", rest)
        rest = rest[m.end():] if m else rest.lstrip()
        if rest.startswith(FILE_LEVEL):
            continue
        if not m and data is not yaml and data is not None:
            return f"no line number for a problem of a file that parses as YAML:\n{line}"
        field = rest.split(": ", 1)[0] if ": " in rest else ""
        if not field:
            return f"a problem that names no field:\n{line}"
        first = re.match(r"\[[^\]]*\]|[^.\[]*", field).group()
        # keys as field paths write them: an int key (pydantic's location of a key that is no string) as [N]
        top_keys = {f"[{int(k)}]" if isinstance(k, (int, float)) and k == int(k) else str(k) if k != "" else "''"
                    for k in data if not isinstance(k, float) or math.isfinite(k)} if isinstance(data, dict) else set()
        if first not in model_fields | top_keys:
            return f"the named field {field!r} is neither a field of the file's format nor a key of the file:\n{line}"
    return None


def _loadable_experiments() -> list[Path]:
    from testbed.experiments.spec import Experiment

    out = []
    for p in sorted(EXPERIMENTS.glob("*.yaml")):
        t = time.monotonic()
        try:
            Experiment.load(p)
        except Exception:  # noqa: BLE001 - a file being edited elsewhere: not a base
            continue
        if time.monotonic() - t < 0.2:
            out.append(p)
    return out


# -- out-of-range command-line values -------------------------------------------------------------------------

NUMBERS = ["-1", "0", "1", "2", "-0", "0.5", "0.7", "1.5", "1e-5", "-1e-5", "1e400", "-1e400", "nan", "NaN", "inf",
           "-inf", "Infinity", "99999999999999999999", "9223372036854775807", "9223372036854775808",
           "-9223372036854775809", "65535", "65536", "4789", "abc", "", " ", "0x10", "1_0", "1,2", "1e", "½", "٣",
           "None", "true", "[]", "-", "--"]
NAMES = ["pair", "x", "", " ", ".", "..", "../x", "a/b", "*", "Bad Name", "a" * 30, "tb.", "é", "-x", "--all"]
FLAG_WORDS = {"--machines": ["/nonexistent/machines.yaml", "{tmp}/topologies/pair.yaml", "{tmp}", "", "/dev/null",
                             "{tmp}/binary.dat"]}


def _choice(choices):
    return st.sampled_from([*choices, "", "bogus", str(choices[0]).upper(), f"{choices[0]} "])


def _setting_values(s):
    if s.kind is bool:
        return st.sampled_from([None, "no"])  # the flag, or its --no- form
    if s.choices:
        return _choice(s.choices)
    if s.kind is list:
        return st.sampled_from(["allreduce", "allreduce,p2p", "", ",", "bogus", "p2p,,p2p"])
    if s.kind is tuple:
        return st.sampled_from(["0.9,0.95", "0.9", "1,1", "nan,0.9", "0.9,inf", "-0.1,0.5", "a,b", "", "0.9,0.95,0.99"])
    if s.kind is str:
        return st.sampled_from(["/nonexistent/corpus.txt", "", "{tmp}"])
    return st.one_of(st.sampled_from(NUMBERS), st.integers(-2**70, 2**70).map(str),
                     st.floats(allow_nan=True, allow_infinity=True).map(repr))


@st.composite
def options(draw, table):
    """Some of the options in `table` ({flag: values strategy}), each with a value."""
    flags = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=4, unique=True))
    argv = []
    for f in flags:
        value = draw(table[f])
        if value is None:
            argv.append(f)
        elif value == "no":
            argv.append("--no-" + f[2:])
        elif value.startswith("-") or draw(st.booleans()):
            argv.append(f"{f}={value}")
        else:
            argv += [f, value]
    return argv, flags


def _tables():
    from testbed.engine.counters import ENGINE_PROCS
    from testbed.train import settings as tsettings
    from testbed.vocab import CHECKSUM_MODES, ELEMENT_TYPES, ERROR_MODELS, SCOPES

    numbers = st.sampled_from(NUMBERS)
    runtimes = _choice(["netns", "docker"])
    protect = st.sampled_from(["sign", "sign,exponent", "0,31", "31", "32", "-1", "bogus", "", ",", "sign,sign"])
    up = {"--capture-limit": numbers, "--vxlan-port": numbers, "--engine-procs": _choice(list(ENGINE_PROCS)),
          "--runtime": runtimes, "--name": st.sampled_from(NAMES),
          "--machines": st.sampled_from(FLAG_WORDS["--machines"]),
          "--capture": st.sampled_from(["{tmp}/capture", ""]), "--out": st.sampled_from(["{tmp}/history", ""])}
    train = {s.flag: _setting_values(s) for s in tsettings.described() if s.name not in ("mode", "steps")}
    train.update({"--ber": numbers, "--protected-ber": numbers, "--scope": _choice(SCOPES),
                  "--checksum": _choice(CHECKSUM_MODES), "--element": _choice(ELEMENT_TYPES), "--protect": protect,
                  "--runtime": runtimes, "--name": st.sampled_from(NAMES),
                  "--machines": st.sampled_from(FLAG_WORDS["--machines"])})
    run = {"--jobs": numbers, "-j": numbers, "--executor": _choice(["local", "slurm"]), "--cpus": numbers,
           "--gpus": numbers, "--time": numbers,
           "--mem": st.sampled_from(["16G", "16", "-1", "1.5G", "", "abc", "16Q"]),
           "--sbatch": st.sampled_from(["qos=high", "=x", "", "--", "a", "a=b=c", "=", "-", "--qos=high"]),
           "--recipes": st.sampled_from(["", ",", "*", "nomatch", "default", "protect"]), "--runtime": runtimes,
           "--detach": st.none(), "--retry-failed": st.none(), "--cold": st.none(),
           "--machines": st.sampled_from(FLAG_WORDS["--machines"])}
    link = {"--ber": numbers, "--protected-ber": numbers, "--seed": numbers, "--burst-length": numbers,
            "--bad-ber": numbers, "--error-model": _choice(ERROR_MODELS), "--scope": _choice(SCOPES),
            "--checksum": _choice(CHECKSUM_MODES), "--element": _choice(ELEMENT_TYPES), "--protect": protect,
            "--direction": st.sampled_from(["h1-h2", "h1->h2", "h2->h1", "", "x", "h1-h9"]),
            "--topo": st.sampled_from(NAMES)}
    return {"up": up, "train": train, "run": run, "link": link}


TOPOLOGY_ARGS = ["{tmp}/topologies/pair.yaml", "{tmp}/topologies/rich.yaml", "{tmp}/topologies/chain4.yaml",
                 "{tmp}/nonexistent.yaml", "nosuchtopology", "{tmp}", "{tmp}/experiments/rich.yaml"]


@st.composite
def command_line(draw, tables):
    """(argv with {tmp} for the work directory, the flags and positional values given)."""
    command = draw(st.sampled_from(["up", "up", "train", "train", "train", "run", "run", "link", "link", "down",
                                    "status"]))
    if command in ("down", "status"):
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=2))
        argv = ["down", *names] if command == "down" else ["status", f"--topo={names[0]}"]
        return argv, [], names
    opts, flags = draw(options(tables[command]))
    if command == "up":
        topo = draw(st.sampled_from(TOPOLOGY_ARGS))
        return ["up", topo, *opts], flags, [topo]
    if command == "train":
        topo = draw(st.sampled_from(TOPOLOGY_ARGS))
        mode = draw(st.one_of(st.sampled_from(["ddp", "pp"]), _choice(["ddp", "pp"])))
        steps = draw(st.one_of(st.just("2"), st.sampled_from(NUMBERS)))
        return (["train", topo, "--out", "{tmp}/out", f"--mode={mode}", f"--steps={steps}", *opts],
                [*flags, "--mode", "--steps"], [topo])
    if command == "run":
        exp = draw(st.sampled_from(["{tmp}/experiments/small.yaml"] * 3 + ["{tmp}/experiments/rich.yaml"]))
        return ["run", exp, "--out", "{tmp}/out", *opts], flags, [exp]
    link = draw(st.sampled_from(["h1-h2", "", "x" * 100]))
    return ["link", "set", link, *opts], flags, [link]


def argument_problem(argv, flags, positional, outcome, err, reached) -> str | None:
    """Exit 2 must say which option or argument is wrong, without a traceback; or the case is accepted. A name
    that cannot be a topology's must never reach `down`."""
    from testbed.topology.schema import TOPOLOGY_NAME_RE

    if any(not TOPOLOGY_NAME_RE.match(n) for n in reached):
        return f"`testbed down` went to take down a name no topology can have: {reached}"
    if outcome in ("accepted", "exit 0"):  # exit 0: `status`, which only reads
        return None
    if outcome != "exit 2":
        return f"{outcome}:\n{err[-3000:]}"
    words = [*flags, *(f[2:].replace("-", "_") + ":" for f in flags if f.startswith("--")), "--jobs" if "-j" in flags
             else "-j", *(p for p in positional if p), *map(repr, positional),
             *(a.split("=", 1)[-1] for a in argv if "/" in a)]  # a file given to an option
    if re.match(r"testbed( link set)?: nothing to change: give --", err):
        return None  # the command as a whole: no option that changes anything (--bad-ber alone)
    if "Traceback" in err or not any(w in err for w in words):
        return f"exit 2 without naming the option or argument ({', '.join(flags + positional)}):\n{err[-2000:]}"
    return None


# -- the tests ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def hypothesis_home(tmp_path_factory):
    """Hypothesis keeps caches (constants of the code under test, unicode tables) in ./.hypothesis, whatever the
    database: here they go under tmp."""
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp/{topologies,experiments,cases}, the shipped topologies and the rich files copied in (experiments name
    topologies relative to their own directory); the current directory tmp/cwd, the state directory tmp/state:
    whatever a command creates shows up under tmp."""
    shutil.copytree(TOPOLOGIES, tmp_path / "topologies")
    (tmp_path / "topologies" / "rich.yaml").write_text(RICH_TOPOLOGY)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "rich.yaml").write_text(RICH_EXPERIMENT)
    shutil.copy(EXPERIMENTS / "paper-pp.yaml", tmp_path / "experiments" / "small.yaml")
    (tmp_path / "binary.dat").write_bytes(b"\xff\xfe\x00machines")
    (tmp_path / "cases").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def our_leftovers(names: set[str]) -> dict:
    """What the cases could have created: namespaces (and their /etc/netns files) named with PREFIX, state under
    /run/testbed named after one of the case's topologies. Other tests may run on this machine at the same time,
    so what they create is left out of the comparison."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    run = os.listdir("/run/testbed") if os.path.isdir("/run/testbed") else []
    return {"netns": [n for n in netns if n.startswith(PREFIX)], "etc_netns": [n for n in etc if n.startswith(PREFIX)],
            "run_testbed": [n for n in run if n in names]}


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def name_in(text: bytes) -> str | None:
    try:
        data = yaml.load(text.decode("utf-8"), Loader=yaml.CSafeLoader)
    except Exception:  # noqa: BLE001 - not YAML: it names nothing
        return None
    return str(data.get("name")) if isinstance(data, dict) else None


HYPOTHESIS = dict(derandomize=True, database=None, deadline=None, print_blob=False,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def sweep(text: str):
    """Systematically: every leaf value of a file, one at a time, at each edge of its kind (SWEEP_NUMBERS for a
    number, a unit's number at those for '1gbit' and the like, SWEEP_STRINGS for other strings)."""
    base = _parsed(text)
    for path in _paths(base):
        value = _get(base, path)
        if isinstance(value, (dict, list)):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            edges = SWEEP_NUMBERS
        elif isinstance(value, str) and (m := NUMBER_WITH_UNIT.match(value)) and m.group(1):
            edges = [n + m.group(1) for n in ("-1", "0", "1e999", "nan", "inf")]
        else:
            edges = SWEEP_STRINGS
        for edge in edges:
            data = _set(copy.deepcopy(base), path, edge)
            yield (yaml.dump(data, Dumper=yaml.CSafeDumper, sort_keys=False).encode(),
                   [f"sweep: {'.'.join(map(str, path))} = {edge!r}"])


SWEEP_NUMBERS = [-1, 0, 2**64, math.inf, math.nan, "1e999", True]
SWEEP_STRINGS = ["", 0, None, {"x": 1}, "\u202e" + "a" * 300]


def _file_property(workdir, what: str, bases: dict[str, str], model_fields: set[str], command, cases: int,
                   nested: dict[str, str] | None = None, swept: tuple[str, ...] = ()) -> Tally:
    """The cases of `sweep` over the files `swept`, then `cases` drawn by hypothesis from malformed_file(bases)
    (with nested: some an experiment that names a malformed topology file), each checked by file_problem."""
    tally, state, names = Tally(what), workdir / "state", {"pair", "rich"}
    case_dir = workdir / "cases"

    def one(text: bytes, done: list[str]) -> None:
        path = case_dir / f"c{tally.counts['cases']}.yaml"
        path.write_bytes(text)
        names.add(name_in(text))
        with stopped_before_building(state):
            outcome, err = run_in_process(command(path))
        tally.add(outcome, file_problem(path, text, outcome, err, model_fields),
                  f"{'; '.join(done)}\n{text.decode('utf-8', 'replace')[:3000]}")
        for p in case_dir.iterdir():
            p.unlink()

    for text in swept:
        for case in sweep(text):
            one(*case)

    @settings(max_examples=cases, **HYPOTHESIS)
    @given(case=malformed_file(bases), inner=st.one_of(st.none(), malformed_file(nested)) if nested else st.none(),
           slot=st.sampled_from(NESTED_SLOTS))
    def check(case, inner, slot):
        text, done = case
        if inner is not None:  # an experiment that names a malformed topology file
            topo = case_dir / "topology.yaml"
            topo.write_bytes(inner[0])
            names.add(name_in(inner[0]))
            data = _set(copy.deepcopy(_parsed(NESTED_EXPERIMENT)), slot, str(topo))
            text = yaml.dump(data, Dumper=yaml.CSafeDumper, sort_keys=False).encode()
            done = [f"{'.'.join(slot)} names a topology file ({'; '.join(inner[1])}):\n"
                    f"{inner[0].decode('utf-8', 'replace')[:2000]}\n--- experiment ---"]
        one(text, done)

    check()
    tally.names = names
    return tally


def _nothing_created(workdir, names) -> None:
    assert our_leftovers(names) == {"netns": [], "etc_netns": [], "run_testbed": []}
    assert not (workdir / "state").exists(), tree(workdir / "state")
    assert tree(workdir / "cwd") == [] and tree(workdir / "cases") == []
    assert not (workdir / "out").exists() and not (workdir / "history").exists()


def test_malformed_topology_files(workdir):
    """`testbed up FILE` on malformed topology files: exit 2 naming the file, the line and the field, or
    accepted; no traceback, nothing created."""
    from testbed.topology.schema import TopologyFile

    bases = {p.name: p.read_text() for p in sorted((workdir / "topologies").glob("*.yaml"))}
    tally = _file_property(workdir, "topology files (testbed up)", bases, set(TopologyFile.model_fields),
                           lambda path: ["up", str(path)], TOPOLOGY_CASES, swept=(RICH_TOPOLOGY,))
    _nothing_created(workdir, tally.names)
    tally.check(TOPOLOGY_CASES)


def test_malformed_experiment_files(workdir):
    """`testbed run FILE --out DIR` on malformed experiment files (and experiments naming a malformed topology
    file): exit 2 naming the file, the line and the field, or accepted; no traceback, no DIR, nothing created."""
    from testbed.experiments.spec import ExperimentFile

    bases = {p.name: p.read_text() for p in _loadable_experiments()}
    bases.update({"rich.yaml": RICH_EXPERIMENT, "lambda.yaml": LAMBDA_EXPERIMENT})
    # the shipped experiments name ../topologies/...: from tmp/cases that is tmp/topologies
    topologies = {p.name: p.read_text() for p in sorted((workdir / "topologies").glob("*.yaml"))}
    tally = _file_property(workdir, "experiment files (testbed run)", bases, set(ExperimentFile.model_fields),
                           lambda path: ["run", str(path), "--out", str(workdir / "out")], EXPERIMENT_CASES,
                           nested=topologies, swept=(RICH_EXPERIMENT, LAMBDA_EXPERIMENT))
    _nothing_created(workdir, tally.names)
    tally.check(EXPERIMENT_CASES)


def test_out_of_range_command_line_values(workdir):
    """`testbed up/train/run/link set/down/status` with negative, huge, NaN and infinite numbers, wrong types and
    unknown choices: exit 2 naming the option, or accepted; no traceback, nothing created."""
    tables, tally, state = _tables(), Tally("command-line values"), workdir / "state"
    tmp = str(workdir)

    @settings(max_examples=ARGUMENT_CASES, **HYPOTHESIS)
    @given(case=command_line(tables))
    def check(case):
        argv, flags, positional = case
        argv = [a.replace("{tmp}", tmp) for a in argv]
        positional = [p.replace("{tmp}", tmp) for p in positional]
        DOWN_REACHED.clear()
        with stopped_before_building(state):
            outcome, err = run_in_process(argv)
        tally.add(outcome, argument_problem(argv, flags, positional, outcome, err, list(DOWN_REACHED)),
                  " ".join(map(repr, argv)))

    check()
    _nothing_created(workdir, set(NAMES))
    tally.check(ARGUMENT_CASES)


def test_a_sample_through_the_real_command(workdir):
    """A sample of the cases above (SUBPROCESS_CASES, each refused in-process) through the `testbed` command
    itself: exit code 2, the same message as in-process (so the in-process harness is the command), no traceback;
    no namespace, no state under /run/testbed, no file created. `down` and `status` stay out of it: they would
    read (and `down` remove) what other tests on this machine have up."""
    from concurrent.futures import ThreadPoolExecutor

    from testbed.experiments.spec import ExperimentFile
    from testbed.topology.schema import TopologyFile

    tmp, state, sample = str(workdir), workdir / "state", []
    topologies = {p.name: p.read_text() for p in sorted((workdir / "topologies").glob("*.yaml"))}
    experiments = {"rich.yaml": RICH_EXPERIMENT, "small.yaml": (workdir / "experiments" / "small.yaml").read_text()}
    kinds = [("topology", malformed_file(topologies), lambda p: ["up", str(p)], set(TopologyFile.model_fields)),
             ("experiment", malformed_file(experiments), lambda p: ["run", str(p), "--out", f"{tmp}/out"],
              set(ExperimentFile.model_fields)),
             ("arguments", command_line(_tables()).filter(lambda c: c[0][0] not in ("down", "status")), None, None)]
    per_kind = SUBPROCESS_CASES // len(kinds)
    for kind, strategy, command, fields in kinds:
        picked = []

        @settings(max_examples=4 * per_kind, **HYPOTHESIS)
        @given(case=strategy)
        def collect(case):
            if len(picked) == per_kind:
                return
            n = len(sample)
            if command is not None:  # a file: kept under tmp/sample until the command has run
                path = workdir / "sample" / f"{kind}{len(picked)}.yaml"
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(case[0])
                argv, check = command(path), functools.partial(file_problem, path, case[0], model_fields=fields)
            else:
                argv = [a.replace("{tmp}", tmp) for a in case[0]]
                check = functools.partial(argument_problem, argv, case[1], [p.replace("{tmp}", tmp) for p in case[2]],
                                          reached=[])
            with stopped_before_building(state):
                outcome, err = run_in_process(argv)
            if outcome == "exit 2":
                picked.append((kind, argv, err, check))
            elif command is not None:
                path.unlink()
            assert len(sample) == n

        collect()
        sample += picked
    assert len(sample) == SUBPROCESS_CASES

    names = {name_in(p.read_bytes()) for p in (workdir / "sample").glob("*.yaml")} | set(NAMES) | {"pair", "rich"}
    run_before = set(os.listdir("/run/testbed")) if os.path.isdir("/run/testbed") else set()
    env = {**os.environ, "TESTBED_PREFIX": PREFIX, "PYTHONPATH": str(ROOT)}

    def real(case):
        return subprocess.run([*TESTBED, *case[1]], capture_output=True, text=True, timeout=120, cwd=workdir / "cwd",
                              env=env)

    tally = Tally("through the real command")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(real, sample))
    for (kind, argv, err, check), r in zip(sample, results):
        outcome = f"exit {r.returncode}" if "Traceback" not in r.stderr else "traceback"
        problem = check(outcome=outcome, err=r.stderr) or (
            None if r.stderr == err else f"stderr differs from in-process:\n{r.stderr}\n--- in-process ---\n{err}")
        tally.add(outcome, problem, f"{kind}: testbed {' '.join(map(repr, argv))}")
    run_after = set(os.listdir("/run/testbed")) if os.path.isdir("/run/testbed") else set()
    assert not (run_after - run_before) & names, run_after - run_before
    shutil.rmtree(workdir / "sample")
    _nothing_created(workdir, names)
    tally.check(SUBPROCESS_CASES)
    assert tally.counts["exit 2"] == SUBPROCESS_CASES
