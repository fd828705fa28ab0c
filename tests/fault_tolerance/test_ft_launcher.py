"""Launcher behaviour: signals, orphans, monitor supervision, persisted timeouts, torchrun
compatibility, concurrent jobs. Real processes, bounded waits."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from tests.fault_tolerance.conftest import FAST, WORKER
from trainguard._core.clock import wait_until
from trainguard._core.procs import terminate_processes


def _start(tmp_path, *args, cold=True):
    cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--log-dir",
           str(tmp_path), "--rdzv-id", "t", *FAST]
    if cold:
        cmd += ["--ft-warm-restart", "false"]
    return subprocess.Popen(cmd + list(args), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited meanwhile (a zombie the launcher has not reaped yet)
        return ""


def _wait_log(tmp_path, needle, cycle=0, timeout=60):
    path = tmp_path / "t" / f"cycle_{cycle}.log"
    ok = wait_until(lambda: path.exists() and needle in path.read_text(), timeout, 0.05)
    assert ok, f"{needle!r} not in {path}"


def test_sigterm_is_forwarded_with_grace_and_a_rank_ignoring_it_is_killed(tmp_path):
    script = tmp_path / "term.py"
    script.write_text(
        "import os, signal, sys, time\nrank = int(os.environ['RANK'])\n"
        "def save(*_):\n    print('checkpoint saved on SIGTERM', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save if rank == 0 else signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(120)\n")
    proc = _start(tmp_path, "--nproc-per-node", "2", "--ft-term-timeout", "1", str(script))
    try:
        _wait_log(tmp_path, ":1: ready")
        _wait_log(tmp_path, ":0: ready")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        terminate_processes([proc], grace_s=1)
    print(f"launcher exit after SIGTERM: {took:.2f} s")
    assert proc.returncode == 128 + signal.SIGTERM, err
    log = (tmp_path / "t" / "cycle_0.log").read_text()
    assert ":0: checkpoint saved on SIGTERM" in log
    assert 1.0 <= took < 8.0  # rank 1 got its 1 s grace, then SIGKILL


def test_launcher_sigkill_leaves_no_orphan_even_after_setsid(tmp_path):
    proc = _start(tmp_path, "--nproc-per-node", "2", WORKER, "setsid", "1")
    try:
        _wait_log(tmp_path, ":1: inject setsid")
        wait_until(lambda: any("sleep(1000)" in " ".join(p.cmdline())
                               for p in psutil.Process(proc.pid).children(recursive=True)), 10)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert any("sleep(1000)" in " ".join(p.cmdline()) for p in tree)
        proc.kill()
        proc.wait(5)

        def gone():
            return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in tree)

        t0 = time.monotonic()
        ok = wait_until(gone, 1.0, 0.02)
        print(f"orphans gone after {time.monotonic() - t0:.3f} s")
        assert ok, [(p.pid, p.cmdline()) for p in tree if p.is_running()]
    finally:
        terminate_processes([proc], grace_s=0)
        proc.communicate(timeout=5)


def test_a_killed_monitor_is_respawned_and_still_catches_the_hang(tmp_path):
    script = tmp_path / "gated.py"
    script.write_text(
        "import os, time\nfrom pathlib import Path\nprint('ready', flush=True)\n"
        "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    while not Path('go').exists():\n        time.sleep(0.02)\n"
        "    time.sleep(3600)\n")
    proc = _start(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1",
                  "--ft-auto-heartbeat-timeout", "2", str(script))
    try:
        _wait_log(tmp_path, ":1: ready")
        monitors = [p for p in psutil.Process(proc.pid).children()
                    if _cmdline(p).strip() == "trainguard: rank 1 rank monitor (local 1)"]
        assert len(monitors) == 1
        monitors[0].kill()
        (tmp_path / "go").write_text("")
        _out, err = proc.communicate(timeout=60)
    finally:
        terminate_processes([proc], grace_s=1)
    assert "rank monitor of local rank 1 died" in err and "respawning" in err, err
    assert "rank 1 hang detected (auto_heartbeat" in err, err
    assert proc.returncode == 0, err


def test_calculated_timeouts_persist_through_a_restart(launch, tmp_path):
    script = tmp_path / "auto.py"
    script.write_text(
        "import json, os, sys, time\nfrom pathlib import Path\n"
        "from trainguard.fault_tolerance import RankMonitorClient\n"
        "c = RankMonitorClient()\nstate = Path('ft_state.json')\n"
        "if state.exists():\n    c.load_state_dict(json.loads(state.read_text()))\n"
        "c.init_workload_monitoring()\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    for _ in range(6):\n        c.send_heartbeat(); time.sleep(0.4)\n"
        "    assert c.calculate_and_set_hb_timeouts()\n"
        "    state.write_text(json.dumps(c.state_dict()))\n"
        "    print('SET', json.dumps(c.timeouts), flush=True)\n"
        "    c.shutdown_workload_monitoring()\n    sys.exit(3)\n"
        "print('GOT', json.dumps(c.timeouts), flush=True)\n")
    r = launch("--nproc-per-node", "1", "--max-restarts", "1", str(script))
    assert r.rc == 0, r
    set_ = json.loads(r.cycle_log(0).split("SET ", 1)[1].splitlines()[0])
    got = json.loads(r.cycle_log(1).split("GOT ", 1)[1].splitlines()[0])
    print("calculated subsequent timeout", set_["subsequent"], "after restart", got["subsequent"])
    assert 0.4 * 5 <= set_["subsequent"] < 30  # safety factor 5 x ~0.4 s gaps
    assert set_["initial"] >= set_["subsequent"]
    assert abs(got["subsequent"] - set_["subsequent"]) <= 0.01 * set_["subsequent"]
    assert not c_never_raises_without_data()


def c_never_raises_without_data():
    from trainguard.fault_tolerance import RankMonitorClient

    c = RankMonitorClient()  # not under the launcher, no heartbeats: returns False, no raise
    return c.calculate_and_set_hb_timeouts() or c.calculate_and_set_section_timeouts()


DDP = """
import argparse, os
import torch, torch.distributed as dist
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=4)
p.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ["LOCAL_RANK"]))
a = p.parse_args()
dist.init_process_group("gloo", init_method="env://")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(a.steps):
    opt.zero_grad(); model(torch.ones(4, 8)).sum().backward(); opt.step()
    if step == 1 and dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), 9)
print("trained", dist.get_rank(), dist.get_world_size(), os.environ["TORCHELASTIC_RESTART_COUNT"],
      flush=True)
print("ps:", open("/proc/self/cmdline").read().replace(chr(0), " ").strip(), flush=True)
dist.destroy_process_group()
"""


def test_a_torchrun_ddp_script_runs_unchanged_and_restarts_warm(launch, tmp_path):
    (tmp_path / "train.py").write_text(DDP)
    r = launch("--nproc-per-node", "2", "--max-restarts", "1", "train.py", "--steps", "4",
               cold=False, timeout=240)
    assert r.rc == 0, r
    log1 = r.cycle_log(1)
    assert ":0: trained 0 2 1" in log1 and ":1: trained 1 2 1" in log1
    assert "cycle 1: started 2 worker(s) (warm fork)" in r.err, r
    # ps shows the rank and the script, not the fork server's command line
    assert ":1: ps: trainguard worker rank 1 (local 1) : python train.py --steps 4" in log1, log1


PORT_USER = """
import os, socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if os.environ["RANK"] == "0":
    s.bind(("0.0.0.0", int(os.environ["MASTER_PORT"]))); s.listen()  # as TCPStore does
time.sleep(1.0)
print("port ok", flush=True)
"""


def test_concurrent_jobs_get_distinct_free_ports(tmp_path):
    script = tmp_path / "port.py"
    script.write_text(PORT_USER)
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 29500))
        held.listen()
    except OSError:
        pass  # someone else holds it: the point (a busy default port) still stands
    procs = []
    try:
        for i in range(3):
            d = tmp_path / f"job{i}"
            d.mkdir()
            procs.append(_start(d, "--nproc-per-node", "2", str(script)))
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        terminate_processes(procs, grace_s=1)
        held.close()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    ports = {err.split("MASTER_PORT=")[1].split()[0] for _, err in results}
    assert len(ports) == 3


def test_port_in_use_is_one_line_and_exit_2(tmp_path):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    (tmp_path / "s.py").write_text("")
    try:
        r = subprocess.run([sys.executable, "-m", "trainguard.fault_tolerance.launcher",
                            "--master-port", str(held.getsockname()[1]), "s.py"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, check=False)
    finally:
        held.close()
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "is in use" in r.stderr, r.stderr
    assert os.path.exists(tmp_path / "s.py")


def test_a_signal_death_is_not_blamed_on_the_last_warning(launch, tmp_path):
    """The rank's last stderr line is a warning, then SIGKILL: the cause is just the signal;
    restart and summary wording name the restart count and the duration's unit."""
    (tmp_path / "k.py").write_text(
        "import os, signal, sys\n"
        "print('/x/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated',"
        " file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = launch("--max-restarts", "1", "--ft-attribution", "false", "k.py")
    assert r.rc == 1, r
    assert "root cause: cycle 0, rank 0, signal: killed by signal SIGKILL\n" in r.err, r
    assert "restart 1 of at most 1 (cycle 1)" in r.err, r
    assert "duration (s)" in r.err, r


def test_early_exits_leave_no_temp_run_dir(tmp_path):
    """Bad input found after the launcher exists (an unresolvable store host): exit 2 and no
    empty trainguard_* directory left in TMPDIR."""
    (tmp_path / "s.py").write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "trainguard.fault_tolerance.launcher",
                        "--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400",
                        "--rdzv-conf", "join_timeout=5", "s.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, check=False,
                       env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 2, r.stderr
    assert not list(tmp.glob("trainguard_*")), list(tmp.iterdir())
