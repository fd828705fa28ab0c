"""Process-wide pool of warm, idle checkpoint writer processes (one trainer process).

A writer process costs a fresh interpreter that imports torch (1-2 s idle, 5-26 s on a loaded
2-core machine). Under in-process restart a checkpointer made inside the wrapped function is made
anew every iteration, so without the pool every iteration paid that start. The pool keeps idle
writers instead:

* ``AsyncCheckpointer.abort()`` (restart) parks its idle writer here (the worker unmaps every arena
  it was sent, ``op: reset``); a busy one is killed and a replacement is spawned here at once, so
  it imports torch while the restart goes on;
* an idle writer that dies unasked (``kill -9``, the OOM killer) is replaced here at once, by
  the thread that noticed the death (``_writer``), so the next save takes the replacement;
* a new or aborted checkpointer takes a writer with the same ``nice`` from here before spawning;
* ``__exit__`` with an exception and the finalizer of an abandoned checkpointer park its idle
  writer too; ``close()`` stops it;
* a reserve rank under ``inprocess.Wrapper`` fills the pool to :func:`prewarm_writers` writers
  (``_core.hooks`` standby callback) and imports the trainer-side DCP modules, so the
  checkpointers it makes when it becomes active start warm;
* a checkpointer with a spare writer (``AsyncCheckpointer(spare_writer=...)``; by default on
  inside an in-process restart loop once an abort there killed a busy writer) keeps one warm
  idle writer of its ``nice`` in the pool
  (:func:`want_spare`): when an abort kills its busy writer, the next save takes the spare,
  which imported torch long before, instead of the replacement started at the abort.

At most :data:`MAX_IDLE` writers are pooled, plus one per checkpointer that keeps a spare
(:func:`capacity`; more are stopped). Pooled writers are stopped at
interpreter exit (atexit) and by ``_core.hooks.run_release_callbacks`` (the leak checker); they
also exit by themselves within ~1 s of the trainer's death (``_worker`` watches its parent).
Thread-safe (one lock; process starts and stops happen outside it).

Follows: the worker pools of ``multiprocessing.Pool`` / ``concurrent.futures`` in spirit;
difference: a worker is lent to one owner at a time and returned only when idle.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref

from trainguard._core.hooks import register_release_callback, register_standby_callback
from trainguard._core.logging import get_logger
from trainguard.checkpointing.async_ckpt._writer import WriterDied, WriterProcess
from trainguard.errors import ConfigError

__all__ = ["MAX_IDLE", "busy_kills", "capacity", "drain", "fill", "idle_pids", "note_busy_kill",
           "park", "prewarm_writers", "spare_enabled", "spare_forced", "spawn", "take",
           "unwant_spare", "want_spare"]

_log = get_logger("trainguard.checkpointing")
MAX_IDLE = 4  # idle writers kept at most (each an interpreter with torch imported)
_DISABLE_ENV = "TRAINGUARD_CKPT_WRITER_POOL"  # "0": no pool (the benchmark's baseline)
_lock = threading.Lock()
_idle: list[WriterProcess] = []
_state: dict = {"prewarm": 2, "closed": False, "standby_calls": 0, "excess_since": None,
                "busy_kills": 0}
_prewarm_thread: list[threading.Thread] = []
_cancel = threading.Event()  # drain(): a pre-warm waiting for a writer to start gives up
# "0": no spare writers, whatever the argument; "1": spare_writer=None keeps them from the start
_SPARE_ENV = "TRAINGUARD_CKPT_SPARE_WRITER"
# A spare waits this long at most for its owners' own cold writers to finish importing torch
# (the imports would compete for CPU), then starts anyway.
SPARE_START_DELAY_S = 30.0
_wanting: weakref.WeakSet[WriterProcess] = weakref.WeakSet()  # handles that want a spare
_spare_wake = threading.Event()
_spare_stop = threading.Event()
_spare_thread: list[threading.Thread] = []


def enabled() -> bool:
    """False when the environment sets ``TRAINGUARD_CKPT_WRITER_POOL=0`` (every writer cold)."""
    return os.environ.get(_DISABLE_ENV, "1") != "0" and not _state["closed"]


def take(nice: int, warm_dcp: bool = False) -> WriterProcess | None:
    """Pop a live pooled writer started with ``nice`` (dead ones are reaped), or None.

    Preferred, in order: one that has imported torch and whose DCP import matches ``warm_dcp``
    (a DCP writer's import of DCP takes ~1 s more; a torch-format owner leaves those to DCP
    owners), then any that has imported torch, then one still starting; the newest first
    within each (the writer an abort just parked is taken back, a spare stays a spare)."""
    if not enabled():
        return None
    dead: list[WriterProcess] = []
    found = None
    with _lock:
        for w in list(_idle):
            if not w.alive():
                _idle.remove(w)
                dead.append(w)
        live = [w for w in _idle if w.nice == nice]
        _poll_ready(live)
        found = None
        for fits in (lambda w: w.ready and w.warm_dcp == warm_dcp, lambda w: w.ready,
                     lambda w: w.warm_dcp == warm_dcp, lambda w: True):
            found = next((w for w in reversed(live) if fits(w) and w.alive()), None)
            if found is not None:
                break
        if found is not None:
            _idle.remove(found)
            found.pooled = False
    for w in dead:
        w.stop(grace_s=0.0)
    if found is not None:
        _spare_wake.set()  # a spare was maybe taken: start the next one
    return found


def park(writer: WriterProcess) -> bool:
    """Keep an idle writer handle for reuse; True if kept. Stopped instead (up to ~4 s) when the
    pool is full, disabled or shut down, or the writer is not alive."""
    if enabled() and writer.alive():
        with _lock:
            if len(_idle) < _capacity():
                writer.pooled = True
                _idle.append(writer)
                return True
    writer.stop(grace_s=2.0)
    return False


def spawn(rank: int, nice: int = 0, ready_timeout_s: float = 0.0, warm_dcp: bool = False,
          stop: threading.Event | None = None) -> bool:
    """Start a new writer into the pool; False (nothing started) when the pool is full or
    disabled. With ``ready_timeout_s`` > 0 it is pooled only once ready (blocks up to that long;
    one that is not ready by then is pooled anyway), else at once (it imports torch meanwhile).
    ``warm_dcp``: it also imports DCP's write modules right after torch (a replacement for a
    DCP checkpointer's writer, or a reserve in a process that uses DCP). ``stop``: an extra
    event that, like :func:`drain`, makes a wait for readiness give up (the writer is stopped)."""
    if not enabled():
        return False
    with _lock:
        if len(_idle) >= _capacity():
            return False

    def cancelled() -> bool:
        return _cancel.is_set() or (stop is not None and stop.is_set())

    writer = WriterProcess(rank, nice, warm_dcp)
    writer.spawn()
    try:  # ps: "(pooled, idle)" from the start, like a writer parked after use
        writer.send_now({"op": "reset"})
    except WriterDied:
        writer.stop(grace_s=0.0)
        return False
    deadline = time.monotonic() + ready_timeout_s
    try:
        while not writer.ready and time.monotonic() < deadline and not cancelled():
            writer.recv(min(0.5, max(0.0, deadline - time.monotonic())))
    except WriterDied:
        writer.stop(grace_s=0.0)
        return False
    if cancelled():
        writer.stop(grace_s=0.0)
        return False
    return park(writer)


def fill(n: int, rank: int = -1, nice: int = 0, ready_timeout_s: float = 120.0,
         warm_dcp: bool = False) -> int:
    """Spawn writers (``nice``) into the pool until it holds ``n`` (capped at MAX_IDLE), one at
    a time: each is pooled once ready (up to ``ready_timeout_s``), so the imports do not compete
    with each other for CPU. Blocks for their start-ups; returns how many were started.
    ``warm_dcp``: see :func:`spawn`."""
    started = 0
    while enabled():
        with _lock:
            have = sum(1 for w in _idle if w.nice == nice)
            if have >= min(n, MAX_IDLE) or len(_idle) >= MAX_IDLE:
                break
        if not spawn(rank, nice, ready_timeout_s, warm_dcp):
            break
        started += 1
    return started


def _poll_ready(writers: list[WriterProcess]) -> None:
    """Read the ready message of pooled writers that sent it (never blocks; with ``_lock``
    held: nobody else reads a pooled writer's socket)."""
    for w in writers:
        if not w.ready:
            try:
                w.poll_ready()
            except WriterDied:
                pass


def _capacity() -> int:
    """Call with ``_lock`` held: see :func:`capacity`."""
    return MAX_IDLE + len(_wanting)


def capacity() -> int:
    """Writers the pool keeps at most: :data:`MAX_IDLE`, plus one per live checkpointer that
    keeps a spare (its spare must not crowd out the writers an abort parks)."""
    with _lock:
        return _capacity()


TRIM_AFTER_S = 10.0  # pooled writers beyond capacity() for this long are stopped


def _trim(now: float) -> None:
    """Stop the oldest pooled writers beyond :func:`capacity` once the excess has lasted
    :data:`TRIM_AFTER_S` (checkpointers that kept spares were closed; during an in-process
    restart the excess is momentary: the aborted iteration's checkpointers are collected while
    their parked writers wait for the next iteration's); blocks for their exit (~0.1 s each)."""
    with _lock:
        extra = len(_idle) - _capacity()
        if extra <= 0:
            _state["excess_since"] = None
            return
        since = _state.setdefault("excess_since", None) or now
        _state["excess_since"] = since
        if now - since < TRIM_AFTER_S:
            return
        stop = _idle[:extra]
        del _idle[:extra]
        _state["excess_since"] = None
    for w in stop:
        w.stop(grace_s=2.0)


def idle_pids(ready_only: bool = False) -> list[int]:
    """Pids of the pooled writers (``ready_only``: of those that have imported torch), for
    tests and diagnostics."""
    with _lock:
        if ready_only:
            _poll_ready(_idle)
        return [w.pid for w in _idle if w.pid is not None and (w.ready or not ready_only)]


def drain(grace_s: float = 2.0) -> int:
    """Stop every pooled writer (asked to exit, SIGKILL after ``grace_s``, reaped); returns how
    many. A running pre-warm and the spare keeper are stopped first (a writer they are starting
    is stopped; ~1 s), and no spare is kept until a checkpointer asks again
    (:func:`want_spare`). Blocks up to ~``grace_s`` + 2 s per writer."""
    _cancel.set()
    _spare_stop.set()
    _spare_wake.set()
    try:
        for t in [*_prewarm_thread, *_spare_thread]:
            t.join(10.0)
    finally:
        with _lock:
            _wanting.clear()
            _spare_thread.clear()
        _spare_stop.clear()
        _cancel.clear()
    with _lock:
        writers = list(_idle)
        _idle.clear()
    for w in writers:
        try:
            w.stop(grace_s=grace_s)
        except WriterDied:  # pragma: no cover - stop() does not raise it; keep draining
            pass
    return len(writers)


def prewarm_writers(n: int) -> int:
    """Set how many warm checkpoint writers a reserve rank keeps ready; returns the old value.

    A reserve (inactive) rank under ``inprocess.Wrapper`` makes no checkpointers until it becomes
    active, and then makes them all at once: each would start a writer process that imports
    torch, competing for CPU exactly when the restart needs it. While a rank waits as a reserve,
    the Wrapper runs the ``_core.hooks`` standby callbacks; from the second such wait on (not
    at job start, where the active ranks start their own writers), checkpointing's fills this
    process's writer pool up to ``n`` writers (``writer_nice=0``, one at a time) and imports the
    trainer-side DCP planner modules, in a background thread; when the trainer has imported
    ``torch.distributed.checkpoint`` by then, the pooled writers import DCP's write modules too
    (a cold DCP import takes seconds). The checkpointers made when the rank becomes active take
    these writers warm. Active ranks are not affected. A ``format="dcp"`` checkpointer asks every
    writer it gets (new or pooled) to import DCP at once, whatever this setting.

    Memory cost: each pooled writer is one idle interpreter with torch imported: measured with
    torch 2.13 (CPU build, x86-64, Python 3.11) at 275 MiB RSS, of which 146 MiB is its own
    (USS; the rest is shared library pages), and no GPU memory. ``0`` disables pre-warming.
    Default 2. Returns at once; the writers start when the rank next waits as a reserve.

    Args:
        n: writers to keep warm on a reserve rank, 0 to ``MAX_IDLE`` (4).

    Raises:
        ConfigError: ``n`` is not an int in that range.

    Follows: nothing in NVRx/torchft (their reserve ranks start checkpoint workers cold).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_IDLE:
        raise ConfigError(f"prewarm_writers(n) needs an int from 0 to {MAX_IDLE}, got {n!r}")
    old, _state["prewarm"] = _state["prewarm"], n
    return int(old)


def _prewarm() -> None:
    """Reserve rank (background thread): fill the pool, import the DCP planner's modules."""
    try:
        # a trainer that imported DCP writes DCP: its pooled writers import it too
        fill(int(_state["prewarm"]), int(os.environ.get("RANK", "-1")),
             warm_dcp="torch.distributed.checkpoint" in sys.modules)
        from trainguard.checkpointing.async_ckpt._dcp_plan import import_dcp

        import_dcp()
    except Exception:  # noqa: BLE001 - a failed pre-warm only means a cold start later
        _log.exception("pre-warming checkpoint writers failed")


def on_standby() -> None:
    """``_core.hooks`` standby callback: start :func:`_prewarm` in a named thread (once at a
    time); returns at once. The first call of the process does nothing: at job start every
    active rank is starting its own writers, and pre-warming then would compete with them for
    CPU; a reserve is needed only after a rank left, i.e. after a restart."""
    _state["standby_calls"] += 1
    if int(_state["prewarm"]) <= 0 or not enabled() or _state["standby_calls"] < 2:
        return
    with _lock:
        if any(t.is_alive() for t in _prewarm_thread):
            return
        _prewarm_thread.clear()
        t = threading.Thread(target=_prewarm, name="trainguard-ckpt-prewarm", daemon=True)
        _prewarm_thread.append(t)
    t.start()


def note_busy_kill() -> None:
    """An abort killed a writer busy with a save (counted; see :func:`busy_kills`)."""
    with _lock:
        _state["busy_kills"] = int(_state.get("busy_kills", 0)) + 1


def busy_kills() -> int:
    """Writers killed busy by an abort inside an in-process restart loop in this process: from
    the first on, ``AsyncCheckpointer(spare_writer=None)`` keeps a spare writer."""
    return int(_state.get("busy_kills", 0))


def spare_forced() -> bool:
    """``TRAINGUARD_CKPT_SPARE_WRITER=1``: ``spare_writer=None`` keeps a spare from the start."""
    return os.environ.get(_SPARE_ENV, "") == "1"


def spare_enabled() -> bool:
    """False when the pool is disabled or the environment sets
    ``TRAINGUARD_CKPT_SPARE_WRITER=0``."""
    return enabled() and os.environ.get(_SPARE_ENV, "1") != "0"


def want_spare(writer: WriterProcess) -> None:
    """Keep one warm idle writer with ``writer.nice`` in the pool for the handle ``writer`` while
    it has a process attached (until :func:`unwant_spare` or :func:`drain`): N such handles of
    one ``nice`` keep N spares (see :func:`capacity`). Returns at once.

    A background thread (``trainguard-ckpt-spare``) starts the spare once the owners' own
    writers are ready (at most :data:`SPARE_START_DELAY_S` after they started, so their torch
    imports do not compete), pools it once it has imported torch (it goes on to import DCP's
    write modules when an owner writes DCP), and starts another whenever a checkpointer takes
    it. Costs one idle
    interpreter with torch imported per such handle (see :func:`prewarm_writers`)."""
    if not spare_enabled():
        return
    with _lock:
        _wanting.add(writer)
        if not any(t.is_alive() for t in _spare_thread):
            _spare_thread.clear()
            t = threading.Thread(target=_keep_spares, name="trainguard-ckpt-spare", daemon=True)
            _spare_thread.append(t)
            t.start()
    _spare_wake.set()


def unwant_spare(writer: WriterProcess) -> None:
    """The handle no longer needs a spare (its checkpointer is closed); never blocks."""
    with _lock:
        _wanting.discard(writer)
    _spare_wake.set()


def _spare_due() -> tuple[int, int, bool] | None:
    """(rank, nice, warm_dcp) of a spare to start now, or None: every attached writer that
    wants a spare has one idle writer of its ``nice`` in the pool (or the pool is full), or an
    owner's own writer is still starting."""
    now = time.monotonic()
    with _lock:
        owners = [w for w in _wanting if w.proc is not None]
        have = [(w.nice, w.warm_dcp) for w in _idle]
        full = len(_idle) >= _capacity()
    if full:
        return None
    for key in sorted({(w.nice, w.warm_dcp) for w in owners}):
        group = [w for w in owners if (w.nice, w.warm_dcp) == key]
        if have.count(key) >= len(group):
            continue
        if any(not w.ready and now - w.started_at < SPARE_START_DELAY_S for w in owners):
            continue  # an owner's own writer is still importing torch: do not compete
        return group[0].rank, key[0], key[1]
    return None


def _keep_spares() -> None:
    """The spare keeper: see :func:`want_spare`. Exits once no handle wants a spare, or at
    :func:`drain`."""
    while not _spare_stop.is_set() and spare_enabled():
        _spare_wake.wait(0.5)
        _spare_wake.clear()
        if _spare_stop.is_set():
            return
        _trim(time.monotonic())
        with _lock:
            if not _wanting and len(_idle) <= MAX_IDLE:
                _spare_thread.clear()
                return
        due = _spare_due()
        if due is None:
            continue
        rank, nice, warm_dcp = due
        try:
            if spawn(rank, nice, ready_timeout_s=120.0, warm_dcp=warm_dcp, stop=_spare_stop):
                _log.debug("spare checkpoint writer of rank %d is ready in the pool", rank)
            else:
                _spare_stop.wait(5.0)  # could not start or pool full: do not spin
        except Exception:  # noqa: BLE001 - a missing spare only means a cold start later
            _log.exception("starting a spare checkpoint writer failed")
            _spare_stop.wait(5.0)


def _release_idle() -> None:
    drain()


def _at_exit() -> None:
    _state["closed"] = True
    drain(grace_s=1.0)


atexit.register(_at_exit)
register_standby_callback("trainguard.checkpointing.writer_pool", on_standby)
register_release_callback("trainguard.checkpointing.writer_pool", _release_idle)
