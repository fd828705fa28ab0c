"""Fault injection for tests, demos and benchmarks: a declarative plan and a rank launcher.

A :class:`FaultPlan` lists :class:`Fault` entries keyed by ``(rank, iteration, step)``; the code
under test calls ``plan.check(rank, iteration, step)`` at each step and the matching fault fires
for real (an exception, ``sys.exit``, a signal to itself, a segfault, a hang). :func:`run_ranks`
launches N rank processes (``python -m trainguard.testing.faults module:function``) with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``TRAINGUARD_STORE_PORT`` set on free
ports, waits for them within a timeout (then terminates them) and collects each rank's JSON
result.

Follows: torchft's ``manager_integ_test`` injector (plan keyed by rank and step) and NVRx's
``inject_fault`` catalogue (kinds below).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainguard._core.net import free_port
from trainguard._core.procs import terminate_processes

__all__ = [
    "Fault",
    "FaultKind",
    "FaultPlan",
    "InjectedFault",
    "RankResult",
    "inject",
    "run_ranks",
]

PLAN_ENV = "TRAINGUARD_FAULT_PLAN"
RESULT_ENV = "TRAINGUARD_RESULT_FILE"


class FaultKind(str, enum.Enum):
    """What a fault does to the process that hits it."""

    RAISE = "raise"  # raise InjectedFault (an Exception): in-process restart
    EXIT = "exit"  # sys.exit(exit_code) (SystemExit, a BaseException): the rank leaves
    OS_EXIT = "os_exit"  # os._exit(exit_code): the process vanishes without cleanup
    SIGKILL = "sigkill"
    SIGTERM = "sigterm"
    SIGSEGV = "sigsegv"  # a real segmentation fault (read of address 0)
    SIGSTOP = "sigstop"  # the process stops itself
    HANG_SLEEP = "hang_sleep"  # time.sleep(duration_s): stuck in a C call, GIL released
    HANG_GIL = "hang_gil"  # catastrophic regex: stuck in C code holding the GIL


class InjectedFault(RuntimeError):
    """The exception raised by :attr:`FaultKind.RAISE`."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault.

    Attributes:
        rank: rank that faults (compare with the rank the caller passes to ``check``).
        kind: see :class:`FaultKind`.
        iteration: restart iteration it fires in (None: any).
        step: training step it fires at (None: any).
        duration_s: length of a HANG_SLEEP (seconds); HANG_GIL runs until killed.
        exit_code: exit code of EXIT / OS_EXIT.
    """

    rank: int
    kind: FaultKind
    iteration: int | None = None
    step: int | None = None
    duration_s: float = 3600.0
    exit_code: int = 1

    def matches(self, rank: int, iteration: int | None, step: int | None) -> bool:
        return (rank == self.rank
                and (self.iteration is None or self.iteration == iteration)
                and (self.step is None or self.step == step))


class FaultPlan:
    """An ordered list of faults; each fires at most once per process.

    Raises:
        ValueError: an unknown fault kind when decoding.
    """

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self.faults = [dataclasses.replace(f, kind=FaultKind(f.kind)) for f in faults]
        self.fired: list[Fault] = []

    def to_json(self) -> str:
        return json.dumps([{**dataclasses.asdict(f), "kind": f.kind.value} for f in self.faults])

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        return cls(Fault(**d) for d in json.loads(text))

    def to_env(self) -> dict[str, str]:
        return {PLAN_ENV: self.to_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan:
        env = os.environ if environ is None else environ
        return cls.from_json(env[PLAN_ENV]) if env.get(PLAN_ENV) else cls()

    def check(self, rank: int, iteration: int | None = None, step: int | None = None) -> None:
        """Fire the first not-yet-fired fault matching ``(rank, iteration, step)``."""
        for fault in self.faults:
            if fault not in self.fired and fault.matches(rank, iteration, step):
                self.fired.append(fault)
                inject(fault.kind, fault.duration_s, fault.exit_code,
                       f"rank {rank} iteration {iteration} step {step}")
                return


def inject(kind: FaultKind | str, duration_s: float = 3600.0, exit_code: int = 1,
           where: str = "") -> None:
    """Make the fault happen now, in this process."""
    kind = FaultKind(kind)
    sys.stdout.flush()
    sys.stderr.flush()
    if kind is FaultKind.RAISE:
        raise InjectedFault(f"injected fault ({where})")
    if kind is FaultKind.EXIT:
        sys.exit(exit_code)
    if kind is FaultKind.OS_EXIT:
        os._exit(exit_code)
    if kind is FaultKind.SIGSEGV:
        ctypes.string_at(0)
    if kind is FaultKind.HANG_SLEEP:
        time.sleep(duration_s)
        return
    if kind is FaultKind.HANG_GIL:
        re.match(r"(a|aa)+$", "a" * 80 + "b")  # exponential backtracking, GIL held
        return
    sig = {FaultKind.SIGKILL: signal.SIGKILL, FaultKind.SIGTERM: signal.SIGTERM,
           FaultKind.SIGSTOP: signal.SIGSTOP}[kind]
    os.kill(os.getpid(), sig)
    time.sleep(0.5)  # a stopped or dying process must not run on meanwhile


@dataclasses.dataclass
class RankResult:
    """Outcome of one launched rank: exit code, output, and its JSON result (None if none)."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    result: Any
    wall_s: float


def run_ranks(
    target: str,
    world_size: int,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    plan: FaultPlan | None = None,
    pythonpath: Sequence[str] = (),
    python: str = sys.executable,
) -> list[RankResult]:
    """Run ``target`` ("module:function") on ``world_size`` rank processes; collect results.

    Each rank calls ``function()`` and its JSON-serialisable return value becomes
    ``RankResult.result``. Blocks at most ``timeout_s`` seconds plus a 5 s shutdown; ranks still
    running then are terminated (SIGTERM, grace, SIGKILL) and reaped, their returncode is the
    signal's negative number.
    """
    with tempfile.TemporaryDirectory(prefix="tg-ranks-") as tmp:
        base = dict(os.environ)
        base.update({
            "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "TRAINGUARD_STORE_PORT": str(free_port()),
            "PYTHONUNBUFFERED": "1",
        })
        if pythonpath:
            base["PYTHONPATH"] = os.pathsep.join([*pythonpath, base.get("PYTHONPATH", "")])
        if plan is not None:
            base.update(plan.to_env())
        base.update(env or {})
        procs, files = [], []
        start = time.monotonic()
        for rank in range(world_size):
            out = open(os.path.join(tmp, f"rank{rank}.out"), "w+")  # noqa: SIM115
            err = open(os.path.join(tmp, f"rank{rank}.err"), "w+")  # noqa: SIM115
            rank_env = {**base, "RANK": str(rank),
                        RESULT_ENV: os.path.join(tmp, f"rank{rank}.json")}
            procs.append(subprocess.Popen([python, "-m", "trainguard.testing.faults", target],
                                          env=rank_env, stdout=out, stderr=err))
            files.append((out, err))
        return _collect(procs, files, tmp, start, timeout_s)


def _collect(procs, files, tmp, start, timeout_s) -> list[RankResult]:
    ends: dict[int, float] = {}
    deadline = start + timeout_s
    while len(ends) < len(procs) and time.monotonic() < deadline:
        for rank, p in enumerate(procs):
            if rank not in ends and p.poll() is not None:
                ends[rank] = time.monotonic()
        time.sleep(0.02)
    terminate_processes([p for p in procs if p.poll() is None], grace_s=2.0)
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        path = os.path.join(tmp, f"rank{rank}.json")
        value = None
        if os.path.exists(path):
            with open(path) as fh:
                value = json.load(fh)
        results.append(RankResult(rank, p.returncode, out.read(), err.read(), value,
                                  ends.get(rank, time.monotonic()) - start))
        out.close()
        err.close()
    return results


def _main(argv: Sequence[str]) -> int:
    module, _, func = argv[0].partition(":")
    fn = getattr(importlib.import_module(module), func)
    value = fn()
    path = os.environ.get(RESULT_ENV)
    if path:
        with open(path + ".tmp", "w") as fh:
            json.dump(value, fh)
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    try:
        code = _main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the exit code says it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torch's takes seconds on a busy machine)
