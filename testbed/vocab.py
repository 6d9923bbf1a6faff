"""The testbed's vocabulary: the names that a link's settings, the training settings, experiment files, the CLIs
and the analysis all accept, each defined once here and imported wherever it is needed (schema Literals,
argparse choices, checks, tables).

At the bottom of the import order: imports nothing (nothing of the package, nothing heavy), so any module may
import it.
"""

__all__ = ["SCOPES", "CHECKSUM_MODES", "ENGINES", "ENGINE_CHOICES", "FLOAT_FORMATS", "ELEMENT_TYPES", "WIRE_DTYPES",
           "TORCH_DTYPE_NAMES", "PROTECT_FIELDS", "MODES", "GUARDS", "PERTURBATIONS", "LATENCY_BERS", "DEFAULT_RECIPE",
           "ERROR_MODELS", "DEFAULT_TOLERANCE"]

# What a link's engine corrupts: the TCP payload, the whole frame, or only gloo's tensor bytes (docs/engine.md).
SCOPES = ("payload", "all", "tensor")
# fix: corrupted frames get valid checksums (delivered); keep: they keep the original ones (dropped, resent).
CHECKSUM_MODES = ("fix", "keep")
# Engine kinds: the NFQUEUE process (every scope) and the in-kernel tc program (docs/engine.md, "The bpf engine");
# a topology or a command may also ask for auto (bpf where it loads and the scope allows, else nfqueue).
ENGINES = ("nfqueue", "bpf")
ENGINE_CHOICES = ENGINES + ("auto",)
# How a link's bit errors arrive: independently per bit (bernoulli; counter: the same law drawn as a pure function
# of the stream position), or in bursts (docs/engine.md, "Error models").
ERROR_MODELS = ("bernoulli", "counter", "gilbert_elliott")

# The floating-point types a tensor crosses a link in: type -> (exponent bits, mantissa bits), the sign on top.
FLOAT_FORMATS = {"fp32": (8, 23), "bf16": (8, 7), "fp16": (5, 10)}
ELEMENT_TYPES = tuple(FLOAT_FORMATS)  # a link's element (scope tensor): the type of the values it corrupts
WIRE_DTYPES = ELEMENT_TYPES  # training's wire_dtype: the type DDP's buckets and PP's activations cross the link in
TORCH_DTYPE_NAMES = dict(zip(ELEMENT_TYPES, ("float32", "bfloat16", "float16")))  # torch.<name> of each
PROTECT_FIELDS = ("sign", "exponent", "mantissa")  # the fields protect may name; index = protect's field code

# Training: the parallelism modes, and what a step whose loss or gradient norm is not finite does.
MODES = ("ddp", "pp")
GUARDS = ("skip", "stop", "none", "sanitize")
# Controls at BER 0 (the chaos floor): none, one mantissa-LSB flip at step 1 of a gradient value or of a weight,
# another reduction order (testbed/train/recipe.py).
PERTURBATIONS = ("none", "lsb", "weight-lsb", "order")

# The BERs the latency measurement sweeps by default (testbed bench latency, an experiment file's latency:).
LATENCY_BERS = (0.0, 1e-6, 1e-5)
# The recipe of an experiment grid point that sets none: the file's `train:` as it is.
DEFAULT_RECIPE = "default"
# The paired rule's tolerance on the eval-loss gap, relative to the clean eval loss, when an experiment file sets
# none (`tolerance:`; docs/experiments.md, "The paired rule").
DEFAULT_TOLERANCE = 0.01
