"""Control of other machines over SSH (paramiko): commands, long-running processes, files.

One `Remote` per machine holds one SSH connection open for a whole command; every command (`run`), file
transfer (SFTP) and process (`start`) goes over it. `connect_all(inventory)` opens them all at once.

Errors are `RemoteError`s; the message always names the machine and its address
(`m2 (192.0.2.12:22): unreachable: [Errno 113] No route to host`), and `kind` says what went wrong:
`unreachable`, `authentication`, `host-key` (the machine's host key is unknown, changed or revoked), `ssh` (the
SSH handshake failed otherwise), `not-root`, `testbed-missing`, `version`, `command` (a command exited non-zero),
`timeout`, `unanswered` (a machine that stopped answering while a command ran: no reply to an SSH request within
UNANSWERED_S seconds), `file` (an SFTP operation failed).

Host keys are checked as OpenSSH checks them (docs/machines.md, "Host keys"): against the machine's
`known_hosts` file (default ~/.ssh/known_hosts) and /etc/ssh/ssh_known_hosts, by the name OpenSSH looks up
(`ADDRESS`, or `[ADDRESS]:PORT` off port 22; plain, hashed and wildcard entries; `@revoked` honoured,
`@cert-authority` lines not used). The inventory's `host_key_check` says what an unknown key does: refused
(true, the default), recorded in the known_hosts file (accept-new); a changed key is refused by both; false
checks nothing and records nothing.

Commands go through the remote login shell, as with `ssh host CMD`: an argv list is quoted with shlex.join,
environment variables are put on the command line (`env K=V ... CMD`; sshd usually refuses paramiko's
set_environment_variable).
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import logging
import os
import re
import shlex
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import paramiko

from testbed import __version__
from testbed.machines.inventory import ACCEPT_NEW, Inventory, Machine

# paramiko logs a failed handshake (with a traceback) from its transport thread; the RemoteError says it
# better. A NullHandler keeps Python's last-resort handler from printing it when logging is not configured.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_CONNECT_TIMEOUT = 5.0
# A command that prints nothing for QUIET_S seconds has its machine asked whether it still answers (an SSH
# request that sshd replies to); no reply within UNANSWERED_S ends the wait with an UnansweredError. The TCP
# connection alone cannot tell: a machine whose sshd is stopped (or frozen) still has its kernel acknowledge.
QUIET_S = 10.0
UNANSWERED_S = 30.0
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STDERR_TAIL = 2000


# ----------------------------------------------------------------------------------------------------------
# Errors.


# A proxy command's relay: stdin/stdout (the SSH client's connection) to a TCP connection. Run inside a network
# namespace (`nsenter --net=NS python relay.py HOST PORT`) it reaches machines that live behind it: the test
# machines of tests/sshmachines.py and the qemu VMs of testbed/machines/vm.py (no netcat or socat needed).
RELAY = r'''import os, select, socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
try:
    s = socket.create_connection((host, port), timeout=timeout)
except OSError as e:
    sys.stderr.write(f"connect to {host}:{port}: {e}\n")
    sys.exit(1)
s.settimeout(None)
up = True
while True:
    r = select.select([0, s] if up else [s], [], [])[0]
    if up and 0 in r:
        d = os.read(0, 65536)
        if d:
            s.sendall(d)
        else:
            up = False
            s.shutdown(socket.SHUT_WR)
    if s in r:
        d = s.recv(65536)
        if not d:
            break
        while d:
            d = d[os.write(1, d):]
'''


class RemoteError(RuntimeError):
    """Something failed on (or on the way to) a machine. `machine`: its name; `address`: `ADDR:PORT`;
    `kind`: see the module docstring; `detail`: the message without the machine; `errors`: every error when
    several machines failed at once (connect_all), else [self]."""

    kind = "ssh"

    def __init__(self, machine: Machine | str, detail: str, *, address: str | None = None, kind: str | None = None):
        super().__init__(machine.name if isinstance(machine, Machine) else machine, detail)
        self.machine = machine.name if isinstance(machine, Machine) else machine
        self.address = address if address is not None else (machine.endpoint if isinstance(machine, Machine) else "?")
        self.detail = detail
        if kind is not None:
            self.kind = kind
        self.errors: list[RemoteError] = [self]
        self.message = f"{self.machine} ({self.address}): {self.kind}: {detail}"

    def __str__(self) -> str:
        return self.message


class UnreachableError(RemoteError):
    kind = "unreachable"


class UnansweredError(RemoteError):
    """The machine stopped answering over a connection that was open (its sshd stopped or frozen)."""

    kind = "unanswered"


class AuthenticationError(RemoteError):
    kind = "authentication"


class HostKeyError(RemoteError):
    """The machine's host key is not known (and may not be recorded), changed, or revoked. `fingerprint`: that
    of the key the machine offered (`SHA256:...`, as OpenSSH prints it); `problem`: unknown, changed, revoked
    or record (it could not be written to the known_hosts file)."""

    kind = "host-key"

    def __init__(self, machine: Machine | str, detail: str, *, fingerprint: str = "", problem: str = "", **kw):
        super().__init__(machine, detail, **kw)
        self.fingerprint, self.problem = fingerprint, problem


class NotRootError(RemoteError):
    kind = "not-root"


class TestbedMissingError(RemoteError):
    __test__ = False  # not a pytest test class
    kind = "testbed-missing"


class VersionError(RemoteError):
    kind = "version"


class CommandError(RemoteError):
    """A command exited non-zero (with check=True). `command`, `returncode`, `stdout`, `stderr`."""

    kind = "command"

    def __init__(self, machine: Machine | str, detail: str, *, command: str = "", returncode: int | None = None,
                 stdout: str = "", stderr: str = "", **kw):
        super().__init__(machine, detail, **kw)
        self.command, self.returncode, self.stdout, self.stderr = command, returncode, stdout, stderr


class RemoteTimeoutError(RemoteError, subprocess.TimeoutExpired):
    """A command or process still ran after its timeout. Also a subprocess.TimeoutExpired (`cmd`, `timeout`),
    so that a RemoteProcess can stand in for a Popen."""

    kind = "timeout"

    def __init__(self, machine: Machine | str, detail: str, *, cmd: str = "", timeout: float | None = None, **kw):
        RemoteError.__init__(self, machine, detail, **kw)
        self.cmd, self.timeout, self.output, self.stderr = cmd, timeout, None, None


class RemoteFileError(RemoteError):
    kind = "file"


def _tail(text: str, limit: int = _STDERR_TAIL) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


# ----------------------------------------------------------------------------------------------------------
# Results and processes.


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    command: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class RemoteProcess:
    """A long-running command started with `Remote.start`: its own session (and process group) on the
    machine, output to `log_path` there, independent of the SSH connection that started it. `pid` and
    `start_time` (clock ticks since boot, /proc/PID/stat field 22) identify it, so that a reused pid is never
    taken for it. `to_dict()` / `Remote.process(d)` hand it to another connection."""

    def __init__(self, remote: "Remote", pid: int, start_time: str, log_path: str, command: str = ""):
        self.remote, self.pid, self.start_time, self.log_path, self.command = remote, pid, start_time, log_path, command
        self.returncode: int | None = None
        self._signal: int | None = None

    def __repr__(self) -> str:
        return f"RemoteProcess({self.remote.machine.name}, pid={self.pid}, log={self.log_path})"

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.remote.machine.name, "pid": self.pid, "start_time": self.start_time,
                "log_path": self.log_path, "command": self.command}

    @property
    def rc_path(self) -> str:
        return self.log_path + ".rc"

    def poll(self) -> int | None:
        """None while it runs; then the command's exit status (128+N when signal N ended the command; -N when
        `kill(N)` ended the wrapper too, e.g. SIGKILL, so no status was recorded; -1 when it is unknown)."""
        if self.returncode is not None:
            return self.returncode
        # running: the pid has our start time and is not a zombie; else the recorded status, if any
        script = (f"s=$(cut -d' ' -f3,22 /proc/{self.pid}/stat 2>/dev/null); "
                  f"case \"$s\" in ?' '{self.start_time}) "
                  f"[ \"${{s%% *}}\" != Z ] && {{ echo running; exit 0; }};; esac; "
                  f"if [ -e {shlex.quote(self.rc_path)} ]; then echo \"exit $(cat {shlex.quote(self.rc_path)})\"; "
                  f"else echo gone; fi")
        out = self.remote.run(script, timeout=30).stdout.split()
        if out[:1] == ["running"]:
            return None
        if out[:1] == ["exit"] and len(out) == 2 and out[1].lstrip("-").isdigit():
            self.returncode = int(out[1])
        else:
            self.returncode = -self._signal if self._signal else -1
        return self.returncode

    def wait(self, timeout: float | None = None, interval: float = 0.1) -> int:
        """Its exit status; RemoteTimeoutError when it still runs after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise RemoteTimeoutError(self.remote.machine, f"pid {self.pid} ({self.command}) still runs after "
                                                              f"{timeout:g} s", cmd=self.command, timeout=timeout)
            time.sleep(interval)
            interval = min(interval * 1.5, 1.0)
        return rc

    def kill(self, sig: int = 15) -> None:
        """Send `sig` to its process group (nothing when it is gone already)."""
        if self.returncode is not None:
            return
        self._signal = int(sig)
        self.remote.run(f"s=$(cut -d' ' -f22 /proc/{self.pid}/stat 2>/dev/null); "
                        f"[ \"$s\" = {self.start_time} ] && kill -{int(sig)} -- -{self.pid} 2>/dev/null; true",
                        timeout=30)

    def read_log(self) -> str:
        return self.remote.get_text(self.log_path)


# ----------------------------------------------------------------------------------------------------------
# The connection.


class Remote:
    """One SSH connection to one machine. Use `Remote.connect(machine)`; a context manager."""

    def __init__(self, machine: Machine, client: paramiko.SSHClient, proxy: subprocess.Popen | None = None):
        self.machine = machine
        self.client = client
        self._proxy = proxy
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.Lock()
        self._ping_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Remote({self.machine.label})"

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- connecting --------------------------------------------------------------------------------------

    @classmethod
    def connect(cls, machine: Machine, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> "Remote":
        """Connect and log in (RemoteError kinds unreachable, authentication, ssh); `timeout` bounds each
        step (TCP connect, SSH banner, authentication)."""
        pkey = _load_key(machine)
        proxy = None
        errlog = None
        try:
            if machine.proxy_command:
                sock, proxy, errlog = _start_proxy(machine)
            else:
                sock = socket.create_connection((machine.address, machine.port), timeout=timeout)
        except OSError as e:
            raise UnreachableError(machine, _oserror(e, timeout)) from None
        client = paramiko.SSHClient()
        # paramiko is given no keys: its policy is asked about every key, and HostKeyPolicy checks it as OpenSSH
        # would; the transport prefers the key types known_hosts lists for the machine, as OpenSSH does.
        policy = HostKeyPolicy(machine)
        client.set_missing_host_key_policy(policy)
        try:
            client.connect(machine.address, port=machine.port, username=machine.user, pkey=pkey,
                           sock=sock, timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                           channel_timeout=timeout, allow_agent=machine.key is None,
                           look_for_keys=machine.key is None, transport_factory=policy.transport)
        except BaseException as e:
            client.close()
            sock.close()
            proxy_err = _stop_proxy(proxy, errlog)
            if isinstance(e, HostKeyError):
                raise e from None
            if isinstance(e, paramiko.AuthenticationException):
                how = f"key {machine.key}" if machine.key else "the SSH agent's keys and ~/.ssh/id_* (no `key:` given)"
                raise AuthenticationError(machine, f"user {machine.user} with {how} was refused: {e}") from None
            if isinstance(e, (paramiko.SSHException, EOFError, OSError)):
                if proxy is not None and (proxy_err is not None or "banner" in str(e)):
                    raise UnreachableError(machine, f"proxy command `{machine.proxy_argv_text()}` "
                                                    + (f"failed: {proxy_err}" if proxy_err else
                                                       f"led to no SSH server within {timeout:g} s ({e})")) from None
                if isinstance(e, OSError) and not isinstance(e, paramiko.SSHException):
                    raise UnreachableError(machine, _oserror(e, timeout)) from None
                raise RemoteError(machine, f"SSH handshake failed: {e or type(e).__name__}") from None
            raise
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(15)
        return cls(machine, client, proxy)

    def answers(self, within: float = UNANSWERED_S) -> bool:
        """Whether sshd there replies to an SSH request (keepalive@openssh.com, which OpenSSH answers, if only
        with a refusal) within `within` seconds. paramiko's own wait for the reply has no timeout, so it waits in
        a thread of its own; one that never returns ends when the connection is closed."""
        t = self.client.get_transport()
        if t is None or not t.is_active():
            return False
        replies: list = []

        def ask():
            with self._ping_lock:  # paramiko keeps one pending global request per transport
                replies.append(t.global_request("keepalive@openssh.com", wait=True))

        asker = threading.Thread(target=ask, daemon=True, name=f"ping-{self.machine.name}")
        asker.start()
        asker.join(within)
        return bool(replies) and t.is_active()

    @property
    def closed(self) -> bool:
        t = self.client.get_transport()
        return t is None or not t.is_active()

    def close(self) -> None:
        with self._sftp_lock:
            if self._sftp is not None:
                try:
                    self._sftp.close()
                except Exception:
                    pass
                self._sftp = None
        self.client.close()
        _stop_proxy(self._proxy, None)
        self._proxy = None

    # -- commands ----------------------------------------------------------------------------------------

    def command_line(self, argv: list[str] | str, env: dict[str, str] | None = None) -> str:
        """The command line `run` sends: a list is quoted (shlex.join) and env put first (`env K=V ... ARGV`);
        a string is shell text for the login shell, env exported first (`export K=V ...; TEXT`)."""
        cmd = argv if isinstance(argv, str) else shlex.join(str(a) for a in argv)
        if env:
            for k in env:
                if not _ENV_NAME_RE.match(str(k)):
                    raise ValueError(f"environment variable name {k!r} is not a valid name")
            assign = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
            cmd = f"env {assign} {cmd}" if not isinstance(argv, str) else f"export {assign}; {cmd}"
        return cmd

    def run(self, argv: list[str] | str, env: dict[str, str] | None = None, check: bool = True,
            timeout: float | None = None, input: str | None = None) -> Result:
        """Run a command there and wait for it. `check`: CommandError on a non-zero exit; `input`: its stdin
        (else stdin is empty); `timeout`: seconds, then every process of the command is sent SIGTERM and
        RemoteTimeoutError raised (sshd refuses SSH `signal` requests for root, so a command run with a timeout
        carries TESTBED_RUN_ID=<random> in its environment, and its processes are found by that)."""
        cmd = self.command_line(argv, env)
        run_id = None
        sent = cmd
        if timeout is not None:
            run_id = uuid.uuid4().hex
            sent = self.command_line(argv, {**(env or {}), "TESTBED_RUN_ID": run_id})
        chan = self._session()
        out: list[bytes] = []
        err: list[bytes] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            chan.exec_command(sent)
            writer = threading.Thread(target=_feed, args=(chan, input), daemon=True)
            reader = threading.Thread(target=_drain, args=(chan.recv_stderr, err), daemon=True)
            writer.start()
            reader.start()
            heard = time.monotonic()
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                chan.settimeout(1.0 if left is None else min(left, 1.0))
                try:
                    data = chan.recv(65536)
                except socket.timeout:
                    if time.monotonic() - heard >= QUIET_S:
                        if not self.answers(UNANSWERED_S):
                            self.client.close()  # frees the waits on it; the machine cannot be used anyway
                            raise UnansweredError(self.machine, f"no reply to an SSH request within "
                                                                f"{UNANSWERED_S:g} s while `{cmd}` ran (its sshd "
                                                                f"stopped or the machine froze); the command may "
                                                                f"still be running there")
                        heard = time.monotonic()
                    continue
                if not data:
                    break
                heard = time.monotonic()
                out.append(data)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not chan.status_event.wait(left):
                self._kill_run(run_id)
                raise RemoteTimeoutError(self.machine, f"`{cmd}` still ran after {timeout:g} s (sent it SIGTERM)",
                                         cmd=cmd, timeout=timeout)
            reader.join(None if deadline is None else 1.0)
            rc = chan.recv_exit_status()
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise RemoteError(self.machine, f"connection lost while running `{cmd}`: {e or type(e).__name__}") from None
        finally:
            chan.close()
        result = Result(rc, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"), cmd)
        if check and rc != 0:
            what = f"exit status {rc}" if rc >= 0 else "ended without an exit status (killed by a signal?)"
            tail = _tail(result.stderr) or _tail(result.stdout)
            raise CommandError(self.machine, f"`{cmd}` failed ({what})" + (f": {tail}" if tail else ""),
                               command=cmd, returncode=rc, stdout=result.stdout, stderr=result.stderr)
        return result

    def _kill_run(self, run_id: str | None) -> None:
        """SIGTERM every process there whose environment holds TESTBED_RUN_ID=run_id (best effort)."""
        if run_id is None:
            return
        script = (f"for f in $(grep -lsxz TESTBED_RUN_ID={run_id} /proc/[0-9]*/environ); do "
                  "p=${f#/proc/}; kill -TERM ${p%/environ} 2>/dev/null; done; true")
        try:
            self.run(script, check=False)
        except RemoteError:
            pass

    def testbed(self, args: list[str], **kw) -> Result:
        """Run the inventory's testbed command there with `args` (keywords as for `run`)."""
        return self.run([*self.machine.testbed_argv, *args], **kw)

    def start(self, argv: list[str] | str, env: dict[str, str] | None = None,
              log_path: str | None = None) -> RemoteProcess:
        """Start a long-running command in its own session there (setsid), stdin from /dev/null, stdout and
        stderr appended to `log_path` there (default: a new file in $TMPDIR/testbed-remote/ there, /tmp when
        TMPDIR is unset); its exit status goes to `log_path + '.rc'`. A list is run as it is, shell text by sh.
        Returns at once; the process outlives this connection."""
        cmd = self.command_line(argv, env)
        inner = cmd if not isinstance(argv, str) else f"sh -c {shlex.quote(cmd)}"  # `exit` must not end the wrapper
        if log_path is None:
            name = f"{self.machine.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.log"
            resolve = f'log="${{TMPDIR:-/tmp}}/testbed-remote/{name}"'
        else:
            resolve = f"log={shlex.quote(log_path)}"
        # The wrapper shell (its log file is $1) prints its pid, start time and log on the connection, then
        # moves its own stdin, stdout and stderr off it (so the SSH command ends at once) and runs the command.
        # It is the session and process-group leader (its pid is the group's id) and traps TERM, INT and HUP (a
        # trapped signal is reset to the default in the command it starts): a group kill ends the command, and
        # the wrapper still records the command's status.
        wrapper = ('echo $$ $(cut -d" " -f22 /proc/$$/stat) "$1"; exec </dev/null >>"$1" 2>&1; '
                   f'unset TESTBED_RUN_ID; trap : TERM INT HUP; {inner}; echo $? >"$1.rc"')
        script = (f'{resolve}; mkdir -p "$(dirname "$log")" && rm -f "$log.rc" && : >>"$log" && '
                  f'exec setsid -f sh -c {shlex.quote(wrapper)} sh "$log" </dev/null')
        r = self.run(script, timeout=30)
        words = r.stdout.rstrip("\n").split(" ", 2)
        if len(words) != 3 or not words[0].isdigit() or not words[1].isdigit():
            raise RemoteError(self.machine, f"could not start `{cmd}`: unexpected output {r.stdout!r} {r.stderr!r}")
        return RemoteProcess(self, int(words[0]), words[1], words[2], cmd)

    def process(self, d: dict[str, Any]) -> RemoteProcess:
        """The RemoteProcess described by `RemoteProcess.to_dict()`, controlled over this connection."""
        return RemoteProcess(self, int(d["pid"]), str(d["start_time"]), d["log_path"], d.get("command", ""))

    def check(self) -> str:
        """That the machine is usable: logged in as root, the testbed command found there, at this
        controller's version. Returns the remote testbed version (NotRootError, TestbedMissingError,
        VersionError otherwise)."""
        uid = self.run(["id", "-u"], timeout=30).stdout.strip()
        if uid != "0":
            raise NotRootError(self.machine, f"runs commands as uid {uid} (user {self.machine.user}); the testbed "
                                             "needs root there: log in as root (`user: root` in the inventory)")
        r = self.testbed(["--version"], check=False, timeout=120)
        if r.returncode in (126, 127):
            raise TestbedMissingError(
                self.machine, f"the testbed command `{self.machine.testbed}` is not found there "
                              f"({_tail(r.stderr, 300) or f'exit status {r.returncode}'}): install the project there "
                              "(pip install it into a virtual environment) or set `testbed:` in the inventory to "
                              "its path, e.g. testbed: /opt/testbed/.venv/bin/testbed")
        m = re.fullmatch(r"testbed (\S+)", r.stdout.strip())
        if r.returncode != 0 or not m:
            raise TestbedMissingError(
                self.machine, f"`{self.machine.testbed} --version` does not work there (exit status {r.returncode}): "
                              f"{_tail(r.stderr or r.stdout, 500)}; reinstall the project there or fix `testbed:` "
                              "in the inventory")
        version = m.group(1)
        if version != __version__:
            raise VersionError(self.machine, f"runs testbed {version}, this controller runs testbed {__version__}: "
                                             "install the same version on every machine")
        return version

    # -- files (SFTP over the same connection) -----------------------------------------------------------

    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            try:
                self._sftp = self.client.open_sftp()
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise RemoteFileError(self.machine, f"cannot open SFTP: {e or type(e).__name__}") from None
        return self._sftp

    def _file_op(self, what: str, fn):
        with self._sftp_lock:
            try:
                return fn(self.sftp())
            except OSError as e:
                raise RemoteFileError(self.machine, f"{what}: {e.strerror or e}") from None

    def put_text(self, path: str, text: str, mode: int | None = None) -> None:
        def op(s: paramiko.SFTPClient) -> None:
            with s.open(path, "w") as f:
                f.write(text.encode())
            if mode is not None:
                s.chmod(path, mode)
        self._file_op(f"write {path}", op)

    def get_text(self, path: str) -> str:
        def op(s: paramiko.SFTPClient) -> str:
            with s.open(path, "r") as f:
                return f.read().decode(errors="replace")
        return self._file_op(f"read {path}", op)

    def put(self, local: str | os.PathLike, remote: str) -> None:
        self._file_op(f"copy {local} to {remote}", lambda s: s.put(os.fspath(local), remote))

    def get(self, remote: str, local: str | os.PathLike) -> None:
        self._file_op(f"copy {remote} to {local}", lambda s: s.get(remote, os.fspath(local)))

    def exists(self, path: str) -> bool:
        def op(s: paramiko.SFTPClient) -> bool:
            try:
                s.stat(path)
                return True
            except FileNotFoundError:
                return False
        return self._file_op(f"stat {path}", op)

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """mkdir -p over SFTP."""
        def op(s: paramiko.SFTPClient) -> None:
            parts = [p for p in path.split("/") if p]
            cur = "/" if path.startswith("/") else ""
            for p in parts:
                cur = f"{cur}{p}" if cur in ("", "/") else f"{cur}/{p}"
                try:
                    if not stat.S_ISDIR(s.stat(cur).st_mode):
                        raise NotADirectoryError(20, f"{cur} exists and is not a directory")
                except FileNotFoundError:
                    s.mkdir(cur, mode)
        self._file_op(f"mkdir -p {path}", op)

    # -- internals ---------------------------------------------------------------------------------------

    def _session(self) -> paramiko.Channel:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise RemoteError(self.machine, "the SSH connection is closed")
        try:
            return transport.open_session(timeout=DEFAULT_CONNECT_TIMEOUT * 2)
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise RemoteError(self.machine, f"cannot open an SSH session: {e or type(e).__name__}") from None


def connect_all(inventory: Inventory, names: list[str] | None = None,
                timeout: float = DEFAULT_CONNECT_TIMEOUT) -> dict[str, Remote]:
    """Connect to every machine (or those in `names`), in parallel. If any fails, the connections opened are
    closed and the first failure (in inventory order) is raised, its message listing every failure."""
    machines = [inventory[n] for n in (names if names is not None else inventory.names)]
    if not machines:
        return {}
    remotes: dict[str, Remote] = {}
    errors: list[RemoteError] = []
    other: BaseException | None = None
    with ThreadPoolExecutor(max_workers=min(16, len(machines)), thread_name_prefix="ssh-connect") as pool:
        futures = [(m, pool.submit(Remote.connect, m, timeout)) for m in machines]
        for m, f in futures:
            try:
                remotes[m.name] = f.result()
            except RemoteError as e:
                errors.append(e)
            except BaseException as e:  # noqa: BLE001 - closed below, then re-raised
                other = other or e
    if errors or other is not None:
        for r in remotes.values():
            r.close()
        if other is not None:
            raise other
        first = errors[0]
        if len(errors) > 1:
            first.errors = errors
            first.message = f"{len(errors)} of {len(machines)} machines cannot be used:\n" + "\n".join(
                f"  {e.machine} ({e.address}): {e.kind}: {e.detail}" for e in errors)
        raise first
    return remotes


# ----------------------------------------------------------------------------------------------------------
# Host keys.

USER_KNOWN_HOSTS = "~/.ssh/known_hosts"
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
_RECORD_LOCK = threading.Lock()


def host_key_name(address: str, port: int) -> str:
    """The name OpenSSH looks a host key up by: the address, `[ADDRESS]:PORT` off port 22."""
    return address if port == 22 else f"[{address}]:{port}"


def known_hosts_line(address: str, port: int, pubkey: str | os.PathLike) -> str:
    """The known_hosts line of the host key in the public key file `pubkey` (`NAME TYPE BASE64`)."""
    with open(pubkey) as f:
        words = f.read().split()
    if len(words) < 2:
        raise ValueError(f"{os.fspath(pubkey)} is not a public key file")
    return f"{host_key_name(address, port)} {words[0]} {words[1]}\n"


def fingerprint(key: paramiko.PKey) -> str:
    """`SHA256:...` (unpadded base64 of the key blob's SHA-256), as `ssh-keygen -l` and ssh print it."""
    return key.fingerprint


@dataclass(frozen=True)
class KnownHost:
    """One known_hosts line that names a host: where it is, its marker (`@revoked`, `@cert-authority` or
    None) and its key."""

    file: str
    line: int
    marker: str | None
    key: paramiko.PKey

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def describe(self) -> str:
        return f"{self.key.get_name()} {fingerprint(self.key)}"


def _pattern_matches(pattern: str, name: str) -> bool:
    """An OpenSSH host pattern (`*` and `?` wildcards; `[`, `]` literal) against a name, case-insensitively."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(rx, name.lower()) is not None


def _names_match(field: str, name: str) -> bool:
    """Whether a known_hosts line's host field (hashed `|1|SALT|HASH`, or comma-separated patterns, `!` negating)
    names `name`."""
    if field.startswith("|1|"):
        try:
            return paramiko.HostKeys.hash_host(name, field) == field
        except (binascii.Error, ValueError, IndexError):
            return False
    matched = False
    for pattern in field.split(","):
        if pattern.startswith("!"):
            if _pattern_matches(pattern[1:], name):
                return False
        elif _pattern_matches(pattern, name):
            matched = True
    return matched


def known_hosts_entries(path: str, name: str) -> list[KnownHost]:
    """The lines of the known_hosts file `path` that name host `name` (none when the file does not exist or
    cannot be read; lines paramiko cannot parse, or of unknown key types, are skipped, as ssh skips them)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        marker = None
        if words[0].startswith("@"):
            marker, words = words[0], words[1:]
        if len(words) < 3 or not _names_match(words[0], name):
            continue
        try:
            key = paramiko.PKey.from_type_string(words[1], base64.b64decode(words[2], validate=True))
        except (paramiko.SSHException, paramiko.pkey.UnknownKeyType, binascii.Error, ValueError, TypeError):
            continue
        out.append(KnownHost(path, no, marker, key))
    return out


def _algorithms(key_type: str) -> list[str]:
    """The host key algorithms of a key type (an RSA key signs with rsa-sha2-512/256)."""
    return ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if key_type == "ssh-rsa" else [key_type]


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """A machine's host key check (its inventory's `host_key_check` and `known_hosts`). paramiko, given no
    keys, asks `missing_host_key` about every key; it raises HostKeyError for an unknown (with
    host_key_check true), changed or revoked key and records an unknown one (accept-new)."""

    def __init__(self, machine: Machine):
        self.machine = machine
        self.mode = machine.host_key_check
        self.name = host_key_name(machine.address, machine.port)
        self.user_file = os.path.expanduser(machine.known_hosts or USER_KNOWN_HOSTS)
        self.files = [self.user_file, SYSTEM_KNOWN_HOSTS] if self.mode is not False else []
        self.entries = [e for f in self.files for e in known_hosts_entries(f, self.name)]

    def transport(self, sock, **kw) -> paramiko.Transport:
        """paramiko's transport, preferring the host key algorithms of the keys known for the machine."""
        t = paramiko.Transport(sock, **kw)
        known = [a for e in self.entries if e.marker is None for a in _algorithms(e.key.get_name())]
        if known:
            opts = t.get_security_options()
            first = [a for a in dict.fromkeys(known) if a in opts.key_types]
            opts.key_types = first + [a for a in opts.key_types if a not in first]
        return t

    def missing_host_key(self, client, hostname: str, key: paramiko.PKey) -> None:
        if self.mode is False:
            return
        offered = f"{key.get_name()} {fingerprint(key)}"
        fp = fingerprint(key)
        for e in self.entries:
            if e.marker == "@revoked" and e.key == key:
                raise HostKeyError(self.machine, f"host key {offered} is marked @revoked in {e.where}: refused",
                                   fingerprint=fp, problem="revoked")
        plain = [e for e in self.entries if e.marker is None]
        if any(e.key == key for e in plain):
            return
        if plain:
            old = next((e for e in plain if e.key.get_name() == key.get_name()), plain[0])
            raise HostKeyError(
                self.machine,
                f"HOST KEY CHANGED: the machine offers {offered}, but {old.where} lists {old.describe()} for "
                f"{self.name}. Someone may be intercepting the connection, or the machine was rebuilt with a new "
                f"key. If you know it was rebuilt, remove the old key (`ssh-keygen -R {shlex.quote(self.name)} -f "
                f"{shlex.quote(old.file)}`) and connect again; for machines rebuilt often, set `host_key_check: "
                "false` for it in the inventory", fingerprint=fp, problem="changed")
        if self.mode == ACCEPT_NEW:
            self._record(key, fp)
            return
        ca = (" (host certificates, @cert-authority lines, are not supported)"
              if any(e.marker == "@cert-authority" for e in self.entries) else "")
        raise HostKeyError(
            self.machine,
            f"unknown host key {offered}: no known_hosts file lists a key for {self.name} (read: "
            f"{', '.join(self.files)}){ca}. Check the fingerprint on the machine (`ssh-keygen -lf "
            f"/etc/ssh/ssh_host_{key.get_name().removeprefix('ssh-').split('-')[0]}_key.pub`), then add the "
            f"line `{self.name} {key.get_name()} {key.get_base64()}` to {self.user_file}, or set "
            "`host_key_check: accept-new` for the machine in the inventory to record it at the first connection",
            fingerprint=fp, problem="unknown")

    def _record(self, key: paramiko.PKey, fp: str) -> None:
        """Append the key to the known_hosts file (its directory made, mode 0700, if missing)."""
        line = f"{self.name} {key.get_name()} {key.get_base64()}\n"
        try:
            with _RECORD_LOCK:
                parent = os.path.dirname(self.user_file)
                if parent and not os.path.isdir(parent):
                    os.makedirs(parent, mode=0o700)
                with open(self.user_file, "a") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)  # other controllers appending at the same time
                    f.write(line)
        except OSError as e:
            raise HostKeyError(self.machine, f"cannot record host key {key.get_name()} {fp} in {self.user_file} "
                                             f"(host_key_check: accept-new): {e.strerror or e}",
                               fingerprint=fp, problem="record") from None


# ----------------------------------------------------------------------------------------------------------
# Helpers.


def _load_key(machine: Machine) -> paramiko.PKey | None:
    if machine.key is None:
        return None
    if not os.path.exists(machine.key):
        raise AuthenticationError(machine, f"key file {machine.key} does not exist (the inventory's `key:`)")
    try:
        return paramiko.PKey.from_path(machine.key)
    except paramiko.PasswordRequiredException:
        raise AuthenticationError(machine, f"key {machine.key} is encrypted: load it into ssh-agent (ssh-add) and "
                                           "leave `key:` out, or use a key without a passphrase") from None
    except (paramiko.SSHException, OSError, ValueError) as e:
        raise AuthenticationError(machine, f"cannot read key {machine.key}: {e or type(e).__name__}") from None


def _oserror(e: OSError, timeout: float) -> str:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s"
    return str(e) or type(e).__name__


def _start_proxy(machine: Machine) -> tuple[socket.socket, subprocess.Popen, Any]:
    """Run the machine's proxy command as OpenSSH does (/bin/sh, stdin and stdout are the connection) on one
    end of a socket pair; paramiko gets the other end, a real socket (so timeouts and end of file behave as
    on TCP, unlike paramiko.ProxyCommand, which spins when the command exits). The command runs in its own
    session so that a Ctrl-C in the terminal does not cut the connections a clean-up still needs."""
    ours, theirs = socket.socketpair()
    errlog = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", f"exec {machine.proxy_argv_text()}"], stdin=theirs, stdout=theirs,
                                stderr=errlog, start_new_session=True, close_fds=True)
    except OSError:
        ours.close()
        errlog.close()
        raise
    finally:
        theirs.close()
    return ours, proc, errlog


def _stop_proxy(proc: subprocess.Popen | None, errlog: Any) -> str | None:
    """Stop a proxy command; its error output (or exit status) when it had failed on its own, else None."""
    if proc is None:
        return None
    failed = None
    try:
        rc = proc.wait(0.5)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rc = None
    if rc not in (None, 0) and errlog is not None:
        errlog.seek(0)
        text = errlog.read().decode(errors="replace").strip()
        failed = _tail(text, 500) or f"exit status {rc}"
    if errlog is not None:
        errlog.close()
    return failed


def _feed(chan: paramiko.Channel, data: str | None) -> None:
    try:
        if data:
            chan.sendall(data.encode())
        chan.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def _drain(recv, out: list[bytes]) -> None:
    while True:
        try:
            data = recv(65536)
        except socket.timeout:  # the channel's timeout (set for the stdout reads) applies here too
            continue
        except (OSError, EOFError, paramiko.SSHException):
            return
        if not data:
            return
        out.append(data)
