"""What an experiment is: a grid over recipe x BER x mode x scope x checksum x seed, with a topology per mode
and a model.

    name: quick
    model: tiny
    steps: 30
    tokens_per_step: 1024          # optional: each mode's batch size follows from it (below)
    topologies: {ddp: topologies/pair.yaml, pp: topologies/pair.yaml}
    recipes:                       # optional: named variations of train: and of the links
      sanitize: {train: {guard: sanitize}}
      protect: {link: {protect: [sign, exponent]}}
    grid: {recipe: [default, sanitize, protect], mode: [ddp, pp], ber: [0, 1e-5, 1e-4], seed: [1]}
    train: {seq_len: 64, lr: 0.001, eval_every: 10}
    latency: {topology: topologies/pair.yaml, bers: [0, 1e-6, 1e-5], size: 16384, count: 500}
    tolerance: 1%                  # optional: the paired rule's tolerance (docs/experiments.md), default 1 %

Recipes: a recipe's `train:` is any subset of the training settings, merged over the file's `train:`; its
`link:` holds the engine's value settings (element, protect, protected_ber), applied to every link like the
BER. The recipe `default` exists implicitly (nothing changed) and its points keep the ids they had before
recipes existed; another recipe's name goes into its points' ids.

Tokens per step: with `tokens_per_step` T, DDP trains batch_size = T / (seq_len x ranks) sequences per rank and
PP a global batch of T / seq_len sequences, so both modes see the same tokens per optimizer step. It must divide
exactly; `batch_size` is then not set anywhere.

Validated like topology files: errors name the file, the line, the field and the problem.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from testbed.linklayer import PROFILE_NAMES
from testbed.topology import units
from testbed.topology.topo import Topology, TopologyError
from testbed.train import settings
from testbed.train.model import PRESETS, seq_len_of
from testbed.topology.yamlfile import read_yaml
from testbed.vocab import (CHECKSUM_MODES, DEFAULT_RECIPE, DEFAULT_TOLERANCE, ELEMENT_TYPES, ENGINE_CHOICES, LATENCY_BERS, MODES,
                           PROTECT_FIELDS, SCOPES)

Ber = Annotated[float, BeforeValidator(lambda x: units.parse_probability(x, upper=0.5))]
BerList = Annotated[list[Ber], Field(min_length=1)]


def _tolerance(value) -> float:
    """'1%' or 0.01: the paired rule's tolerance, relative to the clean eval loss; more than 0, less than 1."""
    frac = units.parse_fraction(value)
    if not 0.0 < frac < 1.0:
        raise ValueError(f"must lie above 0 and below 1 (100%), got {value!r}")
    return frac


Tolerance = Annotated[float, BeforeValidator(_tolerance)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


RECIPE_NAME = EXPERIMENT_NAME = r"^[a-z0-9][a-z0-9_-]{0,15}$"


class GridSpec(_Strict):
    recipe: list[Annotated[str, Field(pattern=RECIPE_NAME)]] = Field(
        default_factory=lambda: [DEFAULT_RECIPE], min_length=1)
    mode: list[Literal[MODES]] = Field(min_length=1)
    ber: list[Ber] = Field(min_length=1)
    scope: list[Literal[SCOPES]] = Field(default_factory=lambda: ["tensor"], min_length=1)
    checksum: list[Literal[CHECKSUM_MODES]] = Field(default_factory=lambda: ["fix"], min_length=1)
    seed: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [1], min_length=1)
    # BERs given as the theory's lambda (catastrophic values per step, docs/theory.md section 4): per recipe and
    # mode, from its model, shape and wire dtype (theory.ber_at_lambda); added to `ber`
    ber_at_lambda: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(default=None,
                                                                                           min_length=1)


def train_spec(partial: bool = False) -> type[BaseModel]:
    """The `train:` section, derived from the training settings (testbed/train/settings.py): every setting an
    experiment file may set, with the same type, default, choices and range, so errors name the field.
    partial: a recipe's `train:`, where every setting is optional and unset ones are left out of the merge."""
    fields = {}
    for s in settings.described():
        if not s.file:
            continue
        tp = Literal[s.choices] if s.choices else getattr(s, "annotation", list[str] if s.kind is list else s.kind)
        if s.optional or partial:
            tp = tp | None
        default = None if partial else ... if s.required else s.default
        finite = {"allow_inf_nan": False} if s.kind is float else {}  # as TrainSettings requires
        fields[s.name] = (tp, Field(default=default, ge=s.ge, gt=s.gt, le=s.le, description=s.help, **finite))
    return create_model("PartialTrainSpec" if partial else "TrainSpec", __base__=_Strict, **fields)


TrainSpec = train_spec()
PartialTrainSpec = train_spec(partial=True)
ModelName = Literal[tuple(PRESETS)]


# Training settings added after results had been published, with their defaults: a point that leaves them so
# keeps its earlier fingerprint (finished points stay reusable); any other value is part of the hash.
LATER_DEFAULTS = {"injector": "wire", "device": "cpu", "monitor": False, "on_detection": "none", "perturb": "none",
                  "resync_every": 0, "link_seed": "topology"}


class LatencySpec(_Strict):
    topology: str
    link: str | None = None
    bers: list[Ber] = Field(default_factory=lambda: list(LATENCY_BERS))
    size: int = Field(default=16384, ge=1)
    count: int = Field(default=500, ge=10)
    engine: Literal[ENGINE_CHOICES] | None = None  # the measured link's engine (None: the file's)


class LinkSpec(_Strict):
    """A recipe's link settings (engine, scope tensor), applied to every link of the point's topology like the
    BER. element defaults to the recipe's wire_dtype; a clean point (BER 0) gets no residual errors either.
    `profile`: a link layer (testbed/linklayer.py) on every link; the grid's BERs are then pre-FEC BERs."""
    element: Literal[ELEMENT_TYPES] | None = None
    protect: list[Literal[PROTECT_FIELDS] | Annotated[int, Field(ge=0, le=31)]] | None = None
    protected_ber: Ber | None = None
    # the residual as a fraction of each point's BER (protected_ber = protected_fraction x BER): one recipe for a
    # whole BER grid, e.g. 1e-3 for a protection that leaves a thousandth of the line's errors on protected bits
    protected_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    profile: Literal[PROFILE_NAMES] | None = None  # type: ignore[valid-type]
    # one-way delay on every link direction (netem: where the kernel has it; docs/theory.md, "Link layers")
    delay: Annotated[float | None, BeforeValidator(lambda x: None if x is None else units.parse_duration(x))] = None


class RecipeSpec(_Strict):
    description: str | None = None
    train: PartialTrainSpec = Field(default_factory=PartialTrainSpec)
    link: LinkSpec = Field(default_factory=LinkSpec)
    topology: str | dict[Literal[MODES], str] | None = Field(
        default=None, description="this recipe's topology file instead of `topologies`: one for every mode, or one "
                                  "per mode ({ddp: ring4.yaml, pp: chain4.yaml}; a mode it leaves out takes the "
                                  "file's)")
    mode: Annotated[list[Literal[MODES]], Field(min_length=1)] | None = Field(
        default=None, description="this recipe's modes instead of grid.mode (a subset of it): e.g. a DDP-only "
                                  "rank count")
    model: ModelName | None = Field(default=None, description="this recipe's GPT-2 preset (instead of the file's "
                                                               "`model`): a size ladder in one file")
    steps: int | None = Field(default=None, ge=1, description="this recipe's training steps (instead of the file's "
                                                              "`steps`)")
    baseline: Annotated[str, Field(pattern=RECIPE_NAME)] | None = Field(
        default=None, description="the recipe whose clean runs this recipe's points are compared with. A control "
                                  "(train: perturb) runs at BER 0 only, against them; a recipe that differs from "
                                  "its baseline only in `link:` (protect, protected_ber, protected_fraction, "
                                  "element: nothing at BER 0) runs no clean runs of its own, its BER points are "
                                  "paired with the baseline's (the same training, bit for bit)")
    ber: BerList | dict[Literal[MODES], BerList] | None = Field(
        default=None, description="this recipe's BERs instead of grid.ber: one list for every mode, or one per mode "
                                  "({ddp: [...], pp: [...]}: a threshold grid around each mode's own); the clean "
                                  "runs (BER 0) are added when missing")
    seed: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = Field(
        default=None, description="this recipe's seeds instead of grid.seed (a large model with fewer seeds)")


class FaultSpec(_Strict):
    """Fault localisation (docs/locate.md): at a point of BER > 0 only one link has that BER (both directions),
    every other link `background_ber`; BER 0 points are all clean. `link: random` draws the link per seed
    (testbed/locate/faults.py: the same link for a seed's keep and fix points); a name fixes it."""
    link: str = "random"
    background_ber: Ber = 0.0


class ResourcesSpec(_Strict):
    """What one point's job asks of a scheduler (`testbed run --executor slurm`, docs/cluster.md); flags of
    `testbed run` override each field. Not part of the fingerprint: where a point ran does not change it."""
    cpus: int | None = Field(default=None, ge=1, description="CPUs per point (sbatch --cpus-per-task)")
    gpus: int | None = Field(default=None, ge=0, description="GPUs per point (sbatch --gpus-per-node)")
    memory: str | None = Field(default=None, pattern=r"^[0-9]+[KMGT]?$",
                               description="memory per point, e.g. 16G (sbatch --mem)")
    time: int | None = Field(default=None, ge=1, description="time limit per point in minutes (sbatch --time)")
    partition: str | None = None
    account: str | None = None
    sbatch: dict[str, str | int | bool] = Field(default_factory=dict, description="more sbatch options, e.g. "
                                                "{qos: high, constraint: a100} (names without the dashes)")


class ExperimentFile(_Strict):
    name: str = Field(pattern=EXPERIMENT_NAME)
    description: str | None = None
    model: ModelName = settings.default_of("model")
    steps: int = Field(ge=1)
    runtime: Literal["netns", "docker"] | None = None
    tokens_per_step: int | None = Field(default=None, ge=1, description="tokens per optimizer step, both modes")
    topologies: dict[Literal[MODES], str]
    recipes: dict[Annotated[str, Field(pattern=RECIPE_NAME)], RecipeSpec] = Field(default_factory=dict)
    grid: GridSpec
    train: TrainSpec = Field(default_factory=TrainSpec)
    latency: LatencySpec | None = None
    fault: FaultSpec | None = None
    point_timeout: float = Field(default=1800, gt=0, allow_inf_nan=False, description="wall-clock limit per point (s)")
    tolerance: Tolerance = Field(default=DEFAULT_TOLERANCE, description="the paired rule's tolerance on the "
                                 "eval-loss gap, relative to the clean eval loss ('1%' or 0.01); set before the run")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    reuse: list[Annotated[str, Field(pattern=EXPERIMENT_NAME)]] = Field(
        default_factory=list, description="names of other experiments whose rows count as this file's where a "
                                          "recipe has the same name and settings (the fingerprint it would have "
                                          "under that name): copy their results.jsonl into --out, and those points "
                                          "are not run again")


def format_ber(ber: float) -> str:
    """0 -> '0', 1e-4 -> '1e-4', 2.5e-05 -> '2.5e-5' (short, exact enough for ids and labels)."""
    if ber == 0:
        return "0"
    mantissa, exp = f"{ber:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exp)}"


@dataclass(frozen=True)
class Point:
    mode: str
    ber: float
    scope: str
    checksum: str
    seed: int
    recipe: str = DEFAULT_RECIPE
    lam: float | None = None  # grid.ber_at_lambda: the lambda the BER was computed for
    against: str | None = None  # the recipe whose clean runs it is compared with (RecipeSpec.baseline)

    @property
    def id(self) -> str:
        """e.g. ddp-ber1e-5-tensor-fix-s1; another recipe than the default goes before the seed:
        ddp-ber1e-5-tensor-fix-sanitize-s1."""
        recipe = "" if self.recipe == DEFAULT_RECIPE else f"-{self.recipe}"
        return f"{self.mode}-ber{format_ber(self.ber)}-{self.scope}-{self.checksum}{recipe}-s{self.seed}"

    @property
    def baseline(self) -> "Point":
        """The clean run this point is compared with: same recipe, mode, scope, checksum and seed at BER 0 (a
        recipe with a baseline: that recipe's)."""
        return Point(self.mode, 0.0, self.scope, self.checksum, self.seed, self.against or self.recipe)

    def params(self) -> dict:
        return {"recipe": self.recipe, "mode": self.mode, "ber": self.ber, "scope": self.scope,
                "checksum": self.checksum, "seed": self.seed}


@dataclass(frozen=True)
class Experiment:
    spec: ExperimentFile
    file: str
    base_dir: Path
    _topologies: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, path: str | Path) -> "Experiment":
        """Parse and check an experiment file and every topology file it names; InputError (exit code 2 from
        `testbed run`) naming the file, line, field and problem, before anything is built."""
        doc = read_yaml(path)
        if not isinstance(doc.data, dict):
            raise doc.error([("", "the file must hold a mapping with 'name', 'steps', 'topologies' and 'grid'")])
        spec = doc.validate(ExperimentFile)
        path = Path(path).resolve()
        exp = cls(spec=spec, file=str(path), base_dir=path.parent)
        problems = []
        for mode in spec.grid.mode:
            if mode not in spec.topologies:
                problems.append((f"topologies.{mode}", f"grid runs mode {mode} but names no topology for it"))
                continue
            try:
                exp.topology(mode)
            except TopologyError as e:
                problems.append((f"topologies.{mode}", str(e)))
        for name, r in spec.recipes.items():
            own = r.topology if isinstance(r.topology, dict) else {"": r.topology} if r.topology else {}
            for mode, f in own.items():
                try:
                    Topology.load(exp.resolve(f))
                except TopologyError as e:
                    problems.append((f"recipes.{name}.topology" + (f".{mode}" if mode else ""), str(e)))
            if r.mode is not None and set(r.mode) - set(spec.grid.mode):
                problems.append((f"recipes.{name}.mode", f"{', '.join(sorted(set(r.mode) - set(spec.grid.mode)))} "
                                                         f"is not in grid.mode ({', '.join(spec.grid.mode)})"))
        if not problems:
            problems += exp._recipe_problems()
        if not problems and spec.fault is not None:
            problems += exp._fault_problems()
        if spec.latency is not None:
            # checked now, not after the training points (which may take hours)
            try:
                topo = Topology.load(exp.resolve(spec.latency.topology))
                if spec.latency.link is not None:
                    topo.link(spec.latency.link)
            except TopologyError as e:
                problems.append(("latency.topology", str(e)))
            except KeyError as e:
                problems.append(("latency.link", e.args[0]))
        if problems:
            raise doc.error(problems)
        return exp

    def resolve(self, p: str) -> Path:
        """Paths in an experiment file are relative to the file, or to the project root (topologies/...)."""
        cand = Path(p)
        if cand.is_absolute():
            return cand
        for base in (self.base_dir, self.base_dir.parent, Path.cwd()):
            try:
                if (base / cand).exists():
                    return base / cand
            except OSError:  # a name the file system cannot hold (too long): no such file here; loading it says so
                continue
        return self.base_dir / cand

    def _recipe_problems(self) -> list[tuple[str, str]]:
        """The recipes in the grid exist; tokens_per_step divides into whole batches; every (recipe, mode)
        gives valid training settings; link settings meet the grid (scope tensor, protected_ber <= BER)."""
        spec, problems = self.spec, []
        defined = [DEFAULT_RECIPE] + [r for r in spec.recipes if r != DEFAULT_RECIPE]
        for i, name in enumerate(spec.grid.recipe):
            if name not in defined:
                problems.append((f"grid.recipe[{i}]", f"unknown recipe {name!r} (the file defines: "
                                                      f"{', '.join(defined)})"))
        if spec.train.perturb != "none":
            problems.append(("train.perturb", "a perturbation is a control: set it in a recipe that names its "
                                              "`baseline` (the recipe it perturbs), not for the whole file"))
        for name, r in spec.recipes.items():
            if r.baseline is not None and (r.baseline not in defined or r.baseline == name):
                problems.append((f"recipes.{name}.baseline", f"must name another recipe of the file "
                                                             f"({', '.join(n for n in defined if n != name)})"))
            elif r.baseline is not None and not self.is_control(name) and (diff := self._differs_beyond_link(name)):
                problems.append((f"recipes.{name}.baseline", "a recipe shares another's clean runs only when it "
                                                             f"differs from it in link: alone (here also {diff}); a "
                                                             "control (train: perturb) may differ in its "
                                                             "perturbation"))
            elif r.baseline is not None and not self.is_control(name) and self.recipe(r.baseline).baseline:
                problems.append((f"recipes.{name}.baseline", f"{r.baseline} takes its clean runs from another "
                                                             "recipe itself: name that one"))
            elif r.baseline is not None and self.is_control(r.baseline):
                problems.append((f"recipes.{name}.baseline", f"{r.baseline} is a control itself (perturbed)"))
            elif self.is_control(name) and r.baseline is None:
                problems.append((f"recipes.{name}.baseline", "a control (train: perturb) must name the recipe it "
                                                             "perturbs, whose clean runs it is compared with"))
        for name, r in spec.recipes.items():
            if isinstance(r.ber, dict):
                problems += [(f"recipes.{name}.ber", f"names no BERs for mode {m}, which the grid runs (give a list "
                                                     "for every mode, or one per mode of grid.mode)")
                             for m in self.modes_of(name) if m not in r.ber]
            if r.ber is not None and self.is_control(name):
                problems.append((f"recipes.{name}.ber", "a control runs at BER 0 only: it takes no BERs"))
        if problems:
            return problems
        if spec.tokens_per_step is not None:
            setters = ["train"] * ("batch_size" in spec.train.model_fields_set) + [
                f"recipes.{n}.train" for n, r in spec.recipes.items() if "batch_size" in r.train.model_fields_set]
            problems += [(f"{w}.batch_size", "tokens_per_step sets the batch size of every mode: set one of them, "
                                             "not both") for w in setters]
        for name in [None, *dict.fromkeys(spec.grid.recipe)]:  # None: the file's train: alone
            for mode in (self.modes_of(name) if name else spec.grid.mode):
                try:
                    self._settings(Point(mode, 0.0, "tensor", "fix", 0, name or DEFAULT_RECIPE),
                                   self.recipe(name) if name else None)
                except ValueError as e:
                    path = "tokens_per_step" if "tokens_per_step" in str(e) else (
                        f"recipes.{name}.train" if name else "train")
                    problems.append((path, f"{mode}: {e}"))
            if name is None:
                if problems:
                    return problems  # every recipe would repeat them
                continue
            for i, lam in enumerate(spec.grid.ber_at_lambda or []):
                for mode in self.modes_of(name):
                    if self.is_control(name) or any(p[0].startswith("recipes.") for p in problems):
                        continue
                    try:
                        self.ber_at_lambda(name, mode, lam)
                    except ValueError as e:
                        problems.append((f"grid.ber_at_lambda[{i}]", f"recipe {name}, {mode}: {e}"))
            link = self.recipe(name).link
            if link.model_dump(exclude_none=True, exclude={"profile", "delay"}) and set(spec.grid.scope) != {"tensor"}:
                problems.append((f"recipes.{name}.link", "element, protect and protected_ber need scope tensor "
                                                          f"(the grid also runs scope {', '.join(spec.grid.scope)})"))
            merged = {**spec.train.model_dump(), **self.recipe(name).train.model_dump(exclude_unset=True)}
            element = link.element or merged.get("wire_dtype") or settings.default_of("wire_dtype")
            width = 32 if element == "fp32" else 16
            for i, bit in enumerate(link.protect or []):
                if isinstance(bit, int) and bit >= width:
                    problems.append((f"recipes.{name}.link.protect[{i}]",
                                     f"bit {bit} is not a bit of a {element} value (0-{width - 1})"))
            if link.protected_fraction is not None and link.protected_ber is not None:
                problems.append((f"recipes.{name}.link.protected_fraction", "set protected_ber (one residual BER) "
                                                                             "or protected_fraction (a fraction of "
                                                                             "each point's BER), not both"))
            if link.protected_fraction and not link.protect:
                problems.append((f"recipes.{name}.link.protected_fraction", "a residual on protected bits needs "
                                                                             "protect (the bits it applies to)"))
            bers = [b for m in self.modes_of(name) for b in self.bers_of(name, m) if b > 0]
            if link.protected_ber and bers and link.protected_ber > min(bers):
                problems.append((f"recipes.{name}.link.protected_ber",
                                 f"must not exceed the {'recipe' if self.recipe(name).ber else 'grid'}'s smallest "
                                 f"BER > 0, {min(bers):g} (protected bits err "
                                 "at most as often as the line)"))
        return problems

    def topology(self, mode: str, recipe: str | None = None) -> Topology:
        """The topology of a mode's points, or of a recipe's when the recipe names its own. Read once per file
        and version of it (a Topology is immutable): checking a ladder of recipes asks for it hundreds of times."""
        path = self.resolve(self.topology_file(mode, recipe))
        try:
            st = path.stat()
            key = (str(path), st.st_mtime_ns, st.st_size)
        except OSError:
            return Topology.load(path)  # its error names the file
        if key not in self._topologies:
            self._topologies[key] = Topology.load(path)
        return self._topologies[key]

    def topology_file(self, mode: str, recipe: str | None = None) -> str:
        """The topology file (as the experiment file names it) of a recipe's points in a mode: the recipe's own
        (one for every mode, or its entry for the mode), else the file's `topologies`."""
        own = self.recipe(recipe).topology if recipe else None
        if isinstance(own, dict):
            own = own.get(mode)
        return own or self.spec.topologies[mode]

    def modes_of(self, recipe: str) -> list[str]:
        """The modes a recipe's points run: the recipe's own `mode`, else grid.mode (in grid order)."""
        own = self.recipe(recipe).mode
        return [m for m in self.spec.grid.mode if own is None or m in own]

    def fault_link(self, point: Point) -> str | None:
        """The link that carries the point's BER when the file has a `fault:` (None: every link does, or the
        point is clean). Ground truth for scoring the detectors; they are never told."""
        f = self.spec.fault
        if f is None or point.ber == 0:
            return None
        if f.link != "random":
            return f.link
        from testbed.locate.faults import pick_link

        return pick_link(self.topology(point.mode, point.recipe), point.seed)

    def _fault_problems(self) -> list[tuple[str, str]]:
        """fault.link exists in every topology the grid uses; the background is below every faulty BER."""
        from testbed.locate.faults import candidate_links

        f, problems = self.spec.fault, []
        bers = [b for b in self.spec.grid.ber if b > 0]
        if not bers:
            problems.append(("grid.ber", "a fault needs a BER > 0 (the bad link's); BER 0 points are the clean runs"))
        elif f.background_ber >= min(bers):
            problems.append(("fault.background_ber", f"must be below the grid's smallest BER > 0, {min(bers):g} "
                                                     "(the bad link must be worse than the others)"))
        if f.link != "random":
            for name in dict.fromkeys(self.spec.grid.recipe):
                for mode in self.modes_of(name):
                    topo = self.topology(mode, name)
                    if f.link not in candidate_links(topo):
                        problems.append(("fault.link", f"no link {f.link!r} that can carry errors in topology "
                                                       f"{topo.name} (links: {', '.join(candidate_links(topo))}), "
                                                       "or `random`"))
        return problems

    def recipe(self, name: str) -> RecipeSpec:
        """A recipe by name; `default` is the empty recipe unless the file defines it."""
        return self.spec.recipes.get(name) or RecipeSpec()

    def model_of(self, recipe: str) -> str:
        """The GPT-2 preset of a recipe's points: the recipe's `model`, else the file's."""
        return self.recipe(recipe).model or self.spec.model

    def steps_of(self, recipe: str) -> int:
        """The training steps of a recipe's points: the recipe's `steps`, else the file's."""
        return self.recipe(recipe).steps or self.spec.steps

    def bers_of(self, recipe: str, mode: str) -> list[float]:
        """The BERs a recipe's points run in a mode: the recipe's own `ber` (its list, or its list for the mode),
        else the grid's `ber` (grid.ber_at_lambda adds to either; the clean runs are added by points())."""
        own = self.recipe(recipe).ber
        if own is None:
            return list(self.spec.grid.ber)
        return list(own[mode] if isinstance(own, dict) else own)

    def seeds_of(self, recipe: str) -> list[int]:
        """The seeds of a recipe's points: the recipe's own `seed`, else the grid's."""
        own = self.recipe(recipe).seed
        return list(self.spec.grid.seed if own is None else own)

    def _differs_beyond_link(self, name: str) -> str:
        """What besides `link:` differs between a recipe and its baseline ('' when nothing): the clean runs of
        the two are then not the same training."""
        base = self.recipe(name).baseline
        mine, theirs = ({**self.spec.train.model_dump(), **self.recipe(x).train.model_dump(exclude_unset=True)}
                        for x in (name, base))
        diff = [k for k, v in mine.items() if theirs.get(k) != v]
        diff += ["model"] * (self.model_of(name) != self.model_of(base))
        diff += ["steps"] * (self.steps_of(name) != self.steps_of(base))
        diff += ["topology"] * any(self.topology_file(m, name) != self.topology_file(m, base)
                                   for m in self.modes_of(name))
        diff += ["mode"] * bool(set(self.modes_of(name)) - set(self.modes_of(base)))
        diff += ["seed"] * bool(set(self.seeds_of(name)) - set(self.seeds_of(base)))
        return ", ".join(diff)

    def shares_clean_runs(self, recipe: str) -> bool:
        """A recipe whose BER points pair with its baseline's clean runs (a baseline that is no control's)."""
        return self.recipe(recipe).baseline is not None and not self.is_control(recipe)

    def is_control(self, recipe: str) -> bool:
        """A recipe that perturbs a clean run (train: perturb other than none): it runs at BER 0 only."""
        return (self.recipe(recipe).train.perturb or "none") != "none"

    def ber_at_lambda(self, recipe: str, mode: str, lam: float) -> float:
        """The BER at which the theory expects `lam` catastrophic values per step on this recipe's wire (its model,
        batch, sequence length, ranks and wire dtype; nothing protected: theory.ber_at_lambda), to 3 significant
        digits. ValueError when there is none, or it exceeds 0.5."""
        from testbed.analysis import theory

        cfg = self._settings(Point(mode, 0.0, "tensor", "fix", 0, recipe), self.recipe(recipe))
        ranks = self.world_size(mode, cfg.hosts, recipe)
        shape = ({"n_params": cfg.model} if mode == "ddp" else
                 {"batch_size": cfg.batch_size, "seq_len": seq_len_of(cfg.model, cfg.seq_len),
                  "width": PRESETS[cfg.model].n_embd})
        ber = float(f"{theory.ber_at_lambda(lam, mode, ranks, wire_dtype=cfg.wire_dtype, **shape):.3g}")
        if ber > 0.5:
            raise ValueError(f"lambda {lam:g} needs BER {ber:g} > 0.5")
        return ber

    def world_size(self, mode: str, hosts: int | None = None, recipe: str | None = None) -> int:
        """Ranks of a mode's points: the topology's hosts, or the first `hosts` of them."""
        n = len(self.topology(mode, recipe).hosts)
        return min(n, hosts) if hosts else n

    def train_settings(self, point: Point) -> "settings.TrainSettings":
        """The point's settings: the file's `train:` (defaults filled in) with its recipe's `train:` over it, the
        batch size from tokens_per_step, model and steps from the top, mode and seed from the grid, point_timeout
        as the run's limit. Collectives only matter under scope tensor. ValueError when they do not fit."""
        return self._settings(point, self.recipe(point.recipe))

    def _settings(self, point: Point, recipe: RecipeSpec | None) -> "settings.TrainSettings":
        t = self.spec.train.model_dump()
        if recipe is not None:
            t.update(recipe.train.model_dump(exclude_unset=True))
        if point.scope != "tensor":
            t["collectives"] = None
        tokens = self.spec.tokens_per_step
        model = (recipe.model if recipe is not None else None) or self.spec.model
        if tokens is not None:
            seq = seq_len_of(model, t["seq_len"])
            per = seq * (self.world_size(point.mode, t["hosts"], point.recipe) if point.mode == "ddp" else 1)
            if tokens % per:
                what = "seq_len x ranks" if point.mode == "ddp" else "seq_len"
                raise ValueError(f"tokens_per_step {tokens} is not a multiple of {what} = {per}")
            t["batch_size"] = tokens // per
            micro = t["microbatches"] or self.world_size(point.mode, t["hosts"], point.recipe)
            if point.mode == "pp" and t["batch_size"] % micro:
                raise ValueError(f"tokens_per_step {tokens} gives a batch of {t['batch_size']} sequences, not a "
                                 f"multiple of {micro} micro-batches")
        steps = (recipe.steps if recipe is not None else None) or self.spec.steps
        return settings.TrainSettings(mode=point.mode, model=model, steps=steps,
                                      seed=point.seed, run_timeout=self.spec.point_timeout, **t)

    def tokens_per_step(self, point: Point) -> int:
        """Tokens per optimizer step: batch x seq_len, times the ranks for DDP (PP's batch is global)."""
        cfg = self.train_settings(point)
        seq = seq_len_of(cfg.model, cfg.seq_len)
        return cfg.batch_size * seq * (self.world_size(point.mode, cfg.hosts, point.recipe) if point.mode == "ddp"
                                       else 1)

    def link_settings(self, point: Point) -> dict:
        """The recipe's link settings that train() applies to every link, unset ones left out. element defaults
        to the wire dtype (scope tensor: the engine's field counters and protection need the value layout);
        a clean point has no residual errors on protected bits either; protected_fraction becomes protected_ber
        = fraction x the point's BER."""
        link = self.recipe(point.recipe).link.model_dump(exclude_none=True)
        wire = self.train_settings(point).wire_dtype
        if point.scope == "tensor" and "element" not in link and (wire != "fp32" or link.get("protect")):
            link["element"] = wire
        fraction = link.pop("protected_fraction", None)
        if fraction is not None:
            link["protected_ber"] = fraction * point.ber
        if point.ber == 0 and link.get("protected_ber"):
            link["protected_ber"] = 0.0
        return link

    def planned(self) -> list[tuple[str, str, str, float, str, str]]:
        """The grid as (point id, recipe, mode, BER, scope, checksum): what the report needs to say what has not
        run yet, and which BERs still lack seeds (neither pass nor fail yet)."""
        return [(p.id, p.recipe, p.mode, p.ber, p.scope, p.checksum) for p in self.points()]

    def points(self) -> list[Point]:
        """The grid, with any missing BER-0 baselines added, baselines first (deviation needs them)."""
        g = self.spec.grid
        pts = [Point(m, b, s, c, seed, r, against=self.recipe(r).baseline)
               for r in g.recipe for m in self.modes_of(r)
               for b, s, c, seed in itertools.product(self.bers_of(r, m), g.scope, g.checksum, self.seeds_of(r))
               if (b == 0 or not self.is_control(r)) and (b > 0 or not self.shares_clean_runs(r))]
        for r, m, lam in ((r, m, lam) for r in g.recipe for m in self.modes_of(r) for lam in g.ber_at_lambda or []):
            if self.is_control(r):
                continue
            b = self.ber_at_lambda(r, m, lam)
            pts += [Point(m, b, s, c, seed, r, lam, against=self.recipe(r).baseline)
                    for s, c, seed in itertools.product(g.scope, g.checksum, self.seeds_of(r))
                    if b not in self.bers_of(r, m)]
        pts = list(dict.fromkeys(pts))
        base = {p.baseline for p in pts}

        def order(p: Point) -> tuple:
            return (p.mode, p.scope, p.checksum, g.recipe.index(p.recipe) if p.recipe in g.recipe else -1, p.ber,
                    p.seed)

        return sorted(base, key=order) + sorted((p for p in pts if p not in base), key=order)

    def reused_fingerprints(self, runtime: str | None, recipe: str) -> list[str]:
        """The fingerprints a recipe's rows have in the experiments this file reuses (`reuse:`)."""
        return [self.fingerprint(runtime, recipe, name=n) for n in self.spec.reuse if n != self.spec.name]

    def fingerprint(self, runtime: str | None = None, recipe: str = DEFAULT_RECIPE, name: str | None = None) -> str:
        """Identifies everything that shapes the result of a recipe's points but the grid: model, steps, the
        training settings with the recipe's over them, its link settings, tokens_per_step, the topology files'
        contents and the runtime. A re-run reuses a finished point only if it matches. A file without recipes
        and tokens_per_step hashes as it did before they existed."""
        d = self.spec.model_dump(exclude={"grid", "latency", "description", "point_timeout", "topologies",
                                          "recipes", "tokens_per_step", "fault", "tolerance", "resources", "reuse"})
        if name is not None:  # the same recipe as another experiment would fingerprint it (reuse:)
            d["name"] = name
        r = self.recipe(recipe)
        if r.model is not None:
            d["model"] = r.model
        if r.steps is not None:
            d["steps"] = r.steps
        d["train"].update(r.train.model_dump(exclude_unset=True))
        for k, v in LATER_DEFAULTS.items():  # at their defaults, settings added later leave the hash as it was
            if d["train"].get(k) == v:
                del d["train"][k]
        if r.link.model_dump(exclude_none=True):
            d["link"] = r.link.model_dump(exclude_none=True)
        if self.spec.tokens_per_step is not None:
            d["tokens_per_step"] = self.spec.tokens_per_step
        d["topologies"] = {m: hashlib.sha256(self.resolve(f).read_bytes()).hexdigest()
                           for m, f in sorted(self.spec.topologies.items())}
        if isinstance(r.topology, str):
            d["topologies"]["recipe"] = hashlib.sha256(self.resolve(r.topology).read_bytes()).hexdigest()
        elif r.topology:  # one per mode
            d["topologies"]["recipe"] = {m: hashlib.sha256(self.resolve(f).read_bytes()).hexdigest()
                                         for m, f in sorted(r.topology.items())}
        if self.spec.fault is not None:
            d["fault"] = self.spec.fault.model_dump()
        d["runtime"] = runtime or self.spec.runtime or "netns"
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def portable_copy(self) -> str:
        """The experiment file with absolute topology paths, to keep beside the results (re-runnable there)."""
        raw = yaml.safe_load(Path(self.file).read_text())
        raw["topologies"] = {m: str(self.resolve(f).resolve()) for m, f in raw["topologies"].items()}
        if raw.get("latency"):
            raw["latency"]["topology"] = str(self.resolve(raw["latency"]["topology"]).resolve())
        for r in (raw.get("recipes") or {}).values():
            if isinstance(r, dict) and isinstance(r.get("topology"), dict):
                r["topology"] = {m: str(self.resolve(f).resolve()) for m, f in r["topology"].items()}
            elif isinstance(r, dict) and r.get("topology"):
                r["topology"] = str(self.resolve(r["topology"]).resolve())
        return yaml.safe_dump(raw, sort_keys=False)


def planned_points(out_dir: str | Path) -> list[tuple[str, str, str, float, str, str]] | None:
    """The grid of the experiment kept in out_dir (experiment.yaml) as Experiment.planned() tuples, which
    the report uses to say what has not run yet. The grid is read from the file alone, its topologies not loaded:
    the copy names them by absolute path, which need not exist where the results are read (another clone or
    machine). None when the copy is missing or does not parse, and the report then goes on without saying it."""
    path = (Path(out_dir) / "experiment.yaml").resolve()
    try:  # the runner checked the copy; a lambda grid loads its topologies and may fail here: then None
        return Experiment(spec=read_yaml(path).validate(ExperimentFile), file=str(path),
                          base_dir=path.parent).planned()
    except Exception:  # noqa: BLE001 - only the report's "Incomplete" and pending BERs depend on it
        return None
