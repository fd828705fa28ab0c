import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WORKER = str(HERE / "ft_worker.py")
FAST = ["--ft-workload-check-interval", "0.05", "--monitor-interval", "0.05",
        "--ft-workers-stop-timeout", "2", "--ft-rank-termination-grace", "0.5"]


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, log_dir: Path) -> None:
        self.rc, self.out, self.err = proc.returncode, proc.stdout, proc.stderr
        self.log_dir = log_dir

    def cycle_log(self, cycle: int) -> str:
        return (self.log_dir / "t" / f"cycle_{cycle}.log").read_text()

    def __repr__(self) -> str:
        return f"rc={self.rc}\nstdout:\n{self.out[-3000:]}\nstderr:\n{self.err[-6000:]}"


@pytest.fixture
def launch(tmp_path):
    def run(*args: str, timeout: float = 90, cold: bool = True, env: dict | None = None) -> Run:
        cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--log-dir",
               str(tmp_path), "--rdzv-id", "t", *FAST]
        if cold:
            cmd += ["--ft-warm-restart", "false"]
        proc = subprocess.run(cmd + list(args), check=False, capture_output=True, text=True,
                              timeout=timeout, cwd=tmp_path, env={**os.environ, **(env or {})})
        return Run(proc, tmp_path)

    return run
