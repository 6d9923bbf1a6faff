"""Bit flips as a pure function of stream position (issue 38, item 1): a counter-based generator.

The packet-order generators of the engines draw flips in the order packets arrive, so a retransmission, a GSO
boundary or a reordered segment moves every later flip. Here a flip is a function of (key, bit offset in the
stream) and nothing else:

- the key: two 32-bit words from the stream's identity: BLAKE2b of the engine's part (seed, tag, generation:
  `key_of`, computed once per setting in userspace), then, for a flow, Philox of the flow's four identity words
  under that key (`flow_key`: ordinal or connection number, the two addresses, the port pair), which a BPF program
  computes per flow as well. The same identity gives the same key on every run and in every engine;
- the stream is cut into blocks of BLOCK_BYTES (512) bytes by byte offset (the TCP sequence number relative to the
  flow's ISN, or the eligible-byte offset in scope tensor); block b's flips come from Philox4x32-10 (Salmon et al.,
  SC'11; checked against the Random123 known-answer vectors) at counter (b low, b high, j, 0), j = 0, 1, ...:
  - the count: a 64-bit uniform u (words 0 and 1 of counter j = 0) against the precomputed binomial tail table
    of the BER: the block holds at least k flips iff u < floor(P(Binomial(4096, ber) >= k) 2^64) (inverse CDF,
    integer compares only, so a BPF program can do the same);
  - the positions: the following words (2 and 3 of j = 0, then all four of j = 1, 2, ...), each taken mod 512,
    a position already drawn skipped (so the k positions are a uniform k-subset of the block's 512 bits).
  Per block: Binomial(512, ber) flips at uniform distinct positions, which is exactly independent flips of
  every bit with probability ber. A byte range's flips are the flips of the blocks it overlaps that fall inside
  it, so any cutting of a stream into segments gives the same flips, and a retransmission gets its original's.

Why 512-byte blocks: one Philox call per block is the cost of a stretch without flips, which a BPF program pays
per packet (128 calls for 64 KiB instead of 1,024 with 64-byte blocks); the count table stays short at the BERs
of interest (14 entries at 1e-4, 106 at 1e-2: the program takes at most MAX_TAIL).

Written by hand (numpy, vectorised over blocks) because the same arithmetic has to run in a BPF program: numpy's
Philox is 4x64 and keyed differently, and no library exposes a per-position binomial draw.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

BLOCK_BYTES = 512
BLOCK_BITS = BLOCK_BYTES * 8
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
_MAX_WORDS = 4 * 1024  # position words a block may use (rejections included); tables cap the count far below
MAX_TAIL = 128  # the longest count table the BPF program takes (tail_table; BER up to ~1e-2)


def philox4x32(counter: np.ndarray, key: tuple[int, int], rounds: int = 10) -> np.ndarray:
    """Philox4x32-R of an (N, 4) array of 32-bit counter words under one key: (N, 4) uint64 holding 32-bit words."""
    c = np.asarray(counter, dtype=np.uint64).reshape(-1, 4)
    c0, c1, c2, c3 = (c[:, i].copy() for i in range(4))
    k0, k1 = key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        p0, p1 = _M0 * c0, _M1 * c2
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & _MASK32, p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return np.stack([c0, c1, c2, c3], axis=1)


def _key(ident: tuple) -> tuple[int, int]:
    """A Philox key: BLAKE2b-64 of the identity's repr, as two 32-bit words."""
    d = hashlib.blake2b(repr(ident).encode(), digest_size=8).digest()
    return int.from_bytes(d[:4], "little"), int.from_bytes(d[4:], "little")


def stream_key(link_seed: int, run_seed: int | None, direction: str, flow: str | tuple) -> tuple[int, int]:
    """The Philox key of one stream: of (link seed, run seed or None, direction, flow identity)."""
    return _key((int(link_seed), None if run_seed is None else int(run_seed), str(direction), flow))


def flow_key(base: tuple[int, int], words: tuple[int, int, int, int]) -> tuple[int, int]:
    """A flow's key under an engine's key ``base``: words 0 and 1 of Philox4x32-10 of the flow's four 32-bit
    identity words (what the BPF program computes per flow)."""
    w = philox4x32(np.array([[int(x) & 0xFFFFFFFF for x in words]], dtype=np.uint64), base)[0]
    return int(w[0]), int(w[1])


def model_key(seed: int, *key: int) -> tuple[int, int]:
    """The key of an engine's model: ``key_of(seed, tag, generation)``, and for a flow (four more words: its
    number and the three words of its 12-byte identity) that key's ``flow_key``."""
    if len(key) > 4:
        return flow_key(key_of(seed, *key[:-4]), tuple(key[-4:]))
    return key_of(seed, *key)


@lru_cache(maxsize=64)
def tail_table(ber: float) -> tuple[int, ...]:
    """(T_1, T_2, ...): T_k = floor(P(Binomial(BLOCK_BITS, ber) >= k) 2^64), down to the first 0 (a count that a
    64-bit uniform never reaches)."""
    from scipy import stats

    if not 0 <= ber <= 1:
        raise ValueError(f"ber must be in [0, 1], got {ber!r}")
    sf = stats.binom.sf(np.arange(BLOCK_BITS), BLOCK_BITS, ber)  # P(X >= k), k = 1 .. BLOCK_BITS
    out = []
    for p in sf.tolist():
        t = min(int(float(p) * 2.0 ** 64), 2 ** 64 - 1)
        if t <= 0:
            break
        out.append(t)
    return tuple(out)


def key_of(*words: int) -> tuple[int, int]:
    """A Philox key from any tuple of ints (an engine's seed and stream key)."""
    return _key(tuple(int(w) for w in words))


def _count_words(key: tuple[int, int], ber: float, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(counts, words): the blocks' flip counts and their counter-0 Philox words (None where no block can flip)."""
    blocks = np.asarray(blocks, dtype=np.uint64)
    table = tail_table(ber)
    if not table or blocks.size == 0:
        return np.zeros(blocks.shape, dtype=np.int64), None
    ctr = np.zeros((blocks.size, 4), dtype=np.uint64)
    ctr[:, 0], ctr[:, 1] = blocks & _MASK32, blocks >> np.uint64(32)
    w = philox4x32(ctr, key)
    u = (w[:, 1] << np.uint64(32)) | w[:, 0]
    return (u[:, None] < np.array(table, dtype=np.uint64)[None, :]).sum(axis=1).astype(np.int64), w


def block_counts(key: tuple[int, int], ber: float, blocks: np.ndarray) -> np.ndarray:
    """Flip counts of the given block indices (int64 array)."""
    return _count_words(key, ber, blocks)[0]


def block_positions(key: tuple[int, int], block: int, count: int) -> list[int]:
    """The `count` distinct bit positions (0 .. BLOCK_BITS - 1) of block `block`'s flips, in draw order."""
    out: list[int] = []
    j = 0
    words = [int(x) for x in philox4x32(np.array([[block & 0xFFFFFFFF, block >> 32, 0, 0]]), key)[0, 2:]]
    while len(out) < count:
        if not words:
            j += 1
            if 4 * j > _MAX_WORDS:
                raise RuntimeError("position draw did not settle (count too large for a block)")
            words = [int(x) for x in philox4x32(np.array([[block & 0xFFFFFFFF, block >> 32, j, 0]]), key)[0]]
        pos = words.pop(0) % BLOCK_BITS
        if pos not in out:
            out.append(pos)
    return out


_EMPTY = np.zeros(0, dtype=np.int64)
_BB = np.uint64(BLOCK_BITS - 1)


def flips_bits(key: tuple[int, int], ber: float, start_bit: int, n_bits: int) -> np.ndarray:
    """The stream bit offsets (sorted, int64) that flip within bits [start_bit, start_bit + n_bits)."""
    if n_bits <= 0 or ber <= 0:
        return _EMPTY
    first, last = start_bit // BLOCK_BITS, (start_bit + n_bits - 1) // BLOCK_BITS
    blocks = np.arange(first, last + 1, dtype=np.uint64)
    counts, w = _count_words(key, ber, blocks)
    hit = counts > 0
    if not hit.any():
        return _EMPTY
    blocks, counts, w = blocks[hit], counts[hit], w[hit]
    base = blocks.astype(np.int64) * BLOCK_BITS
    p2, p3 = (w[:, 2] & _BB).astype(np.int64), (w[:, 3] & _BB).astype(np.int64)
    # one flip: word 2; two: words 2 and 3 when they differ; anything else drawn block by block
    one = counts == 1
    two = (counts == 2) & (p2 != p3)
    parts = [base[one] + p2[one], base[two] + p2[two], base[two] + p3[two]]
    rest = ~(one | two)
    if rest.any():
        parts.append(np.array([int(b) * BLOCK_BITS + p for b, n in zip(blocks[rest], counts[rest])
                               for p in block_positions(key, int(b), int(n))], dtype=np.int64))
    out = np.sort(np.concatenate(parts))
    lo, hi = np.searchsorted(out, [start_bit, start_bit + n_bits])
    return out[lo:hi]


def flips(key: tuple[int, int], ber: float, start_byte: int, nbytes: int) -> np.ndarray:
    """The stream bit offsets (sorted, int64) that flip within bytes [start_byte, start_byte + nbytes) of the
    stream; bit i of byte B is offset 8 B + i, i = 0 the byte's most significant bit (the engines' order)."""
    return flips_bits(key, ber, 8 * start_byte, 8 * nbytes)


def apply(buf: bytearray, key: tuple[int, int], ber: float, start_byte: int) -> int:
    """Flip `buf` in place as the stream's bytes [start_byte, start_byte + len(buf)); returns the bits flipped."""
    offs = flips(key, ber, start_byte, len(buf)) - 8 * start_byte
    for o in offs:
        buf[o >> 3] ^= 0x80 >> (o & 7)
    return len(offs)
