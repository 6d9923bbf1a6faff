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
import math
import types
import typing
from dataclasses import MISSING, dataclass, field
from typing import NamedTuple

from testbed.train.model import PRESETS
from testbed.vocab import GUARDS, MODES, PERTURBATIONS, WIRE_DTYPES

# list: of strings; tuple: a fixed number of floats (tuple[float, float]); both comma-separated on a command line
KINDS = (bool, int, float, str, list, tuple)


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
    length: int | None = None  # tuple: how many floats

    @property
    def flag(self):
        return "--" + self.name.replace("_", "-")

    @property
    def required(self):
        return self.default is MISSING

    @property
    def annotation(self):
        """The value's full type (list[str], tuple[float, float], int, ...), for validators that check elements."""
        return {list: list[str], tuple: tuple[(float,) * (self.length or 1)]}.get(self.kind, self.kind)

    def text(self, value):
        """`value` as written on a command line."""
        return ",".join(map(str, value)) if self.kind in (list, tuple) else str(value)

    def problem(self, value):
        """What is wrong with `value` for this setting, or None."""
        if value is None:
            return None if self.optional else "must be set"
        ok = {bool: lambda v: isinstance(v, bool),
              int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str),
              list: lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
              tuple: lambda v: isinstance(v, (list, tuple)) and len(v) == self.length
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)}[self.kind]
        if not ok(value):
            want = {list: "a list of str", tuple: f"{self.length} floats"}.get(self.kind, self.kind.__name__)
            return f"must be {want}, got {value!r}"
        if self.kind in (float, tuple) and not all(map(math.isfinite, value if self.kind is tuple else [value])):
            return f"must be finite, got {value!r}"  # inf as a timeout, a rate or a bound breaks the run later
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
    kind, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if (kind not in KINDS or (kind is list and args not in ((), (str,)))
            or (kind is tuple and (not args or set(args) != {float}))):
        raise TypeError(f"setting {name}: type must be bool, int, float, str, list[str] or tuple[float, ...] "
                        f"(a fixed number of floats), got {tp}")
    return kind, optional, len(args) if kind is tuple else None


def described(cls=None):
    """The settings of `cls` (default: this module's TrainSettings), in field order."""
    cls = cls or TrainSettings
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional, length = _kind(hints[f.name], f.name)
        m = f.metadata
        default = f.default if f.default_factory is MISSING else f.default_factory()
        out.append(Setting(f.name, kind, optional, default, m.get("help", ""), m.get("choices"), m.get("ge"),
                           m.get("gt"), m.get("le"), m.get("worker", True), m.get("file", True), length))
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
            parts = [x.strip() for x in text.split(",") if x.strip()]
            value = parts if s.kind is list else tuple(map(float, parts)) if s.kind is tuple else s.kind(text)
        except ValueError:
            want = f"{s.length} comma-separated floats" if s.kind is tuple else s.kind.__name__
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
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
            help += f" (default: {s.text(s.default)})"
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
                             "pp: one pipeline stage per host", choices=MODES, file=False)
    steps: int = setting(help="training steps", ge=1, file=False)
    model: str = setting("tiny", "GPT-2 preset (testbed/train/model.py)", choices=PRESETS, file=False)
    seed: int = setting(0, "seed of the initial parameters and of the batches", ge=0, file=False)
    batch_size: int = setting(8, "sequences per step per data-parallel rank (pp: the global batch, split into "
                                 "--microbatches)", ge=1)
    seq_len: int | None = setting(None, "tokens per sequence (default: the model's context)", ge=1)
    # the recipe; the defaults are nanoGPT's: AdamW (0.9, 0.95), decay 0.1 on matrices, norm clipping 1.0
    optimizer: str = setting("adamw", "adamw, or sgd with --momentum", choices=("adamw", "sgd"))
    lr: float = setting(1e-3, "peak learning rate (see --lr-schedule)", gt=0)
    lr_schedule: str = setting("constant", "constant, or cosine: decays to 10% of --lr at the last step; both "
                                           "after --warmup-steps of linear warmup", choices=("constant", "cosine"))
    warmup_steps: int = setting(0, "steps of linear warmup: lr/K, 2lr/K, ... lr for K steps", ge=0)
    betas: tuple[float, float] = setting((0.9, 0.95), "adamw: the moments' decay rates, each in [0, 1)")
    eps: float = setting(1e-8, "adamw: added to the second moment's root", gt=0)
    momentum: float = setting(0.9, "sgd: momentum (0: none)", ge=0, le=1)
    weight_decay: float = setting(0.1, "weight decay on matrices (2-D parameters) only; decoupled for adamw, "
                                       "added to the gradient for sgd", ge=0)
    clip: str = setting("norm", "gradient clipping: norm (scale the gradients to global L2 norm <= "
                                "--grad-clip), value (clamp every element to +-grad_clip) or none",
                        choices=("norm", "value", "none"))
    grad_clip: float = setting(1.0, "the bound of --clip; 0: no clipping (as --clip none)", ge=0)
    guard: str = setting("skip", "a step whose loss or gradient norm is not finite: skip its update on every rank, "
                                 "stop the run as diverged, none (apply it: Inf/NaN can reach the weights; diverged "
                                 "when the loss is no longer finite) or sanitize (zero received values that are "
                                 "not finite or exceed --sanitize-threshold, then skip as skip does)",
                         choices=GUARDS)
    sanitize_threshold: float = setting(1e3, "sanitize: received values of larger magnitude are zeroed; far above "
                                             "clean DDP gradients (< 1) and the PP activations of tiny, small and "
                                             "mini (their clean runs never reach it), far below what a flip of "
                                             "the top exponent bits makes (x2^32 and more); GPT-2 124M's PP "
                                             "activations pass it after ~130 steps (docs/training.md, Guard)", gt=0)
    wire_dtype: str = setting("fp32", "dtype on the data link: DDP's gradient allreduce, PP's activations and "
                                      "gradients", choices=WIRE_DTYPES)
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
    max_skips: int = setting(0, "more consecutive skipped steps than this end the run as diverged; 0: no limit",
                             ge=0)
    save_final: bool | None = setting(None, "save final-rank{R}.pt (default: below 50M parameters per rank)")
    # where the bit errors happen (docs/injector.md)
    injector: str = setting("wire", "wire: bits flipped on the emulated links (engines on a topology that is brought "
                                    "up); process: the same error models applied inside the workers, run here on "
                                    "loopback with the topology's world size and link settings (DDP: a ring "
                                    "allreduce corrupted per hop; PP: each stage boundary)", choices=("wire", "process"))
    device: str = setting("cpu", "where the workers compute: cpu, or cuda (injector process, ddp only: flips drawn "
                                 "and applied on the GPU)", choices=("cpu", "cuda"))
    monitor: bool = setting(False, "fault localisation (docs/locate.md): after every step, time a probe to each "
                                   "ring neighbour over the data link and checksum it over the management "
                                   "network (pp: also every stage boundary's activations and gradients), record "
                                   "per-bucket collective times and the host's TCP counters, and send it all to "
                                   "rank 0 over the management network, which writes RUN_DIR/monitor-ranks.jsonl; "
                                   "`testbed locate RUN_DIR` reads it")
    perturb: str = setting("none", "a control at BER 0 (the chaos floor; docs/training.md): lsb flips the least "
                                   "significant mantissa bit of one gradient value once, at step 1 (element i of "
                                   "the first parameter's gradient, wte, i = its largest-magnitude element, after "
                                   "the allreduce and before clipping, on every DDP replica alike; PP: stage 0); "
                                   "weight-lsb flips that bit of the same parameter element after step 1's update; "
                                   "order reverses the sequences of every batch (DDP: each rank's, PP: the global "
                                   "batch), so the loss mean and every weight gradient sum over the batch in "
                                   "another order (the same mathematics, other rounding); none: no control",
                           choices=PERTURBATIONS)
    resync_every: int = setting(0, "ddp, a control: every K steps, after the update, copy rank 0's parameters and "
                                   "optimizer state to every replica over the clean management network, so the "
                                   "replicas cannot drift apart (guard sanitize zeroes values on each rank "
                                   "separately); 0: never", ge=0)
    # the launcher's own settings: not passed to the workers
    on_detection: str = setting("none", "with --monitor: what the launcher does when a detector first becomes "
                                        "confident: none, or clean: set the named link's BER to 0 on both "
                                        "directions (`link set`, as a repair swaps the optics) and log it in "
                                        "RUN_DIR/monitor-actions.jsonl; `testbed locate` prints the step time "
                                        "before and after", choices=("none", "clean"), worker=False)
    link_seed: str = setting("topology", "the wire's corruption seeds: topology (each link direction's seed from the "
                                         "topology file, the same for every run seed: seeds vary the training, "
                                         "not the flips) or run (the run seed mixed into every link direction's "
                                         "seed: each seed also an independent draw of the link, as the process "
                                         "injector always does); docs/experiments.md, \"What a seed varies\"",
                             choices=("topology", "run"), worker=False)
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
            value = getattr(self, s.name)
            problem = s.problem(value)
            if problem:
                raise ValueError(f"{s.name}: {problem}")
            if s.kind is tuple and isinstance(value, list):  # from a file or JSON: one spelling, hashable
                object.__setattr__(self, s.name, tuple(value))
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: must be in [0, 1), got {self.betas!r}")
        context = PRESETS[self.model].n_positions
        if self.seq_len is not None and self.seq_len > context:
            raise ValueError(f"seq_len: must be <= {context} (the context of {self.model}), got {self.seq_len}")
        if self.device == "cuda" and (self.injector != "process" or self.mode != "ddp"):
            raise ValueError("device: cuda needs injector process and mode ddp (the wire's hosts and PP's "
                             f"pipeline run on CPU), got injector {self.injector}, mode {self.mode}")
        if self.resync_every and self.mode != "ddp":
            raise ValueError(f"resync_every: only ddp has replicas to re-synchronise, got mode {self.mode}")
        if self.on_detection != "none" and not self.monitor:
            raise ValueError(f"on_detection: {self.on_detection} needs monitor (the detectors read its records)")
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
                argv += [s.flag, s.text(value)]
        return argv
