"""Link layers between a physical link's pre-FEC bit errors and what reaches the application: the profile table,
the codeword model's closed forms and each profile's added latency (docs/theory.md, "Link layers"; every constant's
source: docs/linklayer-sources.md).

A link (or one direction) says `profile: rs544` and `pre_fec_ber: 1e-4` instead of `ber:`. The engine then draws
bit errors at the pre-FEC BER and applies the profile (testbed/engine/models.py CodewordModel; the NFQUEUE engine):

- `none`: no FEC, no retry: the raw BER is delivered.
- `rs544`, `rs528`, `rs272`: Reed-Solomon RS(n, k) over m = 10-bit symbols, correcting t symbols per codeword. The
  stream is cut into codewords of k data symbols; a codeword's symbol errors are Binomial(n, p_s) with
  p_s = 1 - (1 - p)^m. At most t: corrected, nothing delivered. More: uncorrectable; the decoder marks it (the 66b
  sync headers of its blocks are corrupted), so every frame wholly or partly inside it is dropped and TCP
  retransmits (IEEE 802.3 Clause 91; AMD PG203 sub-mode 1).
- `rs544-pass`: the same code with the error indication bypassed (802.3 91.5.3.3, MDIO 1.200.1 = 0): an
  uncorrectable codeword's errors are passed on as one burst (its errored data symbols, as received).
- `llr`: link-level retry (UEC 1.0 LLR: sequence numbers, NACK on a CRC error, go-back-N replay): a frame with any
  bit error is not delivered; it arrives again, clean, after a replay delay, invisible to TCP.

Pure arithmetic (math only): the engine process imports it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Profile", "PROFILES", "PROFILE_NAMES", "profile", "symbol_error_probability",
           "codeword_failure_probability", "failed_symbol_count_pmf", "symbol_bit_errors_pmf",
           "delivered_ber", "frame_error_probability", "frame_drop_probability", "codewords_per_frame",
           "added_latency_s", "goodput_fraction", "MAC_RATE_BPS"]

MAC_RATE_BPS = 100e9  # the link the added latencies are stated for (100GBASE-R: one 106.25 Gbit/s FEC stream)


@dataclass(frozen=True)
class Profile:
    """One link layer. `kind`: raw (errors delivered), fec (a Reed-Solomon code) or retry (link-level replay).
    `on_failure` (fec): drop (the uncorrectable codeword's frames are dropped) or pass (its errors delivered).
    Latencies are per hop, at MAC_RATE_BPS: `line_bps` the FEC stream's serial rate (codeword fill time =
    n m / line_bps), `decode_s` the decoder's, `replay_s` the retry's round trip for an errored frame."""

    name: str
    kind: str
    description: str
    n: int = 0
    k: int = 0
    t: int = 0
    m: int = 10
    on_failure: str = ""
    line_bps: float = 0.0
    decode_s: float = 0.0
    replay_s: float = 0.0
    design_pre_fec_ber: float | None = None  # what the standard's PMDs must meet before FEC (None: not found)
    sources: str = ""

    @property
    def data_bits(self) -> int:
        """Data bits a codeword carries (k m)."""
        return self.k * self.m

    @property
    def fill_s(self) -> float:
        """Time for a whole codeword to arrive (the decoder needs all of it)."""
        return self.n * self.m / self.line_bps if self.kind == "fec" else 0.0


_RS544 = dict(n=544, k=514, t=15, m=10, line_bps=106.25e9, decode_s=114.8e-9, design_pre_fec_ber=2.4e-4,
              sources="802.3 Cl.91/119 RS(544,514,15,10) (Intel AN 846 5.3); pre-FEC 2.4e-4: 802.3cm 138.1.1 "
                      "(and 802.3cd 136.1); decode 114.8 ns: AMD PG203 Table A-4 (an RS(528) engine: no RS(544) "
                      "decoder latency was found, assumed equal); fill 5440 b / 106.25 Gb/s = 51.2 ns")
PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("none", "raw", "no FEC, no retry: the pre-FEC BER is delivered"),
    Profile("rs544", "fec", "RS(544,514) KP4 FEC (802.3bs/cd); an uncorrectable codeword's frames are dropped",
            on_failure="drop", **_RS544),
    Profile("rs544-pass", "fec", "RS(544,514) KP4 FEC with the error indication bypassed: an uncorrectable "
                                 "codeword's errors are delivered as one burst", on_failure="pass", **_RS544),
    Profile("rs528", "fec", "RS(528,514) KR4 FEC (802.3bj Cl.91, 802.3by Cl.108); uncorrectable codewords' frames "
                            "dropped", n=528, k=514, t=7, m=10, on_failure="drop", line_bps=103.125e9,
            decode_s=114.8e-9, design_pre_fec_ber=None,
            sources="802.3 Cl.91 RS(528,514,7,10) (Intel AN 846 5.2); decode 114.8 ns: AMD PG203 Table A-4 "
                    "(full correction and indication); fill 5280 b / 103.125 Gb/s = 51.2 ns; pre-FEC design "
                    "point: not found (5e-5 is often quoted for 100GBASE-SR4)"),
    Profile("rs272", "fec", "RS(272,257+1) low-latency FEC (25G/50G Ethernet Consortium LL-RS): half the "
                            "codeword; uncorrectable codewords' frames dropped", n=272, k=258, t=7, m=10,
            on_failure="drop", line_bps=106.25e9, decode_s=114.8e-9 / 2, design_pre_fec_ber=None,
            sources="25G Ethernet Consortium LL-RS, RS(272,257+1,7,10), 'cuts FEC latency approximately in "
                    "half' (announcement, 2019): decode taken as half of 114.8 ns (inferred); fill 2720 b / "
                    "106.25 Gb/s = 25.6 ns; pre-FEC target: not found"),
    Profile("llr", "retry", "link-level retry (UEC 1.0 LLR): a frame with a bit error is replayed, clean, after "
                            "the replay delay; no FEC", replay_s=5e-6,
            sources="UEC 1.0 LLR as described by the OCP SAI LLR proposal (NACK on a CRC error, go-back-N) and "
                    "the SONiC LLR design: replay timer 5,000-5,500 ns in its example profiles (illustrative)"),
)}
PROFILE_NAMES = tuple(PROFILES)


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r} (one of {', '.join(PROFILE_NAMES)})") from None


# -- the codeword model ----------------------------------------------------------------------------------------

def symbol_error_probability(p: float, m: int = 10) -> float:
    """An m-bit symbol errs if any of its bits does: 1 - (1 - p)^m."""
    return -math.expm1(m * math.log1p(-p)) if p < 1 else 1.0


def _log_binom_pmf(j: int, n: int, q: float) -> float:
    if q <= 0:
        return 0.0 if j == 0 else -math.inf
    if q >= 1:
        return 0.0 if j == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * math.log(q)
            + (n - j) * math.log1p(-q))


def _tail(n: int, q: float, above: int) -> float:
    """P(Binomial(n, q) > above), summed term by term in log space (exact to rounding, tiny tails included)."""
    if above >= n:
        return 0.0
    logs = [_log_binom_pmf(j, n, q) for j in range(above + 1, n + 1)]
    top = max(logs)
    if top == -math.inf:
        return 0.0
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def codeword_failure_probability(prof: Profile, p: float) -> float:
    """P(more than t of the n symbols err): the codeword cannot be corrected."""
    return _tail(prof.n, symbol_error_probability(p, prof.m), prof.t)


def failed_symbol_count_pmf(prof: Profile, p: float) -> list[tuple[int, float]]:
    """The number of errored symbols of a codeword given that it failed: [(j, P(j | j > t))], j = t+1..n, the
    negligible tail (relative mass < 1e-18) left out."""
    q = symbol_error_probability(p, prof.m)
    logs = [(j, _log_binom_pmf(j, prof.n, q)) for j in range(prof.t + 1, prof.n + 1)]
    top = max(x for _, x in logs)
    if top == -math.inf:
        return [(prof.t + 1, 1.0)]
    w = [(j, math.exp(x - top)) for j, x in logs]
    total = sum(x for _, x in w)
    return [(j, x / total) for j, x in w if x / total > 1e-18]


def symbol_bit_errors_pmf(p: float, m: int = 10) -> list[tuple[int, float]]:
    """Bit errors within an errored m-bit symbol: [(b, P(b | b >= 1))], b = 1..m."""
    w = [(b, math.exp(_log_binom_pmf(b, m, p))) for b in range(1, m + 1)]
    total = sum(x for _, x in w)
    return [(b, x / total) for b, x in w]


def delivered_ber(prof: Profile, p: float) -> float:
    """BER of the data bits handed up. raw: p. fec, pass: a data bit arrives wrong iff it erred and its codeword
    failed, i.e. at least t of the other n - 1 symbols erred: p P(Binomial(n-1, p_s) >= t) (miscorrections, where
    the decoder 'corrects' into another codeword, are left out). fec, drop and retry: 0 (nothing errored is handed
    up: dropped or replayed)."""
    if prof.kind == "raw":
        return p
    if prof.kind == "fec" and prof.on_failure == "pass":
        return p * _tail(prof.n - 1, symbol_error_probability(p, prof.m), prof.t - 1)
    return 0.0


def frame_error_probability(p: float, frame_bits: int) -> float:
    """A frame of `frame_bits` bits has at least one bit error: 1 - (1 - p)^L."""
    return -math.expm1(frame_bits * math.log1p(-p)) if p < 1 else 1.0


def codewords_per_frame(prof: Profile, frame_bits: int) -> float:
    """Codewords a frame of L bits overlaps, on average over where it starts: 1 + (L - 1) / (k m)."""
    return 1.0 + (frame_bits - 1) / prof.data_bits


def frame_drop_probability(prof: Profile, p: float, frame_bits: int) -> float:
    """P(a frame is not delivered as sent): fec with drop: it overlaps a failed codeword, 1 - (1 - P_cw)^c with c
    the codewords it overlaps (codewords fail independently); retry: the frame has a bit error (it is replayed,
    not lost); raw and fec with pass: 0."""
    if prof.kind == "fec" and prof.on_failure == "drop":
        pf = codeword_failure_probability(prof, p)
        return -math.expm1(codewords_per_frame(prof, frame_bits) * math.log1p(-pf)) if pf < 1 else 1.0
    if prof.kind == "retry":
        return frame_error_probability(p, frame_bits)
    return 0.0


def added_latency_s(prof: Profile, p: float = 0.0, frame_bits: int = 1500 * 8) -> float:
    """The one-way latency a profile adds per hop to a frame, on average: fec, the codeword fill and the decoder
    (whatever the BER); retry, the replay delay times the expected replays of a frame, E = P / (1 - P) with P its
    frame error probability (go-back-N resends the frames behind it too: that costs throughput, goodput_fraction);
    raw: 0."""
    if prof.kind == "fec":
        return prof.fill_s + prof.decode_s
    if prof.kind == "retry":
        pe = frame_error_probability(p, frame_bits)
        return math.inf if pe >= 1 else prof.replay_s * pe / (1 - pe)
    return 0.0


def goodput_fraction(prof: Profile, p: float = 0.0, frame_bits: int = 1500 * 8, rate_bps: float = MAC_RATE_BPS
                     ) -> float:
    """The share of the link's rate that delivers new frames. retry (go-back-N): an errored frame costs its own
    transmission and the replay round trip, during which the frames sent behind it are resent too, so with
    P = frame_error_probability and a = replay_s / (frame_bits / rate_bps) the link delivers
    (1 - P) / (1 + a P) of its rate (the go-back-N efficiency with the window filling the round trip). fec: 1
    (the code's overhead is inside the standard's line rate: the MAC rate is MAC_RATE_BPS); raw: 1. A link
    with goodput g spends 1/g of the clean link's time on each byte."""
    if prof.kind != "retry":
        return 1.0
    pe = frame_error_probability(p, frame_bits)
    a = prof.replay_s * rate_bps / frame_bits
    return (1 - pe) / (1 + a * pe)
