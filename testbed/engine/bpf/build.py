"""Build the bpf engine's object (flip.c) with Debian's clang, on first use, into a cache directory.

The object is never committed: it is compiled from the source next to this file with
``clang -O2 -g -target bpf -mcpu=v3`` (``-g``: the maps are BTF-defined and the state map holds a
bpf_spin_lock, both need BTF) and cached under ``$TESTBED_BPF_CACHE`` (default ``/var/cache/testbed/bpf``,
or ``~/.cache/testbed/bpf`` when that cannot be written), keyed by a hash of the source, the flags and the
compiler's version, so an edit or another clang rebuilds it. Concurrent builders are safe (temp file +
rename).

Debian packages: clang (clang-14 in bookworm), llvm, libbpf-dev (bpf/bpf_helpers.h), linux-libc-dev
(linux/bpf.h), bpftool (loads and pins), iproute2 (tc attaches).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

__all__ = ["SOURCE", "CFLAGS", "PACKAGES", "BuildError", "object_path", "cache_dir", "missing_tools", "include_dirs"]

SOURCE = Path(__file__).with_name("flip.c")
CFLAGS = ("-O2", "-g", "-target", "bpf", "-mcpu=v3", "-Wall")
# What the engine needs installed (Debian names), by what it is for.
PACKAGES = {"clang": "clang", "llc": "llvm", "bpftool": "bpftool", "tc": "iproute2",
            "/usr/include/bpf/bpf_helpers.h": "libbpf-dev", "/usr/include/linux/bpf.h": "linux-libc-dev",
            "ethtool": "ethtool"}


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    env = os.environ.get("TESTBED_BPF_CACHE")
    candidates = [Path(env)] if env else [Path("/var/cache/testbed/bpf"), Path.home() / ".cache" / "testbed" / "bpf"]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    return Path(tempfile.gettempdir()) / "testbed-bpf"


def include_dirs() -> list[str]:
    """-I for the multiarch headers (asm/types.h lives in /usr/include/<triplet> on Debian; clang's bpf
    target does not look there by itself)."""
    triplet = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    return [f"-I/usr/include/{triplet}"] if os.path.isdir(f"/usr/include/{triplet}") else []


def missing_tools() -> dict[str, str]:
    """What is missing, as {tool or header: Debian package}; empty when everything the engine needs is there."""
    out = {}
    for what, pkg in PACKAGES.items():
        present = os.path.exists(what) if what.startswith("/") else shutil.which(what) is not None
        if what == "llc":  # only clang needs it (clang links llvm's backend itself); report, not required
            continue
        if not present:
            out[what] = pkg
    return out


def _clang() -> str:
    for name in ("clang", "clang-14", "clang-15", "clang-16"):
        p = shutil.which(name)
        if p:
            return p
    raise BuildError("clang is missing (apt-get install clang llvm libbpf-dev): the bpf engine is compiled on "
                     "first use")


def _clang_version(clang: str) -> str:
    try:
        return subprocess.run([clang, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


# Benchmarks only (benchmarks/bench_bpf_floor.py): variants of the program that measure a floor, named in
# TESTBED_BPF_FLOOR: "compute" (keyed flips computed and counted, no byte written), "copy" (and each packet
# with flips made linear and private up to its last flip, as for writing, but nothing written).
FLOORS = {"compute": "-DTB_FLOOR_COMPUTE", "copy": "-DTB_FLOOR_COPY"}


def floor_flags() -> list[str]:
    v = os.environ.get("TESTBED_BPF_FLOOR", "").strip()
    if not v:
        return []
    if v not in FLOORS:
        raise BuildError(f"TESTBED_BPF_FLOOR must be one of {', '.join(FLOORS)} (benchmarks only), got {v!r}")
    return [FLOORS[v]]


def object_path(source: Path = SOURCE) -> Path:
    """The compiled object for `source`: from the cache, or built now (a second or so)."""
    clang = _clang()
    flags = [*CFLAGS, *include_dirs(), *floor_flags()]
    text = source.read_bytes()
    key = hashlib.sha256(text + "\0".join(flags).encode() + _clang_version(clang).encode()).hexdigest()[:16]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    obj = d / f"{source.stem}-{key}.o"
    if obj.exists():
        return obj
    fd, tmp = tempfile.mkstemp(prefix=obj.name + ".", dir=d)
    os.close(fd)
    try:
        r = subprocess.run([clang, *flags, "-c", str(source), "-o", tmp], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            hint = ""
            if "bpf_helpers.h" in r.stderr:
                hint = " (apt-get install libbpf-dev)"
            elif "asm/types.h" in r.stderr or "linux/bpf.h" in r.stderr:
                hint = " (apt-get install linux-libc-dev)"
            raise BuildError(f"clang could not build {source}{hint}:\n{r.stderr.strip()[-3000:]}")
        os.replace(tmp, obj)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return obj
