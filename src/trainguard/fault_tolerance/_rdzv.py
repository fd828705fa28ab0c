"""Multi-node rendezvous on a ``torch.distributed`` store: generations, identity claims, leases,
rounds.

Keys (``P = tg/<run_id>/g<gen>/``)::

    tg/<run_id>/gen          current generation (a new one when the previous job is done or stale)
    P config                 "nnodes=MIN:MAX nproc=N" of the first launcher (others must match)
    P claims/count, /<i>     names of every identity ever claimed in this generation
    P claim/<name>           token of the launcher that owns identity <name>
    P lease/<token>          renewal counter of a launcher; "exit" (done) or "left" (gone)
    P round                  the current round N (= global cycle, TORCHELASTIC_RESTART_COUNT)
    P r<N>/count, /slot/<k>  joins of round N (json: name, node_rank, token, addr)
    P r<N>/closed            json list of member slots (compare-and-set: first closer wins)
    P r<N>/master            "addr:port" published by the round's group-rank-0 node
    P r<N>/ok                members whose workers all exited 0
    P r<N>/end               why round N ended (first writer wins)
    P done                   "ok" or "fail:<exit code>:<reason>": the job is over
    P nodefail/count         node failures so far (``--ft-max-node-failures``)
    P nodefail/<token>       1 once the failure of that launcher was counted (counted once)

Every key of a round is namespaced by generation and round, so a reused store never leaks a
stale round, and a stale store from an earlier job with the same run id (done, or every lease
lapsed) gets a clean new generation. Liveness is judged by watching a lease counter change on
the observer's own monotonic clock (no wall-clock comparison across nodes).

Follows: NVRx's barrier rendezvous (``ft_rendezvous_barrier``: round-fenced compare-and-set
keys, spares parked until the next round, unhealthy nodes leave without closing it) and
torchrun's c10d backend (MIN:MAX, last call, join timeout); differences: leases on the store
(a dead launcher is noticed within ``--ft-lease-s``, not a collective timeout), every store
call under its own deadline, a round also closes as soon as every live launcher has joined.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from trainguard._core.clock import Deadline
from trainguard._core.store import DeadlineStore, StoreCallTimeout
from trainguard.fault_tolerance._args import LaunchSpec
from trainguard.fault_tolerance.errors import EXIT_STORE_LOST, LaunchConfigError, LauncherError

__all__ = [
    "EXIT_STORE_LOST",
    "NodeIdentity",
    "Rendezvous",
    "RdzvSettings",
    "StoreLost",
    "resolve_identity",
]

_log = logging.getLogger("trainguard.fault_tolerance")


class StoreLost(LauncherError):
    """This launcher could not renew its lease within ``--ft-lease-s``: it must stop its
    workers (self-fence) and exit with :data:`EXIT_STORE_LOST`."""


class DuplicateIdentity(LaunchConfigError):
    """Another live launcher already owns this node identity."""


@dataclasses.dataclass(frozen=True)
class NodeIdentity:
    """Who this launcher is: ``name`` is unique per live launcher; ``node_rank`` orders nodes."""

    name: str
    node_rank: int | None
    addr: str


def _route_addr(host: str) -> str | None:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def resolve_identity(spec: LaunchSpec, environ: Mapping[str, str]) -> NodeIdentity:
    """This launcher's rendezvous identity: the node rank resolved by ``_identity`` (``--node-rank``
    > ``PET_NODE_RANK`` > ``SLURM_PROCID`` > ``JOB_COMPLETION_INDEX``), else the host name (the
    rendezvous then orders nodes by address).
    """
    rank = spec.node_rank if spec.node_rank_given else None
    host = socket.gethostname().split(".")[0]
    addr = spec.local_addr
    if not addr:
        st = RdzvSettings.from_spec(spec)
        addr = (_route_addr(st.host) if st.store_type == "tcp" else None) or "127.0.0.1"
    return NodeIdentity(f"node{rank}" if rank is not None else host, rank, addr)


@dataclasses.dataclass(frozen=True)
class RdzvSettings:
    """Validated ``--rdzv-endpoint`` / ``--rdzv-conf`` (durations in seconds)."""

    store_type: str
    host: str
    port: int
    path: str
    is_host: bool | None
    join_timeout_s: float
    last_call_s: float
    connect_timeout_s: float

    @classmethod
    def from_spec(cls, spec: LaunchSpec) -> RdzvSettings:
        """Raises:
        LaunchConfigError: an unknown store type, a bad port, a non-positive timeout.
        """
        conf = dict(spec.rdzv_conf)
        store_type = conf.get("store_type", "tcp").lower()
        if store_type not in ("tcp", "file"):
            raise LaunchConfigError(f"--rdzv-conf store_type={store_type}: use tcp or file")

        def seconds(key: str, default: float) -> float:
            try:
                value = float(conf.get(key, default))
            except ValueError:
                raise LaunchConfigError(f"--rdzv-conf {key}={conf[key]!r} is not seconds"
                                        ) from None
            if value <= 0:
                raise LaunchConfigError(f"--rdzv-conf {key} must be > 0 seconds, got {value:g}")
            return value

        join = seconds("join_timeout", seconds("timeout", 600.0) if "timeout" in conf else 600.0)
        last_call = seconds("last_call_timeout", 30.0)
        connect = seconds("connect_timeout", min(60.0, join))
        raw_host = conf.get("is_host", "").strip().lower()
        is_host = None if raw_host == "" else raw_host in ("1", "true", "yes")
        endpoint = spec.rdzv_endpoint
        if store_type == "file":
            return cls("file", "", 0, os.path.abspath(endpoint), False, join, last_call, connect)
        host, sep, port = endpoint.rpartition(":")
        if not sep:
            host, port = endpoint, "29400"
        try:
            port_n = int(port)
        except ValueError:
            raise LaunchConfigError(f"--rdzv-endpoint {endpoint!r}: port {port!r} is not a "
                                    "number (HOST:PORT)") from None
        if not 0 < port_n < 65536:
            raise LaunchConfigError(f"--rdzv-endpoint {endpoint!r}: port must be 1-65535")
        return cls("tcp", host.strip("[]") or "127.0.0.1", port_n, "", is_host, join, last_call,
                   connect)


def _is_local(host: str) -> bool:
    try:
        wanted = {str(i[4][0]) for i in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in wanted):
        return True
    mine = _route_addr(host)
    return mine is not None and mine in wanted


def open_store(st: RdzvSettings, lease_s: float) -> tuple[Callable[[], dist.Store], Any]:
    """A factory of client connections, and the store server this launcher hosts (or None).

    TCP: the launcher hosts the store when ``is_host=1``, or when ``is_host`` is unset, the
    endpoint is an address of this machine and its port is free (torchrun's c10d heuristic,
    with the port as tie-breaker among launchers on one machine).

    Raises:
        LaunchConfigError: the host cannot be resolved, ``is_host=1`` but the port is taken,
            or the file-store path is not writable.
    """
    if st.store_type == "file":
        try:
            os.makedirs(os.path.dirname(st.path) or ".", exist_ok=True)
            with open(st.path, "ab"):
                pass
        except OSError as exc:
            raise LaunchConfigError(f"--rdzv-endpoint {st.path}: the file store is not writable "
                                    f"({exc.strerror}); use a path on a shared, writable "
                                    "filesystem") from None
        return (lambda: dist.FileStore(st.path, -1)), None
    try:
        socket.getaddrinfo(st.host, st.port)
    except OSError as exc:
        raise LaunchConfigError(f"--rdzv-endpoint {st.host}:{st.port}: cannot resolve "
                                f"{st.host!r} ({exc}); check the host name") from None
    server = None
    if st.is_host or (st.is_host is None and _is_local(st.host)):
        try:
            server = dist.TCPStore(st.host if st.is_host is None else "0.0.0.0", st.port,
                                   is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=lease_s))
            _log.info("hosting the rendezvous store on port %d", st.port)
        except (RuntimeError, OSError) as exc:
            if st.is_host:
                raise LaunchConfigError(f"--rdzv-conf is_host=1 but port {st.port} cannot be "
                                        f"bound ({exc}); free it or pick another endpoint"
                                        ) from None
    op_timeout = datetime.timedelta(seconds=max(lease_s, 1.0))

    def factory() -> dist.Store:
        return dist.TCPStore(st.host, st.port, is_master=False, wait_for_workers=False,
                             timeout=op_timeout)

    return factory, server


class _Keys:
    def __init__(self, run_id: str, gen: int) -> None:
        self.p = f"tg/{run_id}/g{gen}/"

    def __call__(self, name: str) -> str:
        return self.p + name

    def r(self, n: int, name: str) -> str:
        return f"{self.p}r{n}/{name}"


class LeaseKeeper:
    """Background thread: renews this launcher's lease, watches every claimant's lease, the
    round counter and the done flag; writes a byte to ``wake_fd`` on any change.

    Opens the next round when a member of the active round lapses or leaves. Marks itself
    ``fenced`` (and stops renewing) when its own renewal has not succeeded for ``lease_s``.
    Every store call runs on its own connection under a deadline, so the thread never wedges.
    """

    def __init__(self, factory: Callable[[], dist.Store], keys: _Keys, token: str,
                 lease_s: float, interval_s: float, max_restarts: int, wake_fd: int,
                 budget: NodeFailureBudget | None = None) -> None:
        self.keys, self.token = keys, token
        self.lease_s, self.interval_s = lease_s, interval_s
        self.max_restarts = max_restarts
        self.budget = budget or NodeFailureBudget(None, 1)
        self.ds = DeadlineStore(factory, lease_s, "lease")
        self.wake_fd = wake_fd
        self.lock = threading.Lock()
        self.fenced = False
        self.round = -1
        self.done = ""
        self.names: list[str] = []
        self.owner: dict[str, str] = {}  # name -> token
        self.seen: dict[str, tuple[str, float]] = {}  # token -> (value, monotonic change time)
        self.active: tuple[int, dict[str, str]] | None = None  # round, token -> name
        self.last_ok = time.monotonic()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tg-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, final: str = "") -> None:
        """Stop renewing; ``final`` ("exit" or "left") is written as the lease's last value
        (bounded by one lease interval)."""
        self._stop.set()
        self._thread.join(self.lease_s + 1.0)
        if final:
            try:
                self.ds.call(lambda s: s.set(self.keys(f"lease/{self.token}"), final),
                             self.interval_s * 2)
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                _log.debug("cannot write the final lease value: %s", exc)

    def _wake(self) -> None:
        try:
            os.write(self.wake_fd, b"l")
        except OSError:
            pass

    # -- views for the main thread -------------------------------------------------------
    def status(self, token: str) -> str:
        """'live', 'lapsed' or 'gone' ('exit'/'left'); an unseen token counts as live."""
        with self.lock:
            value, changed = self.seen.get(token, ("", time.monotonic()))
        if value in ("exit", "left"):
            return "gone"
        return "lapsed" if time.monotonic() - changed > self.lease_s else "live"

    def live_claimants(self) -> dict[str, str]:
        """name -> token of every claimed identity whose owner's lease is live."""
        with self.lock:
            owners = dict(self.owner)
        return {n: t for n, t in owners.items() if self.status(t) == "live"}

    def watch_round(self, n: int, members: dict[str, str] | None) -> None:
        with self.lock:
            self.active = (n, dict(members)) if members else None

    # -- thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._tick()
            if self.fenced:
                self._wake()
                return
            self._stop.wait(self._next_wait(t0))

    def _next_wait(self, t0: float) -> float:
        """Seconds to the next tick: the renewal interval, or sooner when a member of the
        active round would lapse before then (so a lost node is noticed about one lease after
        its last renewal was seen, not up to one interval later)."""
        now = time.monotonic()
        wait = self.interval_s - (now - t0)
        with self.lock:
            tokens = list(self.active[1]) if self.active is not None else []
            changes = [self.seen[t][1] for t in tokens
                       if t in self.seen and self.seen[t][0] not in ("exit", "left")]
        for changed in changes:
            due = changed + self.lease_s - now
            if due > 0:  # one already lapsed was handled (or is the next round's business)
                wait = min(wait, due + 0.01)
        return max(0.0, wait)

    def _tick(self, renew: bool = True) -> None:
        self._seq += 1
        keys, known = self.keys, len(self.names)

        def op(s: dist.Store) -> tuple[Any, ...]:
            if renew:
                s.set(keys(f"lease/{self.token}"), str(self._seq))
            count = s.add(keys("claims/count"), 0)
            new = [keys(f"claims/{i}") for i in range(known, count)]
            names = [v.decode() for v in s.multi_get(new)] if new else []
            everyone = self.names + names
            owners = [v.decode() for v in s.multi_get([keys(f"claim/{n}") for n in everyone])
                      ] if everyone else []
            leases = [v.decode() for v in s.multi_get([keys(f"lease/{t}") for t in owners])
                      ] if owners else []
            rnd = int(s.get(keys("round"))) if s.check([keys("round")]) else 0
            done = s.get(keys("done")).decode() if s.check([keys("done")]) else ""
            return names, owners, leases, rnd, done

        remaining = self.last_ok + self.lease_s - time.monotonic()
        try:
            names, owners, leases, rnd, done = self.ds.call(op, max(0.05, remaining))
        except Exception as exc:  # noqa: BLE001 - any store failure counts against the lease
            if time.monotonic() - self.last_ok >= self.lease_s:
                _log.error("could not renew this node's lease for %.1f s (%s): stopping the "
                           "workers (self-fence)", self.lease_s, exc)
                self.fenced = True
            return
        self.last_ok = now = time.monotonic()
        changed = False
        with self.lock:
            self.names.extend(names)
            self.owner = dict(zip(self.names, owners))
            for token, value in zip(owners, leases):
                old = self.seen.get(token)
                if old is None or old[0] != value:
                    self.seen[token] = (value, now)
            if rnd != self.round or done != self.done:
                self.round, self.done, changed = rnd, done, True
            active = self.active
        if active is not None and not done and rnd == active[0]:
            for token, name in active[1].items():
                state = self.status(token)
                if state != "live":
                    why = "left" if state == "gone" else f"lease lapsed (> {self.lease_s:g} s)"
                    _log.error("node %s %s: opening the next round", name, why)
                    if state == "lapsed":
                        self._count_failure(token, f"node {name} {why}")
                    self._open_next(rnd, f"node {name} {why}")
                    changed = True
                    break
        if changed:
            self._wake()

    def _count_failure(self, token: str, reason: str) -> None:
        try:
            self.ds.call(lambda s: self.budget.record(s, self.keys, token, reason))
        except Exception as exc:  # noqa: BLE001 - the lapse is counted by another survivor
            _log.warning("could not count the node failure: %s", exc)

    def _open_next(self, n: int, reason: str) -> None:
        try:
            self.ds.call(lambda s: open_next_round(s, self.keys, n, reason, self.max_restarts))
        except Exception as exc:  # noqa: BLE001 - retried next tick
            _log.warning("could not open the next round: %s", exc)


@dataclasses.dataclass(frozen=True)
class NodeFailureBudget:
    """``--ft-max-node-failures``: node failures (a lapsed lease, a failed health check, an
    exclusion) the job tolerates; ``limit`` None = no limit. One failure more ends the job on
    every node with ``code`` (the do-not-requeue code, ``--ft-no-restart-exit-code``).

    The count lives in the rendezvous store, so every launcher (spares included) sees the same
    one; a failure reported by several survivors (one lapsed lease) counts once.

    Follows: no counterpart in torchrun (``--max-restarts`` counts restarts, not lost nodes).
    """

    limit: int | None
    code: int

    def record(self, s: dist.Store, keys: _Keys, token: str, reason: str) -> bool:
        """Count the failure of launcher ``token`` once (whoever reports it first); returns True
        when the budget is exhausted (``done`` is then set). One store round trip or three."""
        if int(s.add(keys(f"nodefail/{token}"), 1)) != 1:
            return self.exhausted(int(s.add(keys("nodefail/count"), 0)))
        n = int(s.add(keys("nodefail/count"), 1))
        _log.warning("node failure %d of the job (%s); --ft-max-node-failures %s", n, reason,
                     "none" if self.limit is None else self.limit)
        if not self.exhausted(n):
            return False
        s.compare_set(keys("done"), "", f"fail:{self.code}:{n} node failure(s), more than "
                                        f"--ft-max-node-failures {self.limit} (last: {reason})")
        return True

    def exhausted(self, count: int) -> bool:
        return self.limit is not None and count > self.limit


def open_next_round(s: dist.Store, keys: _Keys, n: int, reason: str, max_restarts: int) -> None:
    """End round ``n`` (first reason wins) and open ``n + 1``; past ``max_restarts`` the job
    ends instead (``done = fail:1:...``)."""
    s.compare_set(keys.r(n, "end"), "", reason)
    if n + 1 > max_restarts:
        s.compare_set(keys("done"), "", f"fail:1:round {n} ended ({reason}) and no restart is "
                                        f"left (--max-restarts {max_restarts})")
    else:
        s.compare_set(keys("round"), str(n), str(n + 1))


@dataclasses.dataclass
class Round:
    """The outcome of joining round ``n``: ``members`` maps name -> token in group-rank order."""

    n: int
    kind: str  # member | spare | retry | done | fenced | too_few | signalled
    members: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # name,tok,addr
    group_rank: int = -1
    detail: str = ""


class Rendezvous:
    """The main thread's view of the rendezvous (every store call under a deadline)."""

    def __init__(self, spec: LaunchSpec, identity: NodeIdentity, wake_fd: int) -> None:
        self.spec, self.identity = spec, identity
        self.st = RdzvSettings.from_spec(spec)
        self.factory, self.server = open_store(self.st, spec.lease_s)
        self.ds = DeadlineStore(self.factory, max(spec.lease_s, 2.0), "rdzv")
        self.token = f"{identity.name}-{os.getpid()}-{secrets.token_hex(4)}"
        self.wake_fd = wake_fd
        self.gen = -1
        self.keys = _Keys(spec.run_id, 0)
        self.keeper: LeaseKeeper | None = None
        self.interrupted: Callable[[], int] = lambda: 0  # pending SIGTERM-like signal, or 0
        self.budget = NodeFailureBudget(spec.ft.max_node_failures, spec.ft.no_restart_exit_code)

    def call(self, fn: Callable[[dist.Store], Any], deadline_s: float | None = None) -> Any:
        """Run ``fn`` on the store within ``deadline_s`` (default the store deadline), cut to
        the moment this node's own lease would lapse: when the store is unreachable the lease
        keeper fences the node then, and the main thread must not sit in a dead call beyond
        it (a fenced node stops its workers at once).

        Raises:
            StoreCallTimeout: no answer in time (the caller retries while the lease holds).
        """
        keeper = self.keeper
        if keeper is not None:
            if keeper.fenced:
                raise StoreCallTimeout("this node is fenced (lease lost): no more store calls")
            left = keeper.last_ok + keeper.lease_s - time.monotonic() + 0.1
            deadline_s = max(0.05, min(deadline_s or self.ds.deadline_s, left))
        return self.ds.call(fn, deadline_s)

    # -- start ----------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, pick the generation, check the config, claim the identity, start the lease.

        Blocks at most ``connect_timeout`` plus about two lease timeouts.

        Raises:
            LaunchConfigError: the store is unreachable, ``--nnodes``/``--nproc-per-node``
                differ from the job's, or another live launcher owns this identity.
        """
        deadline = Deadline(self.st.connect_timeout_s)
        last: BaseException | None = None
        while not deadline.expired():
            try:
                self.call(lambda s: s.check(["tg/ping"]), max(0.5, deadline.remaining()))
                break
            except Exception as exc:  # noqa: BLE001 - retried until the connect timeout
                last = exc
                time.sleep(min(0.5, deadline.remaining()))
        else:
            where = self.st.path or f"{self.st.host}:{self.st.port}"
            why = str(last).splitlines()[0][:160] if last else "no answer"
            raise LaunchConfigError(f"rendezvous store {where} unreachable for "
                                    f"{self.st.connect_timeout_s:g} s ({why}); check "
                                    "--rdzv-endpoint and that the store host is up")
        self.gen = self._generation()
        self.keys = _Keys(self.spec.run_id, self.gen)
        self._check_config()
        self.call(lambda s: s.set(self.keys(f"lease/{self.token}"), "0"))
        self.keeper = LeaseKeeper(self.factory, self.keys, self.token, self.spec.lease_s,
                                  self.spec.lease_interval_s, self.spec.max_restarts,
                                  self.wake_fd, self.budget)
        self.keeper.start()
        self._claim()

    def _generation(self) -> int:
        base = f"tg/{self.spec.run_id}/gen"
        gen = int(self.call(lambda s: s.compare_set(base, "", "0")).decode())
        keys = _Keys(self.spec.run_id, gen)
        if self.call(lambda s: s.check([keys("done")])):
            why = "its job is done"
        elif self._any_live(keys):
            return gen
        else:
            why = "no launcher of it renewed its lease"
        new = int(self.call(lambda s: s.compare_set(base, str(gen), str(gen + 1))).decode())
        _log.warning("rendezvous generation %d of run id %r is stale (%s): using generation "
                     "%d", gen, self.spec.run_id, why, new)
        return new

    def _any_live(self, keys: _Keys) -> bool:
        """True when some claimant of ``keys``' generation renews its lease (watched for up to
        one lease timeout); True for a generation nobody claimed yet."""
        def leases(s: dist.Store) -> list[bytes]:
            count = s.add(keys("claims/count"), 0)
            names = [v.decode() for v in s.multi_get([keys(f"claims/{i}")
                                                      for i in range(count)])] if count else []
            toks = [v.decode() for v in s.multi_get([keys(f"claim/{n}") for n in names])
                    ] if names else []
            return list(s.multi_get([keys(f"lease/{t}") for t in toks])) if toks else []

        first = self.call(leases)
        if not first:
            return True
        deadline = Deadline(self.spec.lease_s)
        while not deadline.expired():
            time.sleep(self.spec.lease_interval_s / 2)
            now = self.call(leases)
            if len(now) != len(first) or any(a != b and b not in (b"exit", b"left")
                                              for a, b in zip(first, now)):
                return True
        return False

    def _check_config(self) -> None:
        spec = self.spec
        mine = f"nnodes={spec.nnodes_min}:{spec.nnodes_max} nproc={spec.nproc_per_node}"
        theirs = self.call(lambda s: s.compare_set(self.keys("config"), "", mine)).decode()
        if theirs != mine:
            raise LaunchConfigError(f"this launcher has {mine} but the job (run id "
                                    f"{spec.run_id!r}) was started with {theirs}; give every "
                                    "launcher the same --nnodes and --nproc-per-node")

    def _claim(self) -> None:
        assert self.keeper is not None
        name, key = self.identity.name, self.keys(f"claim/{self.identity.name}")
        cur = self.call(lambda s: s.compare_set(key, "", self.token)).decode()
        if cur == self.token:
            def register(s: dist.Store) -> None:
                i = s.add(self.keys("claims/count"), 1) - 1
                s.set(self.keys(f"claims/{i}"), name)
            self.call(register)
            return
        lease = self.keys(f"lease/{cur}")
        first = self.call(lambda s: s.get(lease) if s.check([lease]) else b"").decode()
        deadline = Deadline(self.spec.lease_s)
        value = first
        while first not in ("exit", "left") and not deadline.expired():
            time.sleep(self.spec.lease_interval_s / 2)
            value = self.call(lambda s: s.get(lease) if s.check([lease]) else b"").decode()
            if value != first:
                break
        if value == first or value in ("exit", "left"):
            got = self.call(lambda s: s.compare_set(key, cur, self.token)).decode()
            if got == self.token:
                _log.warning("identity %s: the previous launcher (%s) is gone; this launcher "
                             "replaces it", name, cur)
                return
        raise DuplicateIdentity(f"node identity {name!r} is already owned by a live launcher "
                                f"({cur}); give each launcher a distinct --node-rank")

    # -- rounds --------------------------------------------------------------------------
    def current_round(self) -> tuple[int, str]:
        def op(s: dist.Store) -> tuple[int, str]:
            s.compare_set(self.keys("round"), "", "0")
            done = s.get(self.keys("done")).decode() if s.check([self.keys("done")]) else ""
            return int(s.get(self.keys("round"))), done
        return self.call(op)  # type: ignore[no-any-return]

    def join(self, n: int) -> Round:
        """Join round ``n`` (or park when it is already closed) and wait until it closes.

        Blocks at most the join timeout (the round is checked every ~0.1 s).
        """
        assert self.keeper is not None
        keys, spec, st = self.keys, self.spec, self.st
        if self.call(lambda s: s.check([keys.r(n, "closed")])):
            return Round(n, "spare", detail="already closed")
        me = json.dumps({"name": self.identity.name, "rank": self.identity.node_rank,
                         "token": self.token, "addr": self.identity.addr})

        def enter(s: dist.Store) -> int:
            k = s.add(keys.r(n, "count"), 1) - 1
            s.set(keys.r(n, f"slot/{k}"), me)
            return k

        my_slot = int(self.call(enter))
        deadline = Deadline(st.join_timeout_s)
        next_note = time.monotonic() + 5.0
        min_at: float | None = None
        slots: dict[int, dict[str, Any]] = {}
        while True:
            state = self._state(n)
            if state is not None:
                return state
            closed, count = self.call(lambda s: (
                s.get(keys.r(n, "closed")).decode() if s.check([keys.r(n, "closed")]) else "",
                s.add(keys.r(n, "count"), 0)))
            missing = [k for k in range(count) if k not in slots]
            if missing:
                present = self.call(lambda s, m=missing: [  # type: ignore[misc]
                    k for k in m if s.check([keys.r(n, f"slot/{k}")])])
                if present:
                    vals = self.call(lambda s, p=present: s.multi_get(  # type: ignore[misc]
                        [keys.r(n, f"slot/{k}") for k in p]))
                    slots.update({k: json.loads(v) for k, v in zip(present, vals)})
            if closed:
                return self._closed(n, json.loads(closed), slots, my_slot)
            valid = self._valid(slots)
            live = self.keeper.live_claimants()
            # restart rounds close once every live launcher is in; the first round waits the
            # last call for launchers still starting (torchrun semantics)
            everyone = n > 0 and set(live) <= {slots[k]["name"] for k in valid}
            if len(valid) >= spec.nnodes_min and min_at is None:
                min_at = time.monotonic()
            close = len(valid) >= spec.nnodes_max or (len(valid) >= spec.nnodes_min and (
                everyone or (min_at is not None and time.monotonic() - min_at >= st.last_call_s)))
            if close:
                chosen = json.dumps(valid[:spec.nnodes_max])
                self.call(lambda s, c=chosen: s.compare_set(  # type: ignore[misc]
                    keys.r(n, "closed"), "", c))
                continue
            if deadline.expired():
                return Round(n, "too_few", detail=(
                    f"only {len(valid)} of at least {spec.nnodes_min} node(s) joined round {n} "
                    f"within the join timeout ({st.join_timeout_s:g} s)"))
            if time.monotonic() >= next_note:  # a waiting node says what it waits for
                next_note = time.monotonic() + 30.0
                _log.info("round %d: %d node(s) joined (%s), waiting for %s; the job ends "
                          "(exit 1) if too few join within %.0f s more", n, len(valid),
                          ", ".join(slots[k]["name"] for k in valid) or "none",
                          f"at least {spec.nnodes_min}" if len(valid) < spec.nnodes_min
                          else f"up to {spec.nnodes_max} (last call)",
                          deadline.remaining())
            time.sleep(0.1)

    def _valid(self, slots: dict[int, dict[str, Any]]) -> list[int]:
        """Slots of live launchers, one per identity (its current owner), in join order."""
        assert self.keeper is not None
        owners = self.keeper.live_claimants()
        out, names = [], set()
        for k in sorted(slots):
            d = slots[k]
            if d["name"] in names or self.keeper.status(d["token"]) != "live":
                continue
            if d["name"] in owners and owners[d["name"]] != d["token"]:
                continue
            names.add(d["name"])
            out.append(k)
        return out

    def _closed(self, n: int, chosen: list[int], slots: dict[int, dict[str, Any]], my_slot: int
                ) -> Round:
        missing = [k for k in chosen if k not in slots]
        if missing:
            vals = self.call(lambda s: s.multi_get([self.keys.r(n, f"slot/{k}")
                                                    for k in missing]))
            slots.update({k: json.loads(v) for k, v in zip(missing, vals)})
        ordered = sorted(chosen, key=lambda k: (slots[k]["rank"] is None,
                                                slots[k]["rank"] or 0, slots[k]["name"]))
        members = [(slots[k]["name"], slots[k]["token"], slots[k]["addr"]) for k in ordered]
        if my_slot not in chosen:
            return Round(n, "spare", members, detail="full")
        return Round(n, "member", members, ordered.index(my_slot))

    def _state(self, n: int) -> Round | None:
        """A terminal or superseding state seen by the lease keeper, else None."""
        assert self.keeper is not None
        signum = self.interrupted()
        if signum:
            return Round(n, "signalled", detail=str(signum))
        if self.keeper.fenced:
            return Round(n, "fenced")
        if self.keeper.done:
            return Round(n, "done", detail=self.keeper.done)
        if self.keeper.round > n:
            return Round(n, "retry")
        return None

    def wait_change(self, n: int, timeout_s: float) -> Round | None:
        """Park until round ``n`` is superseded, the job is done or the lease is lost (checks
        every 0.1 s; at most ``timeout_s``)."""
        deadline = Deadline(timeout_s)
        while not deadline.expired():
            state = self._state(n)
            if state is not None:
                return state
            time.sleep(0.1)
        return None

    def publish_master(self, n: int, addr: str, port: int) -> None:
        self.call(lambda s: s.set(self.keys.r(n, "master"), f"{addr}:{port}"))

    def master(self, n: int) -> tuple[str, int] | Round:
        """The round's MASTER_ADDR/PORT (waits for group rank 0, at most the join timeout)."""
        key = self.keys.r(n, "master")
        deadline = Deadline(self.st.join_timeout_s)
        while not deadline.expired():
            state = self._state(n)
            if state is not None:
                return state
            if self.call(lambda s: s.check([key])):
                host, _, port = self.call(lambda s: s.get(key)).decode().rpartition(":")
                return host, int(port)
            time.sleep(0.05)
        return Round(n, "too_few", detail=f"round {n}: group rank 0 never published "
                                          "MASTER_ADDR/PORT")

    def succeeded(self, n: int, members: int) -> None:
        """Count this node's success in round ``n``; the last member marks the job done."""
        if int(self.call(lambda s: s.add(self.keys.r(n, "ok"), 1))) >= members:
            self.call(lambda s: s.compare_set(self.keys("done"), "", "ok"))

    def end_round(self, n: int, reason: str) -> None:
        self.call(lambda s: open_next_round(s, self.keys, n, reason, self.spec.max_restarts))

    def node_failed(self, reason: str) -> bool:
        """Count this node's own failure (failed health check, exclusion) against
        ``--ft-max-node-failures``; True when that exhausted the budget (the job is over).
        Best effort: a store error is logged and counts as not exhausted, so the node still
        leaves (its exclusion or failed check is never lost to a store hiccup)."""
        try:
            return bool(self.call(lambda s: self.budget.record(s, self.keys, self.token, reason)))
        except Exception as exc:  # noqa: BLE001 - as LeaseKeeper._count_failure
            _log.warning("could not count this node's failure (%s): %s", reason, exc)
            return False

    def finish(self, value: str) -> None:
        self.call(lambda s: s.compare_set(self.keys("done"), "", value))

    def close(self, final: str) -> None:
        """Stop the lease (``final`` = exit | left | ''), linger while hosting the store until
        every other launcher is gone (at most one lease timeout + 2 s), drop the server."""
        if self.keeper is not None:
            keeper, self.keeper = self.keeper, None
            keeper.stop(final)
            if self.server is not None:
                deadline = Deadline(self.spec.lease_s + 2.0)
                while not deadline.expired():
                    others = {t for t in keeper.live_claimants().values() if t != self.token}
                    if not others:
                        break
                    keeper._tick(renew=False)  # refresh the view only
                    time.sleep(self.spec.lease_interval_s)
            keeper.ds.close()
        self.ds.close()
        self.server = None
