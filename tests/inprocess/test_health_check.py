"""Health checks: CPU-safe defaults, bounded CUDA check, InfiniBand counters, raising checks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from trainguard.errors import ConfigError
from trainguard.inprocess.compose import Compose
from trainguard.inprocess.exceptions import HealthCheckError
from trainguard.inprocess.health_check import (
    CudaHealthCheck,
    HealthCheck,
    NicHealthCheck,
    default_health_check,
    run_bounded,
)
from trainguard.inprocess.state import FrozenState, State

STATE = State(rank=1, world_size=2, initial_rank=1, initial_world_size=2).freeze()
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_base_is_abstract():
    with pytest.raises(TypeError):
        HealthCheck()  # type: ignore[abstract]


@no_cuda
def test_cuda_check_is_not_applicable_without_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # NVRx called NVML here and failed on CPU hosts
    threads = threading.active_count()
    assert CudaHealthCheck(timeout=1)(STATE) is STATE
    assert threading.active_count() == threads  # nothing was started


@no_cuda
def test_default_chain_on_cpu_passes(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    chain = default_health_check()
    assert [type(c) for c in chain.instances] == [NicHealthCheck]
    assert chain(STATE) is STATE and chain(STATE) is STATE


@needs_cuda
def test_cuda_check_binds_device_and_passes():
    device = torch.cuda.device_count() - 1
    check = CudaHealthCheck(timeout=30, device=device)
    torch.ones(8, device=f"cuda:{device}").sum().item()
    assert check(STATE) is STATE
    assert [type(c) for c in default_health_check().instances] == [CudaHealthCheck, NicHealthCheck]


def test_cuda_check_arguments():
    with pytest.raises(ConfigError):
        CudaHealthCheck(timeout=0)
    with pytest.raises(TypeError):
        CudaHealthCheck(timeout="30")  # type: ignore[arg-type]


def test_run_bounded_times_out_on_a_hang():
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(HealthCheckError, match=r"device sync did not finish within 0\.200 s"):
        run_bounded(lambda: release.wait(30), 0.2, "device sync")
    took = time.monotonic() - start
    release.set()
    print(f"bounded health check gave up after {took:.3f} s (limit 0.2 s)")
    assert took < 3.0


def test_run_bounded_wraps_errors_and_passes():
    def fail():
        raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(HealthCheckError, match="probe failed: RuntimeError") as info:
        run_bounded(fail, 5, "probe")
    assert isinstance(info.value.__cause__, RuntimeError)
    seen = []
    run_bounded(lambda: seen.append(threading.current_thread().name), 5, "ok")
    assert seen == ["trainguard-health-ok"]


def _ib(root: Path, device: str, port: int, value: str) -> Path:
    path = root / device / "ports" / str(port) / "counters" / "link_downed"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")
    return path


def test_nic_check_detects_link_down(tmp_path):
    a = _ib(tmp_path, "mlx5_0", 1, "3")
    _ib(tmp_path, "mlx5_1", 1, "0")
    check = NicHealthCheck(sysfs_root=tmp_path)
    assert check(STATE) is STATE  # baseline
    assert check(STATE) is STATE  # unchanged
    a.write_text("4\n")
    with pytest.raises(HealthCheckError, match=r"mlx5_0 port 1: link_downed 3 -> 4") as info:
        check(STATE)
    assert "mlx5_1" not in str(info.value) and "rank 1" in str(info.value)
    assert check(STATE) is STATE  # the new value is the new baseline


def test_nic_check_filters_devices_and_skips_garbage(tmp_path):
    a = _ib(tmp_path, "mlx5_0", 1, "0")
    _ib(tmp_path, "mlx5_1", 2, "not a number")
    check = NicHealthCheck(devices=["mlx5_1"], sysfs_root=tmp_path)
    assert check.read_counters() == {}
    check(STATE)
    a.write_text("9")
    assert check(STATE) is STATE  # mlx5_0 is not watched


def test_nic_check_without_infiniband_is_not_applicable(tmp_path):
    check = NicHealthCheck(sysfs_root=tmp_path / "missing")
    assert check(STATE) is STATE and check(STATE) is STATE


def test_user_check_raising_in_a_chain():
    """A raising check stops the chain; checks to its right already ran."""
    ran = []

    class Recorder(HealthCheck):
        def __call__(self, state: FrozenState) -> FrozenState:
            ran.append(state.rank)
            return state

    class DiskFull(HealthCheck):
        def __call__(self, state: FrozenState) -> FrozenState:
            raise HealthCheckError(f"rank {state.rank}: /tmp has 0 bytes free")

    chain = Compose(Recorder(), DiskFull(), *default_health_check().instances)
    with pytest.raises(HealthCheckError, match="0 bytes free"):
        chain(STATE)
    assert ran == []
