"""Benchmark of the Lightning integration: per-step callback overhead and checkpoint blocking time.

Measured in one run, each with its baseline:

* ``callback_overhead_pct``: CPU time spent inside trainguard's callbacks (FaultToleranceCallback,
  StragglerCallback, PreemptionCallback: every per-step hook they implement, timed around each
  call with the thread's CPU clock, including the preemption check's non-blocking all-reduce)
  per training step, over a 10 ms step; ``callback_wall_overhead_pct`` is the same with the wall
  clock, which on a shared machine also counts the time the thread was not scheduled. Real
  ``lightning.Trainer``, DDP with 2 gloo ranks under ``trainguard launch``, median over ranks.
  What an empty hook costs, timing wrapper included (``time.thread_time`` is a system call, ~3
  us here), is measured in the same fits (an extra callback implementing every per-step hook as
  ``return None``, timed the same way) and subtracted per call (``timer_cpu_us_per_step``):
  Lightning calls every callback's hooks, implemented or not, so only the bodies are ours. The
  uncorrected figure is ``raw_callback_cpu_us_per_step``; ``hot_loop_timer_cpu_us_per_step`` is
  the wrapper around an empty hook called in a tight loop (warm caches: a lower bound).
  Baseline in the same processes: an A/B of the step wall time with and without the callbacks,
  ``--reps`` interleaved repetitions (each runs every ``--variants`` fit once, in an order
  rotated per repetition), each variant's step time against the callback-free fit of the same
  repetition: ``ab_overhead_pct`` (default callbacks; ``_min`` / ``_max`` over repetitions),
  ``ab_<variant>_overhead_pct`` for the others (``no_ddp_hook``: the straggler callback's
  timing of DDP's all-reduce off; ``overlapped_ddp_hook`` / ``blocking_ddp_hook``: the same,
  plus the Python communication hook an earlier default used (issue 11 replaced the overlapped
  one by an autograd final callback and no hook; the blocking one came before it); one callback
  alone: ``ft``, ``straggler``, ...), ``ddp_hook_pct`` / ``overlapped_ddp_hook_pct`` /
  ``blocking_ddp_hook_pct`` (a timing against ``no_ddp_hook``), and the same A/B of the rank
  processes' CPU time per step (every thread: ``ab_cpu_us_per_step``,
  ``ab_<variant>_cpu_us_per_step``), less sensitive to a shared machine's load than wall time;
* ``ddp_<small|deep>_<timer|overlapped|blocking>_hook_us_per_step`` (and ``..._cpu_us_per_step``,
  the process's CPU time, every thread): each timing of DDP's all-reduce alone, forward +
  backward time against DDP's own untimed all-reduce, after a barrier, interleaved
  step by step in the same processes (``Linear(64, 64)``, one bucket, as in the fits; and 8 x
  ``Linear(256, 256)`` in 8 buckets, where a blocking hook loses the overlap);
* ``ckpt_block_ms`` / ``lightning_async_block_ms`` / ``lightning_sync_block_ms``: how long
  ``trainer.save_checkpoint`` blocks the training loop with ``TrainguardCheckpointIO``, with
  Lightning's ``AsyncCheckpointIO`` and with its default synchronous ``TorchCheckpointIO``; same
  model (``--params-mb`` of float32 parameters + SGD momentum), same process, the median of
  ``--saves`` saves each, with time between saves for the background writes to finish.

Prints a rich table, then one JSON line. Run:
``.venv/bin/python bench/lightning_overhead.py [--quick] [--reps 3] [--variants none,default,...]``
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


class _OldOverlap:
    """The gloo hook issue 11 replaced (kept here as the baseline): DDP's asynchronous
    all-reduce re-issued from a Python communication hook, each bucket's completion stamped by a
    Python ``Future.then`` callback on the process group's thread."""

    def __init__(self, group: Any) -> None:
        self.group, self.world_size = group, group.size()
        self.issued_ns = self.done_ns = 0


def _old_overlapped_allreduce(state: Any, bucket: Any) -> Any:
    buf = bucket.buffer()
    buf.div_(state.world_size)
    state.issued_ns = time.perf_counter_ns()
    fut = state.group.allreduce([buf]).get_future()

    def stamp(done: Any) -> Any:
        state.done_ns = max(state.done_ns, time.perf_counter_ns())
        return done.value()[0]

    return fut.then(stamp)


def _register_old_overlapped(model: Any) -> None:
    import torch

    # DDP checks a hook's annotations at run time
    _old_overlapped_allreduce.__annotations__ = {
        "state": object, "bucket": torch.distributed.GradBucket,
        "return": torch.futures.Future[torch.Tensor]}
    model.register_comm_hook(_OldOverlap(model.process_group), _old_overlapped_allreduce)


#: the micro-bench's ways of timing DDP's all-reduce (``none``: untimed, DDP's own)
MICRO = ("none", "timer", "overlapped", "blocking")


def _ddp_hook_micro(steps: int) -> dict[str, dict[str, list[float]]]:
    """Forward + backward wall time (s) of DDP models with each way of timing the gradient
    all-reduce, interleaved step by step in the same processes (so load drifts cancel): ``none``
    (DDP's own C++ all-reduce, untimed), ``timer`` (the default on gloo:
    :class:`BackwardWaitTimer`, no communication hook), ``overlapped`` (the Python hook it
    replaced) and ``blocking`` (the hook before that). A barrier precedes each timed step, so the
    ranks' skew (which one waits in the all-reduce) is not counted. Two model shapes: the overhead
    bench's ``Linear(64, 64)`` (one bucket) and 8 x ``Linear(256, 256)`` in 0.25 MB buckets (8
    buckets: what the blocking hook loses is the overlap). Runs after the fits, on the process
    group Lightning left initialised; a straggler detector is running (as under the callback), so
    the blocking hook's ``dist.all_reduce`` goes through its timing wrapper."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.integrations.lightning._ddp_hook import BackwardWaitTimer, timed_allreduce
    from trainguard.straggler import Detector

    # layers, width, batch, steps: the deep model's steps are ~10x longer on a loaded machine
    shapes = {"small": (1, 64, 8, steps), "deep": (8, 256, 32, max(40, steps // 2))}
    Detector.initialize(window_steps=20)
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for shape, (layers, width, batch, n) in shapes.items():
            models = {}
            for name in MICRO:
                torch.manual_seed(0)
                net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
                model = DDP(net, bucket_cap_mb=0.25)
                if name == "overlapped":
                    _register_old_overlapped(model)
                elif name == "blocking":
                    model.register_comm_hook(model.process_group, timed_allreduce)
                models[name] = model
            timer = BackwardWaitTimer()
            timer.attach(models["timer"])
            x = torch.randn(batch, width)
            times: dict[str, list[float]] = {n: [] for n in models}
            cpus: dict[str, list[float]] = {n: [] for n in models}
            for i in range(n + 5):
                for j in range(len(models)):
                    name = list(models)[(i + j) % len(models)]
                    dist.barrier()  # both ranks start together: what is timed is not skew
                    t0, c0 = time.perf_counter(), time.process_time()
                    models[name](x).pow(2).mean().backward()
                    if name == "timer":
                        Detector.add_collective_wait(timer.take_exposed_s())
                    if i >= 5:
                        times[name].append(time.perf_counter() - t0)
                        cpus[name].append(time.process_time() - c0)  # every thread's
            timer.detach()
            out[shape] = times
            out[f"{shape}_cpu"] = cpus
            dist.barrier()
    finally:
        Detector.shutdown()
    return out


def _child_overhead(out: str, steps: int, reps: int, variants: list[str],
                    hook_steps: int) -> None:
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
        """Wall clock and this process's CPU clock (every thread: gloo's, the detector's
        reporter) at each batch end; the same in every variant."""

        def __init__(self) -> None:
            self.t: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.t.append(time.perf_counter())
            self.cpu.append(time.process_time())

    class BlockingHook(L.Callback):
        """The first DDP hook: a blocking ``dist.all_reduce`` per bucket."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from trainguard.integrations.lightning._ddp_hook import timed_allreduce

            model = trainer.strategy.model
            model.register_comm_hook(model.process_group, timed_allreduce)

    class OverlappedHook(L.Callback):
        """The second DDP hook, replaced by the timer in issue 11 (see ``_OldOverlap``)."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            _register_old_overlapped(trainer.strategy.model)

    class Noop(L.Callback):
        """Every per-step hook, empty, timed like ours: what a hook call costs in a fit
        (Lightning calls every callback's hook, implemented or not) plus the timing wrapper."""

        def on_train_batch_start(self, *args: Any) -> None:
            return None

        def on_before_backward(self, *args: Any) -> None:
            return None

        def on_after_backward(self, *args: Any) -> None:
            return None

        def on_before_optimizer_step(self, *args: Any) -> None:
            return None

        def on_train_batch_end(self, *args: Any) -> None:
            return None

    def fit(variant: str) -> tuple[dict[str, float], float, float, dict[str, float]]:
        totals = {"s": 0.0, "cpu_s": 0.0}
        ours = _callbacks(tgl, variant)
        _timed(ours, totals)
        noop_totals = {"s": 0.0, "cpu_s": 0.0, "calls": 0.0}
        noop = Noop()
        _timed([noop], noop_totals)
        clock = Clock()
        extra: list[Any] = []
        if variant == "blocking_ddp_hook":
            extra.append(BlockingHook())
        elif variant == "overlapped_ddp_hook":
            extra.append(OverlappedHook())
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps,
                            callbacks=[*ours, noop, *extra, clock], logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        trainer.fit(Step())
        gaps = [b - a for a, b in zip(clock.t[5:], clock.t[6:])]
        cpu = (clock.cpu[-1] - clock.cpu[5]) / (len(clock.cpu) - 6)
        return ({k: v / steps for k, v in totals.items()}, statistics.median(gaps), cpu,
                noop_totals)

    # interleaved: every repetition runs each variant once, in an order rotated per repetition,
    # so the machine's drift falls on all variants alike
    runs: dict[str, list[tuple[dict[str, float], float, float, dict[str, float]]]] = {
        v: [] for v in variants}
    for rep in range(reps):
        for i in range(len(variants)):
            variant = variants[(i + rep) % len(variants)]
            runs[variant].append(fit(variant))
    timer_cpu, timer_wall = _timer_cost()
    hooks = _ddp_hook_micro(hook_steps)
    ours = runs[DEFAULT]
    result = {"rank": int(os.environ["RANK"]),
              "hot_timer_cpu_s_per_call": timer_cpu, "hot_timer_s_per_call": timer_wall,
              # the empty callback's hooks in the default fits (same Trainer, same step)
              "noop_cpu_s_per_call": statistics.median(r[3]["cpu_s"] / r[3]["calls"]
                                                        for r in ours),
              "noop_s_per_call": statistics.median(r[3]["s"] / r[3]["calls"] for r in ours),
              "calls_per_step": statistics.median(r[0]["calls"] for r in ours),
              "hook_s_per_step": statistics.median(r[0]["s"] for r in ours),
              "hook_cpu_s_per_step": statistics.median(r[0]["cpu_s"] for r in ours),
              "hooks_us": {k: round(v * 1e6, 1) for k, v in ours[-1][0].items()},
              "step_s": {v: [r[1] for r in rs] for v, rs in runs.items()},
              "cpu_s": {v: [r[2] for r in rs] for v, rs in runs.items()},
              "ddp_hook_micro": hooks}
    with open(f"{out}.{result['rank']}", "w") as f:
        json.dump(result, f)


#: the variants an overhead run can compare; each fit gets fresh callback instances
VARIANTS = ("none", "default", "no_ddp_hook", "overlapped_ddp_hook", "blocking_ddp_hook", "ft",
            "straggler", "straggler_no_ddp_hook", "preempt")
DEFAULT = "default"


def _callbacks(tgl: Any, variant: str) -> list[Any]:
    """The trainguard callbacks of one variant: ``none``; ``default`` (all three, defaults:
    the straggler callback times DDP's all-reduce with gloo); ``no_ddp_hook`` (all three,
    ``time_ddp_allreduce=False``); ``overlapped_ddp_hook`` / ``blocking_ddp_hook`` (as
    ``no_ddp_hook``, plus the communication hook an earlier default used, registered by the
    bench); or one callback alone."""
    ft = tgl.FaultToleranceCallback
    strag = tgl.StragglerCallback
    return {
        "none": list,
        "default": lambda: [ft(), strag(window_steps=20), tgl.PreemptionCallback()],
        "no_ddp_hook": lambda: [ft(), strag(window_steps=20, time_ddp_allreduce=False),
                                tgl.PreemptionCallback()],
        "overlapped_ddp_hook": lambda: [ft(), strag(window_steps=20, time_ddp_allreduce=False),
                                        tgl.PreemptionCallback()],
        "blocking_ddp_hook": lambda: [ft(), strag(window_steps=20, time_ddp_allreduce=False),
                                      tgl.PreemptionCallback()],
        "ft": lambda: [ft()],
        "straggler": lambda: [strag(window_steps=20)],
        "straggler_no_ddp_hook": lambda: [strag(window_steps=20, time_ddp_allreduce=False)],
        "preempt": lambda: [tgl.PreemptionCallback()],
    }[variant]()


def _spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def _overhead(steps: int, reps: int, variants: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tg-lt-bench-") as tmp:
        out = os.path.join(tmp, "overhead")
        cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--nproc-per-node",
               "2", "--ft-preload", "lightning", "--log-dir", os.path.join(tmp, "logs"),
               __file__, "--child", out, "--steps", str(steps), "--reps", str(reps),
               "--variants", ",".join(variants)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"overhead run failed (rc {proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-4000:]}")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    # the timing wrapper's own cost (measured in the same processes) is not the callbacks'
    calls = statistics.median(r["calls_per_step"] for r in ranks)
    # an empty hook's cost in the same fits (call + timing wrapper, as cold as ours): Lightning
    # calls every callback's hooks whether implemented or not, so only the bodies are ours
    timer_cpu = statistics.median(r["noop_cpu_s_per_call"] for r in ranks) * calls
    timer_wall = statistics.median(r["noop_s_per_call"] for r in ranks) * calls
    hot_cpu = statistics.median(r["hot_timer_cpu_s_per_call"] for r in ranks) * calls
    raw_cpu = statistics.median(r["hook_cpu_s_per_step"] for r in ranks)
    hook = statistics.median(r["hook_s_per_step"] for r in ranks) - timer_wall
    cpu = raw_cpu - timer_cpu
    # per variant and repetition: the step time (median of the two ranks' medians), then the
    # ratio to the "none" fit of the same repetition (interleaved, so both saw the same load)
    step = {v: [statistics.median(r["step_s"][v][i] for r in ranks) for i in range(reps)]
            for v in variants}
    # and the rank processes' CPU per step (all threads), less sensitive to load than wall time
    cpu_step = {v: [statistics.median(r["cpu_s"][v][i] for r in ranks) for i in range(reps)]
                for v in variants}
    print("per-hook CPU us/step, rank 0:", json.dumps(ranks[0]["hooks_us"]), flush=True)
    fig: dict[str, Any] = {
        "callback_overhead_pct": 100 * cpu / STEP_S, "callback_cpu_us_per_step": cpu * 1e6,
        "raw_callback_cpu_us_per_step": raw_cpu * 1e6, "timer_cpu_us_per_step": timer_cpu * 1e6,
        "hot_loop_timer_cpu_us_per_step": hot_cpu * 1e6,
        "hook_calls_per_step": calls,
        "callback_wall_overhead_pct": 100 * hook / STEP_S,
        "callback_us_per_step": hook * 1e6,
        "step_ms_without": statistics.median(step["none"]) * 1e3,
        "step_ms_with": statistics.median(step[DEFAULT]) * 1e3, "ab_reps": reps,
        "process_cpu_ms_per_step_without": statistics.median(cpu_step["none"]) * 1e3}
    for v in variants:
        if v == "none":
            continue
        pct = [100 * (w - n) / n for w, n in zip(step[v], step["none"])]
        lo, mid, hi = _spread(pct)
        key = "ab_overhead_pct" if v == DEFAULT else f"ab_{v}_overhead_pct"
        fig[key], fig[f"{key}_min"], fig[f"{key}_max"] = mid, lo, hi
        cpu_us = [1e6 * (w - n) for w, n in zip(cpu_step[v], cpu_step["none"])]
        lo, mid, hi = _spread(cpu_us)
        ckey = "ab_cpu_us_per_step" if v == DEFAULT else f"ab_{v}_cpu_us_per_step"
        fig[ckey], fig[f"{ckey}_min"], fig[f"{ckey}_max"] = mid, lo, hi
        if v != DEFAULT:
            fig[f"step_ms_{v}"] = statistics.median(step[v]) * 1e3
    for shape in ("small", "deep"):
        # per step: each timing's extra forward+backward time over DDP's own all-reduce, both
        # ranks' medians of step-by-step interleaved runs
        med = {n: statistics.median(statistics.median(r["ddp_hook_micro"][shape][n])
                                    for r in ranks) for n in MICRO}
        cpu_med = {n: statistics.median(statistics.median(r["ddp_hook_micro"][f"{shape}_cpu"][n])
                                        for r in ranks) for n in MICRO}
        fig[f"ddp_{shape}_fwd_bwd_us_none"] = med["none"] * 1e6
        fig[f"ddp_{shape}_fwd_bwd_cpu_us_none"] = cpu_med["none"] * 1e6
        for n in MICRO[1:]:
            fig[f"ddp_{shape}_{n}_hook_us_per_step"] = (med[n] - med["none"]) * 1e6
            fig[f"ddp_{shape}_{n}_hook_cpu_us_per_step"] = (cpu_med[n] - cpu_med["none"]) * 1e6
    if "no_ddp_hook" in variants:
        # the all-reduce timing alone: the same callbacks with it (the default's timer, or a
        # hook an earlier default used) against without (no_ddp_hook)
        for v, key in ((DEFAULT, "ddp_hook_pct"),
                       ("overlapped_ddp_hook", "overlapped_ddp_hook_pct"),
                       ("blocking_ddp_hook", "blocking_ddp_hook_pct")):
            if v in variants:
                pct = [100 * (w - n) / n for w, n in zip(step[v], step["no_ddp_hook"])]
                lo, mid, hi = _spread(pct)
                fig[key], fig[f"{key}_min"], fig[f"{key}_max"] = mid, lo, hi
    return fig


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
    parser.add_argument("--reps", type=int, default=3,
                        help="interleaved repetitions of every variant (>= 1, default 3)")
    parser.add_argument("--variants", default="none,default,no_ddp_hook,overlapped_ddp_hook",
                        help=f"comma-separated overhead variants, 'none' and 'default' always "
                             f"included; known: {', '.join(VARIANTS)}")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 300)
    if steps < 20:
        parser.error("--steps must be >= 20")
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    variants = ["none", DEFAULT] + [v for v in args.variants.split(",")
                                    if v and v not in ("none", DEFAULT)]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown --variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.child:
        _child_overhead(args.child, steps, args.reps, variants, steps)
        return 0
    params_mb = args.params_mb or (8 if args.quick else 64)
    saves = args.saves or (2 if args.quick else 5)
    if params_mb < 1 or saves < 1:
        parser.error("--params-mb and --saves must be >= 1")
    figures: dict[str, Any] = dict(_overhead(steps, args.reps, variants))
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
                  f"{f['callback_wall_overhead_pct']:.3f} %", "", "<= 1 %")
    reps = f["ab_reps"]
    names = [DEFAULT] + [k[len("step_ms_"):] for k in f if k.startswith("step_ms_")
                         and k not in ("step_ms_with", "step_ms_without")]
    for v in names:
        key = "ab_overhead_pct" if v == DEFAULT else f"ab_{v}_overhead_pct"
        ckey = "ab_cpu_us_per_step" if v == DEFAULT else f"ab_{v}_cpu_us_per_step"
        step = f["step_ms_with"] if v == DEFAULT else f[f"step_ms_{v}"]
        table.add_row(f"A/B vs no callbacks: {v.replace('_', ' ')}",
                      f"wall {f[key]:+.2f} % (min {f[key + '_min']:+.2f}, max "
                      f"{f[key + '_max']:+.2f}; {step:.2f} ms); process CPU "
                      f"{f[ckey]:+.0f} us/step (min {f[ckey + '_min']:+.0f}, max "
                      f"{f[ckey + '_max']:+.0f})",
                      f"no callbacks {f['step_ms_without']:.2f} ms, CPU "
                      f"{f['process_cpu_ms_per_step_without']:.2f} ms/step; {reps} interleaved "
                      "reps", "<= 1 %" if v == DEFAULT else "")
    for shape, label in (("small", "Linear(64,64), 1 bucket"),
                         ("deep", "8 x Linear(256,256), 8 buckets")):
        table.add_row(f"DDP all-reduce timing cost per fwd+bwd, {label}",
                      f"timer (default) {f[f'ddp_{shape}_timer_hook_us_per_step']:+.0f} us; "
                      f"overlapped hook (before) "
                      f"{f[f'ddp_{shape}_overlapped_hook_us_per_step']:+.0f} us; blocking hook "
                      f"{f[f'ddp_{shape}_blocking_hook_us_per_step']:+.0f} us; process CPU "
                      f"{f[f'ddp_{shape}_timer_hook_cpu_us_per_step']:+.0f} / "
                      f"{f[f'ddp_{shape}_overlapped_hook_cpu_us_per_step']:+.0f} / "
                      f"{f[f'ddp_{shape}_blocking_hook_cpu_us_per_step']:+.0f} us",
                      f"untimed {f[f'ddp_{shape}_fwd_bwd_us_none']:.0f} us "
                      "(step-by-step interleaved)", "")
    for key, label in (("ddp_hook_pct", "all-reduce timer (default)"),
                       ("overlapped_ddp_hook_pct", "overlapped DDP hook (before)"),
                       ("blocking_ddp_hook_pct", "blocking DDP hook (first)")):
        if key in f:
            table.add_row(f"{label} vs untimed", f"wall {f[key]:+.2f} % (min "
                          f"{f[key + '_min']:+.2f}, max {f[key + '_max']:+.2f})",
                          "same callbacks, time_ddp_allreduce=False", "")
    table.add_row(f"ckpt_block_ms ({f['ckpt_mb']} MB)", f"{f['ckpt_block_ms']:.1f} ms",
                  f"AsyncCheckpointIO {f['lightning_async_block_ms']:.1f} ms; TorchCheckpointIO "
                  f"{f['lightning_sync_block_ms']:.1f} ms", "< both")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
