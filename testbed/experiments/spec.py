"""What an experiment is: a grid over BER x mode x scope x checksum x seed, with a topology per mode and a model.

    name: quick
    model: tiny
    steps: 30
    topologies: {ddp: topologies/pair.yaml, pp: topologies/pair.yaml}
    grid: {mode: [ddp, pp], ber: [0, 1e-5, 1e-4], scope: [tensor], checksum: [fix], seed: [1]}
    train: {batch_size: 8, seq_len: 64, lr: 0.001, eval_every: 10}
    latency: {topology: topologies/pair.yaml, bers: [0, 1e-6, 1e-5], size: 16384, count: 500}

Validated like topology files: errors name the file, the field and the problem.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from .. import units
from ..topo import Topology, TopologyError
from ..train import settings
from ..train.model import PRESETS
from ..yamlfile import read_yaml

Ber = Annotated[float, BeforeValidator(lambda x: units.parse_probability(x, upper=0.5))]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GridSpec(_Strict):
    mode: list[Literal["ddp", "pp"]] = Field(min_length=1)
    ber: list[Ber] = Field(min_length=1)
    scope: list[Literal["payload", "all", "tensor"]] = Field(default_factory=lambda: ["tensor"], min_length=1)
    checksum: list[Literal["fix", "keep"]] = Field(default_factory=lambda: ["fix"], min_length=1)
    seed: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [1], min_length=1)


def train_spec() -> type[BaseModel]:
    """The `train:` section, derived from the training settings (testbed/train/settings.py): every setting an
    experiment file may set, with the same type, default, choices and range, so errors name the field."""
    fields = {}
    for s in settings.described():
        if not s.file:
            continue
        tp = Literal[s.choices] if s.choices else list[str] if s.kind is list else s.kind
        if s.optional:
            tp = tp | None
        fields[s.name] = (tp, Field(default=... if s.required else s.default, ge=s.ge, gt=s.gt, le=s.le,
                                    description=s.help))
    return create_model("TrainSpec", __base__=_Strict, **fields)


TrainSpec = train_spec()
ModelName = Literal[tuple(PRESETS)]


class LatencySpec(_Strict):
    topology: str
    link: str | None = None
    bers: list[Ber] = Field(default_factory=lambda: [0.0, 1e-6, 1e-5])
    size: int = Field(default=16384, ge=1)
    count: int = Field(default=500, ge=10)


class ExperimentFile(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,15}$")
    description: str | None = None
    model: ModelName = settings.default_of("model")
    steps: int = Field(ge=1)
    runtime: Literal["netns", "docker"] | None = None
    topologies: dict[Literal["ddp", "pp"], str]
    grid: GridSpec
    train: TrainSpec = Field(default_factory=TrainSpec)
    latency: LatencySpec | None = None
    point_timeout: float = Field(default=1800, gt=0, description="wall-clock limit per point (s)")


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

    @property
    def id(self) -> str:
        return f"{self.mode}-ber{format_ber(self.ber)}-{self.scope}-{self.checksum}-s{self.seed}"

    @property
    def baseline(self) -> "Point":
        """The clean run this point is compared with: same mode and seed at BER 0."""
        return Point(self.mode, 0.0, self.scope, self.checksum, self.seed)

    def params(self) -> dict:
        return {"mode": self.mode, "ber": self.ber, "scope": self.scope, "checksum": self.checksum, "seed": self.seed}


@dataclass(frozen=True)
class Experiment:
    spec: ExperimentFile
    file: str
    base_dir: Path

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
            if (base / cand).exists():
                return base / cand
        return self.base_dir / cand

    def topology(self, mode: str) -> Topology:
        return Topology.load(self.resolve(self.spec.topologies[mode]))

    def points(self) -> list[Point]:
        """The grid, with any missing BER-0 baselines added, baselines first (deviation needs them)."""
        g = self.spec.grid
        pts = [Point(m, b, s, c, seed) for m, b, s, c, seed in itertools.product(g.mode, g.ber, g.scope, g.checksum, g.seed)]
        base = {p.baseline for p in pts}
        ordered = sorted(base, key=_order) + sorted((p for p in pts if p not in base), key=_order)
        return ordered

    def fingerprint(self, runtime: str | None = None) -> str:
        """Identifies everything that shapes a point's result but the grid: model, steps, training settings,
        the topology files' contents and the runtime. A re-run reuses a finished point only if it matches."""
        d = self.spec.model_dump(exclude={"grid", "latency", "description", "point_timeout", "topologies"})
        d["topologies"] = {m: hashlib.sha256(self.resolve(f).read_bytes()).hexdigest()
                           for m, f in sorted(self.spec.topologies.items())}
        d["runtime"] = runtime or self.spec.runtime or "netns"
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def portable_copy(self) -> str:
        """The experiment file with absolute topology paths, to keep beside the results (re-runnable there)."""
        raw = yaml.safe_load(Path(self.file).read_text())
        raw["topologies"] = {m: str(self.resolve(f).resolve()) for m, f in raw["topologies"].items()}
        if raw.get("latency"):
            raw["latency"]["topology"] = str(self.resolve(raw["latency"]["topology"]).resolve())
        return yaml.safe_dump(raw, sort_keys=False)


def _order(p: Point) -> tuple:
    return (p.mode, p.scope, p.checksum, p.ber, p.seed)
