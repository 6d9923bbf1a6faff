"""Tests of testbed.engine.gloo on real gloo streams recorded by tests/gloo_capture.py.

The session fixture ``gloo_captures`` runs two real torch gloo ranks in namespaces tbG-a/tbG-b and records
their pair connection twice (TSO/GSO on; offloads off with MTU 1280). Everything here is checked against
those bytes: an independent sequential frame parser (written below, separately from the tracker), the known
tensor contents of the workload (gloo_capture.SCRIPT), and re-segmented / replayed / reordered / corrupted
versions of the recorded segments.
"""

from __future__ import annotations

import os
import random
import sys
from bisect import bisect_right
import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gloo_capture import SCRIPT, WORLD_SIZE, Direction, gloo_captures, op_sum, op_values  # noqa: E402,F401

from testbed.engine.flows import FlowState, unwrap_offset  # noqa: E402
from testbed.engine.gloo import (  # noqa: E402
    COLLECTIVE_CODES,
    GlooHeader,
    GlooStreamTracker,
    collective_codes,
    header_problem,
    parse_gloo_header,
)

pytestmark = pytest.mark.timeout(300)


def stream_offset(seq: int, isn: int, reference: int = 0) -> int:
    """Stream offset of ``seq`` in a direction whose SYN carried ``isn`` (the engine's ``unwrap_offset``)."""
    return unwrap_offset(seq, (isn + 1) & 0xFFFFFFFF, reference)

HYP = settings(max_examples=15, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------------------------------
# Independent reference: parse a reassembled stream sequentially (uses nbytes to advance, not the tracker)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    start: int  # offset of the 48-byte header
    nbytes: int
    opcode: int
    slot: int
    length: int

    @property
    def is_data(self) -> bool:
        return self.opcode in (0, 1)

    @property
    def payload(self) -> tuple[int, int]:
        return (self.start + 48, self.start + self.nbytes)

    @property
    def code(self) -> int:
        return self.slot >> 56

    @property
    def tag(self) -> int:
        return self.slot if self.code == 0 else (self.slot >> 24) & 0xFFFFFFFF


def reference_frames(stream: bytes, initiator: bool) -> list[Frame]:
    pos = 8 if initiator else 0
    frames = []
    while pos < len(stream):
        words = [int.from_bytes(stream[pos + 8 * k: pos + 8 * k + 8], "little") for k in range(6)]
        nbytes, opcode, slot, _off, length, _roff = words
        assert opcode in (0, 1, 2, 3), (pos, words)
        assert nbytes == 48 + (length if opcode in (0, 1) else 0), (pos, words)
        frames.append(Frame(pos, nbytes, opcode, slot, length))
        pos += nbytes
    assert pos == len(stream)
    return frames


def merge(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if s >= e:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(r) for r in out]


def clip(ranges, a: int, b: int) -> list[tuple[int, int]]:
    return merge((max(s, a), min(e, b)) for s, e in ranges if s < b and e > a)


def subtract(ranges, a: int, b: int) -> list[tuple[int, int]]:
    out = []
    for s, e in ranges:
        if e <= a or s >= b:
            out.append((s, e))
            continue
        if s < a:
            out.append((s, a))
        if e > b:
            out.append((b, e))
    return merge(out)


def feed(tracker: GlooStreamTracker, segments) -> list[tuple[int, int]]:
    got = []
    for off, data in segments:
        r = tracker.eligible(off, data)
        for s, e in r:
            assert off <= s < e <= off + len(data), (off, len(data), r)
        assert r == sorted(r)
        got.extend(r)
    return merge(got)


def pieces(stream: bytes, cuts) -> list[tuple[int, bytes]]:
    pts = sorted({c for c in cuts if 0 < c < len(stream)} | {0, len(stream)})
    return [(a, stream[a:b]) for a, b in zip(pts, pts[1:])]


@dataclass
class Dir:
    mode: str
    d: Direction
    stream: bytes
    frames: list[Frame]
    expected: list[tuple[int, int]]  # merged payload ranges of all data frames

    @property
    def captured(self) -> list[tuple[int, bytes]]:
        """The recorded segments in capture order (may contain real reordering/retransmissions)."""
        return self.d.data_segments()

    @property
    def segments(self) -> list[tuple[int, bytes]]:
        """The recorded segmentation in stream order, each byte once (the in-order base of most tests)."""
        out, end = [], 0
        for off, data in sorted(self.captured, key=lambda t: t[0]):
            if off + len(data) <= end:
                continue
            if off < end:
                data, off = data[end - off:], end
            out.append((off, data))
            end = off + len(data)
        return out

    def expected_for(self, codes) -> list[tuple[int, int]]:
        return merge(f.payload for f in self.frames if f.is_data and f.length and f.code in codes)


@pytest.fixture(scope="session")
def dirs(gloo_captures) -> list[Dir]:
    out = []
    for mode, cap in gloo_captures.items():
        for conn in cap.data_connections():
            for d in conn.directions:
                stream = d.stream()
                frames = reference_frames(stream, d.initiator)
                expected = merge(f.payload for f in frames if f.is_data and f.length)
                out.append(Dir(mode, d, stream, frames, expected))
    assert out
    return out


def ids(dirs_):
    return [f"{x.mode}:{'init' if x.d.initiator else 'resp'}" for x in dirs_]


# --------------------------------------------------------------------------------------------------------------
# The recordings themselves
# --------------------------------------------------------------------------------------------------------------


def test_recordings_are_what_the_tests_need(gloo_captures, dirs):
    for mode, cap in gloo_captures.items():
        for rank in range(WORLD_SIZE):
            assert [r["ok"] for r in cap.results[rank]] == [True] * len(SCRIPT), (mode, rank, cap.results)
        conns = cap.data_connections()
        assert len(conns) == 1, f"{mode}: expected one gloo pair connection for 2 ranks, got {len(conns)}"
    straddling = 0
    for x in dirs:
        sizes = [len(p) for _, p in x.segments]
        if x.mode == "tso":
            assert max(sizes) > 1500, "TSO/GSO capture should contain large segments"
        else:
            assert max(sizes) <= 1280 - 40, "MTU 1280 capture should only contain MSS-sized segments"
            bounds = {off for off, _ in x.segments}
            straddling += sum(any(b in bounds for b in range(f.start + 1, f.start + 48)) for f in x.frames)
        if x.d.initiator:
            # gloo's handshake: int64 LE, the listener-side pair's sequence number (== the initiator's rank)
            assert int.from_bytes(x.stream[:8], "little", signed=True) == x.d.src_rank
    # the asynchronous burst of the MTU 1280 recording packs frames into segments: headers straddle packets
    assert straddling >= 2, straddling


# --------------------------------------------------------------------------------------------------------------
# Real traffic: exact classification
# --------------------------------------------------------------------------------------------------------------


def test_real_streams_exact(dirs):
    for x in dirs:
        t = GlooStreamTracker(x.d.initiator)
        got = feed(t, x.segments)
        assert not t.desynced, (x.mode, t.desync_reason)
        assert got == x.expected, x.mode
        assert t.frontier == len(x.stream)
        before = 0  # shift_of: s - shift_of(s) is the number of eligible bytes before s (the engine's flip key)
        for s, e in got:
            assert s - t.shift_of(s) == before and e - 1 - t.shift_of(e - 1) == before + e - s - 1, x.mode
            before += e - s
        data = [f for f in x.frames if f.is_data]
        assert t.frames == len(x.frames) and t.data_frames == len(data)
        payload = sum(f.length for f in data)
        assert t.eligible_bytes == t.payload_bytes == payload
        assert t.header_bytes == len(x.stream) - payload
        # every header byte (and the handshake) is outside the eligible set
        for f in x.frames:
            assert clip(got, f.start, f.start + 48) == []
        assert clip(got, 0, 8 if x.d.initiator else 0) == []


def test_real_streams_aligned(dirs):
    """eligible_aligned answers eligible's ranges with each frame's value grid: torch sends unbound buffers,
    so the origin is the payload start of the frame holding the range (reference parse), on the recorded
    segmentation, in capture order (retransmissions, reordering) and byte by byte around headers."""
    for x in dirs:
        starts = [f.payload[0] for f in x.frames if f.is_data and f.length]
        for segs in (x.segments, x.captured):
            t, ref = GlooStreamTracker(x.d.initiator), GlooStreamTracker(x.d.initiator)
            for off, data in segs:
                got = t.eligible_aligned(off, data)
                assert [(s, e) for s, e, _ in got] == ref.eligible(off, data), (x.mode, off)
                for s, e, o in got:
                    assert o == starts[bisect_right(starts, s) - 1] and t.origin_of(e - 1) == o, (x.mode, s, o)
            assert not t.desynced and t.frontier == len(x.stream)
        t = GlooStreamTracker(x.d.initiator)
        for k in range(min(len(x.stream), 20000)):  # 1-byte segments: every header split, every path
            for s, e, o in t.eligible_aligned(k, x.stream[k:k + 1]):
                assert o == starts[bisect_right(starts, s) - 1]


def test_real_capture_order(dirs):
    """Segments in the order tcpdump saw them, with whatever real reordering or retransmission the veth
    produced (the receiving side of a veth reorders now and then): a segment that starts at or below the
    contiguous frontier gets exactly its reference ranges, one beyond it gets []."""
    for x in dirs:
        t = GlooStreamTracker(x.d.initiator)
        received: list[tuple[int, int]] = []
        for off, data in x.captured:
            end = off + len(data)
            frontier = received[0][1] if received and received[0][0] == 0 else 0
            want = clip(x.expected, off, end) if off <= frontier else []
            assert t.eligible(off, data) == want, (x.mode, off, frontier)
            received = merge(received + [(off, end)])
        assert not t.desynced and t.frontier == len(x.stream)
        assert t.eligible_bytes == sum(e - s for s, e in x.expected)


def _float_slice(payload: bytes, arr: np.ndarray) -> tuple[int, int] | None:
    """[i, j) if ``payload`` is the float32 bytes of arr[i:j], else None (arr is an arithmetic progression)."""
    if len(payload) % 4:
        return None
    p = np.frombuffer(payload, dtype=np.float32)
    step = float(arr[1] - arr[0]) if len(arr) > 1 else 1.0
    i = (float(p[0]) - float(arr[0])) / step
    if i != int(i) or i < 0:
        return None
    i = int(i)
    j = i + len(p)
    if j > len(arr) or arr[i:j].tobytes() != payload:
        return None
    return (i, j)


def test_known_tensor_contents(dirs):
    """The eligible bytes are the workload's tensors, frame by frame, and all of them."""
    # torch's gloo tag = collective counter: one per collective call (point-to-point uses the user tag).
    tag_of = {}
    k = 0
    for i, step in enumerate(SCRIPT):
        if step["op"] != "sendrecv":
            tag_of[i] = k
            k += 1
    code_of_op = {"barrier": 0x07, "allreduce": 0x04, "reduce_scatter": 0x04, "broadcast": 0x06,
                  "allgather": 0x02, "alltoall": 0x08, "sendrecv": 0x00}
    for mode in sorted({x.mode for x in dirs}):
        mdirs = [x for x in dirs if x.mode == mode]
        coverage: dict[int, list] = {}
        checked = 0
        for x in mdirs:
            t = GlooStreamTracker(x.d.initiator)
            eligible = feed(t, x.segments)
            src, dst = x.d.src_rank, x.d.dst_rank
            by_op: dict[int, list[Frame]] = {}
            for f in x.frames:
                if not f.is_data:
                    continue
                if f.code == 0:
                    ops = [i for i, s in enumerate(SCRIPT) if s["op"] == "sendrecv" and s["tag"] == f.tag
                           and s["src"] == src]
                else:
                    ops = [i for i, kk in tag_of.items() if kk == f.tag]
                assert len(ops) == 1, (mode, f)
                i = ops[0]
                assert f.code == code_of_op[SCRIPT[i]["op"]], (SCRIPT[i], hex(f.slot))
                by_op.setdefault(i, []).append(f)
            for i, frames in by_op.items():
                step = SCRIPT[i]
                op = step["op"]
                for f in frames:
                    a, b = f.payload
                    if a < b:  # the whole payload is eligible
                        assert clip(eligible, a, b) == [(a, b)]
                payload = b"".join(x.stream[f.payload[0]:f.payload[1]] for f in frames)
                if op == "barrier":
                    assert payload == b""
                elif op in ("allreduce", "reduce_scatter"):
                    mine, total = op_values(i, src), op_sum(i)
                    for f in frames:
                        chunk = x.stream[f.payload[0]:f.payload[1]]
                        own = _float_slice(chunk, mine)
                        red = _float_slice(chunk, total)
                        assert own or red, (mode, step, f)
                        if red:
                            coverage.setdefault(i, []).append(red)
                        checked += len(chunk)
                elif op == "broadcast":
                    assert src == step["root"]
                    assert payload == op_values(i, src).tobytes()
                    checked += len(payload)
                elif op == "allgather":
                    assert payload == op_values(i, src).tobytes()
                    checked += len(payload)
                elif op == "sendrecv":
                    assert payload == op_values(i, src).tobytes()
                    checked += len(payload)
                elif op == "alltoall":
                    part = step["n"] // WORLD_SIZE
                    assert payload == op_values(i, src)[dst * part:(dst + 1) * part].tobytes()
                    checked += len(payload)
            # every op that moves data between the ranks is seen in this direction
            for i, step in enumerate(SCRIPT):
                if step["op"] == "sendrecv" and step["src"] != src:
                    continue
                if step["op"] == "broadcast" and step["root"] != src:
                    continue
                assert i in by_op, (mode, x.d.name, step)
        # allreduce: the reduced values of every element cross the link (the allgather phase)
        for i, step in enumerate(SCRIPT):
            if step["op"] in ("allreduce", "reduce_scatter"):
                assert merge(coverage[i]) == [(0, step["n"])], (mode, step)
        assert checked == sum(x.expected[k][1] - x.expected[k][0] for x in mdirs for k in range(len(x.expected)))


# --------------------------------------------------------------------------------------------------------------
# Segmentation independence
# --------------------------------------------------------------------------------------------------------------


def test_one_byte_segments(dirs):
    """Feeding the first 96 KiB of every stream one byte at a time (dozens of headers) changes nothing."""
    for x in dirs:
        n = min(len(x.stream), 96 << 10)
        t = GlooStreamTracker(x.d.initiator)
        got = feed(t, ((i, x.stream[i:i + 1]) for i in range(n)))
        assert not t.desynced
        assert got == clip(x.expected, 0, n)
        assert t.frontier == n


@st.composite
def cut_plans(draw):
    # cut points as fractions of the stream, and headers around which to cut into 1-byte pieces
    fractions = draw(st.lists(st.floats(0, 1, allow_nan=False), max_size=300))
    headers = draw(st.lists(st.floats(0, 1, allow_nan=False), max_size=12))
    widths = draw(st.lists(st.integers(1, 80), min_size=1, max_size=4))
    return fractions, headers, widths


@HYP
@given(plan=cut_plans())
def test_random_resegmentation(dirs, plan):
    fractions, headers, widths = plan
    for x in dirs:
        n = len(x.stream)
        cuts = {int(fr * n) for fr in fractions}
        for h_i, h in enumerate(headers):
            f = x.frames[int(h * (len(x.frames) - 1))]
            w = widths[h_i % len(widths)]
            cuts.update(range(f.start - w, f.start + 48 + w))  # 1-byte pieces across a header
        if x.d.initiator:
            cuts.update(range(0, 10))  # and across the handshake
        t = GlooStreamTracker(x.d.initiator)
        got = feed(t, pieces(x.stream, cuts))
        assert not t.desynced, t.desync_reason
        assert got == x.expected


# --------------------------------------------------------------------------------------------------------------
# Retransmissions and out-of-order delivery
# --------------------------------------------------------------------------------------------------------------


def test_retransmissions_get_the_same_ranges(dirs):
    rng = random.Random(7)
    for x in dirs:
        segs = x.segments
        t = GlooStreamTracker(x.d.initiator)
        first = []
        replays = partials = 0
        for k, (off, data) in enumerate(segs):
            first.extend(t.eligible(off, data))
            if k and rng.random() < 0.3:
                # full retransmission of an earlier segment
                o2, d2 = segs[rng.randrange(max(0, k - 40), k + 1)]
                assert t.eligible(o2, d2) == clip(x.expected, o2, o2 + len(d2))
                replays += 1
            if k + 1 < len(segs) and rng.random() < 0.3:
                # partial retransmission: old bytes + new bytes beyond the frontier (like a coalesced resend)
                f = t.frontier
                nxt_off, nxt = segs[k + 1]
                if nxt_off == f and len(nxt) > 1:
                    a = max(0, f - rng.randint(1, 3000))
                    b = f + rng.randint(1, len(nxt) - 1)
                    r = t.eligible(a, x.stream[a:b])
                    assert merge(r) == r and r == clip(x.expected, a, b)
                    first.extend(r)
                    partials += 1
                    segs[k + 1] = (b, nxt[b - f:])  # the rest of that segment arrives next
        assert not t.desynced
        assert replays and partials
        assert merge(first) == x.expected
        assert t.retransmitted_bytes > 0
        assert t.eligible_bytes == sum(e - s for s, e in x.expected)


def test_retransmission_older_than_history_is_not_eligible(dirs):
    x = max(dirs, key=lambda y: len(y.stream))
    t = GlooStreamTracker(x.d.initiator, history_bytes=64 << 10)
    feed(t, x.segments)
    a, b = x.expected[0]
    assert t.eligible(a, x.stream[a:b]) == []
    assert t.stale_bytes >= b - a
    # recent history is still answered
    a, b = x.expected[-1]
    assert t.eligible(a, x.stream[a:b]) == [(a, b)]


def test_out_of_order_segments(dirs):
    """A segment beyond a gap is answered [] (buffered); once the gap is filled, tracking continues and
    the final eligible set is the reference minus the out-of-order segments themselves. A later
    retransmission of such a segment gets its true ranges."""
    rng = random.Random(11)
    for x in dirs:
        segs = list(x.segments)
        # choose non-overlapping places to reorder: swap two neighbours, or hold one back for 5 segments
        order = list(range(len(segs)))
        late: set[int] = set()
        k = 1
        while k < len(order) - 7:
            if rng.random() < 0.08:
                hold = rng.choice([1, 5])
                i = order[k]
                order[k:k + hold + 1] = order[k + 1:k + hold + 1] + [i]
                late.update(order[k:k + hold])  # these arrive before segment i: out of order
                k += hold + 2
            else:
                k += 1
        assert late
        t = GlooStreamTracker(x.d.initiator)
        got = []
        for j in order:
            off, data = segs[j]
            r = t.eligible(off, data)
            if j in late:
                assert r == []
            got.extend(r)
        assert not t.desynced, t.desync_reason
        assert t.frontier == len(x.stream) and t.ooo_bytes == sum(len(segs[j][1]) for j in late)
        expect = x.expected
        for j in late:
            expect = subtract(expect, segs[j][0], segs[j][0] + len(segs[j][1]))
        assert merge(got) == expect
        for j in late:  # retransmissions of the out-of-order segments get the same ranges as everyone else
            off, data = segs[j]
            assert t.eligible(off, data) == clip(x.expected, off, off + len(data))


def test_out_of_order_buffer_is_bounded(dirs):
    x = next(y for y in dirs if y.mode == "mtu1280" and not y.d.initiator)
    segs = x.segments
    t = GlooStreamTracker(x.d.initiator, max_ooo_bytes=10_000)
    t.eligible(*segs[0])
    for off, data in segs[2:40]:  # segment 1 never arrives
        assert t.eligible(off, data) == []
    assert t.desynced and "out-of-order" in t.desync_reason
    assert t.eligible(*segs[1]) == []


def test_zero_length_and_keepalive_segments(dirs):
    x = next(y for y in dirs if y.mode == "tso")
    t = GlooStreamTracker(x.d.initiator)
    got = []
    for off, data in x.segments:
        assert t.eligible(off, b"") == []
        assert t.eligible(t.frontier, b"") == []
        if t.frontier:
            # TCP keep-alive: one old byte at frontier - 1
            f = t.frontier
            assert t.eligible(f - 1, x.stream[f - 1:f]) == clip(x.expected, f - 1, f)
        got.extend(t.eligible(off, memoryview(data)))
    assert merge(got) == x.expected and not t.desynced


# --------------------------------------------------------------------------------------------------------------
# Desynchronisation
# --------------------------------------------------------------------------------------------------------------


def _corrupt(x: Dir, pos: int, value: int) -> list[tuple[int, bytes]]:
    s = bytearray(x.stream)
    s[pos] = value
    s = bytes(s)
    return [(off, s[off:off + len(d)]) for off, d in x.segments]


@pytest.mark.parametrize("field,keyword", [
    ("opcode", "opcode"), ("nbytes", "nbytes"), ("slot_top", "collective code"), ("slot_unused", "unused bits"),
    ("length_data", "nbytes"), ("offset_unbound", "offset"), ("handshake", "handshake"),
])
def test_corrupted_header_desyncs(dirs, field, keyword):
    rng = random.Random(hash(field) & 0xFFFF)
    for x in dirs:
        if field == "handshake":
            if not x.d.initiator:
                continue
            pos, val = 7, 0x80  # sign bit of the int64
            at = 0
        else:
            pool = [f for f in x.frames if (f.is_data and f.length) or field not in ("length_data",)]
            if field == "offset_unbound":
                pool = [f for f in pool if f.opcode == 1]
            if field == "slot_unused":
                pool = [f for f in pool if f.code != 0]
            f = rng.choice(pool[1:])
            at = f.start
            pos, val = {
                "opcode": (at + 8, 9),
                "nbytes": (at + 0, x.stream[at] ^ 0x01),
                "slot_top": (at + 23, 0x42),
                "slot_unused": (at + 17, 0x01),
                "length_data": (at + 32, x.stream[at + 32] ^ 0x04),
                "offset_unbound": (at + 24, 0x01),
            }[field]
        t = GlooStreamTracker(x.d.initiator)
        got = feed(t, _corrupt(x, pos, val))
        assert t.desynced, (field, x.mode)
        assert keyword in t.desync_reason, t.desync_reason
        # nothing at or after the bad header was ever eligible; before it, the reference ranges
        assert clip(got, at, len(x.stream)) == []
        # the segment that completes the bad header (and everything after it) answers []
        seg_start = max(o for o, _ in x.segments if o <= (at + 47 if field != "handshake" else 7))
        assert got == clip(x.expected, 0, seg_start)
        # permanently
        assert t.eligible(x.expected[-1][0], x.stream[x.expected[-1][0]:x.expected[-1][1]]) == []


def test_wrong_direction_role_desyncs(dirs):
    """Tracking a direction with the wrong initiator flag (off by the 8-byte handshake) desyncs at once."""
    for x in dirs:
        t = GlooStreamTracker(not x.d.initiator)
        feed(t, x.segments[:20])
        assert t.desynced, x.mode


def test_random_bytes_desync_seeded():
    rng = np.random.default_rng(1234)
    for k in range(200):
        data = rng.integers(0, 256, size=int(rng.integers(56, 5000)), dtype=np.uint8).tobytes()
        t = GlooStreamTracker(bool(k % 2))
        off = 0
        while off < len(data):
            n = int(rng.integers(1, 1500))
            t.eligible(off, data[off:off + n])
            off += n
        assert t.desynced and t.desync_reason


def test_non_gloo_text_desyncs():
    for initiator in (True, False):
        t = GlooStreamTracker(initiator)
        msg = b"GET / HTTP/1.1\r\nHost: 10.98.0.1\r\n\r\n" * 4
        assert t.eligible(0, msg) == []
        assert t.desynced


@HYP
@given(data=st.binary(max_size=600), initiator=st.booleans(),
       ops=st.lists(st.tuples(st.integers(-20, 700), st.integers(0, 200)), max_size=40))
def test_random_input_never_raises(data, initiator, ops):
    t = GlooStreamTracker(initiator, max_ooo_bytes=1000, history_bytes=100)
    for off, n in ops:
        chunk = data[max(off, 0):max(off, 0) + n]
        r = t.eligible(off, chunk)
        for s, e in r:
            assert off <= s < e <= off + len(chunk)
        if t.desynced:
            assert r == []
    t.stats()


# --------------------------------------------------------------------------------------------------------------
# Collective filter
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [{"allreduce"}, {"broadcast"}, {"p2p"}, {"allgather", "alltoall"},
                                   {"reduce_scatter"}, {"barrier"}])
def test_collective_filter(dirs, names):
    codes = collective_codes(names)
    for x in dirs:
        t = GlooStreamTracker(x.d.initiator, collectives=names)
        got = feed(t, x.segments)
        assert not t.desynced
        assert got == x.expected_for(codes)
        assert t.payload_bytes == sum(e - s for s, e in x.expected)
        assert t.eligible_bytes == sum(e - s for s, e in got)
        if names == {"allreduce"}:
            bcast = x.expected_for({0x06})
            assert all(clip(got, s, e) == [] for s, e in bcast)
            if x.d.src_rank == 0:
                assert bcast, "rank 0 broadcasts: its direction must carry broadcast payload"
        # retransmissions obey the filter too
        for s, e in x.expected[:5]:
            assert t.eligible(s, x.stream[s:e]) == clip(got, s, e)


def test_filter_names():
    assert collective_codes(None) is None
    assert collective_codes({"allreduce", "reduce_scatter"}) == {0x04}
    assert collective_codes(["P2P", "all-gather"]) == {0x00, 0x02}
    assert collective_codes("broadcast") == {0x06}
    with pytest.raises(ValueError):
        collective_codes({"allreduse"})
    with pytest.raises(ValueError):
        GlooStreamTracker(True, collectives={"nope"})


# --------------------------------------------------------------------------------------------------------------
# Small pure functions
# --------------------------------------------------------------------------------------------------------------


def test_parse_gloo_header_on_real_headers(dirs):
    x = next(y for y in dirs if not y.d.initiator)
    seen = set()
    for f in x.frames:
        h = parse_gloo_header(x.stream, f.start)
        assert isinstance(h, GlooHeader)
        assert (h.nbytes, h.opcode, h.slot, h.length) == (f.nbytes, f.opcode, f.slot, f.length)
        assert h.payload_length == (f.length if f.is_data else 0)
        assert h.collective == COLLECTIVE_CODES[f.code] and h.tag == f.tag
        assert header_problem(h) is None
        assert parse_gloo_header(x.stream[f.start:f.start + 48]) == h
        seen.add(h.collective)
    assert {"allreduce", "broadcast", "allgather", "barrier", "p2p", "alltoall"} <= seen
    h = parse_gloo_header(x.stream, x.frames[0].start)
    assert header_problem(h._replace(opcode=4)) == "bad opcode 4"
    assert "max_frame_bytes" in header_problem(h._replace(opcode=1, length=100, nbytes=148), max_frame_bytes=99)


def test_max_frame_bytes_desyncs(dirs):
    x = next(y for y in dirs if y.mode == "tso" and y.d.src_rank == 0)
    t = GlooStreamTracker(x.d.initiator, max_frame_bytes=1 << 20)  # the 1.2 MB broadcast frame is larger
    feed(t, x.segments)
    assert t.desynced and "max_frame_bytes" in t.desync_reason


def test_stream_offset_wraparound():
    isn = 0xFFFFFF00
    assert stream_offset((isn + 1) & 0xFFFFFFFF, isn) == 0
    assert stream_offset(0x10, isn) == 0x10 + 0xFF
    assert stream_offset(isn, isn) == -1  # a retransmitted SYN
    big = (1 << 32) + 5000  # 4 GiB into the stream
    seq = (isn + 1 + big) & 0xFFFFFFFF
    assert stream_offset(seq, isn, reference=big - 70000) == big
    assert stream_offset(seq, isn, reference=big + 70000) == big  # retransmission behind the frontier
    assert stream_offset(seq, isn) == 5000  # without a reference: modulo 2**32


def test_recorded_offsets_through_stream_offset(dirs):
    for x in dirs:
        t = GlooStreamTracker(x.d.initiator)
        got = []
        for s in x.d.segments:
            if s.payload:
                got.extend(t.eligible(stream_offset(s.seq, x.d.isn, t.frontier), s.payload))
        assert not t.desynced and t.frontier == len(x.stream)
        for s in x.d.segments:  # everything again, as retransmissions: now every byte is classified
            if s.payload:
                got.extend(t.eligible(stream_offset(s.seq, x.d.isn, t.frontier), s.payload))
        assert merge(got) == x.expected


def test_recorded_offsets_through_flow_state(dirs):
    """The engine's path: FlowState.stream_offset on every recorded packet (SYN included) feeds the tracker."""
    for x in dirs:
        flow = FlowState(bytes(12), False)
        t = None
        got = []
        for _ in range(2):  # the second time, everything as retransmissions: every byte is classified
            for s in x.d.segments:
                flags = sum(bit for ch, bit in (("F", 0x01), ("S", 0x02), ("R", 0x04), ("A", 0x10))
                            if ch in s.flags)
                off, new_stream = flow.stream_offset(s.seq, flags, len(s.payload))
                if new_stream:
                    assert t is None and flow.initiator == x.d.initiator
                    t = GlooStreamTracker(flow.initiator)
                if s.payload:
                    got.extend(t.eligible(off, s.payload))
            assert not t.desynced and t.frontier == len(x.stream)
        assert merge(got) == x.expected


def test_hot_path_is_cheap(dirs):
    """Segments inside a payload take the O(1) path; report the cost (loose bound: shared 2-vCPU machine)."""
    x = max((y for y in dirs if y.mode == "mtu1280"), key=lambda y: max(e - s for s, e in y.expected))
    a, b = max(x.expected, key=lambda r: r[1] - r[0])
    t = GlooStreamTracker(x.d.initiator)
    feed(t, pieces(x.stream[:a], range(0, a, 1228)))
    mv = memoryview(x.stream)
    segs = [(o, mv[o:min(o + 1228, b)]) for o in range(a, b, 1228)]
    e0 = t.eligible_bytes
    t0 = time.perf_counter()
    for o, d in segs:
        t.eligible(o, d)
    per_call = (time.perf_counter() - t0) / len(segs)
    assert t.frontier == b and t.eligible_bytes - e0 == b - a
    print(f"hot path: {per_call * 1e6:.2f} us per segment over {len(segs)} segments")
    assert per_call < 50e-6
    t = GlooStreamTracker(x.d.initiator)  # the same with the value grid (what scope tensor uses with protect)
    feed(t, pieces(x.stream[:a], range(0, a, 1228)))
    t0 = time.perf_counter()
    for o, d in segs:
        t.eligible_aligned(o, d)
    aligned = (time.perf_counter() - t0) / len(segs)
    assert t.frontier == b
    print(f"hot path, eligible_aligned: {aligned * 1e6:.2f} us per segment")
    assert aligned < 50e-6


# --------------------------------------------------------------------------------------------------------------
# The same rows against the bpf engine's tracker (flip.c, tb_keyed), replayed through the loaded program
# --------------------------------------------------------------------------------------------------------------
# The recorded directions are fed, packet by packet, to the bpf program (BPF_PROG_TEST_RUN: the real program,
# maps and helpers, attached nowhere) and to the NFQUEUE engine's corruptor, both in scope tensor with
# error_model counter at a BER high enough to flip bits in most frames: equal streams must give equal flips
# (the tracker's eligible ranges and the counter function's keys agree), and every flip must land in a data
# frame's payload (the reference parse above). Frames of at most 1448 payload bytes: a test run takes one page.

BPF_BER = 5e-4
ISN = 0x7FFFFF00  # near a wrap: stream offsets cross 2^32 - ISN within the first bytes


def _bpf_or_skip():
    if os.geteuid() != 0:
        pytest.skip("the bpf program needs root")
    from testbed.engine.bpf import engine as bpf_engine

    ok, why = bpf_engine.available()
    if not ok:
        pytest.skip(why)
    return bpf_engine


_TCP_FLAGS = {"S": 0x02, "SA": 0x12, "PA": 0x18}


def _frame(x: Dir, off: int, data: bytes, flags: str = "PA") -> bytes:
    """Ethernet + IPv4 + TCP (no options) + data, built by hand (Scapy's per-packet cost dominated these tests;
    neither engine checks the checksums it is handed)."""
    import socket
    import struct

    (sa, sp), (da, dp) = x.d.src, x.d.dst
    seq = (ISN + 1 + off) & 0xFFFFFFFF if "S" not in flags else ISN
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + len(data), 1, 0x4000, 64, 6, 0, socket.inet_aton(sa),
                     socket.inet_aton(da))
    tcp = struct.pack("!HHIIBBHHH", sp, dp, seq, 1, 5 << 4, _TCP_FLAGS[flags], 65535, 0, 0)
    return b"\x02\0\0\0\0\x02\x02\0\0\0\0\x01\x08\x00" + ip + tcp + data


def _mss(segments, size: int = 1448):
    for off, data in segments:
        for k in range(0, len(data), size):
            yield off + k, data[k:k + size]


def _replay(x: Dir, segments, tmp_path, **settings):
    """Feed the SYN and ``segments`` (stream offset, bytes) to both engines; return (bpf flips, NFQUEUE flips,
    bpf stats): flips as sorted stream bit offsets, each transmission's counted (a resent range's flips again)."""
    from testbed.engine.config import EngineSpec
    from testbed.engine.corruptor import Corruptor

    bpf_engine = _bpf_or_skip()
    kw = dict(ber=BPF_BER, scope="tensor", error_model={"type": "counter"}, seed=7, **settings)
    spec = EngineSpec(netns="/run/netns/none", iface="veth0", control_socket=str(tmp_path / "e.sock"),
                      stats_file=str(tmp_path / "e.stats.json"), engine="bpf", **kw)
    corr = Corruptor(EngineSpec(netns="/run/netns/none", iface="veth0", control_socket="/nonexistent.sock",
                                stats_file="/nonexistent.json", **kw).validate())
    syn = "S" if x.d.initiator else "SA"
    flips = {"bpf": [], "nfqueue": []}
    with bpf_engine.FrameRunner(spec, tmp_path / "pins") as runner:
        for off, data in [(0, b""), *segments]:
            frame = _frame(x, off, data, syn if off == 0 and not data else "PA")
            out_b = runner.run(frame)
            out_n = corr.process(frame[14:])
            out_n = frame[14:] if out_n is None else bytes(out_n)
            for name, out in (("bpf", out_b[-len(data):] if data else b""), ("nfqueue", out_n[-len(data):] if data
                                                                                   else b"")):
                if not data:
                    continue
                diff = np.frombuffer(out, np.uint8) ^ np.frombuffer(data, np.uint8)
                bad = np.flatnonzero(diff)
                bits = np.flatnonzero(np.unpackbits(diff[bad]).reshape(-1, 8))
                flips[name] += (8 * (off + bad[bits // 8].astype(np.int64)) + bits % 8).tolist()
        st = runner.stats()
    return sorted(flips["bpf"]), sorted(flips["nfqueue"]), st


def _inside(bits, ranges) -> bool:
    starts = [s for s, _ in ranges]
    for b in bits:
        i = bisect_right(starts, b // 8) - 1
        if i < 0 or not ranges[i][0] <= b // 8 < ranges[i][1]:
            return False
    return True


def test_bpf_tracker_equal_flips_in_order(dirs, tmp_path):
    """Both recordings, both directions, in stream order cut at 1448 bytes (the first 1,200 packets of each: every
    kind of frame of the workload's first part): the bpf program's flips are the NFQUEUE engine's, all inside data
    payloads, thousands of them; every byte parsed, none desynced."""
    for x in dirs:
        segs = list(_mss(x.segments))[:1200]
        b, n, st = _replay(x, segs, tmp_path)
        end = segs[-1][0] + len(segs[-1][1])
        payload = sum(max(0, min(e, end) - s) for s, e in x.expected)
        assert b == n, (x.mode, x.d.initiator, len(b), len(n))
        assert _inside(b, x.expected)
        assert len(b) > 0.5 * BPF_BER * 8 * payload, (len(b), payload)
        assert st["flows_desynced"] == 0 and st["packets_errors"] == 0 and st["bits_seen"] == 8 * payload, st
        assert st["frames"] == sum(f.start + 48 <= end for f in x.frames)


def test_bpf_tracker_headers_split_everywhere(dirs, tmp_path):
    """The first 2,000 stream bytes one byte a packet (the handshake and the first headers split at every byte),
    then 97-byte packets up to 200 KB (headers split at every phase), then 1448: the same flips as the NFQUEUE
    engine."""
    for x in dirs:
        n1, n2 = min(2000, len(x.stream)), min(200_000, len(x.stream))
        segs = [(k, x.stream[k:k + 1]) for k in range(n1)]
        segs += list(_mss([(n1, x.stream[n1:n2])], 97)) + list(_mss([(n2, x.stream[n2:])]))
        b, n, st = _replay(x, segs, tmp_path)
        assert b == n and _inside(b, x.expected) and st["flows_desynced"] == 0, (x.mode, len(b), len(n))


def test_bpf_tracker_retransmissions_get_the_same_flips(dirs, tmp_path):
    """Every third packet is sent again after the next one (a retransmission, cut differently: its second half
    only): each resent byte carries its original's flips, in both engines (the first 250 packets of each
    direction)."""
    for x in dirs:
        segs = list(_mss(x.segments))[:250]
        replayed = []
        for i, (off, data) in enumerate(segs):
            replayed.append((off, data))
            if i % 3 == 1:
                po, pd = segs[i - 1]
                h = len(pd) // 2
                replayed.append((po + h, pd[h:]))
        b, n, st = _replay(x, replayed, tmp_path)
        assert b == n, (x.mode, len(b), len(n))
        first = set(_replay(x, segs, tmp_path)[0])
        assert set(b) == first and len(b) > len(first)  # the resent bits flipped again, the same ones
        assert st["retransmitted_bits"] > 0 and st["retransmitted_flips"] > 0


def test_bpf_tracker_fails_closed(dirs, tmp_path):
    """A segment beyond the parsed frontier across a frame header (out of order) or a header gloo would not write
    (a corrupted opcode): the bpf program passes the flow clean from there on and counts it; it never flips a
    byte the NFQUEUE engine (which buffers out-of-order bytes) would not."""
    x = max(dirs, key=lambda d: len(d.frames))
    segs = list(_mss(x.segments))[:1500]
    heads = {f.start for f in x.frames}
    k = next(i for i in range(len(segs) // 2, len(segs) - 1)
             if any(segs[i + 1][0] <= h < segs[i + 1][0] + len(segs[i + 1][1]) for h in heads))
    swapped = segs[:k] + [segs[k + 1], segs[k]] + segs[k + 2:]
    b, n, st = _replay(x, swapped, tmp_path)
    assert st["flows_desynced"] == 1 and st["desync_out_of_order"] == 1
    assert set(b) <= set(n) and b and max(b) < 8 * segs[k + 1][0]
    stream = bytearray(x.stream[:segs[-1][0]])
    f = [f for f in x.frames if f.start + 48 < len(stream)][-20]
    stream[f.start + 8] = 9  # opcode 9
    b, n, st = _replay(x, list(_mss([(0, bytes(stream))])), tmp_path)
    assert st["flows_desynced"] == 1 and set(b) <= set(n) and max(b) < 8 * f.start


def test_bpf_tracker_reordered_inside_a_frame(dirs, tmp_path):
    """Segments that reach the hook out of order inside one frame's payload (an ingress hook sees that: veth hands
    frames to the backlog of the sender's CPU): the bpf program corrupts the later one as it stands and the
    earlier one, when it comes, as new bytes of the same frame: the flips and counts of the in-order stream."""
    x = max(dirs, key=lambda d: max(f.length for f in d.frames if f.is_data))
    big = max((f for f in x.frames if f.is_data), key=lambda f: f.length)
    segs = [sg for sg in _mss(x.segments) if sg[0] < big.payload[1] + 20_000]  # up to just past the big frame
    inside = [i for i in range(len(segs) - 1) if big.payload[0] <= segs[i][0]
              and segs[i + 1][0] + len(segs[i + 1][1]) <= big.payload[1]]
    assert len(inside) > 20
    swapped = list(segs)
    for i in inside[::7]:
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    b, _, st = _replay(x, swapped, tmp_path)
    want, _, st0 = _replay(x, segs, tmp_path)
    assert b == want and st["flows_desynced"] == 0 and st["tensor_holes"] >= len(inside[::7]) - 1
    assert (st["bits_seen"], st["bits_flipped"]) == (st0["bits_seen"], st0["bits_flipped"])


@pytest.mark.parametrize("names", [{"allreduce"}, {"p2p"}, {"broadcast", "allgather"}],
                         ids=lambda n: "+".join(sorted(n)))
def test_bpf_tracker_collective_filter(dirs, tmp_path, names):
    codes = collective_codes(names)
    for x in dirs:
        b, n, _ = _replay(x, list(_mss(x.segments)), tmp_path, collectives=sorted(names))
        assert b == n and _inside(b, x.expected_for(codes)), (x.mode, names)


@pytest.mark.parametrize("element,protect,pber", [("fp32", ["sign", "exponent"], 0.0),
                                                  ("fp32", ["exponent"], BPF_BER / 4),
                                                  ("bf16", ["sign", "exponent"], 0.0)])
def test_bpf_tracker_protected_bits(dirs, tmp_path, element, protect, pber):
    """Protection in the kernel: the same applied flips as the NFQUEUE engine (protected positions dropped, or
    kept by the residual hash at protected_ber / ber), the same counters by field."""
    for x in dirs:
        b, n, st = _replay(x, list(_mss(x.segments))[:800], tmp_path, element=element, protect=protect,
                           protected_ber=pber)
        assert b == n, (x.mode, element, protect, len(b), len(n))
        assert st["flips_corrected"] > 0 and st["bits_protected"] > 0
        assert (st["flips_protected"] > 0) == (pber > 0)
