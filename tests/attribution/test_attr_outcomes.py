"""Three kinds a new user's check of ``trainguard analyze`` found, each fixed at its root:

1. a fault that ``inprocess.Wrapper`` recovered from in-process is reported as recovered, never
   as the job's failure (a recovered-then-completed log is ``completed``, its STOP saying that
   nothing is left to do);
2. a rank killed by a signal from outside (``kill -9``, the OOM killer) is named: signal, rank,
   and no bare ``None`` in the text output;
3. torchelastic's JSON error file (``error.json``) is read as the traceback it records.

The logs are real runs (``tests/data/attribution/real_runs/README.md``); variants are cut from them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from attr_data import DATA

from trainguard.attribution import analyze
from trainguard.attribution._analyze import analyze_logs
from trainguard.cli import main

RUNS = DATA / "real_runs"
_RESTART_LINE = re.compile(r"restart \d+ -> \d+: cause=|raised; restarting all ranks")


def _cli_text(capsys, *args: str) -> str:
    assert main(["analyze", *args]) == 0
    return capsys.readouterr().out


# ------------------------------------------------------------ 1. recovered in-process
def test_recovered_then_completed_is_completed_and_names_the_recovery(capsys):
    log = str(RUNS / "inprocess_recovered_completed.log")
    for ended in (False, True):  # the CLI's default and the launcher's job_ended=True
        out = analyze([log], job_ended=ended)
        assert (out["primary_category"], out["decision"]) == ("completed", "STOP"), out
        assert "nothing left to do" in out["reason"] and out["recovered"], out
        assert out["culprit_ranks"] is None, out
        rec = out["recovered"]
        assert len(rec) == 1, rec
        assert (rec[0]["category"], rec[0]["ranks"], rec[0]["iteration"], rec[0]["cause"]) == \
            ("code_exception", [1], 0, "exception"), rec
        assert "RuntimeError: injected fault at step 2" in rec[0]["text"], rec
        assert "recovered 1 fault(s)" in out["reason"], out["reason"]
    text = _cli_text(capsys, log)
    assert "recovered in-process: code_exception on rank(s) [1] (restart 0 -> 1)" in text, text
    assert "Decision: STOP" in text and "None" not in text, text


def test_without_the_restart_record_the_same_fault_is_the_failure(write_log):
    """The Wrapper's lines are what make the fault recovered: the same log without them (its
    restart record, its warning) ends in the exception (STOP), as it did before they were
    read."""
    lines = (RUNS / "inprocess_recovered_completed.log").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if not _RESTART_LINE.search(ln) and "call completed" not in ln]
    r = analyze_logs([write_log("".join(kept))], job_ended=True)
    assert (r.primary_category, r.decision, r.culprit_ranks) == ("code_exception", "STOP", [1])
    assert r.recovered == []


def _injected_fault_lines(log: Path) -> list[int]:
    """1-based line numbers of rank 1's injected fault in a real-run log (one per iteration)."""
    return [i + 1 for i, ln in enumerate(log.read_text().splitlines())
            if ln == "vm:1: RuntimeError: injected fault at step 2"]


def test_fault_after_the_last_restart_is_the_failure():
    """Retry limit: iteration 0's fault was recovered, iteration 1's was not (no restart record
    follows it); the verdict is iteration 1's fault, the first listed as recovered."""
    log = RUNS / "inprocess_retry_limit.log"
    r = analyze_logs([str(log)], job_ended=True)
    assert (r.primary_category, r.decision, r.culprit_ranks) == ("code_exception", "STOP", [1])
    first, last = _injected_fault_lines(log)
    assert r.evidence[0].line == last, r.evidence
    assert [(x["line"], x["ranks"]) for x in r.recovered] == [(first, [1])], r.recovered


def test_warning_level_log_recovered_fault_is_not_the_failure():
    """Logging left unconfigured: only the Wrapper's WARNING ("iteration 0 raised; restarting
    all ranks:") and the traceback after it are printed. That traceback is the recovered fault;
    the job went on (CONTINUE while running; never STOP)."""
    log = str(RUNS / "inprocess_warning_level_recovered.log")
    running = analyze_logs([log])
    assert (running.primary_category, running.decision) == ("in_progress", "CONTINUE")
    ended = analyze_logs([log], job_ended=True)
    assert ended.decision != "STOP" and ended.primary_category == "unknown", ended.reason
    assert [(x["category"], x["ranks"], x["iteration"]) for x in ended.recovered] == \
        [("code_exception", [1], 0)], ended.recovered


def test_warning_level_log_with_the_launchers_success_record_is_completed(tmp_path):
    """New-user finding: at the default log level a job that recovered and finished read as
    ``in_progress``; ``trainguard launch`` now appends ``cycle N: every rank exited 0`` to the
    cycle log of a successful cycle, which is the completion."""
    log = tmp_path / "cycle_0.log"
    log.write_text((RUNS / "inprocess_warning_level_recovered.log").read_text()
                   + "vm:launcher: trainguard launcher: cycle 0: every rank exited 0\n")
    for ended in (False, True):
        res = analyze_logs([str(log)], job_ended=ended)
        assert (res.primary_category, res.decision) == ("completed", "STOP"), res.reason
        assert [(x["category"], x["ranks"]) for x in res.recovered] == \
            [("code_exception", [1])], res.recovered


def test_warning_level_retry_limit_revokes_the_announced_restart():
    """The warning announces a restart; the retry limit's RestartAbort says it did not happen:
    iteration 1's fault is the failure again (iteration 0's stays recovered, since iteration 1's
    warning shows that restart happened)."""
    log = RUNS / "inprocess_warning_level_retry_limit.log"
    r = analyze_logs([str(log)], job_ended=True)
    assert (r.primary_category, r.decision, r.culprit_ranks) == ("code_exception", "STOP", [1])
    first, last = _injected_fault_lines(log)
    assert r.evidence[0].line == last, r.evidence
    assert [(x["line"], x["iteration"]) for x in r.recovered] == [(first, 0)], r.recovered


def test_caught_traceback_spans_a_chained_exception(write_log):
    """A caught traceback with a chained exception is one recovered fault; a separate traceback
    from the same rank afterwards (not announced by the Wrapper) is not."""
    caught = ("[rank1]: trainguard: rank 1 (initial rank 1) iteration 0 raised; restarting all "
              "ranks:\n[rank1]: Traceback (most recent call last):\n"
              "[rank1]:   File \"train.py\", line 3, in step\n"
              "[rank1]: ValueError: bad shard\n[rank1]: \n"
              "[rank1]: The above exception was the direct cause of the following exception:\n"
              "[rank1]: \n[rank1]: Traceback (most recent call last):\n"
              "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
              "[rank1]: \n")
    later = "[rank1]: Traceback (most recent call last):\n[rank1]: KeyError: 'labels'\n"
    r = analyze_logs([write_log(caught)])
    assert (r.primary_category, r.decision) == ("in_progress", "CONTINUE"), r.reason
    assert len(r.recovered) == 1 and r.recovered[0]["ranks"] == [1], r.recovered
    unchained = caught.replace("The above exception was the direct cause of the following "
                               "exception:", "")  # the second traceback is then a new one
    r = analyze_logs([write_log(unchained)])
    assert r.primary_category == "framework_crash", r.reason
    r = analyze_logs([write_log(caught + later)])
    assert (r.primary_category, r.culprit_ranks) == ("code_exception", [1]), r.reason
    assert "KeyError" in r.evidence[0].text, r.evidence


def test_recovered_rank_is_not_a_later_failures_culprit(write_log):
    """Rank 1's fault was recovered; rank 0's same kind of fault later was not: rank 0 alone."""
    text = ("[rank1]: RuntimeError: bad batch\n"
            "[rank0]: INFO trainguard.inprocess: restart 0 -> 1: cause=exception ranks=[1] "
            "detection=0.001 s restart=0.090 s\n"
            "[rank1]: INFO trainguard.inprocess: restart 0 -> 1: cause=exception ranks=[1] "
            "detection=0.001 s restart=0.090 s\n"
            "[rank0]: RuntimeError: bad batch\n")
    r = analyze_logs([write_log(text)], job_ended=True)
    assert (r.primary_category, r.culprit_ranks) == ("code_exception", [0]), r.reason
    assert len(r.recovered) == 1 and r.recovered[0]["ranks"] == [1], r.recovered


def test_nvrx_nested_restarter_lines_are_recovery_and_completion(write_log):
    """NVRx's (and trainguard's ``nested_restarter``) restarter lines, as NVRx's launcher reads
    them."""
    head = "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    handled = "[rank0]: [NestedRestarter] name=[InProcess] state=handling stage=completed\n"
    done = "[rank0]: [NestedRestarter] name=[InProcess] state=finalized\n"
    r = analyze_logs([write_log(head + handled + done)], job_ended=True)
    assert (r.primary_category, r.decision) == ("completed", "STOP"), r.reason
    assert r.recovered and "nothing left to do" in r.basis, r.basis
    assert [(x["category"], x["ranks"]) for x in r.recovered] == [("cuda_oom", [2])]
    running = analyze_logs([write_log(head + handled)])  # restarted, not finished yet
    assert (running.primary_category, running.decision) == ("in_progress", "CONTINUE")
    ended = analyze_logs([write_log(head + handled)], job_ended=True)
    assert ended.decision != "STOP" and ended.recovered, ended.reason


# ------------------------------------------------------------ 2. killed from outside
def test_launch_sigkill_names_signal_and_rank(capsys):
    log = str(RUNS / "launch_sigkill_outside.log")
    out = analyze([log], job_ended=True)  # what the launcher runs on a failed cycle
    assert (out["primary_category"], out["decision"], out["culprit_ranks"]) == \
        ("unknown", "RESTART", [1]), out
    assert out["failed_exits"] == [{"rank": 1, "local_rank": None, "code": -9,
                                    "signal": "SIGKILL", "sender": "outside", "node": "vm",
                                    "line": 3, "file": log}], out["failed_exits"]
    assert "rank 1 killed by SIGKILL" in out["reason"], out["reason"]
    text = _cli_text(capsys, log)
    assert "None" not in text, text
    assert "ranks: [1]" in text and "killed by SIGKILL" in text, text


def test_launch_console_sigkill_is_the_same_verdict_as_its_cycle_log():
    """The launcher's console (what a user pipes to a file) says the same as its cycle log: its
    root-cause line names a signal the launcher did not send; its own verdict line (quoting an
    earlier analysis) is no evidence."""
    out = analyze([str(RUNS / "launch_sigkill_outside_console.log")], job_ended=True)
    assert (out["primary_category"], out["decision"], out["culprit_ranks"]) == \
        ("unknown", "RESTART", [1]), out
    assert [(e["rank"], e["signal"], e["sender"]) for e in out["failed_exits"]] == \
        [(1, "SIGKILL", "outside")], out["failed_exits"]


def test_torchrun_sigkill_names_signal_and_rank_once():
    """torchrun reports the death twice (its "failed (exitcode: -9)" line and its record): one
    failed exit, on the record's host; SIGKILL and the rank in the reason."""
    out = analyze([str(RUNS / "torchrun_sigkill.log")])
    assert (out["primary_category"], out["culprit_ranks"]) == ("host_oom", [1]), out
    assert [(e["rank"], e["code"], e["signal"], e["node"]) for e in out["failed_exits"]] == \
        [(1, -9, "SIGKILL", "localhost")], out["failed_exits"]
    assert "rank 1 killed by SIGKILL" in out["reason"] and "kill -9" in out["reason"], out


@pytest.mark.parametrize("line, ranks", [
    ("srun: error: node-02: task 3: Exited with exit code 137\n", [3]),  # 128 + 9
    ("srun: error: node-02: task 3: Killed\n", [3]),
    ("process rank 1 with PID 4242 on node n1 exited on signal 9 (Killed).\n", [1]),
])
def test_other_launchers_sigkill_words(write_log, line, ranks):
    r = analyze_logs([write_log("[rank0]: step 5\n" + line)], job_ended=True)
    assert r.culprit_ranks == ranks, r.reason
    assert [e["signal"] for e in r.failed_exits] == ["SIGKILL"], r.failed_exits
    assert "SIGKILL" in r.reason, r.reason


def test_no_bare_none_in_text_output(capsys, write_log):
    """A log with no step, no checkpoint and no rank: every unknown is said in words."""
    log = write_log("n1:launcher: trainguard launcher: cycle 0: rank 1 killed by signal 9 "
                    "(SIGKILL) from outside the launcher\n")
    text = _cli_text(capsys, log)
    assert "None" not in text, text
    assert "no training step logged, no checkpoint save in the log" in text, text


# ------------------------------------------------------------ 3. torchelastic error file
def _traceback_log(write_log, doc: dict) -> str:
    return write_log(doc["message"]["extraInfo"]["py_callstack"], name="same.log")


def test_error_json_is_attributed_like_its_traceback_in_a_log(write_log):
    path = RUNS / "torchrun_error.json"
    doc = json.loads(path.read_text())
    got = analyze_logs([str(path)])
    same = analyze_logs([_traceback_log(write_log, doc)])
    assert (got.primary_category, got.decision) == ("missing_path", "STOP"), got.reason
    assert (got.fingerprint, got.evidence[0].line, got.evidence[0].text) == \
        (same.fingerprint, same.evidence[0].line, same.evidence[0].text)
    assert got.evidence[0].text.startswith("FileNotFoundError: [Errno 2]"), got.evidence


def test_error_json_older_layout_and_message_only(write_log):
    doc = json.loads((RUNS / "torchrun_error.json").read_text())
    old = {"message": doc["message"]["extraInfo"]["py_callstack"], "timestamp": 1796175447}
    r = analyze_logs([write_log(json.dumps(old), name="error.json")])
    assert (r.primary_category, r.decision) == ("missing_path", "STOP"), r.reason
    bare = {"message": {"message": "torch.OutOfMemoryError: CUDA out of memory. Tried to "
                        "allocate 2.00 GiB", "extraInfo": {"timestamp": "1796175447"}}}
    r = analyze_logs([write_log(json.dumps(bare), name="error.json")])
    assert r.primary_category == "cuda_oom", r.reason


def test_other_json_is_read_as_text(write_log):
    """JSON that is not an error file (a JSON-lines log) is scanned as the text it is."""
    text = ('{"step": 5, "loss": 0.3}\n'
            '{"message": "RuntimeError: CUDA error: an illegal memory access was encountered"}\n'
            '{"message": 3}\n')
    r = analyze_logs([write_log(text, name="train.jsonl")], job_ended=True)
    assert r.primary_category == "framework_crash", r.reason
