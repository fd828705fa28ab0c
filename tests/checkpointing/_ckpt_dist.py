"""Run a module-level function on N gloo ranks in spawned processes (free port, hard timeout)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

from trainguard._core.clock import Deadline
from trainguard._core.net import free_port
from trainguard._core.procs import spawn_context, terminate_processes


def _entry(fn, rank: int, world_size: int, port: int, args: tuple, conn) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        conn.send(("ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report everything, including assertion failures, to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args: Any, timeout_s: float = 90.0,
              expect_ok: bool = True) -> list[tuple[str, Any]]:
    """Returns [(status, value)] per rank; status ok/error/died. Raises if expect_ok and any
    fail."""
    ctx = spawn_context()
    port = free_port()
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, child))
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    deadline = Deadline(timeout_s)
    results: list[tuple[str, Any]] = []
    try:
        for rank, (conn, p) in enumerate(zip(pipes, procs)):
            if conn.poll(deadline.remaining()):
                try:
                    results.append(conn.recv())
                except EOFError:
                    results.append(("died", None))
            else:
                results.append(("died" if not p.is_alive() else "timeout", p.exitcode))
            p.join(max(deadline.remaining(), 5.0))
    finally:
        terminate_processes(procs, grace_s=2.0)
        for c in pipes:
            c.close()
    if expect_ok:
        bad = [(r, s, v) for r, (s, v) in enumerate(results) if s != "ok"]
        if bad:
            raise AssertionError(
                "rank failures:\n" + "\n".join(f"rank {r} {s}:\n{v}" for r, s, v in bad)
            )
    return results
