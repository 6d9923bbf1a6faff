"""The few bpf(2) commands the engine needs from Python (ctypes, no extra dependency): open a pinned map,
look an element up, update it. Maps are created and pinned by bpftool (loader.py); this only reads and
writes them."""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["BpfError", "obj_get", "map_lookup", "map_update", "prog_test_run", "possible_cpus", "BPF_F_LOCK"]

_SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}.get(platform.machine(), 321)
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_OBJ_GET = 7
BPF_PROG_TEST_RUN = 10
BPF_ANY = 0
BPF_F_LOCK = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BpfError(OSError):
    pass


class _ObjAttr(ctypes.Structure):
    _fields_ = [("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32), ("file_flags", ctypes.c_uint32),
                ("path_fd", ctypes.c_int32), ("_pad", ctypes.c_uint32)]


class _ElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def _bpf(cmd: int, attr: ctypes.Structure, what: str) -> int:
    r = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise BpfError(e, f"bpf({what}): {os.strerror(e)}")
    return r


def obj_get(path: str) -> int:
    """A file descriptor for the BPF object pinned at `path` (close it with os.close)."""
    p = ctypes.create_string_buffer(os.fsencode(path))
    attr = _ObjAttr(pathname=ctypes.addressof(p))
    return _bpf(BPF_OBJ_GET, attr, f"obj_get {path}")


def map_lookup(fd: int, key: bytes, value_size: int, flags: int = 0) -> bytes:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value_size)
    attr = _ElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(v), flags=flags)
    _bpf(BPF_MAP_LOOKUP_ELEM, attr, "map_lookup_elem")
    return v.raw


def map_update(fd: int, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value, len(value))
    attr = _ElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(v), flags=flags)
    _bpf(BPF_MAP_UPDATE_ELEM, attr, "map_update_elem")


class _TestAttr(ctypes.Structure):
    _fields_ = [("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32), ("data_size_in", ctypes.c_uint32),
                ("data_size_out", ctypes.c_uint32), ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
                ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32), ("ctx_size_in", ctypes.c_uint32),
                ("ctx_size_out", ctypes.c_uint32), ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32),
                ("_pad", ctypes.c_uint32)]


def prog_test_run(fd: int, data: bytes) -> tuple[int, bytes]:
    """Run a loaded tc program on one frame (BPF_PROG_TEST_RUN: the kernel builds a linear skb from an Ethernet
    frame, runs the program with its maps, tail calls and helpers, and returns the frame as the program left it):
    (return code, frame out)."""
    din = ctypes.create_string_buffer(data, len(data))
    dout = ctypes.create_string_buffer(len(data) + 256)
    attr = _TestAttr(prog_fd=fd, data_size_in=len(data), data_size_out=len(dout), data_in=ctypes.addressof(din),
                     data_out=ctypes.addressof(dout), repeat=1)
    _bpf(BPF_PROG_TEST_RUN, attr, "prog_test_run")
    return attr.retval, dout.raw[:attr.data_size_out]


def possible_cpus() -> int:
    """Number of possible CPUs (the per-CPU maps' value count): /sys/devices/system/cpu/possible."""
    try:
        text = open("/sys/devices/system/cpu/possible").read().strip()
    except OSError:
        return os.cpu_count() or 1
    n = 0
    for part in text.split(","):
        a, _, b = part.partition("-")
        n = max(n, int(b or a) + 1)
    return n
