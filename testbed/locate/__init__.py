"""Fault localisation (issue 13, docs/locate.md): which link of a topology is bad, from what a training run
can observe about itself.

- monitor.py   inside a training worker (--monitor): a timed, checksummed probe to each ring neighbour per step,
               per-bucket collective times, the host's TCP counters; a `monitor` field in each metrics row
- paths.py     which link directions each rank-to-rank hop crosses (from the topology's routes; no BER)
- detectors.py timing (robust step-by-step comparison of hops), consistency (checksum mismatches per hop),
               counters (TCP retransmissions and checksum drops per host); pure logic, no torch
- cli.py       `testbed locate RUN_DIR [--json]`
"""
