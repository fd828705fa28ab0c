"""Worker for the multi-node tests:
``mn_worker.py [--steps N] [--steps0 N] [--fail-node G] [--fail-cycle C] [--hang] [--exclude]
[--sleep S]`` (``--steps0``: steps in cycle 0, default ``--steps``).

Joins a gloo process group from the launcher's env, all-reduces its rank every step and prints
``result rank=R world=W group=G cycle=C sum=S`` at the end (S must be W*(W-1)/2). With
``--fail-node G`` the worker of local rank 0 on group rank G raises at step 3 in cycle C
(default 0); ``--exclude`` asks the launcher to exclude this node instead.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

args = sys.argv[1:]


def opt(name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


steps = int(opt("--steps", "10"))
if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
    steps = int(opt("--steps0", str(steps)))  # a long first cycle, to kill something in
fail_node = int(opt("--fail-node", "-1"))
fail_cycle = int(opt("--fail-cycle", "0"))
pause = float(opt("--sleep", "0.05"))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
group = int(os.environ["GROUP_RANK"])
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"start rank={rank} world={world} group={group} cycle={cycle} "
      f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
total = 0.0
for i in range(steps):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    total = t.item()
    fire = group == fail_node and cycle == fail_cycle and int(os.environ["LOCAL_RANK"]) == 0
    if fire and i == 3:
        if "--exclude" in args:
            from _exclude import ask_exclusion

            sys.exit(ask_exclusion("bad node"))
        if "--hang" in args:
            time.sleep(3600)
        raise RuntimeError(f"injected failure on node {group}")
    time.sleep(pause)
print(f"result rank={rank} world={world} group={group} cycle={cycle} sum={total:g}", flush=True)
dist.destroy_process_group()
