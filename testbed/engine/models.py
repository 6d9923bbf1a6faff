"""Seeded, reproducible bit error models, independent of packets.

Every model is a *sequential stream*: ``flips(n_bits)`` returns the sorted positions, in ``[0, n_bits)``, of
the bits that flip among the next ``n_bits`` bits of the stream; the model's state (RNG, position, burst
state) carries over between calls. ``set_ber(x)`` changes the (mean) bit error rate from the current stream
position on.

Cost grows with the number of errors, not with the number of bits: gaps between errors are drawn as
geometric variables in vectorized chunks, so a call that contains no error is one integer comparison.

Determinism: the same seed and the same sequence of requests give identical flips. Between two
``set_ber`` calls the flips do not even depend on how the stream is cut into requests (``flips(a)`` then
``flips(b)`` equals ``flips(a + b)`` split at ``a``), because every gap is one draw from the RNG in stream
order.

``skip(n_bits)`` advances the stream by ``n_bits`` without materialising their flips, at a cost that does not
depend on ``n_bits``. The flips after a skip have the same distribution as after ``flips(n_bits)`` (the models
are Markov: Bernoulli gaps are memoryless, the Gilbert-Elliott state is drawn from its n-step transition), but
they are not the same draws.

``OffsetKeyedFlips`` makes flips a deterministic function of (seed, flow key, stream bit offset) for one
direction of a TCP flow, so that a retransmitted byte range gets exactly the flips it got the first time.
The error models and their config are described in docs/engine.md ("Error models").
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import NamedTuple, Protocol

import numpy as np

from testbed.engine import counterflips

__all__ = [
    "BitErrorModel",
    "TAG_LINK",
    "TAG_FLOW",
    "BernoulliModel",
    "GilbertElliottModel",
    "CodewordModel",
    "OffsetKeyedFlips",
    "FlipRange",
    "CounterModel",
    "make_rng",
    "build_model",
    "profile_action",
    "validate_error_model",
]

EMPTY = np.empty(0, dtype=np.int64)
EMPTY.flags.writeable = False
_NEVER = 1 << 62  # "no error ahead": larger than any stream position we will ever reach
_MAX_CHUNK = 1 << 20  # gaps drawn per RNG call at most (bounds memory at high BER)
# Gaps drawn per RNG call at least: a numpy call costs ~10 us however few values it draws, but a model per
# TCP flow must stay small for flows that carry little. Start small, double per refill, up to _MIN_CHUNK_MAX.
_MIN_CHUNK_START = 64
_MIN_CHUNK_MAX = 4096


# What a model's seed is mixed with (``build_model(..., seed, tag, generation, *flow)``): the direction's
# packet-order model, or a flow's offset-keyed one. The bpf engine derives its keys from the same tags.
TAG_LINK = 1
TAG_FLOW = 2


def make_rng(seed: int, *key: int) -> np.random.Generator:
    """A PCG64 generator for ``seed`` and an optional key of non-negative ints (flow key, purpose tag).

    SeedSequence mixes the words, so (seed, key) pairs that differ in any word give independent streams.
    """
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), *map(int, key)])))


def _check_probability(name: str, x: float) -> float:
    x = float(x)
    if not (0.0 <= x <= 1.0) or math.isnan(x):
        raise ValueError(f"{name} must be a probability in [0, 1], got {x}")
    return x


class BitErrorModel(Protocol):
    """What the engine needs from a model."""

    ber: float  # configured (mean) bit error rate
    position: int  # bits consumed so far

    def flips(self, n_bits: int) -> np.ndarray: ...

    def skip(self, n_bits: int) -> None: ...

    def set_ber(self, ber: float) -> None: ...


class BernoulliModel:
    """Independent bit errors: each bit of the stream flips with probability ``ber``.

    The distance from one error to the next is Geometric(ber); the model keeps a buffer of upcoming error
    positions drawn in chunks sized to the expected number of errors of the request.
    """

    __slots__ = ("_rng", "_ber", "position", "_buf", "_i", "_next", "_last", "_chunk")

    def __init__(self, ber: float, seed: int = 0, *, rng: np.random.Generator | None = None):
        self._rng = rng if rng is not None else make_rng(seed)
        self.position = 0
        self._ber = 0.0
        self._chunk = _MIN_CHUNK_START
        self.set_ber(ber)

    @property
    def ber(self) -> float:
        return self._ber

    def set_ber(self, ber: float) -> None:
        """New error rate from the current position on (errors already drawn beyond it are discarded: by
        memorylessness the next error is again Geometric(ber) bits away)."""
        self._ber = _check_probability("ber", ber)
        self._buf = EMPTY
        self._i = 0
        self._last = self.position - 1  # position of the last error drawn (or just before the stream)
        self._next = _NEVER
        if self._ber > 0.0:
            self._extend(self.position + 1)

    def _extend(self, until: int) -> None:
        """Draw gaps until the buffer holds an error at a position >= ``until``."""
        p = self._ber
        parts = [self._buf[self._i:]]
        last = self._last
        while last < until:
            expected = (until - last) * p
            k = int(min(_MAX_CHUNK, max(self._chunk, expected + 4.0 * math.sqrt(expected) + 16.0)))
            if self._chunk < _MIN_CHUNK_MAX:
                self._chunk *= 2
            pos = np.cumsum(self._rng.geometric(p, size=k))
            pos += last
            parts.append(pos)
            last = int(pos[-1])
        self._buf = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._i = 0
        self._last = last
        self._next = int(self._buf[0])

    def skip(self, n_bits: int) -> None:
        """Advance by ``n_bits`` without returning their flips; O(1) in ``n_bits``. While the buffer reaches
        past the skipped stretch this is exactly ``flips(n_bits)`` with the result dropped; beyond it the next
        error is drawn afresh from the new position (memoryless: the same distribution, other draws)."""
        end = self.position + n_bits
        self.position = end
        if self._next >= end:  # no error in the stretch (or none at all: ber 0)
            return
        if self._last >= end:  # the buffer already reaches past it: drop the errors inside
            j = int(np.searchsorted(self._buf, end, side="left"))
            self._i = j
            self._next = int(self._buf[j])
            return
        self.set_ber(self._ber)  # redraw from the new position

    def flips(self, n_bits: int) -> np.ndarray:
        start = self.position
        end = start + n_bits
        self.position = end
        if self._next >= end:  # hot path: no error in this request
            return EMPTY
        if self._last < end:
            self._extend(end)
        buf = self._buf
        i = self._i
        j = int(np.searchsorted(buf, end, side="left"))  # buf[j] >= end exists: _extend guarantees it
        out = buf[i:j] - start
        self._i = j
        self._next = int(buf[j])
        return out

    def __repr__(self) -> str:
        return f"BernoulliModel(ber={self._ber:g}, position={self.position})"


class GilbertElliottModel:
    """Two-state (Gilbert-Elliott) burst error model.

    Parametrization (all lengths in bits):

    - In the *bad* state each bit flips with probability ``bad_ber`` (default 0.5: a burst scrambles about
      half its bits), in the *good* state with ``good_ber`` (default 0).
    - ``burst_length`` is the mean sojourn in the bad state: after each bad bit the chain leaves the bad
      state with probability ``p_bg = 1 / burst_length``, so sojourns are Geometric(p_bg), mean
      ``burst_length``.
    - The stationary share of bad bits ``pi_b`` is chosen so that the mean BER equals ``mean_ber``:
      ``pi_b * bad_ber + (1 - pi_b) * good_ber = mean_ber``, i.e.
      ``pi_b = (mean_ber - good_ber) / (bad_ber - good_ber)``.
    - The good -> bad probability follows from stationarity ``pi_b = p_gb / (p_gb + p_bg)``:
      ``p_gb = p_bg * pi_b / (1 - pi_b)``; the mean good sojourn is ``1 / p_gb`` bits.

    Valid when ``0 <= good_ber <= mean_ber < bad_ber <= 1``, ``burst_length >= 1`` and ``p_gb <= 1``
    (i.e. ``mean_ber`` not so close to ``bad_ber`` that good sojourns would be shorter than one bit).
    ``mean_ber == good_ber`` means the chain never enters the bad state.

    The chain starts in its stationary distribution, so the expected BER is ``mean_ber`` from bit 0.
    Errors are drawn per sojourn with a ``BernoulliModel`` per state, so the cost grows with the number of
    errors and bursts, not bits. ``bad_sojourns``/``bad_sojourn_bits`` count completed bad sojourns (for
    checking the burst length statistically).
    """

    __slots__ = (
        "_mean_ber", "burst_length", "bad_ber", "good_ber", "p_gb", "p_bg", "pi_bad",
        "_rng", "_streams", "_state", "_sojourn_start", "_sojourn_end", "position",
        "_lengths", "_li", "bad_sojourns", "bad_sojourn_bits",
    )

    GOOD, BAD = 0, 1

    def __init__(self, mean_ber: float, burst_length: float, bad_ber: float = 0.5, good_ber: float = 0.0,
                 seed: int = 0, *, rng: np.random.Generator | None = None):
        rng = rng if rng is not None else make_rng(seed)
        # Independent child streams: sojourn lengths, errors in good state, errors in bad state.
        children = rng.bit_generator.seed_seq.spawn(3) if hasattr(rng.bit_generator, "seed_seq") else None
        if children is None:  # pragma: no cover - PCG64 always has a seed_seq
            raise ValueError("rng must come from a SeedSequence")
        self._rng = np.random.Generator(np.random.PCG64(children[0]))
        self.burst_length, self.bad_ber, self.good_ber, self._mean_ber = self._validate(
            mean_ber, burst_length, bad_ber, good_ber)
        self._streams = (
            BernoulliModel(self.good_ber, rng=np.random.Generator(np.random.PCG64(children[1]))),
            BernoulliModel(self.bad_ber, rng=np.random.Generator(np.random.PCG64(children[2]))),
        )
        self._derive()
        self.position = 0
        self.bad_sojourns = 0
        self.bad_sojourn_bits = 0
        self._lengths = {self.GOOD: EMPTY, self.BAD: EMPTY}
        self._li = {self.GOOD: 0, self.BAD: 0}
        # Stationary start; the residual sojourn of a geometric sojourn is again geometric (memoryless).
        self._state = self.BAD if self._rng.random() < self.pi_bad else self.GOOD
        self._sojourn_start = 0
        self._sojourn_end = self._draw_length(self._state)

    @staticmethod
    def _validate(mean_ber, burst_length, bad_ber, good_ber):
        mean_ber = _check_probability("mean_ber", mean_ber)
        bad_ber = _check_probability("bad_ber", bad_ber)
        good_ber = _check_probability("good_ber", good_ber)
        burst_length = float(burst_length)
        if not (burst_length >= 1.0) or math.isinf(burst_length):
            raise ValueError(f"burst_length is the mean bad-state sojourn in bits and must be a finite number "
                             f">= 1, got {burst_length}")
        if not good_ber < bad_ber:
            raise ValueError(f"gilbert_elliott needs good_ber < bad_ber, got good_ber={good_ber}, bad_ber={bad_ber}")
        if not (good_ber <= mean_ber < bad_ber):
            raise ValueError(f"gilbert_elliott needs good_ber <= mean_ber < bad_ber, got mean_ber={mean_ber}, "
                             f"good_ber={good_ber}, bad_ber={bad_ber}")
        pi_bad = (mean_ber - good_ber) / (bad_ber - good_ber)
        p_gb = (1.0 / burst_length) * pi_bad / (1.0 - pi_bad)
        if p_gb > 1.0:
            raise ValueError(f"gilbert_elliott: mean_ber={mean_ber} is too close to bad_ber={bad_ber} for "
                             f"burst_length={burst_length} (the good state would last less than one bit: "
                             f"p_gb={p_gb:.3g} > 1); lower mean_ber or raise bad_ber/burst_length")
        return burst_length, bad_ber, good_ber, mean_ber

    def _derive(self) -> None:
        self.p_bg = 1.0 / self.burst_length
        self.pi_bad = (self._mean_ber - self.good_ber) / (self.bad_ber - self.good_ber)
        self.p_gb = self.p_bg * self.pi_bad / (1.0 - self.pi_bad)

    @property
    def ber(self) -> float:
        return self._mean_ber

    @property
    def state(self) -> int:
        return self._state

    def _draw_length(self, state: int) -> int:
        """Length of a new sojourn in ``state`` (>= 1 bit; 'never ends' for a good state with p_gb == 0)."""
        p = self.p_bg if state == self.BAD else self.p_gb
        if p <= 0.0:
            return _NEVER
        i = self._li[state]
        arr = self._lengths[state]
        if i >= arr.size:
            arr = self._rng.geometric(p, size=min(1024, max(16, 2 * arr.size)))
            self._lengths[state] = arr
            i = 0
        self._li[state] = i + 1
        return self._sojourn_start + int(arr[i])

    def set_ber(self, ber: float) -> None:
        """New mean BER from the current position on (burst_length, bad_ber, good_ber unchanged)."""
        self.set_params(mean_ber=ber)

    def set_params(self, mean_ber: float | None = None, burst_length: float | None = None,
                   bad_ber: float | None = None, good_ber: float | None = None) -> None:
        self.burst_length, self.bad_ber, self.good_ber, self._mean_ber = self._validate(
            self._mean_ber if mean_ber is None else mean_ber,
            self.burst_length if burst_length is None else burst_length,
            self.bad_ber if bad_ber is None else bad_ber,
            self.good_ber if good_ber is None else good_ber,
        )
        self._derive()
        self._streams[self.GOOD].set_ber(self.good_ber)
        self._streams[self.BAD].set_ber(self.bad_ber)
        self._lengths = {self.GOOD: EMPTY, self.BAD: EMPTY}
        self._li = {self.GOOD: 0, self.BAD: 0}
        # Memorylessness: redraw the rest of the current sojourn with the new parameters.
        self._sojourn_start = self.position
        self._sojourn_end = self._draw_length(self._state)

    def skip(self, n_bits: int) -> None:
        """Advance by ``n_bits`` without returning their flips; O(1) in ``n_bits``.

        Inside the current sojourn only that state's error stream moves on. Otherwise the chain is in the
        other state at the sojourn's end (bit ``e``), and the state at the new position ``p`` is drawn from
        the two-state chain's ``(p - e)``-step transition, ``P(bad) = pi_b + (1[bad at e] - pi_b) * lam**(p - e)``
        with ``lam = 1 - p_gb - p_bg``; a fresh sojourn (memoryless) starts at ``p``. The current bad sojourn,
        if it ends inside the skip, is counted; sojourns entirely inside it are not.
        """
        end = self.position + n_bits
        if end < self._sojourn_end:
            self._streams[self._state].skip(n_bits)
            self.position = end
            return
        if self._state == self.BAD:
            self.bad_sojourns += 1
            self.bad_sojourn_bits += self._sojourn_end - self._sojourn_start
        steps = end - self._sojourn_end
        lam = 1.0 - self.p_gb - self.p_bg
        decay = lam ** steps
        bad_at_e = 1.0 if self._state == self.GOOD else 0.0
        p_bad = self.pi_bad + (bad_at_e - self.pi_bad) * decay
        self._state = self.BAD if self._rng.random() < p_bad else self.GOOD
        self.position = end
        for stream in self._streams:  # per-state error streams: memoryless, restart where they are
            stream.set_ber(stream.ber)
        self._sojourn_start = end
        self._sojourn_end = self._draw_length(self._state)

    def flips(self, n_bits: int) -> np.ndarray:
        start = self.position
        end = start + n_bits
        if end <= self._sojourn_end:  # hot path: the request stays inside the current sojourn
            self.position = end
            return self._streams[self._state].flips(n_bits)
        parts = []
        pos = start
        while pos < end:
            seg_end = self._sojourn_end if self._sojourn_end < end else end
            f = self._streams[self._state].flips(seg_end - pos)
            if f.size:
                parts.append(f + (pos - start))
            pos = seg_end
            if pos == self._sojourn_end:
                if self._state == self.BAD:
                    self.bad_sojourns += 1
                    self.bad_sojourn_bits += self._sojourn_end - self._sojourn_start
                self._state ^= 1
                self._sojourn_start = pos
                self._sojourn_end = self._draw_length(self._state)
        self.position = end
        if not parts:
            return EMPTY
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __repr__(self) -> str:
        return (f"GilbertElliottModel(mean_ber={self._mean_ber:g}, burst_length={self.burst_length:g}, "
                f"bad_ber={self.bad_ber:g}, good_ber={self.good_ber:g}, position={self.position})")


class CodewordModel:
    """A link layer's FEC over the stream (testbed/linklayer.py): the stream is cut into codewords of k m data
    bits; each codeword fails (more than t of its n symbols err at the pre-FEC BER) independently, with
    probability P_cw, so the distance from one failed codeword to the next is Geometric(P_cw) codewords. A failed
    codeword's errors are drawn when it is reached: j ~ Binomial(n, p_s) given j > t errored symbols among its
    n (those among the k data symbols are delivered), each with b ~ Binomial(m, p) given b >= 1 wrong bits.

    ``flips(n_bits)``: the wrong data bits of failed codewords (what a decoder that passes them on delivers:
    profile ``rs544-pass``); ``failures(n_bits)``: how many failed codewords the next n_bits touch (a decoder
    that marks them makes every frame they touch be dropped: ``rs544``). Both advance the stream, as ``skip``
    does. ``codewords_failed`` counts the failed codewords reached; ``codewords`` the codewords begun."""

    __slots__ = ("profile", "_rng", "_ber", "position", "_pf", "_next", "_pattern", "_j", "_b", "codewords_failed",
                 "_counted")

    def __init__(self, ber: float, profile, seed: int = 0, *, rng: np.random.Generator | None = None):
        self.profile = profile
        self._rng = rng if rng is not None else make_rng(seed)
        self.position = 0
        self.codewords_failed = 0
        self._counted = -1  # the last failed codeword counted
        self.set_ber(ber)

    @property
    def ber(self) -> float:
        return self._ber

    @property
    def codewords(self) -> int:
        return -(-self.position // self.profile.data_bits)

    def set_ber(self, ber: float) -> None:
        """New pre-FEC BER from the codeword the stream is in on (it and later ones are drawn afresh)."""
        from testbed import linklayer

        self._ber = _check_probability("ber", ber)
        prof = self.profile
        self._pf = linklayer.codeword_failure_probability(prof, self._ber) if self._ber > 0 else 0.0
        if self._pf > 0:
            js = linklayer.failed_symbol_count_pmf(prof, self._ber)
            bs = linklayer.symbol_bit_errors_pmf(self._ber, prof.m)
            self._j = (np.array([j for j, _ in js]), np.array([w for _, w in js]))
            self._b = (np.array([b for b, _ in bs]), np.array([w for _, w in bs]))
        self._pattern = None
        self._next = self._draw_after(self.position // prof.data_bits - 1)

    def _draw_after(self, cw: int) -> int:
        """The index of the next failed codeword after codeword `cw`."""
        pf = self._pf
        if pf <= 0:
            return _NEVER
        if pf >= 1:
            return cw + 1
        gap = math.ceil(math.log1p(-self._rng.random()) / math.log1p(-pf)) if pf < 1e-12 else \
            int(self._rng.geometric(pf))
        return min(_NEVER, cw + max(1, gap))

    def _errors_of(self, cw: int) -> np.ndarray:
        """Stream positions of the wrong data bits of failed codeword `cw` (drawn once)."""
        if self._pattern is not None and self._pattern[0] == cw:
            return self._pattern[1]
        prof, rng = self.profile, self._rng
        j = int(rng.choice(self._j[0], p=self._j[1]))
        symbols = rng.choice(prof.n, size=j, replace=False)
        symbols = np.sort(symbols[symbols < prof.k])  # parity symbols are not handed up
        bits = []
        for s in symbols:
            b = int(rng.choice(self._b[0], p=self._b[1]))
            bits.append(cw * prof.data_bits + int(s) * prof.m + np.sort(rng.choice(prof.m, size=b, replace=False)))
        pos = np.concatenate(bits).astype(np.int64) if bits else EMPTY
        self._pattern = (cw, pos)
        return pos

    def _advance(self, end: int, want_flips: bool):
        """Consume the stream up to `end`: (flips in [position, end) relative to position, failed codewords
        touched)."""
        start, d = self.position, self.profile.data_bits
        out, touched = [], 0
        while self._next < _NEVER and self._next * d < end:
            cw = self._next
            if (cw + 1) * d > start:  # the failed codeword overlaps this request
                touched += 1
                if cw != self._counted:
                    self.codewords_failed += 1
                    self._counted = cw
                if want_flips:
                    e = self._errors_of(cw)
                    e = e[(e >= start) & (e < end)]
                    if e.size:
                        out.append(e - start)
            if (cw + 1) * d > end:  # it goes on past this request: keep it for the next
                break
            self._next = self._draw_after(cw)
        self.position = end
        flips = (out[0] if len(out) == 1 else np.concatenate(out)) if out else EMPTY
        return flips, touched

    def flips(self, n_bits: int) -> np.ndarray:
        return self._advance(self.position + n_bits, True)[0]

    def failures(self, n_bits: int) -> int:
        return self._advance(self.position + n_bits, False)[1]

    def skip(self, n_bits: int) -> None:
        self._advance(self.position + n_bits, False)

    def __repr__(self) -> str:
        return f"CodewordModel({self.profile.name}, ber={self._ber:g}, position={self.position})"


class CounterModel:
    """Bernoulli flips drawn by a counter-based generator (engine/counterflips.py): the flips of bit offset x are
    a pure function of (key, x), so a stream's flips depend on nothing but its identity and positions (the same
    in any engine that computes the same function; no memory of what was drawn). flips(n) and skip(n) move a
    position as the sequential models do; seek(x) sets it (OffsetKeyedFlips starts it at the flow's first keyed
    offset)."""

    __slots__ = ("_ber", "key", "pos")

    def __init__(self, ber: float, key: tuple[int, int]):
        self._ber = _check_probability("ber", ber)
        self.key = key
        self.pos = 0

    @property
    def ber(self) -> float:
        return self._ber

    def set_ber(self, ber: float) -> None:
        self._ber = _check_probability("ber", ber)

    def seek(self, pos: int) -> None:
        self.pos = int(pos)

    def flips(self, n_bits: int) -> np.ndarray:
        f = counterflips.flips_bits(self.key, self._ber, self.pos, n_bits)
        start, self.pos = self.pos, self.pos + n_bits
        return f - start if f.size else EMPTY

    def skip(self, n_bits: int) -> None:
        self.pos += int(n_bits)

    def __repr__(self) -> str:
        return f"CounterModel(ber={self._ber:g}, key={self.key})"


def validate_error_model(error_model: dict | None, ber: float) -> dict:
    """Normalize an ``error_model`` config dict (docs/engine.md, "Error models"); raise ValueError if
    invalid."""
    em = dict(error_model or {"type": "bernoulli"})
    kind = em.get("type", "bernoulli")
    em["type"] = kind
    if kind in ("bernoulli", "counter"):
        unknown = set(em) - {"type"}
        if unknown:
            raise ValueError(f"{kind} error model takes no parameters, got {sorted(unknown)}")
        _check_probability("ber", ber)
    elif kind == "gilbert_elliott":
        unknown = set(em) - {"type", "burst_length", "bad_ber", "good_ber"}
        if unknown:
            raise ValueError(f"unknown gilbert_elliott parameters {sorted(unknown)}")
        if em.get("burst_length") is None:
            raise ValueError("gilbert_elliott needs burst_length (mean burst length in bits)")
        em["burst_length"] = float(em["burst_length"])
        em["bad_ber"] = float(em.get("bad_ber", 0.5) if em.get("bad_ber") is not None else 0.5)
        em["good_ber"] = float(em.get("good_ber", 0.0) if em.get("good_ber") is not None else 0.0)
        GilbertElliottModel._validate(ber, em["burst_length"], em["bad_ber"], em["good_ber"])
    elif kind == "profile":
        from testbed import linklayer

        unknown = set(em) - {"type", "profile"}
        if unknown:
            raise ValueError(f"unknown profile error model parameters {sorted(unknown)}")
        linklayer.profile(em.get("profile"))  # a ValueError naming the known ones
        _check_probability("pre-FEC ber", ber)
    else:
        raise ValueError(f"unknown error model type {kind!r} (bernoulli, counter, gilbert_elliott, profile)")
    return em


def profile_action(error_model: dict | None) -> str | None:
    """What the engine does with a packet that holds drawn errors, beyond flipping them: "drop" (a failed
    codeword's frames, FEC with error marking), "replay" (a frame with a bit error is resent clean: link-level
    retry), None (deliver the flips: no profile, raw, or FEC that passes its failures on)."""
    if not error_model or error_model.get("type") != "profile":
        return None
    from testbed import linklayer

    prof = linklayer.profile(error_model["profile"])
    if prof.kind == "retry":
        return "replay"
    return "drop" if prof.kind == "fec" and prof.on_failure == "drop" else None


def build_model(error_model: dict | None, ber: float, seed: int, *key: int):
    """The model an ``error_model`` config dict describes, seeded by (seed, *key): Bernoulli, counter (Bernoulli
    as a pure function of position: CounterModel, keyed by ``counterflips.model_key(seed, *key)``), Gilbert-Elliott,
    or a link profile's (a CodewordModel for FEC, Bernoulli at the pre-FEC BER for raw and retry)."""
    em = validate_error_model(error_model, ber)
    if em["type"] == "counter":
        return CounterModel(ber, counterflips.model_key(seed, *key))
    rng = make_rng(seed, *key)
    if em["type"] == "bernoulli":
        return BernoulliModel(ber, rng=rng)
    if em["type"] == "profile":
        from testbed import linklayer

        prof = linklayer.profile(em["profile"])
        return CodewordModel(ber, prof, rng=rng) if prof.kind == "fec" else BernoulliModel(ber, rng=rng)
    return GilbertElliottModel(ber, em["burst_length"], em["bad_ber"], em["good_ber"], rng=rng)


def _interval_start(iv: list[int]) -> int:
    return iv[0]


def _interval_end(iv: list[int]) -> int:
    return iv[1]


class FlipRange(NamedTuple):
    """Answer of ``OffsetKeyedFlips.flips_at``."""

    positions: np.ndarray  # sorted bit positions relative to the request's start
    new_bits: int  # bits of the request seen for the first time
    new_flips: int  # flips among them
    retx_bits: int  # bits seen before (retransmitted) or too old to remember
    retx_flips: int  # flips among them (the same as the first time)


_new_flip_range = tuple.__new__  # FlipRange without its Python-level __new__ (the per-packet path builds one)


class OffsetKeyedFlips:
    """Flips of one TCP flow direction as a function of the stream bit offset.

    The underlying model is advanced strictly in stream-offset order: a request beyond the generated
    high-water mark also generates the skipped gap (out-of-order data), and generated flips are remembered
    for the last ``window_bits`` of stream (64 MiB by default; less if more than ``max_flips`` flips, 8 MB,
    would be stored: at BER 1e-2 that still covers 12 MB, more than TCP ever has in flight). A request for a
    range generated before gets exactly the same flips.

    A gap longer than what could be remembered anyway (``window_bits``, or ``max_flips / ber`` if that is
    shorter) is not generated in full: the part below it is skipped with ``model.skip`` (O(1), no flips
    materialised) and counts as forgotten if it is ever requested. So one request costs at most one window's
    flips, whatever the gap. (TCP's window keeps real out-of-order gaps far shorter; this bounds the cost
    whatever offsets come, e.g. flips started on a flow that has already carried data.)

    ``start`` (bits): the stream offset at which the flips start; bits below it count as forgotten.

    Each bit is *new* the first time it is requested and *retransmitted* after that (bits generated as part
    of a gap are new when the gap is filled). Bits older than the remembered window are reported as
    retransmitted with no flips (``forgotten_bits``): TCP never retransmits that far back in practice.
    Pruning has hysteresis: the window is trimmed back to ``window_bits`` once it exceeds it by an eighth.

    ``last_new``: after a request whose answer mixes new and retransmitted bits, the new stretches of it as
    absolute ``[start, end)`` bit ranges (for callers that classify the new flips; not set on the hot path,
    whose answer is all new).
    """

    __slots__ = (
        "model", "window_bits", "max_flips", "_prune_at", "_hw", "_floor", "_seen", "_lo", "_hi", "_arr",
        "_head", "_stored", "forgotten_bits", "last_new",
    )

    def __init__(self, model: BitErrorModel, *, start: int = 0, window_bits: int = 64 << 23,
                 max_flips: int = 1 << 20):
        self.model = model
        if hasattr(model, "seek"):  # a position-keyed model (CounterModel) starts where the flow's flips do
            model.seek(start)
        self.window_bits = int(window_bits)
        self.max_flips = int(max_flips)
        self._prune_at = self.window_bits + (self.window_bits >> 3)
        self._hw = int(start)  # model generated for [start, hw)
        self._floor = int(start)  # flips remembered for [floor, hw)
        self._seen: list[list[int]] = []  # sorted disjoint [start, end) of requested ranges within the window
        # stored non-empty flip chunks: [lo, hi) with absolute positions; entries before _head are dropped
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._arr: list[np.ndarray] = []
        self._head = 0
        self._stored = 0
        self.forgotten_bits = 0
        self.last_new: list[tuple[int, int]] = []

    def set_ber(self, ber: float) -> None:
        self.model.set_ber(ber)

    def flips_at(self, start: int, n_bits: int) -> FlipRange:
        end = start + n_bits
        hw = self._hw
        seen = self._seen
        # Hot path: in-order data continuing the stream.
        if start == hw and (not seen or seen[-1][1] == hw):
            f = self.model.flips(n_bits)
            self._hw = end
            if seen:
                seen[-1][1] = end
            else:
                seen.append([start, end])
            if f.size:
                self._store(start, end, f + start)
            if end - self._floor > self._prune_at:
                self._prune(end - self.window_bits)
            return _new_flip_range(FlipRange, (f, n_bits, f.size, 0, 0))
        return self._general(start, end)

    def _gap_horizon(self) -> int:
        """How many bits before a request's end are worth generating: what could be remembered."""
        keep = self.window_bits
        ber = self.model.ber
        if ber > 0.0 and self.max_flips / ber < keep:
            keep = int(self.max_flips / ber)
        return keep

    # -- internals ---------------------------------------------------------------------------------------------

    def _store(self, lo: int, hi: int, absolute: np.ndarray) -> None:
        self._lo.append(lo)
        self._hi.append(hi)
        self._arr.append(absolute)
        self._stored += absolute.size
        if self._stored > self.max_flips:
            # Too many flips to remember the whole window (very high BER): forget the oldest chunks.
            while self._stored > self.max_flips and self._head < len(self._arr) - 1:
                self._floor = max(self._floor, self._hi[self._head])
                self._drop_head()
            self._prune(self._floor)

    def _drop_head(self) -> None:
        self._stored -= self._arr[self._head].size
        self._arr[self._head] = EMPTY
        self._head += 1
        if self._head > 256 and self._head * 2 > len(self._arr):
            h = self._head
            del self._lo[:h], self._hi[:h], self._arr[:h]
            self._head = 0

    def _prune(self, floor: int) -> None:
        self._floor = max(self._floor, floor)
        floor = self._floor
        while self._head < len(self._hi) and self._hi[self._head] <= floor:
            self._drop_head()
        seen = self._seen
        k = 0
        while k < len(seen) and seen[k][1] <= floor:
            k += 1
        if k:
            del seen[:k]
        if seen and seen[0][0] < floor:
            seen[0][0] = floor

    def _lookup(self, a: int, b: int) -> np.ndarray:
        """Remembered absolute flip positions in [a, b)."""
        out = []
        i = max(self._head, bisect_right(self._hi, a, lo=self._head))
        while i < len(self._lo) and self._lo[i] < b:
            arr = self._arr[i]
            if arr.size:
                lo_i = np.searchsorted(arr, a, side="left")
                hi_i = np.searchsorted(arr, b, side="left")
                if hi_i > lo_i:
                    out.append(arr[lo_i:hi_i])
            i += 1
        if not out:
            return EMPTY
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _general(self, start: int, end: int) -> FlipRange:
        if end > self._hw:
            gen_from = self._hw
            skip_to = min(start, end - self._gap_horizon())
            if skip_to > gen_from:  # a gap longer than could be remembered: skip it, do not generate it
                self.model.skip(skip_to - gen_from)
                self._hw = gen_from = skip_to
                self._prune(skip_to)
            f = self.model.flips(end - gen_from)
            if f.size:
                self._store(gen_from, end, f + gen_from)
            self._hw = end
            if end - self._floor > self._prune_at:
                self._prune(end - self.window_bits)
        floor = self._floor
        positions = self._lookup(max(start, floor), end) if end > floor else EMPTY
        # Classify [start, end) into new (not requested before) and retransmitted bits.
        new_bits = new_flips = 0
        forgotten = max(0, min(end, floor) - start)
        cur = max(start, floor)
        seen = self._seen
        spans = self.last_new = []
        for k in range(bisect_right(seen, cur, key=_interval_end), len(seen)):
            s, e = seen[k]
            if s >= end:
                break
            if s > cur:  # unseen stretch [cur, s)
                nb, nf = self._count(positions, cur, min(s, end))
                new_bits += nb
                new_flips += nf
                spans.append((cur, min(s, end)))
            cur = max(cur, min(e, end))
            if cur >= end:
                break
        if cur < end:
            nb, nf = self._count(positions, cur, end)
            new_bits += nb
            new_flips += nf
            spans.append((cur, end))
        self.forgotten_bits += forgotten
        self._mark_seen(max(start, floor), end)
        n = end - start
        rel = positions - start if positions.size else EMPTY
        return _new_flip_range(FlipRange, (rel, new_bits, new_flips, n - new_bits, int(positions.size) - new_flips))

    @staticmethod
    def _count(positions: np.ndarray, a: int, b: int) -> tuple[int, int]:
        if b <= a:
            return 0, 0
        if not positions.size:
            return b - a, 0
        return b - a, int(np.searchsorted(positions, b) - np.searchsorted(positions, a))

    def _mark_seen(self, a: int, b: int) -> None:
        if b <= a:
            return
        seen = self._seen
        i = bisect_right(seen, a, key=_interval_start)
        # merge with the previous interval if it touches
        if i > 0 and seen[i - 1][1] >= a:
            i -= 1
            a = seen[i][0]
        j = i
        while j < len(seen) and seen[j][0] <= b:
            b = max(b, seen[j][1])
            j += 1
        seen[i:j] = [[a, b]]
