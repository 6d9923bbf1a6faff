"""The corruption engine: an NFQUEUE shim that flips bits of packets crossing one link direction.

- ``models``: seeded bit error models (Bernoulli, Gilbert-Elliott) and offset-keyed flips per TCP flow.
- ``packet``: IPv4/TCP/UDP parsing, checksums, bit flipping.
- ``nfqueue``: a lean nfnetlink_queue client.
- ``corruptor``: the per-packet pipeline (scope, checksum mode, counters).
- ``gloo``: the gloo stream tracker (scope ``tensor``); ``protect``: protected bits of tensor values.
- ``shim`` / ``__main__``: the engine process; ``manager``: start/stop/query engines from outside.
- ``base`` / ``registry``: the engine kinds' interface and registry (``nfqueue_engine``, ``bpf_engine``).
- ``links``: one topology's engines on this machine (``Testbed.engines``); ``counters``: what they count.

See docs/engine.md.
"""
