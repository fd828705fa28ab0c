"""Leak checks for tests: child processes, shared-memory segments and simulated-node network
namespaces (:mod:`trainguard.testing.netns`) left behind.

Idle resources a capability keeps on purpose for reuse (pooled checkpoint writer processes) are
released first, through ``_core.hooks.run_release_callbacks``: what is left is a leak."""

from __future__ import annotations

import os
import re
import time

import psutil

from trainguard._core.hooks import run_release_callbacks
from trainguard._core.procs import pid_alive
from trainguard.testing.netns import NETNS_PATTERN, _delete_namespaces, list_netns, lock_owner

__all__ = ["LeakChecker", "harness_netns", "live_children", "trainguard_shm_segments"]

# Helpers that multiprocessing keeps for the interpreter's lifetime are not leaks.
_IGNORED_CMDLINE = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                    "multiprocessing.semaphore_tracker")
SHM_DIR = "/dev/shm"
SHM_PREFIX = "tg_"  # every trainguard shared-memory segment name starts with this


def live_children() -> list[psutil.Process]:
    """Live (non-zombie) descendants of this process, minus multiprocessing's helpers."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if any(tag in cmd for tag in _IGNORED_CMDLINE):
            continue
        out.append(child)
    return out


def trainguard_shm_segments() -> set[str]:
    """Names of trainguard shared-memory segments currently in /dev/shm."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def harness_netns() -> set[str]:
    """Names of the network namespaces made by :class:`trainguard.testing.netns.SimNodes`."""
    return {n for n in list_netns() if NETNS_PATTERN.match(n)}


def _leaked_netns(before: set[str], ours: set[int]) -> list[str]:
    """New harness namespaces owned by this process tree or by nobody alive (a concurrent test
    session's live clusters are not ours to report)."""
    out = []
    for name in sorted(harness_netns() - before):
        m = NETNS_PATTERN.match(name)
        run = m.group(1) if m else ""
        owner = lock_owner(run)
        if owner is None or owner in ours or not psutil.pid_exists(owner):
            out.append(name)
    return out


_OWNER = re.compile(r"tg_[a-z]+?([0-9a-f]+)_")


def _foreign(name: str, ours: set[int]) -> bool:
    """True when segment ``name`` names a live owner process outside this process tree.

    Segment names carry their owner's pid (see ``_core.shm.unique_prefix``); another test session
    running concurrently must not have its segments reported or unlinked by this one.
    """
    m = _OWNER.match(name)
    if not m:
        return False
    pid = int(m.group(1), 16)
    return pid not in ours and psutil.pid_exists(pid)


class LeakChecker:
    """Snapshot before a test, then :meth:`check` after it; returns a list of problems.

    Children are given ``grace_s`` to exit before they count as leaked; leaked ones are killed so
    one failing test does not poison the next.
    """

    def __init__(self, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s
        self.shm_before = trainguard_shm_segments()
        self.children_before = {p.pid for p in live_children()}
        self.netns_before = harness_netns()

    def check(self) -> list[str]:
        problems: list[str] = []
        run_release_callbacks()  # pooled idle writers are kept on purpose, not leaked
        end = time.monotonic() + self.grace_s
        leaked = []
        while True:
            leaked = [p for p in live_children() if p.pid not in self.children_before]
            if not leaked or time.monotonic() > end:
                break
            time.sleep(0.05)
        for proc in leaked:
            try:
                problems.append(
                    f"leaked child process pid={proc.pid}: {' '.join(proc.cmdline())[:200]}"
                )
                proc.kill()
            except psutil.Error:
                pass
        ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
        new_shm = {n for n in trainguard_shm_segments() - self.shm_before if not _foreign(n, ours)}
        for name in sorted(new_shm):
            problems.append(f"leaked shared-memory segment /dev/shm/{name}")
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        leaked_ns = _leaked_netns(self.netns_before, ours)
        for name in leaked_ns:
            problems.append(f"leaked network namespace {name} (a SimNodes left open)")
        if leaked_ns:
            _delete_namespaces(leaked_ns)
        return problems


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    """True once process ``pid`` has exited (gone, or a zombie not yet reaped by its parent);
    False if it is still running after ``timeout_s`` seconds (polls every 50 ms)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)
