"""Training settings: one dataclass, the single place where a training setting is defined.

Every field carries its type, default, help and valid range or choices (written with `setting()`, kept in the
field's metadata), and says where it goes:
  worker  passed to every worker process (`python -m testbed.train.worker`); False for the launcher's own
          settings (timeouts of the whole run, hosts, collectives)
  file    accepted under an experiment file's `train:`; False where the file sets it elsewhere (model and
          steps at the top, mode and seed in the grid, run_timeout as point_timeout)
Everything else is derived from the dataclass:
  - the worker's CLI and the flags of `testbed train`: add_arguments(parser)
  - the experiment file's `train:` schema: TrainSpec in testbed/experiments/spec.py, from described()
  - the argv given to the workers: TrainSettings(...).worker_argv()
  - the runner's config and the defaults it reports: TrainSettings(...), default_of(name)
so adding a field here is all it takes to add a setting. The derivations read this module's `TrainSettings`
when they run (parsers when they are built, TrainSpec when spec.py is imported): a subclass with more fields,
assigned to it before the rest of testbed is imported, is seen everywhere (tests/test_settings.py does that).

Imports nothing heavy (no torch): validation and the CLIs need only this and the preset table.
"""

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass, field
from typing import NamedTuple

from testbed.train.model import PRESETS

KINDS = (bool, int, float, str, list)  # list: of strings (comma-separated on a command line)


def setting(default=MISSING, help="", *, choices=None, ge=None, gt=None, le=None, worker=True, file=True):
    """A settings field: its default (MISSING: required), help, choices or range, and where it goes."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "ge": ge, "gt": gt, "le": le,
            "worker": worker, "file": file}
    return field(default=default, metadata=meta)


class Setting(NamedTuple):
    """One field of a settings dataclass, as the derivations see it."""

    name: str
    kind: type  # one of KINDS
    optional: bool  # None is allowed: decided at run time (the help says how)
    default: object  # MISSING: required
    help: str
    choices: tuple | None
    ge: float | None
    gt: float | None
    le: float | None
    worker: bool
    file: bool

    @property
    def flag(self):
        return "--" + self.name.replace("_", "-")

    @property
    def required(self):
        return self.default is MISSING

    def problem(self, value):
        """What is wrong with `value` for this setting, or None."""
        if value is None:
            return None if self.optional else "must be set"
        ok = {bool: lambda v: isinstance(v, bool),
              int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str),
              list: lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)}[self.kind]
        if not ok(value):
            return f"must be {'a list of str' if self.kind is list else self.kind.__name__}, got {value!r}"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, got {value!r}"
        for bound, holds, word in ((self.ge, lambda b: value >= b, ">="), (self.gt, lambda b: value > b, ">"),
                                   (self.le, lambda b: value <= b, "<=")):
            if bound is not None and not holds(bound):
                return f"must be {word} {bound:g}, got {value!r}"
        return None


def _kind(tp, name):
    """(kind, optional) of an annotation: int, int | None, list[str] | None, ..."""
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"setting {name}: only X | None unions are supported, got {tp}")
        tp = rest[0]
    kind = typing.get_origin(tp) or tp
    if kind not in KINDS or (kind is list and typing.get_args(tp) not in ((), (str,))):
        raise TypeError(f"setting {name}: type must be bool, int, float, str or list[str], got {tp}")
    return kind, optional


def described(cls=None):
    """The settings of `cls` (default: this module's TrainSettings), in field order."""
    cls = cls or TrainSettings
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional = _kind(hints[f.name], f.name)
        m = f.metadata
        default = f.default if f.default_factory is MISSING else f.default_factory()
        out.append(Setting(f.name, kind, optional, default, m.get("help", ""), m.get("choices"), m.get("ge"),
                           m.get("gt"), m.get("le"), m.get("worker", True), m.get("file", True)))
    return out


def default_of(name, cls=None):
    """The default of one setting (MISSING for a required one)."""
    s = next((s for s in described(cls) if s.name == name), None)
    if s is None:
        raise KeyError(f"no training setting {name!r}")
    return s.default


def _argparse_type(s):
    def parse(text):
        try:
            value = [x.strip() for x in text.split(",") if x.strip()] if s.kind is list else s.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {s.kind.__name__}, got {text!r}") from None
        problem = s.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = s.kind.__name__
    return parse


def add_arguments(parser, *, worker_only=False, cls=None):
    """One option per setting (--batch-size for batch_size; --x/--no-x for booleans). With worker_only, only
    the settings passed to workers (the worker's own CLI)."""
    for s in described(cls):
        if worker_only and not s.worker:
            continue
        help = s.help.replace("%", "%%")
        kw = {"default": None if s.required else s.default, "required": s.required}
        if s.kind is bool:
            if s.default is not None:
                help += f" (default: {'on' if s.default else 'off'})"
            parser.add_argument(s.flag, action=argparse.BooleanOptionalAction, help=help, **kw)
            continue
        if s.default not in (MISSING, None):
            shown = ",".join(s.default) if s.kind is list else s.default
            help += f" (default: {shown})"
        if s.choices:
            kw["choices"] = s.choices
        parser.add_argument(s.flag, type=_argparse_type(s), help=help,
                            metavar=None if s.choices else s.name.upper(), **kw)


def from_args(args, cls=None):
    """Settings from an argparse namespace (those it lacks keep their defaults)."""
    cls = cls or TrainSettings
    return cls(**{s.name: getattr(args, s.name) for s in described(cls) if hasattr(args, s.name)})


@dataclass(frozen=True)
class TrainSettings:
    mode: str = setting(help="ddp: one replica per host, gradients allreduced over the data links; "
                             "pp: one pipeline stage per host", choices=("ddp", "pp"), file=False)
    steps: int = setting(help="training steps", ge=1, file=False)
    model: str = setting("tiny", "GPT-2 preset (testbed/train/model.py)", choices=PRESETS, file=False)
    seed: int = setting(0, "seed of the initial parameters and of the batches", ge=0, file=False)
    batch_size: int = setting(8, "sequences per step per data-parallel rank (pp: the global batch, split into "
                                 "--microbatches)", ge=1)
    seq_len: int | None = setting(None, "tokens per sequence (default: the model's context)", ge=1)
    lr: float = setting(1e-3, "learning rate (AdamW, constant)", gt=0)
    grad_clip: float = setting(1.0, "global-norm gradient clipping; 0 disables", ge=0)
    eval_every: int = setting(0, "evaluate every K steps and after the last; 0: never", ge=0)
    eval_batches: int = setting(4, "fixed validation batches per evaluation", ge=1)
    schedule: str = setting("gpipe", "pp: pipeline schedule", choices=("gpipe", "1f1b"))
    microbatches: int | None = setting(None, "pp: microbatches per step, must divide --batch-size "
                                             "(default: the world size)", ge=1)
    timeout: float = setting(30.0, "process-group timeout in s: a collective/send/recv that waits longer fails "
                                   "(hung), so a corrupted frame cannot stall a run for long", gt=0)
    reference: bool = setting(True, "ddp: also allreduce every bucket over the clean management network and "
                                    "count the values that differ")
    data: str | None = setting(None, "UTF-8 text file to train on (default: the Shakespeare corpus)")
    threads: int | None = setting(None, "torch threads per worker (default: $TESTBED_TORCH_THREADS, else 1)",
                                  ge=1)
    fingerprint_every: int = setting(1, "sha256 of the parameters every K steps and at the last; 0: never",
                                     ge=0)
    fingerprint_sample: int = setting(4096, "parameter coordinates sampled per step", ge=1)
    nonfinite: str = setting("skip", "a step whose loss or gradient norm is not finite: skip its update on "
                                     "every rank (as mixed-precision trainers do) or stop the run as diverged",
                             choices=("skip", "stop"))
    max_skips: int = setting(0, "more consecutive skipped steps than this end the run as diverged; 0: no limit",
                             ge=0)
    save_final: bool | None = setting(None, "save final-rank{R}.pt (default: below 50M parameters per rank)")
    # the launcher's own settings: not passed to the workers
    hosts: int | None = setting(None, "use only the first N hosts of the topology (default: all)", ge=2,
                                worker=False)
    collectives: list[str] | None = setting(None, "scope tensor: corrupt only these gloo collectives, "
                                                  "comma-separated (default: ddp allreduce, pp p2p)",
                                            worker=False)
    stall_timeout: float = setting(120.0, "hung when no rank makes progress for this long, in s", gt=0,
                                   worker=False)
    run_timeout: float = setting(3600.0, "hung when the whole run takes longer, in s", gt=0, worker=False,
                                 file=False)

    def __post_init__(self):
        for s in described(type(self)):
            problem = s.problem(getattr(self, s.name))
            if problem:
                raise ValueError(f"{s.name}: {problem}")
        context = PRESETS[self.model].n_positions
        if self.seq_len is not None and self.seq_len > context:
            raise ValueError(f"seq_len: must be <= {context} (the context of {self.model}), got {self.seq_len}")
        if self.mode == "pp" and self.microbatches and self.batch_size % self.microbatches:
            raise ValueError(f"microbatches: must divide batch_size {self.batch_size}, got {self.microbatches}")

    def worker_argv(self):
        """The worker's arguments for these settings (without --out). None is left out: the worker decides."""
        argv = []
        for s in described(type(self)):
            value = getattr(self, s.name)
            if not s.worker or value is None:
                continue
            if s.kind is bool:
                argv.append(s.flag if value else "--no-" + s.flag[2:])
            else:
                argv += [s.flag, ",".join(value) if s.kind is list else str(value)]
        return argv
