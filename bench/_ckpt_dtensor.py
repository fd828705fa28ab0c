"""DTensor scenario for bench/checkpoint.py: 2 gloo ranks, sharded vs plain save, reshard load.

Each rank holds half of ``size_mb`` MiB: 64 DTensors sharded on dim 0 over a 2-rank CPU mesh,
or (baseline, same bytes per rank) 64 plain tensors under rank-specific keys. Both are saved by
``AsyncCheckpointer(format="dcp")`` and timed until committed (save + wait), interleaved round by
round. The DTensor checkpoint is then loaded into a different sharding (dim 1), which makes every
rank read pieces of both ranks' files, and checked for equality.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

N_TENSORS = 64


def _rank(rank: int, port: int, size_mb: int, directory: str, rounds: int, conn: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    try:
        conn.send(("ok", _measure(rank, size_mb, directory, rounds)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        dist.destroy_process_group()


def _measure(rank: int, size_mb: int, directory: str, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainguard.checkpointing import AsyncCheckpointer

    mesh = init_device_mesh("cpu", (2,))
    rows = size_mb * 2**20 // 4 // N_TENSORS // 1024
    torch.manual_seed(0)
    full = [torch.randn(rows, 1024) for _ in range(N_TENSORS)]
    sharded = {f"layer{i}": distribute_tensor(t, mesh, [Shard(0)]) for i, t in enumerate(full)}
    plain = {f"r{rank}.layer{i}": v.to_local().clone() for i, v in enumerate(sharded.values())}
    samples: dict[str, list[float]] = {"dtensor_save_s": [], "plain_save_s": [],
                                       "dtensor_block_s": [], "plain_block_s": []}
    with AsyncCheckpointer(os.path.join(directory, "dt"), format="dcp", keep_last=1) as ckd, \
            AsyncCheckpointer(os.path.join(directory, "pl"), format="dcp", keep_last=1) as ckp:
        for r in range(rounds + 1):  # round 0 warms up
            for name, ck, state in (("dtensor", ckd, sharded), ("plain", ckp, plain)):
                dist.barrier()
                t0 = time.perf_counter()
                ck.save(state, r)
                t1 = time.perf_counter()
                ck.wait()
                if r:
                    samples[f"{name}_save_s"].append(time.perf_counter() - t0)
                    samples[f"{name}_block_s"].append(t1 - t0)
        loads = []
        for _ in range(max(1, rounds)):
            target = {f"layer{i}": distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(1)])
                      for i in range(N_TENSORS)}
            dist.barrier()
            t0 = time.perf_counter()
            ckd.load_dcp(target)
            loads.append(time.perf_counter() - t0)
        equal = all(torch.equal(target[f"layer{i}"].to_local(), sharded[f"layer{i}"].full_tensor()
                                .chunk(2, dim=1)[rank]) for i in range(N_TENSORS))
    samples["dtensor_load_reshard_s"] = loads
    return {"samples": samples, "reshard_equal": equal}


def run(size_mb: int, directory: str, rounds: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Spawn the 2 ranks, return rank 0's medians and spreads (raises if a rank failed)."""
    from trainguard._core.clock import Deadline
    from trainguard._core.net import free_port
    from trainguard._core.procs import spawn_context, terminate_processes

    ctx = spawn_context()
    port, procs, pipes = free_port(), [], []
    for rank in range(2):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank, args=(rank, port, size_mb, directory, rounds, child))
        proc.start()
        child.close()
        procs.append(proc)
        pipes.append(parent)
    deadline = Deadline(timeout_s)
    results = []
    try:
        for conn in pipes:
            if not conn.poll(deadline.remaining()):
                raise TimeoutError(f"DTensor benchmark ranks did not finish in {timeout_s:.0f} s")
            results.append(conn.recv())
    finally:
        terminate_processes(procs, grace_s=5.0)
        for conn in pipes:
            conn.close()
    bad = [v for status, v in results if status != "ok"]
    if bad:
        raise RuntimeError("DTensor benchmark rank failed:\n" + "\n".join(bad))
    samples = results[0][1]["samples"]
    out: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    out["dtensor_vs_plain_save"] = out["dtensor_save_s"] / out["plain_save_s"]
    out["dtensor_reshard_equal"] = all(v["reshard_equal"] for _, v in results)
    out["dtensor_spread"] = {k: [min(v), statistics.median(v), max(v)] for k, v in samples.items()}
    return out
