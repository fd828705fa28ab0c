"""DDP worker for the simulated-node fault tests: ``netns_worker.py DIR [--steps N]``.

Trains a tiny model with DDP over gloo from a fixed seed. Every rank feeds the same batch of each
step, so the averaged gradient, and hence the final weights, do not depend on the world size:
the weights' checksum is comparable with :func:`reference_checksum` run in one process.

Progress goes to ``DIR``: ``progress_<cycle>_<rank>`` holds the last step done. Ranks keep
stepping past ``--steps`` (without changing the weights) until ``DIR/release`` exists, so a test
can inject a fault while training runs, wait for the next cycle, then let it finish. At the end
each rank writes ``result_<cycle>_<rank>.json`` (rank, world, group, node, cycle, checksum).
When ``DIR/exclude_<group rank>`` appears in cycle 0, local rank 0 of that node asks the launcher
to exclude the node (``WorkloadAction.ExcludeThisNode``) and exits 3.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
from _exclude import ask_exclusion

STEPS = 12
HOLD_S = 90.0  # a cycle waits at most this long for DIR/release


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def reference_checksum(steps: int = STEPS) -> float:
    """The checksum one process gets after ``steps`` steps: what every rank must report."""
    model, opt = build()
    for step in range(steps):
        train_step(model, opt, step)
    return checksum(model)


def main() -> int:
    import torch.distributed as dist

    folder = sys.argv[1]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else STEPS
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    model, opt = build()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    release = os.path.join(folder, "release")
    hold_until = time.monotonic() + HOLD_S
    step = 0
    group = int(os.environ.get("GROUP_RANK", "0"))
    exclude = os.path.join(folder, f"exclude_{group}")
    while step < steps or not _released(release, hold_until):
        if cycle == 0 and os.environ.get("LOCAL_RANK") == "0" and os.path.exists(exclude):
            return ask_exclusion("netns test: bad node")
        if step < steps:
            train_step(ddp, opt, step)
        else:  # held: keep the ranks in lockstep without changing the weights
            _idle_step()
        with open(os.path.join(folder, f"progress_{cycle}_{rank}"), "w") as fh:
            fh.write(str(step))
        step += 1
        time.sleep(0.05)
    result = {"rank": rank, "world": world, "group": group, "cycle": cycle,
              "node": os.environ.get("TRAINGUARD_NODE", ""), "checksum": checksum(model),
              "steps": min(step, steps)}
    with open(os.path.join(folder, f"result_{cycle}_{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _released(path: str, hold_until: float) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if os.path.exists(path) or time.monotonic() > hold_until else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank decides the same
    return bool(flag.item())


def _idle_step() -> None:
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))


if __name__ == "__main__":
    sys.exit(main())
