"""Benchmark of the Lightning integration: per-step callback overhead and checkpoint blocking time.

Measured in one run, each with its baseline:

* ``callback_overhead_pct``: CPU time spent inside trainguard's callbacks (FaultToleranceCallback,
  StragglerCallback, PreemptionCallback: every per-step hook they implement, timed around each
  call with the thread's CPU clock, including the preemption check's non-blocking all-reduce)
  per training step, over a 10 ms step; ``callback_wall_overhead_pct`` is the same with the wall
  clock, which on a shared machine also counts the time the thread was not scheduled. Real
  ``lightning.Trainer``, DDP with 2 gloo ranks under ``trainguard launch``, median over ranks.
  The timing wrapper's own cost (``time.thread_time`` is a system call, ~3 us here) is measured
  around an empty hook in the same processes and subtracted (``timer_cpu_us_per_step``; the
  uncorrected figure is ``raw_callback_cpu_us_per_step``).
  Baseline in the same processes: an A/B of the step wall time with and without the callbacks
  (``ab_overhead_pct``; noisy on a shared machine);
* ``ckpt_block_ms`` / ``lightning_async_block_ms`` / ``lightning_sync_block_ms``: how long
  ``trainer.save_checkpoint`` blocks the training loop with ``TrainguardCheckpointIO``, with
  Lightning's ``AsyncCheckpointIO`` and with its default synchronous ``TorchCheckpointIO``; same
  model (``--params-mb`` of float32 parameters + SGD momentum), same process, the median of
  ``--saves`` saves each, with time between saves for the background writes to finish.

Prints a rich table, then one JSON line. Run:
``.venv/bin/python bench/lightning_overhead.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEP_S = 0.010
HOOKS = ("setup", "teardown", "on_train_start", "on_train_end", "on_train_batch_start",
         "on_train_batch_end", "on_before_backward", "on_after_backward",
         "on_before_optimizer_step", "on_validation_start", "on_validation_end",
         "on_validation_batch_end", "on_save_checkpoint")


def _timed(callbacks: list[Any], totals: dict[str, float]) -> None:
    """Replace each implemented hook of ``callbacks`` by a timed wrapper (instance attribute):
    ``totals["s"]`` wall time, ``totals["cpu_s"]`` this thread's CPU time, and per hook."""
    for cb in callbacks:
        for name in HOOKS:
            if name in ("setup", "teardown", "on_train_start", "on_train_end"):
                continue  # once per fit, not per step
            impl = getattr(type(cb), name, None)
            if impl is None or not any(name in vars(k) for k in type(cb).__mro__[:2]):
                continue
            bound = getattr(cb, name)

            key = f"{type(cb).__name__}.{name}"

            def wrapper(*args: Any, _f: Any = bound, _k: str = key, **kwargs: Any) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return _f(*args, **kwargs)
                finally:
                    cpu = time.thread_time() - c0
                    wall = time.perf_counter() - t0
                    totals["s"] += wall
                    totals["cpu_s"] += cpu
                    totals["calls"] = totals.get("calls", 0.0) + 1
                    totals[_k] = totals.get(_k, 0.0) + cpu

            setattr(cb, name, wrapper)


def _timer_cost() -> tuple[float, float]:
    """(CPU s, wall s) the timing wrapper itself adds to one hook call: the same wrapper around
    an empty hook, measured in the same process (``time.thread_time`` is a system call, several
    us on a VM, against well under 1 us for ``perf_counter``)."""

    class Empty:
        def on_train_batch_end(self, *args: Any) -> None:
            return None

    n, best = 20_000, (float("inf"), float("inf"))
    for _ in range(3):
        totals = {"s": 0.0, "cpu_s": 0.0}
        cb = Empty()
        _timed([cb], totals)
        for _ in range(n):
            cb.on_train_batch_end(None, None, None, None, 0)
        best = min(best, (totals["cpu_s"] / n, totals["s"] / n))
    return best


def _child_overhead(out: str, steps: int) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import trainguard.integrations.lightning as tgl

    class Step(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 64)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            time.sleep(STEP_S)
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(1_000_000, 64), batch_size=8)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.t.append(time.perf_counter())

    def fit(with_ours: bool) -> tuple[dict[str, float], float]:
        totals = {"s": 0.0, "cpu_s": 0.0}
        ours = [tgl.FaultToleranceCallback(), tgl.StragglerCallback(window_steps=20),
                tgl.PreemptionCallback()] if with_ours else []
        _timed(ours, totals)
        clock = Clock()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps,
                            callbacks=[*ours, clock], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(Step())
        gaps = [b - a for a, b in zip(clock.t[5:], clock.t[6:])]
        return {k: v / steps for k, v in totals.items()}, statistics.median(gaps)

    rounds = [(fit(False), fit(True)) for _ in range(2)]
    timer_cpu, timer_wall = _timer_cost()
    result = {"rank": int(os.environ["RANK"]),
              "timer_cpu_s_per_call": timer_cpu, "timer_s_per_call": timer_wall,
              "calls_per_step": statistics.median(r[1][0]["calls"] for r in rounds),
              "hook_s_per_step": statistics.median(r[1][0]["s"] for r in rounds),
              "hook_cpu_s_per_step": statistics.median(r[1][0]["cpu_s"] for r in rounds),
              "hooks_us": {k: round(v * 1e6, 1) for k, v in rounds[-1][1][0].items()},
              "step_s_without": statistics.median(r[0][1] for r in rounds),
              "step_s_with": statistics.median(r[1][1] for r in rounds)}
    with open(f"{out}.{result['rank']}", "w") as f:
        json.dump(result, f)


def _overhead(steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tg-lt-bench-") as tmp:
        out = os.path.join(tmp, "overhead")
        cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--nproc-per-node",
               "2", "--ft-preload", "lightning", "--log-dir", os.path.join(tmp, "logs"),
               __file__, "--child", out, "--steps", str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"overhead run failed (rc {proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-4000:]}")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    # the timing wrapper's own cost (measured in the same processes) is not the callbacks'
    calls = statistics.median(r["calls_per_step"] for r in ranks)
    timer_cpu = statistics.median(r["timer_cpu_s_per_call"] for r in ranks) * calls
    timer_wall = statistics.median(r["timer_s_per_call"] for r in ranks) * calls
    raw_cpu = statistics.median(r["hook_cpu_s_per_step"] for r in ranks)
    hook = statistics.median(r["hook_s_per_step"] for r in ranks) - timer_wall
    cpu = raw_cpu - timer_cpu
    with_s = statistics.median(r["step_s_with"] for r in ranks)
    without = statistics.median(r["step_s_without"] for r in ranks)
    print("per-hook CPU us/step, rank 0:", json.dumps(ranks[0]["hooks_us"]), flush=True)
    return {"callback_overhead_pct": 100 * cpu / STEP_S, "callback_cpu_us_per_step": cpu * 1e6,
            "raw_callback_cpu_us_per_step": raw_cpu * 1e6, "timer_cpu_us_per_step": timer_cpu * 1e6,
            "hook_calls_per_step": calls,
            "callback_wall_overhead_pct": 100 * hook / STEP_S,
            "callback_us_per_step": hook * 1e6,
            "step_ms_without": without * 1e3, "step_ms_with": with_s * 1e3,
            "ab_overhead_pct": 100 * (with_s - without) / without}


def _ckpt(params_mb: int, saves: int, root: str) -> dict[str, float]:
    import lightning as L
    import torch
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader

    from trainguard.integrations.lightning import TrainguardCheckpointIO

    width = int((params_mb * (1 << 20) / 4 / 4) ** 0.5)  # 4 square layers of float32

    class Big(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                             for _ in range(4)])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(64, width), batch_size=8)

    def blocking_ms(name: str, plugin: Any) -> float:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, plugins=[plugin])
        model = Big()
        trainer.fit(model)
        times = []
        for i in range(saves + 1):
            t0 = time.perf_counter()
            trainer.save_checkpoint(os.path.join(root, f"{name}-{i}.ckpt"))
            times.append(time.perf_counter() - t0)
            time.sleep(max(1.0, 20 * times[-1]))  # let a background write finish
        trainer.strategy.checkpoint_io.teardown()
        for i in range(saves + 1):
            path = os.path.join(root, f"{name}-{i}.ckpt")
            if not os.path.exists(path):
                raise SystemExit(f"{name}: {path} was never written")
        return 1e3 * statistics.median(times[1:])  # the first save pays one-off set-up

    return {"ckpt_block_ms": blocking_ms("trainguard", TrainguardCheckpointIO()),
            "lightning_async_block_ms": blocking_ms("async", AsyncCheckpointIO()),
            "lightning_sync_block_ms": blocking_ms("sync", TorchCheckpointIO()),
            "ckpt_mb": params_mb * 2}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller model")
    parser.add_argument("--steps", type=int, default=None, help="training steps per fit")
    parser.add_argument("--params-mb", type=int, default=None, help="model size in MB (64)")
    parser.add_argument("--saves", type=int, default=None, help="saves per plugin (5)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 300)
    if steps < 20:
        parser.error("--steps must be >= 20")
    if args.child:
        _child_overhead(args.child, steps)
        return 0
    params_mb = args.params_mb or (8 if args.quick else 64)
    saves = args.saves or (2 if args.quick else 5)
    if params_mb < 1 or saves < 1:
        parser.error("--params-mb and --saves must be >= 1")
    figures: dict[str, Any] = dict(_overhead(steps))
    with tempfile.TemporaryDirectory(prefix="tg-lt-ckpt-") as root:
        figures.update(_ckpt(params_mb, saves, root))
    figures["load_avg_1min"] = os.getloadavg()[0]
    _table(figures)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                      for k, v in figures.items()}))
    return 0


def _table(f: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Lightning integration (2 gloo ranks, real Trainer)")
    for col in ("figure", "trainguard", "baseline", "target"):
        table.add_column(col)
    table.add_row("callback_overhead_pct (10 ms step)", f"{f['callback_overhead_pct']:.3f} %"
                  f" CPU ({f['callback_cpu_us_per_step']:.0f} us); wall "
                  f"{f['callback_wall_overhead_pct']:.3f} %",
                  f"A/B step time: {f['ab_overhead_pct']:+.2f} % ({f['step_ms_without']:.2f} -> "
                  f"{f['step_ms_with']:.2f} ms)", "<= 1 %")
    table.add_row(f"ckpt_block_ms ({f['ckpt_mb']} MB)", f"{f['ckpt_block_ms']:.1f} ms",
                  f"AsyncCheckpointIO {f['lightning_async_block_ms']:.1f} ms; TorchCheckpointIO "
                  f"{f['lightning_sync_block_ms']:.1f} ms", "< both")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
