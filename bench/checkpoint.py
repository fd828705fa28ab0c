"""Benchmark: async checkpoint blocking/durable time vs torch.save, DCP async_save and machine limits.

Usage: python bench/checkpoint.py --size-mb 256 [--dir /path] [--repeats 3] [--nvrx-python PY]

State: 64 float32 CPU tensors totalling --size-mb MiB. Limits measured in the same run: memcpy
into an existing buffer, and fsync'd sequential write bandwidth to the same directory. Prints a
rich table, then exactly one JSON line.
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


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_s(state, repeats: int) -> float:
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():  # pre-fault like our arenas
        dst[k].copy_(v)
    return median_time(lambda: [dst[k].copy_(v) for k, v in state.items()], repeats)


def disk_write_gbps(directory: str, nbytes: int, repeats: int) -> float:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)  # 64 MiB source
    path = os.path.join(directory, "bw.bin")

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = nbytes
        while left:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
        os.close(fd)
        os.unlink(path)

    return nbytes / median_time(write, repeats) / 1e9


def torch_save_s(state, directory: str, repeats: int) -> float:
    def save():
        path = os.path.join(directory, "ts.pt")
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(path)

    return median_time(save, repeats)


def dcp_async(state, directory: str, repeats: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    blocks, durables = [], []
    for i in range(repeats + 1):
        path = os.path.join(directory, f"dcp{i}")
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        if i:  # first call warms up the executor
            blocks.append(t1 - t0)
            durables.append(t2 - t0)
        shutil.rmtree(path, ignore_errors=True)
    return statistics.median(blocks), statistics.median(durables)


def ours(state, directory: str, repeats: int) -> tuple[float, float]:
    blocks, durables = [], []
    with AsyncCheckpointer(os.path.join(directory, "tg"), keep_last=1) as ck:
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            req = ck.save(state, step)
            t1 = time.perf_counter()
            ck.wait()
            if step:  # step 0 allocates the arena and waits for the writer to start
                blocks.append(t1 - t0)
                durables.append(req.durable_s)  # until the manifest is committed (before pruning)
    return statistics.median(blocks), statistics.median(durables)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--dir", default=None, help="directory to write to (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nvrx-python", default=None, help="interpreter with NVRx installed")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="tg_bench_", dir=args.dir)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(minutes=5))
    try:
        state = make_state(args.size_mb)
        nbytes = sum(t.numel() * 4 for t in state.values())
        r = {"size_mb": args.size_mb, "memcpy_s": memcpy_s(state, args.repeats + 2),
             "disk_write_gbps": disk_write_gbps(base, nbytes, args.repeats)}
        r["torch_save_s"] = torch_save_s(state, base, args.repeats)
        r["dcp_async_block_s"], r["dcp_async_durable_s"] = dcp_async(state, base, args.repeats)
        r["async_block_s"], r["async_durable_s"] = ours(state, base, args.repeats)
        r["nvrx"] = nvrx(args.nvrx_python)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(base, ignore_errors=True)
    disk_limit_s = nbytes / (r["disk_write_gbps"] * 1e9)
    r["block_vs_memcpy"] = r["async_block_s"] / r["memcpy_s"]
    r["block_vs_dcp_async"] = r["async_block_s"] / r["dcp_async_block_s"]
    r["durable_vs_disk_limit"] = r["async_durable_s"] / disk_limit_s
    r["targets_met"] = {"block<=1.5x_memcpy": r["block_vs_memcpy"] <= 1.5,
                        "block<=0.5x_dcp_async": r["block_vs_dcp_async"] <= 0.5,
                        "durable<=1.3x_disk_limit": r["durable_vs_disk_limit"] <= 1.3}
    table = Table(title=f"checkpoint of {args.size_mb} MiB ({N_TENSORS} float32 tensors), medians")
    for col in ("what", "blocking s", "durable s"):
        table.add_column(col)
    table.add_row("memcpy (limit)", f"{r['memcpy_s']:.4f}", "")
    table.add_row(f"fsync'd write {r['disk_write_gbps']:.2f} GB/s (limit)", "", f"{disk_limit_s:.3f}")
    table.add_row("torch.save + fsync", f"{r['torch_save_s']:.3f}", f"{r['torch_save_s']:.3f}")
    table.add_row("DCP async_save", f"{r['dcp_async_block_s']:.4f}", f"{r['dcp_async_durable_s']:.3f}")
    table.add_row("trainguard AsyncCheckpointer", f"{r['async_block_s']:.4f}", f"{r['async_durable_s']:.3f}")
    table.add_row("NVRx", r["nvrx"], "")
    Console().print(table)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
