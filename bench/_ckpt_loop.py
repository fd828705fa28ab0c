"""Training-loop scenario for bench/checkpoint.py: the step-time cost of a save every step.

A stack of ``Linear(2048, 2048)`` layers trained with SGD + momentum, so that parameters plus
momentum hold ``size_mb`` MiB; the batch is calibrated so that one step (forward, backward,
``optimizer.step()``) takes about ``step_ms``. Methods, interleaved round by round so machine
noise hits all alike: no save (baseline); ``bgcopy``, a background thread copying the state's
bytes once per step exactly as the overlapped save stages them (chunked, GIL-free ``memmove``,
joined before the optimizer step) and nothing else: the floor any overlapped snapshot pays on
this host, since its copy competes with training for the same cores and memory bandwidth;
trainguard overlapped snapshot (default ``if_busy="skip"``: a save requested while the previous
one is in flight is skipped); the same with ``if_busy="wait"`` (``overlap_wait``, the design
before skipping); trainguard snapshot (blocking copy); ``torch.distributed.checkpoint.async_save``
(waiting for the previous one first) and a synchronous ``torch.save`` + fsync. Needs an
initialized (1-rank) process group.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from trainguard.checkpointing import AsyncCheckpointer, _staging

WIDTH = 2048
METHODS = ("none", "bgcopy", "overlap", "overlap_wait", "snapshot", "dcp_async", "torch_save")


def _model(size_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, size_mb * 2**20 // 2 // (WIDTH * WIDTH * 4))  # params + momentum = size
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    return model, opt


class Loop:
    """One model, one checkpointer; ``run`` returns per-method samples of block and step time."""

    def __init__(self, size_mb: int, step_ms: float, directory: str, save_every: int = 1) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp, self.dir, self.save_every = dcp, directory, save_every
        self.model, self.opt = _model(size_mb)
        self.batch = 16
        self.ck = AsyncCheckpointer(os.path.join(directory, "tg"), keep_last=1, max_in_flight=2)
        self.step_no = 0
        self.pending: Any = None
        self.dcp_dirs: list[str] = []
        self.samples: dict[str, list[float]] = {}
        self.bg: threading.Thread | None = None
        self._train()  # creates the momentum buffers: the state now has its full size
        self.nbytes = sum(t.numel() * t.element_size() for t in self._tensors())
        self._calibrate(step_ms)
        self.dst = [torch.empty_like(t) for t in self._tensors()]
        self.bg_dst = [torch.zeros_like(t) for t in self._tensors()]

    def _tensors(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        return params + [self.opt.state[p]["momentum_buffer"] for p in params]

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def _train(self) -> None:
        x = torch.randn(self.batch, WIDTH)
        loss = self.model(x).square().mean()
        loss.backward()
        if self.bg is not None:  # bgcopy: the copy must end before the state changes
            self.bg.join()
            self.bg = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def _calibrate(self, step_ms: float) -> None:
        for _ in range(2):
            t0 = time.perf_counter()
            for _ in range(3):
                self._train()
            took = (time.perf_counter() - t0) / 3
            self.batch = max(1, min(8192, round(self.batch * step_ms / 1e3 / took)))

    def memcpy_s(self) -> float:
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self._tensors()):
            d.copy_(s)
        return time.perf_counter() - t0

    # -- one save per method (returns after the part that blocks training) --------------------
    def _bgcopy(self) -> None:
        self.bg = threading.Thread(target=_staging._copy_chunked, name="bench-bgcopy",
                                   args=(self.bg_dst, self._tensors(), _staging.CHUNK_BYTES))
        self.bg.start()

    def _overlap(self) -> None:
        self.ck.save(self._state(), self.step_no, overlap=True)
        self.ck.maybe_finalize()

    def _overlap_wait(self) -> None:
        self.ck.save(self._state(), self.step_no, overlap=True, if_busy="wait")
        self.ck.maybe_finalize()

    def _snapshot(self) -> None:
        self.ck.save(self._state(), self.step_no)
        self.ck.maybe_finalize()

    def _dcp_async(self) -> None:
        if self.pending is not None:
            self.pending.result()  # one save in flight, like ours with its arenas
            while len(self.dcp_dirs) > 1:
                shutil.rmtree(self.dcp_dirs.pop(0), ignore_errors=True)
        path = os.path.join(self.dir, f"dcp{self.step_no}")
        self.dcp_dirs.append(path)
        self.pending = self.dcp.async_save(self._state(), checkpoint_id=path)

    def _torch_save(self) -> None:
        path = os.path.join(self.dir, "ts.pt")
        with open(path, "wb") as f:
            torch.save(self._state(), f)
            f.flush()
            os.fsync(f.fileno())

    def _drain(self) -> None:
        if self.bg is not None:
            self.bg.join()
            self.bg = None
        self.ck.wait()
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        for path in self.dcp_dirs:
            shutil.rmtree(path, ignore_errors=True)
        self.dcp_dirs = []

    def _block(self, method: str, steps: int) -> None:
        save: Callable[[], None] | None = {
            "none": None, "bgcopy": self._bgcopy, "overlap": self._overlap,
            "overlap_wait": self._overlap_wait, "snapshot": self._snapshot,
            "dcp_async": self._dcp_async, "torch_save": self._torch_save}[method]
        fenced0, skipped0, saves = self.ck.fenced_steps, self.ck.saves_skipped, 0
        for i in range(steps + 1):  # the first step of a block warms the method up
            self.step_no += 1
            t0 = time.perf_counter()
            self._train()
            t1 = time.perf_counter()
            saving = save is not None and self.step_no % self.save_every == 0
            if saving:
                save()  # type: ignore[misc]
                saves += 1
            t2 = time.perf_counter()
            if i:
                self.samples.setdefault(f"{method}_step_s", []).append(t2 - t0)
                if saving or save is None:
                    self.samples.setdefault(f"{method}_block_s", []).append(t2 - t1)
        if method.startswith("overlap"):
            self.samples.setdefault(f"{method}_fenced_frac", []).append(
                (self.ck.fenced_steps - fenced0) / max(1, saves))
            self.samples.setdefault(f"{method}_skipped", []).append(
                self.ck.saves_skipped - skipped0)
            self.samples.setdefault(f"{method}_saves", []).append(saves)
        self._drain()

    def run(self, rounds: int, steps: int,
            methods: tuple[str, ...] = METHODS) -> dict[str, list[float]]:
        try:
            for r in range(rounds + 1):
                for method in methods:
                    self._block(method, steps if r else 1)  # round 0: warm-up only
                if r == 0:
                    self.samples.clear()
                self.samples.setdefault("memcpy_s", []).append(self.memcpy_s())
                self.samples.setdefault("loadavg_1min", []).append(os.getloadavg()[0])
        finally:
            self._drain()
            self.ck.close()
        return self.samples


_BLOCK_KEYS = {"overlap": "overlap_block_s", "snapshot": "snapshot_block_s",
               "dcp_async": "dcp_async_loop_block_s", "torch_save": "torch_save_loop_block_s",
               "overlap_wait": "overlap_wait_block_s", "bgcopy": "bgcopy_block_s"}


def summarize(samples: dict[str, list[float]], batch: int, nbytes: int) -> dict[str, Any]:
    """Medians under the issue's keys (for the methods that ran; ``none`` must have), plus
    [min, median, max] of every sample series."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["none_step_s"]
    out: dict[str, Any] = {
        "loop_state_mb": round(nbytes / 2**20, 1), "loop_batch": batch,
        "loop_step_s": base, "loop_memcpy_s": med["memcpy_s"],
        "loop_loadavg": [min(samples["loadavg_1min"]), max(samples["loadavg_1min"])],
    }
    for method, key in _BLOCK_KEYS.items():
        if f"{method}_step_s" in med:
            out[key] = med[f"{method}_block_s"]
            out[f"{method}_step_overhead_pct"] = (med[f"{method}_step_s"] - base) / base * 100.0
    if "overlap_step_s" in med:
        out["overlap_fenced_frac"] = med["overlap_fenced_frac"]
        out["saves_skipped"] = int(sum(samples["overlap_skipped"]))
        out["overlap_saves_requested"] = int(sum(samples["overlap_saves"]))
        out["overlap_block_vs_memcpy"] = med["overlap_block_s"] / med["memcpy_s"]
        if "dcp_async_step_s" in med:
            out["block_vs_dcp_async"] = med["overlap_block_s"] / med["dcp_async_block_s"]
    out["loop_spread"] = {k: [min(v), statistics.median(v), max(v)] for k, v in samples.items()}
    return out
