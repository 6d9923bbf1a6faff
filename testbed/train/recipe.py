"""The training recipe both trainers share: optimizer, learning-rate schedule, clipping, the receiver-side
sanitizer, the wire dtype and the count of frozen values. Settings: testbed/train/settings.py.

The default recipe is nanoGPT's: AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only, constant lr,
global-norm clipping to 1.0.
"""

import math

import torch

from testbed.vocab import TORCH_DTYPE_NAMES

WIRE_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in TORCH_DTYPE_NAMES.items()}
MIN_LR_FRACTION = 0.1  # cosine decays to this fraction of --lr at the last step
# Adam: an element whose second moment exceeds this moves less than 1e-3 of lr per step for any gradient element
# of magnitude <= 1 (the update is lr * m / sqrt(v), |m| <= max |g|; clipped and typical gradient elements are
# far below 1), so it is frozen: v decays by beta2 per step, ~270 steps per factor 1e6 at 0.95.
FROZEN_EXP_AVG_SQ = 1e6


def nonfinite(t):
    """Number of NaN/Inf values. A sum is ~100x faster than isfinite() on 124M values and is finite whenever
    all values are (unless finite values overflow it): count exactly only when it is not. The sum is fp32, so
    16-bit values near their maximum do not overflow it."""
    if torch.isfinite(t.sum(dtype=torch.float32)):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def sanitize(t, threshold):
    """(t with every value that is not finite or exceeds +-threshold set to 0, how many were); t itself when
    none is. One min/max pass in the common case (NaN propagates through both and fails the test)."""
    lo, hi = torch.aminmax(t)
    if lo >= -threshold and hi <= threshold:
        return t, 0
    bad = ~(t.abs() <= threshold)  # NaN and Inf included
    return t.masked_fill(bad, 0), int(bad.sum())


PERTURB_LSB_STEP = 1  # --perturb lsb / weight-lsb flip one value at this step (0-based: the second update)


@torch.no_grad()
def perturb_lsb_(params, step, what="gradient"):
    """--perturb lsb (what="gradient", called before the norm and clipping) and weight-lsb (what="weight", called
    after the optimizer step): at PERTURB_LSB_STEP, flip the least significant mantissa bit (bit 0) of one fp32
    value in place: element i of the first parameter with a gradient (wte in GPT-2 and in PP's stage 0), i = the
    largest-magnitude element of that gradient, the lowest flat index on a tie (torch.argmax). Returns i, or None
    at any other step."""
    if step != PERTURB_LSB_STEP:
        return None
    p = next(p for p in params if p.grad is not None)
    i = int(p.grad.view(-1).abs().argmax())
    target = p.grad if what == "gradient" else p
    target.view(-1)[i: i + 1].view(torch.int32).bitwise_xor_(1)
    return i


def perturb_order(x, y, perturb):
    """--perturb order: the batch's sequences in reverse order (the same batch, summed in another order)."""
    return (x.flip(0), y.flip(0)) if perturb == "order" else (x, y)


def make_optimizer(params, a):
    """AdamW or SGD; weight decay on matrices (embeddings, linear weights) only, as nanoGPT does."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if a.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=a.lr, momentum=a.momentum)
    return torch.optim.AdamW(groups, lr=a.lr, betas=tuple(a.betas), eps=a.eps)


def lr_at(step, a):
    """Learning rate of `step`: linear warmup over warmup_steps (lr/K, 2lr/K, ..., lr), then constant, or a
    cosine from lr down to MIN_LR_FRACTION * lr at the last step."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if a.lr_schedule == "constant":
        return a.lr
    progress = min(1.0, (step - a.warmup_steps) / max(1, a.steps - 1 - a.warmup_steps))
    return a.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(opt, lr):
    for group in opt.param_groups:
        group["lr"] = lr


def clip_(params, a, total_norm):
    """Clip the gradients of `params` in place; total_norm: their global L2 norm (a tensor), measured before.
    norm: scale by min(1, grad_clip / norm), as clip_grad_norm_ does (an Inf norm zeroes the finite elements,
    a NaN norm makes every element NaN); value: clamp each element to +-grad_clip (NaN stays NaN)."""
    if a.clip == "none" or a.grad_clip == 0:
        return
    params = [p for p in params if p.grad is not None]
    if a.clip == "value":
        torch.nn.utils.clip_grad_value_(params, a.grad_clip)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, a.grad_clip, total_norm)


@torch.no_grad()
def frozen_values(opt):
    """Parameter elements that can no longer train: the parameter or its optimizer state is not finite, or
    (Adam) its second moment exceeds FROZEN_EXP_AVG_SQ. Fast path per tensor: sums and a max (NaN fails it)."""
    n = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            finite = [p] + [state[k] for k in ("exp_avg", "momentum_buffer") if state.get(k) is not None]
            v = state.get("exp_avg_sq")
            if all(torch.isfinite(t.sum()) for t in finite) and (v is None or v.max() <= FROZEN_EXP_AVG_SQ):
                continue
            ok = torch.isfinite(p)
            for t in finite[1:]:
                ok &= torch.isfinite(t)
            if v is not None:
                ok &= v <= FROZEN_EXP_AVG_SQ  # False for NaN and Inf
            n += int(p.numel() - ok.sum())
    return n
