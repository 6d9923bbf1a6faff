"""The docker runtime: each host is a container (Containernet's way). Links, routes and the corruption engine
work exactly as with the netns runtime, because they only see the container's network namespace path.

A host container
- runs the worker image (`testbed image build`; a node's `image:` overrides it) with `network_mode="none"`:
  docker gives it a network namespace with only `lo`, and the testbed then creates veths directly inside it
  through `/proc/PID/ns/net` (PID: the container's init, from `docker inspect`). Docker never touches the
  host's interfaces, routes or firewall for it.
- gets `cap_add=["NET_ADMIN"]` only (never privileged): enough for `ip`/`tc`/`iptables` inside. The corruption
  engine does not need it: the engine runs on the host and setns()es into the container's namespace.
- runs `docker-init` (init=True) as PID 1 with an idle `sleep infinity`; work is started with `docker exec`.
- is named `tb.TOPOLOGY.NODE`, has hostname NODE and labels `testbed.topology`, `testbed.node`.
- has the node's `cpus` (nano_cpus) and `memory` (mem_limit, no extra swap) as cgroup limits, and its `env`.
- mounts, at the same path inside as outside (so paths can be passed around unchanged):
    WORK_DIR   (/var/lib/testbed/work, read-write): the shared work directory (run dirs, logs, metrics);
               it is also the container's working directory;
    cache_dir()(~/.cache/testbed of the user running `up`, or $TESTBED_CACHE; read-write): the corpus,
               tokenizer and token caches, so every host trains on the same prepared data;
               TESTBED_CACHE is set to it inside;
    HISTORY_ROOT (/var/lib/testbed/history, read-write): where `down` saves final engine counters;
    every path in $TESTBED_DOCKER_MOUNTS (':'-separated absolute paths), e.g. an experiment's results dir.

Which engine: $DOCKER_HOST if set; else /var/run/docker.sock; else the testbed's own engine at
unix:///run/testbed-docker/docker.sock (containers/ensure-docker.sh starts it); the first that answers.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

from testbed import nsutil, procs
from testbed.runtime.base import RESOLV_CONF, Host, Runtime, RuntimeUnavailable, register_runtime

LABEL_TOPOLOGY = "testbed.topology"
LABEL_NODE = "testbed.node"
LABEL_RUNTIME = "testbed.runtime"
PRIVATE_DIR = Path(os.environ.get("TESTBED_DOCKER_DIR", "/run/testbed-docker"))
PRIVATE_HOST = f"unix://{PRIVATE_DIR}/docker.sock"
SYSTEM_HOST = "unix:///var/run/docker.sock"
WORK_DIR = Path(os.environ.get("TESTBED_WORK_DIR", "/var/lib/testbed/work"))
EXEC_TAG = "TESTBED_EXEC_ID"  # set in every process started by DockerRuntime.popen, to find and signal it
# Host-specific variables that would break programs inside the image if passed through `exec`.
HOST_ONLY_ENV = frozenset({"PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "VIRTUAL_ENV", "PYTHONHOME",
                           "LD_LIBRARY_PATH", "TERM", "TMPDIR"})
NETNS_SYSCTLS = nsutil.HOST_SYSCTLS  # the same settings netns hosts get

HOW_TO_GET_AN_ENGINE = (
    "Get one with `containers/ensure-docker.sh` (as root: installs Debian's docker.io if missing and starts "
    "dockerd with --iptables=false --bridge=none and a private data root and socket), or `make test`, which runs "
    "it; or start Docker yourself (apt-get install docker.io; dockerd) or point DOCKER_HOST at a reachable engine.")

_engine_cache: dict[str, str] = {}


def worker_tag() -> str:
    return os.environ.get("TESTBED_WORKER_IMAGE", "testbed-worker:latest")


def container_name(topology: str, node: str) -> str:
    # Docker names: [a-zA-Z0-9][a-zA-Z0-9_.-]+. Topology names are [a-z0-9][a-z0-9_-]* and node names
    # [A-Za-z0-9][A-Za-z0-9_-]*, so this is always valid, and unique per engine like the netns names.
    return f"{nsutil.PREFIX}{topology}.{node}"


def _candidates() -> list[str]:
    if os.environ.get("DOCKER_HOST"):
        return [os.environ["DOCKER_HOST"]]  # explicit: never fall back to another engine
    return [SYSTEM_HOST, PRIVATE_HOST]


def _connect(url: str, timeout: float):
    import docker

    if url == os.environ.get("DOCKER_HOST"):
        return docker.from_env(timeout=int(timeout))  # honours DOCKER_TLS_VERIFY / DOCKER_CERT_PATH too
    return docker.DockerClient(base_url=url, timeout=int(timeout))


def client(timeout: float = 120):
    """A docker SDK client for the first engine that answers; RuntimeUnavailable (with what to do) if none."""
    try:
        import docker
    except ImportError:
        raise RuntimeUnavailable("the docker SDK is missing from this Python: pip install docker") from None

    key = os.environ.get("DOCKER_HOST", "")
    url = _engine_cache.get(key)
    if url:
        try:
            return _connect(url, timeout)
        except docker.errors.DockerException:
            _engine_cache.pop(key, None)
    tried = []
    for url in _candidates():
        if url.startswith("unix://") and not os.path.exists(url[len("unix://"):]):
            tried.append(f"{url} (no such socket)")
            continue
        try:
            c = _connect(url, timeout)
            c.ping()
        except docker.errors.DockerException as e:
            tried.append(f"{url} ({short_error(e)})")
            continue
        _engine_cache[key] = url
        return c
    raise RuntimeUnavailable(f"no Docker engine is reachable (tried {'; '.join(tried)}). {HOW_TO_GET_AN_ENGINE}")


def engine_url() -> str:
    """The engine the runtime uses, for the docker CLI's -H. Cheap: without a cached answer, the one socket
    that exists; only when several exist does it ask which answers."""
    cached = _engine_cache.get(os.environ.get("DOCKER_HOST", ""))
    if cached:
        return cached
    cands = _candidates()
    present = [u for u in cands if not u.startswith("unix://") or os.path.exists(u[len("unix://"):])]
    if len(present) == 1 or len(cands) == 1:
        return (present or cands)[0]
    try:
        client(timeout=15)
    except RuntimeUnavailable:
        return cands[0]
    return _engine_cache.get(os.environ.get("DOCKER_HOST", ""), cands[0])


def short_error(e: Exception) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return s[:200]


def _cli_prefix() -> list[str]:
    """`docker` with -H when the engine is not the one the CLI would find by itself (DOCKER_HOST)."""
    if os.environ.get("DOCKER_HOST"):
        return ["docker"]
    return ["docker", "-H", engine_url()]


@register_runtime
class DockerRuntime(Runtime):
    name = "docker"
    leftover_key = "containers"
    python = "python3"  # the worker image's

    def run_facts(self, host: Host) -> dict:
        """The image and its content digest (its image id: runtime/image.py's image_digest), None if gone."""
        import docker

        image = host.extra.get("image") or worker_tag()
        try:
            digest = client().images.get(image).id
        except docker.errors.ImageNotFound:
            digest = None
        return {"image": host.extra.get("image"), "image_digest": digest}

    def host_alive(self, host: Host) -> bool:
        import docker
        try:
            ctr = self.client.containers.get(host.container_id)
        except (docker.errors.NotFound, RuntimeUnavailable):
            return False
        return ctr.status == "running" and int(ctr.attrs["State"].get("Pid") or 0) == host.pid

    def why_gone(self, host: Host) -> str:
        import docker
        try:
            ctr = self.client.containers.get(host.container_id)
        except RuntimeUnavailable as e:
            return f"the Docker engine does not answer ({str(e).split('. ')[0]})"
        except docker.errors.NotFound:
            return f"its container {host.container_id[:12]} is gone"
        return f"its container {host.container_id[:12]} is {ctr.status}" + (
            f" (exit code {ctr.attrs['State'].get('ExitCode')})" if ctr.status == "exited" else "")

    def shared_dir(self):
        return WORK_DIR

    def __init__(self):
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = client()
        return self._client

    # -- checks --------------------------------------------------------------------------------------------

    def check(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeUnavailable("the docker runtime needs root (veths are moved into the containers' "
                                     "namespaces from the host)")
        from shutil import which
        if not which("docker"):
            raise RuntimeUnavailable("the docker CLI is missing (it runs `exec` in containers): apt-get install "
                                     f"docker.io. {HOW_TO_GET_AN_ENGINE}")
        if not which("nsenter"):
            raise RuntimeUnavailable("nsenter is missing: apt-get install util-linux")
        c = self.client  # raises RuntimeUnavailable when no engine answers
        tag = worker_tag()
        if not image_present(c, tag):
            raise RuntimeUnavailable(
                f"the worker image {tag} is missing from the Docker engine at {engine_url()}: build it with "
                f"`testbed image build` (once: ~3 min on a machine without a registry; cached afterwards)")

    # -- hosts ---------------------------------------------------------------------------------------------

    def create(self, topology: str, node, state_dir) -> Host:
        import docker

        c = self.client
        name = container_name(topology, node.name)
        image = node.image or worker_tag()
        if not image_present(c, image):
            hint = "build it with `testbed image build`" if image == worker_tag() else \
                "pull or build it first (it needs python3 for the testbed's workloads)"
            raise RuntimeUnavailable(f"node {node.name}: image {image} is not in the Docker engine: {hint}")
        # A container of this name can only be a leftover of a killed run of the same topology (`up` holds the
        # topology's state directory, so no live topology owns it): remove it.
        self._remove_stale(name, topology)
        kw: dict = {}
        if node.cpus:
            ncpu = self._ncpu()
            if node.cpus > ncpu:
                raise RuntimeUnavailable(f"node {node.name} asks for cpus: {node.cpus:g}, but this machine has only "
                                         f"{ncpu} CPU(s) and Docker refuses a larger limit; lower `cpus`")
            kw["nano_cpus"] = int(round(node.cpus * 1e9))
        if node.memory:
            kw["mem_limit"] = int(node.memory)
            kw["memswap_limit"] = int(node.memory)  # no swap beyond the limit (a no-op where there is no swap)
        cache = _cache_dir()
        for d in shared_paths():
            d.mkdir(parents=True, exist_ok=True)
        volumes = {str(p): {"bind": str(p), "mode": "rw"} for p in shared_paths()}
        env = {"TESTBED_CACHE": str(cache), **(node.env or {}), "TESTBED_NODE": node.name,
               "TESTBED_TOPOLOGY": topology}
        labels = {LABEL_TOPOLOGY: topology, LABEL_NODE: node.name, LABEL_RUNTIME: "docker",
                  "testbed.state": str(state_dir)}
        try:
            ctr = c.containers.create(
                image, command=["sleep", "infinity"], name=name, hostname=node.name, labels=labels,
                network_mode="none", cap_add=["NET_ADMIN"], privileged=False, init=True, detach=True,
                environment=env, volumes=volumes, working_dir=str(WORK_DIR), sysctls=NETNS_SYSCTLS,
                shm_size="256m", stop_signal="SIGKILL", **kw)
        except docker.errors.APIError as e:
            raise RuntimeError(f"cannot create the container of {node.name} ({name}, image {image}): "
                               f"{e.explanation or e}") from None
        try:
            ctr.start()
            ctr.reload()
            pid = int(ctr.attrs["State"]["Pid"])
            if not pid:
                raise RuntimeError(f"container {name} did not start: {ctr.attrs['State'].get('Error') or ctr.status}")
            if not _is_our_process(pid, topology, node.name):
                raise RuntimeUnavailable(
                    f"the Docker engine at {engine_url()} does not run on this machine (the container's process "
                    f"{pid} is not visible here), but the docker runtime moves veths into the containers' network "
                    f"namespaces from this host: use an engine on this machine ({HOW_TO_GET_AN_ENGINE})")
        except BaseException as e:
            _force_remove(ctr)
            if isinstance(e, docker.errors.APIError):
                raise RuntimeError(f"cannot start the container of {node.name} ({name}): {e.explanation or e}") from None
            raise
        return Host(topology=topology, node=node.name, runtime=self.name, netns=f"/proc/{pid}/ns/net",
                    container_id=ctr.id, pid=pid, extra={"name": name, "image": image,
                                                         "image_id": ctr.attrs.get("Image")})

    def _ncpu(self) -> int:
        if not hasattr(self, "_ncpu_cached"):
            try:
                self._ncpu_cached = int(self.client.info().get("NCPU") or os.cpu_count() or 1)
            except Exception:
                self._ncpu_cached = os.cpu_count() or 1
        return self._ncpu_cached

    def _remove_stale(self, name: str, topology: str) -> None:
        import docker

        try:
            old = self.client.containers.get(name)
        except docker.errors.NotFound:
            return
        if old.labels.get(LABEL_TOPOLOGY) != topology:
            raise RuntimeError(f"a container named {name} exists and is not the testbed's: remove or rename it")
        _remove_container(old)

    def exec_argv(self, host: Host, argv: list[str], env: dict | None = None) -> list[str]:
        """`docker exec -i CONTAINER ARGV`: the command runs inside the container, so its cgroup limits (cpus,
        memory), file system, pid namespace and capabilities apply, unlike an nsenter from the host. stdin,
        stdout, stderr (separately) and the exit code pass through. A terminal (stdin, stdout and stderr all
        ttys, e.g. `testbed exec h1 -- bash` from a shell) gets `-t` as well, so Ctrl-C and job control reach
        the command; a small `sh` decides that at run time, in the process that will be the client.

        Killing the docker client does NOT kill the command inside (Docker's exec has no such link): use
        `popen()` (whose kill()/terminate()/send_signal() signal the command inside), or `down`, which removes
        the container and everything in it."""
        tail = [*self._env_flags(env), _cid(host), *argv]
        script = ('if [ -t 0 ] && [ -t 1 ] && [ -t 2 ]; then t=-t; else t=; fi; '
                  f'exec {shlex.join(_cli_prefix())} exec -i $t "$@"')
        return ["sh", "-c", script, "testbed-exec", *tail]

    def set_hosts_file(self, host: Host, text: str) -> None:
        """Docker bind-mounts a per-container hosts file (HostsPath) over /etc/hosts: rewrite it in place (a
        rename would leave the container on the old inode). With network_mode none Docker never rewrites it."""
        info = self.client.api.inspect_container(_cid(host))
        for key, content in (("HostsPath", text), ("ResolvConfPath", RESOLV_CONF)):
            path = info.get(key)
            if not path:
                raise RuntimeError(f"container of {host.node} has no {key}")
            with open(path, "w") as f:
                f.write(content)

    def _env_flags(self, env: dict | None) -> list[str]:
        flags = []
        for k, v in (env or {}).items():
            if k in HOST_ONLY_ENV:
                continue
            flags += ["-e", f"{k}={v}"]
        return flags

    def popen(self, host: Host, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start `argv` in the container; the returned Popen's signals reach the command inside (see
        ContainerPopen), so p.kill() stops the workload, not only the docker client."""
        tag = uuid.uuid4().hex
        cmd = [*_cli_prefix(), "exec", "-i", *self._env_flags({**(env or {}), EXEC_TAG: tag}), _cid(host), *argv]
        p = ContainerPopen(cmd, **kw)
        p.exec_tag, p.container_pid = tag, host.pid
        return p

    def list(self, topology: str | None = None) -> list[str]:
        try:
            c = self.client
        except RuntimeUnavailable:
            return []
        return sorted(x.name for x in c.containers.list(all=True, filters={"label": _label_filter(topology)}))

    def delete(self, host: Host) -> None:
        import docker

        if not host.container_id:
            return
        try:
            ctr = self.client.containers.get(host.container_id)
        except docker.errors.NotFound:
            return
        _remove_container(ctr)

    def delete_all(self, topology: str | None = None) -> list[str]:
        try:
            c = self.client
        except RuntimeUnavailable:
            return []
        import docker

        for _ in range(5):
            try:  # list() inspects each container it found: one may go in between (another machine's teardown
                found = c.containers.list(all=True, filters={"label": _label_filter(topology)})  # of the topology)
                break
            except docker.errors.NotFound:
                continue
        else:
            found = []
        gone = []
        for ctr in found:
            _remove_container(ctr)
            gone.append(ctr.name)
        return gone


class ContainerPopen(subprocess.Popen):
    """A `docker exec` client whose signals go to the command inside the container.

    The command carries a unique TESTBED_EXEC_ID in its environment; send_signal() finds every process in the
    container's pid namespace with that tag (the command and the children that kept its environment) and
    signals them from the host. The client then exits with the command's status. SIGKILL also kills the client
    at once, so kill() + wait() always return promptly."""

    exec_tag: str = ""
    container_pid: int | None = None

    def inside_pids(self) -> list[int]:
        return _tagged_pids(self.exec_tag, self.container_pid)

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        pids = self.inside_pids()
        deadline = time.monotonic() + 1.0
        while not pids and self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # `docker exec` takes ~0.1 s to start the command: give it that
            pids = self.inside_pids()
        for pid in pids:
            procs.kill(pid, sig)
        if sig == signal.SIGKILL or not pids:
            super().send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _tagged_pids(tag: str, container_pid: int | None) -> list[int]:
    """Processes carrying EXEC_TAG=tag in their environment, in the container's pid namespace if given."""
    needle = f"{EXEC_TAG}={tag}"
    if container_pid:
        candidates = procs.in_namespace(f"/proc/{container_pid}/ns/pid", "pid")
    else:
        candidates = procs.pids()
    return [p for p in candidates if needle in (procs.environ(p) or [])]


OWN_PROCESS_WAIT_S = 10.0  # how long the container's init may take to exec (runc's own environment until then)


def _is_our_process(pid: int, topology: str, node: str) -> bool:
    """Is host pid `pid` the init of the container just made for (topology, node)? Its environment says so; a
    remote engine's pid names some unrelated process here, or none. The engine reports the pid once runc has
    started it, and until it execs the container's init its environment is runc's: on a loaded machine that can
    take a while, so an existing process is asked again for up to OWN_PROCESS_WAIT_S."""
    return procs.environ_has(pid, (f"TESTBED_TOPOLOGY={topology}", f"TESTBED_NODE={node}"), OWN_PROCESS_WAIT_S)


def _cid(host: Host) -> str:
    if not host.container_id:
        raise RuntimeError(f"host {host.node} has no container id (it was not created by the docker runtime)")
    return host.container_id


def _label_filter(topology: str | None) -> str:
    return f"{LABEL_TOPOLOGY}={topology}" if topology else LABEL_TOPOLOGY


def image_present(c, ref: str) -> bool:
    import docker
    try:
        c.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def shared_paths() -> list[Path]:
    """Host directories every container mounts read-write at the same path: the work directory, the data
    cache, the results history, and each absolute path in $TESTBED_DOCKER_MOUNTS (':'-separated), e.g. an
    experiment's results directory."""
    paths = [WORK_DIR, _cache_dir(), _history_root()]
    for p in os.environ.get("TESTBED_DOCKER_MOUNTS", "").split(os.pathsep):
        if p.strip():
            if not os.path.isabs(p):
                raise RuntimeUnavailable(f"TESTBED_DOCKER_MOUNTS: {p!r} is not an absolute path")
            paths.append(Path(p).resolve())
    out: list[Path] = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out


def _cache_dir() -> Path:
    return Path(os.environ.get("TESTBED_CACHE", "~/.cache/testbed")).expanduser().resolve()


def _history_root() -> Path:
    from testbed.state import HISTORY_ROOT
    return Path(HISTORY_ROOT)


def _kill_foreign_processes(ctr) -> None:
    """Processes that entered the container's network namespace from outside (an engine, an nsenter'd tcpdump)
    keep the namespace, and the veths in it, alive after the container is gone: kill them first. Processes of
    the container itself go with it."""
    pid = int((ctr.attrs.get("State") or {}).get("Pid") or 0)
    if not pid:
        return
    own_pidns = procs.namespace(pid, "pid")
    if own_pidns is None:
        return
    for p in nsutil.processes_in_netns(f"/proc/{pid}/ns/net"):
        pidns = procs.namespace(p, "pid")
        if pidns is not None and pidns != own_pidns:
            procs.kill(p)


def _remove_container(ctr) -> None:
    try:
        ctr.reload()
        _kill_foreign_processes(ctr)
    except Exception:
        pass
    _force_remove(ctr)


def _force_remove(ctr) -> None:
    import docker
    try:
        ctr.remove(force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code == 409 and "already in progress" in str(e):
            return  # another teardown is removing it
        raise


def engine_status() -> tuple[bool, str]:
    """For `testbed doctor`: is an engine reachable, which, and is the worker image there."""
    try:
        c = client(timeout=15)
    except RuntimeUnavailable as e:
        return False, str(e)
    try:
        v = c.version()
        what = f"Docker {v.get('Version')} (API {v.get('ApiVersion')}) at {engine_url()}"
        info = c.info()
        what += f", cgroup v{info.get('CgroupVersion', '?')}, {info.get('Driver')}"
    except Exception as e:
        return False, f"engine at {engine_url()} answers ping but not version/info: {short_error(e)}"
    tag = worker_tag()
    if image_present(c, tag):
        img = c.images.get(tag)
        return True, f"{what}; worker image {tag} {img.id[:19]} (testbed {img.labels.get('testbed.version', '?')})"
    return True, f"{what}; worker image {tag} missing: `testbed image build` (docker runtime refuses to start)"
