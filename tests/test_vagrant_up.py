"""`vagrant up --provider libvirt` for real (issue 24; `make test-vagrant`, mark `vagrant`, outside `make test`):
the box built here (testbed/machines/vagrantbox.py), libvirtd in a namespace of the testbed's own, one VM under
TCG (KVM where it works), then what the VM must offer and that the `vagrant ssh-config` inventory connects without
prompts. The VM, the box copy, libvirt's networks, volumes and the namespace are removed afterwards. Root.

Provisioning is skipped (`--no-provision`): it runs `make deps`, which needs Debian's mirror and PyPI from inside
the VM, and the VMs' network here has no way out (the namespace is not routed to the host on purpose)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from testbed.machines import vagrantbox
from testbed.machines.inventory import inventory_from_ssh_config, parse_inventory
from testbed.machines.remote import Remote

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.vagrant, pytest.mark.privileged]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    timings: dict[str, float] = {}
    t = time.monotonic()
    box = vagrantbox.build_box(log=print)
    timings["box"] = time.monotonic() - t
    dot = tmp_path_factory.mktemp("vagrant-dot")
    env = {"TESTBED_VMS": "1", "TESTBED_VM_CPUS": "1", "TESTBED_VM_MEMORY": "1024", "VAGRANT_DOTFILE_PATH": str(dot)}
    with vagrantbox.libvirt_netns(accel=vagrantbox.box_accel(box, log=print), log=print) as lv:
        before = set(os.listdir(vagrantbox.IMAGES_DIR)) if vagrantbox.IMAGES_DIR.is_dir() else set()
        try:
            vagrantbox.add_box(box, env={"VAGRANT_HOME": str(lv.home)}, log=print)
            t = time.monotonic()
            r = lv.vagrant(["up", "--provider", "libvirt", "--no-provision"], env=env, cwd=str(ROOT), timeout=1200)
            timings["up"] = time.monotonic() - t
            assert "using testbed/bookworm-local" in r.stderr, r.stderr
            yield lv, env, timings
        finally:
            lv.vagrant(["destroy", "-f"], env=env, cwd=str(ROOT), check=False, timeout=300)
            lv.vagrant(["box", "remove", "--force", vagrantbox.BOX_NAME], env=env, check=False)
        netns = lv.netns
    print(f"timings (s): {timings}")
    assert not (vagrantbox.vm.NETNS_DIR / netns).exists()
    after = set(os.listdir(vagrantbox.IMAGES_DIR)) if vagrantbox.IMAGES_DIR.is_dir() else set()
    assert after <= before, after - before
    assert subprocess.run(["pgrep", "-x", "libvirtd"], capture_output=True).returncode != 0


def test_the_vm_has_netem_the_private_network_and_the_project(up):
    lv, env, _ = up
    out = lv.vagrant(["ssh", "-c", "sudo modprobe sch_netem && lsmod | grep -c ^sch_netem; ip -o -4 addr show eth1; "
                      "test -f /testbed/Makefile && echo synced"], env=env, cwd=str(ROOT)).stdout
    assert out.split()[0] == "1", out
    assert "inet 192.168.56.11/24" in out and "synced" in out, out


def test_the_vagrant_inventory_connects_without_prompts(up, tmp_path):
    """`vagrant ssh-config` (StrictHostKeyChecking no, UserKnownHostsFile /dev/null) through
    `testbed machines from-ssh-config`: host keys not checked, nothing written, no prompt."""
    lv, env, _ = up
    config = lv.ssh_config(str(ROOT), env=env)
    inv = parse_inventory(inventory_from_ssh_config(config))
    m = inv["m1"]
    assert (m.host_key_check, m.known_hosts, m.user) == (False, "/dev/null", "vagrant")
    with Remote.connect(m, timeout=30) as r:
        assert r.run(["id", "-un"]).stdout.strip() == "vagrant"
        assert r.run(["sudo", "-n", "id", "-u"]).stdout.strip() == "0"
