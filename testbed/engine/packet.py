"""IPv4/TCP/UDP parsing, Internet checksums and bit flipping on raw packets (as NFQUEUE hands them over:
an IP packet, no Ethernet header).

Everything here works on bytes-like objects with plain indexing and numpy; no Scapy (65 us per dissect,
far too slow for the per-packet path). The parser never raises on hostile input: it answers a reason
string for anything it does not handle (the caller passes such packets unmodified and counts them).
"""

from __future__ import annotations

import struct
import sys

import numpy as np

__all__ = [
    "IPPROTO_TCP",
    "IPPROTO_UDP",
    "parse_ipv4",
    "ones_complement_sum",
    "internet_checksum",
    "ipv4_header_checksum",
    "fix_ipv4_header_checksum",
    "l4_checksum",
    "fix_l4_checksum",
    "l4_checksum_ok",
    "apply_flips",
    "UNPARSED_REASONS",
]

IPPROTO_TCP = 6
IPPROTO_UDP = 17
# Reasons parse_ipv4 may answer instead of a parsed tuple.
UNPARSED_REASONS = ("short", "not_ipv4", "bad_ihl", "bad_length", "fragment", "not_tcp_udp", "bad_l4_header")

_NATIVE_U32 = np.dtype("=u4")
_LITTLE = sys.byteorder == "little"
_PSEUDO = struct.Struct("!4H")


def parse_ipv4(pkt) -> tuple[int, int, int, int] | str:
    """Parse an IPv4 packet carrying TCP or UDP.

    Returns ``(proto, ihl, l4_header_len, total_len)`` (the L4 payload is ``pkt[ihl + l4_header_len:
    total_len]``), or a reason string from ``UNPARSED_REASONS``. IP options and TCP options are allowed;
    fragments (MF set or offset != 0) are not parsed: their L4 header is absent or elsewhere.
    """
    n = len(pkt)
    if n < 20:
        return "short"
    b0 = pkt[0]
    if b0 >> 4 != 4:
        return "not_ipv4"
    ihl = (b0 & 0x0F) << 2
    if ihl < 20 or ihl > n:
        return "bad_ihl"
    total = (pkt[2] << 8) | pkt[3]
    if total < ihl or total > n:  # truncated (or nonsense); shorter total = trailing padding, allowed
        return "bad_length"
    if (pkt[6] & 0x3F) or pkt[7]:  # MF flag or fragment offset
        return "fragment"
    proto = pkt[9]
    if proto == IPPROTO_TCP:
        if total - ihl < 20:
            return "bad_l4_header"
        thl = (pkt[ihl + 12] >> 4) << 2
        if thl < 20 or ihl + thl > total:
            return "bad_l4_header"
        return IPPROTO_TCP, ihl, thl, total
    if proto == IPPROTO_UDP:
        if total - ihl < 8:
            return "bad_l4_header"
        ulen = (pkt[ihl + 4] << 8) | pkt[ihl + 5]
        if ulen != total - ihl:
            return "bad_l4_header"
        return IPPROTO_UDP, ihl, 8, total
    return "not_tcp_udp"


def ones_complement_sum(data, start: int = 0, end: int | None = None) -> int:
    """Folded 16-bit ones'-complement sum (big-endian words, RFC 1071) of ``data[start:end]``, not inverted.

    Sums the bytes as *native* 32-bit words with numpy (half as many elements as 16-bit words: 2**16 = 1
    modulo 0xFFFF, so folding a sum of 32-bit words gives the sum of their 16-bit halves) and byte-swaps the
    folded result: the ones'-complement sum is byte-order independent (RFC 1071 section 2(B)), so this equals
    the big-endian sum. A trailing odd byte is padded with a zero byte on its right.
    """
    if end is None:
        end = len(data)
    n = end - start
    if n <= 0:
        return 0
    quads = n >> 2
    s = int(np.frombuffer(data, dtype=_NATIVE_U32, count=quads, offset=start).sum(dtype=np.uint64)) if quads else 0
    i = start + (quads << 2)
    if end - i >= 2:
        s += (data[i] | data[i + 1] << 8) if _LITTLE else (data[i] << 8 | data[i + 1])
        i += 2
    if i < end:
        s += data[i] if _LITTLE else data[i] << 8
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    if _LITTLE:
        s = ((s & 0xFF) << 8) | (s >> 8)
    return s


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def internet_checksum(data) -> int:
    """RFC 1071 checksum (inverted folded sum) of ``data``."""
    return (~ones_complement_sum(data)) & 0xFFFF


def ipv4_header_checksum(pkt, ihl: int) -> int:
    """Checksum the IPv4 header would carry (computed with its checksum field taken as zero)."""
    s = ones_complement_sum(pkt, 0, ihl) + ((~((pkt[10] << 8) | pkt[11])) & 0xFFFF)
    return (~_fold(s)) & 0xFFFF


def fix_ipv4_header_checksum(buf: bytearray, ihl: int) -> None:
    c = ipv4_header_checksum(buf, ihl)
    buf[10] = c >> 8
    buf[11] = c & 0xFF


def _pseudo_sum(pkt, proto: int, l4_len: int) -> int:
    a, b, c, d = _PSEUDO.unpack_from(pkt, 12)
    return a + b + c + d + proto + l4_len


def _csum_offset(proto: int) -> int:
    return 16 if proto == IPPROTO_TCP else 6


def l4_checksum(pkt, ihl: int, total: int, proto: int) -> int:
    """Full TCP/UDP checksum of ``pkt[ihl:total]`` (pseudo-header included, checksum field taken as zero).

    A full recompute, never an incremental update: with NFQA_CFG_F_GSO a CHECKSUM_PARTIAL packet's field holds
    only the pseudo-header sum (measured: an incremental update dropped every packet; docs/engine.md, "GSO"),
    so "old checksum + delta" would be wrong.
    """
    off = ihl + _csum_offset(proto)
    field = (pkt[off] << 8) | pkt[off + 1]
    s = ones_complement_sum(pkt, ihl, total) + ((~field) & 0xFFFF) + _pseudo_sum(pkt, proto, total - ihl)
    c = (~_fold(s)) & 0xFFFF
    if proto == IPPROTO_UDP and c == 0:
        c = 0xFFFF  # RFC 768: a computed zero is sent as all ones (zero means "no checksum")
    return c


def fix_l4_checksum(buf: bytearray, ihl: int, total: int, proto: int) -> None:
    c = l4_checksum(buf, ihl, total, proto)
    off = ihl + _csum_offset(proto)
    buf[off] = c >> 8
    buf[off + 1] = c & 0xFF


def l4_checksum_ok(pkt, ihl: int, total: int, proto: int) -> bool:
    """Whether the TCP/UDP checksum field verifies (UDP checksum 0 = none, always ok)."""
    off = ihl + _csum_offset(proto)
    field = (pkt[off] << 8) | pkt[off + 1]
    if proto == IPPROTO_UDP and field == 0:
        return True
    return l4_checksum(pkt, ihl, total, proto) == field


_MASKS = (np.uint8(0x80) >> np.arange(8, dtype=np.uint8)).astype(np.uint8)


def apply_flips(buf: bytearray, base: int, positions: np.ndarray) -> None:
    """XOR bit ``p`` of ``buf[base:]`` for each ``p`` in the distinct ``positions``.

    Bit numbering is network order: bit 0 is the most significant bit of ``buf[base]``.
    """
    n = positions.size
    if n == 0:
        return
    if n <= 4:  # a Python loop beats numpy's fixed overhead for a handful of flips
        for p in positions.tolist():
            buf[base + (p >> 3)] ^= 0x80 >> (p & 7)
        return
    # ufunc.at is unbuffered: several flips in one byte each apply.
    np.bitwise_xor.at(np.frombuffer(buf, dtype=np.uint8), (positions >> 3) + base, _MASKS[positions & 7])
