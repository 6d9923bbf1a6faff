"""Unit tests of the bit error models (pure logic, seeded; statistics against exact 99.9% intervals)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from testbed.engine.models import (
    BernoulliModel,
    GilbertElliottModel,
    OffsetKeyedFlips,
    build_model,
    validate_error_model,
)

ALPHA = 0.001  # every statistical check is a 99.9% interval


def binomial_interval(n: int, p: float, alpha: float = ALPHA) -> tuple[int, int]:
    """Central interval holding Binomial(n, p) with probability >= 1 - alpha."""
    return int(stats.binom.ppf(alpha / 2, n, p)), int(stats.binom.isf(alpha / 2, n, p))


def assert_count_binomial(k: int, n: int, p: float) -> None:
    lo, hi = binomial_interval(n, p)
    assert lo <= k <= hi, f"{k} errors in {n} bits: outside the 99.9% interval [{lo}, {hi}] for p={p}"


def draw(model, sizes) -> np.ndarray:
    """Absolute flip positions over consecutive requests of the given sizes."""
    out, pos = [], 0
    for n in sizes:
        f = model.flips(int(n))
        assert f.dtype == np.int64
        assert np.all(np.diff(f) > 0) and (f.size == 0 or (f[0] >= 0 and f[-1] < n))
        out.append(f + pos)
        pos += int(n)
    return np.concatenate(out) if out else np.empty(0, np.int64)


# -- Bernoulli ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ber,n_bits,seed",
                         [(1e-3, 10**7, 1), (1e-5, 10**9, 2), (1e-7, 2 * 10**10, 3), (0.3, 10**6, 4)])
def test_bernoulli_rate_in_binomial_interval(ber, n_bits, seed):
    m = BernoulliModel(ber, seed=seed)
    k = sum(m.flips(n).size for n in [n_bits // 4] * 4)
    assert m.position == n_bits // 4 * 4
    assert_count_binomial(k, n_bits // 4 * 4, ber)


def test_bernoulli_gaps_are_geometric():
    """Gaps between errors are iid Geometric(p): compare their distribution (KS on the continuous-scale
    quantiles is too strict for a discrete law, so compare the mean with its CLT interval and the
    probability of a gap of exactly 1 with its binomial interval)."""
    p = 0.01
    f = BernoulliModel(p, seed=11).flips(10**7)
    gaps = np.diff(f)
    z = stats.norm.isf(ALPHA / 2)
    sd = math.sqrt((1 - p) / p**2 / gaps.size)
    assert abs(gaps.mean() - 1 / p) <= z * sd
    assert_count_binomial(int((gaps == 1).sum()), gaps.size, p)


def test_bernoulli_does_not_depend_on_request_sizes():
    rng = np.random.default_rng(0)
    sizes_a = rng.integers(1, 20000, size=500)
    total = int(sizes_a.sum())
    sizes_b = [total // 3, total - total // 3]
    a = draw(BernoulliModel(1e-3, seed=5), sizes_a)
    b = draw(BernoulliModel(1e-3, seed=5), sizes_b)
    assert a.size > 100
    np.testing.assert_array_equal(a, b)


def test_bernoulli_seeds():
    a = BernoulliModel(1e-3, seed=1).flips(10**6)
    b = BernoulliModel(1e-3, seed=1).flips(10**6)
    c = BernoulliModel(1e-3, seed=2).flips(10**6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_bernoulli_edge_rates_and_validation():
    assert BernoulliModel(0.0, seed=1).flips(10**9).size == 0
    np.testing.assert_array_equal(BernoulliModel(1.0, seed=1).flips(100), np.arange(100))
    for bad in (-1e-9, 1.5, float("nan")):
        with pytest.raises(ValueError):
            BernoulliModel(bad)
    with pytest.raises(ValueError):
        BernoulliModel(1e-3, seed=-1)


def test_bernoulli_set_ber_applies_from_current_position():
    m = BernoulliModel(1e-5, seed=9)
    k1 = m.flips(10**8).size
    m.set_ber(1e-3)
    k2 = m.flips(10**7).size
    m.set_ber(0.0)
    assert m.flips(10**9).size == 0
    assert_count_binomial(k1, 10**8, 1e-5)
    assert_count_binomial(k2, 10**7, 1e-3)
    # same seed, same sequence of requests and changes -> same flips
    m2 = BernoulliModel(1e-5, seed=9)
    m2.flips(10**8)
    m2.set_ber(1e-3)
    assert m2.flips(10**7).size == k2


def test_bernoulli_skip_is_exact_inside_the_buffer_and_memoryless_beyond():
    # while the drawn errors reach past the skipped stretch, skip(n) == flips(n) with the result dropped
    a, b = BernoulliModel(1e-2, seed=21), BernoulliModel(1e-2, seed=21)
    a.flips(1000)
    b.flips(1000)
    a.flips(50)
    b.skip(50)
    np.testing.assert_array_equal(a.flips(100000), b.flips(100000))
    # a huge skip is O(1) (no flips drawn for it) and the rate after it is unchanged
    m = BernoulliModel(1e-3, seed=22)
    m.skip(1 << 50)
    assert m.position == 1 << 50
    assert_count_binomial(m.flips(10**7).size, 10**7, 1e-3)
    # deterministic: same seed, same requests
    m2 = BernoulliModel(1e-3, seed=22)
    m2.skip(1 << 50)
    m3 = BernoulliModel(1e-3, seed=22)
    m3.skip(1 << 50)
    np.testing.assert_array_equal(m2.flips(10**6), m3.flips(10**6))
    z = BernoulliModel(0.0, seed=1)
    z.skip(10**12)
    assert z.flips(10**6).size == 0 and z.position == 10**12 + 10**6


# -- Gilbert-Elliott ---------------------------------------------------------------------------------------------

def batch_means_interval(values: np.ndarray, alpha: float = ALPHA) -> tuple[float, float]:
    """Student-t interval for the mean of (approximately independent) batch means."""
    m = values.mean()
    half = stats.t.isf(alpha / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size)
    return m - half, m + half


@pytest.mark.parametrize("mean_ber,burst,bad,good", [(1e-3, 64.0, 0.5, 0.0), (1e-4, 16.0, 0.5, 1e-6),
                                                    (1e-2, 200.0, 0.3, 0.0)])
def test_gilbert_elliott_mean_ber_batch_means(mean_ber, burst, bad, good):
    """Errors are correlated within bursts, so the BER is checked with batch means: batches of 10^7 bits are
    hundreds of state cycles long (mean cycle = burst / pi_bad bits), hence nearly independent."""
    m = GilbertElliottModel(mean_ber, burst, bad, good, seed=21)
    cycle = burst / m.pi_bad
    batch = 10**7
    assert batch > 100 * cycle
    rates = np.array([m.flips(batch).size / batch for _ in range(200)])
    lo, hi = batch_means_interval(rates)
    assert lo <= mean_ber <= hi, f"mean BER {mean_ber} outside batch-means interval [{lo:.4g}, {hi:.4g}]"


def test_gilbert_elliott_burst_length_from_runs():
    """With bad_ber=1 and good_ber=0 every bad sojourn is a visible run of consecutive flipped bits (runs are
    separated by >= 1 good bit). Run lengths are iid Geometric(1/burst_length): mean burst_length, variance
    (1-p)/p^2. Gaps between runs have mean 1/p_gb."""
    burst = 48.0
    m = GilbertElliottModel(2e-3, burst, bad_ber=1.0, good_ber=0.0, seed=33)
    f = m.flips(10**9)
    breaks = np.flatnonzero(np.diff(f) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [f.size - 1]))
    runs = (ends - starts + 1)[1:-1]  # drop the runs cut by the stream's ends
    gaps = (f[starts[1:]] - f[ends[:-1]] - 1)
    z = stats.norm.isf(ALPHA / 2)
    p = 1 / burst
    assert runs.size > 10000
    assert abs(runs.mean() - burst) <= z * math.sqrt((1 - p) / p**2 / runs.size)
    q = m.p_gb
    assert abs(gaps.mean() - 1 / q) <= z * math.sqrt((1 - q) / q**2 / gaps.size)
    # and the model's own accounting of completed bad sojourns agrees with what the flips show
    assert m.bad_sojourns == pytest.approx(runs.size, abs=2)


def test_gilbert_elliott_sojourn_counters_with_half_bad_ber():
    burst = 100.0
    m = GilbertElliottModel(1e-3, burst, seed=5)
    m.flips(2 * 10**9)
    p = 1 / burst
    mean = m.bad_sojourn_bits / m.bad_sojourns
    z = stats.norm.isf(ALPHA / 2)
    assert abs(mean - burst) <= z * math.sqrt((1 - p) / p**2 / m.bad_sojourns)


def test_gilbert_elliott_determinism_and_chunking():
    sizes = np.random.default_rng(1).integers(1, 100000, size=2000)
    a = draw(GilbertElliottModel(1e-3, 64, seed=7), sizes)
    b = draw(GilbertElliottModel(1e-3, 64, seed=7), [int(sizes.sum())])
    c = draw(GilbertElliottModel(1e-3, 64, seed=8), [int(sizes.sum())])
    assert a.size > 1000
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_gilbert_elliott_set_ber():
    m = GilbertElliottModel(1e-4, 32, seed=3)
    m.flips(10**8)
    m.set_ber(1e-2)
    rates = np.array([m.flips(10**6).size / 10**6 for _ in range(300)])
    lo, hi = batch_means_interval(rates)
    assert lo <= 1e-2 <= hi
    m.set_ber(0.0)  # a running burst finishes (mean 32 bits), then the chain stays good for ever
    m.flips(10**4)
    assert m.state == m.GOOD and m.flips(10**8).size == 0


def test_gilbert_elliott_skip_follows_the_chain():
    """After skip(n), P(bad | state before) is the chain's n-step transition pi_b + (1[bad] - pi_b) * lam**n
    (checked per start state over many seeds); a huge skip costs O(1) and leaves the mean BER."""
    mean, burst, bad = 0.2, 8.0, 0.5  # pi_b = 0.4, p_bg = 1/8, p_gb = 1/12: lam = 0.79
    for n in (1, 5, 30):
        counts = {0: [0, 0], 1: [0, 0]}  # start state -> [trials, bad after]
        for seed in range(3000):
            m = GilbertElliottModel(mean, burst, bad, seed=seed)
            s0 = m.state
            m.skip(n)
            counts[s0][0] += 1
            counts[s0][1] += m.state == GilbertElliottModel.BAD
        pi_b, lam = m.pi_bad, 1.0 - m.p_gb - m.p_bg
        for s0, (trials, bad_after) in counts.items():
            assert_count_binomial(bad_after, trials, pi_b + ((s0 == 1) - pi_b) * lam**n)
    m = GilbertElliottModel(1e-3, 64.0, seed=5)
    m.skip(1 << 50)
    assert m.position == 1 << 50
    lo, hi = batch_means_interval(np.array([m.flips(10**7).size / 1e7 for _ in range(40)]))
    assert lo <= 1e-3 <= hi


@pytest.mark.parametrize("kw,match", [
    (dict(mean_ber=1e-3, burst_length=0.5), "burst_length"),
    (dict(mean_ber=0.6, burst_length=10), "mean_ber < bad_ber"),
    (dict(mean_ber=1e-3, burst_length=10, good_ber=1e-2), "good_ber <= mean_ber"),
    (dict(mean_ber=0.45, burst_length=1.0), "too close"),
    (dict(mean_ber=1e-3, burst_length=10, bad_ber=0.0), "good_ber < bad_ber"),
    (dict(mean_ber=-1, burst_length=10), "probability"),
    (dict(mean_ber=1e-3, burst_length=float("inf")), "burst_length"),
])
def test_gilbert_elliott_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        GilbertElliottModel(seed=0, **kw)


def test_gilbert_elliott_derived_parameters():
    m = GilbertElliottModel(1e-3, 64, bad_ber=0.5, good_ber=0.0, seed=0)
    assert m.p_bg == pytest.approx(1 / 64)
    assert m.pi_bad == pytest.approx(2e-3)
    assert m.p_gb == pytest.approx((1 / 64) * 2e-3 / (1 - 2e-3))
    assert m.pi_bad * m.bad_ber + (1 - m.pi_bad) * m.good_ber == pytest.approx(1e-3)


def test_error_model_config():
    assert validate_error_model(None, 1e-3) == {"type": "bernoulli"}
    em = validate_error_model({"type": "gilbert_elliott", "burst_length": 64}, 1e-4)
    assert em == {"type": "gilbert_elliott", "burst_length": 64.0, "bad_ber": 0.5, "good_ber": 0.0}
    with pytest.raises(ValueError, match="burst_length"):
        validate_error_model({"type": "gilbert_elliott"}, 1e-4)
    with pytest.raises(ValueError, match="unknown error model"):
        validate_error_model({"type": "gauss"}, 1e-4)
    with pytest.raises(ValueError):
        validate_error_model({"type": "bernoulli", "burst_length": 3}, 1e-4)
    a = build_model(em, 1e-4, 5, 1, 2).flips(10**7)
    b = build_model(em, 1e-4, 5, 1, 2).flips(10**7)
    c = build_model(em, 1e-4, 5, 1, 3).flips(10**7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


# -- offset-keyed flips ------------------------------------------------------------------------------------------

def okf(seed=1, ber=1e-3, **kw):
    return OffsetKeyedFlips(BernoulliModel(ber, seed=seed), **kw)


def test_retransmitted_range_gets_the_same_flips():
    o = okf()
    first = [o.flips_at(off, 12000) for off in range(0, 120000, 12000)]
    whole = np.concatenate([r.positions + i * 12000 for i, r in enumerate(first)])
    assert sum(r.new_flips for r in first) == whole.size > 50
    # retransmit a range that straddles two original segments, and one that extends past the high-water mark
    r = o.flips_at(30000, 20000)
    np.testing.assert_array_equal(r.positions + 30000, whole[(whole >= 30000) & (whole < 50000)])
    assert (r.new_bits, r.new_flips, r.retx_bits) == (0, 0, 20000)
    assert r.retx_flips == r.positions.size
    r2 = o.flips_at(110000, 20000)
    assert r2.retx_bits == 10000 and r2.new_bits == 10000
    again = o.flips_at(110000, 20000)
    np.testing.assert_array_equal(again.positions, r2.positions)
    assert again.new_bits == 0


def test_offset_keyed_flips_do_not_depend_on_segmentation_or_order():
    """The flips of a byte range are a function of (seed, key, offset): different segmentations, and
    out-of-order arrival (a gap generated when skipped, filled later), give the same flips."""
    total = 2_000_000
    rng = np.random.default_rng(3)
    cuts = np.sort(rng.choice(np.arange(1, total), size=300, replace=False))
    bounds = np.concatenate(([0], cuts, [total]))
    a = okf(seed=4)
    pa = np.concatenate([a.flips_at(int(s), int(e - s)).positions + s for s, e in zip(bounds[:-1], bounds[1:])])
    # b: second half first, then the first half (the first half is generated as a gap)
    b = okf(seed=4)
    r2 = b.flips_at(total // 2, total - total // 2)
    r1 = b.flips_at(0, total // 2)
    pb = np.concatenate([r1.positions, r2.positions + total // 2])
    np.testing.assert_array_equal(pa, pb)
    # filling the gap is first-time data, not a retransmission
    assert r1.new_bits == total // 2 and r1.retx_bits == 0
    assert r1.new_flips + r2.new_flips == pa.size
    assert_count_binomial(pa.size, total, 1e-3)


def test_offset_keyed_counts_each_bit_once():
    o = okf(seed=8)
    seen = flipped = 0
    rng = np.random.default_rng(8)
    hw = 0
    for _ in range(3000):
        if hw and rng.random() < 0.2:  # retransmission of something recent
            start = int(rng.integers(max(0, hw - 50000), hw))
        else:
            start = hw
        n = int(rng.integers(1, 12000))
        r = o.flips_at(start, n)
        assert r.new_bits + r.retx_bits == n
        seen += r.new_bits
        flipped += r.new_flips
        hw = max(hw, start + n)
    assert seen == hw
    ref = okf(seed=8).flips_at(0, hw)
    assert flipped == ref.positions.size


def test_offset_keyed_window_forgets_old_ranges():
    o = okf(ber=1e-2, window_bits=100000)
    o.flips_at(0, 500000)
    r = o.flips_at(0, 1000)  # far behind the window
    assert r.positions.size == 0 and r.retx_bits == 1000 and r.new_bits == 0
    assert o.forgotten_bits == 1000
    recent = o.flips_at(450000, 50000)
    assert recent.retx_bits == 50000 and recent.positions.size > 0


def test_offset_keyed_flip_memory_is_bounded():
    o = okf(ber=0.5, max_flips=10000)
    for off in range(0, 400000, 10000):
        o.flips_at(off, 10000)
    assert o._stored <= 10000 + 10000  # at most the cap plus the newest chunk
    r = o.flips_at(0, 10000)
    assert r.positions.size == 0 and o.forgotten_bits == 10000


def test_offset_keyed_seeds_and_keys():
    a = OffsetKeyedFlips(build_model(None, 1e-3, 1, 2, 0, 10, 20, 30)).flips_at(0, 10**6).positions
    b = OffsetKeyedFlips(build_model(None, 1e-3, 1, 2, 0, 10, 20, 30)).flips_at(0, 10**6).positions
    c = OffsetKeyedFlips(build_model(None, 1e-3, 1, 2, 0, 10, 20, 31)).flips_at(0, 10**6).positions
    d = OffsetKeyedFlips(build_model(None, 1e-3, 2, 2, 0, 10, 20, 30)).flips_at(0, 10**6).positions
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, d)


class CountingModel:
    """A model wrapper that counts the flips it materialises and the bits it skips."""

    def __init__(self, model):
        self.model = model
        self.materialised = 0
        self.skipped = 0

    @property
    def ber(self):
        return self.model.ber

    @property
    def position(self):
        return self.model.position

    def flips(self, n):
        f = self.model.flips(n)
        self.materialised += f.size
        return f

    def skip(self, n):
        self.skipped += n
        self.model.skip(n)

    def set_ber(self, ber):
        self.model.set_ber(ber)


@pytest.mark.parametrize("model", [BernoulliModel(1e-3, seed=30), GilbertElliottModel(1e-3, 64.0, seed=31)],
                         ids=["bernoulli", "gilbert_elliott"])
def test_offset_keyed_huge_gap_is_cheap(model):
    """A request far beyond the generated stream (1.5 GB, then 2**44 bits) generates only the last window
    before it: the flips materialised do not grow with the gap; the part below is skipped and forgotten."""
    window = 8 << 20
    m = CountingModel(model)
    o = OffsetKeyedFlips(m, window_bits=window)
    o.flips_at(0, 12000)
    bound = 2 * window * 1e-3 + 1000  # generous: one window of flips (bursty for Gilbert-Elliott)
    for gap_end in (12 * 10**9, 1 << 44):
        before = m.materialised
        r = o.flips_at(gap_end, 96000)
        assert m.position == gap_end + 96000
        assert m.materialised - before <= bound
        assert o._stored <= bound and o._hw == gap_end + 96000
        assert r.new_bits == 96000 and r.retx_bits == 0
        # inside the generated window: filled first time, and the same flips when requested again
        a = o.flips_at(gap_end - 50000, 50000)
        assert a.new_bits == 50000
        np.testing.assert_array_equal(o.flips_at(gap_end - 50000, 50000).positions, a.positions)
        # below it: skipped, never generated, counted as forgotten
        f0 = o.forgotten_bits
        old = o.flips_at(gap_end - 2 * window, 1000)
        assert old.positions.size == 0 and old.new_bits == 0 and o.forgotten_bits == f0 + 1000
    assert m.skipped >= (1 << 44) - 12 * 10**9 - 2 * window


def test_offset_keyed_gap_horizon_follows_the_flip_cap():
    """At a high BER the gap is generated only as far back as max_flips flips could be remembered."""
    m = CountingModel(BernoulliModel(0.1, seed=32))
    o = OffsetKeyedFlips(m, max_flips=10000)
    o.flips_at(1 << 40, 8000)
    assert m.materialised <= 10000 + 2000 and m.skipped >= (1 << 40) - 100000


def test_offset_keyed_start_and_prune_hysteresis():
    o = okf(ber=1e-2, start=80000, window_bits=80000)
    r = o.flips_at(0, 1000)  # below the start: forgotten
    assert r.positions.size == 0 and o.forgotten_bits == 1000
    r = o.flips_at(80000, 8000)  # the start: the in-order path, like offset 0 of a fresh stream
    assert r.new_bits == 8000 and o._hw == 88000
    ref = okf(ber=1e-2, window_bits=80000).flips_at(0, 8000)
    np.testing.assert_array_equal(r.positions, ref.positions)  # the same model stream, shifted
    # pruned only when the window is exceeded by an eighth, then back to window_bits
    end = 88000
    while o._floor == 80000:
        span = end - o._floor
        o.flips_at(end, 1000)
        end += 1000
    assert span <= 80000 + 10000 < end - 80000 and o._floor == end - 80000
