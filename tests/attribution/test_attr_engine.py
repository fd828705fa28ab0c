"""Log engine: bad input, formats beyond the labelled set, streaming and line numbers."""

from __future__ import annotations

import pytest

from trainguard.attribution import AttributionError, LogInputError, analyze_logs
from trainguard.attribution._registry import parse_registry

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_empty_log_is_a_clear_error(write_log):
    with pytest.raises(LogInputError, match="empty"):
        analyze_logs([write_log("")])


def test_empty_log_among_others_is_a_warning(write_log):
    res = analyze_logs([write_log("", "a.log"), write_log(f"[rank1]: {OOM}\n", "b.log")])
    assert res.primary_category == "cuda_oom" and res.culprit_ranks == [1]
    assert any("empty" in w for w in res.warnings)


def test_binary_log_rejected(write_log):
    with pytest.raises(LogInputError, match="binary"):
        analyze_logs([write_log(b"\x7fELF\x00\x00\x01" * 100)])


def test_missing_and_directory_paths(tmp_path):
    with pytest.raises(LogInputError, match="cannot read"):
        analyze_logs([tmp_path / "nope.log"])
    with pytest.raises(LogInputError, match="directory"):
        analyze_logs([tmp_path])
    with pytest.raises(LogInputError, match="no log files"):
        analyze_logs([])


def test_non_utf8_and_truncated_last_line(write_log):
    data = b"step=10 loss=1.0\n" + b"[rank3]: " + OOM.encode() + b" caf\xe9"  # no final newline
    res = analyze_logs([write_log(data)])
    assert res.primary_category == "cuda_oom" and res.culprit_ranks == [3]
    assert res.evidence[0].line == 2
    assert any("UTF-8" in w for w in res.warnings)


def test_huge_line_does_not_hide_the_failure(write_log):
    data = "x" * (3 << 20) + "\n" + "OSError: [Errno 28] No space left on device\n"
    res = analyze_logs([write_log(data)])
    assert res.primary_category == "storage_full"
    assert res.evidence[0].line == 2


def test_line_numbers_stable_across_chunks(write_log):
    filler = "".join(f"[rank0]: iteration {i:6d}/ 100000 | lm loss: 2.0\n" for i in range(60000))
    data = filler + f"[rank5]: {OOM}\n"
    res = analyze_logs([write_log(data)])
    assert len(data) > 2 << 20  # several chunks
    assert res.evidence[0].line == 60001
    assert res.culprit_ranks == [5]
    assert res.last_step == 59999


@pytest.mark.parametrize("text,category,ranks,nodes,decision", [
    # dmesg / syslog Xid 79 on a named node
    (("Mar  3 10:00:01 gpu-node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, "
     "GPU has fallen off the bus.\n"), "gpu_hardware", None, ["gpu-node-07"],
     "RESTART_EXCLUDE_NODES"),
    # node-prefixed native crash
    ("[node-03] step=120 loss=2.1\n[node-03] Fatal Python error: Segmentation fault\n",
     "framework_crash", None, None, "RESTART"),
    # a bare "Killed" is not an OOM; only a launcher record remains
    ("step=5\nKilled\nsrun: error: node-02: task 3: Exited with exit code 1\n", "unknown", None,
     None, "RESTART"),
    # SIGKILL exit with no Python error -> host OOM
    (("E0101 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -9) "
     "local_rank: 2 (pid: 77) of binary: python\n"), "host_oom", None, None, "STOP"),
    ("train.py: error: unrecognized arguments: --lr-warmup 10\n", "config_error", None, None,
     "STOP"),
    # a script's own one-line error in argparse's form, then a peer's cascade (new user: the
    # Lightning example's unwritable checkpoint directory was blamed on the network, RESTART)
    (("[rank0]: train.py: error: checkpoint directory '/x/ckpt' cannot be created (Not a "
      "directory)\n[rank1]: RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:2453\n"),
     "config_error", [0], None, "STOP"),
    ("[rank0]: FileNotFoundError: [Errno 2] No such file or directory: '/data/x.bin'\n",
     "missing_path", [0], None, "STOP"),
    ("[rank1]: PermissionError: [Errno 13] Permission denied: '/ckpt/step_10'\n",
     "permission_denied", [1], None, "STOP"),
    (("[rank0]: RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
     "central directory\n"), "checkpoint_error", [0], None, "STOP"),
    ("[rank2]: ValueError: Loss is nan, stopping training\n", "nan_or_inf", [2], None, "STOP"),
    ("slurmstepd: error: *** JOB 77 ON node-01 CANCELLED AT 2024-01-01T00:00:00 ***\n",
     "user_cancelled", None, None, "STOP"),
    # issue 12's kinds in wordings no labelled log uses
    ("[rank2]: ValueError: gradient checkpointing cannot be used with use_cache=True\n",
     "config_error", [2], None, "STOP"),
    ("AssertionError: FlashAttention is only supported on sm80 or newer GPUs\n", "config_error",
     None, None, "STOP"),
    (("[rank0]: RuntimeError: [enforce fail at inline_container.cc:319] . unexpected pos 1900 vs "
     "1872\n"), "checkpoint_error", [0], None, "STOP"),
    (("2023-01-01 10:00:00 | INFO | train_inner | epoch 003:      5 / 356 loss=9.44, "
     "nll_loss=8.44, ppl=347.28\n"), "in_progress", None, None, "CONTINUE"),
    (("  rdzv_endpoint    : node-09:29400\nRendezvousConnectionError: The connection to the C10d "
     "store has failed. See inner exception for details.\n"), "network", None, ["node-09"],
     "RESTART"),
    # slurmstepd prints this on a host that is still alive: node-04 reported, it did not fail
    (("slurmstepd: error: *** JOB 77 ON node-04 CANCELLED AT 2024-01-01T00:00:00 DUE TO NODE "
     "FAILURE ***\n"), "node_failure", None, None, "RESTART"),
    (("srun: error: Node failure on node-12\nslurmstepd: error: *** JOB 77 ON node-04 CANCELLED "
      "AT 2024-01-01T00:00:00 DUE TO NODE FAILURE ***\nsrun: error: node-04: task 0: Killed\n"),
     "node_failure", None, ["node-12"], "RESTART_EXCLUDE_NODES"),
    (("[rank4]: RuntimeError: NCCL error in: NCCLUtils.hpp:219, unhandled cuda error, NCCL "
      "version 2.14.3\n"), "framework_crash", [4], None, "RESTART"),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n", "network", None,
     None, "RESTART"),
    (("[default1]:torch.distributed.DistNetworkError: The client socket has failed to connect "
     "to [node-01]:29500\n"), "network", [1], None, "RESTART"),
])
def test_formats_beyond_the_labelled_set(write_log, text, category, ranks, nodes, decision):
    res = analyze_logs([write_log(text)])
    assert (res.primary_category, res.culprit_ranks, res.culprit_nodes, res.decision) == (
        category, ranks, nodes, decision), res.reason


def test_laggard_rank_named_for_collective_timeout(write_log):
    lines = [f"[rank{r}]:[E ProcessGroupNCCL.cpp:1537] [PG 0 Rank {r}] Timeout at NCCL work: 90, "
             f"last enqueued NCCL work: {91 if r != 3 else 89}, last completed NCCL work: 89.\n"
             for r in range(4)]
    res = analyze_logs([write_log("".join(lines))])
    assert res.primary_category == "collective_timeout" and res.failure_domain == "unknown"
    assert res.culprit_ranks == [3]


def test_multi_file_order_and_in_progress(write_log):
    a = write_log("[rank0]: iteration 10/100 | lm loss: 1.0\n", "node1.log")
    b = write_log("[rank8]: iteration 10/100 | lm loss: 1.0\n", "node2.log")
    res = analyze_logs([a, b])
    assert (res.primary_category, res.decision) == ("in_progress", "CONTINUE")
    assert analyze_logs([a, b], job_ended=True).primary_category == "unknown"


def test_registry_is_validated():
    with pytest.raises(AttributionError, match="unknown category"):
        parse_registry("categories: {disk_on_fire: {domain: workload, decision: STOP}}")
    with pytest.raises(AttributionError, match="not valid YAML"):
        parse_registry("categories: [")


def test_exit_meaning_is_one_table_a_site_can_change(tmp_path, write_log):
    """What a SIGKILL means is one decision (``Registry.exit_category``): the code's table when
    no sender is named, the launcher's word on the sender when it is; a site's overlay changes
    it in one place, and a signal the launcher sent itself can never be made a culprit."""
    from trainguard.attribution._registry import load_registry

    shipped = load_registry()
    assert shipped.exit_category(-9) == "host_oom"
    assert shipped.exit_category(-9, "outside") == "unknown"
    assert shipped.exit_category(-9, "launcher") is None
    assert shipped.exit_category(-15) is None and shipped.exit_category(1, "outside") == "unknown"
    line = "n1:launcher: trainguard launcher: cycle 0: rank 1 killed by signal 9 (SIGKILL) {}\n"
    log = write_log("n1:0: step 1\n" + line.format("from outside the launcher"))
    assert analyze_logs([log]).decision == "RESTART"
    reg = tmp_path / "reg.yaml"
    reg.write_text("signal_senders: {outside: host_oom}\n")
    assert analyze_logs([log], registry_path=str(reg)).primary_category == "host_oom"
    bad = tmp_path / "bad.yaml"  # (registries are cached per path)
    bad.write_text("signal_senders: {launcher: host_oom}\n")
    with pytest.raises(AttributionError, match="unknown sender"):
        analyze_logs([log], registry_path=str(bad))


def test_custom_registry_row(tmp_path, write_log):
    """Sites extend the registry with data, not code."""
    from importlib import resources

    import yaml

    doc = yaml.safe_load(resources.files("trainguard.attribution").joinpath(
        "patterns/default.yaml").read_text())
    doc["patterns"].insert(0, {"id": "site_fs_evicted", "category": "storage_full",
                               "role": "root", "tier": 30, "any": ["lustreerror"],
                               "regex": r"LustreError: .* evicted"})
    reg = tmp_path / "reg.yaml"
    reg.write_text(yaml.safe_dump(doc))
    log = write_log("LustreError: 11-0: client evicted by MDS\n")
    assert analyze_logs([log]).primary_category == "code_exception"  # generic "XError:" row
    res = analyze_logs([log], registry_path=str(reg))
    assert res.primary_category == "storage_full"
    assert res.evidence[0].pattern == "site_fs_evicted"


@pytest.mark.parametrize("shift", [-40, -1, 0, 1, 7, 200])
def test_block_boundaries_do_not_move_lines(write_log, shift):
    """The scanner reads 1 MiB blocks and joins only the line split across two of them: a fault
    line placed across (or right at) a block boundary is found, on its own line number, and the
    last progress line is the last one written."""
    from trainguard.attribution import _scan

    filler = "[rank1]: iteration {i:8d}/ 999999 | lm loss: 2.000000E+00 | pad " + "x" * 40 + "\n"
    lines, size, i = [], 0, 0
    fault = "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    while size < _scan._CHUNK + shift - len(fault) // 2:
        lines.append(filler.format(i=i))
        size, i = size + len(lines[-1]), i + 1
    lines.append(fault)
    fault_line = len(lines)
    lines += [filler.format(i=i + k) for k in range(3)] + ["tail without newline"]
    res = analyze_logs([write_log("".join(lines))])
    print("fault at byte", size, "block", _scan._CHUNK, "line", fault_line)
    assert (res.primary_category, res.culprit_ranks) == ("cuda_oom", [3])
    assert res.evidence[0].line == fault_line
    assert res.last_step == i + 2 and res.lines == len(lines)


def test_a_terminated_process_is_not_in_progress(write_log):
    """Found by the running-log property: srun reporting exit code 143 (SIGTERM) after progress
    lines made the log ``in_progress``/CONTINUE. A terminated process is not a culprit, but the
    job is not running: ``unknown``/RESTART."""
    res = analyze_logs([write_log("step 10 loss 1.0\nstep 11 loss 0.9\n"
                                  "srun: error: node-02: task 1: Exited with exit code 143\n")])
    assert (res.primary_category, res.decision, res.culprit_ranks) == ("unknown", "RESTART", None)
