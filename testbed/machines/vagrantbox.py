"""A Vagrant box for the libvirt provider, built here from Debian packages alone (no box can be downloaded on the
project's build machines), and the libvirt daemons Vagrant drives, run inside a network namespace of their own.

    box = build_box(log=print)                 # debootstrap once (minutes); then from the cache
    with libvirt_netns(log=print) as lv:       # libvirtd + virtlogd in namespace tblv-<pid>
        lv.vagrant(["box", "add", "--force", "--name", BOX_NAME, str(box.file)])
        lv.vagrant(["up", "--provider", "libvirt"])

**The box** (`build_box`) is made with the image code of testbed/machines/vm.py (`debootstrap_rootfs`,
`rootfs_to_disk`) but is an ordinary Debian 12 system, as Vagrant expects of a box: systemd, ifupdown with a
DHCP client (eth0 gets the provider's management address; Vagrant writes the private networks into
/etc/network/interfaces), openssh-server (host keys made at first boot), sudo, rsync (the synced folder),
dbus (hostnamectl), Debian's kernel (its `sch_netem`, `vxlan` and `9p` modules), a `vagrant` user with
Vagrant's insecure public key and passwordless sudo. Its disk is the ext4 file system itself (no partition
table, no boot loader): the box's own Vagrantfile boots it with libvirt's direct kernel boot
(`libvirt.kernel`/`initrd`/`cmd_line`, files that come with the box). The box file (an uncompressed tar:
metadata.json, Vagrantfile, box.img as qcow2, vmlinuz, initrd.img) is cached under
$TESTBED_CACHE/vagrant/bookworm-<recipe hash>/ and registered as BOX_NAME with `vagrant box add`.

**libvirt** (`libvirt_netns`): libvirtd and virtlogd are started (`-d`) inside a network namespace of the
testbed's own, so the networks Vagrant has libvirt create (bridges, dnsmasq, NAT rules) exist there only,
never among the host's interfaces, routes or firewall rules. Vagrant itself runs in that namespace too
(`LibvirtNetns.vagrant`): its SSH reaches the VMs' management addresses there. On exit every domain and network
left is destroyed, the daemons are stopped, and the namespace deleted.

Needs root, and on the host: everything vm.py needs, plus qemu-utils (qemu-img), libvirt-daemon-system,
libvirt-daemon-driver-qemu, libvirt-clients, dnsmasq-base, vagrant and vagrant-libvirt (`make vagrant-deps`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tarfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from testbed.machines import vm

BOX_NAME = "testbed/bookworm-local"
BOX_VERSION = 1
# debootstrap's --include (on top of minbase): what a Vagrant box needs, and what vm.py's image has.
BOX_INCLUDE = vm.BASE_PACKAGES + (
    "systemd", "systemd-sysv", "udev", "dbus", "ifupdown", "isc-dhcp-client", "sudo", "rsync", "netbase",
    "ca-certificates", "make", "python3", "bash-completion",
)
BOX_PACKAGES = ("linux-image-amd64", "zstd", "openssh-server")
KERNEL_CMDLINE = "root=/dev/vda rw console=ttyS0 net.ifnames=0 mitigations=off random.trust_cpu=on"
INSECURE_KEY_PATHS = (
    "/usr/share/rubygems-integration/all/gems/vagrant-{v}/keys/vagrant.pub",
    "/usr/share/vagrant/keys/vagrant.pub",
    "/opt/vagrant/embedded/gems/gems/vagrant-{v}/keys/vagrant.pub",
)

INTERFACES = """# made by testbed/machines/vagrantbox.py; Vagrant appends its private networks below
source /etc/network/interfaces.d/*

auto lo
iface lo inet loopback

auto eth0
iface eth0 inet dhcp
"""

# Debian's ssh.service checks its config (sshd -t) before anything else: make the host keys first.
SSH_KEYGEN_DROPIN = """[Service]
ExecStartPre=
ExecStartPre=/usr/bin/ssh-keygen -A
ExecStartPre=/usr/sbin/sshd -t
"""

BOX_VAGRANTFILE = """# The box's own Vagrantfile (testbed/machines/vagrantbox.py): its disk is a bare ext4 file system, booted
# with libvirt's direct kernel boot from the kernel and initrd that come with the box.
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |lv|
    lv.kernel = File.join(File.dirname(__FILE__), "vmlinuz")
    lv.initrd = File.join(File.dirname(__FILE__), "initrd.img")
    lv.cmd_line = "{cmdline}"
    lv.disk_bus = "virtio"
  end
end
""".replace("{cmdline}", KERNEL_CMDLINE)


def box_recipe() -> dict:
    return {"version": BOX_VERSION, "suite": vm.SUITE, "include": sorted(BOX_INCLUDE),
            "packages": sorted(BOX_PACKAGES), "interfaces": INTERFACES, "ssh": SSH_KEYGEN_DROPIN,
            "vagrantfile": BOX_VAGRANTFILE}


def box_cache_root() -> Path:
    return vm.cache_root().parent / "vagrant"


@dataclass(frozen=True)
class Box:
    dir: Path
    file: Path
    info: dict


def insecure_public_key() -> str:
    """Vagrant's insecure public key, from the installed vagrant."""
    version = ""
    try:
        out = subprocess.run(["vagrant", "--version"], capture_output=True, text=True, timeout=60).stdout
        version = out.split()[-1] if out.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        pass
    for p in INSECURE_KEY_PATHS:
        path = Path(p.format(v=version))
        if path.exists():
            return path.read_text()
    raise RuntimeError("Vagrant's insecure public key (keys/vagrant.pub of the vagrant gem) is not found: "
                       "install vagrant (apt-get install vagrant)")


def build_box(cache: str | os.PathLike | None = None, *, mirror: str | None = None, rebuild: bool = False,
              log: vm.Log = vm.quiet) -> Box:
    """The box of the recipe, from the cache or built there first; concurrent builds wait for each other."""
    if os.geteuid() != 0:
        raise PermissionError("building a box needs root (debootstrap, chroot)")
    missing = [t for t in ("debootstrap", "mkfs.ext4", "qemu-img", "unshare", "chroot") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"missing on this machine: {', '.join(missing)} (make vagrant-deps)")
    key_text = insecure_public_key()
    root = (Path(cache) if cache is not None else box_cache_root()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    r = box_recipe()
    key = vm.recipe_key(r)
    dest = root / f"{vm.SUITE}-{key}"
    mirror = mirror or os.environ.get("TESTBED_VM_MIRROR") or vm.DEFAULT_MIRROR
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild and dest.exists():
            shutil.rmtree(dest)
        if (dest / "box.json").exists():
            log(f"box {dest} (cached)")
            return Box(dest, dest / "testbed-bookworm.box", json.loads((dest / "box.json").read_text()))
        for stale in root.glob(f".{key}.build-*"):
            vm.rm_tree(stale)
        work = root / f".{key}.build-{os.getpid()}"
        work.mkdir()
        t0 = time.monotonic()
        try:
            info = _build_box(work, r, key, mirror, key_text, vm.cache_root() / "debs", log)
            info["build_s"] = round(time.monotonic() - t0, 1)
            (work / "box.json").write_text(json.dumps(info, indent=1))
            os.rename(work, dest)
        finally:
            vm.rm_tree(work)
        log(f"box {dest} built in {time.monotonic() - t0:.0f} s")
        return Box(dest, dest / "testbed-bookworm.box", info)


def _chroot(rootfs: Path, *argv: str) -> None:
    vm.check_run(["chroot", str(rootfs), *argv], f"{' '.join(argv)} in the chroot")


def _build_box(work: Path, r: dict, key: str, mirror: str, key_text: str, debs: Path, log: vm.Log) -> dict:
    rootfs = work / "rootfs"
    vm.debootstrap_rootfs(rootfs, vm.SUITE, mirror, debs, BOX_INCLUDE, BOX_PACKAGES, log)
    # the vagrant user: the insecure key (Vagrant replaces it at the first `up`), passwordless sudo
    _chroot(rootfs, "useradd", "-m", "-s", "/bin/bash", "-u", "1000", "-U", "vagrant")
    _chroot(rootfs, "sh", "-c", "echo vagrant:vagrant | chpasswd")
    ssh_dir = rootfs / "home/vagrant/.ssh"
    ssh_dir.mkdir(mode=0o700)
    (ssh_dir / "authorized_keys").write_text(key_text)
    (ssh_dir / "authorized_keys").chmod(0o600)
    _chroot(rootfs, "chown", "-R", "vagrant:vagrant", "/home/vagrant/.ssh")
    sudoers = rootfs / "etc/sudoers.d/vagrant"
    sudoers.write_text("vagrant ALL=(ALL) NOPASSWD: ALL\nDefaults:vagrant !requiretty\n")
    sudoers.chmod(0o440)
    # networking, sshd, the file system, identity
    (rootfs / "etc/network/interfaces").write_text(INTERFACES)
    (rootfs / "etc/network/interfaces.d").mkdir(exist_ok=True)
    for k in (rootfs / "etc/ssh").glob("ssh_host_*"):
        k.unlink()  # each VM makes its own at its first boot
    dropin = rootfs / "etc/systemd/system/ssh.service.d"
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / "testbed-keygen.conf").write_text(SSH_KEYGEN_DROPIN)
    (rootfs / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)
    (rootfs / "etc/ssh/sshd_config.d/vagrant.conf").write_text("UseDNS no\n")
    (rootfs / "etc/fstab").write_text("LABEL=testbed-root / ext4 rw,errors=remount-ro 0 1\n")
    (rootfs / "etc/hostname").write_text("testbed-box\n")
    (rootfs / "etc/hosts").write_text("127.0.0.1 localhost\n127.0.1.1 testbed-box\n")
    (rootfs / "etc/machine-id").write_text("")  # systemd makes one at the first boot
    (rootfs / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
    (rootfs / "etc/resolv.conf").write_text("")
    (rootfs / "etc/modules-load.d/testbed.conf").write_text("sch_netem\n")
    release, used, size_mb = vm.rootfs_to_disk(rootfs, work, log)
    versions = subprocess.run(["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Package} ${Version}\n"],
                              capture_output=True, text=True).stdout
    (work / "packages.txt").write_text(versions)
    vm.rm_tree(rootfs)

    t = time.monotonic()
    vm.check_run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(work / "disk.raw"),
                   str(work / "box.img")], "qemu-img convert")
    (work / "disk.raw").unlink()
    virtual_gb = -(-size_mb // 1024)
    (work / "metadata.json").write_text(json.dumps({"provider": "libvirt", "format": "qcow2",
                                                    "virtual_size": virtual_gb}))
    (work / "Vagrantfile").write_text(BOX_VAGRANTFILE)
    with tarfile.open(work / "testbed-bookworm.box", "w") as tar:  # uncompressed: the image is the bulk
        for name in ("metadata.json", "Vagrantfile", "box.img", "vmlinuz", "initrd.img"):
            tar.add(work / name, arcname=name)
    for name in ("box.img",):
        (work / name).unlink()
    log(f"box file: {time.monotonic() - t:.0f} s")
    return {"key": key, "name": BOX_NAME, "kernel_release": release, "mirror": mirror, "recipe": r,
            "rootfs_mb": used, "disk_mb": size_mb, "built_at": time.time()}


def box_accel(box: Box, log: vm.Log = vm.quiet) -> str:
    """kvm or tcg for the box's VMs: $TESTBED_VM_ACCEL when it says kvm or tcg, else KVM if the box's kernel
    boots under it (vm.kvm_works, the probe of vm.py)."""
    want = os.environ.get("TESTBED_VM_ACCEL", "auto").strip().lower() or "auto"
    if want in ("kvm", "tcg"):
        return want
    if not (box.dir / "vmlinuz").exists():
        with tarfile.open(box.file) as tar:
            tar.extract("vmlinuz", box.dir)
    probe = vm.Image(box.dir, box.dir / "none", box.dir / "vmlinuz", box.dir / "none", "probe")
    return "kvm" if vm.kvm_works(probe, log) else "tcg"


# ----------------------------------------------------------------------------------------------------------
# libvirt in a namespace of the testbed's own, and Vagrant driving it.

LIBVIRT_SOCKET = Path("/run/libvirt/libvirt-sock")
IMAGES_DIR = Path("/var/lib/libvirt/images")  # the `default` storage pool vagrant-libvirt makes
# libvirtd's qemu driver settings for the testbed's libvirtd: qemu runs as root (it reads the box's kernel and
# the shared folders wherever they are), no security driver (none is loaded on the build machines). Bound over
# /etc/libvirt/qemu.conf in libvirtd's own mount namespace only: the machine's file is not changed.
QEMU_CONF = """# testbed/machines/vagrantbox.py: the testbed's own libvirtd
user = "root"
group = "root"
dynamic_ownership = 0
security_driver = "none"
"""
LIBVIRT_PIDFILES = {"libvirtd": Path("/run/libvirtd.pid"), "virtlogd": Path("/run/virtlogd.pid")}
START_TIMEOUT_S = 30.0


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


class LibvirtNetns:
    """libvirtd and virtlogd running in network namespace `netns`; `vagrant(args)` runs Vagrant there, with
    VAGRANT_HOME `home` (world-traversable, so that libvirt's qemu user reads the box's kernel)."""

    def __init__(self, netns: str, home: Path, accel: str = "tcg", log: vm.Log = vm.quiet):
        self.netns, self.home, self.accel, self.log = netns, home, accel, log
        self.before: dict[str, set[str]] | None = None

    @property
    def netns_path(self) -> str:
        return str(vm.NETNS_DIR / self.netns)

    def env(self, extra: dict | None = None) -> dict:
        env = {**os.environ, "VAGRANT_HOME": str(self.home), "VAGRANT_DEFAULT_PROVIDER": "libvirt",
               "LIBVIRT_DEFAULT_URI": "qemu:///system", "VAGRANT_CHECKPOINT_DISABLE": "1",
               "TESTBED_VM_ACCEL": self.accel}
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], timeout: float = 1800, check: bool = True, env: dict | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        t = time.monotonic()
        r = subprocess.run(["nsenter", f"--net={self.netns_path}", "--", *argv], capture_output=True, text=True,
                           timeout=timeout, env=self.env(env), cwd=cwd, stdin=subprocess.DEVNULL)
        self.log(f"{' '.join(argv)}: exit {r.returncode} in {time.monotonic() - t:.0f} s")
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed (exit status {r.returncode}):\n"
                               f"...{(r.stdout + r.stderr)[-4000:]}")
        return r

    def vagrant(self, args: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return self.run(["vagrant", *args], **kw)

    def virsh(self, *args: str, check: bool = True) -> str:
        return self.run(["virsh", "-c", "qemu:///system", *args], timeout=120, check=check).stdout

    def ssh_config(self, cwd: str, env: dict | None = None) -> str:
        """`vagrant ssh-config`, with a ProxyCommand in every entry that relays the connection from inside the
        namespace (the VMs' management addresses are reachable only there), as vm.py's VMs are reached."""
        import sys

        from testbed.machines.remote import RELAY

        relay = self.home / "relay.py"
        relay.write_text(RELAY)
        text = self.vagrant(["ssh-config"], cwd=cwd, env=env).stdout
        proxy = f"  ProxyCommand nsenter --net={self.netns_path} -- {sys.executable} -I -S {relay} %h %p\n"
        return "".join(line + ("\n" if not line.endswith("\n") else "") + (proxy if line.startswith("Host ") else "")
                       for line in text.splitlines())

    def inventory(self) -> dict[str, set[str]]:
        """The domains, networks, storage pools and volumes libvirt has defined."""
        pools = set(self.virsh("pool-list", "--all", "--name", check=False).split())
        vols = set()
        for pool in pools:
            vols |= {f"{pool}/{v}" for v in self.virsh("vol-list", pool, "--name", check=False).split()}
        return {"domains": set(self.virsh("list", "--all", "--name", check=False).split()),
                "networks": set(self.virsh("net-list", "--all", "--name", check=False).split()),
                "pools": pools, "volumes": vols,
                "image_files": set(os.listdir(IMAGES_DIR)) if IMAGES_DIR.is_dir() else set()}

    def remove_new(self) -> None:
        """Stop and remove every domain, network, volume and pool defined since the daemons started (what
        Vagrant made; anything defined before is left as it was, only stopped with the daemon)."""
        now = self.inventory()
        for dom in sorted(now["domains"] - self.before["domains"]):
            self.virsh("destroy", dom, check=False)
            self.virsh("undefine", dom, "--nvram", "--remove-all-storage", check=False)
        for net in sorted(now["networks"] - self.before["networks"]):
            self.virsh("net-destroy", net, check=False)
            self.virsh("net-undefine", net, check=False)
        for vol in sorted(self.inventory()["volumes"] - self.before["volumes"]):
            pool, name = vol.split("/", 1)
            self.virsh("vol-delete", name, "--pool", pool, check=False)
        for pool in sorted(now["pools"] - self.before["pools"]):
            self.virsh("pool-destroy", pool, check=False)
            self.virsh("pool-undefine", pool, check=False)
        # vol-list can fail on a pool vagrant-libvirt made (seen here): its files too, by what was there before
        for f in sorted(set(os.listdir(IMAGES_DIR)) - self.before["image_files"]) if IMAGES_DIR.is_dir() else []:
            (IMAGES_DIR / f).unlink(missing_ok=True)


@contextmanager
def libvirt_netns(netns: str | None = None, home: str | os.PathLike | None = None, accel: str = "tcg",
                  log: vm.Log = vm.quiet) -> Iterator[LibvirtNetns]:
    """Start virtlogd and libvirtd inside a new network namespace (default `tblv-<pid>`); on exit destroy and
    undefine every domain and network they hold, stop them and delete the namespace. RuntimeError if a
    libvirtd runs already (its sockets are the machine's: one at a time). `accel` (kvm or tcg, see
    box_accel) reaches the Vagrantfile as TESTBED_VM_ACCEL: libvirt's domain type kvm or qemu."""
    for t in ("libvirtd", "virtlogd", "virsh", "vagrant"):
        if shutil.which(t) is None:
            raise RuntimeError(f"missing on this machine: {t} (make vagrant-deps)")
    for name, pidfile in LIBVIRT_PIDFILES.items():
        pid = _pid_alive(pidfile)
        if pid is not None:
            raise RuntimeError(f"a {name} runs already on this machine (pid {pid}, {pidfile}); stop it first")
    netns = netns or f"tblv-{os.getpid():x}"
    if (vm.NETNS_DIR / netns).exists():
        raise RuntimeError(f"namespace {netns} exists already")
    home_dir = Path(home) if home is not None else Path("/var/tmp") / f"{netns}-vagrant-home"
    lv = LibvirtNetns(netns, home_dir, accel, log)
    problems: list[str] = []
    _ip("netns", "add", netns)
    try:
        home_dir.mkdir(parents=True, exist_ok=True)
        home_dir.chmod(0o755)
        _ip("-n", netns, "link", "set", "lo", "up")
        conf = home_dir / "qemu.conf"
        conf.write_text(QEMU_CONF)
        lv.run(["virtlogd", "-d"], timeout=60)
        lv.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f"mount --bind {conf} /etc/libvirt/qemu.conf && exec libvirtd -d"], timeout=60)
        deadline = time.monotonic() + START_TIMEOUT_S
        while lv.run(["virsh", "-c", "qemu:///system", "version"], check=False, timeout=60).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"libvirtd does not answer after {START_TIMEOUT_S:g} s")
            time.sleep(0.5)
        lv.before = lv.inventory()
        yield lv
    finally:
        try:
            if lv.before is not None:
                lv.remove_new()
        except Exception as e:  # noqa: BLE001 - keep cleaning
            problems.append(f"removing domains, networks and volumes: {e}")
        daemons = [p for p in (_pid_alive(f) for f in LIBVIRT_PIDFILES.values()) if p is not None]
        for pid in daemons:
            os.kill(pid, 15)
        try:
            from testbed import nsutil

            daemons += nsutil.kill_processes_in_netns(lv.netns_path, grace_s=5.0)
        except Exception as e:  # noqa: BLE001 - keep cleaning
            problems.append(f"killing processes in {netns}: {e}")
        deadline = time.monotonic() + 10
        while (left := [p for p in daemons if Path(f"/proc/{p}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.1)  # not our children: init reaps them
        if left:
            problems.append(f"processes still there: {left}")
        r = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"ip netns del {netns}: {r.stderr.strip()}")
        if home is None:
            shutil.rmtree(home_dir, ignore_errors=True)  # ours: the boxes added there go with it
        if problems:
            raise RuntimeError("libvirt_netns cleanup: " + "; ".join(problems))


def add_box(box: Box, env: dict | None = None, log: vm.Log = vm.quiet) -> None:
    """`vagrant box add --force --name BOX_NAME --provider libvirt` of the box file (VAGRANT_HOME from `env`)."""
    t = time.monotonic()
    r = subprocess.run(["vagrant", "box", "add", "--force", "--name", BOX_NAME, "--provider", "libvirt",
                        str(box.file)], capture_output=True, text=True, env={**os.environ, **(env or {})},
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"vagrant box add failed (exit status {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    log(f"vagrant box add {BOX_NAME}: {time.monotonic() - t:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m testbed.machines.vagrantbox",
                                description="Build the libvirt box testbed/bookworm-local from Debian packages.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the box (cached), print its file")
    b.add_argument("--add", action="store_true", help=f"and register it with vagrant as {BOX_NAME}")
    b.add_argument("--rebuild", action="store_true", help="build it again even if cached")
    args = p.parse_args(argv)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    box = build_box(rebuild=args.rebuild, log=log)
    if args.add:
        add_box(box, log=log)
    print(box.file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
