"""GPT-2 split into pipeline stages: contiguous slices of testbed/train/gpt.py's GPT."""

import torch
from torch import nn


class Stage(nn.Module):
    """A contiguous slice of GPT-2: [embeddings] + blocks + [ln_f + lm_head].

    Stage 0 takes token ids (B, T) and has the embeddings; the last stage returns logits (B, T, vocab);
    the others map hidden states (B, T, C) to hidden states. The blocks are the model's own Block modules,
    called as GPT.forward calls them.
    """

    def __init__(self, config, blocks, embeddings=None, head=None):
        super().__init__()
        self.config = config
        self.wte, self.wpe = embeddings if embeddings is not None else (None, None)
        self.h = nn.ModuleList(blocks)
        self.ln_f, self.lm_head = head if head is not None else (None, None)

    def forward(self, x):
        if self.wte is not None:
            h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        for block in self.h:
            h = block(h)
        if self.lm_head is not None:
            h = self.lm_head(self.ln_f(h))
        return h


def layer_split(n_layer, n_stages):
    """Block index ranges per stage, as even as possible (earlier stages get the extra block)."""
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_stages} stages")
    base, extra = divmod(n_layer, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def split_stages(model, n_stages):
    """Split a GPT into n_stages Stage modules (sharing its parameter tensors).

    Tied embeddings across stages: in PP the first and last stage live on different hosts, so they cannot
    share one tensor. The last stage gets its own lm_head (bias-free Linear) initialised as a copy of wte.
    The two copies start equal and are then trained independently (their gradients are not summed over
    the wire as Megatron does); this keeps the data link's traffic to activations and their gradients.
    With a single stage the head stays tied, as in GPT-2.
    """
    tr = model.transformer
    bounds = layer_split(len(tr.h), n_stages)
    stages = []
    for s, (lo, hi) in enumerate(bounds):
        first, last = s == 0, s == n_stages - 1
        head = None
        if last:
            if first:
                lm_head = model.lm_head  # tied, as in the unsplit model
            else:
                lm_head = nn.Linear(tr.wte.weight.shape[1], tr.wte.weight.shape[0], bias=False)
                with torch.no_grad():
                    lm_head.weight.copy_(tr.wte.weight)
            head = (tr.ln_f, lm_head)
        stages.append(Stage(model.config, list(tr.h[lo:hi]), (tr.wte, tr.wpe) if first else None, head))
    return stages


class WireCast(nn.Module):
    """A stage as the data link sees it: hidden states arrive and leave in the wire dtype, the stage computes
    in fp32. Gradients flow back through the casts, so they cross the link in the wire dtype too. Token ids
    (stage 0's input) and logits (the last stage's output) never cross it. For fp32 both casts are no-ops."""

    def __init__(self, stage, dtype):
        super().__init__()
        self.stage, self.dtype = stage, dtype

    def forward(self, x):
        h = self.stage(x if self.stage.wte is not None else x.float())
        return h if self.stage.lm_head is not None else h.to(self.dtype)
