"""Checks of testbed/analysis/theory.py against independent computations: Monte Carlo with numpy (flip counts,
ring allreduce error reach, fp32 flip outcomes, KP4 decoding), exact sums, known numbers, and torch for the
optimizer behaviour the weight-noise model assumes. Pure computation, no network; a few seconds."""

import math
import struct

import numpy as np
import pytest

from testbed.analysis import theory as th

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


# --- 5. recipes: wire dtypes, protection, guards ---------------------------------------------------------------

def test_wire_formats_and_protected_positions():
    assert [th.wire_bits(d) for d in ("fp32", "bf16", "fp16")] == [32, 16, 16]
    assert th.field_positions("fp32") == {"mantissa": range(0, 23), "exponent": range(23, 31), "sign": range(31, 32)}
    assert th.field_positions("bf16")["exponent"] == range(7, 15)
    assert th.field_positions("fp16")["exponent"] == range(10, 15)
    assert th.protected_positions("fp32", ["sign", "exponent"]) == frozenset(range(23, 32))
    assert th.protected_positions("fp16", ["sign", 3]) == frozenset({15, 3})
    rates = th.bit_error_rates(1e-4, "bf16", ["sign", "exponent"], 1e-6)
    assert list(rates) == [1e-4] * 7 + [1e-6] * 9
    with pytest.raises(ValueError):
        th.protected_positions("bf16", [16])
    with pytest.raises(ValueError):
        th.protected_positions("fp32", ["exponant"])


def test_flip_wire_matches_torch():
    torch = pytest.importorskip("torch")
    vals = np.concatenate([th.typical_gradient_values(256, 1e-3), th.typical_activation_values(256), [0.0, 1.0, 3.0]])
    for dtype, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        t = torch.tensor(vals, dtype=torch.float32).to(tdt)
        assert np.array_equal(th.to_wire(vals, dtype), t.float().numpy().astype(np.float64))
        for k in range(16):
            words = t.view(torch.int16) ^ (1 << k if k < 15 else -(1 << 15))
            with np.errstate(invalid="ignore"):
                want = words.view(tdt).float().numpy().astype(np.float64)
            assert np.array_equal(th.flip_wire(vals, k, dtype), want, equal_nan=True), (dtype, k)
    with np.errstate(invalid="ignore"):  # flips make signalling NaNs
        assert np.array_equal(th.flip_wire(vals, 30, "fp32"), th.flip_bit(vals, 30).astype(np.float64), equal_nan=True)


def test_which_bits_lose_a_step_per_wire_dtype():
    grads = th.typical_gradient_values(median_abs=1e-3, decades=0.5)  # all |g| < 2
    for dtype in ("fp32", "bf16"):
        # only the exponent MSB makes a gradient overflow the fp32 norm (x 2^128); one bit per value
        o = th.bit_outcomes(grads, dtype)
        msb = th.field_positions(dtype)["exponent"][-1]
        assert o.bad[msb] == 1 and o.bad.sum() == pytest.approx(1, abs=1e-3) and o.nonfinite.sum() == 0
    # fp16: the exponent MSB multiplies by 2^16, bounded by 65504 below 1; values in [1, 2) become Inf/NaN
    assert np.all(np.abs(th.flip_wire(np.linspace(-0.999, 0.999, 999), 14, "fp16")) <= 65504)
    assert np.all(~np.isfinite(th.flip_wire(np.linspace(1, 1.999, 99), 14, "fp16")))
    assert th.bit_outcomes(grads, "fp16").bad.sum() < 0.01  # a gradient flip rarely reaches Inf in fp16
    acts = th.typical_activation_values()
    p_one_two = (math.erf(2 / math.sqrt(2)) - math.erf(1 / math.sqrt(2)))
    assert th.bit_outcomes(acts, "fp16").nonfinite[14] == pytest.approx(p_one_two, rel=0.02)


def test_lost_steps_are_the_union_over_ranks_and_hops_monte_carlo():
    # element-level ring (gloo's order): every value crossing a hop is catastrophic with probability q; a step is
    # lost when any rank's gradient holds one (the ranks agree to skip), the sanitizer zeroes each in every rank
    n_ranks, chunk, trials = 3, 20, 3000
    n = n_ranks * chunk
    crossings = th.wire_values_per_step("ddp", n_ranks, n)["gradient"]
    assert crossings == 2 * (n_ranks - 1) * n
    q = 1.0 / crossings  # lambda = 1
    lost, sanitized = 0, 0
    for _ in range(trials):
        wrong = simulate_ring_allreduce(n_ranks, chunk, q, RNG)
        lost += bool(wrong.any())
        sanitized += int(wrong.sum())
    # the theory with a sample whose exponent MSB is the one bad bit per value: q per value = BER
    pred = th.predict_recipe(q, "ddp", n_ranks, n_params=n, gradient_values=np.full(64, 1e-3))
    assert pred.lost == pytest.approx(1.0, rel=1e-3) and pred.p_step_lost == pytest.approx(1 - math.exp(-1), rel=1e-3)
    p = lost / trials
    assert within(p, pred.p_step_lost, std=math.sqrt(p * (1 - p) / trials))
    san = th.predict_recipe(q, "ddp", n_ranks, n_params=n, guard="sanitize", gradient_values=np.full(64, 1e-3))
    assert san.p_step_lost == 0 and san.sanitized_per_step == pytest.approx(1.5 * n_ranks * (n_ranks - 1) * n * q)
    assert within(sanitized / trials, san.sanitized_per_step, std=math.sqrt(san.sanitized_per_step * 3 / trials))


def test_predict_recipe_known_numbers():
    tiny = th.param_count("tiny")
    kw = dict(n_params="tiny", steps=40)
    ddp = th.predict_recipe(1e-6, "ddp", 2, **kw)
    # science.md: tiny model on 2 ranks at 1e-6: lambda ~ 0.47, 38 % of the steps lost (the demo measured 36 %)
    assert ddp.lost == pytest.approx(2 * tiny * 1e-6, rel=1e-3) and ddp.p_step_lost == pytest.approx(0.378, abs=0.002)
    assert ddp.flips_per_step == pytest.approx(2 * tiny * 32 * 1e-6)
    # bf16 halves the flips, not the catastrophic values: one exponent MSB per value either way
    bf16 = th.predict_recipe(1e-6, "ddp", 2, wire_dtype="bf16", **kw)
    assert bf16.lost == pytest.approx(ddp.lost, rel=1e-3)
    assert bf16.flips_per_step == pytest.approx(ddp.flips_per_step / 2)
    # sign and exponent protected: nothing catastrophic from the link but at the protected bits' residual rate
    prot = dict(protect=["sign", "exponent"], **kw)
    assert th.predict_recipe(1e-3, "ddp", 2, **prot).lost == 0
    residual = th.predict_recipe(1e-3, "ddp", 2, protected_ber=1e-7, **prot)
    assert residual.lost == pytest.approx(2 * tiny * 1e-7, rel=1e-3)
    # guards: none skips nothing (norm clipping still zeroes the step); sanitize zeroes 1.5 values per hit (N = 2)
    none = th.predict_recipe(1e-6, "ddp", 2, guard="none", **kw)
    assert none.p_step_skipped == 0 and none.p_step_lost == ddp.p_step_lost and none.frozen_fraction is None
    san = th.predict_recipe(1e-6, "ddp", 2, guard="sanitize", **kw)
    assert san.p_step_lost == 0 and san.sanitized_per_step == pytest.approx(1.5 * ddp.lost, rel=0.01)  # + x2^16 > 1e3
    stop = th.predict_recipe(1e-6, "ddp", 2, guard="stop", **kw)
    assert stop.p_run_completes == pytest.approx(math.exp(-ddp.lost * 40))
    # PP: activations forward and gradients backward at each boundary
    pp = th.predict_recipe(1e-6, "pp", 4, batch_size=16, seq_len=64, width=64, steps=40)
    assert pp.values_per_step == 2 * 3 * 16 * 64 * 64
    assert pp.lost == pytest.approx(pp.values_per_step * 1e-6, rel=0.05) and 0 < pp.lost_forward < pp.lost
    with pytest.raises(ValueError):
        th.predict_recipe(1e-6, "ddp", 2, guard="ignore", **kw)


def test_pp_next_stage_contains_a_huge_finite_activation_but_not_an_inf():
    """The mechanism behind the report's backward-only PP prediction (docs/theory.md, section 4), on the project's
    own GPT-2 split in two stages: an exponent-MSB flip of a boundary activation below 1 (a huge finite value)
    leaves the next stage's loss and every gradient finite, because each use of the residual stream goes through
    a pre-LayerNorm whose variance overflows; an Inf or NaN (the same flip of a value in [1, 2)) makes the loss NaN. The
    same flip of an activation gradient going backward makes the previous stage's gradient norm non-finite."""
    torch = pytest.importorskip("torch")
    from testbed.train.model import build_model
    from testbed.train.stages import split_stages

    first, last = split_stages(build_model("tiny", 1), 2)
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    h = first(idx).detach()

    def run(received):
        x = received.clone().requires_grad_(True)
        last.zero_grad()
        loss = torch.nn.functional.cross_entropy(last(x).flatten(0, 1), idx.flatten())
        loss.backward()
        grads = [p.grad for p in last.parameters() if p.grad is not None] + [x.grad]
        return loss, all(bool(torch.isfinite(g).all()) for g in grads)

    clean, ok = run(h)
    assert math.isfinite(clean.item()) and ok
    small = ((h[0, 3].abs() - 0.5).abs()).argmin().item()  # |x| near 0.5: the MSB flip multiplies by 2^128
    big = h.clone()
    big[0, 3, small] = float(th.flip_wire(np.array([h[0, 3, small].item()], dtype=np.float32), 30)[0])
    assert math.isfinite(big[0, 3, small].item()) and abs(big[0, 3, small].item()) > 1e30
    loss, ok = run(big)
    assert math.isfinite(loss.item()) and ok
    inf = h.clone()
    inf[0, 3, small] = float(th.flip_wire(np.array([1.5], dtype=np.float32), 30)[0])  # NaN (mantissa not 0)
    assert not math.isfinite(inf[0, 3, small].item())
    loss, _ = run(inf)
    assert not math.isfinite(loss.item())
    # backward: a huge activation gradient reaching the first stage overflows its weight gradients' norm
    out = first(idx)
    g = torch.full_like(out, 1e-3)
    g[0, 3, 0] = float(th.flip_wire(np.array([1e-3], dtype=np.float32), 30)[0])
    first.zero_grad()
    out.backward(g)
    norm = torch.nn.utils.get_total_norm([p.grad for p in first.parameters() if p.grad is not None])
    assert not math.isfinite(norm.item())


def test_frozen_fraction_matches_the_estimate_and_monte_carlo():
    # AdamW, guard none, no clipping: every catastrophic error reaching a rank's gradient freezes its element;
    # 1.5 (N-1) b n per step and rank -> 1 - exp(-1.5 (N-1) b K) (science.md: 0.13 %, 1.3 %, 12.6 %)
    for ber, expected in ((1e-6, 0.0013), (1e-5, 0.013), (1e-4, 0.126)):
        f = th.predict_recipe(ber, "ddp", 4, n_params="gpt2-124m", guard="none", clip="none", steps=300).frozen_fraction
        assert f == pytest.approx(1 - math.exp(-1.5 * 3 * ber * 300), rel=0.01)
        assert f == pytest.approx(expected, rel=0.05)
    # distinct elements hit by Poisson(h n) uniform hits per step over K steps
    n, h, steps = 20_000, 2e-4, 300
    hit = np.zeros(n, dtype=bool)
    for _ in range(steps):
        hit[RNG.integers(0, n, RNG.poisson(h * n))] = True
    assert within(hit.sum(), n * float(th.frozen_fraction(h, steps)))
    # with norm clipping an overflowing norm zeroes the gradient instead: nothing freezes
    assert th.predict_recipe(1e-4, "ddp", 4, n_params="tiny", guard="none").frozen_fraction is None


def test_mantissa_noise_bound_exact_and_monte_carlo():
    b = 1e-2
    for dtype in ("fp32", "bf16", "fp16"):
        rates = th.bit_error_rates(b, dtype, ["sign", "exponent"])
        # equality for x = +-2^E (f = 0): b sum_k 4^(k-m) = b (1 - 4^-m) / 3
        powers = np.array([0.25, 0.5, 1.0, -2.0])
        assert float(rates @ th.bit_outcomes(powers, dtype).rel_sq) == pytest.approx(th.mantissa_noise_bound(b, dtype))
        # log-uniform magnitudes: below the bound, and E[(1+f)^-2] = 3 / (8 ln 2) times it
        vals = (10.0 ** RNG.uniform(-3, 0, 20_000)).astype(np.float32)
        got = float(rates @ th.bit_outcomes(vals, dtype).rel_sq)
        assert got <= th.mantissa_noise_bound(b, dtype) and got == pytest.approx(
            th.mantissa_noise_bound(b, dtype) * 3 / (8 * math.log(2)), rel=0.03)
    # Monte Carlo: independent flips of the 23 fp32 mantissa bits with probability b
    vals = (10.0 ** RNG.uniform(-3, 0, 200_000)).astype(np.float32)
    flips = RNG.random((vals.size, 23)) < b
    words = vals.view(np.uint32) ^ (flips * (1 << np.arange(23, dtype=np.uint32))).sum(axis=1).astype(np.uint32)
    rel_sq = ((words.view(np.float32).astype(np.float64) - vals) / vals) ** 2
    expected = float(th.bit_error_rates(b, "fp32", ["sign", "exponent"]) @ th.bit_outcomes(vals, "fp32").rel_sq)
    assert within(rel_sq.mean(), expected, std=rel_sq.std() / math.sqrt(vals.size))
    # the deviation from bounded noise grows as sqrt(BER)
    devs = [th.predict_recipe(x, "ddp", 2, n_params="tiny", protect=["sign", "exponent"]).noise_deviation
            for x in (1e-6, 1e-4)]
    assert math.log10(devs[1] / devs[0]) == pytest.approx(1.0)  # two decades of BER, one of deviation
