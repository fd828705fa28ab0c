"""Worker classes for the runner tests (top level, so spawned ranks import them by name)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from trainguard.runner import DistributedWorker


class NeedsCode(Exception):
    """An exception whose unpickling fails (``code`` is keyword-only and not in ``args``)."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class EchoWorker(DistributedWorker):
    """generate(cmd) where cmd is a tuple ("op", arg) or anything else (echoed)."""

    def load(self, **kwargs):
        self.kwargs = kwargs
        self.resets = 0
        self.kept = None
        self.child = None
        time.sleep(kwargs.get("sleep", 0))
        if kwargs.get("exit_load_rank") == self.rank:
            os._exit(5)
        if kwargs.get("fail_load_rank") == self.rank:
            raise KeyError(f"load failed on rank {self.rank}")

    def generate(self, cmd):
        if not (isinstance(cmd, tuple) and len(cmd) == 2 and isinstance(cmd[0], str)):
            return cmd
        op, arg = cmd
        return getattr(self, "op_" + op)(arg)

    def reset(self):
        self.resets += 1

    # -- operations -------------------------------------------------------------------------
    def op_info(self, _):
        return {"rank": self.rank, "world_size": self.world_size, "device": self.device,
                "kwargs": self.kwargs, "resets": self.resets, "pid": os.getpid(),
                "env_rank": os.environ.get("RANK"), "leader": self.is_leader,
                "torch": "torch" in sys.modules}

    def op_sum(self, arr):
        return float(np.asarray(arr, dtype=np.float64).sum()), bool(arr.flags.writeable)

    def op_scale(self, arr):
        return arr * 2

    def op_keep(self, arr):  # keep the received array across calls (pool must not reuse it)
        if self.kept is None:
            self.kept = arr
        return float(self.kept.sum())

    def op_raise_all(self, _):
        raise ValueError(f"bad input on rank {self.rank}")

    def op_raise_unpicklable(self, _):
        raise NeedsCode(f"custom failure on rank {self.rank}", code=7)

    def op_raise_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"only rank {rank} fails")
        return "fine"

    def op_mixed_types(self, _):
        raise (ValueError if self.rank == 0 else KeyError)(f"rank {self.rank}")

    def op_exit_on(self, spec):
        rank, code = spec
        if self.rank == rank:
            os._exit(code)
        time.sleep(30)  # the survivor is still busy when the crash is noticed
        return "survived"

    def op_kill_on(self, rank):
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return "alive"

    def op_hang_on(self, rank):
        if self.rank == rank:
            time.sleep(3600)
        return "answered"

    def op_sleep_with(self, spec):  # spec = (seconds, array): the array grew the input slot
        time.sleep(spec[0])
        return float(spec[1].sum())

    def op_sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def op_huge_result(self, spec):  # a sparse file larger than /dev/shm, as a plain ndarray
        path, size = spec
        return np.asarray(np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)))

    def op_spawn_child(self, _):  # a grandchild of the runner's process
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        return self.child.pid


class PlainWorker:
    """A class with the three methods and no base class."""

    def load(self, **kwargs):
        self.offset = kwargs.get("offset", 0)

    def generate(self, x):
        return x + self.offset

    def reset(self):
        pass


class NoReset:
    def load(self):
        pass

    def generate(self, x):
        return x


class GroupWorker(DistributedWorker):
    """Uses the torch.distributed process group (gloo) inside generate."""

    def load(self, **kwargs):
        import torch.distributed as dist

        self.dist = dist

    def generate(self, cmd):
        import torch

        op, arg = cmd
        if op == "info":
            return {"initialized": self.dist.is_initialized(),
                    "backend": self.dist.get_backend() if self.dist.is_initialized() else None,
                    "device": self.device, "rank": self.rank}
        if op == "allreduce":
            t = torch.tensor([float(self.rank + arg)])
            self.dist.all_reduce(t)
            return float(t.item())
        if op == "raise_before_collective":
            if self.rank == 1:
                raise RuntimeError("rank 1 fails before the all-reduce")
            t = torch.ones(1)
            self.dist.all_reduce(t)
            return float(t.item())
        raise ValueError(op)

    def reset(self):
        pass
