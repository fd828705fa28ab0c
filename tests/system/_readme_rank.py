"""Rank entry for the README "Using them together" test: runs the snippet with faults injected.

The test writes the README's snippet to ``readme_together.py`` on this rank's ``PYTHONPATH``.
This entry wraps the snippet's ``train_step`` (the user's step) so that it records every step
(``{CKPT_DIR}/../steps{initial rank}.jsonl``: step, active rank, world size, newest step
committed on disk) and fires the
``FaultPlan`` from the environment, keyed by active rank and step; then it calls the snippet's
``train()`` exactly as its ``__main__`` block does.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch.distributed as dist

from trainguard.checkpointing import CheckpointManager
from trainguard.testing import FaultPlan


def main() -> Any:
    import readme_together as snippet  # written by the test

    plan = FaultPlan.from_env()
    user_step = snippet.train_step
    path = os.path.join(os.path.dirname(snippet.CKPT_DIR), f"steps{os.environ['RANK']}.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    manager = CheckpointManager(snippet.CKPT_DIR)

    def train_step(model: Any, opt: Any, step: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        newest = max(manager.committed_steps(), default=0)  # on disk before this step
        os.write(fd, (json.dumps({"step": step, "rank": rank, "world": world, "newest": newest,
                                  "t": time.time()}) + "\n").encode())
        plan.check(rank, None, step)
        user_step(model, opt, step)

    snippet.train_step = train_step
    return snippet.train()
