"""The bpf engine's maps as Python sees them: the layouts of flip.c's structs (every field a u64, so no
padding questions), the gap tables, encoding a configuration and decoding the state and the counters.

Gap tables (docs/engine.md, "The bpf engine"): a Geometric(p) gap G on {1, 2, ...} is drawn as
``G - 1 = sum_k 2^k B_k`` with independent digits ``B_k ~ Bernoulli(r_k)``, ``r_k = q^(2^k) / (1 + q^(2^k))``,
``q = 1 - p`` (the digits of a geometric variable are independent: ``prod_k (1 + q^(2^k)) = 1 / (1 - q)``).
The program compares one 64-bit uniform draw per digit with ``thr_k = round(r_k * 2^64)``. Errors: each
``r_k`` is computed in double precision (relative error < 2^-52) and digits whose threshold rounds to 0
(``r_k < 2^-65``) are never set, which truncates the gap at ``2^ndig`` with probability mass
``q^(2^ndig) < 2^-64``. Both are far below anything a test could resolve (the tests check the realized
rates against exact binomial intervals).
"""

from __future__ import annotations

import math
import struct

from testbed.engine.counterflips import MAX_TAIL

__all__ = ["NSLOTS", "NDIG", "NPORTS", "NEPOCHS", "SCOPES", "CHECKSUMS", "COUNTERS", "UNPARSED", "gap_table",
           "model_tables", "encode_cfg", "config_value", "decode_config_version", "decode_state", "sum_counters",
           "CONFIG_SIZE", "STATE_SIZE", "COUNTERS_SIZE", "keyed", "keyed_words"]

NSLOTS = 8
NDIG = 64
NPORTS = 16
NEPOCHS = 64
RING = 1 << 16
NEVER = 1 << 62
SCOPES = {"payload": 0, "all": 1, "tensor": 2}
CHECKSUMS = {"fix": 0, "keep": 1}
T_GOOD_FLIP, T_BAD_FLIP, T_GOOD_LEN, T_BAD_LEN = range(4)

# struct counters in flip.c, in order
COUNTERS = ("packets", "bytes", "packets_modified", "packets_multiflip", "packets_unparsed",
            "u_short", "u_not_ipv4", "u_bad_ihl", "u_bad_length", "u_fragment", "u_not_tcp_udp", "u_bad_l4_header",
            "packets_errors", "retransmitted_bits", "flows", "flows_excluded", "packets_gso", "keep_gso_passed",
            "ring_overruns", "flips_on_checksum", "flips_applied", "ring_shared", "bits_gso", "flips_gso",
            "packets_unclone_failed", "hole_bits", "holes_lost",
            # keyed flips (tb_keyed)
            "retransmitted_flips", "flows_midstream", "flows_desynced", "desync_out_of_order", "stale_bits",
            "ranges_lost_bits", "bits_protected", "flips_protected", "flips_corrected", "flips_sign", "flips_exponent",
            "flips_mantissa", "header_bytes", "frames", "data_frames", "kflows_lost", "tensor_holes")
UNPARSED = {"u_short": "short", "u_not_ipv4": "not_ipv4", "u_bad_ihl": "bad_ihl", "u_bad_length": "bad_length",
            "u_fragment": "fragment", "u_not_tcp_udp": "not_tcp_udp", "u_bad_l4_header": "bad_l4_header"}
NCOUNTERS = 64
MAXTAIL = MAX_TAIL  # flip.c's MAXTAIL: the longest count table the program takes

_TABLE_WORDS = 2 + NDIG
# keyed, fk[2], lk[2], codes, vbits, pmask, smask, emask, resid, salt_seed, max_frame, ntail, tail[MAXTAIL]
_KEYED_WORDS = 14 + MAXTAIL
_CFG_WORDS = 10 + NPORTS + 4 * _TABLE_WORDS + _KEYED_WORDS
CONFIG_SIZE = 8 * (2 + NSLOTS * _CFG_WORDS)
_STATE_HEAD = ("applied", "slot", "generation", "rng", "cursor", "gen_pos", "gen_idx", "next_flip", "bad",
               "soj_start", "soj_end", "bad_sojourns", "bad_sojourn_bits", "nepochs")
_EPOCH = ("version", "ber_bits", "start_bits", "start_flips", "ktime")
_STATE_TAIL = ("kbits", "kflips", "ucursor")
STATE_SIZE = 8 + 8 * len(_STATE_HEAD) + 8 * len(_EPOCH) * NEPOCHS + 8 * len(_STATE_TAIL)
COUNTERS_SIZE = 8 * NCOUNTERS
_U64_MAX = (1 << 64) - 1


def gap_table(p: float) -> tuple[int, int, list[int]]:
    """(ndig, never, thresholds) of the digit sampler for Geometric(p) gaps on {1, 2, ...}."""
    p = float(p)
    if not 0.0 <= p <= 1.0 or math.isnan(p):
        raise ValueError(f"probability out of range: {p}")
    if p == 0.0:
        return 0, 1, [0] * NDIG
    thr = [0] * NDIG
    if p < 1.0:
        lq = math.log1p(-p)
        for k in range(NDIG):
            x = math.exp(lq * float(1 << k))  # q^(2^k)
            t = int(round(x / (1.0 + x) * 2.0 ** 64))
            thr[k] = min(t, _U64_MAX)
    ndig = max((k + 1 for k, t in enumerate(thr) if t), default=0)
    return ndig, 0, thr


def model_tables(error_model: dict, ber: float) -> tuple[list, int]:
    """The four gap tables (good-state flips, bad-state flips, good sojourns, bad sojourns) and the
    stationary start threshold, for a validated error model (testbed/engine/models.py parametrization)."""
    kind = (error_model or {}).get("type", "bernoulli")
    if kind not in ("bernoulli", "gilbert_elliott"):
        raise ValueError(f"the bpf engine has no {kind} error model (engine nfqueue has)")
    if kind == "bernoulli":
        never = gap_table(0.0)
        return [gap_table(ber), never, never, never], 0
    bad_ber = float(error_model.get("bad_ber", 0.5))
    good_ber = float(error_model.get("good_ber", 0.0))
    p_bg = 1.0 / float(error_model["burst_length"])
    pi_b = (float(ber) - good_ber) / (bad_ber - good_ber)
    p_gb = p_bg * pi_b / (1.0 - pi_b)
    tables = [gap_table(good_ber), gap_table(bad_ber), gap_table(min(1.0, p_gb)), gap_table(p_bg)]
    return tables, min(_U64_MAX, int(round(pi_b * 2.0 ** 64)))


def keyed(scope: str, error_model: dict) -> bool:
    """Whether flips are drawn as a pure function of position (tb_keyed): scope tensor, or error_model counter."""
    return scope == "tensor" or (error_model or {}).get("type") == "counter"


def keyed_words(*, ber: float, seed: int, generation: int, scope: str, collectives=None, element: str = "fp32",
                protect=None, protected_ber: float = 0.0) -> list[int]:
    """The keyed part of a `struct cfg` slot: the engine's keys (as the NFQUEUE engine's CounterModel derives
    them), the tensor scope's filter and value layout, the count table."""
    from testbed.engine import counterflips
    from testbed.engine.gloo import COLLECTIVE_CODES, MAX_FRAME_BYTES, collective_codes
    from testbed.engine.models import TAG_FLOW, TAG_LINK
    from testbed.engine.protect import BitLayout

    codes = collective_codes(collectives)
    mask = sum(1 << c for c in (COLLECTIVE_CODES if codes is None else codes))
    layout = BitLayout(element, protect)
    slots = range(layout.bits)
    pmask = sum(1 << b for b in slots if layout.protected[b])
    smask = sum(1 << b for b in slots if layout.field[b] == 0)
    emask = sum(1 << b for b in slots if layout.field[b] == 1)
    fraction = float(protected_ber) / float(ber) if (layout.any and protected_ber and ber) else 0.0
    resid = 1 << 53 if fraction >= 1.0 else int(fraction * (1 << 53))
    table = counterflips.tail_table(float(ber))
    if len(table) > MAXTAIL:
        raise ValueError(f"BER {ber:g} needs a count table of {len(table)} entries (the program takes {MAXTAIL})")
    fk = counterflips.key_of(seed, TAG_FLOW, generation)
    lk = counterflips.key_of(seed, TAG_LINK, generation)
    words = [1, fk[0], fk[1], lk[0], lk[1], mask, layout.bits, pmask, smask if scope == "tensor" else 0,
             emask if scope == "tensor" else 0, resid, int(seed) & _U64_MAX, MAX_FRAME_BYTES, len(table)]
    return words + list(table) + [0] * (MAXTAIL - len(table))


def encode_cfg(version: int, *, ber: float, error_model: dict, seed: int, generation: int, scope: str,
               checksum: str, control_ports: list[int], new_epoch: bool = True, collectives=None,
               element: str = "fp32", protect=None, protected_ber: float = 0.0) -> bytes:
    """One `struct cfg` slot."""
    if len(control_ports) > NPORTS:
        raise ValueError(f"the bpf engine takes at most {NPORTS} control ports, got {len(control_ports)}")
    is_keyed = keyed(scope, error_model)
    tables, pi_bad = model_tables({"type": "bernoulli"} if is_keyed else error_model, ber)
    skip_retx = 1 if (scope == "payload" and checksum == "fix") else 0
    words = [version, struct.unpack("<Q", struct.pack("<d", float(ber)))[0], generation, int(seed) & _U64_MAX,
             SCOPES[scope], CHECKSUMS[checksum], skip_retx, pi_bad, int(bool(new_epoch)), len(control_ports)]
    words += [int(p) for p in control_ports] + [0] * (NPORTS - len(control_ports))
    for ndig, never, thr in tables:
        words += [ndig, never, *thr]
    if is_keyed:
        words += keyed_words(ber=ber, seed=seed, generation=generation, scope=scope, collectives=collectives,
                             element=element, protect=protect, protected_ber=protected_ber)
    else:
        words += [0] * _KEYED_WORDS
    assert len(words) == _CFG_WORDS
    return struct.pack(f"<{_CFG_WORDS}Q", *words)


def config_value(version: int, slots: list[bytes]) -> bytes:
    """The whole `struct config`: the version in force and the eight slots (slot version % 8 is current)."""
    assert len(slots) == NSLOTS
    return struct.pack("<QQ", version, 0) + b"".join(slots)


def empty_slot() -> bytes:
    return bytes(8 * _CFG_WORDS)


def split_config(value: bytes) -> tuple[int, list[bytes]]:
    n = 8 * _CFG_WORDS
    version = struct.unpack_from("<Q", value, 0)[0]
    return version, [value[16 + i * n: 16 + (i + 1) * n] for i in range(NSLOTS)]


def decode_config_version(value: bytes) -> int:
    return struct.unpack_from("<Q", value, 0)[0]


def decode_state(value: bytes) -> dict:
    head = struct.unpack_from(f"<{len(_STATE_HEAD)}Q", value, 8)
    d = dict(zip(_STATE_HEAD, head))
    eps = []
    n = d["nepochs"]
    base = 8 + 8 * len(_STATE_HEAD)
    first = max(0, n - NEPOCHS)
    for i in range(first, n):
        vals = struct.unpack_from(f"<{len(_EPOCH)}Q", value, base + 8 * len(_EPOCH) * (i % NEPOCHS))
        ep = dict(zip(_EPOCH, vals))
        ep["ber"] = struct.unpack("<d", struct.pack("<Q", ep.pop("ber_bits")))[0]
        eps.append(ep)
    d["epochs"] = eps
    d["epochs_lost"] = first
    d.update(zip(_STATE_TAIL, struct.unpack_from(f"<{len(_STATE_TAIL)}Q", value,
                                                 base + 8 * len(_EPOCH) * NEPOCHS)))
    return d


def sum_counters(value: bytes, ncpus: int) -> dict:
    """Sum a per-CPU `struct counters` lookup (ncpus values, each rounded up to 8 bytes)."""
    tot = [0] * NCOUNTERS
    for c in range(ncpus):
        vals = struct.unpack_from(f"<{NCOUNTERS}Q", value, c * COUNTERS_SIZE)
        for i, v in enumerate(vals):
            tot[i] += v
    return dict(zip(COUNTERS, tot))
