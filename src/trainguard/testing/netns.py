"""Simulated nodes on one machine: one Linux network namespace per node, joined by a bridge.

:class:`SimNodes` creates ``n`` namespaces ``tg<run>-n<i>`` (``<run>``: 6 hex digits, unique per
cluster), each with loopback up and one interface ``eth0`` at ``<subnet>.<i+1>/24``. The other
end of each veth pair (``p<i>``) is a port of bridge ``br0``, which lives in a namespace of its
own (``tg<run>-br``): the cluster touches none of the host's interfaces, routes or addresses, and
no packet leaves what the cluster created. Processes run inside a node through
``ip netns exec`` (:meth:`SimNode.popen`), each in its own session (process group).

Faults, all real kernel state, all undone by :meth:`SimNodes.close`:

* :meth:`SimNodes.link_down` / :meth:`SimNodes.link_up`: the node's switch port goes down (a
  pulled cable: established connections hang silently, new ones time out);
* :meth:`SimNodes.flap`: down for ``down_s`` seconds, then up (blocking or in a named thread);
* :meth:`SimNodes.partition` / :meth:`SimNodes.heal`: a one-way partition, a blackhole route in
  ``src`` for ``dst``'s address (``src`` can no longer send to ``dst``; new connects fail at
  once, established ones hang);
* :meth:`SimNodes.slow` / :meth:`SimNodes.unslow`: a ``tc tbf`` rate limit on both directions of
  the node's link (``netem`` is not assumed to exist).

Cleanup is always done: :meth:`SimNodes.close` (also reached through the context manager and an
``atexit`` hook) stops every process in the node namespaces and deletes the namespaces, which
destroys the veth pairs and the bridge with them. Each cluster holds an ``flock`` on
``/run/trainguard-netns/<run>.lock`` while it lives; :func:`sweep_leftovers` deletes the
namespaces of clusters whose lock is free (their owner died without cleaning up).

Requires root and iproute2 (``ip``; ``tc`` for :meth:`SimNodes.slow`). :func:`netns_unavailable`
says why not; :class:`LocalNodes` is the fallback with the same process interface (every node
is 127.0.0.1, no network faults).

Follows: launcher-research.md §B6 (the recipe verified on trainguard's CI machine); the
fault kinds mirror the node-level faults of that note.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from trainguard._core.procs import terminate_processes
from trainguard.errors import ConfigError, TrainguardError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = [
    "NETNS_PATTERN",
    "LocalNodes",
    "NetnsError",
    "SimNode",
    "SimNodes",
    "list_netns",
    "netns_unavailable",
    "sweep_leftovers",
]

NETNS_PATTERN = re.compile(r"^tg([0-9a-f]{6})-(n\d+|br)$")  # every namespace the harness makes
LOCK_DIR = "/run/trainguard-netns"
IP_TIMEOUT_S = 10.0  # one ``ip``/``tc`` invocation: they return in milliseconds normally
STOP_GRACE_S = 2.0  # SIGTERM -> SIGKILL for processes inside a node at close


class NetnsError(TrainguardError):
    """An ``ip``/``tc`` command failed or timed out; the message has the command and its stderr."""


def _cmd(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one iproute2 command, bounded by :data:`IP_TIMEOUT_S`."""
    try:
        res = subprocess.run(list(args), capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                             check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"{' '.join(args)}: no answer within {IP_TIMEOUT_S} s") from e
    except FileNotFoundError as e:
        raise NetnsError(f"{args[0]} not found: install iproute2") from e
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(args)} failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


_SUPPORT: list[str | None] = []


def netns_unavailable() -> str | None:
    """Why simulated nodes cannot run here (not root, no ``ip``, namespaces refused), or None.

    The first call creates and deletes one probe namespace (milliseconds); the answer is cached.
    """
    if _SUPPORT:
        return _SUPPORT[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif shutil.which("ip") is None:
        reason = "iproute2's `ip` is not installed"
    else:
        probe = f"tg{secrets.token_hex(3)}-br"
        try:
            _cmd(["ip", "netns", "add", probe])
            _cmd(["ip", "netns", "del", probe])
        except NetnsError as e:
            reason = f"cannot create a network namespace: {e}"
    _SUPPORT.append(reason)
    return reason


def list_netns() -> list[str]:
    """Names of every network namespace that ``ip netns`` knows (``/run/netns``)."""
    try:
        return sorted(os.listdir("/run/netns"))
    except OSError:
        return []


def _pids_in(ns: str) -> list[int]:
    res = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _delete_namespaces(names: Sequence[str]) -> None:
    """Stop every process inside ``names``, then delete them; missing ones are skipped."""
    present = set(list_netns())
    pids = [p for ns in names if ns in present for p in _pids_in(ns)]
    if pids:
        terminate_processes(pids, grace_s=STOP_GRACE_S)
    for ns in names:
        if ns in present:
            _cmd(["ip", "netns", "del", ns], check=False)


def _lock_is_free(run: str) -> bool:
    """True when no live process holds cluster ``run``'s lock (or the lock file is missing)."""
    path = os.path.join(LOCK_DIR, f"{run}.lock")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the lock we may have just taken
    return True


def lock_owner(run: str) -> int | None:
    """The pid recorded as the owner of cluster ``run`` (None when unknown)."""
    try:
        with open(os.path.join(LOCK_DIR, f"{run}.lock")) as fh:
            return int(json.load(fh)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of harness clusters whose owner is gone; returns the names deleted.

    A cluster is a leftover when its lock file is missing or no process holds its lock (its owner
    crashed or was SIGKILLed before :meth:`SimNodes.close`). Live clusters, including those of
    other test sessions, are never touched. Blocks for a few ``ip`` calls per leftover.
    """
    runs: dict[str, list[str]] = {}
    for ns in list_netns():
        m = NETNS_PATTERN.match(ns)
        if m:
            runs.setdefault(m.group(1), []).append(ns)
    gone: list[str] = []
    for run, names in sorted(runs.items()):
        if _lock_is_free(run):
            _delete_namespaces(names)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(LOCK_DIR, f"{run}.lock"))
            gone += names
    return gone


class SimNode:
    """One simulated node: a network namespace with one address on the cluster's bridge."""

    def __init__(self, index: int, netns: str, addr: str, port: str) -> None:
        self.index = index
        self.netns = netns  # namespace name, e.g. tg3fa2c1-n0
        self.addr = addr  # IPv4 address of eth0
        self.port = port  # the bridge-side veth (in the bridge namespace)
        self.procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"SimNode({self.index}, {self.netns}, {self.addr})"

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed so that it runs inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: IO[Any] | int | None = None,
        cwd: str | None = None,
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside the node, in a new session; its pid is ``cmd`` itself.

        ``ip netns exec`` execs the command after entering the namespace, so signals sent to the
        returned process (or its group) reach the program. ``log``: a file or descriptor for
        stdout+stderr (default: discarded). The process is stopped at :meth:`SimNodes.close` if
        still running. Does not block.
        """
        out = subprocess.DEVNULL if log is None else log
        proc = subprocess.Popen(self.wrap(cmd), env=dict(env) if env is not None else None,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the node to completion and capture its output.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (it is killed first).
        """
        return subprocess.run(self.wrap(cmd), capture_output=True, text=True, timeout=timeout_s,
                              check=False, stdin=subprocess.DEVNULL)


class _NodeSet:
    """What :class:`SimNodes` and :class:`LocalNodes` share: a context manager over ``nodes``
    whose exit calls ``close``, with ``len`` and indexing over the nodes."""

    nodes: list[SimNode]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i: int) -> SimNode:
        return self.nodes[i]

    def close(self) -> None:
        """Stop every process started through the nodes (and free what the set owns)."""
        raise NotImplementedError


class SimNodes(_NodeSet):
    """``n`` simulated nodes on one bridge; a context manager that always cleans up.

    Args:
        n: number of nodes (1..250).
        subnet: the first three octets of the nodes' /24 (node ``i`` is ``<subnet>.<i+1>``).
            Traffic never leaves the cluster, so clusters of concurrent runs may reuse a subnet.
        sweep: first delete leftovers of crashed earlier clusters (:func:`sweep_leftovers`).

    Raises:
        ConfigError: ``n`` or ``subnet`` is invalid.
        NetnsError: the namespaces could not be created (not root, no ``ip``); whatever had been
            created is deleted before raising.

    Construction takes about 10 ms per node plus ``ip`` start-up costs (roughly 0.1-0.5 s for 3
    nodes on an idle machine).
    """

    def __init__(self, n: int, subnet: str = "10.231.0", sweep: bool = True) -> None:
        if not 1 <= n <= 250:
            raise ConfigError(f"SimNodes(n={n}): n must be between 1 and 250")
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet) or any(
                int(o) > 255 for o in subnet.split(".")):
            raise ConfigError(f"SimNodes(subnet={subnet!r}): give three octets, e.g. '10.231.0'")
        if sweep:
            sweep_leftovers()
        self.run_id = secrets.token_hex(3)
        self.prefix = f"tg{self.run_id}"
        self.bridge_ns = f"{self.prefix}-br"
        self.nodes = [SimNode(i, f"{self.prefix}-n{i}", f"{subnet}.{i + 1}", f"p{i}")
                      for i in range(n)]
        self.network_faults = True
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock_fd = self._take_lock()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> int:
        os.makedirs(LOCK_DIR, exist_ok=True)
        fd = os.open(os.path.join(LOCK_DIR, f"{self.run_id}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": os.getpid(), "created": time.time()}).encode())
        return fd

    def _build(self) -> None:
        br = self.bridge_ns
        _cmd(["ip", "netns", "add", br])
        _cmd(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _cmd(["ip", "-n", br, "link", "set", "br0", "up"])
        for node in self.nodes:
            _cmd(["ip", "netns", "add", node.netns])
            _cmd(["ip", "-n", br, "link", "add", node.port, "type", "veth", "peer", "name",
                  "eth0", "netns", node.netns])
            _cmd(["ip", "-n", br, "link", "set", node.port, "master", "br0", "up"])
            _cmd(["ip", "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0"])
            _cmd(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
            _cmd(["ip", "-n", node.netns, "link", "set", "lo", "up"])

    def namespaces(self) -> list[str]:
        """Every namespace this cluster owns (nodes, then the bridge)."""
        return [n.netns for n in self.nodes] + [self.bridge_ns]

    # ---------------------------------------------------------------- faults
    def link_down(self, i: int) -> None:
        """Take node ``i``'s switch port down: its traffic is dropped silently, both ways."""
        _cmd(["ip", "-n", self.bridge_ns, "link", "set", self.nodes[i].port, "down"])

    def link_up(self, i: int) -> None:
        """Bring node ``i``'s switch port back up (the bridge forwards again within ~0.1 s)."""
        _cmd(["ip", "-n", self.bridge_ns, "link", "set", self.nodes[i].port, "up"])

    def flap(self, i: int, down_s: float, wait: bool = True) -> threading.Thread | None:
        """Node ``i``'s link down for ``down_s`` seconds, then up.

        With ``wait=False`` the up happens in a named daemon thread, returned and joined at
        :meth:`close`; otherwise blocks ``down_s`` seconds.

        Raises:
            ConfigError: ``down_s`` is negative.
        """
        if down_s < 0:
            raise ConfigError(f"flap(down_s={down_s}): must be >= 0 seconds")
        self.link_down(i)
        if wait:
            time.sleep(down_s)
            self.link_up(i)
            return None
        t = threading.Thread(target=self._up_later, args=(i, down_s), daemon=True,
                             name=f"tg-netns-flap-{self.nodes[i].netns}")
        self._threads.append(t)
        t.start()
        return t

    def _up_later(self, i: int, delay_s: float) -> None:
        time.sleep(delay_s)
        if not self._closed:
            with contextlib.suppress(NetnsError):
                self.link_up(i)

    def partition(self, src: int, dst: int) -> None:
        """One-way partition: node ``src`` can no longer send to node ``dst`` (blackhole route).

        ``dst`` still reaches ``src`` at the IP level, so TCP in either direction stalls: new
        connects from ``src`` fail at once, established connections hang silently.
        """
        _cmd(["ip", "-n", self.nodes[src].netns, "route", "add", "blackhole",
              f"{self.nodes[dst].addr}/32"])

    def heal(self, src: int, dst: int) -> None:
        """Undo :meth:`partition` ``(src, dst)``."""
        _cmd(["ip", "-n", self.nodes[src].netns, "route", "del", "blackhole",
              f"{self.nodes[dst].addr}/32"])

    def isolate(self, i: int) -> None:
        """Blackhole node ``i``'s routes to every other node (its link stays up)."""
        for j in range(len(self.nodes)):
            if j != i:
                self.partition(i, j)

    def slow(self, i: int, rate_kbit: int, burst_kbit: int = 32, latency_ms: int = 400) -> None:
        """Rate-limit both directions of node ``i``'s link with ``tc tbf`` (``rate_kbit`` kbit/s).

        Packets beyond the bucket wait up to ``latency_ms`` and are dropped after that.

        Raises:
            ConfigError: a non-positive parameter. NetnsError: ``tc`` failed or is missing.
        """
        if min(rate_kbit, burst_kbit, latency_ms) <= 0:
            raise ConfigError("slow(): rate_kbit, burst_kbit and latency_ms must be > 0")
        spec = ["tbf", "rate", f"{rate_kbit}kbit", "burst", f"{burst_kbit}kbit",
                "latency", f"{latency_ms}ms"]
        node = self.nodes[i]
        _cmd(["tc", "-n", node.netns, "qdisc", "replace", "dev", "eth0", "root", *spec])
        _cmd(["tc", "-n", self.bridge_ns, "qdisc", "replace", "dev", node.port, "root", *spec])

    def unslow(self, i: int) -> None:
        """Remove :meth:`slow` from node ``i``'s link."""
        node = self.nodes[i]
        _cmd(["tc", "-n", node.netns, "qdisc", "del", "dev", "eth0", "root"], check=False)
        _cmd(["tc", "-n", self.bridge_ns, "qdisc", "del", "dev", node.port, "root"], check=False)

    # ---------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Stop every process in the nodes, delete the namespaces (veths and bridge go with them)
        and release the lock. Idempotent; blocks at most ~``STOP_GRACE_S`` + 5 s plus one ``ip``
        call per namespace."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        started = [p for n in self.nodes for p in n.procs if p.poll() is None]
        if started:
            terminate_processes(started, grace_s=STOP_GRACE_S, groups=True)
        _delete_namespaces(self.namespaces())
        for t in self._threads:
            t.join(timeout=1.0)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(LOCK_DIR, f"{self.run_id}.lock"))
        os.close(self._lock_fd)


class LocalNodes(_NodeSet):
    """Fallback with :class:`SimNodes`' process interface where namespaces are unavailable.

    Every node is 127.0.0.1 and commands run directly; ``network_faults`` is False and the fault
    methods are absent, so tests that need them skip.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ConfigError(f"LocalNodes(n={n}): n must be >= 1")
        self.nodes = [_LocalNode(i) for i in range(n)]
        self.network_faults = False

    def close(self) -> None:
        """Stop every process started through the nodes. Idempotent."""
        started = [p for n in self.nodes for p in n.procs if p.poll() is None]
        if started:
            terminate_processes(started, grace_s=STOP_GRACE_S, groups=True)


class _LocalNode(SimNode):
    def __init__(self, index: int) -> None:
        super().__init__(index, "", "127.0.0.1", "")

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        return list(cmd)
