"""Counters of one engine (one link direction), their epochs, and the atomically written stats file."""

from __future__ import annotations

import os
import time

from ..fileio import write_json_atomic as _write_json_atomic

__all__ = ["Counters", "write_json_atomic"]


class Counters:
    """Per-direction counters. Plain attributes: the per-packet path increments them directly.

    ``bits_seen``/``bits_flipped`` count eligible bits the first time they pass (a retransmitted byte range
    in offset-keyed mode is counted in ``retransmitted_bits``/``retransmitted_flips`` instead), so
    ``bits_flipped / bits_seen`` is the realized BER of the data stream the application reads.
    Every live BER change closes an *epoch*: ``epochs`` lists ``{ber, since, bits_seen, bits_flipped}``.
    """

    FIELDS = (
        "packets", "bytes", "bits_seen", "bits_flipped", "packets_modified", "packets_multiflip",
        "packets_unparsed", "packets_truncated", "packets_errors", "flows_excluded", "flows_desynced",
        "flows_midstream", "retransmitted_bits", "retransmitted_flips", "forgotten_bits",
    )

    def __init__(self, ber: float):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.unparsed_reasons: dict[str, int] = {}
        self.epochs: list[dict] = []
        self._epoch_bits_seen = 0
        self._epoch_bits_flipped = 0
        self._epoch_ber = float(ber)
        self._epoch_since = time.time()

    def unparsed(self, reason: str) -> None:
        self.packets_unparsed += 1
        self.unparsed_reasons[reason] = self.unparsed_reasons.get(reason, 0) + 1

    def new_epoch(self, ber: float) -> None:
        """Close the current epoch (its bits are those counted since it began) and start one at ``ber``."""
        self.epochs.append(self._current_epoch())
        self._epoch_bits_seen = self.bits_seen
        self._epoch_bits_flipped = self.bits_flipped
        self._epoch_ber = float(ber)
        self._epoch_since = time.time()

    def _current_epoch(self) -> dict:
        seen = self.bits_seen - self._epoch_bits_seen
        flipped = self.bits_flipped - self._epoch_bits_flipped
        return {"ber": self._epoch_ber, "since": self._epoch_since, "bits_seen": seen, "bits_flipped": flipped,
                "realized_ber": flipped / seen if seen else None}

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.FIELDS}
        d["realized_ber"] = self.bits_flipped / self.bits_seen if self.bits_seen else None
        d["unparsed_reasons"] = dict(self.unparsed_reasons)
        d["epochs"] = [*self.epochs, self._current_epoch()]
        return d


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    _write_json_atomic(path, obj, indent=1)
