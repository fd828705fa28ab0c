"""Straggler detection in a small DDP-style loop: 2 gloo ranks, rank 1 twice as slow from step
120 (with 2 ranks, 2x is 1.33x the median).

Run: ``python examples/straggler_train.py runs/straggler-example`` then
``trainguard straggler report runs/straggler-example``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard._core.net import free_port
from trainguard._core.procs import spawn_context, terminate_processes
from trainguard.straggler import Actions, Detector, ScoringConfig


def train(rank: int, world: int, port: int, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = (torch.randn(32, 64) for _ in range(300))
    Detector.initialize(window_steps=20, report_time_interval=0, node_name=f"node{rank}",
                        scoring=ScoringConfig(floor_ms=1.0),
                        actions=Actions(log=True, run_dir=run_dir if rank == 0 else None))
    for step, batch in enumerate(Detector.wrap_dataloader(loader)):
        with Detector.detection_section("fwd_bwd"):
            loss = model(batch).square().mean()
            loss.backward()
            time.sleep(0.005 * (2.0 if rank == 1 and step >= 120 else 1.0))  # "the model"
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        report = Detector.generate_report_if_interval_elapsed()
        if report is not None and report.stragglers:
            print(report.summary_line(), flush=True)
    Detector.shutdown()
    dist.destroy_process_group()


def main() -> int:
    run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/straggler-example"
    ctx, port = spawn_context(), free_port()
    procs = [ctx.Process(target=train, args=(r, 2, port, run_dir)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    finally:
        terminate_processes(procs, grace_s=2.0)
    return max(abs(p.exitcode or 0) for p in procs)


if __name__ == "__main__":
    sys.exit(main())
