"""Optional capture of corrupted packets, before and after corruption, to two pcap files.

The queue hands over IP packets without an Ethernet header, so the files use link type 101 (LINKTYPE_RAW:
raw IPv4/IPv6), which tcpdump, Wireshark and Scapy's rdpcap read. Packet i of ``before.pcap`` and packet i
of ``after.pcap`` are the same packet. Writing stops (and ``dropped`` counts) once the two files together
would exceed ``max_bytes``. Scapy is imported only when a capture is configured: no cost otherwise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["CaptureWriter", "LINKTYPE_RAW"]

LINKTYPE_RAW = 101
_PCAP_HEADER = 24
_RECORD_HEADER = 16


class CaptureWriter:
    def __init__(self, directory: str | os.PathLike, max_bytes: int = 10_000_000):
        from scapy.utils import RawPcapWriter  # lazy: importing Scapy takes ~1 s

        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.before_path = self.dir / "before.pcap"
        self.after_path = self.dir / "after.pcap"
        self._before = RawPcapWriter(str(self.before_path), linktype=LINKTYPE_RAW, snaplen=0xFFFF)
        self._after = RawPcapWriter(str(self.after_path), linktype=LINKTYPE_RAW, snaplen=0xFFFF)
        # Write the headers now so the files are valid pcaps even when nothing gets captured.
        self._before.write_header(None)
        self._after.write_header(None)
        self._before.flush()
        self._after.flush()
        self.bytes = 2 * _PCAP_HEADER
        self.packets = 0
        self.dropped = 0

    def write(self, before: bytes, after: bytes | bytearray) -> bool:
        """Record one corrupted packet; False (and counted) when the size bound is reached."""
        need = 2 * _RECORD_HEADER + len(before) + len(after)
        if self.bytes + need > self.max_bytes:
            self.dropped += 1
            return False
        now = time.time()
        sec = int(now)
        usec = int((now - sec) * 1e6)
        self._before.write_packet(before, sec=sec, usec=usec)
        self._after.write_packet(bytes(after), sec=sec, usec=usec)
        self.bytes += need
        self.packets += 1
        return True

    def flush(self) -> None:
        self._before.flush()
        self._after.flush()

    def close(self) -> None:
        self._before.close()
        self._after.close()

    def stats(self) -> dict:
        return {"dir": str(self.dir), "before": str(self.before_path), "after": str(self.after_path),
                "packets": self.packets, "bytes": self.bytes, "max_bytes": self.max_bytes, "dropped": self.dropped}
