"""Debian VMs under qemu, built and booted on this machine, as machines for `testbed up --machines`.

    image = build_image()                       # debootstrap, once; then reused from the cache
    with vms(2, image) as (m1, m2):             # m1 = 192.0.2.21, m2 = 192.0.2.22
        Path("machines.yaml").write_text(inventory_yaml([m1, m2]))
        ...                                      # testbed up TOPO --machines machines.yaml

The image (`build_image`) is made here from Debian packages alone (nothing else is downloaded): `debootstrap
--variant=minbase` of bookworm plus a kernel (linux-image-amd64), openssh-server, iproute2, iptables, kmod and
the tools the testbed runs, written into an ext4 disk image with `mkfs.ext4 -d` (no loop mount), with the
kernel and initrd beside it for a direct `-kernel/-initrd` boot. It is cached under
$TESTBED_CACHE/vm/<recipe> (default ~/.cache/testbed/vm/...), the recipe's hash naming it, so a second build
with the same recipe returns at once. The image holds no key: each boot gets its own host key and the
authorized key of its network (below), through a read-only 9p share of the VM's own directory.

Inside, a small init (/sbin/testbed-init, PID 1 behind tini) mounts /proc, /sys, /run, /tmp and
/var/lib/testbed (tmpfs), mounts the VM's shares, sets its address and starts sshd; no systemd. Its root disk
is booted with `snapshot=on`: writes go to a temporary overlay, the cached image is never changed, and several
VMs boot from it at once.

The testbed itself is not installed in the image: `testbed_shares()` (the project checkout, its venv and the
Python installation the venv was made from) are shared read-only with 9p at the same paths, so that the
controller's `.venv/bin/testbed` runs in the guest, at the controller's version.

Network (`VMNetwork`): everything lives in a network namespace of its own, `tbv<TAG>-ul`, holding a bridge
`br0` (192.0.2.1/24) and a tap per VM; qemu runs in that namespace (`nsenter --net`), the VMs get 192.0.2.21,
.22, ... on their `eth0`, and the controller reaches their sshd through a proxy command that relays the
connection from inside that namespace (the inventory's `proxy_command`), as tests/sshmachines.py does for its
namespace machines. The host's own interfaces, routes and firewall are never touched. The VMs' tunnels between
each other use the same `eth0`.

Acceleration (`accel()`): $TESTBED_VM_ACCEL = `kvm`, `tcg` or `auto` (default). `auto` uses KVM when /dev/kvm
opens and a probe boot under KVM reaches the kernel's panic for a missing root within a few seconds (nested
KVM may fail or hang at boot: then TCG, qemu's emulator), and retries a KVM boot that never gets ready once
under TCG; `kvm` uses KVM without probe or fallback.

Every VM's files (console log, qemu's overlay, its keys) are in a temporary directory removed on stop();
stop() always kills qemu; qemu started from the main thread is also killed when the process that started it
dies (PR_SET_PDEATHSIG), but its namespace is then left: `ip netns del tbv<TAG>-ul`.

Needs root, and on the host: debootstrap, e2fsprogs (mkfs.ext4 -d), qemu-system-x86 (with 9p, as Debian's
is), iproute2, util-linux (nsenter, unshare), openssh-client (ssh-keygen).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from testbed import nsutil, procs
from testbed.machines.inventory import Inventory, Machine, parse_inventory
from testbed.machines.remote import RELAY, known_hosts_line

# ----------------------------------------------------------------------------------------------------------
# The recipe.

RECIPE_VERSION = 1
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Installed by debootstrap (no daemons among them). The libraries are what the controller's Python (pyenv
# builds link the system's) and the wheels in its venv need from the system.
BASE_PACKAGES = (
    "iproute2", "iptables", "kmod", "procps", "iputils-ping", "ethtool", "tcpdump", "iperf3", "tini",
    "util-linux", "psmisc", "less",
    "libbz2-1.0", "libexpat1", "libffi8", "libgdbm6", "liblzma5", "libncursesw6", "libreadline8", "libsqlite3-0",
    "libssl3", "libstdc++6", "libgcc-s1", "libgomp1", "libtirpc3", "libuuid1", "zlib1g",
)
# Installed afterwards with apt in the chroot, with services kept from starting (policy-rc.d) and in a pid
# namespace of their own: openssh-server's sshd must never start on the host.
KERNEL_PACKAGES = ("linux-image-amd64", "zstd")
SERVER_PACKAGES = ("openssh-server",)

# What every sshd the testbed starts for itself allows (the VMs here, the test machines of tests/sshmachines.py):
# root by key only, no PAM, no DNS lookups, many sessions at once (one SSH connection carries a command's
# parallel channels).
SSHD_COMMON = """PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
MaxSessions 64
MaxStartups 64:30:128
LogLevel INFO
Subsystem sftp internal-sftp
"""

GUEST_SSHD_CONFIG = """# testbed VM: made by testbed/machines/vm.py (host key and authorized key come with each boot)
Port 22
AddressFamily inet
ListenAddress 0.0.0.0
HostKey /etc/ssh/ssh_host_ed25519_key
PidFile /run/sshd.pid
AuthorizedKeysFile /root/.ssh/authorized_keys
{common}SetEnv PYTHONDONTWRITEBYTECODE=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
""".replace("{common}", SSHD_COMMON)

# PID 1 of the guest (then tini, which reaps every orphan, with sshd under it). The VM's settings come from its
# configuration share (tag tbvmcfg): vm.env (NAME, ADDRESS, GATEWAY), shares (TAG PATH lines), keys.
GUEST_INIT = r"""#!/bin/sh
# PID 1 of a testbed VM (testbed/machines/vm.py): mounts, shared folders, address, then sshd under tini.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
say() { echo "testbed-init: $*"; }
fail() {
    say "FAILED: $*"; echo "TESTBED-VM-FAILED"
    echo 1 >/proc/sys/kernel/sysrq; echo o >/proc/sysrq-trigger; sleep 30
}
mnt() { mountpoint -q "$3" || mount -t "$1" -o "$2" "$1" "$3" || fail "mount $1 on $3"; }
mnt proc nosuid,nodev,noexec /proc
mnt sysfs nosuid,nodev,noexec /sys
mountpoint -q /dev || mount -t devtmpfs -o mode=0755 devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mnt devpts gid=5,mode=620,ptmxmode=666 /dev/pts
mountpoint -q /dev/shm || mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
mountpoint -q /run || mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mountpoint -q /tmp || mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mkdir -p /var/lib/testbed
mountpoint -q /var/lib/testbed || mount -t tmpfs -o mode=0755 tmpfs /var/lib/testbed
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup 2>/dev/null
mkdir -p /run/sshd /run/netns /run/testbed-vm/cfg
for m in virtio_net virtio_rng 9pnet_virtio 9p sch_netem; do modprobe -q $m || say "modprobe $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro tbvmcfg /run/testbed-vm/cfg || fail "mount the configuration share"
cfg=/run/testbed-vm/cfg
. $cfg/vm.env
while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "$path" 2>/dev/null
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 "$tag" "$path" \
        || fail "mount share $tag on $path"
done <$cfg/shares
hostname "$NAME"; echo "$NAME" >/etc/hostname
printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$NAME" >/etc/hosts
ip link set lo up
ip addr add "$ADDRESS" dev eth0 || fail "address $ADDRESS on eth0"
ip link set eth0 up
[ -z "$GATEWAY" ] || ip route add default via "$GATEWAY"
install -m 600 $cfg/ssh_host_ed25519_key /etc/ssh/ssh_host_ed25519_key
install -m 644 $cfg/ssh_host_ed25519_key.pub /etc/ssh/ssh_host_ed25519_key.pub
install -d -m 700 /root/.ssh
install -m 600 $cfg/authorized_keys /root/.ssh/authorized_keys
say "up: $NAME $ADDRESS, $(cut -d' ' -f1 /proc/uptime) s since boot"
echo "TESTBED-VM-READY $NAME"
exec tini -- /usr/sbin/sshd -D -e -f /etc/testbed/sshd_config
"""

# How the controller reaches a VM: the proxy command runs remote.RELAY inside the VMs' namespace.

NETNS_DIR = Path("/run/netns")
SUBNET_PREFIX = "192.0.2."
BRIDGE_ADDRESS = "192.0.2.1"
FIRST_HOST = 21          # m1 = 192.0.2.21
GUEST_IFACE = "eth0"
QEMU = "qemu-system-x86_64"
READY_MARK = "TESTBED-VM-READY"
FAILED_MARK = "TESTBED-VM-FAILED"
DEFAULT_MEM_MB = 2048
DEFAULT_CPUS = 1
BOOT_TIMEOUT_S = 180.0
KVM_PROBE_TIMEOUT_S = 8.0
_counter = itertools.count()
Log = Callable[[str], None]


def quiet(_msg: str) -> None:
    pass


def cache_root() -> Path:
    """Where images are kept: $TESTBED_CACHE/vm (default ~/.cache/testbed/vm)."""
    return Path(os.environ.get("TESTBED_CACHE", "~/.cache/testbed")).expanduser() / "vm"


def recipe(suite: str = SUITE, extra_packages: Sequence[str] = ()) -> dict:
    """What an image is made of; its hash names the image in the cache."""
    return {"version": RECIPE_VERSION, "suite": suite, "arch": "amd64", "variant": "minbase",
            "base": sorted(BASE_PACKAGES), "kernel": sorted(KERNEL_PACKAGES),
            "server": sorted(SERVER_PACKAGES + tuple(extra_packages)),
            "init": GUEST_INIT, "sshd_config": GUEST_SSHD_CONFIG}


def recipe_key(r: dict) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Image:
    """A built image: `disk` (raw ext4, the root file system), `kernel` and `initrd` for -kernel/-initrd."""

    dir: Path
    disk: Path
    kernel: Path
    initrd: Path
    key: str
    info: dict = field(default_factory=dict, compare=False)

    @classmethod
    def load(cls, d: Path) -> "Image":
        info = json.loads((d / "image.json").read_text())
        return cls(d, d / "disk.raw", d / "vmlinuz", d / "initrd.img", info["key"], info)


# ----------------------------------------------------------------------------------------------------------
# Building the image.


def build_image(cache: str | os.PathLike | None = None, *, suite: str = SUITE, mirror: str | None = None,
                extra_packages: Sequence[str] = (), rebuild: bool = False, log: Log = quiet) -> Image:
    """The image of the recipe, from `cache` (default cache_root()) or built there first (minutes: Debian's
    packages are downloaded from `mirror`, default $TESTBED_VM_MIRROR or deb.debian.org). Concurrent builds of
    one recipe wait for each other (a lock file); a failed build leaves nothing behind."""
    if os.geteuid() != 0:
        raise PermissionError("building a VM image needs root (debootstrap, chroot)")
    missing = [t for t in ("debootstrap", "mkfs.ext4", "unshare", "chroot") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"missing on this machine: {', '.join(missing)} (Debian: apt-get install debootstrap "
                           "e2fsprogs util-linux)")
    root = (Path(cache) if cache is not None else cache_root()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    r = recipe(suite, extra_packages)
    key = recipe_key(r)
    dest = root / f"{suite}-{key}"
    mirror = mirror or os.environ.get("TESTBED_VM_MIRROR") or DEFAULT_MIRROR
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild and dest.exists():
            shutil.rmtree(dest)
        if (dest / "image.json").exists():
            log(f"image {dest} (cached)")
            return Image.load(dest)
        for stale in root.glob(f".{key}.build-*"):  # of a build that was killed
            rm_tree(stale)
        work = root / f".{key}.build-{os.getpid()}"
        work.mkdir()
        t0 = time.monotonic()
        try:
            _build(work, r, key, suite, mirror, root / "debs", log)
            info = json.loads((work / "image.json").read_text())
            info["build_s"] = round(time.monotonic() - t0, 1)
            (work / "image.json").write_text(json.dumps(info, indent=1))
            os.rename(work, dest)
        finally:
            rm_tree(work)
        log(f"image {dest} built in {time.monotonic() - t0:.0f} s")
        return Image.load(dest)


def debootstrap_rootfs(rootfs: Path, suite: str, mirror: str, debs: Path, include: Sequence[str],
                       packages: Sequence[str], log: Log = quiet) -> None:
    """`debootstrap --variant=minbase` of `suite` into `rootfs` with `include`, then `packages` installed by apt
    in the chroot (services kept from starting), both in a mount and pid namespace of their own; downloaded
    packages kept in `debs` for the next build. The chroot's resolv.conf is this machine's (replace it)."""
    debs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
    env.pop("TMPDIR", None)
    t = time.monotonic()
    log(f"debootstrap {suite} (minbase) into {rootfs}")
    # In a mount namespace of its own (the proc and sys it mounts in the target vanish with it, whatever
    # happens) and a pid namespace (nothing it starts outlives it).
    check_run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                "debootstrap", "--variant=minbase", f"--include={','.join(include)}",
                f"--cache-dir={debs}", suite, str(rootfs), mirror], "debootstrap", env=env)
    log(f"debootstrap: {time.monotonic() - t:.0f} s")

    t = time.monotonic()
    resolv = rootfs / "etc/resolv.conf"  # apt in the chroot resolves the mirror as this machine does
    resolv.unlink(missing_ok=True)
    if Path("/etc/resolv.conf").exists():
        shutil.copy("/etc/resolv.conf", resolv)
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")  # no service starts in the chroot
    policy.chmod(0o755)
    archives = rootfs / "var/cache/apt/archives"
    # proc for the kernel's and initramfs-tools' scripts; the package cache bound in for the next build
    (debs / "partial").mkdir(exist_ok=True)
    script = (f"mount -t proc proc {rootfs}/proc && mount --bind {debs} {archives} && "
              f"chroot {rootfs} apt-get -q update && "
              f"chroot {rootfs} apt-get -q -y install --no-install-recommends -o Dpkg::Use-Pty=0 {' '.join(packages)}")
    check_run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                "sh", "-c", script], "apt-get install in the chroot", env=env)
    policy.unlink()
    log(f"packages: {time.monotonic() - t:.0f} s")


def rootfs_to_disk(rootfs: Path, work: Path, log: Log = quiet) -> tuple[str, int, int]:
    """Trim `rootfs` (apt lists and caches, docs), copy its kernel and initrd to work/vmlinuz and
    work/initrd.img, and write it into the ext4 image work/disk.raw (label testbed-root, room to spare).
    Returns (kernel release, MB used, MB of the disk)."""
    for d in ("var/lib/apt/lists", "var/cache/apt/archives", "usr/share/doc", "usr/share/man", "usr/share/info"):
        p = rootfs / d
        if p.is_dir() and not p.is_symlink():
            for c in p.iterdir():
                if c.is_dir() and not c.is_symlink():
                    shutil.rmtree(c)
                elif c.name != "lock":
                    c.unlink()

    kernels = sorted((rootfs / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise RuntimeError(f"expected one kernel in {rootfs}/boot, found {[k.name for k in kernels]}")
    release = kernels[0].name[len("vmlinuz-"):]
    initrd = rootfs / "boot" / f"initrd.img-{release}"
    if not initrd.exists():
        raise RuntimeError(f"no initrd for kernel {release} in {rootfs}/boot")
    shutil.copy2(kernels[0], work / "vmlinuz")
    shutil.copy2(initrd, work / "initrd.img")

    t = time.monotonic()
    used = int(subprocess.run(["du", "-sxm", str(rootfs)], capture_output=True, text=True, check=True)
               .stdout.split()[0])
    size_mb = used + max(512, used // 2)  # free space for what the VMs write (into their snapshot overlay)
    check_run(["mkfs.ext4", "-q", "-F", "-L", "testbed-root", "-d", str(rootfs), "-E", "root_owner=0:0",
                str(work / "disk.raw"), f"{size_mb}M"], "mkfs.ext4")
    log(f"disk image ({used} MB used of {size_mb} MB): {time.monotonic() - t:.0f} s")
    return release, used, size_mb


def _build(work: Path, r: dict, key: str, suite: str, mirror: str, debs: Path, log: Log) -> None:
    rootfs = work / "rootfs"
    debootstrap_rootfs(rootfs, suite, mirror, debs, BASE_PACKAGES, [*KERNEL_PACKAGES, *r["server"]], log)

    # configuration
    (rootfs / "sbin/testbed-init").write_text(GUEST_INIT)
    (rootfs / "sbin/testbed-init").chmod(0o755)
    (rootfs / "etc/testbed").mkdir(exist_ok=True)
    (rootfs / "etc/testbed/sshd_config").write_text(GUEST_SSHD_CONFIG)
    for k in (rootfs / "etc/ssh").glob("ssh_host_*"):
        k.unlink()  # each boot brings its own
    (rootfs / "etc/hostname").write_text("testbed-vm\n")
    (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
    (rootfs / "etc/resolv.conf").write_text("")  # the VMs have no DNS server
    release, used, size_mb = rootfs_to_disk(rootfs, work, log)
    versions = subprocess.run(["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Package} ${Version}\n"],
                              capture_output=True, text=True).stdout
    (work / "packages.txt").write_text(versions)
    rm_tree(rootfs)
    (work / "image.json").write_text(json.dumps({"key": key, "suite": suite, "kernel_release": release,
                                                 "mirror": mirror, "recipe": r, "rootfs_mb": used,
                                                 "disk_mb": size_mb, "built_at": time.time()}, indent=1))


def check_run(argv: list[str], what: str, **kw) -> None:
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        out = (r.stdout + r.stderr).strip()
        raise RuntimeError(f"{what} failed (exit status {r.returncode}): ...{out[-3000:]}")


def _mounts_under(path: Path) -> list[str]:
    p = str(path.resolve()) if path.exists() else str(path)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == p or mp.startswith(p + "/"):
                out.append(mp)
    return out


def rm_tree(path: Path) -> None:
    """rm -rf, but never through a mount point (a bound /dev or /proc in a rootfs would be emptied)."""
    if not path.exists():
        return
    mounted = _mounts_under(path)
    if mounted:
        raise RuntimeError(f"not removing {path}: file systems are mounted under it: {mounted}")
    shutil.rmtree(path)


# ----------------------------------------------------------------------------------------------------------
# Acceleration.

_accel_lock = threading.Lock()
_accel_choice: str | None = None


def accel(image: Image | None = None, log: Log = quiet) -> str:
    """`kvm` or `tcg`: $TESTBED_VM_ACCEL when it is `kvm` or `tcg`; else (`auto`) KVM if a probe boot works
    (decided once per process)."""
    global _accel_choice
    want = os.environ.get("TESTBED_VM_ACCEL", "auto").strip().lower() or "auto"
    if want in ("kvm", "tcg"):
        return want
    if want != "auto":
        raise ValueError(f"TESTBED_VM_ACCEL={want!r}: want kvm, tcg or auto")
    with _accel_lock:
        if _accel_choice is None:
            _accel_choice = "kvm" if kvm_works(image, log) else "tcg"
            log(f"acceleration: {_accel_choice}")
        return _accel_choice


def _forget_kvm() -> None:
    global _accel_choice
    with _accel_lock:
        _accel_choice = "tcg"


def kvm_works(image: Image | None = None, log: Log = quiet, timeout: float = KVM_PROBE_TIMEOUT_S) -> bool:
    """Whether a KVM guest boots here: /dev/kvm opens, and the image's kernel (without initrd or root: it
    panics at once) gets to its panic under KVM within `timeout` seconds."""
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
    except OSError as e:
        log(f"no KVM: /dev/kvm: {e.strerror}")
        return False
    if image is None:
        return True  # nothing to probe with: take KVM's word
    with tempfile.TemporaryDirectory(prefix="tbv-kvmprobe-") as d:
        console = Path(d) / "console.log"
        argv = [QEMU, "-accel", "kvm", "-cpu", "host", "-m", "256", "-smp", "1", "-nodefaults", "-no-user-config",
                "-display", "none", "-no-reboot", "-serial", f"file:{console}", "-kernel", str(image.kernel),
                "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent rdinit=/nonexistent"]
        t = time.monotonic()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        text = console.read_text(errors="replace") if console.exists() else ""
        err = p.stderr.read().decode(errors="replace").strip() if p.stderr else ""
        if p.stderr:
            p.stderr.close()
        ok = "Kernel panic" in text
        took = time.monotonic() - t
        if ok:
            log(f"KVM probe: the kernel booted under KVM ({took:.1f} s)")
        elif p.returncode is not None and p.returncode != -signal.SIGKILL:
            log(f"KVM probe: qemu failed under KVM in {took:.1f} s: {err.splitlines()[-1] if err else p.returncode}")
        else:
            log(f"KVM probe: no kernel output under KVM after {took:.1f} s (hangs)")
        return ok


# ----------------------------------------------------------------------------------------------------------
# The network.


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


class VMNetwork:
    """The VMs' network: namespace `tbv<TAG>-ul` with bridge br0 (192.0.2.1/24) and a tap per VM, a client
    key for the VMs' root, a known_hosts file with every VM's host key (the inventory's `known_hosts:`), and
    the relay the proxy command runs. `close()` kills every process in the
    namespace (qemu included), deletes it and the directory."""

    def __init__(self, tag: str | None = None):
        self.tag = tag if tag is not None else f"{os.getpid():x}-{next(_counter)}"
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,11}", self.tag):
            raise ValueError(f"tag {self.tag!r}: 1-12 characters of a-z, 0-9, '-'")
        self.netns = f"tbv{self.tag}-ul"
        self.dir: Path | None = None
        self.key: Path | None = None
        self.known_hosts: Path | None = None
        self._taps = 0
        self._lock = threading.Lock()

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    @property
    def proxy_command(self) -> str:
        return f"nsenter --net={self.netns_path} -- {sys.executable} -I -S {self.dir / 'relay.py'} %h %p"

    def open(self) -> "VMNetwork":
        if (NETNS_DIR / self.netns).exists():
            raise RuntimeError(f"namespace {self.netns} exists already")
        self.dir = Path(tempfile.mkdtemp(prefix=f"tbv{self.tag}-"))
        try:
            self.key = self.dir / "client_key"
            _keygen(self.key, "testbed-vm-client")
            self.known_hosts = self.dir / "known_hosts"
            self.known_hosts.write_text("")
            (self.dir / "relay.py").write_text(RELAY)
            _ip("netns", "add", self.netns)
            self.exec("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
            _ip("-n", self.netns, "link", "set", "lo", "up")
            _ip("-n", self.netns, "link", "add", "br0", "type", "bridge")
            self.exec("sysctl", "-qw", "net.ipv4.neigh.br0.retrans_time_ms=300")
            _ip("-n", self.netns, "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", "br0")
            _ip("-n", self.netns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec(self, *argv: str) -> str:
        r = subprocess.run(["nsenter", f"--net={self.netns_path}", "--", *argv], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {self.netns}: {r.stderr.strip()}")
        return r.stdout

    def add_host_key(self, address: str, pubkey: Path) -> None:
        """List a VM's host key in the network's known_hosts file."""
        with self._lock:
            with open(self.known_hosts, "a") as f:
                f.write(known_hosts_line(address, 22, pubkey))

    def add_tap(self) -> str:
        with self._lock:
            self._taps += 1
            tap = f"tap{self._taps}"
        _ip("-n", self.netns, "tuntap", "add", "dev", tap, "mode", "tap")
        _ip("-n", self.netns, "link", "set", tap, "master", "br0", "up")
        return tap

    def close(self) -> list[str]:
        """Remove everything; the problems (empty when all went)."""
        problems = []
        if (NETNS_DIR / self.netns).exists():
            try:
                nsutil.kill_processes_in_netns(self.netns_path, grace_s=3.0)
            except Exception as e:  # noqa: BLE001 - keep cleaning
                problems.append(f"killing processes in {self.netns}: {e}")
            r = subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"ip netns del {self.netns}: {r.stderr.strip()}")
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        return problems

    def __enter__(self) -> "VMNetwork":
        return self.open()

    def __exit__(self, *exc) -> None:
        problems = self.close()
        if problems and exc[0] is None:
            raise RuntimeError("VM network cleanup: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------
# Booting.


def testbed_shares() -> list[str]:
    """Host directories a guest needs, read-only at the same paths, to run this controller's testbed: the
    checkout of the package (an editable install), the venv, and the Python installation the venv was made
    from; nested ones left out."""
    import testbed

    dirs = [Path(testbed.__file__).resolve().parent.parent, Path(sys.prefix).resolve(),
            Path(sys.base_prefix).resolve()]
    out: list[Path] = []
    for d in sorted(set(dirs), key=lambda p: len(p.parts)):
        if not any(d == o or o in d.parents for o in out):
            out.append(d)
    return [str(d) for d in out]


def guest_testbed() -> str:
    """The testbed command a guest with testbed_shares() runs: this venv's script, at the same path."""
    return str(Path(sys.prefix) / "bin" / "testbed")


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort
        pass


class VM:
    """One booted (or booting) VM. `address` is its eth0 address, `dir` its temporary directory."""

    def __init__(self, image: Image, name: str, network: VMNetwork, address: str, mem_mb: int, cpus: int,
                 shares: Sequence[str], accel_mode: str):
        self.image, self.name, self.network, self.address = image, name, network, address
        self.mem_mb, self.cpus, self.shares, self.accel = mem_mb, cpus, list(shares), accel_mode
        self.dir = Path(tempfile.mkdtemp(prefix=f"tbv{network.tag}-{name}-"))
        self.console_log = self.dir / "console.log"
        self.proc: subprocess.Popen | None = None
        self.tap: str | None = None
        self.started_at = 0.0
        self.boot_s: float | None = None

    def __repr__(self) -> str:
        return f"VM({self.name}, {self.address}, {self.accel})"

    # -- life --------------------------------------------------------------------------------------------

    def _config(self) -> Path:
        cfg = self.dir / "cfg"
        cfg.mkdir(exist_ok=True)
        (cfg / "vm.env").write_text(f"NAME={self.name}\nADDRESS={self.address}/24\nGATEWAY=\n")
        (cfg / "shares").write_text("".join(f"s{i} {p}\n" for i, p in enumerate(self.shares)))
        if not (cfg / "ssh_host_ed25519_key").exists():
            _keygen(cfg / "ssh_host_ed25519_key", f"testbed-vm-{self.name}")
            self.network.add_host_key(self.address, cfg / "ssh_host_ed25519_key.pub")
        shutil.copy(f"{self.network.key}.pub", cfg / "authorized_keys")
        return cfg

    def argv(self) -> list[str]:
        cfg = self._config()
        mac = "52:54:00:7b:%02x:%02x" % (int(self.address.rsplit(".", 1)[1]) // 256,
                                          int(self.address.rsplit(".", 1)[1]) % 256)
        kvm = self.accel == "kvm"
        argv = [QEMU, "-name", f"tbv{self.network.tag}-{self.name}", "-accel", self.accel,
                "-cpu", "host" if kvm else "max", "-m", str(self.mem_mb), "-smp", str(self.cpus),
                "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
                "-serial", f"file:{self.console_log}",
                "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd),
                "-append", "root=/dev/vda rw console=ttyS0 init=/sbin/testbed-init net.ifnames=0 panic=-1 "
                           "fsck.mode=skip mitigations=off random.trust_cpu=on loglevel=4",
                "-drive", f"file={self.image.disk},format=raw,if=virtio,snapshot=on,cache=unsafe",
                "-netdev", f"tap,id=n0,ifname={self.tap},script=no,downscript=no",
                "-device", f"virtio-net-pci,netdev=n0,mac={mac}",
                "-device", "virtio-rng-pci",
                "-virtfs", f"local,path={cfg},mount_tag=tbvmcfg,security_model=none,readonly=on"]
        for i, path in enumerate(self.shares):
            argv += ["-virtfs", f"local,path={path},mount_tag=s{i},security_model=none,readonly=on"]
        return argv

    def start(self) -> "VM":
        """Start qemu (in the network's namespace); returns at once (wait_ready waits for sshd)."""
        if self.tap is None:
            self.tap = self.network.add_tap()
        self.console_log.write_bytes(b"")
        log = open(self.dir / "qemu.log", "ab")
        # PR_SET_PDEATHSIG fires when the *thread* that forked ends: only for qemu started by the main thread
        main = threading.current_thread() is threading.main_thread()
        try:
            self.started_at = time.monotonic()
            # TMPDIR: where snapshot=on puts the overlay (removed with the directory)
            self.proc = subprocess.Popen(["nsenter", f"--net={self.network.netns_path}", "--", *self.argv()],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env={**os.environ, "TMPDIR": str(self.dir)}, start_new_session=True,
                                         preexec_fn=_die_with_parent if main else None)
        finally:
            log.close()
        return self

    def console(self) -> str:
        try:
            return self.console_log.read_text(errors="replace")
        except OSError:
            return ""

    def qemu_log(self) -> str:
        try:
            return (self.dir / "qemu.log").read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = BOOT_TIMEOUT_S) -> float:
        """Wait until its init says ready and its sshd answers; the seconds since start. RuntimeError (with
        the console's tail) when qemu exits or the time is up."""
        deadline = self.started_at + timeout
        while True:
            text = self.console()
            if READY_MARK in text:
                break
            if FAILED_MARK in text or self.proc.poll() is not None:
                how = f"qemu exited: {self.proc.returncode}" if self.proc.poll() is not None else "its init failed"
                raise RuntimeError(f"VM {self.name} did not boot ({how}):\n{self.qemu_log()[-1000:]}\n"
                                   f"...{text[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"VM {self.name} ({self.accel}) not ready after {timeout:g} s:\n...{text[-3000:]}")
            time.sleep(0.1)
        while True:  # sshd's banner, through the proxy
            if self._banner():
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"VM {self.name}: sshd does not answer on {self.address}:22:\n"
                                   f"...{self.console()[-2000:]}")
            time.sleep(0.2)
        self.boot_s = time.monotonic() - self.started_at
        return self.boot_s

    def _banner(self) -> bool:
        r = subprocess.run(["nsenter", f"--net={self.network.netns_path}", "--", sys.executable, "-I", "-S", "-c",
                            "import socket,sys; s=socket.create_connection((sys.argv[1],22),2); s.settimeout(5); "
                            "sys.exit(0 if s.recv(64).startswith(b'SSH-') else 1)", self.address],
                           capture_output=True, timeout=20)
        return r.returncode == 0

    def stop(self) -> None:
        """Kill qemu (TERM, then KILL), remove its tap and directory. Safe to call twice."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if self.tap is not None and (NETNS_DIR / self.network.netns).exists():
            subprocess.run(["ip", "-n", self.network.netns, "link", "del", self.tap], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- reaching it -------------------------------------------------------------------------------------

    def machine(self, testbed_cmd: str | None = None) -> Machine:
        """This VM as an inventory entry."""
        return Machine(name=self.name, address=self.address, user="root", port=22, key=str(self.network.key),
                       testbed=testbed_cmd or guest_testbed(), underlay_iface=GUEST_IFACE,
                       proxy_command=self.network.proxy_command, known_hosts=str(self.network.known_hosts))

    def ssh(self, timeout: float = 10.0):
        """A testbed.machines.remote.Remote connected to it (a context manager)."""
        from testbed.machines.remote import Remote

        return Remote.connect(self.machine(), timeout=timeout)


def boot(image: Image, name: str, network: VMNetwork, address: str | None = None, mem_mb: int = DEFAULT_MEM_MB,
         cpus: int = DEFAULT_CPUS, shares: Sequence[str] | None = None, accel_mode: str | None = None,
         wait: bool = True, timeout: float = BOOT_TIMEOUT_S, log: Log = quiet) -> VM:
    """Boot one VM on `network` (address default: the next free 192.0.2.(21+i)); with `wait`, until its sshd
    answers. `shares`: host directories shared read-only at the same paths (default testbed_shares()). A KVM
    boot that is not ready in time is retried once under TCG (and TCG is used from then on)."""
    if address is None:
        address = f"{SUBNET_PREFIX}{FIRST_HOST + network._taps}"
    vm = VM(image, name, network, address, mem_mb, cpus, testbed_shares() if shares is None else shares,
            accel_mode or accel(image, log))
    try:
        vm.start()
        if wait:
            _wait(vm, timeout, log)
    except BaseException:
        vm.stop()
        raise
    return vm


def _wait(vm: VM, timeout: float, log: Log) -> None:
    try:
        s = vm.wait_ready(timeout if vm.accel == "tcg" else min(timeout, 60.0))
    except (TimeoutError, RuntimeError):
        if vm.accel != "kvm" or os.environ.get("TESTBED_VM_ACCEL", "auto").strip().lower() == "kvm":
            raise  # TCG failed, or KVM was asked for
        log(f"{vm.name}: no boot under KVM; retrying under TCG")
        _forget_kvm()
        if vm.proc is not None and vm.proc.poll() is None:
            vm.proc.kill()
            vm.proc.wait()
        vm.accel = "tcg"
        vm.start()
        s = vm.wait_ready(timeout)
    log(f"{vm.name} ({vm.address}, {vm.accel}) ready in {s:.1f} s")


@contextmanager
def vms(n: int, image: Image | None = None, *, mem_mb: int = DEFAULT_MEM_MB, cpus: int = DEFAULT_CPUS,
        shares: Sequence[str] | None = None, tag: str | None = None, timeout: float = BOOT_TIMEOUT_S,
        log: Log = quiet) -> Iterator[list[VM]]:
    """`n` VMs `m1` ... `mN` on one new VMNetwork, booted together; on exit (even on failure) every qemu is
    killed, the namespace deleted and every directory removed (RuntimeError if something could not be)."""
    if not 1 <= n <= 200:
        raise ValueError(f"n={n}: between 1 and 200 VMs")
    image = image or build_image(log=log)
    mode = accel(image, log)
    net = VMNetwork(tag).open()
    machines: list[VM] = []
    try:
        for i in range(1, n + 1):
            machines.append(boot(image, f"m{i}", net, mem_mb=mem_mb, cpus=cpus, shares=shares, accel_mode=mode,
                                 wait=False, log=log))
        errors = []
        threads = [threading.Thread(target=lambda v=v: _collect(errors, _wait, v, timeout, log)) for v in machines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    except BaseException:
        _teardown(machines, net)
        raise
    try:
        yield machines
    except BaseException:
        _teardown(machines, net)
        raise
    problems = _teardown(machines, net)
    if problems:
        raise RuntimeError("VM cleanup: " + "; ".join(problems))


def _teardown(machines: list[VM], net: VMNetwork) -> list[str]:
    """Stop every VM, remove the network; the problems."""
    problems = []
    for v in machines:
        try:
            v.stop()
        except Exception as e:  # noqa: BLE001 - keep cleaning
            problems.append(f"stopping {v.name}: {e}")
    problems += net.close()
    left = qemu_processes(net.tag)
    if left:
        problems.append(f"qemu processes left: {left}")
    return problems


def _collect(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - raised by the caller
        errors.append(e)


def qemu_processes(tag: str | None = None) -> list[int]:
    """The pids of qemu processes of the VMs of `tag` (every tag's when None) on this machine."""
    out = []
    for pid in procs.pids():
        argv = procs.cmdline(pid) or []
        if argv and Path(argv[0]).name == QEMU and "-name" in argv:
            name = argv[argv.index("-name") + 1] if argv.index("-name") + 1 < len(argv) else ""
            if name.startswith(f"tbv{tag}-" if tag else "tbv"):
                out.append(pid)
    return out


def inventory_yaml(machines: Sequence[VM], testbed_cmd: str | None = None) -> str:
    """A machines file for the VMs."""
    return Inventory({v.name: v.machine(testbed_cmd) for v in machines}).to_yaml()


def inventory(machines: Sequence[VM], testbed_cmd: str | None = None) -> Inventory:
    return parse_inventory(inventory_yaml(machines, testbed_cmd), "<vms>")
