"""The bpf engine: an in-kernel fast path for scopes ``payload`` and ``all``.

- ``flip.c``: the tc (clsact) program: exact Bernoulli / Gilbert-Elliott flips from a seeded PRNG whose state
  is kept per direction in a map, GSO super-packets corrupted whole, checksum ``fix``/``keep``.
- ``build``: compiles flip.c with clang into a cache directory on first use.
- ``maps``: the maps' layouts, gap tables, configuration encoding; ``syscall``: bpf(2) from Python.
- ``pins``: where programs and maps are pinned (bpffs), for sweeps.
- ``engine``: start/stop/stats/set/detach/attach (called by testbed.engine.manager for ``engine: bpf``).

See docs/engine.md, "The bpf engine".
"""
