"""The machines file (testbed.machines.inventory): valid files, every error naming file, line and field, and OpenSSH
client configs (`vagrant ssh-config`) read directly and converted to YAML. Pure logic: no root needed."""

from __future__ import annotations

import os
import textwrap

import pytest

from testbed.machines.inventory import (MACHINE_NAME_RE, Inventory, Machine, inventory_from_ssh_config, is_ssh_config,
                               load_inventory, parse_inventory)
from testbed.topology.yamlfile import InputError

EXAMPLE = """\
machines:
  m1: {address: 192.0.2.11, user: root, port: 22, key: ~/.ssh/id_ed25519}
  m2: {address: 192.0.2.12, user: root}
"""

VAGRANT = """\
Host m1
  HostName 192.168.121.10
  User vagrant
  Port 22
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile /path/.vagrant/machines/m1/libvirt/private_key
  IdentitiesOnly yes
  LogLevel FATAL

Host m2
  HostName 192.168.121.11
  User vagrant
  Port 2222
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile /path/.vagrant/machines/m2/libvirt/private_key
  IdentitiesOnly yes
  LogLevel FATAL
"""


def write(tmp_path, text: str, name: str = "machines.yaml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


# -- valid files ------------------------------------------------------------------------------------------


def test_example_file(tmp_path):
    path = write(tmp_path, EXAMPLE)
    inv = load_inventory(path)
    assert isinstance(inv, Inventory) and inv.path == path
    assert inv.names == ["m1", "m2"]
    assert inv["m1"] == Machine(name="m1", address="192.0.2.11", user="root", port=22,
                                key=os.path.expanduser("~/.ssh/id_ed25519"))
    m2 = inv["m2"]
    assert (m2.user, m2.port, m2.key, m2.testbed, m2.underlay_iface, m2.proxy_command) == \
        ("root", 22, None, "testbed", None, None)
    assert m2.label == "m2 (192.0.2.12:22)"
    assert [m.name for m in inv] == ["m1", "m2"] and len(inv) == 2 and "m1" in inv and "m3" not in inv


def test_every_field_and_defaults(tmp_path):
    path = write(tmp_path, """\
        machines:
          gpu-box_1:
            address: 2001:db8::5
            port: 2222
            user: lab
            key: keys/lab_ed25519
            testbed: /opt/testbed/.venv/bin/python -m testbed
            underlay_iface: enp3s0f1
            proxy_command: ssh -W %h:%p jump.example.org
          plain: {address: Node7.Example.ORG}
        """)
    inv = load_inventory(path)
    m = inv["gpu-box_1"]
    assert m.address == "2001:db8::5" and m.endpoint == "[2001:db8::5]:2222"
    assert m.key == str(tmp_path / "keys" / "lab_ed25519")  # relative to the file's directory
    assert m.testbed_argv == ["/opt/testbed/.venv/bin/python", "-m", "testbed"]
    assert m.underlay_iface == "enp3s0f1"
    assert m.proxy_argv_text() == "ssh -W 2001:db8::5:2222 jump.example.org"
    assert inv["plain"].address == "node7.example.org"
    assert inv["plain"] == Machine("plain", "node7.example.org")


def test_proxy_command_tokens():
    m = Machine("m1", "192.0.2.11", user="u", port=2200, proxy_command="x %h %p %r 100%% %x")
    assert m.proxy_argv_text() == "x 192.0.2.11 2200 u 100% %x"


def test_parse_string_and_yaml_round_trip():
    inv = parse_inventory(EXAMPLE)
    assert inv.path is None
    again = parse_inventory(inv.to_yaml())
    assert again.machines == inv.machines


def test_same_address_other_port_is_fine():
    inv = parse_inventory("machines:\n  a: {address: 192.0.2.1}\n  b: {address: 192.0.2.1, port: 2222}\n")
    assert inv.names == ["a", "b"]


def test_unknown_machine_name_is_a_clear_key_error():
    with pytest.raises(KeyError, match=r"no machine 'm9' .*machines: m1, m2"):
        parse_inventory(EXAMPLE)["m9"]


def test_machine_names_follow_the_node_name_rule():
    from testbed.topology.topo import NODE_NAME_RE
    assert MACHINE_NAME_RE.pattern == NODE_NAME_RE.pattern


# -- errors: FILE:LINE: FIELD: PROBLEM --------------------------------------------------------------------


ERRORS = [
    ("unknown field", "machines:\n  m1: {address: 192.0.2.11, colour: red}\n",
     2, "machines.m1.colour", "unknown key"),
    ("bad IPv4 address", "machines:\n  m1:\n    address: 192.0.2.300\n",
     3, "machines.m1.address", "'192.0.2.300' is not a valid IPv4 address"),
    ("not an address", "machines:\n  m1: {address: 'my host!'}\n",
     2, "machines.m1.address", "neither an IP address nor a host name"),
    ("port too large", "machines:\n  m1:\n    address: 192.0.2.11\n    port: 70000\n",
     4, "machines.m1.port", "less than or equal to 65535 (got 70000)"),
    ("port zero", "machines:\n  m1: {address: 192.0.2.11, port: 0}\n",
     2, "machines.m1.port", "greater than or equal to 1"),
    ("port not a number", "machines:\n  m1: {address: 192.0.2.11, port: ssh}\n",
     2, "machines.m1.port", "valid integer"),
    ("duplicate address and port", "machines:\n  m1: {address: 192.0.2.11}\n  m2: {address: 192.0.2.11, port: 22}\n",
     3, "machines.m2.address", "same address and port as machine m1 (192.0.2.11:22)"),
    ("empty machines", "machines: {}\n", 1, "machines", "no machines"),
    ("machines not a mapping", "machines:\n  - 192.0.2.11\n", 1, "machines", "a mapping of machine names to {address"),
    ("machines null", "machines:\n", 1, "machines", "no machines"),
    ("missing address", "machines:\n  m1: {address: 192.0.2.11}\n  m2:\n    user: root\n",
     3, "machines.m2.address", "required field is missing"),
    ("missing machines", "machine:\n  m1: {address: 192.0.2.11}\n", 1, "machines", "required field is missing"),
    ("reserved name", "machines:\n  local: {address: 192.0.2.11}\n", 2, "machines.local", "reserved"),
    ("bad name", "machines:\n  m1: {address: 192.0.2.11}\n  -x: {address: 192.0.2.12}\n",
     3, "machines.-x", "machine names are 1-32 characters"),
    ("bad user", "machines:\n  m1: {address: 192.0.2.11, user: 'a b'}\n", 2, "machines.m1.user", "not a user name"),
    ("bad interface", "machines:\n  m1: {address: 192.0.2.11, underlay_iface: averyveryverylongname}\n",
     2, "machines.m1.underlay_iface", "not an interface name"),
    ("empty key", "machines:\n  m1: {address: 192.0.2.11, key: ''}\n", 2, "machines.m1.key", "is empty"),
    ("unsplittable testbed", "machines:\n  m1: {address: 192.0.2.11, testbed: \"'/opt/tb\"}\n",
     2, "machines.m1.testbed", "cannot split"),
    ("duplicate machine", "machines:\n  m1: {address: 192.0.2.11}\n  m1: {address: 192.0.2.12}\n",
     3, "", "duplicate key 'm1' (first on line 2)"),
]


@pytest.mark.parametrize("text,line,field,words", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_names_file_line_and_field(tmp_path, text, line, field, words):
    path = write(tmp_path, text)
    with pytest.raises(InputError) as e:
        load_inventory(path)
    msg = str(e.value)
    where = f"{path}:{line}: {field}: " if field else f"{path}:{line}: "
    assert msg.startswith(where), msg
    assert words in msg, msg


def test_every_problem_is_reported_in_line_order(tmp_path):
    path = write(tmp_path, """\
        machines:
          m1: {address: 192.0.2.11, colour: red}
          m2:
            address: 192.0.2.300
            port: 70000
          local: {address: 192.0.2.13}
        """)
    with pytest.raises(InputError) as e:
        load_inventory(path)
    lines = str(e.value).splitlines()
    assert [ln.split(": ")[0:2] for ln in lines] == [
        [f"{path}:2", "machines.m1.colour"], [f"{path}:4", "machines.m2.address"],
        [f"{path}:5", "machines.m2.port"], [f"{path}:6", "machines.local"]]


@pytest.mark.parametrize("text,words", [
    ("", "the file is empty"),
    ("- m1\n", "a machines file holds a mapping `machines:`"),
    ("machines: [\n", "not valid YAML"),
])
def test_not_an_inventory(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(InputError, match=words) as e:
        load_inventory(path)
    assert str(e.value).startswith(path)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match=r"nofile.yaml: cannot read file: No such file"):
        load_inventory(tmp_path / "nofile.yaml")


# -- OpenSSH client configs -------------------------------------------------------------------------------


def test_detects_ssh_config():
    assert is_ssh_config("# from vagrant\n\nHost m1\n  HostName 192.0.2.1\n")
    assert is_ssh_config("host=m1\n")
    assert not is_ssh_config(EXAMPLE)
    assert not is_ssh_config("# Host m1\nmachines: {}\n")
    assert not is_ssh_config("Hostname: x\n")


def test_vagrant_ssh_config(tmp_path):
    path = write(tmp_path, VAGRANT, "ssh-config")
    inv = load_inventory(path)
    assert inv.path == path
    assert inv.machines == {
        "m1": Machine("m1", "192.168.121.10", user="vagrant", port=22,
                      key="/path/.vagrant/machines/m1/libvirt/private_key", host_key_check=False,
                      known_hosts="/dev/null"),
        "m2": Machine("m2", "192.168.121.11", user="vagrant", port=2222,
                      key="/path/.vagrant/machines/m2/libvirt/private_key", host_key_check=False,
                      known_hosts="/dev/null"),
    }


def test_ssh_config_converts_to_an_equivalent_inventory(tmp_path):
    text = inventory_from_ssh_config(VAGRANT)
    assert not is_ssh_config(text)
    assert "machines:" in text and "StrictHostKeyChecking" not in text
    assert parse_inventory(text).machines == parse_inventory(VAGRANT).machines
    # and as files
    assert load_inventory(write(tmp_path, text)).machines == load_inventory(write(tmp_path, VAGRANT, "cfg")).machines


def test_ssh_config_wildcards_defaults_and_proxy_command():
    config = """\
        # hand-written
        Host jumped extra-alias
          HostName 10.1.2.3
          ProxyCommand ssh -W %h:%p bastion
        Host direct
          HostName 10.1.2.4
          IdentityFile ~/.ssh/lab_key
          IdentityFile ~/.ssh/other_key
        Host *.internal !x
          User nobody
        Host *
          User labroot
          Port 2200
        """
    inv = parse_inventory(textwrap.dedent(config))
    assert inv.names == ["jumped", "direct"]
    assert inv["jumped"] == Machine("jumped", "10.1.2.3", user="labroot", port=2200,
                                    proxy_command="ssh -W 10.1.2.3:2200 bastion")
    assert inv["direct"].key == os.path.expanduser("~/.ssh/lab_key")  # the first IdentityFile
    assert parse_inventory(inventory_from_ssh_config(textwrap.dedent(config))).machines == inv.machines


def test_ssh_config_host_without_hostname_uses_its_name():
    inv = parse_inventory("Host node1\n  User root\n")
    assert inv.machines == {"node1": Machine("node1", "node1")}
    with pytest.raises(InputError, match=r"<string>:1: machines.node1.lab: machine names are"):
        parse_inventory("Host node1.lab\n  User root\n")


def test_ssh_config_errors_name_file_and_line(tmp_path):
    path = write(tmp_path, "Host m1\n  HostName 192.0.2.11\n  Port 70000\n\nHost m2\n  HostName 192.0.2.12\n"
                           "  ProxyJump bastion\n", "cfg")
    with pytest.raises(InputError) as e:
        load_inventory(path)
    msg = str(e.value)
    assert f"{path}:7: machines.m2.proxy_jump: ProxyJump is not supported" in msg
    path = write(tmp_path, "Host m1\n  HostName 192.0.2.11\n  Port 70000\n", "cfg2")
    with pytest.raises(InputError, match=rf"^{path}:3: machines.m1.port: .*65535"):
        load_inventory(path)
    with pytest.raises(InputError, match="no machines"):
        parse_inventory("Host *\n  User root\n")
    with pytest.raises(InputError, match=r"<ssh-config>:1: machines.local: 'local' is reserved"):
        inventory_from_ssh_config("Host local\n  HostName 192.0.2.1\n")


# -- host key checking ------------------------------------------------------------------------------------


def test_host_key_check_defaults_to_checked(tmp_path):
    inv = parse_inventory("machines:\n  m1: {address: 192.0.2.11}\n")
    assert inv["m1"].host_key_check is True and inv["m1"].known_hosts is None
    text = ("machines:\n"
            "  a: {address: 192.0.2.11, host_key_check: accept-new, known_hosts: lab/known_hosts}\n"
            "  b: {address: 192.0.2.12, host_key_check: false, known_hosts: ~/kh}\n"
            "  c: {address: 192.0.2.13, host_key_check: true, known_hosts: /etc/lab_hosts}\n")
    path = write(tmp_path, text)
    inv = load_inventory(path)
    assert inv["a"].host_key_check == "accept-new" and inv["a"].known_hosts == str(tmp_path / "lab/known_hosts")
    assert inv["b"].host_key_check is False and inv["b"].known_hosts == os.path.expanduser("~/kh")
    assert inv["c"].host_key_check is True and inv["c"].known_hosts == "/etc/lab_hosts"
    # the settings survive the machines file the inventory writes
    assert load_inventory(write(tmp_path, inv.to_yaml(), "again.yaml")).machines == inv.machines
    assert "host_key_check" not in parse_inventory("machines:\n  m1: {address: 192.0.2.11}\n").to_yaml()


@pytest.mark.parametrize("value", ["maybe", "0", "1", "null", "ask", "'no'"])
def test_host_key_check_bad_values(tmp_path, value):
    path = write(tmp_path, f"machines:\n  m1: {{address: 192.0.2.11}}\n  m2:\n    address: 192.0.2.12\n"
                           f"    host_key_check: {value}\n")
    with pytest.raises(InputError, match=rf"^{path}:5: machines.m2.host_key_check: .*want true .*accept-new "
                                         r".*false"):
        load_inventory(path)
    with pytest.raises(InputError, match=r"machines.m1.known_hosts: is empty"):
        parse_inventory("machines:\n  m1: {address: 192.0.2.11, known_hosts: ''}\n")


@pytest.mark.parametrize("setting, check", [("yes", True), ("ask", True), ("accept-new", "accept-new"),
                                            ("no", False), ("off", False), ("Yes", True)])
def test_ssh_config_strict_host_key_checking(setting, check):
    inv = parse_inventory(f"Host m1\n  HostName 192.0.2.11\n  StrictHostKeyChecking {setting}\n")
    assert inv["m1"].host_key_check == check and inv["m1"].known_hosts is None
    assert parse_inventory(inventory_from_ssh_config(
        f"Host m1\n  HostName 192.0.2.11\n  StrictHostKeyChecking {setting}\n")).machines == inv.machines


def test_ssh_config_known_hosts_files(tmp_path):
    inv = parse_inventory("Host m1\n  HostName 192.0.2.11\n  UserKnownHostsFile ~/.ssh/lab_hosts ~/.ssh/other\n"
                          "Host m2\n  HostName 192.0.2.12\n  UserKnownHostsFile none\n"
                          "Host m3\n  HostName 192.0.2.13\n")
    assert inv["m1"].known_hosts == os.path.expanduser("~/.ssh/lab_hosts")  # the first, which ssh writes to
    assert inv["m2"].known_hosts == "/dev/null"
    assert inv["m3"].known_hosts is None and inv["m3"].host_key_check is True  # OpenSSH's default: ask
    path = write(tmp_path, "Host m1\n  HostName 192.0.2.11\n\n  StrictHostKeyChecking sometimes\n", "cfg")
    with pytest.raises(InputError, match=rf"^{path}:4: machines.m1.host_key_check: 'sometimes': want true"):
        load_inventory(path)


def test_vagrant_ssh_config_is_not_checked():
    """`vagrant ssh-config` says StrictHostKeyChecking no and UserKnownHostsFile /dev/null: the converted
    inventory keeps both, so its throwaway VMs connect without a known key and record none."""
    text = inventory_from_ssh_config(VAGRANT, user="root", underlay_iface="eth1")
    for m in parse_inventory(text):
        assert (m.host_key_check, m.known_hosts, m.user, m.underlay_iface) == (False, "/dev/null", "root", "eth1")
    assert "host_key_check: false, known_hosts: /dev/null" in text


def test_ssh_config_conversion_sets_the_testbed_command():
    """--testbed (the controller's venv shared into Vagrant VMs at the same path) reaches every machine; an empty
    one is refused."""
    cmd = "/work/x/.venv/bin/python -m testbed"
    for m in parse_inventory(inventory_from_ssh_config(VAGRANT, user="root", testbed=cmd)):
        assert (m.testbed, m.testbed_argv) == (cmd, ["/work/x/.venv/bin/python", "-m", "testbed"])
    with pytest.raises(InputError, match="testbed: is empty"):
        inventory_from_ssh_config(VAGRANT, testbed=" ")
