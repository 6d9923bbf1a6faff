"""Counters of one engine (one link direction), their epochs, and the atomically written stats file."""

from __future__ import annotations

import os
import time

from testbed.fileio import write_json_atomic as _write_json_atomic

__all__ = ["Counters", "write_json_atomic"]


class Counters:
    """Per-direction counters. Plain attributes: the per-packet path increments them directly.

    ``bits_seen``/``bits_flipped`` count eligible bits the first time they pass (a retransmitted byte range
    in offset-keyed mode is counted in ``retransmitted_bits``/``retransmitted_flips`` instead), so
    ``bits_flipped / bits_seen`` is the realized BER of the data stream the application reads.
    Every live BER change closes an *epoch*: ``epochs`` lists ``{ber, since, bits_seen, bits_flipped}``.

    Scope ``tensor`` (docs/engine.md, "Protected bits"): ``bits_protected`` counts the eligible bits on protected
    positions (so ``bits_exposed = bits_seen - bits_protected``), ``flips_protected`` the flips applied to them
    (residual errors, at ``protected_ber``), ``flips_corrected`` the line's flips removed by the protection, and
    ``flips_sign``/``flips_exponent``/``flips_mantissa`` the applied flips by field of the element type in force.
    Like ``bits_seen``/``bits_flipped`` they count first-time bits only. Nothing here is counted per packet
    unless the packet has flips or protection is on.
    """

    FIELDS = (
        "packets", "bytes", "bits_seen", "bits_flipped", "packets_modified", "packets_multiflip",
        "packets_unparsed", "packets_truncated", "packets_errors", "flows_excluded", "flows_desynced",
        "flows_midstream", "retransmitted_bits", "retransmitted_flips", "forgotten_bits",
        "bits_protected", "flips_protected", "flips_corrected", "flips_sign", "flips_exponent", "flips_mantissa",
        "frames_dropped", "frames_replayed",
    )

    def __init__(self, ber: float, protection: dict | None = None):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.unparsed_reasons: dict[str, int] = {}
        self.epochs: list[dict] = []
        self._epoch_start = (0, 0, 0, 0)  # bits_seen, bits_flipped, bits_protected, flips_protected
        self._epoch_ber = float(ber)
        self._epoch_protection = protection
        self._epoch_since = time.time()

    def unparsed(self, reason: str) -> None:
        self.packets_unparsed += 1
        self.unparsed_reasons[reason] = self.unparsed_reasons.get(reason, 0) + 1

    def new_epoch(self, ber: float, protection: dict | None = None) -> None:
        """Close the current epoch (its bits are those counted since it began) and start one at ``ber`` (and
        ``protection``: ``{element, protect, protected_ber}`` or None when nothing is protected)."""
        self.epochs.append(self._current_epoch())
        self._epoch_start = (self.bits_seen, self.bits_flipped, self.bits_protected, self.flips_protected)
        self._epoch_ber = float(ber)
        self._epoch_protection = protection
        self._epoch_since = time.time()

    def _current_epoch(self) -> dict:
        s0, f0, p0, fp0 = self._epoch_start
        seen, flipped = self.bits_seen - s0, self.bits_flipped - f0
        exposed = seen - (self.bits_protected - p0)
        flipped_exposed = flipped - (self.flips_protected - fp0)
        return {"ber": self._epoch_ber, "since": self._epoch_since, "bits_seen": seen, "bits_flipped": flipped,
                "realized_ber": flipped / seen if seen else None, "protection": self._epoch_protection,
                "bits_exposed": exposed, "bits_flipped_exposed": flipped_exposed,
                "exposed_ber": flipped_exposed / exposed if exposed else None}

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.FIELDS}
        d["realized_ber"] = self.bits_flipped / self.bits_seen if self.bits_seen else None
        # BER semantics (docs/engine.md, "Protected bits"): per exposed bit, and over all eligible bits
        d["bits_exposed"] = exposed = self.bits_seen - self.bits_protected
        d["bits_flipped_exposed"] = fe = self.bits_flipped - self.flips_protected
        d["exposed_ber"] = fe / exposed if exposed else None
        d["effective_ber"] = d["realized_ber"]
        d["protected_realized_ber"] = self.flips_protected / self.bits_protected if self.bits_protected else None
        d["unparsed_reasons"] = dict(self.unparsed_reasons)
        d["epochs"] = [*self.epochs, self._current_epoch()]
        return d


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    _write_json_atomic(path, obj, indent=1)
