"""Per flow-direction state: TCP stream offsets (from the ISN seen in the SYN, or the first sequence number
seen), the offset-keyed flips, the gloo tracker, whether the flow is excluded (control ports), and what the
flow table needs to pick flows to forget (closed, last seen).

A flow's flips are keyed on its ``identity()``, stable from run to run: for a connection whose SYN passed this
engine, the two addresses and its ordinal among the open connections between them in this direction
(``FlowTable.number``), never the ephemeral ports; for a flow first seen mid-stream, the 4-tuple
(docs/engine.md, "Seeds and reproducibility")."""

from __future__ import annotations

import numpy as np

__all__ = ["FlowState", "FlowTable", "flow_key_ints", "unwrap_offset", "TCP_FIN", "TCP_SYN", "TCP_RST",
           "TCP_ACK"]

TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_ACK = 0x10
_M32 = 0xFFFFFFFF
_OPEN = 1 << 62  # eviction order: open flows after every closed one


def flow_key_ints(key: bytes) -> tuple[int, int, int]:
    """The 12-byte key (src addr, dst addr, src port, dst port) as three 32-bit words, for seeding."""
    return (int.from_bytes(key[0:4], "big"), int.from_bytes(key[4:8], "big"), int.from_bytes(key[8:12], "big"))


def unwrap_offset(seq: int, base: int, reference: int = 0) -> int:
    """Stream offset of TCP sequence number ``seq`` in a stream whose byte 0 has sequence number ``base``
    (the ISN + 1 of the direction's SYN): ``(seq - base) mod 2**32``, unwrapped to the 64-bit value closest
    to ``reference`` (the highest offset seen so far), so streams longer than 4 GiB keep increasing offsets.
    Negative for bytes before ``base`` (a retransmitted SYN: ``seq == base - 1`` gives -1)."""
    d = ((seq - base) - reference) & _M32
    if d >= 0x80000000:
        d -= 0x100000000
    return reference + d


class FlowState:
    """One direction of one flow (a 4-tuple as it passes this engine)."""

    __slots__ = ("key", "excluded", "base", "top", "okf", "keyed_from", "tracker", "initiator", "conn",
                 "ordinal", "desync_counted", "closed", "last")

    def __init__(self, key: bytes, excluded: bool):
        self.key = key
        self.excluded = excluded
        self.base: int | None = None  # sequence number of stream offset 0
        self.top = 0  # highest stream offset (64-bit, unwrapped) seen so far, exclusive
        self.okf = None  # OffsetKeyedFlips, created on first use
        self.keyed_from = 0  # stream offset (bytes) where offset-keyed flips start (> 0 after a live switch)
        self.tracker = None  # GlooStreamTracker (scope tensor), only for flows whose SYN was seen
        self.initiator: bool | None = None
        self.conn = 0  # connection number on this 4-tuple (a new SYN restarts the stream)
        self.ordinal: int | None = None  # FlowTable.number, given at the SYN; None: first seen mid-stream
        self.desync_counted = False
        self.closed = False  # a FIN or RST went by (and no SYN since): forgotten first when the table is full
        self.last = 0  # when the flow was last seen (the engine's packet count): LRU order for the table

    def restart(self) -> None:
        """A new connection reuses the 4-tuple: forget the old stream."""
        self.forget_stream()
        self.tracker = None
        self.initiator = None
        self.conn += 1
        self.ordinal = None
        self.desync_counted = False

    def identity(self) -> tuple[int, bytes]:
        """What the flow's flips are keyed on: (number, 12-byte key). With a SYN seen: (``ordinal``, the two
        addresses and port pair 0, which TCP never uses); first seen mid-stream: (``conn``, the 4-tuple)."""
        if self.ordinal is None:
            return self.conn, self.key
        return self.ordinal, self.key[:8] + b"\0\0\0\0"

    def forget_stream(self) -> None:
        """Forget the stream position and the offset-keyed flips: the next packet starts the stream afresh
        (as a flow first seen mid-stream unless it is a SYN)."""
        self.base = None
        self.top = 0
        self.okf = None
        self.keyed_from = 0

    def stream_offset(self, seq: int, flags: int, payload_len: int) -> tuple[int, bool]:
        """Stream offset of the payload's first byte, and whether this packet starts a new stream (SYN).

        Offsets are 64-bit (``unwrap_offset`` against the highest offset seen). A flow first seen mid-stream
        counts from its first sequence number; bytes before it get negative offsets.
        """
        new_stream = False
        if flags & TCP_SYN:
            isn_base = (seq + 1) & _M32
            if self.base is not None and self.base != isn_base:
                self.restart()
            if self.base is None:
                new_stream = True
            self.base = isn_base
            self.initiator = not (flags & TCP_ACK)
            seq = isn_base  # SYN payload (TCP Fast Open) starts after the SYN's sequence number
        elif self.base is None:
            self.base = seq
        off = unwrap_offset(seq, self.base, self.top)
        end = off + payload_len
        if end > self.top:
            self.top = end
        return off, new_stream


class FlowTable(dict):
    """key -> FlowState, bounded: when full, a quarter of the flows is forgotten, those that saw a FIN or RST
    first, then the least recently seen (``FlowState.last``). Long-lived flows that are still active (a
    training job's connections) are kept: a forgotten flow that comes back is a flow first seen mid-stream,
    which scope ``tensor`` never corrupts."""

    def __init__(self, max_flows: int = 65536):
        super().__init__()
        self.max_flows = max_flows
        self.pairs: dict[bytes, dict[int, FlowState]] = {}  # address pair -> ordinal -> flow holding it

    def number(self, flow: FlowState) -> int:
        """Give a connection whose SYN just passed its ``ordinal``: the lowest one not held by another open
        connection (no FIN or RST seen, still in the table) between the same two addresses in this direction.
        Connections between two hosts opened in a deterministic order (gloo's pairs, one per process group)
        get the same ordinals in every run, also on a topology that stays up (the last run's are closed)."""
        held = self.pairs.setdefault(flow.key[:8], {})
        i = 0
        while True:
            f = held.get(i)
            if f is None or f is flow or f.closed or f.ordinal != i or self.get(f.key) is not f:
                held[i] = flow
                flow.ordinal = i
                return i
            i += 1

    def add(self, flow: FlowState) -> FlowState:
        if len(self) >= self.max_flows:
            self.evict(max(1, self.max_flows // 4))
        self[flow.key] = flow
        return flow

    def evict(self, n: int) -> None:
        """Forget ``n`` flows: closed ones first, then the least recently seen."""
        flows = list(self.values())
        if n >= len(flows):
            self.clear()
            self.pairs.clear()
            return
        order = np.fromiter((f.last if f.closed else f.last + _OPEN for f in flows), dtype=np.int64,
                            count=len(flows))
        for i in np.argpartition(order, n)[:n].tolist():
            f = flows[i]
            del self[f.key]
            held = self.pairs.get(f.key[:8])
            if held is not None and held.get(f.ordinal) is f:
                del held[f.ordinal]
                if not held:
                    del self.pairs[f.key[:8]]
