"""GPT-2 presets, and the model built from one (testbed/train/gpt.py, initialised here, never downloaded).

The preset table is the one list of model sizes: the worker, the CLIs, experiment files and the theory
(testbed/analysis/theory.py) read it. Importing this module does not import torch (that takes seconds, and
the theory and validation need only the table); build_model imports it when called.
The pipeline stage split lives in stages.py.
"""

from typing import NamedTuple


class Preset(NamedTuple):
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int  # context length
    vocab_size: int


PRESETS = {  # the size ladder, largest first: 525x from tiny to gpt2-124m (parameters with tied embeddings)
    "gpt2-124m": Preset(12, 12, 768, 1024, 50257),  # GPT-2 small: 124,439,808 parameters
    "mini": Preset(6, 6, 384, 256, 8192),  # 13,891,584 (head size 64, as GPT-2's)
    "small": Preset(4, 4, 128, 128, 2048),  # 1,071,872
    "tiny": Preset(4, 2, 64, 64, 512),  # 236,928; 4 layers: one block per stage on a 4-host chain
}
GPT2_124M_PARAMS = 124_439_808  # a test checks that build_model("gpt2-124m") has exactly this many
# Parameters of every preset (tied embeddings); a test checks each against build_model and the theory's formula
PRESET_PARAMS = {"gpt2-124m": GPT2_124M_PARAMS, "mini": 13_891_584, "small": 1_071_872, "tiny": 236_928}


def preset(name):
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def seq_len_of(model, seq_len=None):
    """Tokens per sequence: seq_len, or the model's context when it is None (the seq_len setting's default)."""
    return seq_len or PRESETS[model].n_positions


def build_model(name, seed):
    """The whole GPT-2 (testbed/train/gpt.py), initialised from torch's RNG seeded with `seed` (same seed -> same
    bits)."""
    import torch

    from testbed.train.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(preset(name))
    model.train()
    return model


def count_params(module):
    # parameters() yields a tied weight once, so wte/lm_head count once (GPT-2's 124,439,808)
    return sum(p.numel() for p in module.parameters())


def logits_of(model, idx):
    """Logits (B, T, vocab) of a GPT (or a DDP wrapping one) for token ids idx (B, T)."""
    return model(idx)
