"""Fault matrix under ``trainguard launch``: real faults, real processes, bounded time."""

import pytest

from tests.fault_tolerance.conftest import WORKER

HANG = ["--ft-auto-heartbeat-timeout", "2"]


@pytest.mark.parametrize("fault,detail", [
    ("exception", "RuntimeError: injected failure on purpose"),
    ("exit", "exit code 7"),
    ("sigkill", "killed by signal SIGKILL"),
    ("segv", "killed by signal SIGSEGV"),
])
def test_crash_restarts_every_worker_and_names_the_root_cause(launch, fault, detail):
    r = launch("--nproc-per-node", "2", "--max-restarts", "1", WORKER, fault)
    assert r.rc == 0, r
    root = next(ln for ln in r.err.splitlines() if ln.startswith("root cause:"))
    assert root.startswith("root cause: cycle 0, rank 1,") and detail in root, r
    log0, log1 = r.cycle_log(0), r.cycle_log(1)
    assert f":1: inject {fault}" in log0
    assert ":0: done rank=0" in log1 and ":1: done rank=1" in log1  # both ranks restarted
    if fault in ("sigkill", "segv"):  # the record (same file as the ranks' output) names the
        # sender: the rank's own signal did not come from the launcher
        assert ":launcher: trainguard launcher: cycle 0: rank 1 killed by signal " in log0, log0
        assert "from outside the launcher\n" in log0 and "by the launcher" not in log0, log0


@pytest.mark.parametrize("fault", ["hang_c", "hang_gil", "sigstop"])
def test_hang_is_detected_without_code_changes_and_stacks_are_dumped(launch, fault):
    r = launch("--nproc-per-node", "2", "--max-restarts", "1", *HANG, WORKER, fault)
    assert r.rc == 0, r
    assert "rank 1 hang detected (auto_heartbeat" in r.err, r
    log0 = r.cycle_log(0)
    # the launcher's record: its own hang detection stopped rank 1, never an outside kill
    assert ":launcher: trainguard launcher: cycle 0: rank 1 killed as hung after 2 s" in log0, log0
    assert "from outside the launcher" not in log0, log0
    if fault != "sigstop":  # a stopped rank dumps once continued; the kill may come first
        assert "ft_worker.py" in log0 and ("Thread" in log0 or "Stack" in log0), log0[-3000:]
    assert ":1: done rank=1" in r.cycle_log(1)


def test_client_heartbeat_catches_a_python_livelock(launch):
    r = launch("--nproc-per-node", "2", "--max-restarts", "1", "--ft-rank-heartbeat-timeout",
               "1", "--ft-initial-rank-heartbeat-timeout", "5", WORKER, "python_loop", "--client")
    assert r.rc == 0, r
    assert "rank 1 hang detected (heartbeat" in r.err, r


def test_missing_first_heartbeat(launch, tmp_path):
    script = tmp_path / "nohb.py"
    script.write_text("import time\nfrom trainguard.fault_tolerance import RankMonitorClient\n"
                      "RankMonitorClient().init_workload_monitoring()\ntime.sleep(60)\n")
    r = launch("--nproc-per-node", "1", "--ft-initial-rank-heartbeat-timeout", "1",
               str(script))
    assert r.rc == 1, r
    assert "no first heartbeat" in r.err, r


def test_section_times_out_on_no_progress_not_on_age(launch, tmp_path):
    script = tmp_path / "sect.py"
    script.write_text(
        "import os, time\nfrom trainguard.fault_tolerance import RankMonitorClient\n"
        "c = RankMonitorClient(); c.init_workload_monitoring()\n"
        "with c.section('load'):\n"
        "    for _ in range(12):\n        time.sleep(0.2); c.progress()\n"
        "print('loaded', flush=True)\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    with c.section('load'):\n        time.sleep(30)\n")
    r = launch("--nproc-per-node", "1", "--max-restarts", "1", "--ft-rank-section-timeouts",
               "load:1", "--ft-rank-heartbeat-timeout", "none", str(script))
    assert r.rc == 0, r
    assert ":0: loaded" in r.cycle_log(0)  # 2.4 s in 'load' with progress: not killed
    assert "no progress in section 'load'" in r.err, r


def test_out_of_section_timeout_fires_without_any_section(launch, tmp_path):
    script = tmp_path / "oos.py"
    script.write_text("import time\nfrom trainguard.fault_tolerance import RankMonitorClient\n"
                      "c = RankMonitorClient(); c.init_workload_monitoring()\n"
                      "c.send_heartbeat()\ntime.sleep(60)\n")
    r = launch("--nproc-per-node", "1", "--ft-rank-out-of-section-timeout", "1",
               "--ft-rank-heartbeat-timeout", "none", str(script))
    assert r.rc == 1 and "outside any section" in r.err, r


def test_max_restarts_exhausted_exits_1_with_the_first_failure(launch):
    r = launch("--nproc-per-node", "2", "--max-restarts", "1", WORKER, "exit", "--every-cycle")
    assert r.rc == 1, r
    assert "no restart is left" in r.err
    assert "root cause: cycle 0, rank 1, exit: exit code 7" in r.err, r


def test_no_progress_for_n_cycles_exits_with_the_no_restart_code(launch, tmp_path):
    it = tmp_path / "iter.txt"
    it.write_text("5\n")
    r = launch("--nproc-per-node", "1", "--max-restarts", "5", "--ft-max-no-progress-cycles", "2",
               "--ft-checkpoint-iteration-file", str(it), WORKER, "exit", "0", "--every-cycle")
    assert r.rc == 93, r
    assert "no progress for 2 cycle(s)" in r.err
    assert "cycle_3.log" not in str(list((tmp_path / "t").iterdir()))


def test_attribution_stop_verdict_ends_the_job_with_the_no_restart_code(launch, tmp_path):
    script = tmp_path / "nofile.py"
    script.write_text("open('/no/such/dataset/shard-0.bin')\n")
    r = launch("--nproc-per-node", "1", "--max-restarts", "3", "--ft-attribution-stop-action",
               "no-restart", str(script))
    assert r.rc == 93, r
    assert "attribution: STOP (missing_path" in r.err
    assert not (tmp_path / "t" / "cycle_1.log").exists()  # no restart was attempted


def test_a_rank_that_never_connects_while_client_timeouts_are_set_is_a_loud_error(launch,
                                                                                   tmp_path):
    script = tmp_path / "noclient.py"
    script.write_text("import time\ntime.sleep(60)\n")
    r = launch("--nproc-per-node", "1", "--max-restarts", "2",
               "--ft-initial-rank-heartbeat-timeout", "1", "--ft-rank-heartbeat-timeout", "1",
               str(script))
    assert r.rc == 93, r
    assert "rank 0 never connected to its rank monitor" in r.err
    assert "init_workload_monitoring()" in r.err
