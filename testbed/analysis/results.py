"""The results.jsonl row: one place that says which fields a row has, their types and what they mean.

The runner builds rows with `new_row` (a trained point) and `error_row` (a point whose set-up failed); both
refuse a missing or an unknown field, so a row always has exactly the fields listed here. The report's
summary.csv columns are the scalar fields, in this order; the plots and the analysis read rows through the
helpers below. docs/experiments.md documents the same table (`python -m testbed.analysis.results` prints
it as markdown).

Types are JSON types: `str`, `int`, `float` (an int is a valid float), `bool`, `list`, `dict`; a trailing `?`
means the value may be null.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from testbed.train.settings import default_of
from testbed.vocab import DEFAULT_RECIPE, MODES

STATUSES = ("ok", "diverged", "crashed", "hung", "invalid", "error")  # the report lists them in this order
CONFIG_FIELDS = ("mode", "scope", "checksum", "recipe")  # a "config": the grid coordinates but BER and seed
# the training setup, for the theory overlays (the first row of a mode that reports each one)
SETUP_FIELDS = ("model", "n_params", "steps", "lr", "grad_clip", "world_size", "batch_size", "seq_len")
# a recipe's settings, for the theory of each point (a row without them predates recipes: the defaults)
RECIPE_FIELDS = ("tokens_per_step", "microbatches", "optimizer", "clip", "guard", "sanitize_threshold",
                 "wire_dtype", "element", "protect", "protected_ber")
# (the training settings' defaults, and the link's: no element or protect set, no residual errors)
RECIPE_DEFAULTS = {**{k: default_of(k) for k in ("optimizer", "clip", "guard", "sanitize_threshold", "wire_dtype")},
                   "element": None, "protect": None, "protected_ber": 0.0}
MODE_ORDER = MODES

_JSON_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "list": (list,),
               "dict": (dict,)}
_SCALAR_TYPES = {"str", "int", "float", "bool"}


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # a key of _JSON_TYPES, with "?" when null is allowed
    doc: str
    in_error_row: bool = False  # also a field of the row of a point whose set-up failed

    @property
    def nullable(self) -> bool:
        return self.type.endswith("?")

    @property
    def json_type(self) -> str:
        return self.type.rstrip("?")

    @property
    def scalar(self) -> bool:
        """Fits one CSV cell (curves, lists and objects do not)."""
        return self.json_type in _SCALAR_TYPES

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) and self.json_type != "bool":
            return False  # JSON true is not a number
        if isinstance(value, float) and not math.isfinite(value):
            return False  # results.jsonl is strict JSON: no NaN or Infinity
        return isinstance(value, _JSON_TYPES[self.json_type])


def _f(name: str, type_: str, doc: str, error: bool = False) -> Field:
    return Field(name, type_, doc, error)


FIELDS: tuple[Field, ...] = (
    _f("point", "str", "point id, e.g. `ddp-ber1e-5-tensor-fix-s1`; another recipe than the default before the "
                       "seed: `ddp-ber1e-5-tensor-fix-sanitize-s1`", error=True),
    _f("baseline", "str", "id of the clean point (BER 0, same recipe/mode/scope/checksum/seed) it is compared "
                          "with", error=True),
    _f("experiment", "str", "experiment name", error=True),
    _f("tolerance", "float?", "the paired rule's tolerance on the eval-loss gap, relative to the clean eval loss: "
                              "the experiment file's `tolerance:` (default 0.01), fixed before the run; null: a row "
                              "that predates it", error=True),
    _f("recipe", "str", "grid coordinate: the recipe (`default`: the file's `train:` as it is)", error=True),
    _f("fingerprint", "str", "hash of everything but the grid (a re-run reuses a point only if it matches)",
       error=True),
    _f("mode", "str", "grid coordinate: `ddp` or `pp`", error=True),
    _f("ber", "float", "grid coordinate: bit error rate of every link direction (with a `fault:`, of the "
                       "fault link only)", error=True),
    _f("scope", "str", "grid coordinate: what the engine corrupts (`payload`, `all`, `tensor`)", error=True),
    _f("checksum", "str", "grid coordinate: `fix` (errored segments delivered) or `keep` (dropped, resent)",
       error=True),
    _f("seed", "int", "grid coordinate: the training seed (model init, data order); with the process "
       "injector also the corruption seed (mixed into each hop's stream); on the wire the engines' flips come "
       "from the topology's link seeds, the same for every run seed", error=True),
    _f("ber_at_lambda", "float?", "grid `ber_at_lambda`: the lambda (catastrophic values per step, unprotected wire) "
                                  "the point's BER was computed for; null: a BER of the grid's `ber`", error=True),
    _f("model", "str", "GPT-2 preset (`tiny`, `small`, `mini`, `gpt2-124m`; a recipe's `model` or the file's)",
       error=True),
    _f("steps", "int", "training steps requested", error=True),
    _f("topology", "str?", "name of the topology the point trained on"),
    _f("runtime", "str", "where hosts lived: `netns` or `docker`; `loopback` for injector process (local "
                         "processes, no hosts)", error=True),
    _f("injector", "str", "where the bit errors happened: `wire` (engines on the emulated links) or `process` "
                          "(the same error models inside the workers; docs/injector.md)", error=True),
    _f("world_size", "int?", "ranks (one per host)"),
    _f("status", "str", "`ok`, `crashed`, `hung`, `diverged`, `invalid` (an engine died), `error` (set-up failed)",
       error=True),
    _f("reason", "str?", "why, when not ok", error=True),
    _f("steps_completed", "int", "steps every rank finished", error=True),
    _f("skipped_steps", "int?", "updates skipped for a non-finite loss or gradient"),
    _f("lost_step_fraction", "float?", "skipped_steps / steps_completed"),
    _f("sanitized_values", "int?", "guard sanitize: received values zeroed, all ranks and steps"),
    _f("frozen_values", "int?", "parameter elements that can no longer train at the end (non-finite, or Adam's "
                                "second moment > 1e6); DDP: the worst replica, PP: all stages"),
    _f("initial_eval_loss", "float?", "evaluation loss before the first update"),
    _f("made_progress", "bool?", "the last eval loss is at least 1 % below the initial one (training loss "
                                 "without evals); null: unknown"),
    _f("final_loss", "float?", "last training loss"),
    _f("final_eval_loss", "float?", "last evaluation loss (evaluated on clean links)"),
    _f("loss_curve", "list", "[float/null]: training loss per step (index = step; null where non-finite)"),
    _f("eval_curve", "list", "[[step, float]]: evaluation loss"),
    _f("grad_norm_curve", "list", "[float/null]: gradient norm per step"),
    _f("step_time_curve", "list", "[float]: step time per step (slowest rank), s"),
    _f("median_step_time_s", "float?", "median step time (slowest rank), s"),
    _f("median_comm_time_s", "float?", "median time per step spent in communication, s"),
    _f("bits_seen", "int?", "engine counter over the run: bits eligible for corruption"),
    _f("bits_flipped", "int?", "engine counter over the run: bits flipped"),
    _f("realized_ber", "float?", "bits_flipped / bits_seen"),
    _f("flips_sign", "int?", "engine counters, summed over engines: flips of sign bits (scope tensor)"),
    _f("flips_exponent", "int?", "flips of exponent bits"),
    _f("flips_mantissa", "int?", "flips of mantissa bits"),
    _f("bits_exposed", "int?", "bits the engines could flip at the full BER (not protected)"),
    _f("queue_dropped", "int?", "engine counters over the run, summed: packets the kernel dropped because an NFQUEUE "
                                "engine's queue was full (loss the engine caused, not the link; bpf engines have "
                                "no queue: 0); null: no engine"),
    _f("user_dropped", "int?", "the same, because the engine's socket was overrun"),
    _f("nonfinite_received_total", "int?", "values that arrived non-finite"),
    _f("corrupted_values_total", "int?", "gradient elements that differed from the clean reference (DDP)"),
    _f("deviation_curve", "list", "[[step, float]]: estimated L2 distance of the parameters from the baseline run "
                                  "(DDP: rank 0's replica; PP: all stages together)"),
    _f("final_deviation", "float?", "L2 distance from the baseline at the end (DDP: rank 0; PP: all stages)"),
    _f("final_deviation_exact", "bool?", "final_deviation is exact (every rank saved its parameters: models under "
                                         "50M parameters per rank, or `save_final`), else the last step's estimate"),
    _f("replica_divergence_curve", "list", "[[step, float]]: DDP: max over ranks of the estimated L2 distance "
                                           "from rank 0"),
    _f("final_replica_divergence", "float?", "DDP: max over ranks of the L2 distance from rank 0 at the end"),
    _f("perturb", "str?", "a control at BER 0 (`lsb`, `weight-lsb`, `order`; docs/training.md); `none` otherwise"),
    _f("n_params", "int", "model parameters (theory overlay)"),
    _f("lr", "float?", "learning rate the run used"),
    _f("grad_clip", "float?", "global-norm clipping the run used (0: none)"),
    _f("batch_size", "int?", "sequences per step and rank (DDP) or per step (PP)"),
    _f("seq_len", "int?", "tokens per sequence"),
    _f("microbatches", "int?", "PP micro-batches per step"),
    _f("tokens_per_step", "int?", "tokens per optimizer step: batch_size x seq_len (x world_size for DDP)"),
    _f("optimizer", "str?", "`adamw` or `sgd`"),
    _f("clip", "str?", "gradient clipping: `norm`, `value` or `none`"),
    _f("guard", "str?", "what a non-finite step does: `skip`, `stop`, `none`, `sanitize`"),
    _f("sanitize_threshold", "float?", "guard sanitize: received values above it are zeroed"),
    _f("resync_every", "int?", "DDP control: rank 0's parameters and optimizer state copied to every replica "
                               "every K steps (0: never)"),
    _f("link_seed", "str?", "wire points: `topology` (the engines are seeded by the topology's link seeds, so every "
                            "run seed of a point draws the same flips) or `run` (the run seed mixed into every link "
                            "direction's seed: each seed its own draw of the link); null: no engines (the process "
                            "injector always mixes the run seed in)"),
    _f("wire_dtype", "str?", "dtype on the data link: `fp32`, `bf16`, `fp16`"),
    _f("wire_bytes_per_step", "float?", "bytes a rank hands to the data link per step (median)"),
    _f("element", "str?", "engine: the value type it corrupts (scope tensor); null: fp32"),
    _f("protect", "str?", "engine: protected fields and bit positions, comma-separated (`sign,exponent`); "
                          "null: none"),
    _f("protected_ber", "float?", "engine: residual error rate of protected bits"),
    _f("profile", "str?", "the link layer on every link (testbed/linklayer.py: none, rs544, rs544-pass, rs528, "
                          "rs272, llr): `ber` is then the physical link's pre-FEC BER and realized_ber the delivered "
                          "one; null: no profile (`ber` is delivered as it is)"),
    _f("delay_s", "float?", "one-way delay the recipe set on every link direction, s (netem); null: none"),
    _f("frames_dropped", "int?", "engine counters over the run, summed: frames a profile dropped (a failed "
                                 "codeword's, marked bad: TCP resends them); null: no engine"),
    _f("frames_replayed", "int?", "frames with a bit error that a retry profile (llr) had replayed, clean"),
    _f("codewords_failed", "int?", "a FEC profile's uncorrectable codewords"),
    _f("collectives", "list?", "[str]: what `scope: tensor` corrupted (DDP: allreduce; PP: p2p); null otherwise"),
    _f("machine", "dict", "`uname`, `cpus`, `hostname`, `cpu` (model name), `vector` (widest of avx512f, avx2, "
                          "sse4_2) and `torch` (version) of the machine that ran the point: bit-identical runs need "
                          "the same CPU kind and torch (docs/experiments.md)"),
    _f("placement", "dict?", "{host: machine}: where every host ran when the point ran across machines "
                             "(`testbed run --machines`); null: all on this machine"),
    _f("fault_link", "str?", "experiments with a `fault:`: the one link at the point's BER (both directions; the "
                             "others at the background BER), the ground truth the detectors are scored against; "
                             "null: every link at the point's BER, or a clean point"),
    _f("locate", "dict?", "monitored points (`train: {monitor: true}`): `steps_observed`, per detector `scores` "
                          "({detected, link, step, top, correct, false_alarm}) and its top 3 `suspects` "
                          "(docs/locate.md); null: not monitored"),
    _f("wall_time_s", "float?", "training wall time, s"),
    _f("phase_times_s", "dict?", "where the point's time went, s: `setup` (the point's start to its workers' "
                                 "spawn: a topology brought up, or a warm one's links set; counters, data), the "
                                 "launcher's phases (`launch`, `import`, `data`, `connect`, `build`, `steps`, "
                                 "`eval`, `fingerprint`, `loop`, `exit`; docs/training.md, summary `phases_s`), "
                                 "`finish` (the workers' end to the row: counters, a cold topology taken down, "
                                 "metrics merged) and `total`"),
    _f("finished_at", "float", "when the point finished, seconds since the epoch", error=True),
    _f("image_digest", "str?", "worker image digest (docker runtime)"),
    _f("run_dir", "str", "the point's run directory, relative to the experiment directory", error=True),
)

FIELDS_BY_NAME = {f.name: f for f in FIELDS}
ROW_FIELDS = tuple(f.name for f in FIELDS)
ERROR_ROW_FIELDS = tuple(f.name for f in FIELDS if f.in_error_row)
SUMMARY_COLUMNS = tuple(f.name for f in FIELDS if f.scalar)  # summary.csv, in this order
# what differs between two runs of one point by design (clocks), so comparisons of runs leave it out
TIMING_FIELDS = ("step_time_curve", "median_step_time_s", "median_comm_time_s", "wall_time_s", "phase_times_s",
                 "finished_at")
assert set(TIMING_FIELDS) <= set(FIELDS_BY_NAME), set(TIMING_FIELDS) - set(FIELDS_BY_NAME)


def field_names(*names: str) -> tuple[str, ...]:
    """`names`, each checked against the schema: a module names the fields it reads through this, so a renamed
    or misspelt field fails when that module loads instead of reading None from every row."""
    unknown = [n for n in names if n not in FIELDS_BY_NAME]
    if unknown:
        raise KeyError(f"not results.jsonl fields: {', '.join(unknown)}")
    return names


def new_row(**values) -> dict:
    """The row of a trained point, in schema order. Every field must be given, and nothing else."""
    return _build(ROW_FIELDS, values, "a results row")


def error_row(**values) -> dict:
    """The row of a point whose set-up failed (status `error`): the fields marked for it, nothing else."""
    return _build(ERROR_ROW_FIELDS, values, "an error row")


def _build(fields: tuple[str, ...], values: dict, what: str) -> dict:
    missing = [f for f in fields if f not in values]
    unknown = [k for k in values if k not in fields]
    if missing or unknown:
        raise ValueError(f"{what} needs exactly the schema's fields (testbed/analysis/results.py): "
                         + "; ".join(p for p in (missing and f"missing {', '.join(missing)}",
                                                 unknown and f"unknown {', '.join(unknown)}") if p))
    return {f: values[f] for f in fields}


def row_problems(row: dict) -> list[str]:
    """What is wrong with a row against the schema (missing, unknown or mistyped fields); [] when nothing."""
    shape = ERROR_ROW_FIELDS if row.get("status") == "error" and set(row) == set(ERROR_ROW_FIELDS) else ROW_FIELDS
    problems = [f"missing field {f!r}" for f in shape if f not in row]
    problems += [f"unknown field {k!r}" for k in row if k not in shape]
    for k, v in row.items():
        f = FIELDS_BY_NAME.get(k)
        if f is not None and not f.accepts(v):
            problems.append(f"{k}: expected {f.type}, got {v!r}")
    if row.get("status") not in STATUSES:
        problems.append(f"status: expected one of {', '.join(STATUSES)}, got {row.get('status')!r}")
    return problems


def validate_row(row: dict) -> dict:
    """The row itself when it matches the schema, else ValueError naming the point and every problem."""
    problems = row_problems(row)
    if problems:
        raise ValueError(f"results row {row.get('point')!r}: " + "; ".join(problems))
    return row


def markdown_table() -> str:
    """The schema as the markdown table of docs/experiments.md."""
    lines = ["| field | type | error row | meaning |", "|---|---|---|---|"]
    lines += [f"| `{f.name}` | {f.type.replace('?', '/null')} | {'yes' if f.in_error_row else ''} | {f.doc} |"
              for f in FIELDS]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Reading rows: tolerant of missing and malformed values (older files, crashed runs, hand-edited rows).


def finite(x) -> float | None:
    """x as a float when it is a finite number, else None (null, NaN, Inf, strings)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def positive(x) -> float | None:
    """x as a float when it is finite and > 0 (what a log axis can show), else None."""
    v = finite(x)
    return v if v is not None and v > 0 else None


def row_from_summary(record: dict) -> dict:
    """A summary.csv line back as a row: each schema column in its type ('' -> null), other columns as text. The
    fields that do not fit a CSV cell (curves, lists, objects) are absent: such rows rebuild the analysis, not
    the curves."""
    row = {}
    for k, v in record.items():
        f = FIELDS_BY_NAME.get(k)
        if v is None or v == "":
            row[k] = None
        elif f is None or f.json_type == "str":
            row[k] = v
        elif f.json_type == "bool":
            row[k] = v == "True"
        elif f.json_type == "int":
            row[k] = int(float(v))
        else:
            row[k] = float(v)
    return row


def ber_of(row: dict) -> float:
    """The row's BER as a float (numeric strings accepted); 0 when absent."""
    try:
        ber = float(row.get("ber") or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return ber if math.isfinite(ber) else 0.0


def is_ok(row: dict) -> bool:
    return row.get("status") == "ok"


def recipe_of(row: dict) -> str:
    """The row's recipe; a row without one predates recipes: the default."""
    return row.get("recipe") or DEFAULT_RECIPE


def recipe_settings(row: dict) -> dict:
    """The row's RECIPE_FIELDS, the defaults filled in where a row lacks them; protect as a list (bit positions
    as ints)."""
    out = {k: row[k] if row.get(k) is not None else RECIPE_DEFAULTS.get(k) for k in RECIPE_FIELDS}
    if isinstance(out["protect"], str):
        out["protect"] = [int(x) if x.strip().isdigit() else x.strip() for x in out["protect"].split(",") if x.strip()]
    return out


def config_of(row: dict) -> tuple:
    """(mode, scope, checksum, recipe)."""
    return (row.get("mode"), row.get("scope"), row.get("checksum"), recipe_of(row))


def config_key(config: tuple) -> str:
    """'ddp/tensor/fix', with '/RECIPE' appended for a recipe other than the default."""
    mode, scope, checksum, recipe = config
    return f"{mode}/{scope}/{checksum}" + ("" if recipe == DEFAULT_RECIPE else f"/{recipe}")


def mode_key(mode: str) -> tuple:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), str(mode))


def recipe_key(recipe: str) -> tuple:
    """The default recipe first, then by name."""
    return (recipe != DEFAULT_RECIPE, str(recipe))


def config_sort_key(config: tuple) -> tuple:
    """Recipe, then mode (DDP before PP), scope and checksum."""
    mode, scope, checksum, recipe = config
    return (*recipe_key(recipe), *mode_key(mode), str(scope), str(checksum))


def configs(rows: list[dict]) -> list[tuple]:
    """The configs present, in grid order (recipe, DDP before PP, then scope and checksum)."""
    return sorted({config_of(r) for r in rows}, key=config_sort_key)


def recipes(rows: list[dict]) -> list[str]:
    return sorted({recipe_of(r) for r in rows}, key=recipe_key)


def modes(rows: list[dict]) -> list[str]:
    return sorted({r.get("mode") for r in rows}, key=mode_key)


def grid_order(row: dict) -> tuple:
    """Sort key of rows: recipe, mode, scope, checksum, BER, seed."""
    return (*config_sort_key(config_of(row)), ber_of(row), str(row.get("seed")))


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
