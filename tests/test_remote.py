"""testbed.machines.remote against real OpenSSH servers: two "machines" (namespaces with their own sshd, made by
tests/sshmachines.py), reached only through paramiko. Commands, environment, stdin, failures, timeouts, files,
long-running processes, `check()` and every connection error. Root: creates namespaces and runs sshd."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

import pytest

import testbed
from conftest import TESTBED
from sshmachines import inventory, namespaces_of, new_tag, ssh_machines
from testbed.machines.inventory import Inventory, Machine, inventory_from_ssh_config, parse_inventory
from testbed.machines.remote import (AuthenticationError, CommandError, HostKeyError, NotRootError, Remote, RemoteError,
                                     RemoteFileError, RemoteTimeoutError, Result, TestbedMissingError,
                                     UnreachableError, VersionError, connect_all, known_hosts_line)


@pytest.fixture(scope="module")
def lab():
    tag = new_tag()
    with ssh_machines(2, tag=tag) as machines:
        yield machines
    assert not namespaces_of(tag), f"namespaces left: {namespaces_of(tag)}"
    left = subprocess.run(["pgrep", "-f", f"tbm{tag}-"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left: {left}"


@pytest.fixture(scope="module")
def inv(lab) -> Inventory:
    return inventory(lab)


@pytest.fixture(scope="module")
def remotes(inv):
    rs = connect_all(inv)
    yield rs
    for r in rs.values():
        r.close()


@pytest.fixture
def m1(remotes) -> Remote:
    return remotes["m1"]


def netns_pids(ns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def cmdlines(ns: str) -> list[str]:
    out = []
    for pid in netns_pids(ns):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return out


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- commands ---------------------------------------------------------------------------------------------


def test_commands_run_as_root_inside_each_machine(lab, remotes):
    for tm in lab:
        r = remotes[tm.name]
        out = r.run(["sh", "-c", "id -u; hostname; echo $TESTBED_PREFIX; echo $TESTBED_STATE_DIR; "
                                 "readlink /proc/self/ns/net; ip -o -4 addr show dev ul0"]).stdout.splitlines()
        assert out[0] == "0"
        assert out[1] == socket.gethostname()  # machines share the host's UTS namespace
        assert out[2] == tm.prefix and out[3] == tm.state_dir
        assert out[4] == f"net:[{os.stat(tm.netns_path).st_ino}]"  # the machine's own namespace
        assert f"inet {tm.address}/24" in out[5]
    ns1 = remotes["m1"].run(["readlink", "/proc/self/ns/net"]).stdout
    ns2 = remotes["m2"].run(["readlink", "/proc/self/ns/net"]).stdout
    assert ns1 != ns2
    assert ns1.strip() != os.readlink("/proc/self/ns/net")  # not the controller's


def test_machines_reach_each_other_over_the_underlay(remotes):
    remotes["m1"].run(["ping", "-c1", "-W2", "192.0.2.12"], timeout=10)


def test_env_and_quoting(m1):
    tricky = "a b 'c' \"d\" $HOME `x` \\ ;|&"
    r = m1.run(["printf", "%s|", tricky, "$HOME", "*"], env={"FOO": tricky})
    assert r.stdout == f"{tricky}|$HOME|*|"
    assert m1.run(["sh", "-c", 'printf %s "$FOO"'], env={"FOO": tricky, "BAR": "1"}).stdout == tricky
    # shell text: the env is exported to the whole text
    assert m1.run("printf %s \"$FOO\"; printf %s \"$FOO\"", env={"FOO": "x y"}).stdout == "x yx y"
    assert isinstance(m1.run("true"), Result)
    with pytest.raises(ValueError, match="not a valid name"):
        m1.run(["true"], env={"A B": "1"})


def test_stdin_input(m1):
    text = "line one\nzwei – ü\n" + "x" * 200_000 + "\n"
    r = m1.run(["sh", "-c", "cat; echo done >&2"], input=text)
    assert r.stdout == text and r.stderr == "done\n"
    assert m1.run(["cat"]).stdout == ""  # no input: stdin is empty, not left open


def test_nonzero_exit_raises_naming_machine_command_and_stderr(m1):
    with pytest.raises(CommandError) as e:
        m1.run(["sh", "-c", "echo some output; echo 'it broke' >&2; exit 3"])
    err = e.value
    assert isinstance(err, RemoteError) and err.kind == "command" and err.machine == "m1"
    assert err.returncode == 3 and err.stderr == "it broke\n" and err.stdout == "some output\n"
    assert str(err).startswith("m1 (192.0.2.11:22): command: `sh -c ")
    assert "exit status 3" in str(err) and "it broke" in str(err)
    r = m1.run(["sh", "-c", "exit 4"], check=False)
    assert r.returncode == 4 and not r.ok


def test_timeout_stops_the_command(lab, m1):
    t = time.monotonic()
    with pytest.raises(RemoteTimeoutError, match=r"m1 \(192.0.2.11:22\): timeout: .*sleep 31.7.*after 0.5 s") as e:
        m1.run(["sh", "-c", "sleep 31.7; echo not reached"], timeout=0.5)
    assert time.monotonic() - t < 5
    assert isinstance(e.value, subprocess.TimeoutExpired) and e.value.timeout == 0.5
    assert wait_until(lambda: not any("sleep 31.7" in c for c in cmdlines(lab[0].netns)))
    assert m1.run(["echo", "still usable"], timeout=10).stdout == "still usable\n"


def test_one_connection_serves_several_threads(m1):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: m1.run(["sh", "-c", f"sleep 0.2; echo {i}"]).stdout, range(8)))
    assert outs == [f"{i}\n" for i in range(8)]


def test_testbed_command(m1):
    assert m1.testbed(["--version"]).stdout.strip() == f"testbed {testbed.__version__}"


# -- files ------------------------------------------------------------------------------------------------


def test_files_round_trip(m1, tmp_path):
    base = f"/tmp/tbm-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        m1.makedirs(f"{base}/a/b")
        m1.makedirs(f"{base}/a/b")  # exists already: fine
        assert m1.exists(f"{base}/a/b") and not m1.exists(f"{base}/nothing")
        text = "héllo\nwörld\n" * 1000
        m1.put_text(f"{base}/a/b/t.txt", text)
        assert m1.get_text(f"{base}/a/b/t.txt") == text
        assert m1.run(["cat", f"{base}/a/b/t.txt"]).stdout == text
        data = os.urandom(300_000)
        (tmp_path / "blob").write_bytes(data)
        m1.put(tmp_path / "blob", f"{base}/blob")
        m1.get(f"{base}/blob", tmp_path / "back")
        assert (tmp_path / "back").read_bytes() == data
        m1.put_text(f"{base}/x.sh", "#!/bin/sh\necho ran\n", mode=0o755)
        assert m1.run([f"{base}/x.sh"]).stdout == "ran\n"
        with pytest.raises(RemoteFileError, match=rf"m1 \(192.0.2.11:22\): file: read {base}/nothing: No such file"):
            m1.get_text(f"{base}/nothing")
    finally:
        subprocess.run(["rm", "-rf", base])


# -- long-running processes -------------------------------------------------------------------------------


def test_start_poll_kill_leaves_nothing(lab, m1):
    ns = lab[0].netns
    p = m1.start(["sh", "-c", "echo started; exec sleep 123.4"])
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):  # as Popen.wait does: a RemoteProcess can stand in for one
        p.wait(0.2)
    assert p.pid in netns_pids(ns)
    assert wait_until(lambda: any("sleep 123.4" in c for c in cmdlines(ns)))
    assert os.getsid(p.pid) == p.pid and os.getpgid(p.pid) == p.pid  # its own session and process group
    p.kill()
    assert p.wait(5) == 143  # the command's status, 128 + SIGTERM
    assert "started" in p.read_log()
    assert p.pid not in netns_pids(ns)
    assert not any("sleep 123.4" in c for c in cmdlines(ns))


def test_started_process_exit_status_and_log(lab, m1):
    p = m1.start("echo out; echo err >&2; exit 3")
    assert p.log_path.startswith(f"{lab[0].dir}/tmp/testbed-remote/m1-")  # $TMPDIR there
    assert p.wait(10) == 3
    assert p.read_log() == "out\nerr\n"
    assert m1.get_text(p.rc_path).strip() == "3"
    p.kill()  # gone already: nothing happens
    log = f"{lab[0].dir}/logs dir/sub/env.log"
    q = m1.start(["sh", "-c", 'printf "%s|" "$X" "$TESTBED_RUN_ID"'], env={"X": "y z"}, log_path=log)
    assert q.wait(10) == 0 and q.log_path == log and m1.get_text(log) == "y z||"


def test_started_process_outlives_the_connection(lab, inv):
    ns = lab[1].netns
    with Remote.connect(inv["m2"]) as r:
        p = r.start(["sleep", "98.7"])
        saved = p.to_dict()
    assert r.closed
    assert p.pid in netns_pids(ns)
    with Remote.connect(inv["m2"]) as r2:
        q = r2.process(saved)
        assert q.poll() is None
        q.kill(9)
        assert q.wait(5) == -9
    assert not any("sleep 98.7" in c for c in cmdlines(ns))


def test_closing_stops_the_proxy(lab, inv):
    ul = lab[0].underlay_netns
    before = netns_pids(ul)
    r = Remote.connect(inv["m1"])
    assert len(netns_pids(ul) - before) == 1  # the relay
    r.close()
    assert wait_until(lambda: netns_pids(ul) <= before, 3)


# -- check() ----------------------------------------------------------------------------------------------


def test_check_passes_and_gives_the_version(m1):
    assert m1.check() == testbed.__version__


def test_check_not_root(inv, monkeypatch):
    with Remote.connect(inv["m1"]) as r:
        real = r.run

        def run(argv, **kw):
            return Result(0, "1000\n", "") if argv == ["id", "-u"] else real(argv, **kw)
        monkeypatch.setattr(r, "run", run)
        with pytest.raises(NotRootError, match=r"^m1 \(192.0.2.11:22\): not-root: runs commands as uid 1000 "
                                               r"\(user root\); the testbed needs root there"):
            r.check()


def test_check_testbed_missing(lab):
    with Remote.connect(lab[0].machine(testbed="/nonexistent/testbed")) as r:
        with pytest.raises(TestbedMissingError) as e:
            r.check()
    msg = str(e.value)
    assert msg.startswith("m1 (192.0.2.11:22): testbed-missing: the testbed command `/nonexistent/testbed` is not "
                          "found there")
    assert "install the project there" in msg and "set `testbed:` in the inventory" in msg


def test_check_version_mismatch(lab, m1):
    fake = f"{lab[0].dir}/fake-testbed"
    m1.put_text(fake, "#!/bin/sh\necho testbed 9.9.9\n", mode=0o755)
    with Remote.connect(lab[0].machine(testbed=fake)) as r:
        with pytest.raises(VersionError) as e:
            r.check()
    assert str(e.value).startswith(f"m1 (192.0.2.11:22): version: runs testbed 9.9.9, this controller runs "
                                   f"testbed {testbed.__version__}")


# -- connection errors ------------------------------------------------------------------------------------


def test_unreachable_address_fails_fast(lab):
    t = time.monotonic()
    with pytest.raises(UnreachableError) as e:
        Remote.connect(lab[0].machine(address="192.0.2.99"))
    assert time.monotonic() - t < 4
    assert e.value.machine == "m1" and e.value.kind == "unreachable"
    assert str(e.value).startswith("m1 (192.0.2.99:22): unreachable: ")
    assert "No route to host" in str(e.value)


def test_refused_and_unanswered_without_proxy():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UnreachableError, match=rf"^x \(127.0.0.1:{port}\): unreachable: .*[Rr]efused"):
        Remote.connect(Machine("x", "127.0.0.1", port=port))
    with socket.socket() as srv:  # accepts, never speaks SSH
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"^y \(127.0.0.1:\d+\): ssh: SSH handshake failed"):
            Remote.connect(Machine("y", "127.0.0.1", port=srv.getsockname()[1]), timeout=0.5)
        assert time.monotonic() - t < 3


def test_wrong_key_is_an_authentication_error(lab, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    with pytest.raises(AuthenticationError) as e:
        Remote.connect(lab[1].machine(key=str(other)))
    assert str(e.value).startswith(f"m2 (192.0.2.12:22): authentication: user root with key {other} was refused")
    with pytest.raises(AuthenticationError, match=r"key file /nonexistent/key does not exist"):
        Remote.connect(lab[1].machine(key="/nonexistent/key"))
    (tmp_path / "garbage").write_text("not a key\n")
    with pytest.raises(AuthenticationError, match=r"cannot read key .*garbage"):
        Remote.connect(lab[1].machine(key=str(tmp_path / "garbage")))


# -- host keys --------------------------------------------------------------------------------------------


def host_fingerprint(m) -> str:
    """The machine's host key fingerprint as OpenSSH prints it (ssh-keygen -l of its sshd's key)."""
    return subprocess.run(["ssh-keygen", "-l", "-f", m.host_key], capture_output=True, text=True,
                          check=True).stdout.split()[1]


def other_key_line(tmp_path, address: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True)
    return known_hosts_line(address, 22, tmp_path / "impostor.pub")


def test_the_machines_keys_are_checked_against_their_known_hosts(lab):
    """The test machines' inventory points at a known_hosts file with their host keys (sshmachines): the
    connection is made with host_key_check true, the default."""
    m = lab[0].machine()
    assert m.host_key_check is True and m.known_hosts and os.path.exists(m.known_hosts)
    with Remote.connect(m) as r:
        assert r.client.get_transport().get_remote_server_key().fingerprint == host_fingerprint(lab[0])


def test_an_unknown_host_key_is_refused_by_default(lab, tmp_path, monkeypatch):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError) as e:
        Remote.connect(lab[0].machine(known_hosts=str(empty)))
    fp = host_fingerprint(lab[0])
    assert e.value.problem == "unknown" and e.value.fingerprint == fp and e.value.machine == "m1"
    assert str(e.value).startswith(f"m1 (192.0.2.11:22): host-key: unknown host key ssh-ed25519 {fp}: no "
                                   f"known_hosts file lists a key for 192.0.2.11 (read: {empty}, "
                                   "/etc/ssh/ssh_known_hosts)")
    assert empty.read_text() == ""
    # no known_hosts: field: ~/.ssh/known_hosts, as OpenSSH (HOME here is an empty directory)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(HostKeyError, match=rf"unknown host key ssh-ed25519 {re.escape(fp)}: .*read: "
                                           rf"{re.escape(str(tmp_path))}/home/.ssh/known_hosts"):
        Remote.connect(lab[0].machine(known_hosts=None))
    assert not (tmp_path / "home").exists()
    # connect_all names it among the failures
    with pytest.raises(HostKeyError) as e:
        connect_all(Inventory({"m1": lab[0].machine(), "m2": lab[1].machine(known_hosts=str(empty))}))
    assert e.value.machine == "m2" and host_fingerprint(lab[1]) in str(e.value)


def test_a_changed_host_key_is_refused_with_its_fingerprint(tmp_path):
    """A machine whose sshd got a new host key (rebuilt, or someone else at its address) is refused, by the
    default and by accept-new, naming the new key's fingerprint and the old one's line; false lets it in."""
    with ssh_machines(1) as (m,):
        recorded = tmp_path / "known_hosts"
        recorded.write_text(known_hosts_line(m.address, 22, m.host_key))
        with Remote.connect(m.machine(known_hosts=str(recorded))) as r:
            assert r.run(["id", "-u"]).stdout.strip() == "0"
        old = host_fingerprint(m)
        # a new host key, and sshd reloads it (SIGHUP: it re-executes itself)
        key = m.host_key.removesuffix(".pub")
        os.remove(key)
        os.remove(m.host_key)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        new = host_fingerprint(m)
        assert new != old
        pid = int(open(os.path.join(m.dir, "sshd.pid")).read())
        os.kill(pid, 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                with Remote.connect(m.machine(host_key_check=False)) as r:
                    if r.client.get_transport().get_remote_server_key().fingerprint == new:
                        break
            except RemoteError:
                pass
            assert time.monotonic() < deadline, m.sshd_log()
            time.sleep(0.2)
        for check in (True, "accept-new"):
            with pytest.raises(HostKeyError) as e:
                Remote.connect(m.machine(known_hosts=str(recorded), host_key_check=check))
            assert e.value.problem == "changed" and e.value.fingerprint == new
            assert str(e.value).startswith(f"m1 (192.0.2.11:22): host-key: HOST KEY CHANGED: the machine offers "
                                           f"ssh-ed25519 {new}, but {recorded}:1 lists ssh-ed25519 {old} for "
                                           "192.0.2.11")
        assert len(recorded.read_text().splitlines()) == 1  # accept-new recorded nothing


def test_accept_new_records_the_key_and_false_checks_nothing(lab, tmp_path):
    kh = tmp_path / "lab" / "known_hosts"
    with Remote.connect(lab[1].machine(known_hosts=str(kh), host_key_check="accept-new")) as r:
        assert r.run(["id", "-u"]).stdout.strip() == "0"
    assert kh.read_text() == known_hosts_line(lab[1].address, 22, lab[1].host_key)
    with Remote.connect(lab[1].machine(known_hosts=str(kh))):  # now known to the strict check
        pass
    with Remote.connect(lab[1].machine(known_hosts=str(kh), host_key_check="accept-new")):
        pass
    assert kh.read_text() == known_hosts_line(lab[1].address, 22, lab[1].host_key)  # once
    # false: a file listing another key for the address, and nothing written to it
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(other_key_line(tmp_path, lab[1].address))
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        Remote.connect(lab[1].machine(known_hosts=str(wrong), host_key_check="accept-new"))
    before = wrong.read_text()
    with Remote.connect(lab[1].machine(known_hosts=str(wrong), host_key_check=False)) as r:
        assert r.run(["id", "-u"]).stdout.strip() == "0"
    assert wrong.read_text() == before


def test_a_vagrant_style_ssh_config_connects_without_prompts(lab, tmp_path, monkeypatch):
    """`vagrant ssh-config` says StrictHostKeyChecking no and UserKnownHostsFile /dev/null: such a config
    (and the inventory `testbed machines from-ssh-config` makes of it) connects to machines whose keys no file
    lists, with nothing on stdin, and writes no known_hosts file."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = "".join(f"""Host {m.name}
  HostName {m.address}
  User root
  Port 22
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile {m.key}
  IdentitiesOnly yes
  LogLevel FATAL
  ProxyCommand {m.proxy_command}

""" for m in lab)
    (tmp_path / "machines.ssh").write_text(config)
    for inv in (parse_inventory(config), parse_inventory(inventory_from_ssh_config(config))):
        assert all(m.host_key_check is False and m.known_hosts == "/dev/null" for m in inv)
        rs = connect_all(inv)
        try:
            assert [r.run(["id", "-u"], input=None).stdout.strip() for r in rs.values()] == ["0", "0"]
        finally:
            for r in rs.values():
                r.close()
    # through the CLI, as the README's Vagrant steps do, with stdin closed (a prompt would fail)
    out = subprocess.run([*TESTBED, "machines", "from-ssh-config", str(tmp_path / "machines.ssh")],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True).stdout
    with Remote.connect(parse_inventory(out)["m2"]) as r:
        assert r.run(["hostname", "-I"]).stdout.split() == [lab[1].address]
    assert not (tmp_path / "home").exists()


def test_connect_all_closes_the_good_connections_on_failure(lab, monkeypatch):
    opened: list[Remote] = []
    real = Remote.connect

    def spy(cls, machine, timeout=5.0):
        r = real(machine, timeout)
        opened.append(r)
        return r
    monkeypatch.setattr(Remote, "connect", classmethod(spy))
    good = {m.name: m.machine() for m in lab}
    bad = Inventory({**good, "m3": lab[0].machine(name="m3", address="192.0.2.99")})
    with pytest.raises(UnreachableError) as e:
        connect_all(bad)
    assert e.value.machine == "m3" and len(e.value.errors) == 1
    assert sorted(r.machine.name for r in opened) == ["m1", "m2"]
    assert all(r.closed for r in opened)

    worse = Inventory({**bad.machines, "m4": lab[1].machine(name="m4", address="192.0.2.98")})
    with pytest.raises(UnreachableError) as e:
        connect_all(worse)
    assert e.value.machine == "m3" and [x.machine for x in e.value.errors] == ["m3", "m4"]
    msg = str(e.value)
    assert msg.startswith("2 of 4 machines cannot be used:")
    assert "m3 (192.0.2.99:22): unreachable" in msg and "m4 (192.0.2.98:22): unreachable" in msg

    rs = connect_all(bad, names=["m2", "m1"])
    try:
        assert list(rs) == ["m2", "m1"] and all(not r.closed for r in rs.values())
    finally:
        for r in rs.values():
            r.close()
