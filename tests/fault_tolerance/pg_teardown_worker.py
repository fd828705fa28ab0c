"""Worker for the teardown-deadlock test: ``pg_teardown_worker.py ITERATIONS``.

Loops ``init_process_group`` (gloo, a fresh store prefix per round) -> one DDP step ->
``barrier()`` -> ``destroy_process_group()`` -> ``del model``: freeing the model drops the last
torch reference to the destroyed group, whose destructor deadlocked on the GIL within 1-8 rounds
(``trainguard._core.pg_guard``). Prints which ``destroy_process_group`` the script saw.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

_TIMEOUT = datetime.timedelta(seconds=30)


def main() -> int:
    rounds = int(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=_TIMEOUT)
    for i in range(rounds):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{i}", store), rank=rank,
                                world_size=world, timeout=_TIMEOUT)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        model(torch.randn(2, 4)).sum().backward()
        dist.barrier()
        dist.destroy_process_group()
        del model
    print(f"rounds={rounds} destroy={dist.destroy_process_group.__module__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
