"""Benchmark: LocalCheckpointManager save/load (2 gloo ranks) with and without replication,
against torch.save (+fsync) / torch.load of the same per-rank shards.

Usage: python bench/local_checkpoint.py [--size-mb 64] [--repeats 3] [--dir /path]
Prints a rich table, then exactly one JSON line (seconds, medians over rank maxima).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from trainguard._core.net import free_port
from trainguard._core.procs import spawn_context, terminate_processes

WORLD = 2


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return _max_over_ranks(time.perf_counter() - t0)


def _rank_main(rank: int, port: int, root: str, size_mb: int, repeats: int, conn) -> None:
    from trainguard.checkpointing import CliqueReplicationStrategy, LocalCheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    state = {f"t{i}": torch.randn(size_mb * 2**20 // 4 // 16) for i in range(16)}
    res: dict[str, list[float]] = {}
    path = os.path.join(root, f"plain_{rank}.pt")

    def torch_save():
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    for name, strategy in (("local", None), ("local_repl", CliqueReplicationStrategy(1, 2))):
        mgr = LocalCheckpointManager(root, name, strategy)
        mgr.save(state, 0)  # warm-up: writer start, arena allocation
        res[f"{name}_save_s"] = [_timed(lambda it=it, m=mgr: m.save(state, it))
                                 for it in range(1, repeats + 1)]
        res[f"{name}_async_block_s"] = []
        for it in range(repeats + 1, 2 * repeats + 1):  # async: what the training loop waits for
            res[f"{name}_async_block_s"].append(
                _timed(lambda it=it, m=mgr: m.save(state, it, is_async=True))
            )
            while mgr.maybe_finalize() is None:  # one all-reduce per call, like once per step
                time.sleep(0.001)
        mgr.close()
        res[f"{name}_load_s"] = []
        for _ in range(repeats):
            fresh = LocalCheckpointManager(root, name, strategy)
            res[f"{name}_load_s"].append(_timed(fresh.load))
            fresh.close()
    # recovery: rank 1 lost its own shard, fetched from rank 0's replica
    if rank == 1:
        for n in os.listdir(os.path.join(root, "local_repl", "1")):
            if n.endswith(("_1_local.pt", "_1_local.json")):
                os.unlink(os.path.join(root, "local_repl", "1", n))
    fresh = LocalCheckpointManager(root, "local_repl", CliqueReplicationStrategy(1, 2))
    res["recover_load_s"] = [_timed(fresh.load)]
    fresh.close()
    res["torch_save_s"] = [_timed(torch_save) for _ in range(repeats)]
    res["torch_load_s"] = [_timed(lambda: torch.load(path)) for _ in range(repeats)]
    if rank == 0:
        conn.send({k: statistics.median(v) for k, v in res.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=64, help="state per rank, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tg_local_bench_", dir=args.dir)
    ctx, port = spawn_context(), free_port()
    parent, child = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, root, args.size_mb, args.repeats, child))
        for r in range(WORLD)
    ]
    try:
        for p in procs:
            p.start()
        if not parent.poll(900):
            raise SystemExit("benchmark ranks did not report within 900 s")
        r = parent.recv()
        for p in procs:
            p.join(60)
    finally:
        terminate_processes(procs, grace_s=5)
        shutil.rmtree(root, ignore_errors=True)
    r = {"size_mb_per_rank": args.size_mb, "world_size": WORLD, **r}
    r["repl_save_overhead"] = r["local_repl_save_s"] / r["local_save_s"]
    r["local_save_vs_torch_save"] = r["local_save_s"] / r["torch_save_s"]
    table = Table(
        title=f"local checkpoints, {args.size_mb} MiB per rank x {WORLD} ranks "
        "(max over ranks, median)"
    )
    table.add_column("what")
    table.add_column("seconds")
    for key, label in (
        ("local_save_s", "LocalCheckpointManager.save (sync, durable)"),
        ("local_repl_save_s", "... with replication F=2"),
        ("local_async_block_s", "save(is_async=True): blocking part"),
        ("local_repl_async_block_s", "... with replication (runs in background)"),
        ("torch_save_s", "torch.save + fsync"),
        ("local_load_s", "LocalCheckpointManager.load (verified)"),
        ("local_repl_load_s", "... with replication"),
        ("recover_load_s", "load, rank 1 shard from peer replica"),
        ("torch_load_s", "torch.load"),
    ):
        table.add_row(label, f"{r[key]:.3f}")
    Console().print(table)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
