"""GPT-2 in plain torch, nanoGPT style: the architecture of OpenAI's GPT-2 and of transformers' GPT2LMHeadModel.

Why not transformers' own class: importing it costs about 5 s of CPU per worker (torch alone about 2.5 s), and
every experiment point starts one worker per host, so on a 2-core machine that import set the pace of a sweep.
The model is 80 lines; tests/test_train.py checks that it computes what GPT2LMHeadModel computes with the same
weights (transformers stays a test dependency for that check).

Same as GPT-2: pre-LayerNorm blocks (eps 1e-5), fused qkv projection, tanh-approximated GELU, learned position
embeddings, the head tied to the token embedding, biases everywhere, normal(0, 0.02) initialisation with the
residual projections scaled by 1/sqrt(2 n_layer). No dropout: a run is a deterministic function of (seed, data,
wire). Parameter names follow GPT2LMHeadModel's (transformer.h.0.attn.c_attn.weight, ...), but its Conv1D
weights are stored (in, out) and these nn.Linear weights (out, in): load_gpt2_state_dict transposes them.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

INIT_STD = 0.02  # GPT-2's initializer_range
LN_EPS = 1e-5


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=LN_EPS),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaling of the residual projections by depth
                nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def embed(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.transformer.wte(idx) + self.transformer.wpe(pos)

    def forward(self, idx):
        h = self.embed(idx)
        for block in self.transformer.h:
            h = block(h)
        return self.lm_head(self.transformer.ln_f(h))


def load_gpt2_state_dict(model, state_dict):
    """Load a GPT2LMHeadModel state dict (transformers' layout) into `model`: Conv1D weights are transposed."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    own = model.state_dict()
    sd = {k: (v.t() if k.endswith(conv1d) else v) for k, v in state_dict.items() if k in own}
    missing = sorted(set(own) - set(sd))
    if missing:
        raise ValueError(f"state dict lacks {', '.join(missing)}")
    model.load_state_dict(sd)
