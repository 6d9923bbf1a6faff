"""GPT-2 presets, and the model built from one (transformers, from a config, never downloaded).

The preset table is the one list of model sizes: the worker, the CLIs, experiment files and the theory
(testbed/experiments/theory.py) read it. Importing this module does not import torch or transformers (that
takes seconds, and the theory and validation need only the table); build_model imports them when called.
The pipeline stage split lives in stages.py.
"""

from typing import NamedTuple


class Preset(NamedTuple):
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int  # context length
    vocab_size: int


PRESETS = {
    "gpt2-124m": Preset(12, 12, 768, 1024, 50257),  # GPT-2 small: 124,439,808 parameters (tied embeddings)
    "small": Preset(4, 4, 128, 128, 2048),
    "tiny": Preset(4, 2, 64, 64, 512),  # 4 layers: one block per stage on a 4-host chain
}
GPT2_124M_PARAMS = 124_439_808  # a test checks that build_model("gpt2-124m") has exactly this many


def preset(name):
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def make_config(name):
    from transformers import GPT2Config

    p = preset(name)
    return GPT2Config(
        n_layer=p.n_layer,
        n_head=p.n_head,
        n_embd=p.n_embd,
        n_positions=p.n_positions,
        vocab_size=p.vocab_size,
        # no dropout: a run is a deterministic function of (seed, data, wire); any difference is the wire's
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def build_model(name, seed):
    """The whole GPT2LMHeadModel, initialised from torch's RNG seeded with `seed` (same seed -> same bits)."""
    import torch
    from transformers import GPT2LMHeadModel

    config = make_config(name)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def count_params(module):
    # parameters() yields a tied weight once, so wte/lm_head count once (GPT-2's 124,439,808)
    return sum(p.numel() for p in module.parameters())


def logits_of(model, idx):
    """Logits (B, T, vocab) of a GPT2LMHeadModel (or a DDP wrapping one) for token ids idx (B, T)."""
    return model(input_ids=idx).logits
