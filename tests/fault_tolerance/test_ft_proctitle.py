"""Worker process titles: ``ps`` shows ``trainguard worker rank R (local L) : python SCRIPT ARGS``
instead of the fork server's (or the bootstrap's) command line."""

from __future__ import annotations

import subprocess
import sys

from trainguard.fault_tolerance._bootstrap import worker_title

# the worker reads its own /proc/PID/cmdline, which is what ps and psutil show to anyone
SELF = """
import psutil, os, sys
print("CMDLINE", " ".join(psutil.Process(os.getpid()).cmdline()), flush=True)
"""


def test_ps_shows_each_cold_workers_rank_and_script(launch, tmp_path):
    """(A worker forked by the fork server: test_ft_launcher's warm-restart test.)"""
    (tmp_path / "train.py").write_text(SELF)
    r = launch("--nproc-per-node", "2", "train.py", "--lr", "0.1", cold=True, timeout=120)
    assert r.rc == 0, r
    log = r.cycle_log(0)
    for rank in (0, 1):
        line = next((s for s in log.splitlines() if f":{rank}: CMDLINE" in s), "")
        title = f"trainguard worker rank {rank} (local {rank}) : python train.py --lr 0.1"
        assert title in line, log
        assert "_forkserver" not in line and "_bootstrap" not in line, line


def test_title_names_module_and_unknown_ranks():
    env = {"RANK": "3", "LOCAL_RANK": "1"}
    assert worker_title("module", "pkg.train", ["--lr", "a b"], env) == (
        "trainguard worker rank 3 (local 1) : python -m pkg.train --lr 'a b'")
    assert worker_title("script", "t.py", [], {}) == (
        "trainguard worker rank ? (local ?) : python t.py")


def test_without_setproctitle_only_the_thread_name_is_set():
    code = ("import sys; sys.modules['setproctitle'] = None\n"
            "from trainguard.fault_tolerance._bootstrap import _set_title\n"
            "_set_title('trainguard worker rank 7 (local 0) : python t.py', '7')\n"
            "print(open('/proc/self/comm').read().strip())\n"
            "print(open('/proc/self/cmdline').read().replace(chr(0), ' '))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out[0] == "tg-rank-7", out
    assert "trainguard worker" not in out[1], out  # the command line is left as it was
