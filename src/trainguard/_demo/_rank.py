"""Entry point of one demo rank: ``python -m trainguard._demo._rank CONFIG_JSON``.

The launcher sets ``RANK`` (initial rank), ``WORLD_SIZE`` (active + reserve processes),
``MASTER_ADDR`` and ``MASTER_PORT`` (the wrapper's coordination store). Exit status: 0 when the
rank finished (trained to the end, or stayed in reserve), 1 when the wrapper took it out.
"""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta

import torch

from trainguard._demo._config import DemoConfig
from trainguard._demo._events import EventLog
from trainguard._demo._train import Trainer, train
from trainguard.inprocess import Compose, MaxActiveWorldSize, ShiftRanks, Wrapper

__all__ = ["build_wrapper", "main"]


def build_wrapper(config: DemoConfig) -> Wrapper:
    """The demo's ``inprocess.Wrapper``: reserve ranks idle, survivors shift down, and the
    active world is capped at ``config.ranks`` so a reserve rank replaces a removed one.

    Timeouts are short so the demo stays quick: a hang is interrupted after ``soft_timeout_s``.
    """
    soft = config.soft_timeout_s
    return Wrapper(
        store_kwargs={
            "host": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            # the launcher's free port for the wrapper's store (trainguard launch gives one)
            "port": int(os.environ.get("TRAINGUARD_STORE_PORT") or os.environ["MASTER_PORT"]),
            "timeout": timedelta(seconds=60),
        },
        rank_assignment=Compose(MaxActiveWorldSize(config.ranks), ShiftRanks()),
        soft_timeout=timedelta(seconds=soft),
        hard_timeout=timedelta(seconds=config.hard_timeout_s),
        heartbeat_timeout=timedelta(seconds=max(4.0, soft + 1.0)),
        barrier_timeout=timedelta(seconds=max(60.0, config.hard_timeout_s + 10.0)),
        completion_timeout=timedelta(seconds=60),
        last_call_wait=timedelta(seconds=0.1),
        monitor_process_interval=timedelta(seconds=0.25),
        monitor_thread_interval=timedelta(seconds=0.25),
        progress_watchdog_interval=timedelta(seconds=0.25),
        heartbeat_interval=timedelta(seconds=0.5),
        monitor_process_pidfile=config.monitor_pidfile(),
        monitor_process_logfile=str(config.root / "logs" / "monitor{rank}.log"),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainguard._demo._rank CONFIG_JSON", file=sys.stderr)
        return 2
    config = DemoConfig.load(argv[0])
    rank = int(os.environ["RANK"])  # initial rank; the wrapper rewrites RANK per iteration
    torch.set_num_threads(1)  # many ranks share few cores
    # DDP's constructor imports torch._dynamo on first use (seconds, with sympy); pay it at start
    # so that a reserve rank taking over does not pay it inside the restart.
    importlib.import_module("torch._dynamo")
    log = EventLog(config.events_path(rank), rank)
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)  # trainguard launch's cycle
    log.emit("start", pid=os.getpid(), cycle=cycle)
    try:
        accuracy = build_wrapper(config)(train)(Trainer(config, rank, log))
    except BaseException as exc:  # report how this rank left, then let the exit status say it
        log.emit("exit", status="error", error=f"{type(exc).__name__}: {exc}")
        raise
    log.emit("exit", status="reserve" if accuracy is None else "completed", accuracy=accuracy)
    log.close()
    return 0


def _exit_now(code: int) -> None:
    """Leave without interpreter finalisation: unloading torch takes seconds on a busy machine,
    and everything this process owns is already flushed, closed or reaped by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: print, exit 1
        import traceback

        traceback.print_exc()
        status = 1
    _exit_now(status)
