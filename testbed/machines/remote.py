"""Control of other machines over SSH (paramiko): commands, long-running processes, files.

One `Remote` per machine holds one SSH connection open for a whole command; every command (`run`), file
transfer (SFTP) and process (`start`) goes over it. `connect_all(inventory)` opens them all at once.

Errors are `RemoteError`s; the message always names the machine and its address
(`m2 (192.0.2.12:22): unreachable: [Errno 113] No route to host`), and `kind` says what went wrong:
`unreachable`, `authentication`, `ssh` (the SSH handshake failed otherwise), `not-root`, `testbed-missing`,
`version`, `command` (a command exited non-zero), `timeout`, `file` (an SFTP operation failed).

Commands go through the remote login shell, as with `ssh host CMD`: an argv list is quoted with shlex.join,
environment variables are put on the command line (`env K=V ... CMD`; sshd usually refuses paramiko's
set_environment_variable).
"""

from __future__ import annotations

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
from testbed.machines.inventory import Inventory, Machine

# paramiko logs a failed handshake (with a traceback) from its transport thread; the RemoteError says it
# better. A NullHandler keeps Python's last-resort handler from printing it when logging is not configured.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_CONNECT_TIMEOUT = 5.0
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


class AuthenticationError(RemoteError):
    kind = "authentication"


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
        # Lab machines: host keys are not checked (nor written to known_hosts). Test and lab machines are
        # recreated often with new host keys at the same addresses (`vagrant destroy && vagrant up`, fresh
        # namespaces in the tests), and the testbed runs on a lab network it trusts; a strict policy would only
        # make every rebuild fail. Do not point the testbed at machines over a network you do not trust.
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(machine.address, port=machine.port, username=machine.user, pkey=pkey,
                           sock=sock, timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                           channel_timeout=timeout, allow_agent=machine.key is None,
                           look_for_keys=machine.key is None)
        except BaseException as e:
            client.close()
            sock.close()
            proxy_err = _stop_proxy(proxy, errlog)
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
            while True:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    chan.settimeout(min(left, 1.0))
                try:
                    data = chan.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    break
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
