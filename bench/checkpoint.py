"""Benchmark: async checkpoint blocking/durable time vs torch.save, DCP async_save and machine
limits.

Usage: python bench/checkpoint.py --size-mb 256 [--dir /path] [--repeats 5] [--nvrx-python PY]
       [--scenarios rounds,loop,dtensor] [--step-ms 200] [--loop-rounds 3] [--loop-steps 8]
       [--fast-dir /dev/shm] [--save-every 1]

Scenarios (all by default, in one run):
  rounds  - 64 float32 CPU tensors totalling --size-mb MiB saved once per round; limits measured
            in the same run: memcpy into an existing buffer, fsync'd write bandwidth to --dir.
  loop    - a training loop whose model + optimizer state is --size-mb MiB and whose step takes
            ~--step-ms, saving every step: step-time overhead and blocking time of the overlapped
            snapshot (if_busy skip and wait), our blocking snapshot, DCP async_save, torch.save,
            and a bare background memcpy of the state per step (the floor of any overlapped
            copy on this host); saves skipped, load average (see bench/_ckpt_loop.py).
  dtensor - 2 gloo ranks: a DTensor state of --size-mb MiB vs plain tensors of the same size,
            saved in the dcp format until committed, then loaded resharded (bench/_ckpt_dtensor.py).
loop and dtensor write to --fast-dir (tmpfs by default) so the writes keep up with a save per
step and the figures measure the checkpointing software, not the disk. Prints rich tables, then
exactly one JSON line.
Also (rounds): the blocking time of the first save of a freshly created checkpointer, without and
with ``warmup(state)`` (``first_save_block_s``, ``first_save_after_warmup_block_s``), and the
longest
single non-blocking ``maybe_finalize()`` poll while a save is committed (``finalize_block_s``: what
one training step can stall for the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import timedelta

import _ckpt_dtensor
import _ckpt_loop
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from trainguard._core.net import free_port
from trainguard.checkpointing import AsyncCheckpointer

N_TENSORS = 64


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    numel = size_mb * 2**20 // 4 // N_TENSORS
    return {f"layer{i}.weight": torch.randn(numel) for i in range(N_TENSORS)}


class Rounds:
    """Runs every method once per round (interleaved), so machine-load drift hits all alike."""

    def __init__(self, state, directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp, self.state, self.dir = dcp, state, directory
        self.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self.dst = {k: torch.empty_like(v) for k, v in state.items()}
        self.src = memoryview(bytearray(os.urandom(1 << 20)) * 64)  # 64 MiB of incompressible data
        self.ck = AsyncCheckpointer(os.path.join(directory, "tg"), keep_last=1)
        self.samples: dict[str, list[float]] = {}
        self.round = 0

    def add(self, key: str, value: float) -> None:
        if self.round:  # round 0 warms up (page faults, writer start, executors)
            self.samples.setdefault(key, []).append(value)

    def memcpy(self) -> None:
        t0 = time.perf_counter()
        for k, v in self.state.items():
            self.dst[k].copy_(v)
        self.add("memcpy_s", time.perf_counter() - t0)

    def disk(self) -> None:
        path = os.path.join(self.dir, "bw.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = self.nbytes
        while left:
            left -= os.write(fd, self.src[: min(left, len(self.src))])
        os.fsync(fd)
        os.close(fd)
        self.add("disk_write_s", time.perf_counter() - t0)
        os.unlink(path)

    def torch_save(self) -> None:
        path = os.path.join(self.dir, "ts.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        self.add("torch_save_s", time.perf_counter() - t0)
        os.unlink(path)

    def dcp_async(self) -> None:
        path = os.path.join(self.dir, f"dcp{self.round}")
        t0 = time.perf_counter()
        fut = self.dcp.async_save(self.state, checkpoint_id=path)
        self.add("dcp_async_block_s", time.perf_counter() - t0)
        fut.result()
        self.add("dcp_async_durable_s", time.perf_counter() - t0)
        shutil.rmtree(path, ignore_errors=True)

    def ours(self) -> None:
        t0 = time.perf_counter()
        req = self.ck.save(self.state, self.round)
        self.add("async_block_s", time.perf_counter() - t0)
        # a training loop polls maybe_finalize() once per step: the longest call is the most a
        # step stalls for the commit (manifest fsyncs, pruning) when it runs on the trainer
        longest, polls = 0.0, 0
        while True:
            t1 = time.perf_counter()
            done = self.ck.maybe_finalize()
            longest = max(longest, time.perf_counter() - t1)
            if done or polls > 200_000:
                break
            polls += 1
            time.sleep(0.002)
        self.add("finalize_block_s", longest)
        self.add("async_durable_s", req.durable_s)  # until the manifest is committed

    def run(self, rounds: int) -> dict[str, float]:
        try:
            for self.round in range(rounds + 1):
                for fn in (self.memcpy, self.disk, self.ours, self.dcp_async, self.torch_save):
                    fn()
        finally:
            self.ck.close()
        out = {k: statistics.median(v) for k, v in self.samples.items()}
        out["disk_write_gbps"] = self.nbytes / out.pop("disk_write_s") / 1e9
        return out


def first_save(state, directory: str, repeats: int, warm: bool) -> float | None:
    """Median blocking time of the first save of a checkpointer created just before it (after
    ``warmup(state)`` if ``warm``; None when this version has no warmup)."""
    samples = []
    for i in range(repeats):
        t_make = time.perf_counter()
        ck = AsyncCheckpointer(os.path.join(directory, f"first{i}{warm}"), keep_last=1)
        if warm:
            if not hasattr(ck, "warmup"):
                ck.close()
                return None
            ck.warmup(state)
        t0 = time.perf_counter()
        ck.save(state, 1)
        samples.append(time.perf_counter() - t0)
        print(f"first save (warmup: {warm}): setup {t0 - t_make:.3f} s, save {samples[-1]:.4f} s")
        ck.close()
    return statistics.median(samples)


def nvrx(python: str | None) -> str:
    if not python:
        return "unavailable (no --nvrx-python given)"
    probe = subprocess.run([python, "-c", "import nvidia_resiliency_ext"], capture_output=True,
                           text=True, timeout=120, check=False)
    if probe.returncode:
        return "unavailable (nvidia_resiliency_ext not importable: "
        + probe.stderr.strip().splitlines()[-1][:120] + ")"
    return "unavailable (NVRx async checkpointing needs CUDA; this machine has none)" \
        if not torch.cuda.is_available() else "not measured"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--dir", default=None, help="directory to write to (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds (after 1 warm-up)")
    ap.add_argument("--nvrx-python", default=None, help="interpreter with NVRx installed")
    ap.add_argument("--scenarios", default="rounds,loop,dtensor",
                    help="comma-separated subset of rounds,loop,dtensor")
    ap.add_argument("--step-ms", type=float, default=200.0, help="loop: target step time (ms)")
    ap.add_argument("--loop-rounds", type=int, default=3, help="loop: measured rounds")
    ap.add_argument("--loop-steps", type=int, default=8, help="loop: steps per method per round")
    ap.add_argument("--loop-methods", default=",".join(_ckpt_loop.METHODS),
                    help="loop: comma-separated subset of " + ",".join(_ckpt_loop.METHODS)
                    + " (none is always run: it is the baseline)")
    ap.add_argument("--save-every", type=int, default=1,
                    help="loop: save every N steps (1 = every step; overheads are per step)")
    ap.add_argument("--fast-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="loop/dtensor: directory to write to (default /dev/shm)")
    args = ap.parse_args()
    args.scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    methods = [x.strip() for x in args.loop_methods.split(",") if x.strip()]
    args.loop_methods = tuple(m for m in _ckpt_loop.METHODS if m == "none" or m in methods)
    unknown = (set(args.scenarios) - {"rounds", "loop", "dtensor"}) | (
        set(methods) - set(_ckpt_loop.METHODS))
    if unknown or args.size_mb <= 0 or args.repeats < 1 or args.step_ms <= 0 \
            or args.save_every < 1:
        ap.error(f"bad arguments: unknown scenarios or loop methods {sorted(unknown)}"
                 if unknown else
                 "--size-mb, --repeats, --step-ms and --save-every must be positive")
    return args


def _rounds(args: argparse.Namespace, base: str) -> dict:
    state = make_state(args.size_mb)
    nbytes = sum(t.numel() * 4 for t in state.values())
    r = Rounds(state, base).run(args.repeats)
    r["first_save_block_s"] = first_save(state, base, 3, warm=False)
    r["first_save_after_warmup_block_s"] = first_save(state, base, 3, warm=True)
    r["nvrx"] = nvrx(args.nvrx_python)
    disk_limit_s = nbytes / (r["disk_write_gbps"] * 1e9)
    r["block_vs_memcpy"] = r["async_block_s"] / r["memcpy_s"]
    r["snapshot_block_vs_dcp_async"] = r["async_block_s"] / r["dcp_async_block_s"]
    r["durable_vs_disk_limit"] = r["async_durable_s"] / disk_limit_s
    table = Table(title=f"checkpoint of {args.size_mb} MiB ({N_TENSORS} float32 tensors), medians")
    for col in ("what", "blocking s", "durable s"):
        table.add_column(col)
    table.add_row("memcpy (limit)", f"{r['memcpy_s']:.4f}", "")
    table.add_row(f"fsync'd write {r['disk_write_gbps']:.2f} GB/s (limit)", "",
                  f"{disk_limit_s:.3f}")
    table.add_row("torch.save + fsync", f"{r['torch_save_s']:.3f}", f"{r['torch_save_s']:.3f}")
    table.add_row("DCP async_save", f"{r['dcp_async_block_s']:.4f}",
                  f"{r['dcp_async_durable_s']:.3f}")
    table.add_row("trainguard AsyncCheckpointer", f"{r['async_block_s']:.4f}",
                  f"{r['async_durable_s']:.3f}")
    table.add_row("  its first save after creation", f"{r['first_save_block_s']:.4f}", "")
    warm = r["first_save_after_warmup_block_s"]
    table.add_row("  its first save after warmup(state)",
                  "n/a" if warm is None else f"{warm:.4f}", "")
    table.add_row("  its longest maybe_finalize() poll", f"{r['finalize_block_s']:.4f}", "")
    table.add_row("NVRx", r["nvrx"], "")
    Console().print(table)
    return r


def _loop(args: argparse.Namespace, base: str) -> dict:
    loop = _ckpt_loop.Loop(args.size_mb, args.step_ms, base, args.save_every)
    r = _ckpt_loop.summarize(loop.run(args.loop_rounds, args.loop_steps, args.loop_methods),
                             loop.batch, loop.nbytes)
    r["loop_save_every"] = args.save_every
    table = Table(title=f"training loop: {r['loop_state_mb']} MiB state, save every "
                        f"{args.save_every} step(s) "
                        f"(step {r['loop_step_s'] * 1e3:.0f} ms, batch {loop.batch}); "
                        "min / median / max")
    for col in ("method", "blocks training s", "step s", "step overhead %"):
        table.add_column(col)
    spread = r["loop_spread"]

    def fmt(key: str) -> str:
        lo, mid, hi = spread[key]
        return f"{lo:.4f} / {mid:.4f} / {hi:.4f}"

    table.add_row("memcpy of the state (reference)", fmt("memcpy_s"), "", "")
    table.add_row("no checkpoint (baseline)", "", fmt("none_step_s"), "")
    for method, label in (("bgcopy", "background memcpy only (floor)"),
                          ("overlap", "trainguard overlapped snapshot (if_busy=skip)"),
                          ("overlap_wait", "trainguard overlapped snapshot (if_busy=wait)"),
                          ("snapshot", "trainguard snapshot"),
                          ("dcp_async", "DCP async_save"), ("torch_save", "torch.save + fsync")):
        if method in args.loop_methods:
            table.add_row(label, fmt(f"{method}_block_s"), fmt(f"{method}_step_s"),
                          f"{r[f'{method}_step_overhead_pct']:.1f}")
    Console().print(table)
    if "overlap" in args.loop_methods:
        Console().print(f"overlapped saves skipped (previous one still in flight): "
                        f"{r['saves_skipped']} of {r['overlap_saves_requested']}; load average "
                        f"{r['loop_loadavg'][0]:.1f}-{r['loop_loadavg'][1]:.1f}")
    return r


def _dtensor(args: argparse.Namespace, base: str) -> dict:
    r = _ckpt_dtensor.run(args.size_mb, base, args.repeats)
    table = Table(title=f"DTensor ({args.size_mb} MiB over 2 gloo ranks) vs plain tensors, "
                        "format='dcp'; min / median / max")
    for col in ("what", "seconds"):
        table.add_column(col)
    for key, label in (("plain_save_s", "plain-tensor save, until committed"),
                       ("dtensor_save_s", "DTensor save, until committed"),
                       ("plain_block_s", "plain-tensor save, blocking"),
                       ("dtensor_block_s", "DTensor save, blocking"),
                       ("dtensor_load_reshard_s", "DTensor load, Shard(0) -> Shard(1)")):
        lo, mid, hi = r["dtensor_spread"][key]
        table.add_row(label, f"{lo:.3f} / {mid:.3f} / {hi:.3f}")
    Console().print(table)
    return r


def _targets(r: dict) -> dict[str, bool]:
    out = {}
    if "async_block_s" in r:
        out.update({"block<=1.5x_memcpy": r["block_vs_memcpy"] <= 1.5,
                    "block<=0.5x_dcp_async": r["snapshot_block_vs_dcp_async"] <= 0.5,
                    "durable<=1.3x_disk_limit": r["durable_vs_disk_limit"] <= 1.3})
    if "overlap_block_s" in r:
        out.update({"overlap_block<=0.25x_memcpy": r["overlap_block_vs_memcpy"] <= 0.25,
                    "overlap_step_overhead<=5pct": r["overlap_step_overhead_pct"] <= 5.0})
    if "block_vs_dcp_async" in r:
        out["overlap_block<=0.2x_dcp_async"] = r["block_vs_dcp_async"] <= 0.2
    if "dtensor_save_s" in r:
        out["dtensor_save<=1.3x_plain"] = r["dtensor_vs_plain_save"] <= 1.3
    return out


def main() -> None:
    args = _args()
    base = tempfile.mkdtemp(prefix="tg_bench_", dir=args.dir)
    fast = tempfile.mkdtemp(prefix="tg_bench_", dir=args.fast_dir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(minutes=5))
    r: dict = {"size_mb": args.size_mb}
    try:
        if "rounds" in args.scenarios:
            r.update(_rounds(args, base))
        if "loop" in args.scenarios:
            r.update(_loop(args, fast))
        if "dtensor" in args.scenarios:
            r.update(_dtensor(args, fast))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    r["targets_met"] = _targets(r)

    def rounded(v):
        if isinstance(v, float):
            return round(v, 5)
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        if isinstance(v, list):
            return [rounded(x) for x in v]
        return v

    print(json.dumps(rounded(r)))


if __name__ == "__main__":
    main()
