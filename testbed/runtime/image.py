"""The worker image of the docker runtime: Python 3.11, CPU torch, the testbed package and its dependencies,
and iproute2/iptables/ethtool/ping/procps. `testbed image build` makes it; docs/containers.md explains it.

Three layers of caching, from the bottom:
1. base image: `python:3.11-slim` from a registry, or, without one, `testbed-base:bookworm`, made once here with
   `debootstrap --variant=minbase bookworm` (the system tools and python3 included) + `docker import`.
2. deps image `testbed-worker-deps:KEY`: a venv at /opt/venv with exactly the Python packages (same versions)
   the testbed's dependencies resolve to in the host's own environment. Wheels are fetched on the HOST by the
   host's pip (so its index, find-links and torch CPU build apply; nothing inside the build needs an index)
   into a cache, and served to the build from 127.0.0.1 over HTTP (the build runs with --network host): no
   wheel is copied into a layer. KEY hashes the base image id, the Dockerfile and the pinned list, so it is
   built once per dependency set.
3. worker image (`testbed-worker:latest`): the deps image + the testbed package (one COPY, the last layer):
   a rebuild after a change to the testbed code takes a few seconds.

The SDK (docker-py) does the builds, the import and the queries; debootstrap and tar are run as commands.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from testbed import __version__
from testbed.runtime import docker as drt

BASE_REGISTRY = "python:3.11-slim"
BASE_DEBOOTSTRAP = "testbed-base:bookworm"
DEPS_REPO = "testbed-worker-deps"
LABEL = "testbed.image"
PYTHON_TARGET = (3, 11)
CACHE_ROOT = Path(os.environ.get("TESTBED_IMAGE_CACHE", "/var/cache/testbed/image"))
DEBIAN_MIRROR = os.environ.get("TESTBED_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# In the debootstrap base already, so the build needs no Debian mirror; installed by apt on python:3.11-slim.
SYSTEM_PACKAGES = ["iproute2", "iptables", "ethtool", "iputils-ping", "procps", "ca-certificates"]
BASE_INCLUDE = ["python3", "python3-venv", *SYSTEM_PACKAGES]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Pulled in only by a CUDA build of torch; never wanted in the CPU worker image.
CUDA_ONLY = ("nvidia-", "triton", "cuda-")


class ImageBuildError(RuntimeError):
    pass


def _log_default(msg: str) -> None:
    print(f"[image] {msg}", file=sys.stderr, flush=True)


# -- queries -----------------------------------------------------------------------------------------------------


def image_info(tag: str | None = None) -> dict | None:
    """What results should record about an image: tag, id (the content digest of its config), repo digests,
    testbed version and build labels. None if the engine has no such image."""
    import docker

    tag = tag or drt.worker_tag()
    c = drt.client()
    try:
        img = c.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return {"tag": tag, "id": img.id, "repo_digests": img.attrs.get("RepoDigests") or [],
            "created": img.attrs.get("Created"), "size_bytes": img.attrs.get("Size"),
            "labels": {k: v for k, v in (img.labels or {}).items() if k.startswith("testbed.")}}


def image_digest(tag: str | None = None) -> str | None:
    """`sha256:...` identifying the image's content exactly (its image id), or None if it is missing."""
    info = image_info(tag)
    return info["id"] if info else None


# -- the build ---------------------------------------------------------------------------------------------------


def project_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "containers" / "worker" / "Dockerfile").is_file():
        raise ImageBuildError(f"containers/worker/Dockerfile not found under {root}: build images from a checkout "
                              "of the testbed (pip install -e .)")
    return root


def ensure_worker_image(tag: str | None = None, base: str = "auto", log=_log_default) -> dict:
    """Build the worker image if the engine lacks it; return image_info()."""
    tag = tag or drt.worker_tag()
    info = image_info(tag)
    if info is None:
        build_worker(tag, base=base, log=log)
        info = image_info(tag)
    return info


def build_worker(tag: str | None = None, base: str = "auto", *, no_cache: bool = False,
                 rebuild_base: bool = False, torch_index: str | None = None, log=_log_default) -> dict:
    """Build (or refresh) the worker image. Returns image_info() plus `timings_s` per stage."""
    tag = tag or drt.worker_tag()
    root = project_root()
    c = drt.client(timeout=1800)
    timings: dict[str, float] = {}
    t = time.monotonic()
    base_ref, path = resolve_base(c, base, rebuild_base=rebuild_base, log=log)
    timings["base"] = time.monotonic() - t
    base_id = c.images.get(base_ref).id

    t = time.monotonic()
    pins = pinned_requirements()
    wheels = download_wheels(pins, torch_index=torch_index or os.environ.get("TORCH_INDEX") or None, log=log)
    timings["wheels"] = time.monotonic() - t

    t = time.monotonic()
    deps_tag = build_deps(c, root, base_ref, base_id, pins, wheels, no_cache=no_cache, log=log)
    timings["deps"] = time.monotonic() - t

    t = time.monotonic()
    old = image_info(tag)
    with tempfile.TemporaryDirectory(prefix="testbed-ctx-") as ctx:
        ctx = Path(ctx)
        shutil.copy2(root / "containers" / "worker" / "Dockerfile", ctx / "Dockerfile")
        shutil.copy2(root / "containers" / "worker" / ".dockerignore", ctx / ".dockerignore")
        shutil.copytree(root / "testbed", ctx / "testbed",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo"))
        labels = {LABEL: "worker", "testbed.version": __version__, "testbed.base": base_ref,
                  "testbed.base.path": path, "testbed.deps": deps_tag}
        _build(c, ctx, "Dockerfile", tag, {"DEPS": deps_tag, "TESTBED_VERSION": __version__}, labels,
               no_cache=no_cache, log=log)
    timings["worker"] = time.monotonic() - t
    info = image_info(tag) or {}
    if old and old["id"] != info.get("id"):
        _drop_replaced(c, old["id"], log)
    info["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    log(f"{tag} {info.get('id', '?')[:19]} built on {base_ref} ({path}); "
        + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    return info


def _build(c, ctx: Path, dockerfile: str, tag: str, buildargs: dict, labels: dict, *, no_cache: bool, log) -> str:
    import docker

    lines: list[str] = []
    try:
        stream = c.api.build(path=str(ctx), dockerfile=dockerfile, tag=tag, buildargs=buildargs, labels=labels,
                             network_mode="host", rm=True, forcerm=True, pull=False, nocache=no_cache,
                             decode=True)
        for chunk in stream:
            if "error" in chunk:
                tail = "".join(lines[-25:])
                raise ImageBuildError(f"building {tag} failed: {chunk['error'].strip()}\n{tail}")
            s = chunk.get("stream")
            if s:
                lines.append(s)
                if s.strip() and (s.startswith("Step ") or os.environ.get("TESTBED_BUILD_VERBOSE")):
                    log(s.strip())
    except docker.errors.APIError as e:
        raise ImageBuildError(f"building {tag} failed: {e.explanation or e}") from None
    return tag


def _drop_replaced(c, image_id: str, log) -> None:
    """The worker image this build replaced is now untagged: remove it unless a container still uses it
    (only images this command made: they carry testbed.image=worker)."""
    import docker
    try:
        img = c.images.get(image_id)
        if img.labels.get(LABEL) == "worker" and not img.tags:
            c.images.remove(image_id, noprune=False)
    except docker.errors.APIError:
        pass  # in use by a container (it goes when that container does: `docker image prune`)


# -- base image ----------------------------------------------------------------------------------------------------


def resolve_base(c, base: str = "auto", *, rebuild_base: bool = False, log=_log_default) -> tuple[str, str]:
    """(image reference, 'registry' | 'debootstrap'). auto: a local python:3.11-slim, else an existing
    debootstrap base, else a pull from the registry, else a new debootstrap base."""
    if base not in ("auto", "registry", "debootstrap"):
        raise ValueError(f"--base must be auto, registry or debootstrap, not {base!r}")
    if base == "registry" or (base == "auto" and drt.image_present(c, BASE_REGISTRY)):
        if not drt.image_present(c, BASE_REGISTRY):
            _pull(c, BASE_REGISTRY, log)
        return BASE_REGISTRY, "registry"
    if base == "debootstrap" or drt.image_present(c, BASE_DEBOOTSTRAP):
        if rebuild_base or not drt.image_present(c, BASE_DEBOOTSTRAP):
            build_debootstrap_base(c, log=log)
        return BASE_DEBOOTSTRAP, "debootstrap"
    try:
        _pull(c, BASE_REGISTRY, log)
        return BASE_REGISTRY, "registry"
    except ImageBuildError as e:
        log(f"{e}; making a base image with debootstrap instead")
    build_debootstrap_base(c, log=log)
    return BASE_DEBOOTSTRAP, "debootstrap"


def _pull(c, ref: str, log) -> None:
    import docker

    repo, _, tag = ref.partition(":")
    log(f"pulling {ref}")
    try:
        drt.client(timeout=120).images.pull(repo, tag=tag or "latest")
    except docker.errors.DockerException as e:
        why = getattr(e, "explanation", None) or drt.short_error(e)
        raise ImageBuildError(f"cannot pull {ref}: {why}") from None


def build_debootstrap_base(c, log=_log_default) -> str:
    """A Debian bookworm minbase with python3 and the system tools, imported as BASE_DEBOOTSTRAP (~1 min)."""
    if not shutil.which("debootstrap"):
        raise ImageBuildError("no registry image and no debootstrap to make a base: apt-get install debootstrap "
                              "(or make python:3.11-slim reachable)")
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="base-", dir=CACHE_ROOT) as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"debootstrap --variant=minbase bookworm from {DEBIAN_MIRROR} (about a minute)")
        r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_INCLUDE)}",
                            "bookworm", str(rootfs), DEBIAN_MIRROR], capture_output=True, text=True)
        if r.returncode != 0:
            log_file = rootfs / "debootstrap" / "debootstrap.log"
            extra = log_file.read_text()[-2000:] if log_file.exists() else ""
            raise ImageBuildError(f"debootstrap failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}\n{extra}\n"
                                  f"Set TESTBED_DEBIAN_MIRROR to a reachable Debian mirror.")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."], check=True)
        changes = [f"LABEL {LABEL}=base", "LABEL testbed.base.suite=bookworm",
                   f"LABEL testbed.base.mirror={DEBIAN_MIRROR}",
                   f"LABEL testbed.base.created={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
                   "ENV LANG=C.UTF-8",
                   "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   'CMD ["/bin/bash"]']
        repo, _, tag = BASE_DEBOOTSTRAP.partition(":")
        c.api.import_image(src=str(tarball), repository=repo, tag=tag, changes=changes)
    log(f"{BASE_DEBOOTSTRAP} made in {time.monotonic() - t:.0f}s")
    return BASE_DEBOOTSTRAP


# -- Python dependencies ---------------------------------------------------------------------------------------------


def pinned_requirements() -> list[str]:
    """`name==version` for the testbed's runtime dependencies and everything they need, as installed in the
    environment running this (the one the project was tested with). CUDA-only packages are left out."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if sys.version_info[:2] != PYTHON_TARGET:
        raise ImageBuildError(f"run `testbed image build` with the project's Python {'.'.join(map(str, PYTHON_TARGET))} "
                              f"(this is {sys.version.split()[0]}): the image pins what that environment has")
    env = default_environment()
    pins: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in (metadata.distribution("testbed").requires or [])]
    while todo:
        req, ctx_extra = todo.pop()
        if req.marker and not req.marker.evaluate({**env, "extra": ctx_extra}):
            continue
        name = canonicalize_name(req.name)
        if name.startswith(CUDA_ONLY):
            continue
        extras = sorted(req.extras)
        if all((name, e) in seen for e in ["", *extras]):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise ImageBuildError(f"{req.name} (needed by the testbed) is not installed here: "
                                  "make python-deps first") from None
        version = dist.version
        if name == "torch" and "+" not in version:
            version += "+cpu"  # the CPU build, whatever this environment has
        pins[name] = f"{name}=={version}"
        for e in ["", *extras]:
            if (name, e) not in seen:
                seen.add((name, e))
                todo += [(Requirement(r), e) for r in dist.requires or []]
    return sorted(pins.values())


def download_wheels(pins: list[str], torch_index: str | None = None, log=_log_default) -> Path:
    """Every pinned wheel, fetched once with the host's pip (its index/find-links configuration applies) into
    a cache directory named after the pin list."""
    key = hashlib.sha256("\n".join(pins).encode()).hexdigest()[:16]
    d = CACHE_ROOT / "wheels" / key
    stamp = d / ".complete"
    if stamp.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    log(f"downloading {len(pins)} wheels with the host's pip into {d}")
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(d)]
    torch = [p for p in pins if p.startswith("torch==")]
    rest = [p for p in pins if not p.startswith("torch==")]
    if torch:
        extra = ["--extra-index-url", torch_index] if torch_index else []
        r = subprocess.run([*base, *extra, *torch], capture_output=True, text=True)
        if r.returncode != 0 and not torch_index:
            log(f"{torch[0]} not found through pip's configuration; trying {TORCH_CPU_INDEX}")
            r = subprocess.run([*base, "--extra-index-url", TORCH_CPU_INDEX, *torch], capture_output=True, text=True)
        if r.returncode != 0:
            raise ImageBuildError(f"pip download {torch[0]} failed: {_pip_error(r)}\nGive the CPU wheel index with "
                                  f"TORCH_INDEX={TORCH_CPU_INDEX} (or --torch-index).")
    if rest:
        r = subprocess.run([*base, *rest], capture_output=True, text=True)
        if r.returncode != 0:
            raise ImageBuildError(f"pip download failed: {_pip_error(r)}")
    (d / "requirements.txt").write_text("\n".join(pins) + "\n")
    stamp.touch()
    return d


def _pip_error(r: subprocess.CompletedProcess) -> str:
    lines = [l for l in (r.stderr or r.stdout).splitlines() if l.strip() and not l.startswith("WARNING: Location")]
    return "\n".join(lines[-8:])


def build_deps(c, root: Path, base_ref: str, base_id: str, pins: list[str], wheels: Path, *, no_cache: bool,
               log=_log_default) -> str:
    dockerfile = root / "containers" / "worker" / "deps.Dockerfile"
    key = hashlib.sha256(b"\0".join([base_id.encode(), dockerfile.read_bytes(), "\n".join(pins).encode()]))
    tag = f"{DEPS_REPO}:{key.hexdigest()[:16]}"
    if drt.image_present(c, tag) and not no_cache:
        log(f"dependency image {tag} is cached")
        return tag
    log(f"building the dependency image {tag} on {base_ref} ({len(pins)} packages; a few minutes)")
    with tempfile.TemporaryDirectory(prefix="testbed-deps-") as ctx, _serve(wheels) as url:
        ctx = Path(ctx)
        shutil.copy2(dockerfile, ctx / "Dockerfile")
        (ctx / "requirements.txt").write_text("\n".join(pins) + "\n")
        labels = {LABEL: "worker-deps", "testbed.base": base_ref, "testbed.deps.key": key.hexdigest()}
        _build(c, ctx, "Dockerfile", tag, {"BASE": base_ref, "WHEELS_URL": url}, labels, no_cache=no_cache, log=log)
    return tag


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


class _serve:
    """Serve a directory on 127.0.0.1 (ephemeral port) while a build runs with --network host."""

    def __init__(self, directory: Path):
        handler = functools.partial(_Quiet, directory=str(directory))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def describe(info: dict | None, tag: str) -> str:
    if info is None:
        return f"{tag}: not built (testbed image build)"
    labels = info.get("labels", {})
    return json.dumps({"tag": tag, "id": info["id"], "testbed.version": labels.get("testbed.version"),
                       "base": labels.get("testbed.base"), "path": labels.get("testbed.base.path"),
                       "created": info.get("created"), "size_mb": round((info.get("size_bytes") or 0) / 1e6)},
                      indent=2)
