"""The Vagrantfile (docs/machines.md, "Vagrant"): `vagrant validate` on it with the default settings and with
others, the machines it defines, and its own check of the TESTBED_VM* variables. No VM is started.

`vagrant validate` alone cannot run here: it first picks a usable provider, and neither VirtualBox nor the
vagrant-libvirt plugin is usable on the build machines ("No usable default provider could be found"). Vagrant
2.3's `vagrant validate --ignore-provider` replaces every provider with a stand-in, then loads the Vagrantfile
and validates each machine's configuration (box, networks, synced folders, provisioners) except the active
provider's own section. The provider blocks still run while the configuration is loaded: an error in the
libvirt or virtualbox block (an undefined name, say) fails the command; what it skips is only the provider's
check of the values (e.g. a misspelt VirtualBox option). For each machine it validates, it prints
"==> NAME: Ignoring provider config for validation...": that line gives the machine list, which
`vagrant status` cannot (it needs a provider).

Each run works on a copy of the Vagrantfile in a temporary folder, with VAGRANT_HOME there too, so nothing is
written into the repository or ~/.vagrant.d; VAGRANT_CHECKPOINT_DISABLE=1 keeps it off the network. Pure logic,
no root needed; skipped where vagrant is not installed (`make deps` installs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VAGRANTFILE = ROOT / "Vagrantfile"

needs_vagrant = pytest.mark.skipif(shutil.which("vagrant") is None,
                                   reason="vagrant is not installed (`make deps` installs it)")


def vagrant_validate(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(VAGRANTFILE, project / "Vagrantfile")
    # The caller's own VAGRANT_* and TESTBED_* variables (a default provider, a box, sizes) stay out.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VAGRANT_", "TESTBED_"))}
    env.update(VAGRANT_CWD=str(project), VAGRANT_HOME=str(tmp_path / "vagrant.d"), VAGRANT_CHECKPOINT_DISABLE="1",
               **settings)
    return subprocess.run(["vagrant", "validate", "--ignore-provider", "--no-color", "--no-tty"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=120)


def validated_machines(out: str) -> list[str]:
    return re.findall(r"^==> (\S+): Ignoring provider config for validation", out, re.MULTILINE)


@needs_vagrant
@pytest.mark.parametrize("settings, machines", [
    ({}, ["m1", "m2"]),
    ({"TESTBED_VMS": "3", "TESTBED_VM_CPUS": "4"}, ["m1", "m2", "m3"]),
], ids=["default", "3-vms-4-cpus"])
def test_validate(tmp_path, settings, machines):
    r = vagrant_validate(tmp_path, **settings)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Vagrantfile validated successfully" in r.stdout
    assert validated_machines(r.stdout) == machines, r.stdout


@needs_vagrant
@pytest.mark.parametrize("name, value", [
    ("TESTBED_VMS", "zero"),
    ("TESTBED_VMS", "0"),
    ("TESTBED_VM_MEMORY", "4G"),
    ("TESTBED_VM_NET", "192.168.300"),
    ("TESTBED_VM_ACCEL", "hvf"),
    ("TESTBED_VM_SHARE", "relative/dir"),
    ("TESTBED_VM_SHARE", "/usr"),
    ("TESTBED_VM_SHARE", "/no/such/dir"),
    ("TESTBED_VM_PROVISION", "offline"),
])
def test_validate_rejects_bad_setting(tmp_path, name, value):
    r = vagrant_validate(tmp_path, **{name: value})
    assert r.returncode != 0, r.stdout
    # The Vagrantfile's own message (not a Ruby error from deeper down), naming the variable and its value.
    assert f'Vagrantfile: {name}="{value}" is not valid' in r.stderr, r.stdout + r.stderr
    assert "validated successfully" not in r.stdout


@needs_vagrant
@pytest.mark.parametrize("boxes, settings, local", [
    ([], {}, False),
    (["testbed-VAGRANTSLASH-bookworm-local"], {}, True),
    (["testbed-VAGRANTSLASH-bookworm-local", "debian-VAGRANTSLASH-bookworm64"], {}, False),
    (["testbed-VAGRANTSLASH-bookworm-local"], {"TESTBED_VM_BOX": "my/box"}, False),
], ids=["none", "local-only", "both", "explicit"])
def test_local_box_is_the_fallback(tmp_path, boxes, settings, local):
    """Without TESTBED_VM_BOX, the box built here (`make vagrant-box`) is used when debian/bookworm64 is not
    installed and it is, and the Vagrantfile says so."""
    for b in boxes:
        (tmp_path / "vagrant.d" / "boxes" / b).mkdir(parents=True)
    r = vagrant_validate(tmp_path, **settings)
    assert r.returncode == 0, r.stdout + r.stderr
    said = "box debian/bookworm64 is not installed: using testbed/bookworm-local" in r.stderr
    assert said == local, r.stderr


def test_vagrantfile_provisions_what_the_testbed_needs():
    """What `vagrant validate` cannot see: the provisioning script's content, and the usage in the header."""
    text = VAGRANTFILE.read_text()
    for needed in ("make -C /testbed deps", "modprobe sch_netem", "modprobe vxlan", "/etc/modules-load.d/testbed.conf",
                   'type: "9p", readonly: true', "TESTBED_VM_SHARE=", "TESTBED_VM_PROVISION",
                   "ln -sfn /testbed/.venv/bin/testbed /usr/local/bin/testbed",
                   "/home/vagrant/.ssh/authorized_keys /root/.ssh/authorized_keys",
                   "config.vm.provider :libvirt", "config.vm.provider :virtualbox",
                   "vagrant ssh-config > machines.ssh",
                   "testbed machines from-ssh-config machines.ssh --user root --underlay-iface eth1 > machines.yaml",
                   "testbed up topologies/ring4.yaml --machines machines.yaml"):
        assert needed in text, needed


@needs_vagrant
def test_shared_provisioning_needs_shared_directories(tmp_path):
    """TESTBED_VM_PROVISION=shared installs nothing: without TESTBED_VM_SHARE (the host directories the VMs run the
    testbed from) it is refused. (A valid TESTBED_VM_SHARE is not validated here: `vagrant validate
    --ignore-provider` asks vagrant-libvirt's 9p synced folder whether it is usable, which needs a libvirt
    connection; `make test-vagrant` brings VMs up with it for real.)"""
    r = vagrant_validate(tmp_path, TESTBED_VM_PROVISION="shared")
    assert r.returncode != 0 and 'TESTBED_VM_PROVISION="shared" needs TESTBED_VM_SHARE' in r.stderr, r.stderr
