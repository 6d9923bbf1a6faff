"""Checks of testbed/experiments/theory.py against independent computations: Monte Carlo with numpy (flip counts,
ring allreduce error reach, fp32 flip outcomes, KP4 decoding), exact sums, known numbers, and torch for the
optimizer behaviour the weight-noise model assumes. Pure computation, no network; a few seconds."""

import math
import struct

import numpy as np
import pytest

from testbed.experiments import theory as th

RNG = np.random.default_rng(12345)


def within(measured, expected, sigmas=5.0, std=None):
    """Monte Carlo agreement: |measured - expected| <= sigmas x std (Poisson std by default)."""
    std = math.sqrt(expected) if std is None else std
    return abs(measured - expected) <= sigmas * std


# --- 1. flip counts --------------------------------------------------------------------------------------------

def test_gpt2_parameter_count():
    assert th.param_count("gpt2-124m") == th.GPT2_124M_PARAMS == 124_439_808
    assert th.param_count(1000) == 1000
    with pytest.raises(ValueError):
        th.param_count("gpt2-xxl")


def test_ddp_known_numbers():
    # measured-facts section 4: ~3.98e9 gradient bits, ~6e5 flips per rank per step at 1e-4, ~6 at 1e-9 (4 ranks)
    f = th.ddp_ring_flips(1e-4, "gpt2-124m", 4)
    assert f.gradient_bits == 124_439_808 * 32
    assert f.bits_received_per_rank == pytest.approx(1.5 * 124_439_808 * 32)
    assert f.flips_received_per_rank == pytest.approx(5.97e5, rel=1e-3)
    assert th.ddp_ring_flips(1e-9, "gpt2-124m", 4).flips_received_per_rank == pytest.approx(5.97, rel=1e-3)
    assert f.flips_received_reduce_scatter + f.flips_received_allgather == pytest.approx(f.flips_received_per_rank)
    # two ranks: reduce-scatter errors reach both, allgather errors the receiver only
    f2 = th.ddp_ring_flips(1e-6, 1000, 2, dtype_bits=1)
    assert f2.errors_shared_by_all_ranks == pytest.approx(1e-6 * 1000)
    assert f2.errors_allgather_in_rank == pytest.approx(1e-6 * 500) == pytest.approx(f2.flips_received_allgather)


def test_ber_zero_limits():
    f = th.ddp_ring_flips(0.0, "gpt2-124m", 4)
    assert f.flips_received_per_rank == f.errors_in_rank_gradient == f.corrupted_elements_received == 0
    assert f.p_error_free_rank == f.p_error_free_step == 1.0
    p = th.pp_flips(0.0, 4, 8, 1024, 768)
    assert p.flips_per_step == 0 and p.p_error_free_step == 1.0
    assert th.packet_drop_probability(0.0, 1448) == 0 and th.expected_retransmissions(0.0, 1448) == 0


def test_flip_count_and_error_free_probability_monte_carlo():
    ber, bits, trials = 1e-3, 100_000, 40
    counts = (RNG.random((trials, bits)) < ber).sum(axis=1)
    assert within(counts.mean(), th.expected_flips(ber, bits), std=math.sqrt(ber * bits / trials))

    ber, bits, trials = 2.5e-4, 2000, 4000
    clean = ~(RNG.random((trials, bits)) < ber).any(axis=1)
    p = th.p_error_free(ber, bits)
    assert p == pytest.approx(math.exp(-0.5), rel=1e-3)
    assert within(clean.mean(), p, std=math.sqrt(p * (1 - p) / trials))


def test_corrupted_elements_monte_carlo():
    ber, n = 1e-3, 100_000
    corrupted = (RNG.random((n, 32)) < ber).any(axis=1).sum()
    expected = n * th.p_element_corrupted(ber)
    assert expected == pytest.approx(n * (1 - (1 - ber) ** 32))
    assert within(corrupted, expected)


def simulate_ring_allreduce(n_ranks, chunk, q, rng):
    """gloo's ring on chunks (gloo/allreduce.cc): reduce-scatter, rank r sends chunk r+1+s to r-1 which adds it;
    allgather, rank r sends chunk r+s to r-1 which stores it (and forwards that copy next step). Each element on
    each hop is corrupted with probability q by adding a positive marker. Returns, per rank, the boolean mask of
    elements that differ from the clean sum."""
    values = rng.normal(size=(n_ranks, n_ranks * chunk))
    buf = values.copy()
    sl = lambda c: slice((c % n_ranks) * chunk, (c % n_ranks + 1) * chunk)

    def wire(x):
        hit = rng.random(x.shape) < q
        return x + hit * 1000.0 * rng.integers(1, 1000, x.shape)

    for s in range(n_ranks - 1):
        sent = [wire(buf[r, sl(r + 1 + s)]) for r in range(n_ranks)]
        for r in range(n_ranks):
            buf[(r - 1) % n_ranks, sl(r + 1 + s)] += sent[r]
    for s in range(n_ranks - 1):
        sent = [wire(buf[r, sl(r + s)]) for r in range(n_ranks)]
        for r in range(n_ranks):
            buf[(r - 1) % n_ranks, sl(r + s)] = sent[r]
    return np.abs(buf - values.sum(axis=0)) > 1.0


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_ring_error_reach_monte_carlo(n_ranks):
    chunk, q, trials = 40_000 // n_ranks * 2, 1e-3, 3
    elements = n_ranks * chunk
    # element-level model: 1 "bit" per element, BER = q
    f = th.ddp_ring_flips(q, elements, n_ranks, dtype_bits=1)
    per_rank, everywhere = [], []
    for _ in range(trials):
        wrong = simulate_ring_allreduce(n_ranks, chunk, q, RNG)
        per_rank.extend(wrong.sum(axis=1))
        everywhere.append(wrong.all(axis=0).sum())
    n_samples = len(per_rank)
    # errors in one rank's result: every reduce-scatter error plus the allgather errors that reach it (N-h ranks)
    assert within(np.mean(per_rank), f.errors_in_rank_gradient, std=math.sqrt(f.errors_in_rank_gradient / n_samples))
    # reduce-scatter errors are in every rank's result; for N=2 no allgather error is (its owner never sees it)
    assert within(np.mean(everywhere), f.errors_shared_by_all_ranks,
                  std=math.sqrt(f.errors_shared_by_all_ranks / trials))


def test_pp_flips():
    p = th.pp_flips(1e-6, 2, 8, 1024, 768, microbatches=4)
    assert p.bits_per_boundary_each_way == 8 * 1024 * 768 * 32
    assert p.bits_per_microbatch_each_way == p.bits_per_boundary_each_way / 4
    assert p.flips_per_step == pytest.approx(2 * 1e-6 * 8 * 1024 * 768 * 32)
    assert th.pp_flips(1e-6, 4, 8, 1024, 768).flips_per_step == pytest.approx(3 * p.flips_per_step)
    with pytest.raises(ValueError):
        th.pp_flips(1e-6, 2, 6, 1024, 768, microbatches=4)


def test_packet_drop_monte_carlo():
    # measured on the testbed: BER 1e-4 with 1448-byte segments drops ~69 %
    assert th.packet_drop_probability(1e-4, 1448) == pytest.approx(0.686, abs=0.001)
    trials, ber, payload = 1500, 1e-4, 1448
    dropped = (RNG.random((trials, 8 * payload)) < ber).any(axis=1).mean()
    p = float(th.packet_drop_probability(ber, payload))
    assert within(dropped, p, std=math.sqrt(p * (1 - p) / trials))
    attempts = RNG.geometric(1 - p, size=200_000) - 1  # failures before the first success
    assert attempts.mean() == pytest.approx(float(th.expected_retransmissions(ber, payload)), rel=0.03)


def test_gloo_segment_count():
    # one 25 MiB buffer: roundUp(max(25, 2N), N) segments, (N-1)/N of them sent per phase
    assert th.gloo_ring_segments_per_rank(25 * th.MIB, 4, first_bucket_bytes=25 * th.MIB) == 2 * (28 - 7)
    assert th.gloo_ring_segments_per_rank(25 * th.MIB, 2, first_bucket_bytes=25 * th.MIB) == 2 * (26 - 13)
    assert th.gloo_ring_segments_per_rank(1000, 4) == 2 * (8 - 2)  # tiny buffers still use 2N segments


# --- 2. fp32 flips ---------------------------------------------------------------------------------------------

def struct_flip_bits(x, k):
    """Independent bit flip through struct: the float32 word of x, xor 1<<k, as an integer."""
    return struct.unpack("<I", struct.pack("<f", x))[0] ^ (1 << k)


def test_flip_bit_matches_struct_and_known_values():
    xs = [0.0, 1e-5, -3.5e-3, 0.5, 1.0, 1.5, -1.75, 3.0, 1e30]
    got = th.flip_all_bits(np.array(xs, dtype=np.float32)).view(np.uint32)
    for i, x in enumerate(xs):
        assert [int(w) for w in got[i]] == [struct_flip_bits(x, k) for k in range(32)]
    assert th.flip_bit(0.5, 30) == np.float32(0.5 * 2.0**128)  # below 1: ~1e38
    assert np.isinf(th.flip_bit(1.0, 30)) and np.isnan(th.flip_bit(1.5, 30))  # [1, 2): Inf/NaN
    assert th.flip_bit(4.0, 30) == np.float32(4.0 * 2.0**-128)  # >= 2: the MSB is set, the flip shrinks it
    assert th.flip_bit(-2.5, 31) == 2.5 and th.flip_bit(1.0, 22) == 1.5
    with pytest.raises(ValueError):
        th.flip_bit(1.0, 32)


def test_mantissa_relative_error():
    x = np.float32(1.0)  # x = 2^E: the bound is reached
    d = th.flip_deltas(x)
    assert np.allclose(d[:23] / x, th.mantissa_relative_error_bound(np.arange(23)))
    vals = RNG.uniform(-1e3, 1e3, 1000).astype(np.float32)
    rel = th.flip_deltas(vals)[:, :23] / np.abs(vals)[:, None].astype(np.float64)
    assert np.all(rel <= th.mantissa_relative_error_bound(np.arange(23)) * (1 + 1e-12))
    assert np.allclose(th.flip_deltas(vals)[:, 31], 2 * np.abs(vals.astype(np.float64)))


def test_catastrophic_probability_monte_carlo():
    # gradient-like values |g| << 1: only bit 30 is catastrophic, 1 flip in 32, never Inf/NaN
    vals = (RNG.normal(size=200_000) * 1e-4).astype(np.float32)
    stats = th.flip_statistics(vals)
    k = RNG.integers(0, 32, vals.size)
    out = th.flip_bit(vals, k).astype(np.float64)
    mc = np.mean(~np.isfinite(out) | (np.abs(out) > 1e30))
    assert within(mc, stats.p_catastrophic, std=math.sqrt(stats.p_catastrophic / vals.size))
    assert stats.p_nonfinite == 0
    assert stats.p_catastrophic == pytest.approx(1 / 32, rel=0.01)  # all but the tiniest |g| (< 1e30 / 2^128)

    # activation-like values ~ N(0, 1): Inf/NaN iff bit 30 of |x| in [1, 2): P = (P(|x|<2) - P(|x|<1)) / 32
    acts = RNG.normal(size=200_000).astype(np.float32)
    out = th.flip_bit(acts, RNG.integers(0, 32, acts.size))
    analytic = (math.erf(2 / math.sqrt(2)) - math.erf(1 / math.sqrt(2))) / 32
    assert within(np.mean(~np.isfinite(out)), analytic, std=math.sqrt(analytic / acts.size))
    assert th.flip_statistics(th.typical_activation_values()).p_nonfinite == pytest.approx(analytic, rel=0.02)


def test_mantissa_mean_square_relative_error():
    # log-uniform magnitudes: f = mantissa fraction has density 1/((1+f) ln 2), E[(1+f)^-2] = 3/(8 ln 2);
    # E[(2^(k-23)/(1+f))^2] over k = 0..22 = (1 - 4^-23) / (3 x 23) x 3/(8 ln 2)
    vals = (10.0 ** RNG.uniform(-8, 0, 100_000)).astype(np.float32)
    expected = (1 - 4.0**-23) / 69 * 3 / (8 * math.log(2))
    assert th.flip_statistics(vals).mean_rel_sq_mantissa == pytest.approx(expected, rel=0.02)


# --- 3. weight noise -------------------------------------------------------------------------------------------

def test_threshold():
    bits = th.ddp_ring_flips(0, "gpt2-124m", 4).error_bits_in_rank_gradient
    p = th.flip_statistics(th.typical_gradient_values()).p_catastrophic
    thr = th.catastrophic_threshold_ber(bits, p)
    assert thr * bits * p == pytest.approx(1.0)
    assert th.weight_noise_per_step(thr, "gpt2-124m", 1e-3, n_ranks=4).catastrophic == pytest.approx(1.0)
    assert 1e-9 < thr < 3e-9  # GPT-2 124M, 4 ranks: far below the published 1e-4 (docs/theory.md)
    assert th.catastrophic_threshold_ber(1e6) == pytest.approx(32e-6)


def test_adam_caps():
    assert th.adam_step_cap(1e-3, (0.9, 0.999)) == pytest.approx(1e-3 * 0.1 / math.sqrt(0.001))
    # geometric series of the capped step, checked by summing it
    b1, b2, lr = 0.9, 0.95, 1e-3
    steps = sum(th.adam_step_cap(lr, (b1, b2)) * (b1 / math.sqrt(b2)) ** t for t in range(2000))
    assert th.adam_hit_displacement(lr, (b1, b2)) == pytest.approx(steps)


@pytest.mark.parametrize("clip", [1.0, 0.0])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_weight_deviation_scaling(optimizer, clip):
    kw = dict(n_params="gpt2-124m", lr=1e-3, optimizer=optimizer, grad_clip=clip)
    assert th.weight_deviation_estimate(0.0, steps=100, **kw) == 0
    # rare hits: deviation ~ sqrt(BER) (slope 1/2 on log-log axes)
    lo, hi = (th.weight_deviation_estimate(b, steps=100, **kw) for b in (1e-15, 1e-14))
    assert math.log10(hi / lo) == pytest.approx(0.5, abs=0.01)
    if optimizer == "sgd" and clip == 0:
        # a catastrophic hit wrecks an unclipped SGD run: inf once one is expected
        assert math.isinf(th.weight_deviation_estimate(1e-8, steps=100, **kw))
    if clip:
        # no freezing: random walk ~ sqrt(K) (horizon kept fixed so the stall cap does not change)
        k1 = th.weight_deviation_estimate(1e-12, steps=100, horizon_steps=100, **kw)
        k4 = th.weight_deviation_estimate(1e-12, steps=400, horizon_steps=100, **kw)
        assert k4 / k1 == pytest.approx(2.0)


def test_weight_noise_components():
    w = th.weight_noise_per_step(1e-9, "gpt2-124m", 1e-3, grad_clip=1.0, n_ranks=4)
    assert w.p_step_lost == pytest.approx(1 - math.exp(-w.catastrophic), rel=0.2)
    assert w.noise_sq == pytest.approx(w.noise_sq_small + w.noise_sq_lost)
    assert w.frozen == 0 and w.destructive == 0  # clipped: nothing freezes, gradients |g| << 1 never give Inf
    free = th.weight_noise_per_step(1e-9, "gpt2-124m", 1e-3, grad_clip=0.0, n_ranks=4)
    # frozen: (1-b2) x'^2 > fp32 max, i.e. x' > ~8e19; catastrophic: x' > 1e30; the same flips in practice
    assert free.p_step_lost == 0 and free.frozen == pytest.approx(free.catastrophic, rel=1e-3)
    # saturation with clipping: every step lost -> lr^2 n per step
    sat = th.weight_noise_per_step(1e-3, "gpt2-124m", 1e-3, grad_clip=1.0)
    assert sat.noise_sq_lost == pytest.approx(1e-6 * th.GPT2_124M_PARAMS)


def test_optimizer_behaviour_assumed_by_the_model():
    """The weight-noise model relies on two torch behaviours; check them on the installed torch."""
    torch = pytest.importorskip("torch")
    huge = float(th.flip_bit(1e-4, 30))  # ~3.4e34, the exponent-MSB flip of a typical gradient value

    # AdamW without clipping: v overflows to Inf, the element's step is 0 from then on
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), foreach=False, weight_decay=0.0)
    for t in range(4):
        p.grad = torch.full((8,), 1e-4)
        if t == 1:
            p.grad[3] = huge
        opt.step()
        if t == 0:
            before = float(p[3].detach())
    assert math.isinf(float(opt.state[p]["exp_avg_sq"][3])) and float(p[3].detach()) == before
    assert float(p[0].detach()) < before  # the other elements keep moving

    # global-norm clipping: the fp32 norm overflows and the whole gradient becomes 0 (finite, not NaN)
    q = torch.nn.Parameter(torch.zeros(8))
    q.grad = torch.full((8,), 1e-4)
    q.grad[3] = huge
    norm = torch.nn.utils.clip_grad_norm_([q], 1.0)
    assert math.isinf(float(norm)) and torch.all(q.grad == 0)


# --- 4. latency and KP4 ----------------------------------------------------------------------------------------

def test_kp4_fill_time():
    assert th.kp4_line_rate_bps(100e9) == pytest.approx(106.25e9)
    assert th.kp4_codeword_fill_s(100e9) == pytest.approx(51.2e-9)
    assert th.kp4_codeword_fill_s(400e9) == pytest.approx(12.8e-9)


@pytest.mark.parametrize("ber", [0.0, 1e-9, 1e-5, 1e-4])
def test_latency_breakdown_adds_up(ber):
    rows = th.latency_comparison(4096, 100e9, 10, ber)
    assert [r.scheme for r in rows] == list(th.SCHEMES)
    for r in rows:
        parts = r.serialization_s + r.propagation_s + r.fec_fill_s + r.fec_decode_s + r.retransmission_s
        assert r.total_s == pytest.approx(parts)
        assert r.row()["total_ns"] == pytest.approx(parts * 1e9)
        assert r.serialization_s == pytest.approx(4096 * 8 / 100e9) and r.propagation_s == pytest.approx(50e-9)
        base = r.serialization_s + r.propagation_s + r.fec_fill_s + r.fec_decode_s
        assert r.tail_s >= base * (1 - 1e-12)
    kp4, relaxed, link, tcp = rows
    assert kp4.total_s - relaxed.total_s == pytest.approx(51.2e-9 + 114.8e-9)
    assert relaxed.retransmission_s == kp4.retransmission_s == 0
    if ber == 0:
        assert link.total_s == tcp.total_s == relaxed.total_s
        assert relaxed.delivered_error_probability == 0
    else:
        assert relaxed.delivered_error_probability == pytest.approx(1 - (1 - ber) ** 32768)
        assert kp4.delivered_error_probability < 1e-12


def test_retransmission_latency_monte_carlo():
    ber = 1e-5
    link = th.frame_latency(4096, 100e9, 10, "link-retransmit", ber=ber)
    p = link.frame_error_probability
    rtt = 4096 * 8 / 100e9 + 2 * 50e-9
    failures = RNG.geometric(1 - p, size=200_000) - 1
    assert link.retransmission_s == pytest.approx(failures.mean() * rtt, rel=0.03)
    assert link.tail_s - (link.total_s - link.retransmission_s) == pytest.approx(np.quantile(failures, 0.99) * rtt)
    # TCP: k-th retry waits min(0.2 s x 2^(k-1), 120 s); closed form vs simulation and vs p rto / (1 - 2p)
    tcp = th.frame_latency(4096, 100e9, 10, "tcp-retransmit", ber=ber)
    waits = np.array([sum(min(0.2 * 2 ** (k - 1), 120.0) for k in range(1, f + 1)) for f in failures[:50_000]])
    assert tcp.retransmission_s == pytest.approx(waits.mean(), rel=0.05)
    assert tcp.retransmission_s == pytest.approx(0.2 * p / (1 - 2 * p), rel=1e-2)  # the 120 s cap barely matters


def kp4_exact_tail(p_sym, t, n):
    """P(Binomial(n, p) > t) by summing log-space terms (independent of scipy)."""
    logs = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * math.log(p_sym)
            + (n - j) * math.log1p(-p_sym) for j in range(t + 1, n + 1)]
    top = max(logs)
    return math.exp(top) * sum(math.exp(v - top) for v in logs)


def test_kp4_post_fec_ber():
    bers = np.logspace(-7, -2.5, 40)
    post = th.kp4_post_fec_ber(bers)
    assert np.all(np.diff(post) > 0) and np.all(post < bers)
    assert th.kp4_post_fec_ber(1e-5) < 1e-30
    assert th.kp4_post_fec_ber(2.4e-4) <= 1e-12  # the design point meets 1e-12 (with room, if independent)
    p_sym = 1 - (1 - 2.4e-4) ** 10
    assert th.kp4_codeword_failure_probability(2.4e-4) == pytest.approx(kp4_exact_tail(p_sym, 15, 544), rel=1e-6)
    assert th.kp4_post_fec_ber(2.4e-4) == pytest.approx(2.4e-4 * kp4_exact_tail(p_sym, 14, 543), rel=1e-6)
    b = th.kp4_pre_fec_ber_for(1e-12)
    assert th.kp4_post_fec_ber(b) == pytest.approx(1e-12, rel=1e-6) and 2.4e-4 < b < 1e-3


def test_kp4_decoding_monte_carlo():
    # at a pre-FEC BER where failures are frequent: decode 1500 random codewords
    ber, n_cw = 3e-3, 1500
    errors = RNG.random((n_cw, th.KP4_N, th.KP4_SYMBOL_BITS)) < ber
    failed = errors.any(axis=2).sum(axis=1) > th.KP4_T
    assert within(failed.mean(), float(th.kp4_codeword_failure_probability(ber)),
                  std=math.sqrt(0.25 / n_cw))
    post = errors[failed].sum() / errors.size
    assert post == pytest.approx(float(th.kp4_post_fec_ber(ber)), rel=0.08)


def test_markdown_tables_render():
    text = th.markdown_tables(bers=(1e-9, 1e-4), steps=10)
    assert "| 4 | 1e-04 |" in text and "kp4" in text
