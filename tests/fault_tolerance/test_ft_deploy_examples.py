"""examples/slurm and examples/kubernetes cannot drift from the launcher's exit-code contract:
the JobSet's failure policy and the sbatch's requeue logic use the package's constants, and the
sbatch chain is executed with stand-ins for srun/scontrol/trainguard (Slurm is outside
trainguard)."""

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from trainguard.fault_tolerance._agent import EXIT_FAILED
from trainguard.fault_tolerance.config import FaultToleranceConfig
from trainguard.fault_tolerance.errors import EXIT_STORE_LOST, EXIT_UNHEALTHY

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
JOBSET = ROOT / "examples" / "kubernetes" / "jobset.yaml"
NO_RESTART = FaultToleranceConfig().no_restart_exit_code
CODES = {"EXIT_DONE": 0, "EXIT_FAILED": EXIT_FAILED, "EXIT_STORE_LOST": EXIT_STORE_LOST,
         "EXIT_NO_RESTART": NO_RESTART, "EXIT_UNHEALTHY": EXIT_UNHEALTHY}


def _jobset() -> dict:
    docs = list(yaml.safe_load_all(JOBSET.read_text()))
    return next(d for d in docs if d["kind"] == "JobSet")


def test_jobset_failure_policy_uses_the_package_exit_codes():
    spec = _jobset()["spec"]
    job = spec["replicatedJobs"][0]["template"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert len(fail) == 1 and fail[0]["onExitCodes"]["operator"] == "In"
    assert fail[0]["onExitCodes"]["values"] == [NO_RESTART]
    assert fail[0]["onExitCodes"]["containerName"] == "trainer"
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore[0]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    requeued = {EXIT_FAILED, EXIT_STORE_LOST, EXIT_UNHEALTHY}
    assert not requeued & set(fail[0]["onExitCodes"]["values"])  # those restart the JobSet
    assert spec["failurePolicy"]["rules"][0] == {
        "name": "do-not-requeue", "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"]}
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0


def test_jobset_probe_points_at_the_launchers_health_port():
    pod = _jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    cmd = trainer["command"]
    assert cmd[:2] == ["trainguard", "launch"]
    port = int(cmd[cmd.index("--health-port") + 1])
    probe = trainer["livenessProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": port}
    assert probe["timeoutSeconds"] <= 2  # a SIGSTOPped launcher never answers
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT"} <= set(env)
    host = env["PET_RDZV_ENDPOINT"].rpartition(":")[0]
    assert host.startswith(f"{_jobset()['metadata']['name']}-node-0-0.")


def test_sbatch_declares_the_package_exit_codes_and_slurm_options():
    text = SBATCH.read_text()
    declared = {k: int(v) for k, v in re.findall(r"^(EXIT_[A-Z_]+)=(\d+)", text, re.MULTILINE)}
    assert declared == CODES
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --requeue" in text
    assert "--kill-on-bad-exit=0" in text and "store_type=file" in text
    assert "--health-port" in text and "scontrol requeue" in text


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("launcher_rc, restarts, want_rc, requeued", [
    (0, 0, 0, False),
    (NO_RESTART, 0, NO_RESTART, False),
    (EXIT_FAILED, 0, EXIT_FAILED, True),
    (EXIT_STORE_LOST, 1, EXIT_STORE_LOST, True),
    (EXIT_UNHEALTHY, 0, EXIT_UNHEALTHY, True),
    (137, 0, 137, True),  # the launcher was SIGKILLed: requeue
    (EXIT_FAILED, 3, EXIT_FAILED, False),  # MAX_REQUEUES reached
])
def test_sbatch_chain_requeues_except_on_the_no_restart_code(tmp_path, launcher_rc, restarts,
                                                              want_rc, requeued):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: drop its options, run the task command once (one node)
    _stub(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\n"$@"\n')
    _stub(bin_dir, "scontrol", 'echo "$@" >> "$SCONTROL_LOG"\n')
    _stub(bin_dir, "trainguard", 'echo "$@" > "$ARGS_LOG"; exit "$FAKE_RC"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "SLURM_JOB_ID": "777", "SLURM_NNODES": "4", "SLURM_RESTART_COUNT": str(restarts),
           "SHARED": str(tmp_path / "shared"), "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
           "ARGS_LOG": str(tmp_path / "args.log"), "FAKE_RC": str(launcher_rc)}
    proc = subprocess.run(["bash", str(SBATCH)], check=False, capture_output=True, text=True,
                          timeout=30, env=env, cwd=tmp_path)
    assert proc.returncode == want_rc, proc.stdout + proc.stderr
    log = tmp_path / "scontrol.log"
    assert (log.exists() and log.read_text().strip() == "requeue 777") == requeued, proc.stdout
    args = (tmp_path / "args.log").read_text().split()
    assert args[:3] == ["launch", "--nnodes", "4"]
    assert args[args.index("--rdzv-endpoint") + 1] == f"{tmp_path}/shared/777/rdzv.{restarts}.store"
    stop_flag = tmp_path / "shared" / "777" / "do-not-requeue"
    assert stop_flag.exists() == (launcher_rc == NO_RESTART)
