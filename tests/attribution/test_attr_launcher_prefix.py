"""``trainguard launch``'s own cycle logs: the ``{node}:{rank}: `` prefix and the launcher's
record (issues 12/13: the analyser must read the logs of our own launcher).

Each kind is checked in launcher format with several host spellings, and against the prefix
schemes it must not disturb (pdsh ``10.0.0.2: ``, ``srun -l`` ``0: ``, ``[node-01]``, a source
path ``train.py:12: UserWarning``).
"""

from __future__ import annotations

import pytest

from trainguard.attribution import analyze_logs
from trainguard.attribution._context import parse_prefix
from trainguard.fault_tolerance._attr_record import record_lines
from trainguard.fault_tolerance._cycle import CycleResult, Failure

HOSTS = ["node07", "gpu-a.cluster.example.org", "10.0.0.2", "myhost"]

_START = "rank {r}: world 2, gloo, step 0\nepoch 0 | step 1/10 | loss 0.9\n"
_RAISE = """Traceback (most recent call last):
  File "/work/train.py", line 30, in <module>
    main()
  File "/work/train.py", line 21, in main
    raise RuntimeError("boom always")
RuntimeError: boom always
"""
_RESET = """Traceback (most recent call last):
  File "/work/train.py", line 30, in <module>
    main()
  File "/work/train.py", line 19, in main
    dist.all_reduce(t)
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error \
[127.0.0.1]:41007: Connection reset by peer
"""
#: what ``trainguard launch -m no.such.module`` prints on every rank (its bootstrap's runpy)
_NO_MODULE = """Traceback (most recent call last):
  File "<frozen runpy>", line 131, in _get_module_details
  File "<frozen importlib.util>", line 94, in find_spec
ModuleNotFoundError: No module named 'no'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/src/trainguard/fault_tolerance/_bootstrap.py", line 148, in run_worker
    runpy.run_module(target, run_name="__main__", alter_sys=True)
  File "<frozen runpy>", line 222, in run_module
  File "<frozen runpy>", line 140, in _get_module_details
ImportError: Error while finding module specification for 'no.such.module' (ModuleNotFoundError: \
No module named 'no')
"""


def _prefixed(host: str, rank: int, text: str) -> str:
    return "".join(f"{host}:{rank}: {ln}\n" for ln in text.splitlines())


def _launcher(host: str, res: CycleResult) -> str:
    return "".join(f"{ln}\n" for ln in record_lines(host, res))


def _got(write_log, text: str) -> tuple:
    r = analyze_logs([write_log(text)], job_ended=True)
    return r.primary_category, r.decision, r.culprit_ranks, r.culprit_nodes


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("rank", [0, 3, 12])
def test_launcher_prefix_names_node_and_rank(host, rank):
    ctx, body = parse_prefix(f"{host}:{rank}: RuntimeError: boom", launcher=True)
    assert (ctx.node, ctx.rank, body) == (host, rank, "RuntimeError: boom")


@pytest.mark.parametrize("host", HOSTS)
def test_launcher_own_lines_name_the_node_only(host):
    ctx, body = parse_prefix(f"{host}:launcher: trainguard launcher: cycle 0: rank 1 x",
                             launcher=True)
    assert (ctx.node, ctx.rank, body) == (host, None, "trainguard launcher: cycle 0: rank 1 x")


@pytest.mark.parametrize("line,node,rank,task,body", [
    ("10.0.0.2: RuntimeError: x", "10.0.0.2", None, None, "RuntimeError: x"),  # pdsh
    ("0: RuntimeError: x", None, None, 0, "RuntimeError: x"),  # srun -l
    ("[node-01] RuntimeError: x", "node-01", None, None, "RuntimeError: x"),
    ("3: [rank3]: RuntimeError: x", None, 3, 3, "RuntimeError: x"),
    # a relative source path is not a host
    ("train.py:12: UserWarning: x", None, None, None, "train.py:12: UserWarning: x"),
    ("ERROR:1: x", None, None, None, "ERROR:1: x"),
    # NCCL's host:pid:tid [dev]
    ("node07:123:456 [0] NCCL INFO x", "node07", None, None, "NCCL INFO x"),
])
def test_other_prefix_schemes_unchanged(line, node, rank, task, body):
    for launcher in (False, True):
        ctx, got = parse_prefix(line, launcher=launcher)
        assert (ctx.node, ctx.rank, ctx.task, got) == (node, rank, task, body)


@pytest.mark.parametrize("line", ["step:100: RuntimeError: CUDA error", "Epoch:3: loss 0.25",
                                  "trainer:120: starting fit", "mlx5_0:1: port down"])
def test_word_number_lines_outside_a_launcher_log_name_no_node(line):
    ctx, got = parse_prefix(line)
    assert (ctx.node, ctx.rank, got) == (None, None, line)


def test_launcher_log_is_recognised_by_its_prefixed_lines():
    from trainguard.attribution._context import is_launcher_log

    cycle = "".join(f"node07:{r}: step {i}\n" for i in range(5) for r in (0, 1))
    assert is_launcher_log(cycle + "node07:launcher: trainguard launcher: cycle 0: x\n")
    plain = "step:100: RuntimeError: CUDA error\nTraceback (most recent call last):\n  x\n"
    assert not is_launcher_log(plain)


def _exc_log(host: str) -> str:
    """The user's report: rank 1 raises; rank 0 then sees gloo's connection reset (later lines)."""
    return (_prefixed(host, 0, _START.format(r=0)) + _prefixed(host, 1, _START.format(r=1))
            + _prefixed(host, 1, _RAISE) + _prefixed(host, 0, _RESET))


@pytest.mark.parametrize("host", HOSTS)
def test_exception_on_rank1_with_peer_reset_is_code_exception(write_log, host):
    res = CycleResult(0)
    res.fail(Failure(1, "exit", "exit code 1: RuntimeError: boom always", 1, 1))
    res.fail(Failure(0, "exit", "exit code 1", 2, 1))
    cat, decision, ranks, _ = _got(write_log, _exc_log(host) + _launcher(host, res))
    assert (cat, decision, ranks) == ("code_exception", "STOP", [1])


def test_module_not_found_on_every_rank_stops(write_log):
    text = _prefixed("node07", 0, _NO_MODULE) + _prefixed("node07", 1, _NO_MODULE)
    res = CycleResult(0)
    res.fail(Failure(0, "exit", "exit code 1", 1, 1))
    res.fail(Failure(1, "exit", "exit code 1", 2, 1))
    assert _got(write_log, text + _launcher("node07", res))[:2] == ("code_exception", "STOP")


def test_sigkill_record_restarts(write_log):
    """A SIGKILL the launcher did not send: its record says so, and that sender (not a second
    rule) decides the exit's category in the one table: unknown, RESTART."""
    res = CycleResult(0)
    res.fail(Failure(1, "signal", "killed by signal SIGKILL", 5, -9))
    assert record_lines("node07", res) == [
        ("node07:launcher: trainguard launcher: cycle 0: rank 1 killed by signal 9 (SIGKILL) "
         "from outside the launcher")]
    text = _prefixed("node07", 0, _START.format(r=0)) + _prefixed("node07", 1, _START.format(r=1))
    r = analyze_logs([write_log(text + _launcher("node07", res))], job_ended=True)
    assert (r.primary_category, r.decision) == ("unknown", "RESTART"), r.reason
    assert r.fingerprint == "unknown:trainguard_rank_exit", r.reason
    assert "code -9, its signal sent from outside the launcher" in r.reason, r.reason


def test_sigkill_without_a_sender_is_the_exit_code_table(write_log):
    """The same -9 where a launcher record names no sender (torchrun's, an older trainguard
    record): the code's table decides -- host OOM, STOP -- through the same function."""
    text = (_prefixed("node07", 0, _START.format(r=0))
            + "node07:launcher: trainguard launcher: cycle 0: rank 1 killed by signal 9 "
            "(SIGKILL)\n")
    assert _got(write_log, text)[:2] == ("host_oom", "STOP")


def test_hang_kill_race_is_the_launchers_not_an_outside_kill(write_log):
    """The monitor reports rank 1 hung and SIGKILLs it; the launcher sees the exit as well. The
    record says the launcher sent that signal, and the verdict stays the hang (RESTART), not an
    outside kill and not host OOM."""
    res = CycleResult(0)
    res.fail(Failure(1, "hang", "heartbeat: no heartbeat for 5.2 s", 5))
    res.fail(Failure(1, "signal", "killed by signal SIGKILL", 6, -9))
    lines = record_lines("node07", res, [(0, 1, 5, {"timeout_s": 5.0})])
    assert lines[1] == ("node07:launcher: trainguard launcher: cycle 0: rank 1 killed by signal 9 "
                        "(SIGKILL) by the launcher (hang detection)"), lines
    text = _prefixed("node07", 0, _START.format(r=0)) + "\n".join(lines) + "\n"
    assert _got(write_log, text) == ("collective_timeout", "RESTART", [1], None)
    only_kill = _prefixed("node07", 0, _START.format(r=0)) + lines[1] + "\n"
    r = analyze_logs([write_log(only_kill)], job_ended=True)  # the kill alone: a teardown
    assert (r.primary_category, r.decision) == ("unknown", "RESTART"), r.reason
    assert "terminated" in r.reason, r.reason


def test_hang_record_is_the_hang_category(write_log):
    res = CycleResult(0)
    res.fail(Failure(1, "hang", "heartbeat: no heartbeat for 5.2 s", 5))
    events = [(0, 1, 5, {"timeout_s": 5.0})]
    lines = record_lines("node07", res, events)
    assert lines == [("node07:launcher: trainguard launcher: cycle 0: rank 1 killed as hung after "
                      "5 s (heartbeat: no heartbeat for 5.2 s)")]
    text = _prefixed("node07", 0, _START.format(r=0)) + "\n".join(lines) + "\n"
    cat, decision, ranks, _ = _got(write_log, text)
    assert (cat, decision, ranks) == ("collective_timeout", "RESTART", [1])


def test_record_skips_non_process_failures():
    res = CycleResult(2)
    res.fail(Failure(-1, "peer", "another node ended the round", 1))
    res.fail(Failure(0, "signal", "killed by signal SIGSEGV", 2, -11))
    assert record_lines("n1", res) == [
        ("n1:launcher: trainguard launcher: cycle 2: rank 0 killed by signal 11 (SIGSEGV) from "
         "outside the launcher")]
