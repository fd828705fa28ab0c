"""Rank program: gloo all-reduces with the flight recorder on; one rank arrives late.

``TG_FR_CFG`` (JSON): ``collectives`` (count), ``compute_ms`` (sleep before each), ``late``
(``{rank, extra_ms}``). Needs ``TORCH_FR_BUFFER_SIZE`` > 0 in the environment. Returns this rank's
flight-recorder entries (the fields lateness uses) and the recorder's own dump time.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard._core.flight_recorder import own_dump

_KEEP = ("process_group", "collective_seq_id", "time_created_ns", "profiling_name", "is_p2p")


def run() -> dict[str, Any]:
    cfg = json.loads(os.environ["TG_FR_CFG"])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))
    late = cfg.get("late") or {}
    extra = late.get("extra_ms", 0.0) if late.get("rank") == rank else 0.0
    t = torch.ones(256)
    for _ in range(cfg["collectives"]):
        time.sleep((cfg["compute_ms"] + extra) / 1e3)
        dist.all_reduce(t)
    t0 = time.perf_counter()
    dump = own_dump()
    dump_ms = (time.perf_counter() - t0) * 1e3
    dist.barrier()
    dist.destroy_process_group()
    entries = [{k: e.get(k) for k in _KEEP} for e in dump["entries"]]
    return {"entries": entries, "dump_ms": dump_ms}
