"""The worker side of the runner contract: :class:`DistributedWorker`.

Follows: reactor-runtime ``DistributedWorker`` (``rank``, ``world_size``, ``device`` injected
before ``load``; ``is_leader``). Subclassing is optional: any top-level class with ``load``,
``generate`` and ``reset`` methods and a no-argument constructor is accepted.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DistributedWorker"]


class DistributedWorker:
    """Base class for a model replica/shard run by :class:`~trainguard.runner.DistributedRunner`.

    Lifecycle in each rank process (one thread calls everything, in this order):

    1. the class is constructed with no arguments;
    2. ``rank``, ``world_size`` and ``device`` are set (``"cuda:<rank>"`` when CUDA is visible,
       else ``"cpu"``), and, when the runner asks for it and ``world_size > 1``, the default
       ``torch.distributed`` process group is initialised (NCCL on CUDA, Gloo on CPU);
    3. ``load(**load_kwargs)`` once;
    4. ``generate(input)`` / ``reset()`` once per runner call, on every rank with the same input.

    ``generate`` must return CPU data; only rank 0's return value reaches the caller, so gather
    sharded outputs onto rank 0 inside ``generate``.
    """

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_leader(self) -> bool:
        """True on rank 0, whose ``generate`` result is returned to the caller."""
        return self.rank == 0

    def load(self, **kwargs: Any) -> None:
        """Load weights and build state; called once per rank before any ``generate``."""
        raise NotImplementedError(f"{type(self).__name__} must implement load(**load_kwargs)")

    def generate(self, input: Any) -> Any:
        """Run one step on ``input`` (identical on every rank) and return a picklable CPU result."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate(input)")

    def reset(self) -> None:
        """Drop per-session state (caches); by convention keep the loaded weights."""
