"""Launcher workers survive the torch teardown that deadlocked a warm-forked rank.

Freeing a DDP model right after ``destroy_process_group()`` (just after a barrier that followed
DDP's all-reduce) made ``~ProcessGroupGloo`` join a gloo worker thread that waited for the GIL
the main thread held: a rank stuck in ``std::thread::join`` after its script returned (seen in
the simulated-node tests with warm restart on; with torch alone it hangs within 1-8 rounds).
The worker bootstrap guards ``destroy_process_group`` (``trainguard._core.pg_guard``) in both
spawn paths, which this job runs side by side: rank 0 like a forked worker (torch.distributed
imported before the bootstrap, as in the fork server), rank 1 as a cold spawn (the bootstrap's
import hook installs the guard when the script imports torch.distributed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.testing import free_port

HERE = Path(__file__).parent
WORKER = str(HERE / "pg_teardown_worker.py")
ROUNDS = 12
LIMIT_S = 120.0  # import torch twice on a loaded 2-core machine; the rounds take ~1-3 s

_AS_FORKED = ("import sys, torch.distributed; from trainguard.fault_tolerance import _bootstrap; "
              "_bootstrap.finish(_bootstrap.run_worker('script', sys.argv[1], sys.argv[2:]))")


@pytest.mark.timeout(180)
def test_freeing_ddp_after_destroy_does_not_deadlock_in_forked_or_cold_workers(tmp_path):
    port = free_port()
    commands = [
        [sys.executable, "-c", _AS_FORKED, WORKER, str(ROUNDS)],
        [sys.executable, "-m", "trainguard.fault_tolerance._bootstrap", "script", WORKER,
         str(ROUNDS)],
    ]
    procs = []
    for rank, cmd in enumerate(commands):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp_path))
    t0 = time.monotonic()
    outs: list[tuple[str, str]] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - t0))))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        rest = [p.communicate(timeout=10) for p in procs[len(outs):]]
        pytest.fail(f"ranks still running after {time.monotonic() - t0:.1f} s (teardown "
                    f"deadlock): {[o[0][-300:] for o in outs + rest]}")
    elapsed = time.monotonic() - t0
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}: rc={p.returncode}\n{err[-3000:]}"
        assert f"rounds={ROUNDS} destroy=trainguard._core.pg_guard" in out, (rank, out, err[-2000:])
    print(f"2 ranks x {ROUNDS} rounds in {elapsed:.1f} s")
