"""Protected bits (scope ``tensor``): which bits of each tensor value a link protects, and the field of every bit.

A link that protects, e.g., the sign and exponent of each float emulates a protocol layer that FEC-protects a
value's few significant bits and delivers the rest raw. The engine draws flips over every eligible bit as
usual and then keeps only those on exposed (unprotected) bit positions; a flip on a protected position is
kept with probability ``protected_ber / ber`` (the residual error rate of protected bits), decided by a hash of
(seed, flow, stream bit offset), so a retransmitted range gets the same decision. docs/engine.md, "Protected
bits".

Bit numbering. Values are little-endian: byte ``j`` of a value holds its bits ``8j .. 8j+7`` (value bit 0 =
the LSB). The engine numbers the bits of a buffer MSB first within each byte (``packet.apply_flips``: bit
``p`` is ``0x80 >> (p & 7)`` of byte ``p >> 3``). So engine bit ``b``, counted from the first byte of a value,
is value bit ``8 * (b >> 3) + 7 - (b & 7)``. For a value of ``bits`` bits (a power of two), ``b & (bits - 1)``
is the *slot* of any engine bit counted from a value boundary; ``BitLayout`` holds a table per slot.
"""

from __future__ import annotations

import numpy as np

from testbed.vocab import FLOAT_FORMATS, PROTECT_FIELDS

__all__ = ["ELEMENTS", "FIELDS", "BitLayout", "field_bits", "normalize_protect", "protected_positions",
           "residual_keep", "flow_salt"]

# element -> (bytes, exponent bits, mantissa bits); the sign is the top bit.
ELEMENTS = {name: ((1 + exp + man) // 8, exp, man) for name, (exp, man) in FLOAT_FORMATS.items()}
FIELDS = PROTECT_FIELDS  # index = the field code in BitLayout.field

_M64 = (1 << 64) - 1


def field_bits(element: str) -> dict[str, range]:
    """Value bit positions (0 = LSB) of each field: fp32 sign 31, exponent 23-30, mantissa 0-22."""
    size, exp, man = _element(element)
    bits = 8 * size
    return {"sign": range(bits - 1, bits), "exponent": range(man, man + exp), "mantissa": range(0, man)}


def _element(element: str) -> tuple[int, int, int]:
    try:
        return ELEMENTS[element]
    except (KeyError, TypeError):
        raise ValueError(f"element must be one of {', '.join(ELEMENTS)}, got {element!r}") from None


def normalize_protect(protect) -> list | None:
    """``protect`` as the engine keeps it: None (nothing protected) or a list of field names (lower case) and
    bit positions (ints), duplicates dropped, in the order given. A string is a comma-separated list."""
    if protect is None:
        return None
    if isinstance(protect, str):
        protect = [p for p in protect.split(",") if p.strip()]
    if not isinstance(protect, (list, tuple)):
        raise ValueError(f"protect must be a list of field names ({', '.join(FIELDS)}) or bit positions, "
                         f"got {protect!r}")
    out: list = []
    for item in protect:
        if isinstance(item, bool):
            raise ValueError(f"protect: {item!r} is neither a field name nor a bit position")
        if isinstance(item, str):
            key = item.strip().lower()
            if key.lstrip("-").isdigit():
                item = int(key)
            elif key in FIELDS:
                item = key
            else:
                raise ValueError(f"protect: unknown field {item!r} (fields: {', '.join(FIELDS)}, or bit positions)")
        elif not isinstance(item, (int, np.integer)):
            raise ValueError(f"protect: {item!r} is neither a field name nor a bit position")
        else:
            item = int(item)
        if item not in out:
            out.append(item)
    return out or None


def protected_positions(element: str, protect) -> frozenset[int]:
    """Value bit positions (0 = LSB) that ``protect`` names for ``element``. ValueError if a name is unknown or
    a position is outside ``0 .. bits-1``."""
    size = _element(element)[0]
    fields = field_bits(element)
    out: set[int] = set()
    for item in normalize_protect(protect) or ():
        if isinstance(item, str):
            out.update(fields[item])
        elif 0 <= item < 8 * size:
            out.add(item)
        else:
            raise ValueError(f"protect: bit position {item} is outside 0..{8 * size - 1} of {element} "
                             f"(0 is the least significant bit)")
    return frozenset(out)


class BitLayout:
    """Per element type and protected set: field and protection of every slot (engine bit mod value bits).

    - ``size``: bytes per value; ``mask``: ``8 * size - 1``.
    - ``field[slot]``: 0 sign, 1 exponent, 2 mantissa (``FIELDS``; ``field_codes``: the same as a tuple);
      ``protected[slot]``: bool.
    - ``any``: whether anything is protected (the engine's per-packet switch).
    - ``protected_bits(a, b)``: protected bits among engine bits ``[a, b)`` counted from a value boundary
      (any ints, negative too: the count is periodic), O(1).
    """

    __slots__ = ("element", "size", "bits", "mask", "field", "field_codes", "protected", "positions", "any", "_shift",
                 "_nprot", "_cum")

    def __init__(self, element: str = "fp32", protect=None):
        self.element = element
        self.size = _element(element)[0]
        self.bits = 8 * self.size
        self.mask = self.bits - 1
        self._shift = self.bits.bit_length() - 1
        self.positions = protected_positions(element, protect)
        value_bit = np.array([8 * (b >> 3) + 7 - (b & 7) for b in range(self.bits)])  # slot -> value bit
        code = np.full(self.bits, 2, dtype=np.uint8)
        fields = field_bits(element)
        code[np.isin(value_bit, list(fields["exponent"]))] = 1
        code[value_bit == self.bits - 1] = 0
        self.field = code
        self.field_codes = tuple(code.tolist())
        self.protected = np.isin(value_bit, sorted(self.positions))
        self.any = bool(self.positions)
        self._nprot = len(self.positions)
        self._cum = [0, *np.cumsum(self.protected).tolist()]  # protected slots below each slot

    def protected_bits(self, a: int, b: int) -> int:
        if not self.any or b <= a:
            return 0
        return self._count(b) - self._count(a)

    def _count(self, x: int) -> int:
        return (x >> self._shift) * self._nprot + self._cum[x & self.mask]

    def __repr__(self) -> str:
        return f"BitLayout({self.element!r}, protected={sorted(self.positions)})"


def flow_salt(seed: int, conn: int, key: bytes) -> int:
    """A 64-bit salt for one flow direction's residual decisions: (seed, connection number, 12-byte key) mixed
    (the engine passes ``FlowState.identity()``: ordinal and addresses, or for a flow first seen mid-stream its
    connection number on the 4-tuple and the 4-tuple)."""
    x = _mix64(int(seed) & _M64)
    x = _mix64(x ^ int(conn))
    return _mix64(x ^ int.from_bytes(key[:8], "big")) ^ int.from_bytes(key[8:12], "big")


def _mix64(x: int) -> int:
    """splitmix64's finalizer (plus its increment) on a Python int."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def residual_keep(salt: int, bit_offsets: np.ndarray, fraction: float) -> np.ndarray:
    """Which flips on protected positions get through: a deterministic function of (salt, stream bit offset),
    True with probability ``fraction`` (= protected_ber / ber) per offset, independent of the error model's
    draws. splitmix64 of ``offset * golden + salt``, top 53 bits compared with ``fraction * 2**53``."""
    if fraction >= 1.0:
        return np.ones(bit_offsets.size, dtype=bool)
    x = bit_offsets.astype(np.uint64) * _GOLDEN + np.uint64(salt & _M64)  # uint64 arrays wrap silently
    x ^= x >> np.uint64(30)
    x *= _C1
    x ^= x >> np.uint64(27)
    x *= _C2
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)) < np.uint64(int(fraction * (1 << 53)))
