"""The kinds of miss the second held-apart set showed (issue 12), each fixed as a kind.

Every kind is tested here in other words than the held-apart log that showed it (another
runtime's or version's wording, another launcher), with the cases that must *not* change, and
then on that log itself. The held-apart logs are also scored in full by ``test_attr_corpus.py``.
"""

from __future__ import annotations

import pytest
from attr_data import DATA, verdict_keys

from trainguard.attribution import AttributionError, load_registry

HELD2 = DATA / "heldout2"


_got = verdict_keys


# ---------------------------------------------------------------- a Ray node marked dead (k03)
_RAY_RECORD = """\
(TorchTrainer pid=311, ip=10.0.9.1) step 40 loss 0.91
(TorchTrainer pid=311, ip=10.0.9.1) ray.exceptions.ActorDiedError: The actor died unexpectedly \
before finishing this task.
(TorchTrainer pid=311, ip=10.0.9.1) \tclass_name: RayTrainWorker
(TorchTrainer pid=311, ip=10.0.9.1) \tactor_id: 0f3c19b2a7d4e5f600000000
(TorchTrainer pid=311, ip=10.0.9.1) \tpid: 902
(TorchTrainer pid=311, ip=10.0.9.1) \tname: worker_1
(TorchTrainer pid=311, ip=10.0.9.1) \tnamespace: 1c2d3e4f
(TorchTrainer pid=311, ip=10.0.9.1) \tip: 10.0.9.2
{between}(TorchTrainer pid=311, ip=10.0.9.1) The actor died because its node has died. Node Id: \
77ab. the actor's node was terminated unexpectedly: health check failed due to missing too many \
heartbeats
"""


@pytest.mark.parametrize("between", ["", "(RayTrainWorker pid=77, ip=10.0.9.1) step 41\n" * 3])
def test_the_dead_actors_record_names_the_dead_node_not_the_reporter(write_log, between):
    """Ray 2.x wording ("The actor died because its node has died"), printed by the trainer on
    10.0.9.1 about the actor on 10.0.9.2: the record's host is the failed node."""
    got = _got(write_log(_RAY_RECORD.format(between=between)))
    assert got == ("node_failure", "RESTART_EXCLUDE_NODES", None, ["10.0.9.2"]), got


def test_a_record_far_before_the_death_line_names_nothing(write_log):
    text = _RAY_RECORD.format(between="(RayTrainWorker pid=77, ip=10.0.9.1) step 41\n" * 20)
    category, _, _, nodes = _got(write_log(text))
    assert category == "node_failure" and nodes == ["10.0.9.1"]  # only the printer is known


def test_a_bare_ip_field_outside_a_record_names_nothing(write_log):
    """An ``ip:`` line of a configuration dump is not a failure record's host."""
    text = ("server:\n  ip: 10.0.0.5\n  port: 8000\n"
            "[node-02] RuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    assert _got(write_log(text))[3] == ["node-02"]


def test_k03_ray_node_death():
    assert _got(HELD2 / "k03.log") == ("node_failure", "RESTART_EXCLUDE_NODES", None,
                                       ["10.72.56.3"])


# ------------------------------------- a GPU fault known only by the job's framing host (k30)
_ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
_SUBMITIT = ("submitit INFO (2023-02-01 10:00:00,001) - Starting with JobEnvironment(job_id=9, "
             "hostname=gpu-a17, local_rank=0(4), node=0({nodes}), global_rank=0({world}))\n")


def test_single_host_job_ties_an_unplaced_gpu_fault_to_its_host(write_log):
    text = _SUBMITIT.format(nodes=1, world=4) + "epoch 3 step 200 loss 1.2\n" + _ECC
    got = _got(write_log(text))
    assert got == ("gpu_hardware", "RESTART_EXCLUDE_NODES", None, ["gpu-a17"]), got


def test_slurm_nodename_framing(write_log):
    text = ("SLURMD_NODENAME=dgx-b03\n+ python train.py\nstep=10 loss=2.0\n"
            "Feb 02 10:00:00 dgx-b03 kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off "
            "the bus.\n")
    assert _got(write_log(text))[3] == ["dgx-b03"]
    text = "SLURMD_NODENAME=dgx-b03\n+ python train.py\n" + _ECC
    assert _got(write_log(text))[1:] == ("RESTART_EXCLUDE_NODES", None, ["dgx-b03"])


@pytest.mark.parametrize("text", [
    _SUBMITIT.format(nodes=2, world=8) + _ECC,  # two nodes: the fault may be on either
    "job 12 started on node-03\n+ torchrun --nnodes=2 --nproc_per_node=8 train.py\n" + _ECC,
    # the framing names one host, the launcher another: the job is not on one host
    ("job 12 started on node-03\n" + _ECC
     + "srun: error: node-04: task 1: Exited with exit code 1\n"),
    _ECC,  # no host named at all
])
def test_no_single_host_no_node(write_log, text):
    category, decision, _, nodes = _got(write_log(text))
    assert (category, decision, nodes) == ("gpu_hardware", "RESTART", None)


def test_k30_gpu_fault_under_launch():
    assert _got(HELD2 / "k30.log") == ("gpu_hardware", "RESTART_EXCLUDE_NODES", None,
                                       ["node-04"])


# ------------------------------- a generic death with the runtime's list of possible causes (k04)
_DEATH = ("(raylet) The worker (pid=812, ip=10.0.3.4) exited unexpectedly with exit code None. "
          "This may be caused by the process being killed by the OOM killer, a segmentation "
          "fault (SIGSEGV) or `ray stop --force`.\n")


def test_a_generic_death_with_possible_causes_is_unknown(write_log):
    got = _got(write_log("epoch 1 step 30 loss 0.5\n" + _DEATH))
    assert got == ("unknown", "RESTART", None, None), got


@pytest.mark.parametrize("cause, category", [
    ("Fatal Python error: Segmentation fault\n", "framework_crash"),
    ("[12345.678] Out of memory: Killed process 812 (python) total-vm:81234kB\n", "host_oom"),
])
def test_a_cause_the_log_shows_wins_over_the_list(write_log, cause, category):
    assert _got(write_log(cause + _DEATH))[0] == category


def test_k04_ray_worker_died():
    assert _got(HELD2 / "k04.log") == ("unknown", "RESTART", None, None)


# ------------------------------------------ a configuration error under accelerate (k06)
def test_stream_tagged_config_error(write_log):
    text = ("stdout: Distributed environment: MULTI_GPU  Backend: nccl\n"
            "stderr: Traceback (most recent call last):\n"
            "stderr: AssertionError: num_attention_heads (12) must be divisible by "
            "tensor_parallel_size (5)\n")
    assert _got(write_log(text))[:2] == ("config_error", "STOP")


def test_must_be_a_multiple_wording(write_log):
    text = ("[rank0]: ValueError: train_batch_size (10) has to be an exact multiple of the data "
            "parallel size (4)\n[rank1]: ValueError: train_batch_size (10) has to be an exact "
            "multiple of the data parallel size (4)\n")
    assert _got(write_log(text))[:2] == ("config_error", "STOP")


def test_stream_tagged_code_error_stays_code(write_log):
    text = "stderr: ValueError: too many values to unpack (expected 2)\n"
    assert _got(write_log(text))[:2] == ("code_exception", "STOP")


def test_k06_accelerate_config_error():
    assert _got(HELD2 / "k06.log") == ("config_error", "STOP", None, None)


# ------------------------ a file missing inside a checkpoint that partly loaded (k07, k17)
_LOADED = "[rank0]: Restoring checkpoint shard /data/run/ckpt/step_1000/shard_00000.safetensors\n"


def test_missing_shard_of_a_loaded_checkpoint_is_a_checkpoint_error(write_log):
    text = _LOADED + ("[rank3]: FileNotFoundError: Checkpoint shard "
                      "/data/run/ckpt/step_1000/shard_00003.safetensors not found\n")
    assert _got(write_log(text)) == ("checkpoint_error", "STOP", [3], None)


@pytest.mark.parametrize("text", [
    # the same missing shard, but nothing of the checkpoint was shown loading
    ("[rank3]: FileNotFoundError: [Errno 2] No such file or directory: "
     "'/data/run/ckpt/step_1000/shard_00003.safetensors'\n"),
    # a file of another directory than the checkpoint's
    _LOADED + ("[rank3]: FileNotFoundError: [Errno 2] No such file or directory: "
               "'/data/run/tokenizer/tokenizer.model'\n"),
    # the very file the log was loading: the top-level path is missing
    ("Loading checkpoint from /data/run/ckpt/model.pt\n[rank3]: FileNotFoundError: [Errno 2] "
     "No such file or directory: '/data/run/ckpt/model.pt'\n"),
])
def test_missing_top_level_path_stays_missing_path(write_log, text):
    assert _got(write_log(text))[:2] == ("missing_path", "STOP")


@pytest.mark.parametrize("name, ranks", [("k07.log", None), ("k17.log", [4])])
def test_k07_k17_zero_optimizer_shard_missing(name, ranks):
    assert _got(HELD2 / name) == ("checkpoint_error", "STOP", ranks, None)


def test_k18_missing_adapter_file_stays_missing_path():
    assert _got(HELD2 / "k18.log")[:2] == ("missing_path", "STOP")


def test_within_condition_is_validated(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("patterns:\n  - {id: x, category: checkpoint_error, role: root, tier: 30, "
                   "within: somewhere, any: [gone], regex: 'gone (?P<path>\\S+)'}\n")
    with pytest.raises(AttributionError, match="within"):
        load_registry(str(bad))
