"""Minimal trainguard.runner example: two CPU ranks (Gloo) act as one "model".

Each rank holds half of a weight vector; generate() scales the input array by the full weight
sum, computed with an all-reduce, and rank 0's result returns to the caller.

Run: .venv/bin/python examples/runner_echo.py
"""

from __future__ import annotations

import numpy as np

from trainguard.runner import DistributedRunner, DistributedWorker, RankDesync


class EchoModel(DistributedWorker):
    def load(self, scale: float) -> None:
        import torch

        # Each rank owns one shard of the "weights".
        self.shard = torch.full((4,), scale * (self.rank + 1))
        self.calls = 0

    def generate(self, frame: np.ndarray) -> dict:
        import torch.distributed as dist

        if frame.ndim != 2:
            raise ValueError(f"expected a 2-D frame, got shape {frame.shape}")  # every rank
        total = self.shard.sum().clone()
        dist.all_reduce(total)  # needs every rank: the runner sent all of them the same input
        self.calls += 1
        return {"frame": frame * float(total), "calls": self.calls, "device": self.device}

    def reset(self) -> None:
        self.calls = 0  # drop session state, keep the weights


def main() -> None:
    runner = DistributedRunner(EchoModel, world_size=2, load_kwargs={"scale": 0.5},
                               call_timeout=30.0, start_timeout=120.0)
    runner.start()
    try:
        frame = np.ones((720, 1280), np.float32)  # 3.7 MB: travels through shared memory
        out = runner.generate(frame)
        print(f"rank 0 returned {out['frame'].shape} x{out['frame'][0, 0]:.1f} "
              f"after {out['calls']} call(s) on {out['device']}")
        try:
            runner.generate(np.ones(3, np.float32))
        except ValueError as exc:  # same type on every rank: runner stays healthy
            print(f"worker error reached the caller: {exc}; healthy={runner.healthy}")
        runner.reset()
        print(f"after reset: calls={runner.generate(frame)['calls']}")
    except RankDesync as exc:
        print(f"ranks disagreed: {exc}")
    finally:
        runner.shutdown()


if __name__ == "__main__":
    main()
