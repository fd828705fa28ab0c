"""Node identity from Slurm / Kubernetes environments: host lists, rank precedence, run id,
loopback and one-launcher-per-node refusals, and ``trainguard launch --dry-run`` end to end."""

import json
import logging
import os
import subprocess
import sys

import pytest

from trainguard.fault_tolerance import _identity
from trainguard.fault_tolerance._identity import (
    check_one_launcher_per_node,
    expand_hostlist,
    is_loopback,
    resolve_identity,
)
from trainguard.fault_tolerance.errors import LaunchConfigError

# ---------------------------------------------------------------- host lists


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("gpu[001-003,007],login1", ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("a[08-11]", ["a08", "a09", "a10", "a11"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("rack[1-2]-node[3,5]-ib", ["rack1-node3-ib", "rack1-node5-ib", "rack2-node3-ib",
                                "rack2-node5-ib"]),
    ("x[1-2],x2,y", ["x1", "x2", "y"]),  # order kept, duplicates dropped
    (" c1 , c2 ", ["c1", "c2"]),
    ("n[9-10]a,m[099-101]", ["n9a", "n10a", "m099", "m100", "m101"]),
])
def test_hostlist_expands_like_scontrol(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, fragment", [
    ("gpu[001-003", "unbalanced '['"),
    ("gpu001-003]", "unbalanced ']'"),
    ("gpu[3-1]", "bad range"),
    ("gpu[a-b]", "is not N or N-M"),
    ("gpu[[1-2]]", "nested"),
    ("gpu[0-9999999]", "bad range"),
])
def test_bad_hostlist_is_one_clear_error(text, fragment):
    with pytest.raises(LaunchConfigError, match="SLURM_JOB_NODELIST") as info:
        expand_hostlist(text)
    assert fragment in str(info.value)


# ---------------------------------------------------------------- precedence

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "2", "SLURM_NNODES": "4",
         "SLURM_JOB_NODELIST": "gpu[001-004]", "SLURM_NTASKS_PER_NODE": "1",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("cli, env, rank, source", [
    (5, {**SLURM, "PET_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "3"}, 5, "--node-rank"),
    (None, {**SLURM, "PET_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "3"}, 1, "PET_NODE_RANK"),
    (None, {**SLURM, "JOB_COMPLETION_INDEX": "3"}, 2, "SLURM_PROCID"),
    (None, {"JOB_COMPLETION_INDEX": "3"}, 3, "JOB_COMPLETION_INDEX"),
    (None, {}, None, "address"),
    (0, {"PET_NODE_RANK": "7"}, 0, "--node-rank"),  # an explicit 0 still wins
])
def test_node_rank_precedence(cli, env, rank, source):
    ident = resolve_identity(cli, None, env, "gpu001", pid=11, nnodes_max=8)
    assert (ident.node_rank, ident.source) == (rank, source)


@pytest.mark.parametrize("cli, env, source", [
    (None, {**SLURM, "SLURM_NNODES": "1"}, "SLURM_PROCID"),  # a multi-task step, --nnodes 1
    (None, {"PET_NODE_RANK": "4"}, "PET_NODE_RANK"),
    (4, {}, "--node-rank"),
])
def test_nonzero_node_rank_on_one_node_is_refused(cli, env, source):
    pattern = rf"node rank \d \(from {source}\) on a one-node job \(--nnodes 1\)"
    with pytest.raises(LaunchConfigError, match=pattern):
        resolve_identity(cli, None, env, "gpu001", pid=1, nnodes_max=1)


def test_node_rank_beyond_nnodes_is_a_spare_on_several_nodes():
    # --nnodes 2:3 with a fourth launcher: it parks as a hot spare, it is not refused
    ident = resolve_identity(4, None, {}, "gpu001", pid=1, nnodes_max=3)
    assert (ident.node_rank, ident.source) == (4, "--node-rank")


@pytest.mark.parametrize("cli, env, run_id, source", [
    ("mine", {"PET_RDZV_ID": "pet", "SLURM_JOB_ID": "7"}, "mine", "--rdzv-id"),
    (None, {"PET_RDZV_ID": "pet", "SLURM_JOB_ID": "7"}, "pet", "PET_RDZV_ID"),
    (None, {"SLURM_ARRAY_JOB_ID": "100", "SLURM_JOB_ID": "103"}, "100", "SLURM_ARRAY_JOB_ID"),
    (None, {"SLURM_JOB_ID": "103", "TORCHELASTIC_RUN_ID": "te"}, "103", "SLURM_JOB_ID"),
    (None, {"TORCHELASTIC_RUN_ID": "te"}, "te", "TORCHELASTIC_RUN_ID"),
    ("none", {}, "tg11", "pid"),  # torchrun's default value means "not given"
])
def test_run_id_precedence(cli, env, run_id, source):
    ident = resolve_identity(None, cli, env, None, pid=11)
    assert (ident.run_id, ident.run_id_source) == (run_id, source)


def test_bad_rank_variable_is_a_clear_error():
    with pytest.raises(LaunchConfigError, match=r"SLURM_PROCID='x' is not an integer"):
        resolve_identity(None, None, {**SLURM, "SLURM_PROCID": "x"}, "gpu001", pid=1)


def test_slurm_without_endpoint_uses_first_host_and_the_note_is_logged_once(caplog,
                                                                            monkeypatch):
    monkeypatch.setattr(_identity, "_spares_note_logged", False)
    log = logging.getLogger("trainguard.fault_tolerance")
    monkeypatch.setattr(log, "propagate", True)
    with caplog.at_level(logging.INFO, logger="trainguard.fault_tolerance"):
        first = resolve_identity(None, None, SLURM, None, pid=1, nnodes_max=4)
        resolve_identity(None, None, SLURM, None, pid=1, nnodes_max=4)
    assert (first.rdzv_host, first.rdzv_host_source) == ("gpu001", "SLURM_JOB_NODELIST")
    assert first.hosts == ("gpu001", "gpu002", "gpu003", "gpu004")
    assert first.scheduler == "slurm" and first.env_nnodes == 4
    notes = [r.getMessage() for r in caplog.records if "kill-on-bad-exit=0" in r.getMessage()]
    assert len(notes) == 1, notes


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("env, host", [
    (SLURM, "127.0.0.1"),
    (SLURM, "localhost"),
    ({"PET_NNODES": "2:4"}, "127.0.0.5"),
    ({"PET_NNODES": "3"}, None),  # nothing given: the default 127.0.0.1
])
def test_loopback_endpoint_on_a_multi_node_job_is_refused(env, host):
    with pytest.raises(LaunchConfigError, match="loopback") as info:
        resolve_identity(None, None, env, host, pid=1, nnodes_max=4)
    assert "--rdzv-endpoint" in str(info.value)


def test_loopback_is_fine_on_one_node_or_when_simulating():
    resolve_identity(None, None, {**SLURM, "SLURM_NNODES": "1", "SLURM_PROCID": "0"},
                     "127.0.0.1", pid=1)
    resolve_identity(None, None, {**SLURM, "TRAINGUARD_SIMULATED_NODES": "1"}, "127.0.0.1", pid=1,
                     nnodes_max=4)
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("10.1.2.3")


@pytest.mark.parametrize("env", [
    {**SLURM, "SLURM_NTASKS_PER_NODE": "2"},
    {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2),4", "SLURM_NODEID": "2"},
    {**SLURM, "SLURM_LOCALID": "3"},
])
def test_several_launchers_on_one_slurm_node_are_refused(env):
    with pytest.raises(LaunchConfigError, match="one launcher per node"):
        check_one_launcher_per_node(env)
    check_one_launcher_per_node({**env, "TRAINGUARD_SIMULATED_NODES": "1"})


def test_one_task_per_node_passes():
    check_one_launcher_per_node({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x4)"})
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}  # the batch script itself
    check_one_launcher_per_node({**batch, "SLURM_NTASKS_PER_NODE": "8"})
    check_one_launcher_per_node({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x2),4",
                                 "SLURM_NODEID": "1"})


# ---------------------------------------------------------------- --dry-run, end to end

_ENGINE_VARS = ("SLURM_", "PET_", "JOB_COMPLETION_INDEX", "TORCHELASTIC_", "KUBERNETES_",
                "TRAINGUARD_SIMULATED_NODES")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENGINE_VARS)}
    return {**env, **extra}


def _dry(tmp_path, env, *args):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    proc = subprocess.run([sys.executable, "-m", "trainguard.fault_tolerance.launcher",
                           "--dry-run", *args, str(script)], check=False, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=env)
    return proc


def test_dry_run_on_slurm_multi_node(tmp_path):
    env = _clean_env(**SLURM, SLURM_ARRAY_JOB_ID="4240")
    proc = _dry(tmp_path, env, "--nnodes", "4", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["node_rank"] == 2 and out["node_rank_source"] == "SLURM_PROCID"
    assert out["ranks"] == [4, 5] and out["local_ranks"] == [0, 1]
    assert out["run_id"] == "4240" and out["run_id_source"] == "SLURM_ARRAY_JOB_ID"
    assert out["rdzv_endpoint"] == "gpu001:29400"
    assert out["rdzv_host_source"] == "SLURM_JOB_NODELIST"
    # MASTER_ADDR is picked each round on the group-rank-0 node: not known at launch
    assert (out["master_addr"], out["master_port"]) == (None, None)
    assert out["master_addr_note"].startswith("decided at rendezvous")
    assert out["hosts"] == ["gpu001", "gpu002", "gpu003", "gpu004"]
    assert out["scheduler"] == "slurm"
    assert out["exit_codes"] == {"done": 0, "failed": 1, "bad_input": 2, "no_restart": 93,
                                 "store_lost": 75, "unhealthy": 95}
    assert "kill-on-bad-exit=0" in proc.stderr
    store = str(tmp_path / "shared" / "rdzv.store")  # a file store: no host in the endpoint
    proc = _dry(tmp_path, env, "--nnodes", "4", "--rdzv-conf", "store_type=file",
                "--rdzv-endpoint", store)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["master_addr"], out["rdzv_endpoint"]) == (None, store)


def test_dry_run_on_slurm_takes_nnodes_from_slurm_and_shows_the_endpoint(tmp_path):
    """No --nnodes under a multi-node Slurm step with one task per node: SLURM_NNODES is the
    node count (logged); the endpoint derived from SLURM_JOB_NODELIST is printed."""
    proc = _dry(tmp_path, _clean_env(**SLURM), "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["nnodes"], out["nnodes_source"]) == ("4:4", "SLURM_NNODES")
    assert out["rdzv_endpoint"] == "gpu001:29400" and out["rdzv_backend"] == "trainguard"
    assert out["rdzv_store_type"] == "tcp" and out["ranks"] == [4, 5]
    assert "--nnodes 4 taken from SLURM_NNODES" in proc.stderr
    out = json.loads(_dry(tmp_path, _clean_env(**SLURM), "--nnodes", "2:4").stdout)  # CLI wins
    assert (out["nnodes"], out["nnodes_source"]) == ("2:4", "--nnodes")
    one = _clean_env(**{**SLURM, "SLURM_NNODES": "1", "SLURM_PROCID": "0",
                        "SLURM_JOB_NODELIST": "gpu001", "SLURM_NODEID": "0"})
    out = json.loads(_dry(tmp_path, one).stdout)  # torchrun's default on one node
    assert (out["nnodes"], out["nnodes_source"], out["rdzv_endpoint"]) == ("1:1", "default",
                                                                             None)


def test_dry_run_on_kubernetes_pytorchjob_and_indexed_job(tmp_path):
    env = _clean_env(PET_NNODES="3", PET_NPROC_PER_NODE="2", PET_NODE_RANK="1",
                     PET_MASTER_ADDR="job-node-0-0.job", PET_MASTER_PORT="29511",
                     PET_RDZV_ID="trainjob-7", PET_MAX_RESTARTS="4", JOB_COMPLETION_INDEX="2",
                     PET_HEALTH_PORT="28080")
    out = json.loads(_dry(tmp_path, env).stdout)
    assert (out["node_rank"], out["node_rank_source"]) == (1, "PET_NODE_RANK")
    assert out["ranks"] == [2, 3] and out["max_restarts"] == 4
    assert out["rdzv_endpoint"] == "job-node-0-0.job:29511"  # the store, from PET_MASTER_*
    assert (out["master_addr"], out["master_port"]) == (None, None)  # decided each round
    assert out["run_id"] == "trainjob-7" and out["health_port"] == 28080
    del env["PET_NODE_RANK"]  # an indexed Job / JobSet without the Trainer's PET_NODE_RANK
    out = json.loads(_dry(tmp_path, env).stdout)
    assert (out["node_rank"], out["node_rank_source"]) == (2, "JOB_COMPLETION_INDEX")
    assert out["ranks"] == [4, 5] and out["scheduler"] == "kubernetes"
    out = json.loads(_dry(tmp_path, env, "--node-rank", "0").stdout)  # CLI > env
    assert (out["node_rank"], out["node_rank_source"]) == (0, "--node-rank")


@pytest.mark.parametrize("extra, fragment", [
    ({"SLURM_NTASKS_PER_NODE": "8"}, "one launcher per node"),
    ({"PET_RDZV_ENDPOINT": "127.0.0.1:29400"}, "loopback"),
    ({"SLURM_JOB_NODELIST": "gpu[1-"}, "unbalanced"),
])
def test_dry_run_bad_environment_exits_2_with_one_line(tmp_path, extra, fragment):
    proc = _dry(tmp_path, _clean_env(**{**SLURM, **extra}), "--nnodes", "4")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr, lines


# ---------------------------------------------------------------- the launcher under faked engines

_ENV_DUMP = """import glob, json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
cycle = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(f"env_{os.environ['RANK']}_{cycle}.json", "w") as fh:
    json.dump({k: os.environ.get(k) for k in keys}, fh)
t0 = time.monotonic()  # every rank dumps before any exits (a failure stops the others)
while len(glob.glob(f"env_*_{cycle}.json")) < int(os.environ["WORLD_SIZE"]):
    if time.monotonic() - t0 > 20:
        sys.exit(9)
    time.sleep(0.02)
sys.exit(int(sys.argv[1]) if cycle == "0" else 0)
"""


def _run_launcher(tmp_path, env, *args):
    (tmp_path / "dump.py").write_text(_ENV_DUMP)
    return subprocess.run([sys.executable, "-m", "trainguard.fault_tolerance.launcher",
                           "--log-dir", str(tmp_path / "logs"), "--ft-warm-restart", "false",
                           "--monitor-interval", "0.05", "--ft-workers-stop-timeout", "2",
                           *args], check=False, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)


def _dumps(tmp_path, cycle):
    return {int(p.name.split("_")[1]): json.loads(p.read_text())
            for p in tmp_path.glob(f"env_*_{cycle}.json")}


def test_launcher_under_a_faked_single_node_slurm_job(tmp_path):
    env = _clean_env(SLURM_JOB_ID="5150", SLURM_PROCID="0", SLURM_NNODES="1",
                     SLURM_JOB_NODELIST="cn[042]", SLURM_NTASKS_PER_NODE="1", SLURM_LOCALID="0")
    run = _run_launcher(tmp_path, env, "--nproc-per-node", "2", "--max-restarts", "1",
                        "dump.py", "7")
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = _dumps(tmp_path, 0), _dumps(tmp_path, 1)
    assert sorted(first) == sorted(second) == [0, 1]
    for rank, env0 in first.items():
        assert env0["LOCAL_RANK"] == str(rank) and env0["WORLD_SIZE"] == "2"
        assert env0["GROUP_RANK"] == "0" and env0["TORCHELASTIC_RUN_ID"] == "5150"
        assert env0["MASTER_ADDR"] == "127.0.0.1" and env0["TORCHELASTIC_MAX_RESTARTS"] == "1"
    ports = {first[0]["MASTER_PORT"], second[0]["MASTER_PORT"]}
    assert first[0]["MASTER_PORT"] == first[1]["MASTER_PORT"] and len(ports) == 2  # fresh/cycle
    assert (tmp_path / "logs" / "5150" / "cycle_1.log").exists()  # run dir keyed by job id


def test_launcher_under_a_faked_kubernetes_pod_exits_with_the_contract_codes(tmp_path):
    env = _clean_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS="0",
                     PET_RDZV_ID="tj-9", JOB_COMPLETION_INDEX="0",
                     KUBERNETES_SERVICE_HOST="10.0.0.1")
    run = _run_launcher(tmp_path, env, "dump.py", "5")
    assert run.returncode == 1, run.stderr[-3000:]  # failed, no restart left: requeue OK
    dumps = _dumps(tmp_path, 0)
    assert sorted(dumps) == [0, 1] and dumps[1]["TORCHELASTIC_RUN_ID"] == "tj-9"
    run = _run_launcher(tmp_path, env, "--ft-health-check", "off", "--nnodes", "1",
                        "--ft-max-no-progress-cycles", "1", "dump.py", "0")
    assert run.returncode == 0, run.stderr[-3000:]
