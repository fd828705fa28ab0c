"""A standalone program driving a runner, run as a subprocess by test_runner_process.py.

Usage: python runner_script.py MODE. Prints one JSON object per line (flushed) to stdout.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runner_workers import EchoWorker

from trainguard.runner import DistributedRunner, SharedSlotAllocationFailed

# A program started from a terminal: Ctrl-C raises KeyboardInterrupt, even when the test run
# itself was started in the background by a non-interactive shell (which ignores SIGINT, and
# an ignored signal is inherited across exec).
signal.signal(signal.SIGINT, signal.default_int_handler)


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def started(**kwargs) -> DistributedRunner:
    runner = DistributedRunner(EchoWorker, world_size=2, init_process_group=False, **kwargs)
    runner.start()
    pids = [runner.generate(("info", None))["pid"]]
    say(event="started", prefix=runner._prefix, rank0=pids[0], grandchild=runner.generate(
        ("spawn_child", None)))
    return runner


def main(mode: str) -> int:
    if mode == "hang_call":  # the test kills or interrupts us while generate() sleeps
        runner = started()
        big = np.ones(2 << 20, np.float32)  # 8 MiB: a new, still named input generation
        say(event="calling")
        try:
            runner.generate(("sleep_with", (60, big)))
        except KeyboardInterrupt:
            say(event="interrupted", healthy=runner.healthy,
                ranks_alive=[p.is_alive() for p in runner._procs])
            runner.shutdown()
            say(event="shut down")
            return 0
        return 3
    if mode == "no_shutdown":  # exit with live ranks and used shared memory
        runner = started()
        runner.generate(("scale", np.ones(1 << 20, np.float32)))
        say(event="exiting")
        return 0
    if mode == "interrupt_start":
        runner = DistributedRunner(EchoWorker, world_size=2, init_process_group=False,
                                   load_kwargs={"sleep": 1})
        say(event="starting")
        try:
            runner.start()
        except KeyboardInterrupt:
            say(event="interrupted")
            return 0
        return 3
    if mode == "small_shm":  # /dev/shm is a 16 MiB tmpfs here
        runner = DistributedRunner(EchoWorker, world_size=2, init_process_group=False)
        runner.start()
        try:
            runner.generate(("sum", np.ones(16 << 20, np.float32)))  # 64 MiB
        except SharedSlotAllocationFailed as exc:
            say(event="refused", message=str(exc), requested=exc.requested_bytes,
                free=exc.free_bytes, healthy=runner.healthy, after=runner.generate(("sum", np.ones(
                    1 << 20, np.float32)))[0])
        runner.shutdown()
        say(event="left", shm=sorted(os.listdir("/dev/shm")))
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
