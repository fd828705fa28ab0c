"""Store layout, interruption records and restart-latency records of one wrapped call.

Every key lives under ``tg/c<call>/`` where ``<call>`` is a per-call number taken from the store
(``add`` on a per-initial-rank counter), so a persistent store can serve any number of calls;
per-iteration keys live under ``tg/c<call>/i<iteration>/``. Times in records are wall-clock
``time.time()`` so processes on one host can be compared; deadlines use the monotonic clock.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard._core.net import free_port
from trainguard.errors import ConfigError

__all__ = [
    "Cause",
    "Interruption",
    "Keys",
    "RestartRecord",
    "StoreAddress",
    "default_store",
    "mark_terminated",
    "read_int_set",
    "read_interruptions",
    "read_members",
    "record_interruption",
    "resolve_store_address",
]

STORE_PORT_ENV = "TRAINGUARD_STORE_PORT"


class Cause(str, enum.Enum):
    """Why an iteration was interrupted."""

    EXCEPTION = "exception"  # an Exception on some rank: global restart, the rank stays
    EXIT = "exit"  # a BaseException took the rank out (SystemExit, failed finalize, ...)
    HEALTH_CHECK = "health_check"  # the restart health check failed: the rank left
    SOFT_TIMEOUT = "soft_timeout"  # no progress for soft_timeout: restart, the rank stays
    HARD_TIMEOUT = "hard_timeout"  # no progress for hard_timeout: the rank was killed
    TERMINATED = "terminated"  # the rank's process died (signal, segfault, os._exit)
    UNRESPONSIVE = "unresponsive"  # the sibling heartbeat of the rank went stale
    UNKNOWN = "unknown"  # interrupted without a readable record


@dataclasses.dataclass(frozen=True)
class Interruption:
    """One interruption record in the store.

    Attributes:
        cause: see :class:`Cause`.
        initial_rank: initial rank of the faulting process.
        fault_time: wall-clock time of the fault (raise, last progress, death noticed), seconds.
        detection_time: wall-clock time the fault was recorded in the store, seconds.
        message: short description (exception repr, signal, elapsed time).
        secondary: the fault looks like a consequence of another rank's fault (a collective
            failed because a peer died or was aborted); such records do not name fault ranks
            when a primary record exists.
    """

    cause: str
    initial_rank: int
    fault_time: float
    detection_time: float
    message: str = ""
    secondary: bool = False  # a consequence of another fault (peer connection broken)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Interruption:
        return cls(**json.loads(text))


@dataclasses.dataclass
class RestartRecord:
    """Latency record of one restart, as seen by one rank.

    Attributes:
        iteration: the iteration that was interrupted (the restart enters ``iteration + 1``).
        cause: cause of the earliest interruption record (see :class:`Cause`).
        fault_ranks: initial ranks named by the interruption records.
        fault_time: wall-clock time of the earliest fault, seconds (``time.time()``).
        detection_time: wall-clock time the earliest fault was recorded in the store, seconds.
        interrupt_time: wall-clock time this rank's main thread was interrupted, seconds.
        reentry_time: wall-clock time this rank re-entered the wrapped function (or started
            idling as a reserve rank), seconds; None until then.
        message: the interruption summary.
    """

    iteration: int
    cause: str
    fault_ranks: tuple[int, ...]
    fault_time: float
    detection_time: float
    interrupt_time: float
    reentry_time: float | None = None
    message: str = ""

    @property
    def detection_s(self) -> float:
        """Seconds from the fault to its record in the store."""
        return self.detection_time - self.fault_time

    @property
    def restart_s(self) -> float | None:
        """Seconds from the fault to this rank's re-entry (None before re-entry)."""
        return None if self.reentry_time is None else self.reentry_time - self.fault_time

    @classmethod
    def from_interruptions(
        cls, iteration: int, records: list[Interruption], interrupt_time: float
    ) -> RestartRecord:
        if not records:  # interrupted without a readable record: use our own clock
            return cls(iteration, Cause.UNKNOWN.value, (), interrupt_time, interrupt_time,
                       interrupt_time)
        records = [r for r in records if not r.secondary] or records
        first = min(records, key=lambda r: r.fault_time)
        return cls(
            iteration=iteration,
            cause=first.cause,
            fault_ranks=tuple(sorted({r.initial_rank for r in records})),
            fault_time=first.fault_time,
            detection_time=min(r.detection_time for r in records),
            interrupt_time=interrupt_time,
            message=summarize(records),
        )


def summarize(records: list[Interruption]) -> str:
    """Human summary such as ``"exception on ranks [1]; terminated on ranks [3]"``."""
    by_cause: dict[str, set[int]] = {}
    for rec in [r for r in records if not r.secondary] or records:
        by_cause.setdefault(rec.cause, set()).add(rec.initial_rank)
    return "; ".join(f"{c} on ranks {sorted(r)}" for c, r in by_cause.items()) or "no record"


class Keys:
    """Key names of one call; ``it(i, name)`` are per-iteration keys."""

    def __init__(self, call_id: int) -> None:
        self.call_id = call_id
        self.base = f"tg/c{call_id}"

    @staticmethod
    def call_counter(initial_rank: int) -> str:
        return f"tg/calls/{initial_rank}"

    def it(self, iteration: int, name: str) -> str:
        return f"{self.base}/i{iteration}/{name}"

    @property
    def init_barrier(self) -> str:
        return f"{self.base}/init"

    @property
    def term_barrier(self) -> str:
        return f"{self.base}/term"

    @property
    def terminated_all(self) -> str:
        return f"{self.base}/terminated"

    def heartbeat(self, initial_rank: int) -> str:
        return f"{self.base}/hb/{initial_rank}"

    def pg_prefix(self, iteration: int) -> str:
        return f"{self.base}/i{iteration}/pg/"

    def user_prefix(self, iteration: int) -> str:
        """Namespace of a plain ``init_process_group``'s own store in ``iteration``."""
        return f"{self.base}/i{iteration}/user/"

    def assignment_prefix(self, iteration: int | None) -> str:
        tail = "ra_init" if iteration is None else f"i{iteration}/ra"
        return f"{self.base}/{tail}/"


def record_interruption(store: dist.Store, keys: Keys, iteration: int, rec: Interruption) -> None:
    """Append ``rec`` to iteration ``iteration`` and raise its flags (interrupted, event)."""
    store.append(keys.it(iteration, "records"), rec.to_json() + "\n")
    store.set(keys.it(iteration, "interrupted"), b"1")
    store.set(keys.it(iteration, "event"), b"1")


def read_interruptions(store: dist.Store, keys: Keys, iteration: int) -> list[Interruption]:
    key = keys.it(iteration, "records")
    if not store.check([key]):
        return []
    lines = store.get(key).decode().splitlines()
    return [Interruption.from_json(line) for line in lines if line.strip()]


_COMM_ERROR_TEXT = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl",
                    "socket", "timed out")


def is_comm_error(exc: BaseException) -> bool:
    """True when ``exc`` or an exception in its cause/context chain looks like a failed
    collective, store wait or transport (a peer died, or the abort shut the socket): a
    ``torch.distributed.DistError``, a ``ConnectionError``, or a ``RuntimeError`` whose text
    names the transport (c10d raises plain RuntimeErrors)."""
    dist_error = getattr(dist, "DistError", None)
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        if dist_error is not None and isinstance(cur, dist_error):
            return True
        if isinstance(cur, ConnectionError):
            return True
        text = str(cur).lower()
        if isinstance(cur, RuntimeError) and any(t in text for t in _COMM_ERROR_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def is_interrupted(store: dist.Store, keys: Keys, iteration: int) -> bool:
    return bool(store.check([keys.it(iteration, "interrupted")]))


def read_int_set(store: dist.Store, key: str) -> set[int]:
    if not store.check([key]):
        return set()
    return {int(x) for x in store.get(key).decode().split(",") if x}


def mark_terminated(store: dist.Store, keys: Keys, iteration: int, initial_rank: int) -> None:
    """Mark an initial rank terminated in ``iteration`` and for the whole call."""
    store.append(keys.it(iteration, "terminated"), f"{initial_rank},")
    store.append(keys.terminated_all, f"{initial_rank},")


def report_departure(
    store: dist.Store, keys: Keys, iteration: int, rec: Interruption, count: int
) -> int:
    """Record that ``rec.initial_rank`` left, mark it terminated and arrive for it.

    The iteration barrier keeps the terminated set consistent: a rank that already arrived at
    iteration ``iteration``'s barrier may have been counted in by the survivors, so it is
    reported in ``iteration + 1`` instead (the survivors restart once more without it).
    ``count`` must not exceed the barrier's real count (pass an upper bound when unsure).
    Returns the iteration the departure was recorded in.
    """
    from trainguard._core.store import reentrant_arrivals, reentrant_barrier

    target = iteration
    if rec.initial_rank in reentrant_arrivals(store, keys.it(iteration, "barrier")):
        target = iteration + 1
    record_interruption(store, keys, target, rec)
    mark_terminated(store, keys, target, rec.initial_rank)
    reentrant_barrier(store, keys.it(target, "barrier"), [rec.initial_rank], count, 0.0)
    return target


def publish_member(store: dist.Store, keys: Keys, iteration: int, initial: int, rank: int) -> None:
    store.append(keys.it(iteration, "members"), f"{initial}:{rank},")


def read_members(store: dist.Store, keys: Keys, iteration: int) -> dict[int, int]:
    """``{initial_rank: rank}`` of the ranks that started ``iteration``."""
    key = keys.it(iteration, "members")
    if not store.check([key]):
        return {}
    pairs = (p.split(":") for p in store.get(key).decode().split(",") if p)
    return {int(a): int(b) for a, b in pairs}


def terminated_ranks(
    members: dict[int, int], terminated_initial: set[int], world_size: int
) -> set[int]:
    """Current ranks of the terminated initial ranks.

    A rank that died before publishing its membership gets one of the unclaimed rank numbers,
    paired in order (rank assignment preserves order for the common Shift case).
    """
    out = {members[i] for i in terminated_initial if i in members}
    missing_initial = sorted(i for i in terminated_initial if i not in members)
    free = sorted(set(range(world_size)) - set(members.values()))
    out.update(free[: len(missing_initial)])
    return out


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    timeout_s: float


def resolve_store_address(
    store_kwargs: Mapping[str, Any], world_size: int, environ: Mapping[str, str] | None = None
) -> StoreAddress:
    """Address of the default TCPStore.

    Host: ``store_kwargs['host']`` > ``MASTER_ADDR`` > ``127.0.0.1``. Port: ``store_kwargs['port']``
    > ``TRAINGUARD_STORE_PORT`` > ``MASTER_PORT + 1`` > a free port (single rank only).

    Raises:
        ConfigError: no port source with ``WORLD_SIZE > 1``, or a value is not an integer.
    """
    env = os.environ if environ is None else environ
    host = str(store_kwargs.get("host") or env.get("MASTER_ADDR") or "127.0.0.1")
    timeout = store_kwargs.get("timeout", timedelta(seconds=300))
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    try:
        if store_kwargs.get("port") is not None:
            port = int(store_kwargs["port"])
        elif env.get(STORE_PORT_ENV):
            port = int(env[STORE_PORT_ENV])
        elif env.get("MASTER_PORT"):
            port = int(env["MASTER_PORT"]) + 1
        elif world_size == 1:
            port = free_port(host)
        else:
            raise ConfigError(
                f"the default TCPStore needs a port with WORLD_SIZE={world_size}: set "
                f"store_kwargs={{'port': ...}}, {STORE_PORT_ENV}, or MASTER_PORT (port+1 is used)"
            )
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"store port must be an integer: {exc}") from exc
    return StoreAddress(host, port, timeout_s)


def default_store(addr: StoreAddress, is_master: bool) -> dist.TCPStore:
    """Connect to (or host, for the monitor process of initial rank 0) the default TCPStore."""
    return dist.TCPStore(
        addr.host,
        addr.port,
        world_size=None,
        is_master=is_master,
        timeout=timedelta(seconds=addr.timeout_s),
        wait_for_workers=False,
    )


def clone_store(store: dist.Store) -> dist.Store:
    """A store with its own connection where the store supports it (TCPStore), else ``store``."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


def now() -> float:
    return time.time()
