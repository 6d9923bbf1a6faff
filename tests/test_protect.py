"""Protected bits (scope tensor, `protect`): the value layout and its bit numbering, the tracker's value grid
(`eligible_aligned`), the position filter and the field counters on synthetic gloo streams (no root), and a
real gloo point-to-point transfer through a live engine on a veth (root, torch): with sign and exponent
protected at BER 1e-3, no received fp32 or bf16 value differs in those fields, the differing bits are exactly
the engine's flips, and the BER over the exposed bits is the configured one."""

from __future__ import annotations

import json
import os
import struct
import subprocess

import numpy as np
import pytest
from engine_fixtures import PYTHON, read_json_line, veth_link
from scipy import stats
from test_packet import corruptor, tcp_bytes

from testbed.engine.config import EngineSpec
from testbed.engine.gloo import GlooStreamTracker
from testbed.engine.manager import engine_stats, set_engine
from testbed.engine.packet import apply_flips
from testbed.bench.probe import popcount
from testbed.engine.protect import BitLayout, field_bits, normalize_protect, protected_positions, residual_keep

ALPHA = 0.001
DTYPES = {"fp32": np.uint32, "bf16": np.uint16, "fp16": np.uint16}
MASKS = {  # value bits of each field (sign, exponent, mantissa)
    "fp32": (0x80000000, 0x7F800000, 0x007FFFFF),
    "bf16": (0x8000, 0x7F80, 0x007F),
    "fp16": (0x8000, 0x7C00, 0x03FF),
}


def assert_rate(k: int, n: int, p: float) -> tuple[int, int]:
    """``k`` of ``n`` inside the 99.9% binomial interval of rate ``p``; returns the interval."""
    lo, hi = int(stats.binom.ppf(ALPHA / 2, n, p)), int(stats.binom.isf(ALPHA / 2, n, p))
    assert lo <= k <= hi, f"{k} of {n}: outside the 99.9% interval [{lo}, {hi}] of rate {p}"
    return lo, hi


def field_diffs(element: str, sent: bytes, got: bytes) -> tuple[int, int, int]:
    """Differing bits per field (sign, exponent, mantissa) between two little-endian value arrays."""
    d = np.frombuffer(sent, DTYPES[element]) ^ np.frombuffer(got, DTYPES[element])
    return tuple(popcount(d & DTYPES[element](m)) for m in MASKS[element])


# -- the layout -------------------------------------------------------------------------------------------------

def test_fields_of_each_element():
    assert field_bits("fp32") == {"sign": range(31, 32), "exponent": range(23, 31), "mantissa": range(0, 23)}
    assert field_bits("bf16") == {"sign": range(15, 16), "exponent": range(7, 15), "mantissa": range(0, 7)}
    assert field_bits("fp16") == {"sign": range(15, 16), "exponent": range(10, 15), "mantissa": range(0, 10)}
    assert protected_positions("fp32", ["sign", "exponent"]) == set(range(23, 32))
    assert protected_positions("bf16", "sign,3") == {15, 3}
    assert normalize_protect(["Sign", "sign", "7", 7]) == ["sign", 7]
    assert normalize_protect([]) is None
    for bad in (["sig"], [32], [-1], [True], 3.5):
        with pytest.raises(ValueError):
            protected_positions("fp32", bad)
    with pytest.raises(ValueError, match="outside 0..15"):
        protected_positions("fp16", [16])
    with pytest.raises(ValueError, match="element"):
        BitLayout("fp64")


@pytest.mark.parametrize("element", ["fp32", "bf16", "fp16"])
def test_layout_matches_apply_flips_numbering(element):
    """Slot ``b`` of the layout is the value bit that ``apply_flips`` changes when it flips engine bit ``b`` of
    a value: the field table and the protected table agree with the real bit numbering."""
    layout = BitLayout(element, ["sign", "exponent"])
    dtype = DTYPES[element]
    for b in range(layout.bits):
        buf = bytearray(layout.size * 3)
        apply_flips(buf, layout.size, np.array([b], dtype=np.int64))  # in the second value
        values = np.frombuffer(bytes(buf), dtype)
        assert values[0] == values[2] == 0
        value_bit = int(values[1]).bit_length() - 1
        assert int(values[1]) == 1 << value_bit
        field = [name for name, bits in field_bits(element).items() if value_bit in bits][0]
        assert ("sign", "exponent", "mantissa")[layout.field[b]] == field
        assert layout.protected[b] == (field != "mantissa")


def test_protected_bit_count_is_exact_on_any_range():
    layout = BitLayout("fp32", ["sign", "exponent", 0])
    per_value = layout.protected.astype(int)
    rng = np.random.default_rng(1)
    for _ in range(300):
        a = int(rng.integers(-200, 200))
        b = a + int(rng.integers(0, 300))
        brute = sum(per_value[x % 32] for x in range(a, b))
        assert layout.protected_bits(a, b) == brute
    assert BitLayout("bf16").protected_bits(0, 1000) == 0


def test_residual_keep_is_deterministic_and_at_its_rate():
    offsets = np.arange(0, 8_000_000, 8, dtype=np.int64)
    k1 = residual_keep(12345, offsets, 0.1)
    assert np.array_equal(k1, residual_keep(12345, offsets, 0.1))
    assert not np.array_equal(k1, residual_keep(12346, offsets, 0.1))
    assert_rate(int(k1.sum()), offsets.size, 0.1)
    assert residual_keep(1, offsets[:10], 1.0).all() and not residual_keep(1, offsets[:10], 0.0).any()


# -- the value grid from gloo's frames ---------------------------------------------------------------------------

def frame(payload: bytes, code: int = 0x00, opcode: int = 1, roffset: int = 0) -> bytes:
    """A gloo data frame: SEND_UNBOUND_BUFFER (1), or SEND_BUFFER (0) into the buffer at ``roffset``."""
    return struct.pack("<6Q", 48 + len(payload), opcode, code << 56, roffset if opcode == 0 else 0, len(payload),
                       roffset if opcode == 0 else 0) + payload


def split_frames(values: bytes, cut: int) -> bytes:
    """Two SEND_BUFFER frames carrying ``values`` into one buffer, cut at byte ``cut`` (inside a value)."""
    return frame(values[:cut], opcode=0) + frame(values[cut:], opcode=0, roffset=cut)


def test_tracker_gives_each_range_its_value_grid():
    """Unbound frames start a value; SEND_BUFFER's roffset shifts the grid, so a value cut between two frames
    is one value; segment boundaries (fast path, header splits, retransmissions) change nothing."""
    values = bytes(range(256)) * 4  # 1024 bytes
    stream = struct.pack("<q", 1) + frame(values[:100]) + split_frames(values, 502)
    p1, p2, p3 = 56, 56 + 100 + 48, 56 + 100 + 48 + 502 + 48  # payload starts
    t = GlooStreamTracker(initiator=True)
    got = []
    for off in range(0, len(stream), 37):  # 37-byte segments: values and headers straddle them
        got += t.eligible_aligned(off, stream[off:off + 37])
    origins = {s: o for s, _, o in got}
    assert all(origins[s] == p1 for s in origins if s < p1 + 100)
    assert all(origins[s] == p2 for s in origins if p2 <= s < p2 + 502)
    assert all(origins[s] == p3 - 502 for s in origins if s >= p3)  # the second frame's byte 0 is buffer byte 502
    assert sum(e - s for s, e, _ in got) == 100 + 1024
    # the same answers as eligible, with the grid; a retransmission gets the same grid
    t2 = GlooStreamTracker(initiator=True)
    assert [(s, e) for s, e, _ in t2.eligible_aligned(0, stream)] == GlooStreamTracker(True).eligible(0, stream)
    assert t2.eligible_aligned(p3 - 10, stream[p3 - 10:p3 + 10]) == [(p3, p3 + 10, p3 - 502)]
    assert t2.eligible_aligned(p2 + 3, stream[p2 + 3:p2 + 9]) == [(p2 + 3, p2 + 9, p2)]
    assert t2.origin_of(p3 + 5) == p3 - 502 and t2.origin_of(p1) == p1
    # the hot path: a segment inside the current payload
    t3 = GlooStreamTracker(initiator=False)
    assert t3.eligible_aligned(0, frame(values)[:1000]) == [(48, 1000, 48)]
    assert t3.eligible_aligned(1000, frame(values)[1000:1010]) == [(1000, 1010, 48)]


# -- the filter and the counters on synthetic streams (the pure Corruptor) -------------------------------------

def gloo_stream(payloads: bytes) -> bytes:
    return struct.pack("<q", 1) + payloads


def run_stream(c, stream: bytes, mss: int = 1447, sport: int = 40000) -> bytes:
    """SYN, then ``stream`` in ``mss``-byte segments (odd: values straddle packets); the bytes out."""
    c.process(memoryview(tcp_bytes(b"", seq=99, flags="S", sport=sport)))
    out = bytearray()
    for off in range(0, len(stream), mss):
        chunk = stream[off:off + mss]
        r = c.process(memoryview(tcp_bytes(chunk, seq=100 + off, sport=sport)))
        out += chunk if r is None else bytes(r)[40:]
    return bytes(out)


def values_of(element: str, n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 1 << 16, n * (4 if element == "fp32" else 2) // 2,
                                                dtype=np.uint16).tobytes()


@pytest.mark.parametrize("element", ["fp32", "bf16", "fp16"])
def test_field_counters_without_protection(element):
    """Every tensor-scope engine counts its flips by field of the element in force, exactly as the receiver
    sees them; nothing is protected (bits_exposed = bits_seen)."""
    vals = values_of(element, 30000, 2)
    c = corruptor(ber=0.01, seed=2, scope="tensor", element=element)
    out = run_stream(c, gloo_stream(frame(vals[:30000]) + frame(vals[30000:])))  # each unbound frame starts a value
    got = out[56:56 + 30000] + out[56 + 30000 + 48:]
    s = c.stats()
    assert s["bits_flipped"] > 1000 and s["bits_protected"] == s["flips_corrected"] == 0
    assert s["bits_exposed"] == s["bits_seen"] == len(vals) * 8
    assert (s["flips_sign"], s["flips_exponent"], s["flips_mantissa"]) == field_diffs(element, vals, got)


@pytest.mark.parametrize("element", ["fp32", "bf16", "fp16"])
def test_protected_fields_never_flip(element):
    """Sign and exponent protected: values split across packets (odd segments) and across frames (SEND_BUFFER
    cut inside a value) never change in those fields; differing bits = bits_flipped = flips_mantissa; the raw
    line errs at ber over every bit and the exposed bits at ber too."""
    ber = 0.02
    vals = values_of(element, 40000, 3)
    size = 4 if element == "fp32" else 2
    cut = 10 * size + 1  # inside the 11th value
    c = corruptor(ber=ber, seed=3, scope="tensor", element=element, protect=["sign", "exponent"])
    out = run_stream(c, gloo_stream(split_frames(vals, cut)))
    got = out[56:56 + cut] + out[56 + cut + 48:]
    s = c.stats()
    sign, exp, man = field_diffs(element, vals, got)
    assert sign == exp == 0 and man == s["bits_flipped"] == s["flips_mantissa"] > 1000
    assert s["flips_sign"] == s["flips_exponent"] == s["flips_protected"] == 0
    man_bits = len(field_bits(element)["mantissa"])
    n = len(vals) // size
    assert s["bits_seen"] == n * size * 8 and s["bits_exposed"] == n * man_bits
    assert s["bits_flipped_exposed"] == s["bits_flipped"]
    assert_rate(s["bits_flipped"], s["bits_exposed"], ber)
    assert_rate(s["bits_flipped"] + s["flips_corrected"], s["bits_seen"], ber)  # the raw line
    assert s["exposed_ber"] == s["bits_flipped"] / s["bits_exposed"]
    assert s["effective_ber"] == s["bits_flipped"] / s["bits_seen"]


def test_single_exposed_bit_position():
    """Every bit but value bit 30 protected (explicit positions): every flip lands on bit 30 of a value."""
    vals = values_of("fp32", 20000, 4)
    c = corruptor(ber=0.05, seed=4, scope="tensor", protect=[b for b in range(32) if b != 30])
    out = run_stream(c, gloo_stream(split_frames(vals, 4 * 999 + 3)), mss=1001)
    got = out[56:56 + 3999] + out[56 + 3999 + 48:]
    d = np.frombuffer(vals, np.uint32) ^ np.frombuffer(got, np.uint32)
    assert d.any() and set(np.unique(d).tolist()) <= {0, 1 << 30}
    assert popcount(d) == c.counters.bits_flipped == c.counters.flips_exponent
    assert c.stats()["bits_exposed"] == 20000


def test_residual_protected_ber_and_retransmissions():
    """protected_ber > 0: protected bits err at protected_ber (a hash of the stream offset decides), exposed
    bits at ber; a retransmission, full or straddling the frontier, carries exactly the first flips and is
    not counted again."""
    ber, pber = 0.02, 0.002
    vals = values_of("fp32", 100000, 5)
    stream = gloo_stream(frame(vals))
    c = corruptor(ber=ber, seed=5, scope="tensor", protect=["sign", "exponent"], protected_ber=pber)
    c.process(memoryview(tcp_bytes(b"", seq=99, flags="S")))
    out = bytearray()
    mss, off = 1447, 0
    while off < len(stream):
        chunk = stream[off:off + mss]
        out += _pass(c, chunk, off)
        if off and off % (20 * mss) == 0:  # partial retransmission: old bytes and new ones in one segment
            back = stream[off - 700:off + mss + 300]
            again = _pass(c, back, off - 700)
            assert again[:700 + len(chunk)] == out[off - 700:off + len(chunk)]
            out += again[700 + len(chunk):]
            off += mss + 300
            continue
        off += mss
    s = c.stats()
    again = _pass(c, stream[5000:9000], 5000)  # full retransmission
    assert again == out[5000:9000] and c.stats()["bits_seen"] == s["bits_seen"] == len(vals) * 8
    sign, exp, man = field_diffs("fp32", vals, bytes(out[56:]))
    assert sign + exp == s["flips_protected"] == s["flips_sign"] + s["flips_exponent"] > 0
    assert man == s["flips_mantissa"] == s["bits_flipped_exposed"]
    assert s["bits_protected"] == 100000 * 9
    assert_rate(s["flips_protected"], s["bits_protected"], pber)
    assert_rate(s["bits_flipped_exposed"], s["bits_exposed"], ber)
    assert s["retransmitted_flips"] > 0 and s["protected_realized_ber"] == s["flips_protected"] / (100000 * 9)


def _pass(c, chunk: bytes, off: int) -> bytes:
    r = c.process(memoryview(tcp_bytes(chunk, seq=100 + off)))
    return chunk if r is None else bytes(r)[40:]


def test_keep_mode_filters_the_link_models_flips():
    """scope tensor + keep (flips from the link's sequential model over several ranges per segment): the same
    filter, the same counters."""
    vals = values_of("bf16", 30000, 6)
    frames = [vals[:1001], vals[1001:1002], vals[1002:20000], vals[20000:]]
    stream = gloo_stream(b"".join(frame(p, opcode=0, roffset=sum(map(len, frames[:i]))) for i, p in enumerate(frames)))
    c = corruptor(ber=0.02, seed=6, scope="tensor", checksum="keep", element="bf16", protect=["sign", "exponent"])
    out = run_stream(c, stream, mss=4000)
    got, pos = b"", 8
    for p in frames:
        got += out[pos + 48:pos + 48 + len(p)]
        pos += 48 + len(p)
    s = c.stats()
    sign, exp, man = field_diffs("bf16", vals, got)
    assert sign == exp == 0 and man == s["bits_flipped"] == s["flips_mantissa"] > 100
    assert s["bits_exposed"] == 30000 * 7 and s["bits_seen"] == 30000 * 16


def test_settings_are_validated_and_live():
    spec = dict(netns="/x", iface="v", control_socket="/s", stats_file="/f")
    with pytest.raises(ValueError, match="scope 'tensor' only"):
        EngineSpec(**spec, ber=1e-3, protect=["sign"]).validate()
    with pytest.raises(ValueError, match="must not exceed ber"):
        EngineSpec(**spec, ber=1e-3, scope="tensor", protect=["sign"], protected_ber=1e-2).validate()
    with pytest.raises(ValueError, match="outside 0..15"):
        EngineSpec(**spec, ber=1e-3, scope="tensor", element="bf16", protect=[20]).validate()
    assert EngineSpec(**spec, scope="tensor", protect="sign,exponent").validate().protect == ["sign", "exponent"]
    c = corruptor(ber=1e-2, seed=7, scope="tensor")
    assert c.settings()["protect"] is None and not c._protecting
    c.set(protect=["sign", "exponent"], element="bf16")
    assert c.settings()["protect"] == ["sign", "exponent"] and c.layout.positions == set(range(7, 16))
    ep = c.stats()["epochs"]
    assert ep[0]["protection"] is None
    assert ep[1]["protection"] == {"element": "bf16", "protect": ["sign", "exponent"], "protected_ber": 0.0}
    for bad in ({"scope": "payload"}, {"protected_ber": 0.5}, {"ber": 1e-5, "protected_ber": 1e-4}):
        with pytest.raises(ValueError):
            c.set(**bad)
    assert c.scope == "tensor" and c.ber == 1e-2 and c.protected_ber == 0.0
    c.set(protect=[], element="fp32", scope="payload")
    assert not c._protecting and c.settings()["protect"] is None and c.scope == "payload"


TOPO = """name: tp
topology:
  nodes:
    h1: {kind: host}
    h2: {kind: host}
  links:
    - endpoints: ["h1:eth1", "h2:eth1"]
      ber: 1e-3
      scope: tensor
      protect: sign,exponent
      directions:
        h2->h1: {element: bf16, protected_ber: 1e-4}
"""


def test_topology_files_set_protection_per_link_and_direction(tmp_path):
    from testbed.topology.elements import LinkImpairment
    from testbed.topology.topo import Topology, TopologyError

    f = tmp_path / "t.yaml"
    f.write_text(TOPO)
    fwd, rev = Topology.load(f).links[0].forward, Topology.load(f).links[0].reverse
    assert (fwd.element, fwd.protect, fwd.protected_ber) == ("fp32", ("sign", "exponent"), 0.0)
    assert (rev.element, rev.protect, rev.protected_ber) == ("bf16", ("sign", "exponent"), 1e-4)
    assert "protect sign,exponent/bf16 at 0.0001" in rev.describe()
    d = rev.to_dict()
    assert LinkImpairment(**{**d, "protect": tuple(d["protect"])}) == rev
    over = Topology.load(f).with_overrides(protect=[7], element="fp16").links[0].reverse
    assert (over.protect, over.element) == ((7,), "fp16")
    for text, line, field, words in (
            (TOPO.replace("scope: tensor", "scope: payload"), 10, "links[0].protect", "scope: tensor only"),
            (TOPO.replace("protect: sign,exponent", "protect: [sign, 20]"), 12, "h2->h1.protect", "outside 0..15"),
            (TOPO.replace("1e-4", "1e-2"), 12, "h2->h1.protected_ber", "must not exceed ber"),
            (TOPO.replace("sign,exponent", "sign,exponant"), 10, "protect", "exponent")):
        f.write_text(text)
        with pytest.raises(TopologyError) as e:
            Topology.load(f)
        msg = str(e.value)
        assert f"t.yaml:{line}:" in msg and field in msg and words in msg, msg


# -- a real gloo transfer through a live engine -----------------------------------------------------------------

GLOO_PAIR = r"""
import datetime, json, os, sys
import numpy as np, torch, torch.distributed as dist
from testbed.bench.probe import popcount
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
n = int(os.environ["N_BYTES"])
masks = {"fp32": (np.uint32, 0x80000000, 0x7F800000, 0x007FFFFF), "bf16": (np.uint16, 0x8000, 0x7F80, 0x007F)}
for phase, (name, dtype) in enumerate((("fp32", torch.float32), ("bf16", torch.bfloat16))):
    x = torch.from_numpy(np.random.default_rng(10 + phase).standard_normal(n // dtype.itemsize).astype(np.float32))
    x = x.to(dtype)
    if rank == 0:
        sys.stdin.readline()  # the test sets the link's element first
        dist.send(x, dst=1)
        continue
    y = torch.empty_like(x)
    dist.recv(y, src=0)
    view = torch.int32 if dtype.itemsize == 4 else torch.int16
    u, *field = masks[name]
    d = y.view(view).numpy().view(u) ^ x.view(view).numpy().view(u)
    print(json.dumps({name: {"bit_errors": popcount(d), "fields": [popcount(d & u(m)) for m in field],
                             "values_changed": int(np.count_nonzero(d)), "values": int(d.size)}}), flush=True)
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"result": "ok"}), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, iptables)")
@pytest.mark.timeout(180)
def test_real_gloo_transfer_keeps_protected_fields_intact():
    """50 MB of fp32 and then 50 MB of bf16 values (dist.send/recv, so the received bits are exactly what
    crossed the wire) through an engine at BER 1e-3 with sign and exponent protected; the link's element is
    switched live between the two. Checked value by value against the known tensors."""
    pytest.importorskip("torch")

    ber, nbytes = 1e-3, 50_000_000
    with veth_link() as link:
        h = link.start_engine(ber=ber, seed=21, scope="tensor", control_ports=[29500], element="fp32",
                              protect=["sign", "exponent"])
        procs = []
        for rank, side in ((0, "a"), (1, "b")):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=link.addr["a"], MASTER_PORT="29500",
                       GLOO_SOCKET_IFNAME=link.iface, N_BYTES=str(nbytes), OMP_NUM_THREADS="1")
            procs.append(link.popen(side, [PYTHON, "-c", GLOO_PAIR], env=env, stdin=subprocess.PIPE))
        before = engine_stats(h)
        phases = {}
        for element, bits, man_bits in (("fp32", 32, 23), ("bf16", 16, 7)):
            if element == "bf16":
                set_engine(h, element="bf16")
            procs[0].stdin.write("go\n")
            procs[0].stdin.flush()
            got = read_json_line(procs[1], element, timeout=120)[element]
            after = engine_stats(h)
            d = {k: after[k] - before[k] for k in ("bits_seen", "bits_flipped", "bits_protected", "flips_corrected",
                                                   "flips_protected", "flips_sign", "flips_exponent",
                                                   "flips_mantissa")}
            before = after
            phases[element] = (got, d)
            n_values = nbytes * 8 // bits
            assert got["values"] == n_values
            assert got["fields"][:2] == [0, 0], f"{element}: protected fields changed: {got}"
            assert got["bit_errors"] == got["fields"][2] == d["bits_flipped"] == d["flips_mantissa"] > 0
            assert d["flips_sign"] == d["flips_exponent"] == d["flips_protected"] == 0
            assert d["bits_seen"] == nbytes * 8 and d["bits_seen"] - d["bits_protected"] == n_values * man_bits
            exposed = d["bits_seen"] - d["bits_protected"]
            lo, hi = assert_rate(d["bits_flipped"], exposed, ber)
            ci = stats.binomtest(d["bits_flipped"], exposed).proportion_ci(confidence_level=1 - ALPHA)
            assert ci.low <= ber <= ci.high
            assert_rate(d["bits_flipped"] + d["flips_corrected"], d["bits_seen"], ber)  # the raw line
            print(f"{element}: {d['bits_flipped']} flips in {exposed} exposed bits: "
                  f"BER {d['bits_flipped'] / exposed:.4g}"
                  f" (99.9% count interval [{lo}, {hi}], CI of the rate [{ci.low:.4g}, {ci.high:.4g}]); raw line "
                  f"{(d['bits_flipped'] + d['flips_corrected']) / d['bits_seen']:.4g}; effective "
                  f"{d['bits_flipped'] / d['bits_seen']:.4g}; values changed {got['values_changed']}/{got['values']}")
        for p in procs:
            read_json_line(p, "result", timeout=60)
            assert p.wait(30) == 0
        final = engine_stats(h)
        assert final["flows_desynced"] == 0 and final["packets_errors"] == 0 and final["flows_excluded"] >= 1
        e_fp32, e_bf16 = final["epochs"]
        assert e_fp32["protection"]["element"] == "fp32" and e_bf16["protection"]["element"] == "bf16"
        assert e_bf16["bits_exposed"] == nbytes * 8 // 16 * 7
