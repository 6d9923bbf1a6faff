"""The one place that knows there are two kinds of testbed: a topology on this machine (testbed/net.py) and one
across the machines of an inventory (testbed/machines/cluster.py). Everything else holds a BaseTestbed
(testbed/base.py) from `create` or `attach` and never asks which kind it is.

    with testbeds.create("topologies/pair.yaml") as tb: ...            # up here, down after
    with testbeds.create(topo, load_inventory("machines.yaml")) as tb: ...   # across machines
    tb = testbeds.attach("pair")                                         # one that is up; tb.close() after
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from testbed.base import BaseTestbed, quiet
from testbed.machines import cluster
from testbed.machines.placement import VXLAN_PORT
from testbed.net import Testbed
from testbed.state import running_names
from testbed.topology.topo import Topology


def create(topology: Topology | str | Path, machines=None, *, name: str | None = None, runtime: str | None = None,
           capture: dict | None = None, results_dir: str | Path | None = None, engine_procs: str | None = None,
           vxlan_port: int = VXLAN_PORT, log: Callable[[str], None] = quiet) -> BaseTestbed:
    """The testbed of `topology` (a Topology or its file), not up yet: on this machine, or placed across the
    machines of the inventory `machines`. `with` brings it up and down."""
    topo = topology if isinstance(topology, Topology) else Topology.load(topology, name=name)
    if name and topo.name != name:
        topo = topo.with_overrides(name=name)
    if machines is None:
        return Testbed(topo, runtime=runtime, capture=capture, results_dir=results_dir, engine_procs=engine_procs)
    if capture:
        raise ValueError("--capture is not available across machines yet")
    return cluster.ClusterTestbed(topo, machines, runtime=runtime, vxlan_port=vxlan_port, log=log)


def _spans_machines(name: str) -> bool:
    return cluster.cluster_of(name) is not None


def attach(name: str) -> BaseTestbed:
    """The testbed of topology `name`, which is up (LookupError if it is not, or its state is unusable)."""
    if _spans_machines(name):
        return cluster.ClusterTestbed.attach(name)
    return Testbed.attach(name)


def down(name: str) -> dict:
    """Remove topology `name` from wherever it runs. {"found": False} if nothing of it is here; else its
    errors (the state is kept when there are any, for a retry) and where the final counters went."""
    from testbed.clean import leftovers, teardown
    from testbed.topology.schema import TOPOLOGY_NAME_RE

    if not TOPOLOGY_NAME_RE.match(name):  # no topology has it; '' would match every topology's leftovers
        raise ValueError(f"{name!r} is not a topology name (1-24 of a-z 0-9 _ -, starting with a letter or digit)")
    if _spans_machines(name):
        return {"found": True, "errors": cluster.down(name)}
    if name not in running_names() and not any(leftovers(name).values()):
        return {"found": False, "errors": []}
    return {"found": True, **teardown(name)}


def down_all(inventory=None) -> dict:
    """Every topology and every leftover of the testbed: those across machines first (and with an inventory
    `testbed down --all` on each of its machines), then this machine's. {"topologies", "swept", "errors"}."""
    from testbed.clean import clean_all

    errors = cluster.down_all(inventory)
    done = clean_all()
    return {**done, "errors": errors}


def status(name: str) -> dict:
    """What `testbed status` reports of topology `name`; a topology whose state is unusable (a killed `up`)
    is reported broken, with what to do."""
    try:
        tb = attach(name)
    except (LookupError, ValueError) as e:
        return {"name": name, "file": None, "runtime": None, "phase": "broken", "up_pid": None, "created_at": None,
                "hosts": {}, "engines": [], "healthy": False,
                "problems": [f"no usable state ({type(e).__name__}: {e}): remove it with `testbed down {name}`"]}
    try:
        return tb.status()
    finally:
        tb.close()

