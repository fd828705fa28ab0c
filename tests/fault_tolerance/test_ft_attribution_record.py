"""The launcher's attribution of its own cycle log (issues 12/13): a real 2-rank launch where
rank 1 raises is attributed code_exception on rank 1, STOP, and the launcher's record of the
failed ranks is appended to the cycle log."""

from __future__ import annotations

#: no torch import (lean): rank 0 waits to be stopped, rank 1 raises (the gloo peer's
#: connection reset of the same report is covered on log text in tests/attribution)
_SCRIPT = """\
import os, time
rank = int(os.environ["RANK"])
print(f"step 1 done on rank {rank}", flush=True)
if rank == 1:
    raise RuntimeError("boom always")
time.sleep(60)
"""


def test_rank1_exception_is_attributed_code_exception_stop(tmp_path, launch):
    script = tmp_path / "boom.py"
    script.write_text(_SCRIPT)
    run = launch("--nproc-per-node", "2", "--max-restarts", "0", str(script), timeout=60)
    assert run.rc != 0, run
    log = run.cycle_log(0)
    assert ":1: RuntimeError: boom always" in log, log
    assert ":launcher: trainguard launcher: cycle 0: rank 1 exited with exitcode 1" in log, log
    verdict = [ln for ln in run.err.splitlines() if "cycle 0 attribution:" in ln]
    assert verdict, run
    assert "STOP" in verdict[0] and "code_exception" in verdict[0], verdict
    assert "on rank(s) 1 " in verdict[0], verdict


#: rank 1 is SIGKILLed by a process other than the launcher (here itself: the launcher and its
#: monitors sent nothing), as ``kill -9`` from a shell or the OOM killer would
_KILLED = """\
import os, signal, time
rank = int(os.environ["RANK"])
print(f"step 1 done on rank {rank}", flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def test_outside_sigkill_is_attributed_with_signal_and_rank(tmp_path, launch):
    """The verdict the launcher logs for the cycle names the signal and the rank (it was
    ``unknown (unknown)`` with no rank), and a restart is the policy for a kill from outside."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    run = launch("--nproc-per-node", "2", "--max-restarts", "0", str(script), timeout=60)
    assert run.rc != 0, run
    log = run.cycle_log(0)
    assert "rank 1 killed by signal 9 (SIGKILL) from outside the launcher" in log, log
    verdict = [ln for ln in run.err.splitlines() if "cycle 0 attribution:" in ln]
    assert verdict, run
    assert "RESTART" in verdict[0] and "on rank(s) 1 " in verdict[0], verdict
    assert "rank 1 killed by SIGKILL" in verdict[0], verdict


def test_a_successful_cycle_log_ends_with_the_launchers_record(tmp_path, launch):
    """The cycle log of a cycle whose ranks all exited 0 says so in the launcher's words, and
    ``analyze`` reads the log as completed (a rank's own last line proves nothing)."""
    from trainguard.attribution import analyze_logs

    script = tmp_path / "ok.py"
    script.write_text("import os\nprint(f\"step 1 done on rank {os.environ['RANK']}\")\n")
    run = launch("--nproc-per-node", "2", "--max-restarts", "0", str(script), timeout=60)
    assert run.rc == 0, run
    log = run.cycle_log(0)
    assert log.rstrip().endswith(":launcher: trainguard launcher: cycle 0: every rank exited 0"), \
        log
    res = analyze_logs([str(run.log_dir / "t" / "cycle_0.log")], job_ended=True)
    assert (res.primary_category, res.decision) == ("completed", "STOP"), res.reason
