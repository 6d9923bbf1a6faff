"""Gloo-aware TCP stream tracking for the corruption engine.

The shim may flip bits only in what DDP/PP actually send (the payload of gloo's data frames: gradients,
activations, parameters) and never in gloo's own framing, which makes gloo abort or hang. Gloo's TCP
transport (``gloo/transport/tcp/pair.{h,cc}``) has no magic and no checksum, so the only way to know which
bytes are payload is to follow each direction of each pair connection from its first byte:

- the side that sent the SYN (the *initiator*) first writes 8 bytes: an int64 LE sequence number
  (``Device::connectAsInitiator`` -> ``write<sequence_number_t>``); nothing is written back;
- then both directions carry frames: a 48-byte preamble of six uint64 LE
  ``{nbytes, opcode, slot, offset, length, roffset}`` (``struct Op::preamble``), followed by ``length``
  payload bytes for opcodes 0/1 (SEND_BUFFER, SEND_UNBOUND_BUFFER) and by nothing for opcodes 2/3
  (NOTIFY_SEND_READY, NOTIFY_RECV_READY, whose ``length`` is the size of the pending operation);
- frames of one direction never interleave (one ``tx_`` queue, one ``rx_`` op per pair), but TCP segment
  boundaries are unrelated to frame boundaries.

``GlooStreamTracker`` is that per-direction state machine. It is fed each segment's payload with its stream
offset and answers which absolute byte ranges inside it are eligible for corruption. See
``docs/gloo-tracker.md`` for the verified wire format, the state machine and the policies.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from typing import NamedTuple

__all__ = [
    "HEADER_SIZE",
    "HANDSHAKE_SIZE",
    "MAX_FRAME_BYTES",
    "OP_SEND_BUFFER",
    "OP_SEND_UNBOUND_BUFFER",
    "OP_NOTIFY_SEND_READY",
    "OP_NOTIFY_RECV_READY",
    "DATA_OPCODES",
    "COLLECTIVE_CODES",
    "COLLECTIVE_NAMES",
    "P2P_CODE",
    "GlooHeader",
    "parse_gloo_header",
    "header_problem",
    "collective_codes",
    "GlooStreamTracker",
]

# --- wire format ----------------------------------------------------------------------------------------------

HEADER = struct.Struct("<6Q")  # Op::preamble: nbytes, opcode, slot, offset, length, roffset (size_t, LE)
HANDSHAKE = struct.Struct("<q")  # sequence_number_t (ssize_t) written by the initiator
HEADER_SIZE = HEADER.size  # 48
HANDSHAKE_SIZE = HANDSHAKE.size  # 8

OP_SEND_BUFFER = 0
OP_SEND_UNBOUND_BUFFER = 1
OP_NOTIFY_SEND_READY = 2
OP_NOTIFY_RECV_READY = 3
DATA_OPCODES = frozenset((OP_SEND_BUFFER, OP_SEND_UNBOUND_BUFFER))

# Slot layout (gloo/types.h, gloo/types.cc Slot::build): prefix << 56 | (uint32 tag) << 24 | delta (8 bits);
# bits 8..23 are always zero. Point-to-point send/recv (torch dist.send/recv, pipelining) use slot = user
# tag (torch checks 0 <= tag, uint32), so the top byte is 0.
P2P_CODE = 0x00
COLLECTIVE_CODES: dict[int, str] = {
    0x00: "p2p",
    0x01: "gather",  # kGatherSlotPrefix (gather, gatherv)
    0x02: "allgather",  # kAllgatherSlotPrefix (allgather, allgatherv)
    0x03: "reduce",  # kReduceSlotPrefix
    0x04: "allreduce",  # kAllreduceSlotPrefix (torch's gloo reduce_scatter runs as an allreduce: measured)
    0x05: "scatter",  # kScatterSlotPrefix
    0x06: "broadcast",  # kBroadcastSlotPrefix
    0x07: "barrier",  # kBarrierSlotPrefix (zero-length data frames)
    0x08: "alltoall",  # kAlltoallSlotPrefix (alltoall, alltoallv)
}
COLLECTIVE_NAMES: dict[str, int] = {name: code for code, name in COLLECTIVE_CODES.items()}
# Aliases accepted by the filter. reduce_scatter is NOT distinguishable from allreduce on the wire (torch
# 2.13's ProcessGroupGloo sends it with the allreduce prefix): naming either selects both.
COLLECTIVE_NAMES.update({
    "send": P2P_CODE, "recv": P2P_CODE, "point_to_point": P2P_CODE,
    "gatherv": 0x01, "allgatherv": 0x02, "allgather_into_tensor": 0x02,
    "all_reduce": 0x04, "reduce_scatter": 0x04, "reduce_scatter_tensor": 0x04,
    "all_gather": 0x02, "all_to_all": 0x08, "alltoallv": 0x08,
})

MAX_FRAME_BYTES = 1 << 31  # the largest data frame the tracker accepts (the bpf engine's tracker too)
_SLOT_UNUSED_BITS = 0xFFFF << 8  # must be zero in collective slots
_MAX_SANE = 1 << 48  # loose bound for notify lengths and SEND_BUFFER offsets


class GlooHeader(NamedTuple):
    """One 48-byte gloo frame header (``Op::preamble``)."""

    nbytes: int  # total frame size: 48 + length for data frames, 48 for notifications
    opcode: int
    slot: int
    offset: int  # SEND_BUFFER only: sender-side offset (0 otherwise)
    length: int  # payload bytes (data frames) or size of the pending operation (notifications)
    roffset: int  # SEND_BUFFER only: receiver-side offset (0 otherwise)

    @property
    def is_data(self) -> bool:
        return self.opcode in DATA_OPCODES

    @property
    def payload_length(self) -> int:
        return self.length if self.opcode in DATA_OPCODES else 0

    @property
    def collective_code(self) -> int:
        return self.slot >> 56

    @property
    def collective(self) -> str | None:
        return COLLECTIVE_CODES.get(self.slot >> 56)

    @property
    def tag(self) -> int:
        """torch's tag: the collective counter for collectives, the user tag for point-to-point."""
        if self.slot >> 56 == P2P_CODE:
            return self.slot
        return (self.slot >> 24) & 0xFFFFFFFF


def parse_gloo_header(data: bytes | bytearray | memoryview, offset: int = 0) -> GlooHeader:
    """Parse the 48-byte header at ``data[offset:offset+48]`` (no validation: see ``header_problem``)."""
    return GlooHeader(*HEADER.unpack_from(data, offset))


def header_problem(h: GlooHeader | tuple, max_frame_bytes: int = MAX_FRAME_BYTES) -> str | None:
    """Why ``h`` cannot be a header gloo (as used by torch) writes, or None when it can."""
    nbytes, opcode, slot, offset, length, roffset = h
    if opcode == OP_SEND_UNBOUND_BUFFER or opcode == OP_SEND_BUFFER:
        if nbytes != HEADER_SIZE + length:
            return f"data frame nbytes {nbytes} != 48 + length {length}"
        if length > max_frame_bytes:
            return f"data frame length {length} > max_frame_bytes {max_frame_bytes}"
        if opcode == OP_SEND_UNBOUND_BUFFER:
            if offset or roffset:  # Pair::sendUnboundBuffer leaves preamble offset/roffset at 0
                return f"unbound-buffer frame with offset {offset} / roffset {roffset}"
        elif offset >= _MAX_SANE or roffset >= _MAX_SANE:
            return f"buffer frame with offset {offset} / roffset {roffset}"
    elif opcode == OP_NOTIFY_SEND_READY or opcode == OP_NOTIFY_RECV_READY:
        if nbytes != HEADER_SIZE:
            return f"notify frame nbytes {nbytes} != 48"
        if offset or roffset or length >= _MAX_SANE:
            return f"notify frame with offset {offset} / length {length} / roffset {roffset}"
    else:
        return f"bad opcode {opcode}"
    code = slot >> 56
    if code == P2P_CODE:
        if slot >> 32:
            return f"point-to-point slot {slot:#x} above 32 bits"
    elif code in COLLECTIVE_CODES:
        if slot & _SLOT_UNUSED_BITS:
            return f"collective slot {slot:#x} has unused bits set"
    else:
        return f"unknown collective code {code:#04x} in slot {slot:#x}"
    return None


def collective_codes(collectives) -> frozenset[int] | None:
    """Map filter names (``COLLECTIVE_NAMES``, case-insensitive, '-' == '_') to slot top-byte codes."""
    if collectives is None:
        return None
    if isinstance(collectives, str):
        collectives = [collectives]
    codes = set()
    for name in collectives:
        key = str(name).strip().lower().replace("-", "_")
        if key not in COLLECTIVE_NAMES:
            raise ValueError(f"unknown gloo collective {name!r}; known: {sorted(COLLECTIVE_NAMES)}")
        codes.add(COLLECTIVE_NAMES[key])
    return frozenset(codes)


# --- tracker --------------------------------------------------------------------------------------------------

_HANDSHAKE, _HEADER, _PAYLOAD = 0, 1, 2


class GlooStreamTracker:
    """State of one direction of one gloo TCP connection.

    ``eligible(offset, data)`` returns the absolute stream ranges ``[start, end)`` inside the segment
    ``data`` (at stream ``offset``) that are payload bytes of data frames allowed by ``collectives``: the only
    bytes whose bits may be flipped. Call it on the segment as it is on the wire, before flipping.

    - in-order segment: parsed; ranges returned.
    - retransmission (bytes below ``frontier``): answered from a record of the eligible ranges of the last
      ``history_bytes`` bytes, so a retransmission gets the same ranges as the first transmission; older
      bytes are answered ``[]`` (counted in ``stale_bytes``).
    - segment beyond a gap (out of order): ``[]``; its bytes are buffered (at most ``max_ooo_bytes``) and
      parsed once the gap is filled, so tracking continues; a later retransmission of them is answered from
      the record.
    - any header that gloo would not write: ``desynced`` becomes True for good and every call returns
      ``[]`` (including the one that found it); ``desync_reason`` says why.

    ``eligible_aligned(offset, data)`` answers the same ranges as ``(start, end, origin)``: ``origin`` is the
    stream offset of byte 0 of the frame's destination buffer, so byte ``x`` of the range is byte
    ``x - origin`` of the buffer and its phase within a value of ``k`` bytes is ``(x - origin) % k`` (a value
    split across segments or, with SEND_BUFFER's ``roffset``, across frames is still one value).
    ``origin_of(x)`` is the origin of an eligible byte ``x`` answered before (of the record's frames).
    """

    __slots__ = (
        "initiator", "codes", "max_frame_bytes", "history_bytes", "max_ooo_bytes",
        "_frontier", "_state", "_need", "_payload_end", "_pay_ok", "_hbuf",
        "_rec_s", "_rec_e", "_rec_o", "_rec_d", "_rec_head", "_horizon", "_pending", "_pending_bytes", "_origin",
        "frames", "data_frames", "eligible_bytes", "payload_bytes", "header_bytes",
        "retransmitted_bytes", "ooo_bytes", "stale_bytes", "desynced", "desync_reason",
        "handshake", "bytes_by_collective",
    )

    def __init__(self, initiator: bool, collectives: set[str] | None = None, max_frame_bytes: int = MAX_FRAME_BYTES,
                 *, history_bytes: int = 64 << 20, max_ooo_bytes: int = 16 << 20):
        self.initiator = bool(initiator)
        # Slot codes of the collectives whose payload is eligible; None: every data frame. Settable: the
        # engine computes them once per setting and assigns them to every live tracker (next frame on).
        self.codes = collective_codes(collectives)
        self.max_frame_bytes = int(max_frame_bytes)
        self.history_bytes = int(history_bytes)
        self.max_ooo_bytes = int(max_ooo_bytes)

        self._frontier = 0  # stream bytes [0, frontier) have been parsed
        self._state = _HANDSHAKE if self.initiator else _HEADER
        self._payload_end = 0  # in _PAYLOAD: end offset of the current frame's payload
        self._pay_ok = False  # in _PAYLOAD: current payload is eligible
        self._origin = 0  # in _PAYLOAD: stream offset of byte 0 of the current frame's destination buffer
        self._hbuf = bytearray()  # partial handshake/header bytes
        self._need = HANDSHAKE_SIZE if self.initiator else HEADER_SIZE
        # record of eligible payload ranges (sorted, disjoint); entries before _rec_head are pruned
        self._rec_s: list[int] = []
        self._rec_e: list[int] = []
        self._rec_o: list[int] = []  # origin of each recorded frame (see eligible_aligned)
        self._rec_d: list[int] = []  # shift of each recorded frame (see shift_of)
        self._rec_head = 0
        self._horizon = 0  # the record is complete for offsets >= horizon
        self._pending: dict[int, bytes] = {}  # out-of-order bytes beyond frontier: start -> data
        self._pending_bytes = 0

        self.frames = 0
        self.data_frames = 0
        self.eligible_bytes = 0  # eligible payload bytes parsed (each stream byte once)
        self.payload_bytes = 0  # data frame payload bytes parsed, eligible or filtered out
        self.header_bytes = 0  # handshake + frame header bytes parsed
        self.retransmitted_bytes = 0  # bytes received again below the frontier
        self.ooo_bytes = 0  # bytes received beyond a gap (buffered)
        self.stale_bytes = 0  # retransmitted bytes older than the record (answered [])
        self.desynced = False
        self.desync_reason: str | None = None
        self.handshake: int | None = None
        self.bytes_by_collective: dict[str, int] = {}  # data payload bytes announced, per collective

    # -- public ----------------------------------------------------------------------------------------------

    @property
    def frontier(self) -> int:
        """Stream offset up to which the direction has been parsed (the next expected byte)."""
        return self._frontier

    def eligible(self, offset: int, data) -> list[tuple[int, int]]:
        n = len(data)
        if n == 0 or self.desynced:
            return []
        end = offset + n
        # Hot path: the segment continues the stream inside the current payload. O(1), no copy.
        if offset == self._frontier and self._state == _PAYLOAD and end <= self._payload_end:
            self._frontier = end
            self.payload_bytes += n
            if end == self._payload_end:
                self._state = _HEADER
                self._need = HEADER_SIZE
            if self._pending:
                self._drain()
                if self.desynced:
                    return []
            if self._pay_ok:
                self.eligible_bytes += n
                return [(offset, end)]
            return []
        return self._slow(offset, data, end)

    def eligible_aligned(self, offset: int, data) -> list[tuple[int, int, int]]:
        """``eligible`` with each range's origin: ``(start, end, origin)`` (see the class docstring)."""
        n = len(data)
        if n == 0 or self.desynced:
            return []
        end = offset + n
        if offset == self._frontier and self._state == _PAYLOAD and end <= self._payload_end:
            origin = self._origin  # the hot path of eligible, answered with the current frame's origin
            ranges = self.eligible(offset, data)
            return [(offset, end, origin)] if ranges else []
        return [(s, e, self.origin_of(s)) for s, e in self._slow(offset, data, end)]

    def origin_of(self, pos: int) -> int:
        """Origin (stream offset of destination-buffer byte 0) of the recorded frame holding eligible byte
        ``pos``; ``pos`` itself (phase 0) for a byte no longer in the record (older than ``history_bytes``)."""
        rs = self._rec_s
        i = bisect_right(rs, pos) - 1
        if i >= 0 and pos < self._rec_e[i]:
            return self._rec_o[i]
        return pos

    def shift_of(self, pos: int) -> int:
        """Stream offset minus eligible offset of the recorded eligible byte ``pos``: ``pos - shift_of(pos)``
        is the number of eligible bytes before it in this direction. Unlike the stream offset it does not depend
        on where gloo's notifications (timing-dependent) fall between the data frames, so the engine keys tensor
        flips on it (docs/engine.md, "Seeds and reproducibility"). 0 for a byte no longer in the record."""
        rs = self._rec_s
        i = len(rs) - 1
        if i < 0 or pos < rs[i]:  # not in the current (last recorded) frame: look it up
            i = bisect_right(rs, pos) - 1
        if i >= 0 and pos < self._rec_e[i]:
            return self._rec_d[i]
        return 0

    def stats(self) -> dict:
        return {
            "initiator": self.initiator,
            "frontier": self._frontier,
            "frames": self.frames,
            "data_frames": self.data_frames,
            "eligible_bytes": self.eligible_bytes,
            "payload_bytes": self.payload_bytes,
            "header_bytes": self.header_bytes,
            "retransmitted_bytes": self.retransmitted_bytes,
            "ooo_bytes": self.ooo_bytes,
            "ooo_pending_bytes": self._pending_bytes,
            "stale_bytes": self.stale_bytes,
            "desynced": self.desynced,
            "desync_reason": self.desync_reason,
            "bytes_by_collective": dict(self.bytes_by_collective),
        }

    # -- internals -------------------------------------------------------------------------------------------

    def _desync(self, reason: str) -> None:
        self.desynced = True
        self.desync_reason = reason
        self._pending.clear()
        self._pending_bytes = 0
        self._hbuf = bytearray()

    def _slow(self, offset: int, data, end: int) -> list[tuple[int, int]]:
        if end <= 0:
            return []
        mv = memoryview(data)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        if offset < 0:  # bytes before the stream's first byte (cannot happen with a correct offset)
            mv = mv[-offset:]
            offset = 0
        out: list[tuple[int, int]] = []
        f = self._frontier
        if offset < f:  # (partial) retransmission
            hi = end if end < f else f
            self.retransmitted_bytes += hi - offset
            self._lookup(offset, hi, out)
            if end <= f:
                return out
            mv = mv[f - offset:]
            offset = f
        if offset > f:  # beyond a gap
            self._buffer(offset, mv)
            return []
        self._parse(mv, out)
        if self._pending and not self.desynced:
            self._drain()
        if self.desynced:
            return []
        return out

    def _lookup(self, a: int, b: int, out: list) -> None:
        if a < self._horizon:
            cut = b if b < self._horizon else self._horizon
            self.stale_bytes += cut - a
            a = cut
            if a >= b:
                return
        rs, re_ = self._rec_s, self._rec_e
        i = bisect_right(rs, a, self._rec_head) - 1
        if i < self._rec_head:
            i = self._rec_head
        n = len(rs)
        while i < n and rs[i] < b:
            s = rs[i] if rs[i] > a else a
            e = re_[i] if re_[i] < b else b
            if s < e:
                out.append((s, e))
            i += 1

    def _buffer(self, offset: int, mv: memoryview) -> None:
        n = len(mv)
        self.ooo_bytes += n
        old = self._pending.get(offset)
        if old is not None and len(old) >= n:
            return
        self._pending_bytes += n - (len(old) if old is not None else 0)
        self._pending[offset] = bytes(mv)
        if self._pending_bytes > self.max_ooo_bytes:
            self._desync(f"out-of-order buffer over {self.max_ooo_bytes} bytes (gap at {self._frontier})")

    def _drain(self) -> None:
        """Parse buffered out-of-order bytes that the frontier has reached (their ranges go to the record)."""
        for start in sorted(self._pending):
            if start > self._frontier:
                break
            data = self._pending.pop(start)
            self._pending_bytes -= len(data)
            skip = self._frontier - start
            if skip < len(data):
                self._parse(memoryview(data)[skip:], None)
                if self.desynced:
                    return

    def _parse(self, mv: memoryview, out: list | None) -> None:
        """Parse ``mv``, which starts exactly at the frontier; append eligible ranges to ``out``."""
        pos = 0
        n = len(mv)
        f = self._frontier
        while pos < n:
            if self._state == _PAYLOAD:
                take = self._payload_end - f
                if take > n - pos:
                    take = n - pos
                self.payload_bytes += take
                if self._pay_ok:
                    self.eligible_bytes += take
                    if out is not None:
                        if out and out[-1][1] == f:
                            out[-1] = (out[-1][0], f + take)
                        else:
                            out.append((f, f + take))
                f += take
                pos += take
                if f == self._payload_end:
                    self._state = _HEADER
                    self._need = HEADER_SIZE
                continue
            need = self._need
            hb = self._hbuf
            if hb or n - pos < need:  # header/handshake split across segments: accumulate
                take = need - len(hb)
                if take > n - pos:
                    take = n - pos
                hb += mv[pos:pos + take]
                pos += take
                f += take
                self.header_bytes += take
                if len(hb) < need:
                    break
                raw, start = bytes(hb), 0
                self._hbuf = bytearray()
            else:  # whole header inside this segment: unpack in place
                raw, start = mv, pos
                pos += need
                f += need
                self.header_bytes += need
            if self._state == _HANDSHAKE:
                (value,) = HANDSHAKE.unpack_from(raw, start)
                if not 0 <= value < (1 << 31):
                    self._frontier = f
                    self._desync(f"bad handshake value {value} (offset 0)")
                    return
                self.handshake = value
                self._state = _HEADER
                self._need = HEADER_SIZE
                continue
            fields = HEADER.unpack_from(raw, start)
            problem = header_problem(fields, self.max_frame_bytes)
            if problem is not None:
                self._frontier = f
                self._desync(f"{problem} (header at offset {f - HEADER_SIZE})")
                return
            self.frames += 1
            opcode = fields[1]
            if opcode > 1:  # notification: no payload
                continue
            self.data_frames += 1
            length = fields[4]
            code = fields[2] >> 56
            name = COLLECTIVE_CODES[code]
            self.bytes_by_collective[name] = self.bytes_by_collective.get(name, 0) + length
            if length == 0:
                continue
            ok = self.codes is None or code in self.codes
            self._state = _PAYLOAD
            self._payload_end = f + length
            self._pay_ok = ok
            # Destination offset of the payload's first byte: SEND_BUFFER says it (roffset, pair.cc
            # prepareRead); an unbound buffer's is the receiver's recv offset, not on the wire, and gloo and
            # torch send whole values from a value-aligned offset, so the frame starts a value.
            origin = self._origin = f - fields[5] if opcode == OP_SEND_BUFFER else f
            if ok:  # eligible bytes before this frame: self.eligible_bytes
                self._record(f, f + length, origin, f - self.eligible_bytes)
        self._frontier = f

    def _record(self, s: int, e: int, origin: int, shift: int) -> None:
        self._rec_s.append(s)
        self._rec_e.append(e)
        self._rec_o.append(origin)
        self._rec_d.append(shift)
        limit = s - self.history_bytes
        rs, re_ = self._rec_s, self._rec_e
        h = self._rec_head
        while re_[h] <= limit:
            self._horizon = re_[h]
            h += 1
        if h > 1024 and 2 * h > len(rs):
            del rs[:h]
            del re_[:h]
            del self._rec_o[:h]
            del self._rec_d[:h]
            h = 0
        self._rec_head = h
