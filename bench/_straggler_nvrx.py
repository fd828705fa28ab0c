"""NVRx's straggler detector on CPU, for ``bench/straggler.py`` (run with NVRx's interpreter).

NVRx's ``Detector`` imports a compiled CUPTI module and calls ``torch.cuda.synchronize``; on a
CPU-only machine both are stubbed (spec attribution.md §1.3), which leaves its CPU section path
and its gloo report path as they are. Modes (argv[1]):

* ``mark N``: one process, world size 1; prints ``{"mark_us", "report_ms"}`` (``mark_us``: the
  best chunk of 2000 section marks minus an empty loop, as ``bench/straggler.py`` measures ours);
* ``rank``: one of 4 gloo ranks (env RANK, WORLD_SIZE, MASTER_*, NVRX_CFG JSON with
  ``steps``, ``compute_ms``, ``slow_rank``, ``factor``): a whole-step section (compute +
  all-reduce) and a compute-only section; rank 0 prints the relative section scores.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from datetime import timedelta


def _stub_cupti() -> None:
    class _Profiler:
        def __init__(self, **kwargs: object) -> None:
            pass

        def initialize(self) -> None: ...
        def shutdown(self) -> None: ...
        def start(self) -> None: ...
        def stop(self) -> None: ...
        def reset(self) -> None: ...

        def get_stats(self) -> dict:
            return {}

    mod = types.ModuleType("nvrx_cupti_module")
    mod.CuptiProfiler = _Profiler  # type: ignore[attr-defined]
    sys.modules["nvrx_cupti_module"] = mod
    import torch

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def _init(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def mark(n: int) -> dict:
    import torch.distributed as dist
    from nvidia_resiliency_ext.straggler import Detector  # type: ignore[import-not-found]

    _init(0, 1)
    Detector.initialize(gather_on_rank0=True)
    for _ in range(1000):
        with Detector.detection_section("x", profile_cuda=False):
            pass
    # same method as trainguard's figure: best chunk of 2000 marks minus the best empty chunk
    chunk, marks, empty = 2000, float("inf"), float("inf")
    for _ in range(max(5, n // chunk)):
        t0 = time.perf_counter()
        for _ in range(chunk):
            with Detector.detection_section("x", profile_cuda=False):
                pass
        t1 = time.perf_counter()
        for _ in range(chunk):
            pass
        t2 = time.perf_counter()
        marks, empty = min(marks, t1 - t0), min(empty, t2 - t1)
    r0 = time.perf_counter()
    Detector.generate_report()
    report_ms = (time.perf_counter() - r0) * 1e3
    Detector.shutdown()
    dist.destroy_process_group()
    return {"mark_us": (marks - empty) / chunk * 1e6, "report_ms": report_ms}


def rank() -> dict:
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.straggler import Detector  # type: ignore[import-not-found]

    cfg = json.loads(os.environ["NVRX_CFG"])
    r, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init(r, world)
    Detector.initialize(gather_on_rank0=True)
    t = torch.ones(1024)
    ms = cfg["compute_ms"] * (cfg["factor"] if r == cfg["slow_rank"] else 1.0)
    for _ in range(cfg["steps"]):
        with Detector.detection_section("whole_step", profile_cuda=False):
            with Detector.detection_section("compute_only", profile_cuda=False):
                time.sleep(ms / 1e3)
            dist.all_reduce(t)
    report = Detector.generate_report()
    out = {}
    if report is not None:
        out = {name: {str(k): v for k, v in scores.items()}
               for name, scores in report.section_relative_perf_scores.items()}
    Detector.shutdown()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    _stub_cupti()
    result = mark(int(sys.argv[2])) if sys.argv[1] == "mark" else rank()
    print("NVRX_RESULT " + json.dumps(result), flush=True)
