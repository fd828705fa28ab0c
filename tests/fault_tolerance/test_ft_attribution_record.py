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
