"""Host key checking (testbed/machines/remote.py), its pure logic: known_hosts lines (plain, hashed, wildcard,
negated, markers), the name OpenSSH looks keys up by, fingerprints as ssh-keygen prints them, and the policy's
decisions for each `host_key_check` setting, given the key a server offers. No root, no network: keys are made
with ssh-keygen. tests/test_remote.py checks the same policy against real sshd."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import paramiko
import pytest

from testbed.machines.inventory import Machine
from testbed.machines.remote import (SYSTEM_KNOWN_HOSTS, HostKeyError, HostKeyPolicy, fingerprint, host_key_name,
                                     known_hosts_entries, known_hosts_line)


def keygen(path: Path, kind: str = "ed25519") -> paramiko.PKey:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "test", "-f", str(path)], check=True)
    return paramiko.PKey.from_path(str(path))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[paramiko.PKey, Path]]:
    d = tmp_path_factory.mktemp("keys")
    return {n: (keygen(d / n, "ecdsa" if n == "ecdsa" else "ed25519"), d / f"{n}.pub")
            for n in ("a", "b", "c", "ecdsa")}


def ssh_keygen_fingerprint(pub: Path) -> str:
    return subprocess.run(["ssh-keygen", "-l", "-f", str(pub)], capture_output=True, text=True,
                          check=True).stdout.split()[1]


def test_fingerprint_and_name_as_openssh(keys):
    for key, pub in keys.values():
        assert fingerprint(key) == ssh_keygen_fingerprint(pub)
        assert fingerprint(key).startswith("SHA256:") and not fingerprint(key).endswith("=")
    assert host_key_name("192.0.2.11", 22) == "192.0.2.11"
    assert host_key_name("192.0.2.11", 2222) == "[192.0.2.11]:2222"
    assert host_key_name("2001:db8::1", 2222) == "[2001:db8::1]:2222"


def test_known_hosts_lines(tmp_path, keys):
    a, b = keys["a"][0], keys["b"][0]
    hashed = paramiko.HostKeys.hash_host("10.0.0.7")
    kh = tmp_path / "known_hosts"
    kh.write_text(
        "# a comment\n\n"
        f"192.0.2.11 {a.get_name()} {a.get_base64()}\n"
        f"[192.0.2.11]:2222 {b.get_name()} {b.get_base64()}\n"
        f"{hashed} {a.get_name()} {a.get_base64()}\n"
        f"*.lab,!bad.lab,192.0.2.2? {b.get_name()} {b.get_base64()}\n"
        f"@revoked 192.0.2.30 {a.get_name()} {a.get_base64()}\n"
        "192.0.2.11 ssh-ed25519 not-base64!!\n"
        "192.0.2.11 ssh-unknown AAAA\n"
        "192.0.2.11\n"
        f"192.0.2.12,192.0.2.11 {b.get_name()} {b.get_base64()}\n")
    got = lambda name: [(e.line, e.marker, e.key) for e in known_hosts_entries(str(kh), name)]  # noqa: E731
    assert got("192.0.2.11") == [(3, None, a), (11, None, b)]  # bad lines skipped, as ssh skips them
    assert got("[192.0.2.11]:2222") == [(4, None, b)]  # `[` and `]` are literal, not a character class
    assert got("10.0.0.7") == [(5, None, a)] and got("10.0.0.8") == []
    assert got("node.lab") == [(6, None, b)] and got("NODE.LAB") == [(6, None, b)]
    assert got("bad.lab") == [] and got("192.0.2.25") == [(6, None, b)] and got("192.0.2.250") == []
    assert got("192.0.2.30") == [(7, "@revoked", a)]
    assert known_hosts_entries(str(tmp_path / "missing"), "192.0.2.11") == []
    assert known_hosts_entries(os.devnull, "192.0.2.11") == []
    e = known_hosts_entries(str(kh), "192.0.2.11")[0]
    assert e.where == f"{kh}:3" and e.describe() == f"ssh-ed25519 {fingerprint(a)}"


def machine(kh: Path | str, check=True, port: int = 22) -> Machine:
    return Machine("m1", "192.0.2.11", port=port, host_key_check=check, known_hosts=str(kh))


def test_known_key_is_accepted_and_unknown_refused_by_default(tmp_path, keys):
    (a, apub), (b, _) = keys["a"], keys["b"]
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line("192.0.2.11", 22, apub))
    policy = HostKeyPolicy(machine(kh))
    assert policy.files == [str(kh), SYSTEM_KNOWN_HOSTS]
    policy.missing_host_key(None, "192.0.2.11", a)  # known: no error
    # the same key on another port is another name: unknown
    with pytest.raises(HostKeyError) as e:
        HostKeyPolicy(machine(kh, port=2222)).missing_host_key(None, "[192.0.2.11]:2222", a)
    assert e.value.problem == "unknown" and e.value.fingerprint == fingerprint(a)
    msg = str(e.value)
    assert msg.startswith(f"m1 (192.0.2.11:2222): host-key: unknown host key ssh-ed25519 {fingerprint(a)}: "
                          "no known_hosts file lists a key for [192.0.2.11]:2222")
    assert f"[192.0.2.11]:2222 ssh-ed25519 {a.get_base64()}" in msg and "accept-new" in msg
    assert kh.read_text() == known_hosts_line("192.0.2.11", 22, apub)  # nothing recorded
    # the default file is ~/.ssh/known_hosts
    assert HostKeyPolicy(Machine("m1", "192.0.2.11")).user_file == os.path.expanduser("~/.ssh/known_hosts")


def test_changed_key_is_refused_with_both_fingerprints(tmp_path, keys):
    (a, apub), (b, _), (c, cpub) = keys["a"], keys["b"], keys["c"]
    kh = tmp_path / "known_hosts"
    kh.write_text("# lab\n" + known_hosts_line("192.0.2.11", 22, apub))
    for check in (True, "accept-new"):
        with pytest.raises(HostKeyError) as e:
            HostKeyPolicy(machine(kh, check)).missing_host_key(None, "192.0.2.11", b)
        assert e.value.problem == "changed" and e.value.fingerprint == fingerprint(b)
        msg = str(e.value)
        assert msg.startswith(f"m1 (192.0.2.11:22): host-key: HOST KEY CHANGED: the machine offers ssh-ed25519 "
                              f"{fingerprint(b)}, but {kh}:2 lists ssh-ed25519 {fingerprint(a)} for 192.0.2.11")
        assert f"ssh-keygen -R 192.0.2.11 -f {kh}" in msg
    assert kh.read_text() == "# lab\n" + known_hosts_line("192.0.2.11", 22, apub)  # accept-new wrote nothing
    # a host with two keys listed: either is accepted
    with open(kh, "a") as f:
        f.write(known_hosts_line("192.0.2.11", 22, cpub))
    HostKeyPolicy(machine(kh)).missing_host_key(None, "192.0.2.11", c)
    HostKeyPolicy(machine(kh)).missing_host_key(None, "192.0.2.11", a)


def test_accept_new_records_an_unknown_key_once(tmp_path, keys):
    (a, apub), (b, _) = keys["a"], keys["b"]
    kh = tmp_path / "new" / "dir" / "known_hosts"  # made, as ssh makes ~/.ssh
    HostKeyPolicy(machine(kh, "accept-new")).missing_host_key(None, "192.0.2.11", a)
    assert kh.read_text() == known_hosts_line("192.0.2.11", 22, apub)
    assert (kh.parent.stat().st_mode & 0o777) == 0o700
    # now known: accepted by the strict policy, and a different key is a changed one
    HostKeyPolicy(machine(kh, True)).missing_host_key(None, "192.0.2.11", a)
    HostKeyPolicy(machine(kh, "accept-new")).missing_host_key(None, "192.0.2.11", a)
    assert kh.read_text() == known_hosts_line("192.0.2.11", 22, apub)  # not twice
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        HostKeyPolicy(machine(kh, "accept-new")).missing_host_key(None, "192.0.2.11", b)
    # a file that cannot be written: a clear error, not a silent accept
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "known_hosts").write_text("")
    (ro / "known_hosts").chmod(0o444)
    if os.geteuid() != 0:
        with pytest.raises(HostKeyError, match=r"cannot record host key ssh-ed25519 SHA256:\S+ in .*ro/known_hosts"):
            HostKeyPolicy(machine(ro / "known_hosts", "accept-new")).missing_host_key(None, "192.0.2.11", a)
    with pytest.raises(HostKeyError, match=r"cannot record host key .* in /proc/nonexistent-file/known_hosts"):
        HostKeyPolicy(machine(Path("/proc/nonexistent-file/known_hosts"), "accept-new")).missing_host_key(
            None, "192.0.2.11", a)


def test_false_checks_nothing_and_records_nothing(tmp_path, keys):
    (a, apub), (b, _) = keys["a"], keys["b"]
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line("192.0.2.11", 22, apub))
    policy = HostKeyPolicy(machine(kh, False))
    assert policy.files == [] and policy.entries == []  # no file is read
    policy.missing_host_key(None, "192.0.2.11", b)  # changed: still accepted
    HostKeyPolicy(machine(tmp_path / "none", False)).missing_host_key(None, "192.0.2.11", a)
    assert kh.read_text() == known_hosts_line("192.0.2.11", 22, apub) and not (tmp_path / "none").exists()


def test_revoked_key_is_refused_even_when_listed(tmp_path, keys):
    (a, apub) = keys["a"]
    kh = tmp_path / "known_hosts"
    line = known_hosts_line("192.0.2.11", 22, apub)
    kh.write_text(line + "@revoked * " + line.split(" ", 1)[1])
    for check in (True, "accept-new"):
        with pytest.raises(HostKeyError) as e:
            HostKeyPolicy(machine(kh, check)).missing_host_key(None, "192.0.2.11", a)
        assert e.value.problem == "revoked"
        assert f"host key ssh-ed25519 {fingerprint(a)} is marked @revoked in {kh}:2" in str(e.value)


def test_transport_prefers_the_known_key_types(tmp_path, keys):
    (e, epub), (a, apub) = keys["ecdsa"], keys["a"]
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line("192.0.2.11", 22, epub))
    import socket

    s1, s2 = socket.socketpair()
    try:
        t = HostKeyPolicy(machine(kh)).transport(s1)
        types = list(t.get_security_options().key_types)
        assert types[0] == e.get_name() and "ssh-ed25519" in types[1:]
        t2 = HostKeyPolicy(machine(tmp_path / "none")).transport(s2)
        assert list(t2.get_security_options().key_types)[0] == "ssh-ed25519"  # paramiko's own order
    finally:
        s1.close()
        s2.close()
