"""Parsing of the human units used in topology files: rates, durations, fractions, sizes.

Each parser raises ValueError with a message that says what forms are accepted; the topology loader
prefixes it with the file and the field path.
"""

from __future__ import annotations

import math
import re

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

# tc's conventions: "bit" units are bits per second with decimal prefixes.
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE_RE = re.compile(_NUMBER + r"\s*([kmgt]?bit)(?:/s)?$", re.IGNORECASE)

_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_DURATION_RE = re.compile(_NUMBER + r"\s*(ns|us|µs|ms|s)$", re.IGNORECASE)

_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3}
_SIZE_RE = re.compile(_NUMBER + r"\s*([kmg]?b?)$", re.IGNORECASE)


def parse_rate(value: object) -> int:
    """'10gbit', '100 Mbit/s', '1.5gbit' -> bits per second (int). A bare number means bit/s."""
    if isinstance(value, bool):
        raise ValueError(f"expected a rate such as '10gbit' or '100mbit', got {value!r}")
    if isinstance(value, (int, float)):
        bps = float(value)
    elif isinstance(value, str):
        m = _RATE_RE.match(value.strip())
        if not m:
            raise ValueError(
                f"cannot parse rate {value!r}: use a number with bit, kbit, mbit, gbit or tbit "
                "(bits per second, as tc writes them), e.g. '10gbit'"
            )
        bps = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    else:
        raise ValueError(f"expected a rate such as '10gbit', got {type(value).__name__}")
    if not math.isfinite(bps):
        raise ValueError(f"rate must be a finite number, got {value!r}")
    if bps <= 0:
        raise ValueError(f"rate must be positive, got {value!r}")
    if bps < 8:
        raise ValueError(f"rate {value!r} is below 8 bit/s")
    return int(round(bps))


def parse_duration(value: object) -> float:
    """'100us', '1.5ms', '2s' -> seconds. Zero may be written as 0."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '1ms', got {value!r}")
    if isinstance(value, (int, float)):
        if value == 0:
            return 0.0
        if not math.isfinite(value):
            raise ValueError(f"duration must be a finite number with a unit, got {value!r}")
        raise ValueError(f"duration {value!r} needs a unit: ns, us, ms or s (e.g. '{value}ms')")
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as '1ms', got {type(value).__name__}")
    m = _DURATION_RE.match(value.strip())
    if not m:
        if value.strip().startswith("-"):
            raise ValueError(f"duration must not be negative, got {value!r}")
        raise ValueError(f"cannot parse duration {value!r}: use a number with ns, us, ms or s, e.g. '100us'")
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    if not math.isfinite(seconds):
        raise ValueError(f"duration must be a finite number, got {value!r}")
    return seconds


def parse_fraction(value: object) -> float:
    """'0.5%' -> 0.005; a bare number is a fraction in [0, 1]."""
    if isinstance(value, bool):
        raise ValueError(f"expected a fraction or a percentage, got {value!r}")
    if isinstance(value, str):
        s = value.strip()
        if s.endswith("%"):
            try:
                frac = float(s[:-1]) / 100.0
            except ValueError:
                raise ValueError(f"cannot parse percentage {value!r}") from None
        else:
            try:
                frac = float(s)
            except ValueError:
                raise ValueError(f"cannot parse {value!r}: write a fraction (0.01) or a percentage ('1%')") from None
    elif isinstance(value, (int, float)):
        frac = float(value)
    else:
        raise ValueError(f"expected a fraction or a percentage, got {type(value).__name__}")
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"must lie between 0 and 1 (0% and 100%), got {value!r}")
    return frac


def parse_probability(value: object, upper: float = 1.0) -> float:
    """A float, also written as a string such as '1e-5' (YAML 1.1 reads 1e-5 as a string)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number such as 1e-5, got {value!r}") from None
    if not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    p = float(value)
    if not 0.0 <= p <= upper:
        raise ValueError(f"must lie in [0, {upper:g}], got {value!r}")
    return p


def parse_size(value: object) -> int:
    """'512m', '2g', 1048576 -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '2g', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value.strip())
        if not m:
            raise ValueError(f"cannot parse size {value!r}: use a number with k, m or g, e.g. '512m'")
        size = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
        if not math.isfinite(size):
            raise ValueError(f"size must be a finite number, got {value!r}")
        n = int(size)
    else:
        raise ValueError(f"expected a size such as '2g', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n


def format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def format_duration(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-9:g}ns"
