"""The machines file (`--machines FILE`): which machines a topology's hosts may be placed on, and how to reach
them over SSH.

    machines:
      m1: {address: 192.0.2.11, user: root, port: 22, key: ~/.ssh/id_ed25519}
      m2: {address: 192.0.2.12}

Per machine: `address` (required: an IP address or a host name), `user` (default root), `port` (22), `key`
(a private key file; default none: paramiko then tries the SSH agent and ~/.ssh/id_*; `~` is expanded and a
relative path is taken from the file's directory), `testbed` (the testbed command there, default `testbed` on
its PATH; split like a shell would, so `/opt/venv/bin/python -m testbed` works), `underlay_iface` (the interface
carrying the tunnels; default: the one with the route to the other machines) and `proxy_command` (OpenSSH's
ProxyCommand, for machines behind a jump host or in a network namespace: run by /bin/sh, its stdin/stdout are
the connection; %h, %p, %r and %% are replaced by the address, port, user and %), `host_key_check` (`true`, the
default: the machine's host key must be listed in a known_hosts file; `accept-new`: an unknown key is added to
the known_hosts file, a changed one refused; `false`: not checked) and `known_hosts` (the file read and written
instead of ~/.ssh/known_hosts; /etc/ssh/ssh_known_hosts is read too, as OpenSSH does). Machine names follow the
rule of node names in topologies; `local` is reserved (the controller itself).

The output of `vagrant ssh-config` (any OpenSSH client config) is accepted as a machines file too: a file
whose first meaningful line starts with `Host ` is read with `paramiko.SSHConfig`, one machine per `Host`
entry (patterns with `*`, `?` or `!` are skipped), its StrictHostKeyChecking (yes and ask: true, accept-new,
no and off: false) and UserKnownHostsFile (the first file) becoming host_key_check and known_hosts;
`inventory_from_ssh_config(text)` writes the equivalent machines file. Errors are `InputError`s, `FILE:LINE: FIELD: PROBLEM`, like topology files.

Pure: nothing here touches the system but reading the file.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import paramiko
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from testbed.topology.yamlfile import InputError, YamlDocument, parse_yaml, pydantic_problems, read_text

# The rule of node names in topologies (testbed.topology.topo.NODE_NAME_RE; repeated here so that topo may import this
# module without a cycle; tests/test_inventory.py checks the two stay equal).
MACHINE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
RESERVED_MACHINE_NAMES = {"local"}
IFNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")  # at most 15 characters (the kernel's IFNAMSIZ)
_HOSTNAME_RE = re.compile(r"^(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
DEFAULT_USER = "root"
DEFAULT_PORT = 22
DEFAULT_TESTBED = "testbed"
# host_key_check: True (the key must be known), ACCEPT_NEW (an unknown key is recorded, a changed one refused),
# False (not checked). OpenSSH's StrictHostKeyChecking values, as the testbed reads them from an ssh config.
ACCEPT_NEW = "accept-new"
HOST_KEY_CHECKS = (True, ACCEPT_NEW, False)
_STRICT_HOST_KEY_CHECKING = {"yes": True, "ask": True, "accept-new": ACCEPT_NEW, "no": False, "off": False}


@dataclass(frozen=True)
class Machine:
    """One machine of the inventory. `key` is an absolute path (or None: the agent and default keys);
    `host_key_check` one of HOST_KEY_CHECKS; `known_hosts` an absolute path (or None: ~/.ssh/known_hosts)."""

    name: str
    address: str
    user: str = DEFAULT_USER
    port: int = DEFAULT_PORT
    key: str | None = None
    testbed: str = DEFAULT_TESTBED
    underlay_iface: str | None = None
    proxy_command: str | None = None
    host_key_check: bool | str = True
    known_hosts: str | None = None

    @property
    def endpoint(self) -> str:
        """`192.0.2.11:22`, `[2001:db8::1]:22`."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def label(self) -> str:
        """How errors name the machine: `m1 (192.0.2.11:22)`."""
        return f"{self.name} ({self.endpoint})"

    @property
    def testbed_argv(self) -> list[str]:
        """The testbed command there, as an argv prefix."""
        return shlex.split(self.testbed)

    def proxy_argv_text(self) -> str | None:
        """The proxy command with %h, %p, %r and %% replaced (as OpenSSH does), or None."""
        if self.proxy_command is None:
            return None
        subst = {"h": self.address, "p": str(self.port), "r": self.user, "%": "%"}
        return re.sub(r"%([hpr%])", lambda m: subst[m.group(1)], self.proxy_command)


@dataclass
class Inventory:
    """The machines of a machines file, in file order. `path`: the file (None when parsed from a string)."""

    machines: dict[str, Machine]
    path: str | None = None

    def __getitem__(self, name: str) -> Machine:
        try:
            return self.machines[name]
        except KeyError:
            where = f" in {self.path}" if self.path else ""
            raise KeyError(f"no machine {name!r}{where} (machines: {', '.join(self.machines)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self.machines

    def __iter__(self):
        return iter(self.machines.values())

    def __len__(self) -> int:
        return len(self.machines)

    @property
    def names(self) -> list[str]:
        return list(self.machines)

    def to_yaml(self) -> str:
        """The inventory as a machines file (fields at their default left out, except user and port)."""
        return _dump({m.name: m for m in self.machines.values()})


# ----------------------------------------------------------------------------------------------------------
# The file's schema.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MachineModel(_Strict):
    address: str
    user: str = DEFAULT_USER
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    key: str | None = None
    testbed: str = DEFAULT_TESTBED
    underlay_iface: str | None = None
    proxy_command: str | None = None
    host_key_check: bool | Literal["accept-new"] = True
    known_hosts: str | None = None

    @field_validator("host_key_check", mode="before")
    @classmethod
    def _host_key_check(cls, v: Any) -> Any:
        if v not in HOST_KEY_CHECKS or (v != ACCEPT_NEW and not isinstance(v, bool)):
            raise ValueError(f"{v!r}: want true (the host key must be in known_hosts, the default), accept-new "
                             "(an unknown key is added to known_hosts, a changed one refused) or false (not checked)")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        v = v.strip()
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            pass
        if re.fullmatch(r"[0-9.]+", v):
            raise ValueError(f"{v!r} is not a valid IPv4 address")
        if not _HOSTNAME_RE.match(v):
            raise ValueError(f"{v!r} is neither an IP address nor a host name")
        return v.lower()

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?", v):
            raise ValueError(f"{v!r} is not a user name (letters, digits, '_', '.', '-')")
        return v

    @field_validator("key", "proxy_command", "known_hosts")
    @classmethod
    def _nonempty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty (leave the field out for the default)")
        return v

    @field_validator("testbed")
    @classmethod
    def _testbed(cls, v: str) -> str:
        try:
            argv = shlex.split(v)
        except ValueError as e:
            raise ValueError(f"cannot split {v!r} into words: {e}") from None
        if not argv:
            raise ValueError("is empty (leave the field out for `testbed` on the machine's PATH)")
        return v

    @field_validator("underlay_iface")
    @classmethod
    def _iface(cls, v: str | None) -> str | None:
        if v is not None and not IFNAME_RE.match(v):
            raise ValueError(f"{v!r} is not an interface name (1-15 characters of letters, digits, '_', '.', '-')")
        return v


class InventoryFile(_Strict):
    machines: dict[str, MachineModel]

    @field_validator("machines")
    @classmethod
    def _some(cls, v: dict) -> dict:
        if not v:
            raise ValueError("no machines: list at least one, e.g. `m1: {address: 192.0.2.11}`")
        return v


# ----------------------------------------------------------------------------------------------------------
# Loading.


def load_inventory(path: str | Path) -> Inventory:
    """Read a machines file (YAML, or an OpenSSH client config such as `vagrant ssh-config` output)."""
    return parse_inventory(read_text(path), str(path))  # InputError naming the file: unreadable, not UTF-8


def parse_inventory(text: str, path: str = "<string>") -> Inventory:
    """A machines file's text as an Inventory; `path` names the file in errors (and is where relative key
    paths start from, unless it is `<...>`: then they start from the current directory)."""
    if is_ssh_config(text):
        return _from_ssh_config(text, path)
    data, lines = parse_yaml(text, path)
    doc = YamlDocument(path, data, lines)
    if not isinstance(data, dict):
        raise doc.error([("", "a machines file holds a mapping `machines:` of machine names to "
                              "{address: ..., user: ..., port: ..., key: ...}")])
    if isinstance(data.get("machines"), dict):
        data = {**data, "machines": {str(k): v for k, v in data["machines"].items()}}
    return _build(doc, data, _base_dir(path))


def is_ssh_config(text: str) -> bool:
    """Whether the first meaningful line (not blank, not a comment) is a `Host ` line."""
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            return bool(re.match(r"host(\s|=)", s, re.IGNORECASE))
    return False


def _base_dir(path: str) -> Path:
    return Path.cwd() if path.startswith("<") else Path(path).resolve().parent


def _build(doc: YamlDocument, data: dict, base: Path) -> Inventory:
    problems: list[tuple[str, str]] = []
    machines_raw = data.get("machines")
    if isinstance(machines_raw, dict):
        for name in machines_raw:
            if not MACHINE_NAME_RE.match(name):
                problems.append((f"machines.{name}", "machine names are 1-32 characters of letters, digits, '_' "
                                                     "or '-', starting with a letter or digit"))
            elif name in RESERVED_MACHINE_NAMES:
                problems.append((f"machines.{name}", f"{name!r} is reserved (it names the controller itself)"))
    elif machines_raw is None and "machines" in data:
        raise doc.error([("machines", "no machines: list at least one, e.g. `m1: {address: 192.0.2.11}`")])
    elif "machines" in data:
        raise doc.error([("machines", "a mapping of machine names to {address: ..., user: ..., ...}, "
                                      f"not a {type(machines_raw).__name__}")])
    try:
        spec = InventoryFile.model_validate(data)
    except ValidationError as e:
        raise doc.error(problems + pydantic_problems(e)) from None
    if problems:
        raise doc.error(problems)
    machines: dict[str, Machine] = {}
    seen: dict[tuple, str] = {}
    for name, m in spec.machines.items():
        ident = (m.address, m.port, m.proxy_command)
        if ident in seen:
            endpoint = Machine(name, m.address, port=m.port).endpoint
            problems.append((f"machines.{name}.address", f"same address and port as machine {seen[ident]} ({endpoint})"))
            continue
        seen[ident] = name
        machines[name] = Machine(name=name, address=m.address, user=m.user, port=m.port, key=_file(m.key, base),
                                 testbed=m.testbed, underlay_iface=m.underlay_iface, proxy_command=m.proxy_command,
                                 host_key_check=m.host_key_check, known_hosts=_file(m.known_hosts, base))
    if problems:
        raise doc.error(problems)
    return Inventory(machines, None if doc.file.startswith("<") else doc.file)


def _file(path: str | None, base: Path) -> str | None:
    """A file field: `~` expanded, a relative path taken from `base`."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    return str(base / path) if not os.path.isabs(path) else path


# ----------------------------------------------------------------------------------------------------------
# OpenSSH client configs (`vagrant ssh-config`).

# ssh_config keyword (lower case) -> the machine field it sets
_SSH_KEYWORDS = {"hostname": "address", "user": "user", "port": "port", "identityfile": "key",
                 "proxycommand": "proxy_command", "stricthostkeychecking": "host_key_check",
                 "userknownhostsfile": "known_hosts"}


def inventory_from_ssh_config(text: str, path: str = "<ssh-config>", underlay_iface: str | None = None,
                              user: str | None = None, testbed: str | None = None) -> str:
    """The machines file (YAML) equivalent to an OpenSSH client config; InputError if an entry is unusable.
    `underlay_iface` is set on every machine: the interface the tunnels use when the SSH address is not one
    the machines reach each other at (Vagrant: SSH to a forwarded or management address, tunnels over the
    private network, eth1 on Debian boxes). `user` replaces every entry's user (Vagrant lists `vagrant`; the
    testbed needs root, which the Vagrantfile lets log in with the same key). `testbed` replaces every machine's
    testbed command (default `testbed` on its PATH; e.g. the controller's own venv, shared into the VMs at the
    same path)."""
    import dataclasses

    inv = _from_ssh_config(text, path)
    if testbed is not None and not testbed.strip():
        raise InputError(path, [("testbed", "is empty (leave it out for `testbed` on the machines' PATH)")])
    changes = {k: v for k, v in (("underlay_iface", underlay_iface), ("user", user), ("testbed", testbed)) if v}
    inv.machines = {n: dataclasses.replace(m, **changes) for n, m in inv.machines.items()}
    return (f"# machines converted from an OpenSSH client config ({path})\n" if not path.startswith("<")
            else "# machines converted from an OpenSSH client config\n") + inv.to_yaml()


def _from_ssh_config(text: str, path: str) -> Inventory:
    config = paramiko.SSHConfig.from_text(text)
    hosts, lines = _ssh_config_hosts(text)
    problems: list[tuple[str, str]] = []
    raw: dict[str, dict[str, Any]] = {}
    for name in hosts:
        opts = config.lookup(name)
        if "proxyjump" in opts and "proxycommand" not in opts:
            problems.append((f"machines.{name}.proxy_jump", "ProxyJump is not supported: write it as a ProxyCommand, "
                                                            "e.g. `ProxyCommand ssh -W %h:%p JUMPHOST`"))
            continue
        m: dict[str, Any] = {"address": opts.get("hostname", name)}
        for keyword, field in _SSH_KEYWORDS.items():
            if keyword in opts and keyword != "hostname":
                value = opts[keyword]
                m[field] = value[0] if isinstance(value, list) else value  # IdentityFile: the first one
        if "port" in m:
            try:
                m["port"] = int(m["port"])
            except ValueError:
                pass  # the schema reports it
        if str(m.get("proxy_command", "")).lower() == "none":
            del m["proxy_command"]
        if "host_key_check" in m:
            # the schema reports a value that is none of OpenSSH's
            m["host_key_check"] = _STRICT_HOST_KEY_CHECKING.get(str(m["host_key_check"]).lower(), m["host_key_check"])
        if "known_hosts" in m:
            # OpenSSH reads every file listed and writes to the first; the testbed uses the first
            files = shlex.split(str(m["known_hosts"]))
            m["known_hosts"] = files[0] if files else m["known_hosts"]
            if m["known_hosts"].lower() == "none":
                m["known_hosts"] = os.devnull
        raw[name] = m
    if not hosts:
        problems.append(("", "no machines: no `Host NAME` entry without wildcards"))
    doc = YamlDocument(path, {"machines": raw}, lines)
    if problems:
        raise doc.error(problems)
    return _build(doc, {"machines": raw}, _base_dir(path))


def _ssh_config_hosts(text: str) -> tuple[list[str], dict[str, int]]:
    """The machine names of an ssh config (the first plain name of each `Host` line, in file order) and the
    line of each (`machines.NAME`) and of its options (`machines.NAME.FIELD`)."""
    hosts: list[str] = []
    lines: dict[str, int] = {"": 1, "machines": 1}
    current: str | None = None
    for no, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = re.match(r"(\S+?)(?:\s*=\s*|\s+)(.*)$", s)
        if not m:
            continue
        keyword, value = m.group(1).lower(), m.group(2)
        if keyword == "host":
            names = [n for n in shlex.split(value) if not any(c in n for c in "*?!")]
            current = names[0] if names and names[0] not in hosts else None
            if current:
                hosts.append(current)
                lines[f"machines.{current}"] = no
        elif keyword == "match":
            current = None
        elif current and keyword in _SSH_KEYWORDS | {"proxyjump": "proxy_jump"}:
            field = {**_SSH_KEYWORDS, "proxyjump": "proxy_jump"}[keyword]
            lines.setdefault(f"machines.{current}.{field}", no)
    return hosts, lines


def _dump(machines: dict[str, Machine]) -> str:
    out: dict[str, dict[str, Any]] = {}
    defaults = {f.name: f.default for f in fields(Machine)}
    for name, m in machines.items():
        entry: dict[str, Any] = {"address": m.address, "user": m.user, "port": m.port}
        for f in ("key", "testbed", "underlay_iface", "proxy_command", "host_key_check", "known_hosts"):
            if getattr(m, f) != defaults[f]:
                entry[f] = getattr(m, f)
        out[name] = entry
    return yaml.safe_dump({"machines": out}, sort_keys=False, default_flow_style=None, width=1000)
