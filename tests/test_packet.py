"""Unit and property tests of packet parsing, checksums, bit flipping and the per-packet pipeline (no
network: the Corruptor is pure). Packets are crafted with Scapy; checksums are checked against Scapy and
against a naive RFC 1071 reference."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import ICMP, IP, TCP, UDP, IPOption_NOP, IPOption_RR
from scapy.layers.inet6 import IPv6
from scapy.packet import Raw

from testbed.engine.config import EngineSpec
from testbed.engine.corruptor import Corruptor, uses_gso
from testbed.engine.nfqueue import SKB_CSUMNOTREADY
from testbed.engine.packet import (
    apply_flips,
    internet_checksum,
    ipv4_header_checksum,
    l4_checksum,
    l4_checksum_ok,
    ones_complement_sum,
    parse_ipv4,
)
from testbed.bench.probe import popcount

SRC, DST = "10.99.0.1", "10.99.0.2"
TCP_OPTS = [("MSS", 1460), ("SAckOK", b""), ("Timestamp", (12345, 0)), ("NOP", None), ("WScale", 7)]


def tcp_bytes(payload: bytes = b"x" * 100, seq: int = 1000, flags: str = "PA", sport: int = 40000,
              dport: int = 5001, ip_options=None, tcp_options=None, **ip_kw) -> bytes:
    ip = IP(src=SRC, dst=DST, options=ip_options or [], **ip_kw)
    return bytes(ip / TCP(sport=sport, dport=dport, seq=seq, flags=flags, options=tcp_options or []) / Raw(payload))


def udp_bytes(payload: bytes = b"u" * 77, sport: int = 4000, dport: int = 4001, chksum=None) -> bytes:
    u = UDP(sport=sport, dport=dport) if chksum is None else UDP(sport=sport, dport=dport, chksum=chksum)
    return bytes(IP(src=SRC, dst=DST) / u / Raw(payload))


def ref_sum(data: bytes) -> int:
    """Naive RFC 1071 folded sum of big-endian 16-bit words."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def ref_l4_ok(pkt: bytes) -> bool:
    proto, ihl, _, total = parse_ipv4(pkt)
    pseudo = pkt[12:20] + bytes([0, proto]) + struct.pack("!H", total - ihl)
    return ref_sum(pseudo + pkt[ihl:total]) == 0xFFFF


def corruptor(**kw) -> Corruptor:
    spec = EngineSpec(netns="/run/netns/none", iface="veth0", control_socket="/nonexistent.sock",
                      stats_file="/nonexistent.json", **kw)
    return Corruptor(spec.validate())


def bit_diff(a: bytes, b: bytes) -> int:
    return popcount(np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8))


# -- parsing -----------------------------------------------------------------------------------------------------

def test_parse_tcp_with_ip_and_tcp_options():
    pkt = tcp_bytes(b"hello", ip_options=[IPOption_RR(), IPOption_NOP()], tcp_options=TCP_OPTS)
    proto, ihl, thl, total = parse_ipv4(pkt)
    assert proto == 6 and ihl > 20 and thl > 20 and total == len(pkt)
    assert pkt[ihl + thl:total] == b"hello"


def test_parse_udp():
    pkt = udp_bytes(b"abc")
    assert parse_ipv4(pkt) == (17, 20, 8, len(pkt))


@pytest.mark.parametrize("pkt,reason", [
    (b"", "short"),
    (b"\x45" + b"\0" * 10, "short"),
    (bytes(IPv6(dst="::1") / TCP() / Raw(b"x" * 30)), "not_ipv4"),
    (tcp_bytes()[:40], "bad_length"),  # truncated: total length says more
    (bytes(IP(src=SRC, dst=DST, flags="MF") / UDP() / Raw(b"x" * 40)), "fragment"),
    (bytes(IP(src=SRC, dst=DST, frag=100, proto=6) / Raw(b"x" * 40)), "fragment"),
    (bytes(IP(src=SRC, dst=DST) / ICMP() / Raw(b"ping")), "not_tcp_udp"),
    (bytes(IP(src=SRC, dst=DST, proto=253) / Raw(b"x" * 30)), "not_tcp_udp"),
    (bytes(IP(src=SRC, dst=DST, proto=6) / Raw(b"\x01\x02")), "bad_l4_header"),  # TCP header cut short
    (bytes(IP(src=SRC, dst=DST) / TCP(dataofs=15) / Raw(b"x" * 10)), "bad_l4_header"),  # doff past the end
    (bytes(IP(src=SRC, dst=DST) / TCP(dataofs=2)), "bad_l4_header"),
    (bytes(IP(src=SRC, dst=DST) / UDP(len=200) / Raw(b"x" * 10)), "bad_l4_header"),
    (b"\x42" + tcp_bytes()[1:], "bad_ihl"),
])
def test_parse_rejects(pkt, reason):
    assert parse_ipv4(pkt) == reason


# -- checksums ---------------------------------------------------------------------------------------------------

@given(st.binary(max_size=3000), st.integers(0, 7))
def test_ones_complement_sum_matches_reference(data, start):
    start = min(start, len(data))
    assert ones_complement_sum(data, start) == ref_sum(data[start:])
    assert internet_checksum(data) == (~ref_sum(data)) & 0xFFFF


@pytest.mark.parametrize("n", [0, 1, 2, 3, 100, 1447, 1448, 9000, 65000])
def test_l4_checksums_match_scapy(n):
    payload = np.random.default_rng(n).bytes(n)
    for pkt in (tcp_bytes(payload, tcp_options=TCP_OPTS, ip_options=[IPOption_RR()]), udp_bytes(payload)):
        proto, ihl, _, total = parse_ipv4(pkt)
        off = ihl + (16 if proto == 6 else 6)
        assert l4_checksum(pkt, ihl, total, proto) == struct.unpack_from("!H", pkt, off)[0]
        assert ipv4_header_checksum(pkt, ihl) == struct.unpack_from("!H", pkt, 10)[0]
        assert l4_checksum_ok(pkt, ihl, total, proto)


def test_udp_zero_checksum_means_none():
    pkt = udp_bytes(b"abc", chksum=0)
    assert l4_checksum_ok(pkt, 20, len(pkt), 17)


@given(st.binary(min_size=1, max_size=500), st.data())
def test_apply_flips_matches_naive(data, draw):
    nbits = len(data) * 8
    positions = np.array(sorted(draw.draw(st.sets(st.integers(0, nbits - 1), max_size=100))), dtype=np.int64)
    buf = bytearray(data)
    apply_flips(buf, 0, positions)
    ref = bytearray(data)
    for p in positions:
        ref[p // 8] ^= 0x80 >> (p % 8)
    assert buf == ref
    assert bit_diff(bytes(buf), data) == positions.size


# -- the pipeline ------------------------------------------------------------------------------------------------

def test_gso_only_for_fix_with_payload_or_tensor():
    assert uses_gso("payload", "fix") and uses_gso("tensor", "fix")
    assert not uses_gso("payload", "keep") and not uses_gso("all", "fix") and not uses_gso("all", "keep")


def test_fix_mode_flips_payload_and_recomputes_checksum():
    c = corruptor(ber=0.01, seed=1)
    pkt = tcp_bytes(np.random.default_rng(1).bytes(1448), tcp_options=TCP_OPTS, ip_options=[IPOption_RR()])
    proto, ihl, thl, total = parse_ipv4(pkt)
    out = c.process(memoryview(pkt))
    assert out is not None and len(out) == len(pkt)
    assert out[: ihl + 16] == pkt[: ihl + 16] and out[ihl + 18: ihl + thl] == pkt[ihl + 18: ihl + thl]
    assert bit_diff(bytes(out), pkt) - bit_diff(bytes(out[ihl + 16: ihl + 18]), pkt[ihl + 16: ihl + 18]) \
        == c.counters.bits_flipped > 0
    assert ref_l4_ok(bytes(out))
    assert IP(bytes(out))[TCP].chksum == IP(bytes(IP(bytes(out))))[TCP].chksum  # scapy agrees
    assert c.counters.bits_seen == 1448 * 8 and c.counters.packets_modified == 1


def test_keep_mode_leaves_checksum_so_receiver_drops():
    c = corruptor(ber=0.01, seed=2, checksum="keep")
    pkt = tcp_bytes(np.random.default_rng(2).bytes(1448))
    out = c.process(memoryview(pkt))
    assert out is not None
    assert out[:40] == pkt[:40]  # headers, checksum included, untouched
    assert bit_diff(bytes(out), pkt) == c.counters.bits_flipped
    assert not ref_l4_ok(bytes(out))


def test_csum_not_ready_full_recompute():
    """With NFQA_CFG_F_GSO a CHECKSUM_PARTIAL packet's field holds only the pseudo-header sum; fix mode must
    recompute in full, keep mode must write the clean packet's checksum before corrupting."""
    pkt = bytearray(tcp_bytes(np.random.default_rng(3).bytes(30000)))
    good = pkt[36:38]
    pkt[36:38] = b"\x12\x34"  # whatever the stack left there
    out = corruptor(ber=1e-3, seed=3).process(memoryview(bytes(pkt)), SKB_CSUMNOTREADY)
    assert out is not None and ref_l4_ok(bytes(out))
    out = corruptor(ber=1e-3, seed=3, checksum="keep").process(memoryview(bytes(pkt)), SKB_CSUMNOTREADY)
    assert out[36:38] == good and not ref_l4_ok(bytes(out))


def test_udp_fix_and_zero_checksum():
    c = corruptor(ber=0.05, seed=4)
    out = c.process(memoryview(udp_bytes(b"z" * 500)))
    assert out is not None and ref_l4_ok(bytes(out))
    out0 = c.process(memoryview(udp_bytes(b"z" * 500, chksum=0)))
    assert out0 is not None and out0[26:28] == b"\0\0"  # no checksum stays no checksum


def test_scope_all_fix_keeps_headers_consistent():
    c = corruptor(ber=0.002, seed=5, scope="all")
    modified = 0
    for i in range(300):
        pkt = tcp_bytes(np.random.default_rng(i).bytes(1000), seq=i * 1000)
        out = c.process(memoryview(pkt))
        if out is None:
            continue
        modified += 1
        out = bytes(out)
        if out[0] >> 4 == 4 and 20 <= (out[0] & 15) * 4:
            assert ipv4_header_checksum(out, (out[0] & 15) * 4) == struct.unpack_from("!H", out, 10)[0]
        p = parse_ipv4(out)
        if not isinstance(p, str):
            assert l4_checksum_ok(out, p[1], p[3], p[0])
    assert modified > 100
    assert c.counters.bits_seen == 300 * 1040 * 8


def test_retransmitted_segment_gets_identical_flips_and_is_counted_once():
    c = corruptor(ber=1e-3, seed=6)
    syn = tcp_bytes(b"", seq=999, flags="S")
    assert c.process(memoryview(syn)) is None
    segs = [tcp_bytes(np.random.default_rng(k).bytes(1448), seq=1000 + 1448 * k) for k in range(20)]
    first = [c.process(memoryview(s)) for s in segs]
    seen, flipped = c.counters.bits_seen, c.counters.bits_flipped
    assert seen == 20 * 1448 * 8 and flipped > 0
    again = [c.process(memoryview(s)) for s in segs[5:10]]
    for a, b in zip(first[5:10], again):
        assert (a is None and b is None) or bytes(a) == bytes(b)
    assert (c.counters.bits_seen, c.counters.bits_flipped) == (seen, flipped)
    assert c.counters.retransmitted_bits == 5 * 1448 * 8


def test_same_seed_same_stream_same_flips_regardless_of_segmentation():
    """Offset-keyed flips: the same bytes of the same flow get the same flips however TCP cut them."""
    data = np.random.default_rng(7).bytes(64000)

    def run(seg_size, seed=7):
        c = corruptor(ber=1e-3, seed=seed)
        c.process(memoryview(tcp_bytes(b"", seq=0, flags="S")))
        out = bytearray()
        for off in range(0, len(data), seg_size):
            chunk = data[off:off + seg_size]
            r = c.process(memoryview(tcp_bytes(chunk, seq=1 + off)))
            out += chunk if r is None else bytes(r)[40:]
        return bytes(out), c.counters.bits_flipped

    a, fa = run(1448)
    b, fb = run(8948)
    assert a == b and fa == fb == bit_diff(a, data) > 0
    other, _ = run(1448, seed=8)
    assert other != a


def test_control_ports_are_excluded_once_per_flow():
    c = corruptor(ber=0.5, seed=8, control_ports=[29500])
    for k in range(5):
        assert c.process(memoryview(tcp_bytes(b"y" * 500, seq=k * 500, dport=29500))) is None
        assert c.process(memoryview(tcp_bytes(b"y" * 500, seq=k * 500, sport=29500, dport=40000))) is None
    assert c.counters.flows_excluded == 2
    assert c.process(memoryview(tcp_bytes(b"y" * 500))) is not None


def test_set_changes_ber_and_records_epochs():
    c = corruptor(ber=1e-4, seed=9)
    c.process(memoryview(tcp_bytes(b"", seq=0, flags="S")))
    seq = 1
    for _ in range(200):
        c.process(memoryview(tcp_bytes(b"a" * 1448, seq=seq)))
        seq += 1448
    c.set(ber=1e-2)
    for _ in range(200):
        c.process(memoryview(tcp_bytes(b"a" * 1448, seq=seq)))
        seq += 1448
    ep = c.stats()["epochs"]
    assert [e["ber"] for e in ep] == [1e-4, 1e-2]
    assert ep[0]["bits_seen"] == ep[1]["bits_seen"] == 200 * 1448 * 8
    assert ep[1]["bits_flipped"] > 10 * max(1, ep[0]["bits_flipped"])
    with pytest.raises(ValueError):
        c.set(ber=2.0)
    with pytest.raises(ValueError):
        c.set(bogus=1)
    assert c.ber == 1e-2
    c.set(error_model={"type": "gilbert_elliott", "burst_length": 32})
    assert c.stats()["error_model"]["type"] == "gilbert_elliott"
    c.set(checksum="keep")
    assert not c.gso


def test_tensor_scope_flips_only_gloo_payload():
    """Scope tensor: the gloo tracker says which bytes are frame payload; handshake and headers stay clean.
    A flow first seen mid-stream is never corrupted (and counted)."""
    c = corruptor(ber=0.1, seed=10, scope="tensor")
    c.process(memoryview(tcp_bytes(b"", seq=99, flags="S")))  # initiator's SYN
    payload = np.random.default_rng(10).bytes(4000)
    header = struct.pack("<6Q", 48 + len(payload), 0, 0x04 << 56, 0, len(payload), 0)
    stream = struct.pack("<q", 1) + header + payload
    out = bytearray()
    for off in range(0, len(stream), 1448):
        chunk = stream[off:off + 1448]
        r = c.process(memoryview(tcp_bytes(chunk, seq=100 + off)))
        out += chunk if r is None else bytes(r)[40:]
    assert out[:56] == stream[:56]
    assert bit_diff(bytes(out[56:]), payload) == c.counters.bits_flipped > 0
    assert c.counters.bits_seen == len(payload) * 8
    mid = c.process(memoryview(tcp_bytes(payload[:1000], seq=5000, sport=41000)))
    assert mid is None and c.counters.flows_midstream == 1


# -- hostile input: the pipeline never raises --------------------------------------------------------------------

@st.composite
def ipv4_like(draw):
    """IPv4-ish packets: sane or broken version/IHL/lengths/flags/protocol/L4 header, random payload."""
    ihl = draw(st.integers(0, 15))
    proto = draw(st.sampled_from([6, 17, 1, 253, draw(st.integers(0, 255))]))
    options = draw(st.binary(min_size=max(0, ihl * 4 - 20), max_size=max(0, ihl * 4 - 20)))
    if proto == 6:
        l4 = struct.pack("!HHIIBBHHH", draw(st.integers(0, 65535)), draw(st.integers(0, 65535)),
                         draw(st.integers(0, 2**32 - 1)), 0, draw(st.integers(0, 255)), draw(st.integers(0, 255)),
                         8192, 0, 0)
    elif proto == 17:
        l4 = struct.pack("!HHHH", 1, 2, draw(st.integers(0, 65535)), draw(st.integers(0, 65535)))
    else:
        l4 = b""
    body = l4 + draw(st.binary(max_size=1600))
    cut = draw(st.integers(0, 40))
    total = 20 + len(options) + len(body)
    total_field = draw(st.sampled_from([total, total + 10, max(0, total - 5), draw(st.integers(0, 65535))]))
    frag = draw(st.sampled_from([0, 0, 0x2000, 0x4000, 0x0010]))
    version = draw(st.sampled_from([4, 4, 4, 6, draw(st.integers(0, 15))]))
    hdr = struct.pack("!BBHHHBBH4s4s", version << 4 | ihl, 0, total_field & 0xFFFF, 1, frag, 64, proto, 0,
                      bytes([10, 99, 0, 1]), bytes([10, 99, 0, 2]))
    pkt = hdr + options + body
    return pkt[: max(0, len(pkt) - cut)] if draw(st.booleans()) else pkt


@st.composite
def valid_packets(draw):
    """Well-formed TCP/UDP packets (with or without IP/TCP options): the path that flips bits."""
    payload = draw(st.binary(min_size=0, max_size=3000))
    if draw(st.booleans()):
        return tcp_bytes(payload, seq=draw(st.integers(0, 2**32 - 1)),
                         flags=draw(st.sampled_from(["S", "SA", "PA", "A"])),
                         ip_options=draw(st.sampled_from([None, [IPOption_RR()], [IPOption_NOP()] * 3])),
                         tcp_options=draw(st.sampled_from([None, TCP_OPTS])))
    return udp_bytes(payload, chksum=draw(st.sampled_from([None, 0])))


HOSTILE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HOSTILE
@given(st.one_of(st.binary(max_size=2000), ipv4_like(), valid_packets()),
       st.sampled_from(["payload", "all", "tensor"]), st.sampled_from(["fix", "keep"]),
       st.sampled_from([0, SKB_CSUMNOTREADY]))
def test_pipeline_never_raises_and_passes_unparsable_unmodified(pkt, scope, checksum, info):
    c = corruptor(ber=0.05, seed=11, scope=scope, checksum=checksum)
    before = dict(c.counters.unparsed_reasons)
    out = c.process(memoryview(pkt), info)
    parsed = parse_ipv4(pkt)
    if isinstance(parsed, str):
        assert out is None
        assert c.counters.packets_unparsed == 1
        assert c.counters.unparsed_reasons[parsed] == before.get(parsed, 0) + 1
        return
    assert out is None or len(out) == len(pkt)
    event(f"modified={out is not None}")
    if out is None:
        return
    proto, ihl, l4h, total = parsed
    if scope != "all":  # headers untouched but for the checksum field
        csum = ihl + (16 if proto == 6 else 6)
        assert out[:csum] == pkt[:csum] and out[csum + 2: ihl + l4h] == pkt[csum + 2: ihl + l4h]
        if checksum == "fix":
            assert l4_checksum_ok(bytes(out), ihl, total, proto)
        elif not info & SKB_CSUMNOTREADY:
            assert out[csum: csum + 2] == pkt[csum: csum + 2]
            assert bit_diff(bytes(out), pkt) == c.counters.bits_flipped


@HOSTILE
@given(ipv4_like(), st.integers(0, 2**32 - 1))
def test_pipeline_survives_hostile_streams(first, seed):
    """Many hostile packets through one corruptor (flow state, offsets, trackers carry over)."""
    c = corruptor(ber=0.01, seed=seed % 1000, scope="tensor")
    rng = np.random.default_rng(seed)
    pkts = [first] + [bytes(tcp_bytes(rng.bytes(int(rng.integers(0, 3000))), seq=int(rng.integers(0, 2**32)),
                                       flags=rng.choice(["S", "SA", "A", "PA", "F", "R"]))) for _ in range(20)]
    for p in pkts:
        out = c.process(memoryview(p))
        assert out is None or len(out) == len(p)
    assert c.counters.packets == len(pkts)


# -- live changes and existing flows -----------------------------------------------------------------------------

def gloo_frame(payload: bytes, code: int) -> bytes:
    return struct.pack("<6Q", 48 + len(payload), 1, code << 56, 0, len(payload), 0) + payload


def send_stream(c: Corruptor, data: bytes, seq: int, sport: int = 40000, mss: int = 1448) -> bytes:
    """Pass ``data`` through ``c`` as consecutive segments from ``seq``; returns the payload bytes out."""
    out = bytearray()
    for off in range(0, len(data), mss):
        chunk = data[off:off + mss]
        r = c.process(memoryview(tcp_bytes(chunk, seq=(seq + off) & 0xFFFFFFFF, sport=sport)))
        out += chunk if r is None else bytes(r)[40:]
    return bytes(out)


def test_collective_names_are_validated():
    with pytest.raises(ValueError, match="allreduse"):
        EngineSpec(netns="/x", iface="v", control_socket="/s", stats_file="/f", scope="tensor",
                   collectives=["allreduse"]).validate()
    spec = EngineSpec(netns="/x", iface="v", control_socket="/s", stats_file="/f", scope="tensor",
                      collectives="broadcast").validate()
    assert spec.collectives == ["broadcast"]
    c = corruptor(ber=0.1, seed=12, scope="tensor", collectives=["allreduce"])
    with pytest.raises(ValueError, match="allreduse"):
        c.set(collectives=["allreduse"])
    assert c.collectives == ["allreduce"]


def test_live_collectives_change_reaches_existing_trackers():
    """A new filter applies to connections already open (from their next frame), computed once per set."""
    c = corruptor(ber=0.1, seed=12, scope="tensor", collectives=["allreduce"])
    rng = np.random.default_rng(12)
    p1, p2, p3 = rng.bytes(3000), rng.bytes(3000), rng.bytes(3000)
    for sport in (40000, 40001):
        c.process(memoryview(tcp_bytes(b"", seq=99, flags="S", sport=sport)))
    first = struct.pack("<q", 1) + gloo_frame(p1, 0x04)  # handshake + an allreduce frame
    out = send_stream(c, first, 100)
    assert bit_diff(out[56:], p1) > 0
    flipped = c.counters.bits_flipped
    c.set(collectives=["broadcast"])
    trackers = [f.tracker for f in c.flows.values()]
    assert len(trackers) == 2 and trackers[0].codes is trackers[1].codes is c._codes
    assert trackers[0].codes == {0x06}
    second = gloo_frame(p2, 0x04) + gloo_frame(p3, 0x06)  # allreduce now filtered out, broadcast in
    out = send_stream(c, second, 100 + len(first))
    assert out[:48 + len(p2) + 48] == second[:48 + len(p2) + 48]
    assert bit_diff(out[48 + len(p2) + 48:], p3) == c.counters.bits_flipped - flipped > 0


def test_live_switch_to_offset_keyed_restarts_streams():
    """payload+keep does not follow stream offsets; switching to fix after 3 GiB must not generate a 3 GiB
    gap (nor unwrap it into another 4 GiB epoch): the flow restarts at its next packet."""
    c = corruptor(ber=1e-3, seed=13, checksum="keep")
    c.process(memoryview(tcp_bytes(b"", seq=0, flags="S")))
    send_stream(c, b"k" * 20000, 1)
    flow = next(iter(c.flows.values()))
    generation = c._generation
    seq = (1 + (3 << 30)) & 0xFFFFFFFF  # 3 GiB later
    send_stream(c, b"k" * 20000, seq)
    c.set(checksum="fix")
    assert c._generation == generation + 1 and flow.base is None and flow.okf is None
    seen = c.counters.bits_seen
    send_stream(c, b"f" * 14480, seq + 20000)
    assert flow.base == seq + 20000 and flow.top == 14480
    assert flow.okf._hw == 14480 * 8 and flow.okf._stored < 1000
    assert c.counters.bits_seen - seen == 14480 * 8 and c.counters.forgotten_bits == 0
    # and back: keep, 3 GiB more, fix again: again a fresh start
    c.set(checksum="keep")
    seq2 = (seq + (3 << 30)) & 0xFFFFFFFF
    send_stream(c, b"k" * 3000, seq2)
    c.set(checksum="fix")
    send_stream(c, b"f" * 3000, seq2 + 3000)
    assert flow.base == (seq2 + 3000) & 0xFFFFFFFF and flow.top == 3000 and flow.okf._hw == 3000 * 8


def test_live_switch_tensor_keep_to_fix_keys_flips_from_the_switch():
    """tensor+keep follows offsets (the tracker needs them) but draws from the link model; turning fix on
    starts each flow's offset-keyed flips at its current offset, not at 0 (no gap generated). Tensor flips are
    keyed by the eligible offset: the stream offset less the handshake and the frame header before it."""
    c = corruptor(ber=1e-3, seed=14, scope="tensor", checksum="keep")
    c.process(memoryview(tcp_bytes(b"", seq=99, flags="S")))
    payload = np.random.default_rng(14).bytes(200000)
    stream = struct.pack("<q", 1) + gloo_frame(payload, 0x04)
    cut = 100000
    send_stream(c, stream[:cut], 100)
    flow = next(iter(c.flows.values()))
    assert flow.okf is None and flow.top == cut
    c.set(checksum="fix")
    keyed = cut - 8 - 48
    assert flow.keyed_from == keyed == flow.tracker.eligible_bytes
    seen, flipped = c.counters.bits_seen, c.counters.bits_flipped
    out = send_stream(c, stream[cut:], 100 + cut)
    assert flow.okf._stored < 1000 and flow.okf._floor == keyed * 8
    assert c.counters.bits_seen - seen == (len(stream) - cut) * 8
    assert bit_diff(out, stream[cut:]) == c.counters.bits_flipped - flipped > 0
    # a retransmission from before the switch: no flips (counted as forgotten), the same ranges
    r = c.process(memoryview(tcp_bytes(stream[cut - 1448:cut], seq=100 + cut - 1448)))
    assert r is None and c.counters.forgotten_bits == 1448 * 8


def test_live_scope_change_to_tensor_drops_trackers():
    c = corruptor(ber=0.1, seed=15, scope="tensor")
    c.process(memoryview(tcp_bytes(b"", seq=99, flags="S")))
    flow = next(iter(c.flows.values()))
    assert flow.tracker is not None
    c.set(scope="payload")
    assert flow.tracker is None
    send_stream(c, b"p" * 3000, 100)
    c.set(scope="tensor")
    assert c.process(memoryview(tcp_bytes(b"p" * 1000, seq=3100))) is None
    assert c.counters.flows_midstream == 1


def test_model_change_restarts_flips_at_the_current_offset():
    c = corruptor(ber=1e-3, seed=16)
    c.process(memoryview(tcp_bytes(b"", seq=0, flags="S")))
    send_stream(c, b"a" * 14480, 1)
    flow = next(iter(c.flows.values()))
    old = flow.okf
    c.set(seed=17)
    assert flow.okf is None and flow.keyed_from == 14480 and flow.base == 1
    send_stream(c, b"a" * 1448, 1 + 14480)
    assert flow.okf is not old and flow.okf._floor == 14480 * 8 and flow.top == 14480 + 1448


def test_flow_key_with_and_without_ip_options():
    c = corruptor(ber=0.0)
    c.process(memoryview(tcp_bytes(b"x" * 10, seq=1)))
    c.process(memoryview(tcp_bytes(b"x" * 10, seq=11, ip_options=[IPOption_RR()])))
    c.process(memoryview(tcp_bytes(b"x" * 10, seq=21, sport=40001)))
    assert sorted(c.flows) == sorted([bytes([10, 99, 0, 1, 10, 99, 0, 2]) + struct.pack("!HH", p, 5001)
                                      for p in (40000, 40001)])


def test_flow_table_evicts_closed_flows_then_least_recently_used():
    c = corruptor(ber=0.0)
    c.flows.max_flows = 8
    for port in range(40000, 40008):
        c.process(memoryview(tcp_bytes(b"x", seq=1, sport=port)))
    c.process(memoryview(tcp_bytes(b"", seq=2, sport=40005, flags="FA")))  # 40005 closes
    c.process(memoryview(tcp_bytes(b"", seq=2, sport=40006, flags="R")))  # 40006 resets
    c.process(memoryview(tcp_bytes(b"", seq=2, sport=40007, flags="F")))
    c.process(memoryview(tcp_bytes(b"", seq=5, sport=40007, flags="S")))  # ... and reopens
    c.process(memoryview(tcp_bytes(b"x", seq=2, sport=40000)))  # the oldest flow is active again
    c.process(memoryview(tcp_bytes(b"x", seq=1, sport=41000)))  # full: a quarter (2 flows) goes
    ports = sorted(struct.unpack("!H", k[8:10])[0] for k in c.flows)
    assert ports == [40000, 40001, 40002, 40003, 40004, 40007, 41000]  # closed first, not the oldest
    c.process(memoryview(tcp_bytes(b"x", seq=1, sport=41001)))
    c.process(memoryview(tcp_bytes(b"x", seq=1, sport=41002)))  # full again: least recently used go
    ports = sorted(struct.unpack("!H", k[8:10])[0] for k in c.flows)
    assert ports == [40000, 40003, 40004, 40007, 41000, 41001, 41002]


def test_tensor_keep_maps_flips_over_several_ranges():
    """scope tensor + keep: flips drawn over the eligible ranges of a segment holding several frames land only
    in frame payloads, and their number is bits_flipped."""
    c = corruptor(ber=0.02, seed=18, scope="tensor", checksum="keep")
    c.process(memoryview(tcp_bytes(b"", seq=99, flags="S")))
    rng = np.random.default_rng(18)
    frames = [rng.bytes(int(n)) for n in (300, 5, 200, 400)]
    stream = struct.pack("<q", 1) + b"".join(gloo_frame(p, 0x04) for p in frames)
    out = send_stream(c, stream, 100, mss=4000)
    pos = 8
    for p in frames:
        assert out[pos:pos + 48] == stream[pos:pos + 48]
        pos += 48 + len(p)
    assert bit_diff(out, stream) == c.counters.bits_flipped > 0
    assert c.counters.bits_seen == 8 * sum(len(p) for p in frames)


# -- reproducible identity (docs/engine.md, "Seeds and reproducibility") -----------------------------------------

def notify_frame(code: int) -> bytes:
    return struct.pack("<6Q", 48, 3, code << 56, 0, 4096, 0)


def gloo_connection(c: Corruptor, frames: list[bytes], sport: int, isn: int) -> bytes:
    """A gloo connection (SYN, handshake, ``frames``) through ``c``; returns the payload bytes out."""
    c.process(memoryview(tcp_bytes(b"", seq=isn, flags="S", sport=sport)))
    return send_stream(c, struct.pack("<q", 1) + b"".join(frames), isn + 1, sport=sport)


def tensor_bytes(out: bytes, frames: list[bytes]) -> bytes:
    """The data frames' payload bytes of a stream ``out`` made of the handshake and ``frames``."""
    pos, got = 8, bytearray()
    for f in frames:
        if struct.unpack_from("<Q", f, 8)[0] < 2:
            got += out[pos + 48:pos + len(f)]
        pos += len(f)
    return bytes(got)


def test_flips_do_not_depend_on_ports_isn_or_where_notifications_fall():
    """Two runs of one gloo connection: other ephemeral port, other ISN, a notification elsewhere between the data
    frames. The engine keys the flips on (addresses, ordinal, eligible offset): the tensor bytes get the same
    flips."""
    rng = np.random.default_rng(3)
    data = [rng.bytes(30000) for _ in range(3)]
    one = [gloo_frame(data[0], 0x04), notify_frame(0x04), gloo_frame(data[1], 0x04), gloo_frame(data[2], 0x04)]
    two = [notify_frame(0x04), gloo_frame(data[0], 0x04), gloo_frame(data[1], 0x04), notify_frame(0x04),
           gloo_frame(data[2], 0x04)]
    runs = []
    for frames, sport, isn in ((one, 40000, 99), (two, 51234, 7_000_000)):
        c = corruptor(ber=1e-4, seed=21, scope="tensor")
        runs.append((tensor_bytes(gloo_connection(c, frames, sport, isn), frames), c.counters.bits_flipped))
    (a, fa), (b, fb) = runs
    assert fa == fb > 0 and a == b != b"".join(data)


def test_ordinals_per_address_pair_and_reuse_after_close():
    """Concurrent connections between two addresses get ordinals 0, 1 (different flips); once the first is
    closed (FIN) the next connection takes its ordinal again, and with it the same flips."""
    c = corruptor(ber=1e-3, seed=22, scope="payload")
    payload = bytes(20000)

    def connection(sport: int, isn: int):
        c.process(memoryview(tcp_bytes(b"", seq=isn, flags="S", sport=sport)))
        return c.flows[next(k for k in c.flows if (k[8] << 8 | k[9]) == sport)], send_stream(c, payload, isn + 1,
                                                                                              sport=sport)

    f0, out0 = connection(40000, 10)
    f1, out1 = connection(40001, 5000)
    assert (f0.ordinal, f1.ordinal) == (0, 1) and out0 != out1
    c.process(memoryview(tcp_bytes(b"", seq=20011, flags="FA", sport=40000)))
    f2, out2 = connection(40002, 123456)
    assert f2.ordinal == 0 and out2 == out0
    assert f2.identity() == (0, f0.key[:8] + bytes(4))
    c.process(memoryview(tcp_bytes(b"m" * 100, seq=1, sport=40003)))  # first seen mid-stream: the 4-tuple
    mid = c.flows[next(k for k in c.flows if (k[8] << 8 | k[9]) == 40003)]
    assert mid.ordinal is None and mid.identity() == (0, mid.key)
