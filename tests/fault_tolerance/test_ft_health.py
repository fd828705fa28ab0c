"""Node health checks: each default check failing for real, timeouts, user hooks, and the
launcher refusing to start a cycle on an unhealthy node (exit 95)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from trainguard.fault_tolerance import health
from trainguard.fault_tolerance.errors import EXIT_UNHEALTHY, LaunchConfigError
from trainguard.fault_tolerance.health import (
    CudaCheck,
    DiskSpaceCheck,
    FreeMemoryCheck,
    HealthCheck,
    WritableDirCheck,
    as_probe,
    default_checks,
    launch_checks,
    load_user_check,
    run_health_checks,
)


def test_default_cpu_checks_pass_on_this_machine(tmp_path):
    checks = default_checks([str(tmp_path / "logs"), str(tmp_path)], nproc_per_node=1)
    names = [c.name for c in checks]
    assert names[:4] == [f"disk_space({tmp_path / 'logs'})", f"writable({tmp_path / 'logs'})",
                         f"disk_space({tmp_path})", f"writable({tmp_path})"]
    assert "free_memory" in names
    report = run_health_checks(checks, timeout_s=10)
    assert report.ok, report.summary()
    assert (tmp_path / "logs").is_dir() and not list((tmp_path / "logs").iterdir())


def test_each_default_check_fails_for_real(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    checks: list[HealthCheck] = [
        WritableDirCheck(str(blocker / "ckpt")),  # a file where a directory should be
        DiskSpaceCheck(str(tmp_path / "missing" / "dir"), min_free_bytes=2**62),
        FreeMemoryCheck(min_available_bytes=2**62),
    ]
    report = run_health_checks(checks, timeout_s=10)
    assert not report.ok and len(report.failures) == 3
    by_name = {r.name: r.reason for r in report.results}
    assert "not writable" in by_name[f"writable({blocker / 'ckpt'})"]
    assert "MiB free, need" in by_name[f"disk_space({tmp_path / 'missing' / 'dir'})"]
    assert "MiB available, need" in by_name["free_memory"]
    line = as_probe(checks, 10)()  # the rendezvous' pre-join hook: non-empty = unhealthy
    assert all(f"{c.name}: " in line for c in checks), line
    assert as_probe([FreeMemoryCheck(1)], 10)() == ""


def test_a_raising_check_and_a_hung_check_fail_within_the_deadline():
    release = threading.Event()

    class Hung:
        name = "hung"

        def check(self):
            release.wait(30)
            return True, ""

    class Raises:
        name = "raises"

        def check(self):
            raise RuntimeError("NIC down")

    t0 = time.monotonic()
    try:
        report = run_health_checks([Hung(), Raises(), FreeMemoryCheck()], timeout_s=0.5)
        took = time.monotonic() - t0
    finally:
        release.set()
    print(f"health checks returned after {took:.2f} s")
    assert took < 3.0
    reasons = {r.name: (r.ok, r.reason) for r in report.results}
    assert reasons["hung"] == (False, "did not finish within 0.5 s")
    assert reasons["raises"] == (False, "raised RuntimeError: NIC down")
    assert reasons["free_memory"][0]
    assert report.summary().startswith("hung: did not finish")
    with pytest.raises(ValueError, match="> 0 seconds"):
        run_health_checks([], timeout_s=0)


def test_cuda_check_never_fails_for_lack_of_a_gpu():
    ok, reason = CudaCheck(min_devices=8, timeout_s=60).check()
    assert ok, reason  # CPU torch: no CUDA -> healthy; with GPUs: a kernel ran on each
    if not health.has_nvidia_devices():
        assert not any(isinstance(c, CudaCheck) for c in default_checks(["."], 8))


def test_user_hooks_load_and_report(tmp_path, monkeypatch):
    (tmp_path / "tg_user_checks.py").write_text(
        "def good():\n    return None\n"
        "def bad():\n    return (False, 'ECC errors on gpu3')\n"
        "def false():\n    return False\n"
        "def odd():\n    return 'yes'\n"
        "class Obj:\n    name = 'obj'\n    def check(self):\n        return True, ''\n"
        "OBJ = Obj()\nNOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = run_health_checks([load_user_check(f"tg_user_checks:{n}")
                                for n in ("good", "bad", "false", "odd", "OBJ")], timeout_s=5)
    assert [(r.name, r.ok) for r in report.results] == [
        ("tg_user_checks:good", True), ("tg_user_checks:bad", False),
        ("tg_user_checks:false", False), ("tg_user_checks:odd", False), ("obj", True)]
    assert report.results[1].reason == "ECC errors on gpu3"
    assert "return None/True" in report.results[3].reason
    for spec, fragment in [("nocolon", "expected module:function"),
                           ("no_such_module_xyz:f", "cannot import"),
                           ("tg_user_checks:missing", "has no 'missing'"),
                           ("tg_user_checks:NOT_CALLABLE", "not callable")]:
        with pytest.raises(LaunchConfigError, match=fragment):
            load_user_check(spec)
    assert launch_checks("off", [str(tmp_path)], 1) == []
    names = [c.name for c in launch_checks("tg_user_checks:good", [str(tmp_path)], 1)]
    assert names[-1] == "tg_user_checks:good" and "free_memory" in names


def _launch(tmp_path, *args, env=None, timeout=90):
    cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--log-dir",
           str(tmp_path / "logs"), "--rdzv-id", "h", "--ft-warm-restart", "false",
           "--monitor-interval", "0.05", "--ft-workers-stop-timeout", "2", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path), **(env or {})})


def test_launcher_checks_health_before_every_cycle_and_exits_95(tmp_path):
    """Cycle 0 is healthy and its worker fails; the check before cycle 1 fails: the launcher
    does not start cycle 1 and exits 95 although restarts are left."""
    (tmp_path / "node_probe.py").write_text(
        "import os\nCOUNT = os.path.join(os.path.dirname(__file__), 'calls')\n"
        "def probe():\n"
        "    n = int(open(COUNT).read()) + 1 if os.path.exists(COUNT) else 1\n"
        "    open(COUNT, 'w').write(str(n))\n"
        "    return True if n == 1 else (False, 'gpu fell off the bus')\n")
    (tmp_path / "fail.py").write_text("import sys\nprint('ran', flush=True)\nsys.exit(3)\n")
    run = _launch(tmp_path, "--max-restarts", "3", "--ft-health-check", "node_probe:probe",
                  "fail.py")
    assert run.returncode == EXIT_UNHEALTHY, run.stderr[-3000:]
    assert "gpu fell off the bus" in run.stderr
    assert (tmp_path / "calls").read_text() == "2"
    events = [json.loads(ln) for ln in
              (tmp_path / "logs" / "h" / "launcher_events.jsonl").read_text().splitlines()]
    checks = [e for e in events if e["event"] == "health_check"]
    assert [(e["cycle"], e["ok"]) for e in checks] == [(0, True), (1, False)]
    assert {e["cycle"] for e in events if e["event"] == "spawned"} == {0}


def test_unloadable_hook_is_bad_input(tmp_path):
    (tmp_path / "ok.py").write_text("pass\n")
    run = _launch(tmp_path, "--ft-health-check", "nope_mod_xyz:check", "ok.py", timeout=60)
    assert run.returncode == 2, run.stderr
    assert "cannot import 'nope_mod_xyz'" in run.stderr and "Traceback" not in run.stderr
