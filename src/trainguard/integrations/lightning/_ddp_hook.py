"""DDP communication hook timed by the straggler detector.

No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time
(``bucket`` must be ``dist.GradBucket``, the result ``torch.futures.Future[torch.Tensor]``).
"""

import torch
import torch.distributed as dist

__all__ = ["timed_allreduce"]


def timed_allreduce(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A blocking all-reduce (mean) of one gradient bucket through ``dist.all_reduce``.

    ``dist.all_reduce`` is looked up at call time, so the straggler detector's wrapper times the
    wait for the slowest rank as collective wait instead of this rank's compute. Runs on the
    thread that runs backward; blocks for the all-reduce.
    """
    buf = bucket.buffer()
    dist.all_reduce(buf, group=group)
    buf.div_(dist.get_world_size(group))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
