"""The per-packet pipeline: parse, pick the eligible bits (by scope), draw flips from the model, apply them,
settle the checksum (by mode), count. Pure: bytes in, bytes (or None = unmodified) out; no sockets, so it
can be tested (and fuzzed) without a queue.

Which model draws the flips:

- TCP with checksum ``fix`` and scope ``payload``/``tensor``: ``OffsetKeyedFlips`` per flow direction,
  keyed by the flow's identity (addresses and ordinal, not ports: ``FlowState.identity``) and the stream
  offset from the ISN (or the first sequence number seen). A retransmitted byte range
  gets the same flips as the first time and is not counted twice, so the bytes the application reads carry
  exactly ``bits_flipped`` errors.
- everything else (``keep``, UDP, scope ``all``): one sequential model per engine (= per link direction).
  Retransmissions get fresh, independent errors, as on a real link; in ``keep`` mode they must, or a
  corrupted segment would be dropped again on every retransmission and the flow would stall.

Live changes (``set``) and existing flows: see docs/engine.md, "Live changes and existing flows".

Protected bits (scope ``tensor``, ``protect``): the flips are drawn over every eligible bit as always, then
only those on exposed bit positions of each value are kept (and those on protected positions with probability
``protected_ber / ber``, by a hash of the stream bit offset): ``_protected`` and ``protect.py``. The value
grid comes from the gloo tracker (``eligible_aligned``). Without ``protect`` the per-packet path is unchanged
except that the flips of modified packets are counted by field.
"""

from __future__ import annotations

import logging

import numpy as np

from testbed.engine.config import SETTABLE, EngineSpec
from testbed.engine.flows import TCP_SYN, FlowState, FlowTable, flow_key_ints
from testbed.engine.gloo import GlooStreamTracker, collective_codes
from testbed.engine.models import TAG_FLOW, TAG_LINK, OffsetKeyedFlips, build_model, profile_action
from testbed.engine.nfqueue import SKB_CSUMNOTREADY
from testbed.engine.packet import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    apply_flips,
    fix_ipv4_header_checksum,
    fix_l4_checksum,
    parse_ipv4,
)
from testbed.engine.protect import BitLayout, flow_salt, residual_keep
from testbed.engine.stats import Counters

__all__ = ["Corruptor", "DROP", "offset_keyed", "uses_gso"]


class _Drop:
    """What ``Corruptor.process`` returns for a packet the link loses (a failed codeword's frame, marked bad)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()

log = logging.getLogger(__name__)

# Seed-derivation tags, so the link model and the per-flow models never share a stream.


def _no_shift(_offset: int) -> int:
    """Scope payload keys flips by the stream offset itself."""
    return 0


def offset_keyed(scope: str, checksum: str) -> bool:
    """Whether TCP flips are drawn per flow direction by ``OffsetKeyedFlips`` (keyed by stream offset):
    checksum ``fix`` with scope ``payload``/``tensor``. Everything else draws from the link's sequential model.
    """
    return checksum == "fix" and scope in ("payload", "tensor")


def uses_gso(scope: str, checksum: str) -> bool:
    """Whether the queue should take GSO super-packets (NFQA_CFG_F_GSO): exactly in the offset-keyed modes.

    There the packet is checksummed again in full after the flips, and offset-keyed flips do not depend on
    how the stream is cut into packets, so big packets change nothing but speed. ``keep`` and ``all`` need
    MTU-sized frames (without the flag the kernel segments and completes checksums before queueing) so each
    frame is corrupted and checked as on a real link.
    """
    return offset_keyed(scope, checksum)


class Corruptor:
    """``spec`` must be validated (``EngineSpec.validate()`` returns it; ``Engine`` does it)."""

    def __init__(self, spec: EngineSpec, capture=None):
        self.spec = spec
        self.ber = float(spec.ber)
        self.error_model = dict(spec.error_model)
        self.scope = spec.scope
        self.checksum = spec.checksum
        self.seed = int(spec.seed)
        self.collectives = spec.collectives
        self._codes = collective_codes(self.collectives)  # the tensor-scope filter, shared by all trackers
        self.control_ports = frozenset(spec.control_ports)
        self.element = spec.element
        self.protect = spec.protect
        self.protected_ber = float(spec.protected_ber)
        self._set_layout()
        self.capture = capture
        self.counters = Counters(self.ber, self._protection())
        self.flows = FlowTable()
        self._generation = 0  # bumped when the model or seed changes: new streams for everything
        self.link_model = self._build(TAG_LINK)
        self._update_mode()

    # -- settings ----------------------------------------------------------------------------------------------

    def _build(self, tag: int, *key: int):
        return build_model(self.error_model, self.ber, self.seed, tag, self._generation, *key)

    def _set_layout(self) -> None:
        """The value layout in force (``protect.BitLayout``) and the residual keep fraction of protected flips."""
        self.layout = BitLayout(self.element, self.protect)
        self._protecting = self.layout.any
        self._residual = self.protected_ber / self.ber if self._protecting and self.protected_ber else 0.0

    def _protection(self) -> dict | None:
        if not self._protecting:
            return None
        return {"element": self.element, "protect": list(self.protect), "protected_ber": self.protected_ber}

    def _update_mode(self) -> None:
        # a link profile that drops or replays frames draws every transmission afresh from the link's model, as a
        # real link does (a retransmission crosses new codewords), over MTU-sized frames (no GSO)
        self.action = profile_action(self.error_model)
        self.offset_keyed = offset_keyed(self.scope, self.checksum) and self.action is None
        self.tracks_streams = self.offset_keyed or self.scope == "tensor"  # TCP stream offsets followed
        self.fix = self.checksum == "fix"

    @property
    def gso(self) -> bool:
        """Whether the queue should take GSO super-packets (``uses_gso``)."""
        return self.offset_keyed

    def settings(self) -> dict:
        return {"ber": self.ber, "error_model": dict(self.error_model), "scope": self.scope,
                "checksum": self.checksum, "seed": self.seed, "collectives": self.collectives,
                "control_ports": sorted(self.control_ports), "element": self.element,
                "protect": list(self.protect) if self.protect else None, "protected_ber": self.protected_ber}

    def set(self, restart: bool = False, **settings) -> dict:
        """Change settings live (keys: ``SETTABLE``; None values are ignored). Raises ValueError, changing
        nothing, if a value is invalid. Returns the settings now in force. What happens to existing flows:
        ``_settle_flows`` (docs/engine.md, "Live changes and existing flows"). ``restart``: then start over as
        an engine started with these settings would (seed generation 0, no flow known: connections opened
        from now on get the flips a fresh engine gives them), so a warm sweep's point is its cold twin."""
        settings = {k: v for k, v in settings.items() if v is not None}
        unknown = set(settings) - set(SETTABLE)
        if unknown:
            raise ValueError(f"cannot set {sorted(unknown)}; settable: {', '.join(SETTABLE)}")
        new = self.settings()
        new.update(settings)
        probe = EngineSpec(netns=self.spec.netns, iface=self.spec.iface, control_socket=self.spec.control_socket,
                           stats_file=self.spec.stats_file, ber=new["ber"], error_model=new["error_model"],
                           scope=new["scope"], checksum=new["checksum"], seed=new["seed"],
                           collectives=new["collectives"] if new["scope"] == "tensor" else None,
                           control_ports=new["control_ports"], element=new["element"], protect=new["protect"],
                           protected_ber=new["protected_ber"])
        probe.validate()  # raises before anything changes (normalizes error_model, checks collective names)
        codes = collective_codes(probe.collectives)
        em = probe.error_model
        rebuild = em != self.error_model or int(probe.seed) != self.seed
        ber_changed = float(probe.ber) != self.ber
        protection = (probe.element, probe.protect, probe.protected_ber)
        protection_changed = protection != (self.element, self.protect, self.protected_ber)
        old = (self.scope, self.offset_keyed, self.tracks_streams)
        self.error_model, self.seed = em, int(probe.seed)
        self.scope, self.checksum, self.collectives = probe.scope, probe.checksum, probe.collectives
        self._update_mode()
        if ber_changed or rebuild or protection_changed:
            # what a flip means changed: a new epoch. The protection applies to every flip emitted from now on
            # (a retransmission of bytes sent before gets the new filter; the first copy is what was counted)
            self.ber = float(probe.ber)
            self.element, self.protect, self.protected_ber = protection
            self._set_layout()
            self.counters.new_epoch(self.ber, self._protection())
        if rebuild:
            self._generation += 1
            self.link_model = self._build(TAG_LINK)
        elif ber_changed:
            self.link_model.set_ber(self.ber)
            for flow in self.flows.values():
                if flow.okf is not None:
                    flow.okf.set_ber(self.ber)
        self._settle_flows(*old, rebuild, codes)
        ports = frozenset(int(p) for p in probe.control_ports)
        if ports != self.control_ports:
            self.control_ports = ports
            for flow in self.flows.values():
                flow.excluded = self._is_control(flow.key)
        if restart:
            self._generation = 0
            self.flows = FlowTable()
            self.link_model = self._build(TAG_LINK)
        return self.settings()

    def _settle_flows(self, old_scope: str, old_keyed: bool, old_tracks: bool, rebuild: bool, codes) -> None:
        """Bring existing flows in line with the new settings (O(1) per flow: no model is built here).

        - Scope changed to or from ``tensor``: trackers are dropped. A tracker must parse its stream from
          the first byte, so a connection open across the change is treated as first seen mid-stream.
        - Stream offsets followed now but not before (from ``payload``+``keep`` or ``all``): offsets were not
          updated meanwhile, so every flow forgets its stream and restarts at its next packet (as if first
          seen there; a later gap would otherwise be unwrapped into the wrong 4 GiB epoch).
        - Offset-keyed flips turned on with offsets followed all along (``tensor``+``keep`` -> ``fix``), or a
          new model or seed: the flips restart at each flow's current offset (``keyed_from``) with a new
          model (new seed generation). Bytes below it that come again are counted as forgotten.
        - Collective filter changed: every live tracker gets the new codes (from its next frame header on).
        """
        tensor_changed = (old_scope == "tensor") != (self.scope == "tensor")
        tracks_on = self.tracks_streams and not old_tracks
        restart_flips = rebuild or (self.offset_keyed and not old_keyed)
        codes_changed = codes != self._codes
        self._codes = codes
        if restart_flips and not rebuild:
            self._generation += 1  # new per-flow streams, never a replay of the ones used before
        if not (tensor_changed or tracks_on or restart_flips or codes_changed):
            return
        for flow in self.flows.values():
            if tensor_changed:
                flow.tracker = None
            elif codes_changed and flow.tracker is not None:
                flow.tracker.codes = codes
            if tracks_on:
                flow.forget_stream()
            elif restart_flips:
                flow.okf = None
                # where the new flips start, in the offsets they are keyed by (eligible ones in scope tensor)
                keyed = self.scope == "tensor" and flow.tracker is not None
                flow.keyed_from = flow.tracker.eligible_bytes if keyed else flow.top

    # -- per packet --------------------------------------------------------------------------------------------

    def _is_control(self, key: bytes) -> bool:
        return ((key[8] << 8) | key[9]) in self.control_ports or ((key[10] << 8) | key[11]) in self.control_ports

    def _new_flow(self, key: bytes) -> FlowState:
        excluded = bool(self.control_ports) and self._is_control(key)
        if excluded:
            self.counters.flows_excluded += 1
        return self.flows.add(FlowState(key, excluded))

    def process(self, pkt, info: int = 0):
        """Corrupt one IP packet. Returns the modified packet (a bytearray of the same length) or None when
        the packet passes unmodified. Never raises on packet content."""
        c = self.counters
        c.packets += 1
        c.bytes += len(pkt)
        parsed = parse_ipv4(pkt)
        if parsed.__class__ is str:
            c.unparsed(parsed)
            return None
        proto, ihl, l4h, total = parsed
        # flow key: src addr, dst addr, src port, dst port
        key = bytes(pkt[12:24]) if ihl == 20 else bytes(pkt[12:20]) + bytes(pkt[ihl:ihl + 4])
        flow = self.flows.get(key)
        if flow is None:
            flow = self._new_flow(key)
        flow.last = c.packets
        if proto == IPPROTO_TCP:
            flags = pkt[ihl + 13]
            if flags & 0x07:  # FIN/RST: closed (evicted first when the table is full); SYN: open again
                flow.closed = not flags & TCP_SYN
        if flow.excluded:
            return None
        pay = ihl + l4h
        if self.scope == "all":
            return self._sequential(pkt, 0, total, proto, ihl, total, info, whole=True)
        if proto == IPPROTO_TCP:
            if self.tracks_streams:
                return self._tcp_stream(flow, pkt, ihl, pay, total, info, flags)
            return self._sequential(pkt, pay, total, proto, ihl, total, info)
        if self.scope == "tensor":  # gloo runs over TCP: no tensor bytes in UDP
            return None
        return self._sequential(pkt, pay, total, proto, ihl, total, info)

    def _sequential(self, pkt, a: int, b: int, proto: int, ihl: int, total: int, info: int, whole: bool = False):
        """Flip bits of ``pkt[a:b]`` drawn from the link's sequential model."""
        nbits = (b - a) << 3
        c = self.counters
        c.bits_seen += nbits
        if self.action is not None:
            return self._frame_action(nbits)
        f = self.link_model.flips(nbits)
        if not f.size:
            return None
        c.bits_flipped += f.size
        return self._emit(pkt, a, f, proto, ihl, total, info, whole)

    def _tcp_stream(self, flow: FlowState, pkt, ihl: int, pay: int, total: int, info: int, flags: int):
        plen = total - pay
        seq = (pkt[ihl + 4] << 24) | (pkt[ihl + 5] << 16) | (pkt[ihl + 6] << 8) | pkt[ihl + 7]
        off, new_stream = flow.stream_offset(seq, flags, plen)
        if new_stream:
            self.flows.number(flow)  # its flips' identity, stable from run to run (flows.FlowState.identity)
        if new_stream and self.scope == "tensor":
            tracker = flow.tracker = GlooStreamTracker(flow.initiator)
            tracker.codes = self._codes  # computed once per setting, not per flow
        if plen <= 0:
            return None
        c = self.counters
        if self.scope == "tensor":
            tracker = flow.tracker
            if tracker is None:  # start not seen in tensor scope (first seen mid-stream): never corrupted
                if not flow.desync_counted:
                    flow.desync_counted = True
                    c.flows_midstream += 1
                return None
            if self._protecting:
                ranges = tracker.eligible_aligned(off, pkt[pay:total])
            else:
                ranges = tracker.eligible(off, pkt[pay:total])
            if tracker.desynced and not flow.desync_counted:
                flow.desync_counted = True
                c.flows_desynced += 1
            if not ranges:
                return None
        else:
            if off < 0:  # bytes before the first sequence number seen: not part of the tracked stream
                if off + plen <= 0:
                    return None
                ranges = [(0, off + plen)]
            else:
                ranges = None
        if not self.offset_keyed:  # tensor + keep: eligible ranges from the tracker, flips from the link model
            return self._sequential_ranges(flow, pkt, off, pay, ranges, ihl, total, info)
        okf = flow.okf
        if okf is None:
            number, ident = flow.identity()
            okf = flow.okf = OffsetKeyedFlips(self._build(TAG_FLOW, number, *flow_key_ints(ident)),
                                              start=flow.keyed_from << 3)
        forgotten = okf.forgotten_bits
        if ranges is None:  # payload scope, whole segment
            r = okf.flips_at(off << 3, plen << 3)
            c.bits_seen += r.new_bits
            c.retransmitted_bits += r.retx_bits
            if r.new_flips:
                c.bits_flipped += r.new_flips
            if r.retx_flips:
                c.retransmitted_flips += r.retx_flips
            if okf.forgotten_bits != forgotten:
                c.forgotten_bits += okf.forgotten_bits - forgotten
            if not r.positions.size:
                return None
            return self._emit(pkt, pay, r.positions, IPPROTO_TCP, ihl, total, info)
        # tensor scope: keyed by the eligible offset (s - shift), stable whatever the notifications between frames
        shift = flow.tracker.shift_of if self.scope == "tensor" else _no_shift
        if self._protecting:
            parts = self._protected_keyed(flow, okf, off, ranges, shift)
        else:
            parts = []
            for s, e in ranges:
                k = s - shift(s)
                r = okf.flips_at(k << 3, (e - s) << 3)
                c.bits_seen += r.new_bits
                c.bits_flipped += r.new_flips
                c.retransmitted_bits += r.retx_bits
                c.retransmitted_flips += r.retx_flips
                if r.positions.size:
                    if r.new_flips and self.scope == "tensor":
                        self._count_fields(r.positions, (s - flow.tracker.origin_of(s)) << 3,
                                           self._new_mask(okf, r, k << 3))
                    parts.append(r.positions + ((s - off) << 3))
        c.forgotten_bits += okf.forgotten_bits - forgotten
        if not parts:
            return None
        return self._emit(pkt, pay, parts[0] if len(parts) == 1 else np.concatenate(parts), IPPROTO_TCP, ihl,
                          total, info)

    def _sequential_ranges(self, flow: FlowState, pkt, off: int, pay: int, ranges, ihl: int, total: int,
                           info: int):
        """Sequential-model flips over the eligible stream ranges (absolute offsets, non-empty list; with
        their origins when protecting) of one TCP segment (scope ``tensor`` with ``keep``)."""
        nbytes = 0
        for r in ranges:
            nbytes += r[1] - r[0]
        nbits = nbytes << 3
        c = self.counters
        c.bits_seen += nbits
        layout = self.layout
        if self._protecting:
            for s, e, o in ranges:
                c.bits_protected += layout.protected_bits((s - o) << 3, (e - o) << 3)
        if self.action is not None:
            return self._frame_action(nbits)
        f = self.link_model.flips(nbits)
        if not f.size:
            return None
        if len(ranges) == 1:
            s = ranges[0][0]
            within, grid, base = f, (s - self._origin(flow, ranges[0])) << 3, s << 3
        else:  # map positions in the concatenated eligible bits back to their ranges
            lengths = np.array([(r[1] - r[0]) << 3 for r in ranges], dtype=np.int64)
            ends = np.cumsum(lengths)
            k = np.searchsorted(ends, f, side="right")
            within = f - (ends[k] - lengths[k])
            grid = np.array([(r[0] - self._origin(flow, r)) << 3 for r in ranges], dtype=np.int64)[k]
            base = np.array([r[0] << 3 for r in ranges], dtype=np.int64)[k]
        if self._protecting:
            keep = self._thin(flow, within, grid, base, None)
            if keep is not None:
                f, within, base = f[keep], within[keep], base if np.isscalar(base) else base[keep]
                if not f.size:
                    return None
        else:
            self._count_fields(within, grid, None)
        c.bits_flipped += f.size
        return self._emit(pkt, pay, within + base - (off << 3), IPPROTO_TCP, ihl, total, info)

    def _frame_action(self, nbits: int):
        """A frame under a profile that drops or replays (``self.action``): drop, when it touches a failed
        codeword; replay, when it holds a bit error (it arrives again clean: passed unmodified, counted)."""
        c = self.counters
        if self.action == "drop":
            if self.link_model.failures(nbits):
                c.frames_dropped += 1
                return DROP
            return None
        if self.link_model.flips(nbits).size:
            c.frames_replayed += 1
        return None

    # -- protected bits and field counters (scope tensor) -------------------------------------------------------

    @staticmethod
    def _origin(flow: FlowState, r) -> int:
        """Origin of a tracker range: given with it when protecting, else looked up (only for ranges with
        flips)."""
        return r[2] if len(r) == 3 else flow.tracker.origin_of(r[0])

    @staticmethod
    def _new_mask(okf: OffsetKeyedFlips, r, start_bit: int):
        """Which of ``r.positions`` (relative to ``start_bit``) are first-time bits: None = all of them, False
        = none, else a bool array (from ``okf.last_new``)."""
        if not r.retx_bits:
            return None
        if not r.new_bits:
            return False
        pos = r.positions + start_bit
        new = np.zeros(pos.size, dtype=bool)
        for a, b in okf.last_new:
            new |= (pos >= a) & (pos < b)
        return new

    def _count_fields(self, within: np.ndarray, grid, new) -> None:
        """Count applied first-time flips by field. ``within``: bit positions in their range; ``grid``: bit
        offset of the range start from its value grid (an int, or one per flip); ``new``: see ``_new_mask``."""
        if new is False:
            return
        if new is None and within.size <= 8 and grid.__class__ is int:  # a loop beats numpy's fixed cost
            n = [0, 0, 0]
            codes, mask = self.layout.field_codes, self.layout.mask
            for p in within.tolist():
                n[codes[(p + grid) & mask]] += 1
            self._add_fields(n)
            return
        slots = within + grid
        slots &= self.layout.mask
        self._add_fields_of(slots if new is None else slots[new])

    def _add_fields_of(self, slots: np.ndarray) -> None:
        self._add_fields(np.bincount(self.layout.field[slots], minlength=3).tolist())

    def _add_fields(self, n: list) -> None:
        c = self.counters
        c.flips_sign += n[0]
        c.flips_exponent += n[1]
        c.flips_mantissa += n[2]

    def _thin(self, flow: FlowState, within: np.ndarray, grid, base, new):
        """Protection: which drawn flips to apply (a bool mask, None for all): none on protected positions
        except those a hash of (seed, flow, stream bit offset ``within + base``) keeps at ``protected_ber /
        ber``. Counts the first-time ones (``new`` as in ``_new_mask``): corrected, protected, by field."""
        layout = self.layout
        slots = within + grid
        slots &= layout.mask
        prot = layout.protected[slots]
        keep = None
        if prot.any():
            keep = ~prot
            if self._residual:
                idx = np.flatnonzero(prot)
                offsets = within[idx] + (base if np.isscalar(base) else base[idx])
                keep[idx] = residual_keep(flow_salt(self.seed, *flow.identity()), offsets, self._residual)
        if new is False:  # retransmitted bits only: the same flips again, counted apart
            return keep
        if keep is None:
            self._add_fields_of(slots if new is None else slots[new])
            return None
        drawn = prot if new is None else prot & new  # first-time flips on protected positions
        applied = keep if new is None else keep & new
        c = self.counters
        c.flips_corrected += int(np.count_nonzero(drawn & ~keep))
        c.flips_protected += int(np.count_nonzero(drawn & keep))
        self._add_fields_of(slots[applied])
        return keep

    def _protected_keyed(self, flow: FlowState, okf: OffsetKeyedFlips, off: int, ranges, shift) -> list:
        """Offset-keyed flips over aligned ranges ``(start, end, origin)`` with protection: the positions to
        flip (payload-relative bits), per range, keyed by the eligible offset ``start - shift(start)``;
        counters as in ``_tcp_stream`` plus the protection's."""
        c = self.counters
        layout = self.layout
        parts = []
        for s, e, o in ranges:
            sb = (s - shift(s)) << 3
            r = okf.flips_at(sb, (e - s) << 3)
            grid = (s - o) << 3
            c.bits_seen += r.new_bits
            c.retransmitted_bits += r.retx_bits
            if not r.retx_bits:
                c.bits_protected += layout.protected_bits(grid, grid + ((e - s) << 3))
            elif r.new_bits:
                for a, b in okf.last_new:
                    c.bits_protected += layout.protected_bits(a - sb + grid, b - sb + grid)
            pos = r.positions
            if not pos.size:
                continue
            new = self._new_mask(okf, r, sb)
            keep = self._thin(flow, pos, grid, sb, new)
            if keep is None:
                applied, n_new = pos, r.new_flips
            else:
                applied = pos[keep]
                if new is None:
                    n_new = applied.size
                else:
                    n_new = 0 if new is False else int(np.count_nonzero(keep & new))
            c.bits_flipped += n_new
            c.retransmitted_flips += applied.size - n_new
            if applied.size:
                parts.append(applied + ((s - off) << 3))
        return parts

    def _emit(self, pkt, base: int, positions: np.ndarray, proto: int, ihl: int, total: int, info: int,
              whole: bool = False):
        """Copy, flip, settle checksums, count, capture."""
        out = bytearray(pkt)
        if self.fix:
            apply_flips(out, base, positions)
            if whole:
                self._fix_whole(out, proto, ihl, pkt)
            elif proto == IPPROTO_TCP or ((pkt[ihl + 6] << 8) | pkt[ihl + 7]):  # UDP checksum 0 = none
                fix_l4_checksum(out, ihl, total, proto)
        else:
            if info & SKB_CSUMNOTREADY:
                # The field holds only the pseudo-header sum (offload pending); write the checksum the sender
                # would have sent for the clean packet, so that the corruption is what the receiver catches.
                fix_l4_checksum(out, ihl, total, proto)
            apply_flips(out, base, positions)
        c = self.counters
        c.packets_modified += 1
        if positions.size > 1:
            c.packets_multiflip += 1
        if self.capture is not None:
            self.capture.write(bytes(pkt), out)
        return out

    @staticmethod
    def _fix_whole(out: bytearray, proto: int, ihl: int, orig) -> None:
        """Scope ``all`` with ``fix``: make the corrupted packet's checksums valid as its (possibly corrupted)
        headers now describe it. Flips that landed on a checksum field are overwritten."""
        parsed = parse_ipv4(out)
        if parsed.__class__ is not str:
            p_proto, p_ihl, _, p_total = parsed
            no_udp_checksum = (p_proto == IPPROTO_UDP and proto == IPPROTO_UDP
                               and not (out[p_ihl + 6] or out[p_ihl + 7]) and not (orig[ihl + 6] or orig[ihl + 7]))
            if not no_udp_checksum:
                fix_l4_checksum(out, p_ihl, p_total, p_proto)
        n = len(out)
        if n >= 20 and out[0] >> 4 == 4:
            h = (out[0] & 0x0F) << 2
            if 20 <= h <= n:
                fix_ipv4_header_checksum(out, h)

    # -- reporting ---------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        d = self.counters.to_dict()
        d.update(self.settings())
        # a FEC profile's codewords (sequential link model and the per-flow ones: pass draws per flow)
        models = [self.link_model] + [f.okf.model for f in self.flows.values() if f.okf is not None]
        coded = [m for m in models if hasattr(m, "codewords_failed")]
        d["codewords"] = sum(m.codewords for m in coded) if coded else None
        d["codewords_failed"] = sum(m.codewords_failed for m in coded) if coded else None
        d["flows"] = len(self.flows)
        d["gso"] = self.offset_keyed
        if self.capture is not None:
            d["capture"] = self.capture.stats()
        return d

