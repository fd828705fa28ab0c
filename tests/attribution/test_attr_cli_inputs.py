"""``trainguard analyze`` with bad inputs and outputs, and the one pipeline behind every front
end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainguard.attribution import JOB_ENDED_DEFAULT, analyze
from trainguard.cli import main

OOM = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"


def test_binary_input_is_flagged_not_fatal(tmp_path, capsys):
    good = tmp_path / "good.log"
    good.write_text("step 1 loss 2.0\n" + OOM)
    core = tmp_path / "core.bin"
    core.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 64)
    assert main(["analyze", "--json", str(good), str(core)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["primary_category"] == "cuda_oom" and out["culprit_ranks"] == [1]
    assert out["flagged_inputs"] == [str(core)]
    assert out["decision"] == "STOP"
    assert any(str(core) in w and "binary" in w for w in out["warnings"])


def test_progress_log_next_to_a_core_file_is_stop_not_continue(tmp_path, capsys):
    good = tmp_path / "good.log"
    good.write_text("step 1 loss 2.0\nstep 2 loss 1.9\n")
    core = tmp_path / "core.bin"
    core.write_bytes(b"\x00" * 4096)
    assert main(["analyze", "--json", str(good), str(core)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["primary_category"], out["decision"]) == ("in_progress", "STOP")
    assert "could not be read as a text log" in out["reason"]


def test_every_input_bad_is_one_line_and_exit_2(tmp_path, capsys):
    core = tmp_path / "core.bin"
    core.write_bytes(b"\x00" * 100)
    assert main(["analyze", "--json", str(core), str(tmp_path / "missing.log")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "no input could be analysed" in err[0], err
    assert "core.bin" in err[0] and "missing.log" in err[0]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", [["--json"], []])
def test_output_to_a_full_disk_is_one_clear_line(tmp_path, fmt):
    log = tmp_path / "x.log"
    log.write_text(OOM)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "trainguard", "analyze", *fmt, str(log)],
                              check=False, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    err = proc.stderr.strip().splitlines()
    print("stderr:", proc.stderr)
    assert proc.returncode == 74
    assert len(err) == 1 and "No space left on device" in err[0]
    assert "Traceback" not in proc.stderr


def test_one_pipeline_same_answer_as_the_cli(tmp_path, capsys):
    log = tmp_path / "x.log"
    log.write_text("step 10 loss 1.0\nstep 11 loss 0.9\n")
    assert main(["analyze", "--json", str(log)]) == 0
    cli = json.loads(capsys.readouterr().out)
    lib = analyze([log])
    keys = ["primary_category", "decision", "category_decision", "culprit_ranks", "reason"]
    assert {k: cli[k] for k in keys} == {k: lib[k] for k in keys}
    assert JOB_ENDED_DEFAULT is False and lib["decision"] == "CONTINUE"
    ended = analyze([log], job_ended=True)
    assert (ended["primary_category"], ended["decision"]) == ("unknown", "RESTART")


def test_pipeline_needs_some_input():
    from trainguard.attribution import LogInputError

    with pytest.raises(LogInputError, match="nothing to analyse"):
        analyze([])


#: torchrun's failure summary (the ``ChildFailedError`` record written from the ranks'
#: ``error.json``): rank 1 on host node-03
_RECORD = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-05-01_10:00:00
  host      : node-03
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4242)
  error_file: /tmp/torchelastic_x/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
============================================================
"""


def test_analyze_names_the_host_from_torchruns_record(tmp_path, capsys):
    """The record names where rank 1 ran: ``trainguard analyze`` shows it (and the JSON carries
    it as ``culprit_hosts``) instead of ``nodes: None``; a code fault still excludes no node."""
    log = tmp_path / "job.log"
    log.write_text("epoch 0 step 10 loss 1.0\n" + OOM + _RECORD)
    assert main(["analyze", "--json", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["primary_category"], out["culprit_ranks"]) == ("cuda_oom", [1]), out
    assert out["culprit_hosts"] == ["node-03"] and out["culprit_nodes"] is None, out
    assert main(["analyze", str(log)]) == 0
    text = capsys.readouterr().out
    assert "nodes: ['node-03']" in text and "nodes: None" not in text, text
    no_host = tmp_path / "plain.log"  # no record: nothing to name
    no_host.write_text("epoch 0 step 10 loss 1.0\n" + OOM)
    assert main(["analyze", "--json", str(no_host)]) == 0
    assert json.loads(capsys.readouterr().out)["culprit_hosts"] is None


def test_a_network_fault_named_by_rank_is_placed_on_the_records_host(tmp_path):
    """A network fault (a category whose culprits include nodes) that the fault line places on
    rank 1 only: the record's host is the culprit node."""
    log = tmp_path / "net.log"
    log.write_text("epoch 0 step 10 loss 1.0\n[rank1]: RuntimeError: NCCL error: unhandled "
                   "system error, NCCL version 2.18.1\n" + _RECORD)
    out = analyze([log])
    assert (out["primary_category"], out["culprit_ranks"]) == ("network", [1]), out
    assert out["culprit_nodes"] == ["node-03"] == out["culprit_hosts"], out
