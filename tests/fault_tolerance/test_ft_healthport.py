"""``--health-port``: the liveness verdict comes from the launcher loop's tick; a frozen launcher
(SIGSTOP) fails the probe within 2 s, and it recovers after SIGCONT."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from trainguard._core.clock import wait_until
from trainguard._core.net import free_port
from trainguard._core.procs import terminate_processes
from trainguard.fault_tolerance._healthport import HealthServer, LauncherState, Liveness
from trainguard.fault_tolerance.errors import LaunchConfigError


def test_liveness_goes_stale_without_ticks_unless_a_wait_was_declared():
    live = Liveness(stale_after_s=0.2)
    assert live.snapshot()["status"] == "ok"
    time.sleep(0.3)
    snap = live.snapshot()
    assert snap["status"] == "stale" and snap["heartbeat_age_s"] >= 0.2, snap
    live.enter(LauncherState.RESTARTING, cycle=3, wait_s=30)
    time.sleep(0.3)
    snap = live.snapshot()
    assert (snap["status"], snap["state"], snap["cycle"]) == ("ok", "restarting", 3), snap
    live.tick()  # the loop is back: the declared wait ends with it
    time.sleep(0.3)
    assert live.snapshot()["status"] == "stale"
    with pytest.raises(ValueError, match="> 0 seconds"):
        Liveness(0)


def test_server_answers_200_then_503_when_the_loop_stops_ticking(port):
    live = Liveness(stale_after_s=0.3)
    live.info = {"run_id": "r1"}
    live.enter(LauncherState.RUNNING, cycle=0, wait_s=60)  # a slow first request stays 200
    with HealthServer(live, port, host="127.0.0.1") as server:
        url = f"http://127.0.0.1:{server.port}"
        ok = httpx.get(f"{url}/health", timeout=2)
        assert ok.status_code == 200 and ok.json()["run_id"] == "r1"
        assert httpx.get(f"{url}/nope", timeout=2).status_code == 404
        live.tick()  # the loop's last tick: stale 0.3 s later
        time.sleep(0.4)
        stale = httpx.get(f"{url}/healthz", timeout=2)
        assert stale.status_code == 503 and stale.json()["status"] == "stale"
        with pytest.raises(LaunchConfigError, match=f"--health-port {server.port}"):
            HealthServer(live, server.port, host="127.0.0.1")
    server.close()  # idempotent
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=1)


def _probe(url: str) -> int | None:
    """A Kubernetes-like probe: status code, or None when no answer came within 0.5 s."""
    try:
        return httpx.get(url, timeout=0.5).status_code
    except httpx.TransportError:
        return None


def test_frozen_launcher_fails_the_probe_within_2s_and_recovers(tmp_path, port):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--log-dir",
         str(tmp_path), "--rdzv-id", "hp", "--ft-warm-restart", "false", "--monitor-interval",
         "0.05", "--ft-term-timeout", "2", "--health-port", str(port), str(script)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/health"
    try:
        assert wait_until(lambda: _running(url), 60, 0.1), "launcher never reported running"
        body = httpx.get(url, timeout=2).json()
        assert body["cycle"] == 0 and body["pid"] == proc.pid
        assert body["heartbeat_age_s"] <= body["stale_after_s"] == 1.0
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while _probe(url) == 200 and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        failed_after = time.monotonic() - t0
        print(f"probe failed {failed_after:.2f} s after SIGSTOP")
        assert failed_after < 2.0
        os.kill(proc.pid, signal.SIGCONT)
        assert wait_until(lambda: _probe(url) == 200, 5, 0.1), "no recovery after SIGCONT"
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
        terminate_processes([proc], grace_s=2)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    with socket.socket() as s:  # nothing listens on the port once the launcher is gone
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # probes left TIME_WAITs
        s.bind(("0.0.0.0", port))
        s.listen(1)


def _running(url: str) -> bool:
    try:
        r = httpx.get(url, timeout=1)
    except httpx.TransportError:
        return False
    return r.status_code == 200 and r.json()["state"] == "running"


def test_probe_stays_200_through_a_crash_and_restart(tmp_path, port):
    """Legitimate waits (stopping the failed cycle, health checks, spawning) never fail the
    probe; the state walks running -> restarting -> running and the cycle counter follows."""
    script = tmp_path / "crash_once.py"
    script.write_text(
        "import os, sys, time\ncycle = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "time.sleep(1.0)\nsys.exit(3 if cycle == 0 else 0)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--log-dir",
         str(tmp_path), "--rdzv-id", "hr", "--ft-warm-restart", "false", "--monitor-interval",
         "0.05", "--max-restarts", "1", "--nproc-per-node", "2", "--health-port", str(port),
         str(script)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    url = f"http://127.0.0.1:{port}/health"
    seen: list[tuple[int | None, str, int]] = []
    try:
        assert wait_until(lambda: _probe(url) is not None, 30, 0.05), "no health endpoint"
        while proc.poll() is None:
            try:
                r = httpx.get(url, timeout=1.0)
                seen.append((r.status_code, r.json()["state"], r.json()["cycle"]))
            except httpx.TransportError:
                if proc.poll() is None:  # only the launcher's exit may end the answers
                    seen.append((None, "", -1))
            time.sleep(0.05)
        _out, err = proc.communicate(timeout=10)
    finally:
        terminate_processes([proc], grace_s=2)
    assert proc.returncode == 0, err[-3000:]
    # the server closes in the launcher's teardown: refusals are fine once it is stopping
    stop_at = next((i for i, s in enumerate(seen) if s[1:] == ("stopping", 1)), len(seen))
    bad = [s for s in seen[:stop_at] if s[0] != 200]
    assert not bad, f"{len(bad)} failed probe(s) of {len(seen)}: {seen}"
    assert all(s[0] in (200, None) for s in seen[stop_at:]), seen
    states = [(state, cycle) for _, state, cycle in seen]
    assert ("running", 0) in states and ("running", 1) in states, sorted(set(states))


def test_identity_error_in_the_constructor_releases_the_health_port(tmp_path, port):
    """A multi-node launcher whose identity cannot be resolved (here: a spec built without the
    CLI's validation, naming an unknown store type) fails in its constructor after the base
    opened the health port, the log pump and the wake pipe: all of them are closed again, so the
    port can be bound at once and no launcher thread is left."""
    import dataclasses
    import threading

    from trainguard.fault_tolerance._args import parse_launch_args
    from trainguard.fault_tolerance._multinode import MultiNodeLauncher

    spec = parse_launch_args(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                              "--health-port", str(port), "--log-dir", str(tmp_path),
                              "--ft-attribution", "false", sys.executable])
    bad = dataclasses.replace(spec, rdzv_conf=(("store_type", "etcd"),))
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LaunchConfigError, match="store_type=etcd"):
        MultiNodeLauncher(bad)
    with socket.socket() as sock:  # the health port is free again (no SO_REUSEADDR)
        sock.bind(("0.0.0.0", port))
    names = {t.name for t in threading.enumerate()}
    assert not names & {"tg-launch-health", "tg-launch-logs"}, names
    assert len(os.listdir("/proc/self/fd")) == fds  # wake pipe and pump pipes closed
