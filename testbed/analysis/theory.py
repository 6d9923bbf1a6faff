"""Analytical models that the experiment report overlays on measurements.

Six parts, all pure functions (numpy/scipy only, no torch):

1. flip counts: expected bit flips per training step for DDP (gloo ring allreduce) and pipeline parallelism,
   error-free probabilities, corrupted fp32 elements, TCP-checksum drops and retransmissions;
2. fp32 bit-flip statistics: the value after a flip, |delta| per bit position, the chance a flip is catastrophic;
3. weight noise: a first-order estimate of how far corrupted gradients push the weights away from a clean run
   (SGD and AdamW, with or without global-norm clipping) and the BER at which catastrophic hits become routine;
4. recipes: per wire dtype (fp32, bf16, fp16), protected bits and guard (skip, stop, none, sanitize), the
   expected lost-step fraction 1 - exp(-lambda) (lambda summed over every rank and hop), sanitized values,
   frozen elements and the bounded noise of mantissa-only errors (`predict_recipe`);
5. link latency: serialization + propagation + KP4 RS(544,514) FEC, versus a relaxed link that delivers errored
   frames, versus retransmission (link-level or TCP), and KP4's post-FEC BER under independent bit errors;
6. `markdown_tables()`: the numbers of docs/theory.md (`python -m testbed.analysis.theory`).

Units: BER is a probability per bit; sizes are bits or bytes as the names say; times are seconds; lengths meters;
rates bits per second. Derivations and assumptions: docs/theory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
from scipy.optimize import brentq
from scipy.special import bdtrc, ndtri

from testbed.train.model import GPT2_124M_PARAMS, PRESETS
from testbed.train.settings import default_of
from testbed.vocab import FLOAT_FORMATS, GUARDS

# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------

def gpt2_param_count(n_layer: int, n_embd: int, n_positions: int, vocab_size: int) -> int:
    """Parameters of a GPT-2 with tied embeddings: token + position embeddings, n_layer blocks, final LayerNorm.

    A block has 12 d^2 + 13 d: attention qkv (3d^2 + 3d) and projection (d^2 + d), MLP (4d^2 + 4d, 4d^2 + d),
    two LayerNorms (2 x 2d).
    """
    d = n_embd
    return vocab_size * d + n_positions * d + n_layer * (12 * d * d + 13 * d) + 2 * d


def param_count(model: str | int) -> int:
    """A preset name ("gpt2-124m", "mini", "small", "tiny") or a parameter count -> parameter count."""
    if isinstance(model, str):
        if model not in PRESETS:  # model.py's table: it does not import torch
            raise ValueError(f"unknown model {model!r}: use one of {sorted(PRESETS)} or a parameter count")
        p = PRESETS[model]
        return gpt2_param_count(p.n_layer, p.n_embd, p.n_positions, p.vocab_size)
    if int(model) <= 0:
        raise ValueError(f"parameter count must be positive, got {model!r}")
    return int(model)


# ---------------------------------------------------------------------------------------------------------------
# 1. Flip counts
# ---------------------------------------------------------------------------------------------------------------

def expected_flips(ber, bits):
    """Expected bit flips in `bits` bits at bit error rate `ber` (independent errors)."""
    return np.asarray(ber, dtype=float) * bits


def p_error_free(ber, bits):
    """Probability that none of `bits` bits is flipped: (1 - ber)^bits, computed without underflow trouble."""
    return np.exp(bits * np.log1p(-np.asarray(ber, dtype=float)))


def p_element_corrupted(ber, dtype_bits: int = 32):
    """Probability that a transmitted element of `dtype_bits` bits has at least one flipped bit."""
    return -np.expm1(dtype_bits * np.log1p(-np.asarray(ber, dtype=float)))


MIB = 1024 * 1024
GLOO_MAX_SEGMENT_BYTES = MIB  # gloo AllreduceOptions::kMaxSegmentSize
GLOO_HEADER_BYTES = 48  # six uint64 per frame
# Per data segment a rank receives: the data frame's header, the sender's NOTIFY_SEND_READY, and the
# NOTIFY_RECV_READY of the rank it sends to (gloo/transport/tcp/pair.cc: send() and recv() each notify).
GLOO_HEADER_BYTES_PER_SEGMENT = 3 * GLOO_HEADER_BYTES


def gloo_ring_segments_per_rank(total_bytes: int, n_ranks: int, bucket_bytes: int = 25 * MIB,
                                first_bucket_bytes: int = MIB, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> int:
    """Data frames one rank sends (= receives) per DDP step: gloo's ring, one allreduce per DDP bucket.

    gloo splits a buffer into numSegments = roundUp(max(ceil(bytes / 1 MiB), 2N), N) segments and each rank sends
    numSegments - numSegments / N of them in each of the two phases (gloo/allreduce.cc, ring()). Bucket sizes
    are approximated as 1 MiB first, then 25 MiB (DDP cuts at parameter boundaries).
    """
    sizes = [min(first_bucket_bytes, total_bytes)]
    while sum(sizes) < total_bytes:
        sizes.append(min(bucket_bytes, total_bytes - sum(sizes)))
    segments = 0
    for size in sizes:
        per_bucket = max(-(-size // max_segment_bytes), 2 * n_ranks)
        per_bucket = -(-per_bucket // n_ranks) * n_ranks
        segments += 2 * (per_bucket - per_bucket // n_ranks)
    return segments


@dataclass(frozen=True)
class DDPFlips:
    """Expected bit errors of one DDP step (one gradient ring allreduce over N ranks), per rank unless noted.

    Ring allreduce (gloo/allreduce.cc): reduce-scatter then allgather, rank r sends to r-1. Each phase moves
    (N-1)/N of the gradient through every rank. A flip in the reduce-scatter phase corrupts a partial sum that is
    reduced further and then allgathered: it reaches every rank. A flip in the allgather phase lands in the
    receiver's output buffer, which gloo forwards from that same buffer: a flip on the h-th hop of a chunk
    (h = 1..N-1 from its owner) reaches the N-h ranks downstream, on average N/2 ranks (one rank when N = 2);
    the chunk's owner never sees it, so replicas diverge.
    """
    ber: float
    n_ranks: int
    gradient_bits: int                  # all gradient elements x dtype bits
    bits_received_per_rank: float       # = bits sent per rank = 2 (N-1)/N x gradient_bits
    flips_received_per_rank: float      # flips arriving on this rank's incoming link
    flips_received_reduce_scatter: float
    flips_received_allgather: float
    errors_shared_by_all_ranks: float   # every reduce-scatter flip of every link: BER (N-1) gradient_bits
    errors_allgather_in_rank: float     # allgather flips that reach this rank: BER (N-1)/2 gradient_bits
    errors_in_rank_gradient: float      # the sum: wire errors in this rank's final (averaged) gradient
    error_bits_in_rank_gradient: float  # bits whose flips end up in this rank's gradient: 1.5 (N-1) gradient_bits
    corrupted_elements_received: float  # received elements with >= 1 flip
    p_error_free_rank: float            # no flip arrives at this rank in this step
    p_error_free_step: float            # no flip anywhere in the allreduce (all N links)
    header_flips_per_rank: float        # flips in gloo frame headers/notifications received (crash or hang)
    broadcast_flips_per_rank: float     # DDP's setup parameter broadcast, once, at a non-root rank (0 if skipped)


def ddp_ring_flips(ber: float, model: str | int = "gpt2-124m", n_ranks: int = 4, dtype_bits: int = 32) -> DDPFlips:
    """Expected flips per training step for DDP with a gloo ring allreduce of all gradients over `n_ranks`
    (scalar BER; one allreduce of every gradient element per step, no gradient accumulation)."""
    if n_ranks < 2:
        raise ValueError("a ring allreduce needs at least 2 ranks")
    n = param_count(model)
    g_bits = n * dtype_bits
    share = (n_ranks - 1) / n_ranks
    received = 2 * share * g_bits
    ber_f = float(ber)
    shared = ber_f * (n_ranks - 1) * g_bits
    allgather_in_rank = ber_f * (n_ranks - 1) / 2 * g_bits
    segments = gloo_ring_segments_per_rank(n * dtype_bits // 8, n_ranks)
    return DDPFlips(
        ber=ber_f, n_ranks=n_ranks, gradient_bits=g_bits,
        bits_received_per_rank=received,
        flips_received_per_rank=ber_f * received,
        flips_received_reduce_scatter=ber_f * received / 2,
        flips_received_allgather=ber_f * received / 2,
        errors_shared_by_all_ranks=shared,
        errors_allgather_in_rank=allgather_in_rank,
        errors_in_rank_gradient=shared + allgather_in_rank,
        error_bits_in_rank_gradient=1.5 * (n_ranks - 1) * g_bits,
        corrupted_elements_received=float(2 * share * n * p_element_corrupted(ber_f, dtype_bits)),
        p_error_free_rank=float(p_error_free(ber_f, received)),
        p_error_free_step=float(p_error_free(ber_f, n_ranks * received)),
        header_flips_per_rank=ber_f * segments * GLOO_HEADER_BYTES_PER_SEGMENT * 8,
        broadcast_flips_per_rank=ber_f * g_bits,
    )


@dataclass(frozen=True)
class PPFlips:
    """Expected bit errors of one pipeline-parallel step: S stages, S-1 boundaries, each crossed by the
    activations (B, T, d) forward and their gradients backward; micro-batching splits but does not change them.
    Stage 0 takes token ids and the last stage the targets locally, so only hidden states cross the links."""
    ber: float
    n_stages: int
    microbatches: int
    bits_per_boundary_each_way: float   # B T d dtype_bits
    bits_per_microbatch_each_way: float
    flips_forward_per_boundary: float
    flips_backward_per_boundary: float
    flips_per_step: float               # all boundaries, both directions
    bits_per_step: float
    corrupted_elements_per_step: float
    p_error_free_boundary: float        # one boundary, both directions
    p_error_free_step: float


def pp_flips(ber: float, n_stages: int, batch_size: int, seq_len: int, width: int, microbatches: int | None = None,
             dtype_bits: int = 32) -> PPFlips:
    """Expected flips per training step for pipeline parallelism (width = hidden size d, 768 for GPT-2 124M)."""
    if n_stages < 2:
        raise ValueError("a pipeline needs at least 2 stages")
    m = microbatches or n_stages
    if batch_size % m:
        raise ValueError(f"batch size {batch_size} is not a multiple of {m} micro-batches")
    elements = batch_size * seq_len * width
    each_way = elements * dtype_bits
    total = 2 * (n_stages - 1) * each_way
    ber_f = float(ber)
    return PPFlips(
        ber=ber_f, n_stages=n_stages, microbatches=m,
        bits_per_boundary_each_way=each_way,
        bits_per_microbatch_each_way=each_way / m,
        flips_forward_per_boundary=ber_f * each_way,
        flips_backward_per_boundary=ber_f * each_way,
        flips_per_step=ber_f * total,
        bits_per_step=total,
        corrupted_elements_per_step=float(2 * (n_stages - 1) * elements * p_element_corrupted(ber_f, dtype_bits)),
        p_error_free_boundary=float(p_error_free(ber_f, 2 * each_way)),
        p_error_free_step=float(p_error_free(ber_f, total)),
    )


def packet_drop_probability(ber, payload_bytes: int, header_bytes: int = 0):
    """Probability that a packet fails its checksum (checksum "keep": the receiver drops it): any flip among
    8 (payload + header) bits. header_bytes = 0 when the engine corrupts payloads only (scope "payload");
    the 16-bit checksum's rare misses (two cancelling flips) are ignored."""
    return -np.expm1(8 * (payload_bytes + header_bytes) * np.log1p(-np.asarray(ber, dtype=float)))


def expected_retransmissions(ber, payload_bytes: int, header_bytes: int = 0):
    """Expected retransmissions per delivered packet: geometric number of failures, p / (1 - p)."""
    p = packet_drop_probability(ber, payload_bytes, header_bytes)
    with np.errstate(divide="ignore"):
        return np.where(p < 1, p / np.maximum(1 - p, 1e-300), np.inf)


def retransmissions_per_step(ber, bytes_per_step: float, mss: int = 1448, header_bytes: int = 0):
    """Expected TCP retransmissions per step for `bytes_per_step` sent in full-MSS segments."""
    return math.ceil(bytes_per_step / mss) * expected_retransmissions(ber, mss, header_bytes)


# ---------------------------------------------------------------------------------------------------------------
# 2. fp32 bit flips
# ---------------------------------------------------------------------------------------------------------------

FP32_MAX = float(np.finfo(np.float32).max)  # 3.4e38


def flip_bit(x, k):
    """x (float32, any shape) with bit k (0 = mantissa LSB, 23..30 exponent, 31 sign) flipped; broadcasts."""
    k = np.asarray(k)
    if np.any((k < 0) | (k > 31)):
        raise ValueError("bit position must be in 0..31")
    words = np.asarray(x, dtype=np.float32).view(np.uint32)
    return np.bitwise_xor(words, np.left_shift(np.uint32(1), k.astype(np.uint32))).view(np.float32)


def flip_all_bits(x):
    """Shape (..., 32): x with each bit 0..31 flipped in turn."""
    return flip_bit(np.asarray(x, dtype=np.float32)[..., None], np.arange(32))


def flip_deltas(x):
    """Shape (..., 32): |x' - x| for a flip at each bit position, in float64 (inf where x' is Inf/NaN).

    Mantissa bit k changes x by exactly 2^(k-23) 2^E (E = unbiased exponent), a relative error <= 2^(k-23);
    the sign bit by 2|x|; exponent bit 23+j multiplies x by 2^(+-2^j): 2^128 for the MSB when |x| < 2."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # flips make signalling NaNs
        flipped = flip_all_bits(x).astype(np.float64)
        delta = np.abs(flipped - x.astype(np.float64)[..., None])
    return np.where(np.isfinite(flipped), delta, np.inf)


def mantissa_relative_error_bound(k):
    """Upper bound of |delta| / |x| for a flip of mantissa bit k (0..22): 2^(k-23) (equality when x = +-2^E)."""
    return np.exp2(np.asarray(k, dtype=float) - 23)


def _flip_table(values):
    """(x, x') in float64: x shape (n, 1), x' shape (n, 32) = x with bit k flipped."""
    x = np.asarray(values, dtype=np.float32).ravel()
    with np.errstate(invalid="ignore"):  # flips make signalling NaNs; casting them is fine
        flipped = flip_all_bits(x).astype(np.float64)
    return x.astype(np.float64)[:, None], flipped


@dataclass(frozen=True)
class FlipStatistics:
    """Outcome of one flip at a uniformly random bit of a value drawn from a distribution (probabilities per flip).
    For any value 0 < |x| < 2 only the exponent MSB (bit 30) multiplies it by 2^128; other exponent flips scale it
    by 2^(+-2^j), j < 7; mantissa flips change it by at most 2^(k-23) |x|; the sign flip by 2|x|."""
    p_nonfinite: float          # Inf or NaN: bit 30 of |x| in [1, 2)
    p_huge: float               # finite and |x'| > huge: bit 30 of huge/2^128 < |x| < 1
    p_catastrophic: float       # p_nonfinite + p_huge
    p_grows: float              # not catastrophic, but |delta| > |x| (sign, exponent bits that scale x up)
    mean_rel_sq_mantissa: float  # E[(delta/x)^2] over mantissa flips: ~ (1/23)(1/3) E[1/(1+f)^2] ~ 0.008


def flip_statistics(values, huge: float = 1e30) -> FlipStatistics:
    """Per-flip outcome probabilities averaged over `values` (a sample of the transmitted values) and the 32 bit
    positions (uniform: independent bit errors hit every position of a word equally often)."""
    x, flipped = _flip_table(values)
    finite = np.isfinite(flipped)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.where(finite, np.abs(flipped - x), np.inf)
        huge_mask = finite & (np.abs(flipped) > huge)
        nonzero = x != 0
        rel = np.where(nonzero, delta / np.where(nonzero, np.abs(x), 1.0), 0.0)
    catastrophic = ~finite | huge_mask
    return FlipStatistics(
        p_nonfinite=float(np.mean(~finite)),
        p_huge=float(np.mean(huge_mask)),
        p_catastrophic=float(np.mean(catastrophic)),
        p_grows=float(np.mean(~catastrophic & (rel > 1))),
        mean_rel_sq_mantissa=float(np.mean(rel[:, :23] ** 2)),
    )


def typical_gradient_values(n: int = 4096, median_abs: float = 1e-5, decades: float = 1.0):
    """A deterministic stand-in for transmitted gradient values: log-normal magnitudes (median `median_abs`,
    one standard deviation = `decades` decades), alternating signs, float32. Replace by measured samples."""
    z = ndtri((np.arange(n) + 0.5) / n)
    signs = np.where(np.arange(n) % 2, -1.0, 1.0)
    return (signs * median_abs * 10.0 ** (decades * z)).astype(np.float32)


def typical_activation_values(n: int = 4096, std: float = 1.0):
    """A deterministic stand-in for hidden states crossing a pipeline boundary: normal(0, std) quantiles."""
    return (std * ndtri((np.arange(n) + 0.5) / n)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# 3. Weight noise
# ---------------------------------------------------------------------------------------------------------------

def adam_step_cap(lr: float, betas=default_of("betas")) -> float:
    """Largest single Adam step of an element whose gradient suddenly dominates: lr (1-b1) / sqrt(1-b2)
    (bias correction ignored: late in training)."""
    b1, b2 = betas
    return lr * (1 - b1) / math.sqrt(1 - b2)


def adam_hit_displacement(lr: float, betas=default_of("betas")) -> float:
    """Total displacement of that element over the following steps: the capped step decays as (b1/sqrt(b2))^t
    (m decays by b1, sqrt(v) by sqrt(b2)), so the sum is cap / (1 - b1/sqrt(b2)). 5.8 lr for (0.9, 0.95)."""
    b1, b2 = betas
    if b1 >= math.sqrt(b2):
        raise ValueError("needs b1 < sqrt(b2)")
    return adam_step_cap(lr, betas) / (1 - b1 / math.sqrt(b2))


@dataclass(frozen=True)
class WeightNoise:
    """Per-step sources of deviation from a clean run, for one rank. Counts are expected values per step."""
    flips: float          # wire errors reaching this rank's gradient
    catastrophic: float   # of which Inf/NaN or |x'| > huge
    nonfinite: float      # of which Inf/NaN
    destructive: float    # events that end the run: Inf/NaN reaching the weights (clipping makes Inf x 0 = NaN);
                          # SGD without clipping also a weight jump lr |delta| > max_weight_jump
    p_step_lost: float    # clipping: probability that a dominating error scales the step's gradient to ~0
    frozen: float         # AdamW without clipping: elements whose (1-b2) x'^2 overflows v to Inf (frozen for good)
    noise_sq: float       # E||delta_w||^2 added per step (weights units^2): noise_sq_small + noise_sq_lost
    noise_sq_small: float  # from errors that neither end the run, lose the step nor freeze an element
    noise_sq_lost: float  # from lost steps
    frozen_sq: float      # a frozen element adds this much E||delta_w||^2 per later step (summed over elements)


def weight_noise_per_step(ber, n_params: str | int, lr: float, optimizer: str = default_of("optimizer"), *,
                          grad_clip: float = default_of("grad_clip"), n_ranks: int = 4,
                          error_bits_per_step: float | None = None, values=None, grad_norm: float = 1.0,
                          betas=default_of("betas"), adam_update_rms: float = 0.5,
                          horizon_steps: int | None = None, max_weight_jump: float = 1.0, huge: float = 1e30,
                          dtype_bits: int = 32) -> WeightNoise:
    """First-order estimate of the weight noise that wire errors in the gradient add per step (one rank).

    Errors: error_bits_per_step (default: the DDP ring's 1.5 (N-1) x gradient bits, DDPFlips.error_bits_in_rank_
    gradient) x BER flips per step, each at a uniform bit of a value drawn from `values` (default
    typical_gradient_values()). Each (value, bit) outcome is classified:
    - ends the run: x' Inf/NaN; for SGD without clipping also a weight jump lr |delta| > max_weight_jump;
    - loses the step (grad_clip > 0 and |delta| > grad_norm, the clean global gradient norm): the fp32 norm
      overflows or is dominated, every other element is scaled to ~0 (measured with torch 2.13: an overflowing
      norm gives an all-zero gradient). Cost: the clean update, lr^2 (min(grad_norm, clip)^2 + clip^2) for SGD,
      lr^2 n_params for AdamW (every element misses g/sqrt(v), with E[g^2/v] ~ 1);
    - freezes an element (AdamW, no clipping, (1-b2) x'^2 > fp32 max): v = Inf, its step is 0 from then on
      (measured with torch 2.13); it then misses updates of RMS adam_update_rms x lr per step;
    - noise: SGD lr^2 delta^2; AdamW lr^2 (min(|delta|/sigma, D)^2 + u^2 T): the momentum-integrated step,
      capped at D = adam_hit_displacement / lr, plus T steps of missed updates (RMS u = adam_update_rms) while
      the polluted v = (1-b2) x'^2 decays back to sigma^2, T = ln((1-b2) x'^2/sigma^2)/ln(1/b2) (capped at
      horizon_steps). sigma, the element's sqrt(v), is taken as |x|.
    Assumptions: independent bit errors and steps; no feedback of the deviation through the training dynamics
    (which can amplify it); weight decay and bias correction ignored. An estimate, not a bound.
    """
    if optimizer not in ("sgd", "adamw"):
        raise ValueError("optimizer must be 'sgd' or 'adamw'")
    n = param_count(n_params)
    bits = error_bits_per_step if error_bits_per_step is not None else 1.5 * (n_ranks - 1) * n * dtype_bits
    flips = np.asarray(ber, dtype=float) * bits
    x, x_new = _flip_table(typical_gradient_values() if values is None else values)
    finite = np.isfinite(x_new)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.where(finite, np.abs(x_new - x), np.inf)
    clip = grad_clip > 0
    lost = finite & (delta > grad_norm) & clip

    if optimizer == "sgd":
        destroys = ~finite | ((not clip) & (lr * delta > max_weight_jump))
        freezes = np.zeros_like(finite)
        with np.errstate(over="ignore"):
            noise = lr**2 * np.where(finite, delta, 0.0) ** 2
        lost_sq = lr**2 * (min(grad_norm, grad_clip) ** 2 + grad_clip**2)
    else:
        b2 = betas[1]
        destroys = ~finite
        # |x| stands for sqrt(v) of the hit element; floored so that exact zeros do not divide by 0
        sigma = np.maximum(np.abs(x), 1e-3 * float(np.sqrt(np.mean(x**2))) + 1e-45)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            v_hit = np.where(finite, (1 - b2) * x_new**2, np.inf)
            stall = np.maximum(0.0, np.log(v_hit / sigma**2) / math.log(1 / b2))
            noise = lr**2 * (np.minimum(delta / sigma, adam_hit_displacement(1.0, betas)) ** 2
                             + adam_update_rms**2 * np.minimum(stall, horizon_steps or np.inf))
        freezes = finite & (not clip) & (v_hit > FP32_MAX)
        lost_sq = lr**2 * n

    is_noise = ~(destroys | lost | freezes)
    p_lost = -np.expm1(-flips * float(np.mean(lost)))
    small = flips * float(np.mean(np.where(is_noise, noise, 0.0)))
    frozen = flips * float(np.mean(freezes))
    return WeightNoise(
        flips=flips,
        catastrophic=flips * float(np.mean(~finite | (np.abs(np.where(finite, x_new, 0.0)) > huge))),
        nonfinite=flips * float(np.mean(~finite)),
        destructive=flips * float(np.mean(destroys)),
        p_step_lost=p_lost, frozen=frozen,
        noise_sq=small + p_lost * lost_sq, noise_sq_small=small, noise_sq_lost=p_lost * lost_sq,
        frozen_sq=frozen * lr**2 * adam_update_rms**2,
    )


def weight_deviation_estimate(ber, n_params: str | int, steps: int, lr: float, optimizer: str = default_of("optimizer"),
                              **kwargs) -> float:
    """Expected L2 distance ||w_K - w_K(clean)|| after K = `steps` steps (one rank, weights units).

    Random walk of independent per-step noise: E||dev||^2 = K noise_sq + frozen_sq K (K+1)/2 (an element frozen at
    step t misses K-t updates). Hence deviation ~ sqrt(BER) while the per-step event probabilities are << 1
    (slope 1/2 on log-log axes), and ~ sqrt(K) without freezing. Returns inf when a run-ending event is expected
    at least once within `steps`; below that, the value describes the runs without one (a fraction
    exp(-expected count) of runs). kwargs: see weight_noise_per_step. An estimate, not a bound.
    """
    kwargs.setdefault("horizon_steps", steps)
    w = weight_noise_per_step(ber, n_params, lr, optimizer, **kwargs)
    var = steps * w.noise_sq + w.frozen_sq * steps * (steps + 1) / 2
    return np.where(w.destructive * steps >= 1, np.inf, np.sqrt(var))[()]


def catastrophic_threshold_ber(error_bits_per_step: float, p_catastrophic_per_flip: float = 1 / 32) -> float:
    """BER at which the expected number of catastrophic values per step reaches 1: 1 / (bits x p).

    p = 1/32 when every transmitted value has huge/2^128 < |x| < 2 (only the exponent MSB is catastrophic);
    use flip_statistics(values).p_catastrophic for a measured value sample."""
    return 1.0 / (error_bits_per_step * p_catastrophic_per_flip)


# ---------------------------------------------------------------------------------------------------------------
# 4. Recipes: lost steps, sanitized and frozen values, bounded noise (per wire dtype, protection and guard)
# ---------------------------------------------------------------------------------------------------------------

WIRE_FORMATS = FLOAT_FORMATS  # exponent bits, mantissa bits; sign on top
NORM_OVERFLOW = math.sqrt(FP32_MAX)  # 1.8e19: one value above it makes the fp32 sum of squares (the norm) Inf
FROZEN_EXP_AVG_SQ = 1e6  # testbed/train/recipe.py: an Adam element whose second moment exceeds this is frozen


def wire_bits(dtype: str) -> int:
    """Bits per value on the wire: 32 for fp32, 16 for bf16 and fp16."""
    if dtype not in WIRE_FORMATS:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_FORMATS)}, got {dtype!r}")
    e, m = WIRE_FORMATS[dtype]
    return 1 + e + m


def field_positions(dtype: str) -> dict[str, range]:
    """Bit positions (0 = LSB) of each field: fp32 mantissa 0-22, exponent 23-30, sign 31; bf16 7/8/1; fp16 10/5/1."""
    bits = wire_bits(dtype)
    e, m = WIRE_FORMATS[dtype]
    return {"mantissa": range(0, m), "exponent": range(m, m + e), "sign": range(bits - 1, bits)}


def protected_positions(dtype: str, protect) -> frozenset[int]:
    """The positions `protect` covers: field names (sign, exponent, mantissa) and/or bit positions."""
    fields, out = field_positions(dtype), set()
    for item in protect or ():
        if isinstance(item, str):
            if item not in fields:
                raise ValueError(f"protect: unknown field {item!r} (sign, exponent, mantissa)")
            out.update(fields[item])
        elif 0 <= int(item) < wire_bits(dtype):
            out.add(int(item))
        else:
            raise ValueError(f"protect: bit {item} is not a bit of a {dtype} value (0-{wire_bits(dtype) - 1})")
    return frozenset(out)


def bit_error_rates(ber, dtype: str = "fp32", protect=None, protected_ber: float = 0.0) -> np.ndarray:
    """Per bit position, the probability that a transmitted value has that bit flipped: `ber` on exposed bits,
    `protected_ber` on protected ones (the link protects them, e.g. with FEC, down to that residual rate)."""
    rates = np.full(wire_bits(dtype), float(ber))
    rates[sorted(protected_positions(dtype, protect))] = float(protected_ber)
    return rates


def _bf16_words(x) -> np.ndarray:
    """float32 words of x rounded to bfloat16 (round to nearest even, as torch converts), low 16 bits zero."""
    w = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    w = (w + 0x7FFF + ((w >> 16) & 1)) & 0xFFFF0000
    return w.astype(np.uint32)


def to_wire(values, dtype: str = "fp32") -> np.ndarray:
    """The values as the wire carries them (rounded to `dtype`), as float64."""
    x = np.asarray(values, dtype=np.float32)
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        return _bf16_words(x).view(np.float32).astype(np.float64)
    wire_bits(dtype)
    return x.astype(np.float64)


def flip_wire(values, k: int, dtype: str = "fp32") -> np.ndarray:
    """float64 values after bit k (0 = LSB) of their `dtype` encoding is flipped (values rounded to dtype first)."""
    if not 0 <= k < wire_bits(dtype):
        raise ValueError(f"bit {k} is not a bit of a {dtype} value")
    x = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "fp32":
            return flip_bit(x, k).astype(np.float64)
        if dtype == "fp16":
            w = x.astype(np.float16).view(np.uint16) ^ np.uint16(1 << k)
            return w.view(np.float16).astype(np.float64)
        return (_bf16_words(x) ^ np.uint32(1 << (k + 16))).view(np.float32).astype(np.float64)


@dataclass(frozen=True)
class BitOutcomes:
    """What one flip of each bit position does to a sample of values (arrays indexed by position, 0 = LSB).
    `bad`: the flipped value is not finite or exceeds `threshold` in magnitude (the norm overflows, or the
    sanitizer zeroes it); `nonfinite`: Inf/NaN; `frozen_weight`: Adam, no clipping: the flipped value pushes the
    element's second moment above FROZEN_EXP_AVG_SQ, weighted by the chance min(1, T/steps) that it is still
    there at the end of a run of `steps` steps when hit at a uniform step (T: steps for v to decay below it);
    `rel_sq`: E[min((x' - x)/x, cap)^2] over the values whose flip is not bad (0 for the bad ones)."""
    dtype: str
    threshold: float
    bad: np.ndarray
    nonfinite: np.ndarray
    frozen_weight: np.ndarray
    rel_sq: np.ndarray


def bit_outcomes(values, dtype: str = "fp32", threshold: float = NORM_OVERFLOW, *, cap: float = math.inf,
                 steps: int = 1, beta2: float = 0.95) -> BitOutcomes:
    """BitOutcomes of a value sample (the values are first rounded to the wire dtype; zeros are left out of the
    relative error)."""
    x = to_wire(values, dtype)
    cols = {"bad": [], "nonfinite": [], "frozen_weight": [], "rel_sq": []}
    for k in range(wire_bits(dtype)):
        y = flip_wire(values, k, dtype)
        finite = np.isfinite(y)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            bad = ~finite | (np.abs(y) > threshold)
            rel = np.where(x != 0, np.abs(y - x) / np.where(x != 0, np.abs(x), 1.0), 0.0)
            v = (1 - beta2) * np.where(finite, y, 0.0) ** 2
            stay = np.log(np.maximum(v, FROZEN_EXP_AVG_SQ) / FROZEN_EXP_AVG_SQ) / math.log(1 / beta2)
        cols["bad"].append(bad.mean())
        cols["nonfinite"].append((~finite).mean())
        cols["frozen_weight"].append(np.where(finite, np.minimum(1.0, stay / steps), 0.0).mean())
        cols["rel_sq"].append(np.where(bad, 0.0, np.minimum(rel, cap) ** 2).mean())
    return BitOutcomes(dtype, threshold, **{k: np.array(v) for k, v in cols.items()})


def wire_values_per_step(mode: str, n_ranks: int, n_params: int | None = None, batch_size: int | None = None,
                         seq_len: int | None = None, width: int | None = None) -> dict[str, float]:
    """Values crossing the data links per optimizer step, all links together, by kind.

    DDP (gloo ring allreduce): each of the N ranks sends 2(N-1)/N of the n gradient values (reduce-scatter and
    allgather), so 2(N-1) n gradient values cross. PP: each of the S-1 stage boundaries carries the B T d
    activations forward and as many activation gradients backward (B the global batch)."""
    if n_ranks < 2:
        raise ValueError("a ring or a pipeline needs at least 2 ranks")
    if mode == "ddp":
        return {"gradient": 2.0 * (n_ranks - 1) * param_count(n_params)}
    if mode == "pp":
        per_boundary = float(batch_size * seq_len * width)
        return {"activation": (n_ranks - 1) * per_boundary, "gradient": (n_ranks - 1) * per_boundary}
    raise ValueError(f"mode must be ddp or pp, got {mode!r}")


def frozen_fraction(hits_per_step_per_element, steps: int):
    """Fraction of elements hit at least once in `steps` steps, each step hitting a uniformly random element
    `hits_per_step_per_element` x n times: 1 - (1 - 1/n)^(h n K) -> 1 - exp(-h K)."""
    return -np.expm1(-np.asarray(hits_per_step_per_element, dtype=float) * steps)


@dataclass(frozen=True)
class RecipePrediction:
    """The theory of one grid point (a recipe, a mode, a BER): expected counts per optimizer step.

    catastrophic: the expected number of values per step that arrive non-finite or large enough to make the
    fp32 gradient norm (or the loss) non-finite, summed over every rank and every hop (the union: any rank's Inf
    skips the step everywhere). lost: lambda, the part of them that loses the step: all under skip and stop,
    and under guard none with norm clipping (the Inf norm zeroes the gradient); none under sanitize (zeroed
    first) and under guard none without norm clipping (they reach the optimizer: frozen elements, or the end).
    p_step_lost = 1 - exp(-lambda); p_step_skipped: what the run's skipped_steps / steps counts.
    """
    mode: str
    ber: float
    wire_dtype: str
    guard: str
    clip: str
    values_per_step: float      # all links, all kinds
    flips_per_step: float       # expected bit flips on the wire (exposed and protected bits)
    catastrophic: float         # (above)
    lost: float                 # lambda (above)
    lost_forward: float         # PP: the part of lambda that arrives as activations (forward), else 0
    nonfinite: float            # expected Inf/NaN values arriving per step (all links)
    p_step_lost: float
    p_step_skipped: float
    sanitized_per_step: float   # guard sanitize: values zeroed per step, summed over ranks (0 otherwise)
    frozen_fraction: float | None  # DDP, AdamW, guard none, no clipping: elements frozen at the end, per rank
    p_run_completes: float      # no run-ending event in `steps` (guard stop: any lost step; none: Inf/NaN, SGD huge)
    noise_deviation: float | None  # DDP: deviation from the bounded (not lost, not frozen) errors, an estimate

    @property
    def p_step_lost_backward(self) -> float:
        """P(step lost) when the next stage contains every catastrophic activation going forward, so that only
        lambda - lost_forward loses steps (PP: its pre-LayerNorm absorbs a huge finite value; docs/theory.md,
        section 4). The same as p_step_lost where nothing arrives forward."""
        return float(-np.expm1(-(self.lost - self.lost_forward)))


def predict_recipe(ber, mode: str, n_ranks: int, *, n_params: int | str | None = None, batch_size: int | None = None,
                   seq_len: int | None = None, width: int | None = None, wire_dtype: str = default_of("wire_dtype"),
                   protect=None, protected_ber: float = 0.0, guard: str = default_of("guard"),
                   clip: str = default_of("clip"), grad_clip: float = default_of("grad_clip"),
                   optimizer: str = default_of("optimizer"),
                   sanitize_threshold: float = default_of("sanitize_threshold"), steps: int = 100,
                   lr: float = default_of("lr"), betas=default_of("betas"), gradient_values=None,
                   activation_values=None) -> RecipePrediction:
    """RecipePrediction for a scalar BER (docs/theory.md, section 4). Value samples: gradients log-normal, half a
    decade wide, with median 0.5/sqrt(n) (DDP; 1e-3 for tiny, which measured a median of 1.2e-3 and a maximum 275
    times that over its 236,928 elements at initialisation) or 1e-3 (PP activation gradients); activations
    normal(0, 1). Pass measured samples when there are some."""
    if guard not in GUARDS:
        raise ValueError(f"guard must be one of {', '.join(GUARDS)}, got {guard!r}")
    clipping = "none" if (clip == "none" or not grad_clip) else clip
    n = param_count(n_params) if mode == "ddp" else None
    kinds = wire_values_per_step(mode, n_ranks, n, batch_size, seq_len, width)
    if gradient_values is None:
        gradient_values = typical_gradient_values(median_abs=0.5 / math.sqrt(n) if n else 1e-3, decades=0.5)
    samples = {"gradient": gradient_values,
               "activation": typical_activation_values() if activation_values is None else activation_values}
    rates = bit_error_rates(ber, wire_dtype, protect, protected_ber)
    threshold = sanitize_threshold if guard == "sanitize" else NORM_OVERFLOW
    cap = adam_hit_displacement(1.0, betas) if optimizer == "adamw" else math.inf
    out = {kind: bit_outcomes(samples[kind], wire_dtype, threshold, cap=cap, steps=steps, beta2=betas[1])
           for kind in kinds}
    bad = {kind: kinds[kind] * float(rates @ o.bad) for kind, o in out.items()}
    nonfinite = sum(kinds[kind] * float(rates @ o.nonfinite) for kind, o in out.items())
    # sanitize zeroes them first; guard none without norm clipping hands them to the optimizer
    loses = not (guard == "sanitize" or (guard == "none" and clipping != "norm"))
    lost = sum(bad.values()) if loses else 0.0
    p_lost = float(-np.expm1(-lost))
    frozen = None
    # the share of a value's hits that reach one rank's gradient: DDP ring, per gradient value crossing (the
    # 2(N-1) n crossings put 1.5 (N-1) errors into each rank's n elements: 0.75 N per crossing), PP once
    reach = 0.75 * n_ranks if mode == "ddp" else 1.0
    if mode == "ddp" and optimizer == "adamw" and guard == "none" and clipping == "none":
        per_element = kinds["gradient"] * float(rates @ out["gradient"].frozen_weight) * reach / n_ranks / n
        frozen = float(frozen_fraction(per_element, steps))
    ending = {"stop": lost, "none": nonfinite + (sum(bad.values()) if optimizer == "sgd" and clipping == "none"
                                                 else 0.0)}
    noise = None
    if mode == "ddp":
        # every error that reaches a rank's gradient and is neither lost nor frozen moves that element by
        # ~ lr x (relative error, capped by Adam) x g/sqrt(v), E[(g/sqrt v)^2] ~ 1; a sanitized value loses the
        # element's gradient (relative error 1). Random walk over the steps.
        o = out["gradient"]
        rel = float(rates @ o.rel_sq) + (float(rates @ o.bad) if guard == "sanitize" else 0.0)
        noise = lr * math.sqrt(steps * kinds["gradient"] * reach / n_ranks * rel)
    return RecipePrediction(
        mode=mode, ber=float(ber), wire_dtype=wire_dtype, guard=guard, clip=clipping,
        values_per_step=sum(kinds.values()), flips_per_step=float(rates.sum()) * sum(kinds.values()),
        catastrophic=sum(bad.values()), lost=lost, lost_forward=bad.get("activation", 0.0) if loses else 0.0,
        nonfinite=nonfinite,
        p_step_lost=p_lost, p_step_skipped=p_lost if guard in ("skip", "sanitize", "stop") else 0.0,
        sanitized_per_step=sum(bad.values()) * reach if guard == "sanitize" else 0.0,
        frozen_fraction=frozen, p_run_completes=float(np.exp(-ending.get(guard, 0.0) * steps)),
        noise_deviation=noise)


LAMBDA_REFERENCE_BER = 1e-9  # lambda is linear in BER to first order: measured there, scaled


def lambda_per_ber(mode: str, n_ranks: int, *, n_params: int | str | None = None, batch_size: int | None = None,
                   seq_len: int | None = None, width: int | None = None,
                   wire_dtype: str = default_of("wire_dtype")) -> float:
    """d lambda / d BER of the values on the wire, with nothing protected and no sanitizer (guard skip): the
    expected catastrophic values per step per unit BER, summed over every rank and hop (`predict_recipe`'s
    `catastrophic`, first order in BER). DDP: 2 (N-1) n gradient values; PP: the (S-1) B T d activations and as many
    activation gradients. 0 when no single flip of this wire dtype is catastrophic (fp16 gradients)."""
    pred = predict_recipe(LAMBDA_REFERENCE_BER, mode, n_ranks, n_params=n_params, batch_size=batch_size,
                          seq_len=seq_len, width=width, wire_dtype=wire_dtype, guard="skip")
    return pred.catastrophic / LAMBDA_REFERENCE_BER


def ber_at_lambda(lam: float, mode: str, n_ranks: int, **shape) -> float:
    """The BER at which the unprotected wire carries `lam` catastrophic values per step (lambda; P(step lost) =
    1 - exp(-lam) under guard skip): lam / lambda_per_ber. ValueError when lam is not a positive number or the
    wire dtype has no catastrophic single flips."""
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam > 0):
        raise ValueError(f"lambda must be a positive number, got {lam!r}")
    per = lambda_per_ber(mode, n_ranks, **shape)
    if per <= 0:
        raise ValueError(f"no single flip of a {shape.get('wire_dtype', 'fp32')} value on the {mode} wire is "
                         "catastrophic: no BER gives lambda > 0")
    return lam / per


TABLE_RECIPES = {"default (fp32, skip, clip norm)": {}, "bf16 wire": {"wire_dtype": "bf16"},
                 "fp16 wire": {"wire_dtype": "fp16"}, "protect sign+exponent": {"protect": ["sign", "exponent"]},
                 "sanitize (1e3)": {"guard": "sanitize"}, "guard none, no clip": {"guard": "none", "clip": "none"}}
TABLE_SETUPS = {  # name: (DDP kwargs, PP kwargs, steps, lr)
    "tiny, 2 ranks/stages, 1,024 tokens per step": (
        {"n_ranks": 2, "n_params": "tiny"}, {"n_ranks": 2, "batch_size": 16, "seq_len": 64, "width": 64}, 100, 3e-3),
    "GPT-2 124M, 4 ranks/stages, PP batch 8 x 1024": (
        {"n_ranks": 4, "n_params": "gpt2-124m"}, {"n_ranks": 4, "batch_size": 8, "seq_len": 1024, "width": 768},
        300, 6e-4),
}


def recipe_table(ber: float = 1e-5, noise_ber: float = 1e-4) -> str:
    """docs/theory.md, section 4: per recipe and setup, the BER at which lambda = 1 (63 % of the steps lost) and
    the predictions at `ber` (lost fraction, sanitized values, frozen fraction) and `noise_ber` (deviation)."""
    out = []
    header = ["recipe", "DDP: λ = 1 at BER", "PP: λ = 1 at BER", f"DDP lost at {ber:g}", f"PP lost at {ber:g}",
              "PP: forward share of λ", f"DDP sanitized per step at {ber:g}", f"DDP frozen at the end, {ber:g}",
              f"DDP noise deviation at {noise_ber:g}"]
    for setup, (ddp_kw, pp_kw, steps, lr) in TABLE_SETUPS.items():
        out += [f"\n#### {setup}, {steps} steps, lr {lr:g}\n", "| " + " | ".join(header) + " |",
                "|" + "---|" * len(header)]
        for name, kw in TABLE_RECIPES.items():
            common = dict(steps=steps, lr=lr, **kw)
            d = {b: predict_recipe(b, "ddp", **ddp_kw, **common) for b in (1e-6, ber, noise_ber)}
            p = {b: predict_recipe(b, "pp", **pp_kw, **common) for b in (1e-6, ber)}
            at_one = lambda x: _g(1e-6 / x.lost) if x.lost else "none"  # noqa: E731 (lambda is linear in BER)
            cells = [name, at_one(d[1e-6]), at_one(p[1e-6]), _g(d[ber].p_step_lost), _g(p[ber].p_step_lost),
                     _g(p[ber].lost_forward / p[ber].lost) if p[ber].lost else "—",
                     _g(d[ber].sanitized_per_step) if kw.get("guard") == "sanitize" else "—",
                     "—" if d[ber].frozen_fraction is None else _g(d[ber].frozen_fraction),
                     _g(d[noise_ber].noise_deviation)]
            out.append("| " + " | ".join(cells) + " |")
    return "\n### Recipes (section 4): lost steps, sanitized and frozen values, bounded noise\n" + "\n".join(out)


def mantissa_noise_bound(ber, dtype: str = "fp32") -> float:
    """Upper bound of E[((x' - x)/x)^2] per value when only the mantissa is exposed: a flip of mantissa bit k
    (of m) changes x by at most 2^(k-m) |x|, so the sum over independent flips is b sum_k 4^(k-m) =
    b (1 - 4^-m) / 3 (first order in b; equality for x = +-2^E)."""
    m = WIRE_FORMATS[dtype][1] if dtype in WIRE_FORMATS else wire_bits(dtype)
    return float(ber) * (1 - 4.0 ** -m) / 3


# ---------------------------------------------------------------------------------------------------------------
# 5. Link latency and KP4 FEC
# ---------------------------------------------------------------------------------------------------------------

FIBER_DELAY_S_PER_M = 5e-9  # group index ~1.47-1.5: light travels ~0.2 m/ns in fiber
KP4_N, KP4_K, KP4_T, KP4_SYMBOL_BITS = 544, 514, 15, 10
KP4_CODEWORD_BITS = KP4_N * KP4_SYMBOL_BITS  # 5440
KP4_DECODE_S = {"full": 114.8e-9, "indicate": 74.5e-9, "none": 37.2e-9}  # one vendor's RS-FEC decoder
LINUX_TCP_RTO_MIN_S, LINUX_TCP_RTO_MAX_S = 0.2, 120.0


def kp4_line_rate_bps(rate_bps: float) -> float:
    """Serial line rate carrying a MAC rate through 256b/257b transcoding and RS(544,514): 100G -> 106.25G."""
    return rate_bps * 257 / 256 * KP4_N / KP4_K


def kp4_codeword_fill_s(rate_bps: float) -> float:
    """Time to receive one whole 5440-bit codeword (all lanes together): 51.2 ns at 100 Gbit/s."""
    return KP4_CODEWORD_BITS / kp4_line_rate_bps(rate_bps)


def kp4_codeword_failure_probability(pre_fec_ber):
    """P(> 15 of 544 symbols in error) with independent bit errors; a symbol errs if any of its 10 bits does."""
    p_sym = -np.expm1(KP4_SYMBOL_BITS * np.log1p(-np.asarray(pre_fec_ber, dtype=float)))
    return bdtrc(KP4_T, KP4_N, p_sym)


def kp4_post_fec_ber(pre_fec_ber):
    """Post-FEC BER of RS(544,514) with independent bit errors and a decoder that passes failed codewords on.

    An errored bit survives iff its codeword fails, i.e. at least 15 of the other 543 symbols are errored:
    BER_post = BER_pre x P(Binomial(543, p_sym) >= 15). Miscorrections (extra errors) are ignored."""
    ber = np.asarray(pre_fec_ber, dtype=float)
    p_sym = -np.expm1(KP4_SYMBOL_BITS * np.log1p(-ber))
    return ber * bdtrc(KP4_T - 1, KP4_N - 1, p_sym)


def kp4_pre_fec_ber_for(post_fec_ber: float) -> float:
    """Pre-FEC BER at which kp4_post_fec_ber reaches `post_fec_ber` (independent errors)."""
    f = lambda log_b: math.log(float(kp4_post_fec_ber(10.0**log_b))) - math.log(post_fec_ber)
    return 10.0 ** brentq(f, -8, -1.5)


@dataclass(frozen=True)
class FrameLatency:
    """One-way latency of one frame and its parts (seconds); retransmission is the expected extra time."""
    scheme: str
    serialization_s: float
    propagation_s: float
    fec_fill_s: float
    fec_decode_s: float
    retransmission_s: float
    frame_error_probability: float      # a transmission of the frame has >= 1 bit error (before any FEC)
    delivered_error_probability: float  # the frame handed up still has errors
    tail_s: float                       # latency at `quantile` (retransmissions counted at that quantile)

    @property
    def total_s(self) -> float:
        return (self.serialization_s + self.propagation_s + self.fec_fill_s + self.fec_decode_s
                + self.retransmission_s)

    def row(self) -> dict:
        """Fields in nanoseconds (times) for a breakdown table."""
        out = {"scheme": self.scheme}
        for f in fields(self)[1:]:
            v = getattr(self, f.name)
            out[f.name.replace("_s", "_ns") if f.name.endswith("_s") else f.name] = (
                v * 1e9 if f.name.endswith("_s") else v)
        out["total_ns"] = self.total_s * 1e9
        return out


SCHEMES = ("kp4", "relaxed", "link-retransmit", "tcp-retransmit")


def _retries_at_quantile(p: float, quantile: float) -> int:
    """Smallest r with P(more than r failed attempts) = p^(r+1) <= 1 - quantile."""
    if p <= 0:
        return 0
    if p >= 1:
        raise ValueError("every transmission fails")
    return max(0, math.ceil(math.log(1 - quantile) / math.log(p) - 1 - 1e-12))


def _tcp_backoff_s(p: float, rto_s: float, rto_max_s: float, retries: int | None = None) -> float:
    """Wait for TCP retransmissions with exponential RTO backoff: the k-th retry waits w_k = min(rto 2^(k-1),
    rto_max). With retries=None the expectation sum_k P(>= k failures) w_k = sum_k p^k w_k (closed form);
    otherwise the wait for exactly `retries` retries. (Linux gives up after tcp_retries2 = 15 by default.)"""
    k_cap = 1 + max(0, math.ceil(math.log2(rto_max_s / rto_s)))  # first k with rto 2^(k-1) >= rto_max
    if retries is not None:
        doubling = sum(rto_s * 2 ** (k - 1) for k in range(1, min(retries, k_cap - 1) + 1))
        return doubling + max(0, retries - k_cap + 1) * rto_max_s
    if p >= 1:
        return math.inf
    doubling = sum(p**k * rto_s * 2 ** (k - 1) for k in range(1, k_cap))
    return doubling + rto_max_s * p**k_cap / (1 - p)


def frame_latency(frame_bytes: int, rate_bps: float, length_m: float, scheme: str = "kp4", *, ber: float = 0.0,
                  decoder: str = "full", turnaround_s: float = 0.0, rto_s: float = LINUX_TCP_RTO_MIN_S,
                  rto_max_s: float = LINUX_TCP_RTO_MAX_S, quantile: float = 0.99) -> FrameLatency:
    """One-way latency of a frame of `frame_bytes` on-wire bytes over a link of `rate_bps` and `length_m`.

    Components common to every scheme: serialization 8 L / R and propagation 5 ns/m. Schemes:
    - "kp4": RS(544,514) FEC: + one codeword fill (the receiver decodes whole codewords; the first bit of a
      codeword waits for the last) + decoder latency (`decoder`: full / indicate / none); errors left: post-FEC.
    - "relaxed": no FEC, no retransmission: errored frames are delivered as they are.
    - "link-retransmit": no FEC, CRC + link-level retransmission: each failed attempt costs a round trip
      (serialization + 2 x propagation + `turnaround_s`); failures are geometric, E[retries] = p / (1-p).
    - "tcp-retransmit": no FEC, the checksum drops the segment and TCP resends after the RTO (>= 200 ms on Linux),
      doubling per consecutive loss up to rto_max_s: expected p rto / (1 - 2p) for p < 1/2, diverging beyond
      (that is the stall measured at BER 1e-4 with 1448-byte segments, 69 % drops). Fast retransmit can recover
      in ~1 RTT when later segments get through; this is the no-later-segments (tail) case.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}")
    bits = 8 * frame_bytes
    ser = bits / rate_bps
    prop = length_m * FIBER_DELAY_S_PER_M
    p_frame = float(-np.expm1(bits * np.log1p(-ber)))
    fill = decode = retx = tail_retx = 0.0
    delivered = p_frame
    if scheme == "kp4":
        if decoder not in KP4_DECODE_S:
            raise ValueError(f"decoder must be one of {sorted(KP4_DECODE_S)}")
        fill, decode = kp4_codeword_fill_s(rate_bps), KP4_DECODE_S[decoder]
        if decoder == "full":  # "indicate" only flags errored codewords; "none" passes them on
            delivered = float(-np.expm1(bits * np.log1p(-float(kp4_post_fec_ber(ber)))))
    elif scheme in ("link-retransmit", "tcp-retransmit"):
        delivered = 0.0  # CRC-32 / checksum failures assumed always detected
        if scheme == "link-retransmit":
            rtt = ser + 2 * prop + turnaround_s
            retx = math.inf if p_frame >= 1 else rtt * p_frame / (1 - p_frame)
            tail_retx = rtt * _retries_at_quantile(p_frame, quantile) if p_frame < 1 else math.inf
        else:
            retx = _tcp_backoff_s(p_frame, rto_s, rto_max_s)
            tail_retx = (_tcp_backoff_s(p_frame, rto_s, rto_max_s, _retries_at_quantile(p_frame, quantile))
                         if p_frame < 1 else math.inf)
    base = ser + prop + fill + decode
    return FrameLatency(scheme, ser, prop, fill, decode, retx, p_frame, delivered, base + tail_retx)


def latency_comparison(frame_bytes: int, rate_bps: float, length_m: float, ber: float, **kwargs) -> list[FrameLatency]:
    """frame_latency for every scheme (same arguments)."""
    return [frame_latency(frame_bytes, rate_bps, length_m, s, ber=ber, **kwargs) for s in SCHEMES]


# ---------------------------------------------------------------------------------------------------------------
# 6. Tables for docs/theory.md
# ---------------------------------------------------------------------------------------------------------------

def _g(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def markdown_tables(bers=(1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3), steps: int = 100, lr: float = 1e-3) -> str:
    """The tables of docs/theory.md for GPT-2 124M (DDP on 2 and 4 ranks, PP on 2 and 4 stages), KP4, latency."""
    out = []
    p_cat = flip_statistics(typical_gradient_values()).p_catastrophic
    out.append(f"### DDP, GPT-2 124M ({GPT2_124M_PARAMS:,} parameters, fp32), per step and rank\n")
    out.append(f"Weight deviation: AdamW (0.9, 0.95), lr {lr:g}, clip 1.0 / no clip, after {steps} steps, "
               "typical_gradient_values(); catastrophic = Inf/NaN or |x'| > 1e30.\n")
    out.append(f"For scale, a clean run moves the weights by about lr u sqrt(n K) = "
               f"{lr * 0.5 * math.sqrt(GPT2_124M_PARAMS * steps):.0f} (random walk, u = 0.5) to lr u K sqrt(n) = "
               f"{lr * 0.5 * steps * math.sqrt(GPT2_124M_PARAMS):.0f} (straight line) in {steps} steps.\n")
    out.append("| ranks | BER | flips received | errors in gradient | P(no flip at rank) | P(no flip in step) "
               "| header flips | catastrophic | P(step lost, clip) | deviation clip | deviation no clip "
               f"| frozen after {steps} (no clip) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n_ranks in (2, 4):
        for b in bers:
            f = ddp_ring_flips(b, "gpt2-124m", n_ranks)
            w = weight_noise_per_step(b, "gpt2-124m", lr, n_ranks=n_ranks)
            frozen = weight_noise_per_step(b, "gpt2-124m", lr, n_ranks=n_ranks, grad_clip=0).frozen * steps
            dev_clip = weight_deviation_estimate(b, "gpt2-124m", steps, lr, n_ranks=n_ranks)
            dev_free = weight_deviation_estimate(b, "gpt2-124m", steps, lr, n_ranks=n_ranks, grad_clip=0)
            out.append(f"| {n_ranks} | {b:.0e} | {_g(f.flips_received_per_rank)} | {_g(f.errors_in_rank_gradient)} "
                       f"| {_g(f.p_error_free_rank)} | {_g(f.p_error_free_step)} | {_g(f.header_flips_per_rank)} "
                       f"| {_g(float(w.catastrophic))} | {_g(float(w.p_step_lost))} | {_g(float(dev_clip))} "
                       f"| {_g(float(dev_free))} | {_g(float(frozen))} |")
    for n_ranks in (2, 4):
        f = ddp_ring_flips(0, "gpt2-124m", n_ranks)
        out.append(f"\nCatastrophic-hit threshold, {n_ranks} ranks: BER = "
                   f"{_g(catastrophic_threshold_ber(f.error_bits_in_rank_gradient, p_cat))} (errors reaching a rank's "
                   f"gradient, p = {p_cat:.4f} per flip); counting only the bits a rank receives: "
                   f"{_g(catastrophic_threshold_ber(f.bits_received_per_rank, p_cat))}")
    out.append("\n### PP, GPT-2 124M, batch 8 x 1024 tokens, d = 768, fp32, per step\n")
    act = flip_statistics(typical_activation_values())
    out.append(f"Activations ~ normal(0, 1): per flip P(catastrophic) = {act.p_catastrophic:.4f}, "
               f"P(Inf/NaN) = {act.p_nonfinite:.4f}.\n")
    out.append("| stages | BER | flips per boundary (fwd + bwd) | flips per step | P(no flip in step) "
               "| catastrophic per step | Inf/NaN per step |")
    out.append("|---|---|---|---|---|---|---|")
    for stages in (2, 4):
        for b in bers:
            f = pp_flips(b, stages, 8, 1024, 768)
            out.append(f"| {stages} | {b:.0e} | {_g(2 * f.flips_forward_per_boundary)} | {_g(f.flips_per_step)} "
                       f"| {_g(f.p_error_free_step)} | {_g(f.flips_per_step * act.p_catastrophic)} "
                       f"| {_g(f.flips_per_step * act.p_nonfinite)} |")
    for stages in (2, 4):
        bits = pp_flips(0, stages, 8, 1024, 768).bits_per_step
        out.append(f"\nCatastrophic-hit threshold, {stages} stages: BER = "
                   f"{_g(catastrophic_threshold_ber(bits, act.p_catastrophic))}; one Inf/NaN expected within "
                   f"{steps} steps at BER {_g(catastrophic_threshold_ber(bits * steps, act.p_nonfinite))}")
    out.append(recipe_table())
    out.append("\n### TCP checksum \"keep\": drops and retransmissions (1448-byte segments, payload-only flips)\n")
    out.append("| BER | P(segment dropped) | retransmissions per segment |")
    out.append("|---|---|---|")
    for b in bers:
        out.append(f"| {b:.0e} | {_g(float(packet_drop_probability(b, 1448)))} "
                   f"| {_g(float(expected_retransmissions(b, 1448)))} |")
    out.append("\n### KP4 RS(544,514), independent bit errors\n")
    out.append("| pre-FEC BER | P(codeword fails) | post-FEC BER |")
    out.append("|---|---|---|")
    for b in (1e-5, 1e-4, 2.4e-4, 5e-4, 1e-3, 2e-3):
        out.append(f"| {b:g} | {_g(float(kp4_codeword_failure_probability(b)))} | {_g(float(kp4_post_fec_ber(b)))} |")
    out.append(f"\nPre-FEC BER for post-FEC 1e-12: {_g(kp4_pre_fec_ber_for(1e-12))}; "
               f"for 1e-15: {_g(kp4_pre_fec_ber_for(1e-15))}.")
    out.append("\n### Latency of a 4096-byte frame, 100 Gbit/s, 10 m (ns; retransmission = expected)\n")
    for b in (1e-5,):
        out.append(f"BER {b:g}:\n")
        out.append("| scheme | serialization | propagation | FEC fill | FEC decode | retransmission | mean total "
                   "| p99 | P(frame errored) | P(delivered with errors) |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for lat in latency_comparison(4096, 100e9, 10, b):
            r = lat.row()
            out.append(f"| {lat.scheme} | {_g(r['serialization_ns'])} | {_g(r['propagation_ns'])} "
                       f"| {_g(r['fec_fill_ns'])} | {_g(r['fec_decode_ns'])} | {_g(r['retransmission_ns'])} "
                       f"| {_g(r['total_ns'])} | {_g(r['tail_ns'])} | {_g(lat.frame_error_probability)} "
                       f"| {_g(lat.delivered_error_probability)} |")
    out.append("\nMean total latency (ns) versus BER, same frame and link:\n")
    out.append("| BER | " + " | ".join(SCHEMES) + " |")
    out.append("|---|" + "---|" * len(SCHEMES))
    for b in bers:
        cells = [_g(lat.total_s * 1e9) for lat in latency_comparison(4096, 100e9, 10, b)]
        out.append(f"| {b:.0e} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown_tables())
