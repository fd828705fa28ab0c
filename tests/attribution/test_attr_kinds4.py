"""The kinds of miss the fourth held-apart set showed (issue 12), each fixed as a kind.

Every kind is tested in other words than the heldout4 log that showed it (another runtime's,
launcher's or version's wording, from public reports), with cases that must *not* change, and
then on that log itself. The heldout4 logs are also scored in full by ``test_attr_corpus.py``.
"""

from __future__ import annotations

import pytest
from attr_data import DATA, verdict_keys

HELD4 = DATA / "heldout4"


_got = verdict_keys


# ---------------- a loss scale cut to 1 or below: stuck diverging, not training (p15)
_EPOCH = "Epoch: [3][ 400/1036]  Time 0.398 (0.426)  Loss 0.3301 (0.4213)\n"


@pytest.mark.parametrize("tail", [
    # Apex below 1 (whai362/PVT#94)
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.03125\n",
    # DeepSpeed at its floor: it tried every scale down to 1 (deepspeedai/DeepSpeed#1593)
    ("[2021-11-27 10:00:00,000] [INFO] [stage_1_and_2.py:1769:step] [deepspeed] OVERFLOW! "
     "Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1\n") * 3,
    # fairseq's wording, in scientific notation
    "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 6.1e-05\n",
])
def test_a_log_ending_in_a_collapsed_loss_scale_is_nan(write_log, tail):
    got = _got(write_log(_EPOCH + tail))
    assert got[:2] == ("nan_or_inf", "STOP"), got


@pytest.mark.parametrize("tail", [
    # ordinary dynamic scaling at the start of a run: not a fault
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n",
    ("[INFO] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 128.0, "
     "reducing to 64.0\n"),
    # DeepSpeed's hysteresis step (deepspeedai/DeepSpeed#931): not the scale
    ("[INFO] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but "
     "hysteresis is 2. Reducing hysteresis to 1\n"),
    # a scale that fell below 1 and recovered: training went on after it
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.5\n" + _EPOCH,
])
def test_ordinary_or_recovered_loss_scaling_is_still_training(write_log, tail):
    assert _got(write_log(_EPOCH + tail))[:2] == ("in_progress", "CONTINUE")


def test_p15_apex_loss_scale_collapse():
    assert _got(HELD4 / "p15.log") == ("nan_or_inf", "STOP", None, None)


# --------------------------- job runners' completion wordings (p27)
@pytest.mark.parametrize("line", [
    "submitit INFO (2024-03-01 10:00:00,000) - Job completed successfully\n",
    "State: COMPLETED (exit code 0)\n",  # Slurm's seff
    "Successfully completed.\n",  # LSF's job report
    ("Trial TorchTrainer_3f1a2_00000 completed after 10 iterations at 2024-03-01 10:00:00. "
     "Total running time: 1hr 2min 3s\n"),  # Ray Tune
    "Job 'raysubmit_Xk3fB2' succeeded\n",  # ray job submit
])
def test_job_runner_completion_wordings(write_log, line):
    text = "epoch 1 | iter 500 | loss 0.88\nepoch 2 | iter 1000 | loss 0.51\n" + line
    assert _got(write_log(text))[:2] == ("completed", "STOP")


@pytest.mark.parametrize("line", [
    "State: FAILED (exit code 1)\n",
    "Trial TorchTrainer_3f1a2_00000 errored after 3 iterations at 2024-03-01 10:00:00.\n",
])
def test_runner_failure_wordings_are_not_completion(write_log, line):
    text = "epoch 1 | iter 500 | loss 0.88\n" + line
    assert _got(write_log(text))[0] != "completed"


#: one line per completion wording the registry's completion row names (its comment and the
#: runners above)
_COMPLETIONS = [
    "submitit INFO (2024-03-01 10:00:00,000) - Job completed successfully",
    "State: COMPLETED (exit code 0)", "State : COMPLETED", "Successfully completed.",
    "Trial TorchTrainer_3f1a2_00000 completed after 10 iterations at 2024-03-01 10:00:00.",
    "Job 'raysubmit_Xk3fB2' succeeded", "`Trainer.fit` stopped: `max_steps=100` reached.",
    "Training completed.", "100 epochs completed in 0.523 hours.", "Training is done!",
    "Training has finished", "training finished", "max training steps reached, stopping training",
    "Finished training in 12.3s", "Saving final model to /out", "Training time 0:12:03",
]


@pytest.mark.parametrize("line", _COMPLETIONS)
def test_completion_wordings_pass_the_narrow_triggers(line):
    from trainguard.attribution._registry import load_registry

    row = next(p for p in load_registry().patterns if p.id == "completion")
    assert any(t in line.lower() for t in row.triggers) and row.regex.search(line), line


@pytest.mark.parametrize("line", [
    "iteration 10 completed | allreduce completed in 3 ms",
    "[rank0] step 200: forward completed, loss 1.23",
    "Epoch 3 completed. Validation started",
])
def test_a_bare_completed_is_not_even_looked_at(write_log, line):
    """The completion row has no bare " completed" trigger: an ordinary progress line never goes
    through its long regex (scan time), and the job stays in progress."""
    from trainguard.attribution._registry import load_registry

    row = next(p for p in load_registry().patterns if p.id == "completion")
    assert not any(t in line.lower() for t in row.triggers), row.triggers
    assert _got(write_log(_EPOCH + line + "\n" + _EPOCH))[:2] == ("in_progress", "CONTINUE")


def test_p27_submitit_completed():
    assert _got(HELD4 / "p27.log") == ("completed", "STOP", None, None)


# --------------- an IB completion error of an IB net plugin on pod-prefixed output (p12)
@pytest.mark.parametrize("plugin", ["NET/IB", "NET/IBext", "NET/IBext_v8", "NET/IBP"])
def test_ib_completion_error_in_every_ib_plugin(write_log, plugin):
    text = ("[pod/train-worker-0/trainer] step 10 loss 3.1\n"
            f"[pod/train-worker-0/trainer] gpu-a:3468:3905 [4] ib_plugin.c:1615 NCCL WARN "
            f"{plugin} : Got completion from peer 10.216.210.236<54862> with status=12 "
            "opcode=0 len=0 vendor err 129 (Recv)\n")
    category, decision, _, nodes = _got(write_log(text))
    assert (category, decision) == ("network", "RESTART") and "gpu-a" in (nodes or []), nodes


def test_kubectl_pod_prefix_names_the_node(write_log):
    """``kubectl logs --prefix``: the pod is where the line came from."""
    text = ("[pod/ddp-worker-1/pytorch] [rank3]: RuntimeError: CUDA error: uncorrectable ECC "
            "error encountered\n")
    assert _got(write_log(text)) == ("gpu_hardware", "RESTART_EXCLUDE_NODES", [3],
                                     ["ddp-worker-1"])


def test_a_lowercase_inline_rank_names_the_rank(write_log):
    """``[rank 5]`` printed by the program inside a Ray actor's output, as ``[Rank 5]``."""
    text = ("(RayTrainWorker pid=5, ip=10.0.0.2) [rank 5] Exception in checkpoint write: "
            "[Errno 28] No space left on device\n")
    assert _got(write_log(text))[:3] == ("storage_full", "STOP", [5])


def test_p29_ranks_of_the_full_disk():
    assert _got(HELD4 / "p29.log") == ("storage_full", "STOP", [6, 11], None)


def test_p12_kubernetes_ib_completion():
    category, decision, ranks, nodes = _got(HELD4 / "p12.log")
    assert (category, decision, ranks) == ("network", "RESTART", [12, 13])
    assert "worker-node1" in (nodes or []), nodes


# ----------------------- a GPU fault's node from a plain srun task exit (p21)
def test_gpu_fault_under_plain_srun_is_placed_on_the_tasks_node(write_log):
    text = ("epoch 7 step 100 loss 0.3\n"
            "RuntimeError: CUDA error: an uncorrectable ECC error was encountered\n"
            "srun: error: gpu-b07: task 0: Exited with exit code 1\n")
    assert _got(write_log(text))[1::2] == ("RESTART_EXCLUDE_NODES", ["gpu-b07"])


def test_exits_on_two_nodes_place_nothing(write_log):
    text = ("RuntimeError: CUDA error: an uncorrectable ECC error was encountered\n"
            "srun: error: gpu-b07: task 0: Exited with exit code 1\n"
            "srun: error: gpu-b08: task 1: Exited with exit code 1\n")
    category, decision, _, nodes = _got(write_log(text))
    assert category == "gpu_hardware" and (decision, nodes) != ("RESTART_EXCLUDE_NODES", None)
    assert nodes != ["gpu-b08"], nodes


def test_p21_nvlink_error_under_srun():
    """Rank 0 for the only failed srun task (the k24 convention; the label names none)."""
    assert _got(HELD4 / "p21.log") == ("gpu_hardware", "RESTART_EXCLUDE_NODES", [0],
                                       ["node-14"])


# --------------------- frameworks' configuration exception classes (p31)
@pytest.mark.parametrize("line", [
    ("lightning.fabric.utilities.exceptions.MisconfigurationException: You passed "
     "`devices=2` but haven't specified `accelerator=\"gpu\"`\n"),
    # Hydra (taokz/BiomedGPT#75)
    ("hydra.errors.ConfigCompositionException: Could not override 'common.no_progress_bar'. "
     "To append to your config use +common.no_progress_bar=False\n"),
    "omegaconf.errors.MissingMandatoryValue: Missing mandatory value: model.name\n",
    "omegaconf.errors.InterpolationResolutionError: Unsupported interpolation type env\n",
    "deepspeed.runtime.config_utils.DeepSpeedConfigError: bf16 and fp16 modes cannot be both on\n",
    # HF TrainingArguments validation (zjunlp/DeepKE#394, huggingface/transformers#12685)
    ("ValueError: --load_best_model_at_end requires the save and eval strategy to match, but "
     "found - Evaluation strategy: no - Save strategy: epoch\n"),
    ("ValueError: FP16 Mixed precision training with AMP or APEX (`--fp16`) and FP16 half "
     "precision evaluation (`--fp16_full_eval`) can only be used on CUDA devices.\n"),
])
def test_config_exception_classes(write_log, line):
    assert _got(write_log("step 3 loss 1.2\n" + line))[:2] == ("config_error", "STOP")


@pytest.mark.parametrize("line", [
    "RuntimeError: Expected all tensors to be on the same device\n",
    "KeyError: 'config'\n",
    "ValueError: invalid literal for int() with base 10: '--'\n",
])
def test_other_exceptions_stay_code(write_log, line):
    assert _got(write_log(line))[0] == "code_exception"


def test_p31_lightning_misconfiguration():
    assert _got(HELD4 / "p31.log") == ("config_error", "STOP", None, None)
