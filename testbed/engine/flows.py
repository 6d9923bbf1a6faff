"""Per flow-direction state: TCP stream offsets (from the ISN seen in the SYN, or the first sequence number
seen), the offset-keyed flips, the gloo tracker, and whether the flow is excluded (control ports)."""

from __future__ import annotations

from itertools import islice

__all__ = ["FlowState", "FlowTable", "flow_key_ints", "TCP_SYN", "TCP_ACK"]

TCP_SYN = 0x02
TCP_ACK = 0x10
_M32 = 0xFFFFFFFF


def flow_key_ints(key: bytes) -> tuple[int, int, int]:
    """The 12-byte key (src addr, dst addr, src port, dst port) as three 32-bit words, for seeding."""
    return (int.from_bytes(key[0:4], "big"), int.from_bytes(key[4:8], "big"), int.from_bytes(key[8:12], "big"))


class FlowState:
    """One direction of one flow (a 4-tuple as it passes this engine)."""

    __slots__ = ("key", "excluded", "base", "top", "okf", "tracker", "initiator", "conn", "syn_seen",
                 "desync_counted")

    def __init__(self, key: bytes, excluded: bool):
        self.key = key
        self.excluded = excluded
        self.base: int | None = None  # sequence number of stream offset 0
        self.top = 0  # highest stream offset (64-bit, unwrapped) seen so far, exclusive
        self.okf = None  # OffsetKeyedFlips, created on first use
        self.tracker = None  # GlooStreamTracker (scope tensor), only for flows whose SYN was seen
        self.initiator: bool | None = None
        self.conn = 0  # connection number on this 4-tuple (a new SYN restarts the stream)
        self.syn_seen = False
        self.desync_counted = False

    def restart(self) -> None:
        """A new connection reuses the 4-tuple: forget the old stream."""
        self.base = None
        self.top = 0
        self.okf = None
        self.tracker = None
        self.initiator = None
        self.conn += 1
        self.syn_seen = False
        self.desync_counted = False

    def stream_offset(self, seq: int, flags: int, payload_len: int) -> tuple[int, bool]:
        """Stream offset of the payload's first byte, and whether this packet starts a new stream (SYN).

        Offsets are 64-bit: the 32-bit difference to ``base`` is unwrapped to the value closest to the
        highest offset seen, so streams longer than 4 GiB keep increasing offsets. A flow first seen
        mid-stream counts from its first sequence number; bytes before it get negative offsets.
        """
        new_stream = False
        if flags & TCP_SYN:
            isn_base = (seq + 1) & _M32
            if self.base is not None and self.base != isn_base:
                self.restart()
            if self.base is None:
                new_stream = True
            self.base = isn_base
            self.syn_seen = True
            self.initiator = not (flags & TCP_ACK)
            seq = isn_base  # SYN payload (TCP Fast Open) starts after the SYN's sequence number
        elif self.base is None:
            self.base = seq
        d = ((seq - self.base) - self.top) & _M32
        if d >= 0x80000000:
            d -= 0x100000000
        off = self.top + d
        end = off + payload_len
        if end > self.top:
            self.top = end
        return off, new_stream


class FlowTable(dict):
    """key -> FlowState, bounded: when full, the oldest quarter (insertion order) is forgotten."""

    def __init__(self, max_flows: int = 65536):
        super().__init__()
        self.max_flows = max_flows

    def add(self, flow: FlowState) -> FlowState:
        if len(self) >= self.max_flows:
            for k in list(islice(self, max(1, self.max_flows // 4))):
                del self[k]
        self[flow.key] = flow
        return flow
