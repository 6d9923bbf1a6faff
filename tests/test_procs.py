"""testbed.procs against real processes of this machine (no root needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from testbed import procs


def _sleeper(*extra: str, **kw) -> subprocess.Popen:
    """A sleeping child that has exec'd (until then /proc/PID/cmdline is still this process's: seen once)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *extra], **kw)
    deadline = time.monotonic() + 10
    while (procs.cmdline(p.pid) or [])[1:2] != ["-c"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return p


def test_alive_needs_the_same_start_time():
    p = _sleeper()
    try:
        started = procs.start_time(p.pid)
        # a live child may be running, sleeping, or in disk sleep (D: a python still reading its modules, seen
        # once under load); what matters is that it is not a zombie
        assert started is not None and procs.state(p.pid) in ("R", "S", "D")
        assert procs.alive(p.pid) and procs.alive(p.pid, started)
        assert not procs.alive(p.pid, started + 1)  # a later process that got the same pid is not ours
    finally:
        p.kill()
        p.wait()
    assert not procs.alive(p.pid, started) and procs.start_time(p.pid) is None
    assert not procs.alive(None) and not procs.alive(0)


def test_a_zombie_is_not_alive():
    p = _sleeper()
    try:
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procs.state(p.pid) != "Z" and time.monotonic() < deadline:  # exited, not yet reaped by us
            time.sleep(0.01)
        assert procs.state(p.pid) == "Z" and not procs.alive(p.pid)
    finally:
        p.wait()


def test_kill_and_kill_group_ignore_a_process_that_is_gone():
    p = _sleeper(start_new_session=True)
    try:
        assert procs.kill_group(p.pid, signal.SIGTERM)
        assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        p.kill()
        p.wait()
    assert not procs.kill(p.pid) and not procs.kill_group(p.pid)


def test_find_by_cmdline_environ_and_namespace():
    tag = uuid.uuid4().hex
    p = _sleeper(tag, env={**os.environ, "PROCS_TEST": tag})
    try:
        assert procs.pids_with_cmdline(lambda args: tag in args) == [p.pid]
        assert procs.cmdline(p.pid)[-1] == tag and f"PROCS_TEST={tag}" in procs.environ(p.pid)
        assert p.pid in procs.in_namespace(f"/proc/{os.getpid()}/ns/net", "net")  # the same netns as ours
        assert os.getpid() not in procs.pids()
    finally:
        p.kill()
        p.wait()
    assert procs.cmdline(p.pid) is None and procs.environ(p.pid) is None


def test_environ_has_waits_for_a_process_to_exec_into_its_environment():
    # the shell starts with our environment and execs after 2 s into one that carries the tag (as runc's
    # init execs a container's): asked at once it is not there yet; asked with a wait it is
    tag = uuid.uuid4().hex
    want = (f"PROCS_TAG={tag}",)
    p = subprocess.Popen(["sh", "-c", f"sleep 2; exec env PROCS_TAG={tag} sleep 30"])
    try:
        assert not procs.environ_has(p.pid, want)
        t0 = time.monotonic()
        assert procs.environ_has(p.pid, want, wait_s=20)
        assert time.monotonic() - t0 < 20
        assert not procs.environ_has(p.pid, ("PROCS_TAG=other",), wait_s=0.3)  # asked again, then no
    finally:
        p.kill()
        p.wait()
    t0 = time.monotonic()
    assert not procs.environ_has(p.pid, want, wait_s=20)  # gone: no waiting
    assert time.monotonic() - t0 < 1
