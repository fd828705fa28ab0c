"""Properties of the analysis that must hold for any log, checked with generated inputs.

* a log whose launcher reports a failed process exit never gets CONTINUE;
* shuffling the order of benign INFO lines never changes the answer;
* adding a known-benign line anywhere never changes the answer.
"""

from __future__ import annotations

import json

from attr_data import DATA, LABEL_KEYS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.attribution import analyze_logs

CORPUS = DATA / "corpus"
LABELS = json.loads((CORPUS / "labels.json").read_text())
#: every labelled log: corpus, handed logs, the fresh and the held-apart sets (paths from CORPUS)
FILES = [lb["file"] for lb in LABELS] + [f"../logs/run_{i:02d}.log" for i in range(1, 13)] + [
    f"../{d}/{lb['file']}" for d in ("fresh", "heldout", "heldout2", "heldout3")
    for lb in json.loads((DATA / d / "labels.json").read_text())]
#: labelled logs of runs still training (nothing failed): a failed exit appended must end that
RUNNING = [f"../{d}/{lb['file']}" for d in ("corpus", "fresh", "heldout", "heldout2", "heldout3")
           for lb in json.loads((DATA / d / "labels.json").read_text())
           if lb["primary_category"] == "in_progress"]

#: lines a launcher or library prints in healthy runs (no progress, no rank prefix)
BENIGN_INFO = [
    ("[2024-05-01 10:00:00,001] [INFO] [real_accelerator.py:158:get_accelerator] Setting "
    "ds_accelerator to cuda (auto detect)"),
    ("node-99:4242:4242 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal "
    "network plugin."),
    "node-99:4242:4250 [0] NCCL INFO Failed to open libibverbs.so[.1]",
    "INFO:root:Loading dataset shard 3 of 8 from /data/run/shards",
    "2024-05-01 10:00:01 | INFO | fairseq.tasks.translation | [en] dictionary: 42024 types",
    "[INFO|tokenization_utils_base.py:2287] 2024-05-01 10:00:02 >> loading file tokenizer.json",
    "I0501 10:00:03.000000 4242 torch/_dynamo/utils.py:1000] compiling graph 3",
]
BENIGN_OTHER = [
    ("/usr/lib/python3.10/site-packages/torch/utils/data/dataloader.py:557: UserWarning: This "
    "DataLoader will create 8 worker processes in total."),
    "wandb: WARNING Network error (ReadTimeout), entering retry loop.",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
]
EXITS = [
    ("[2024-05-01 11:00:00,000] [ERROR] [launch.py:321:sigkill_handler] ['python', '-u', "
    "'train.py', '--local_rank=3'] exits with return code = {code}"),
    ("E0501 11:00:00.000000 4242 torch/distributed/elastic/multiprocessing/api.py:869] failed "
    "(exitcode: {code}) local_rank: 1 (pid: 4243) of binary: /usr/bin/python"),
    "srun: error: node-02: task 1: Exited with exit code {pos}",
    "srun: error: node-02: task 3: {signal}",
    "srun: error: node-01: tasks 0-3: {signal}",
    "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIG{sig}",
    ("subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit "
    "status {pos}."),
    ("mpirun noticed that process rank 2 with PID 4242 on node node-03 exited on signal {num} "
    "(Aborted)."),
    # the formats issue 12 names: pdsh-prefixed DeepSpeed, srun -l, torch 1.x elastic, launch.py
    ("worker-1: [2024-05-01 11:00:00,000] [ERROR] [launch.py:325:sigkill_handler] ['python', "
     "'-u', 'train.py', '--local_rank=7'] exits with return code = {code}"),
    "srun: error: node-03: task {pos}: {signal}",
    ("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: {code}) local_rank: 0 "
     "(pid: 4243) of binary: /usr/bin/python3"),
    "[node-02] srun: error: node-02: tasks 4-7: {signal}",
]
PROGRESS = ["step {i} loss 1.{i}", " 12%|#         | {i}/512 [01:12<2:01:33, 14.38s/it]",
            "iteration {i}/ 1000 | lm loss: 2.1E+00", "Epoch: [2]  [{i}/7393]  eta: 0:50:44"]


def _answer(text: str, tmp_path, name: str = "x.log") -> dict:
    path = tmp_path / name
    path.write_text(text)
    res = analyze_logs([path]).to_dict()
    return {k: res[k] for k in LABEL_KEYS}


_SETTINGS = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(before=st.lists(st.sampled_from(PROGRESS + BENIGN_INFO), max_size=12),
       after=st.lists(st.sampled_from(PROGRESS + BENIGN_INFO), max_size=12),
       exit_line=st.sampled_from(EXITS), code=st.sampled_from([-9, -11, -6, -7, 1, 2, 137]),
       pos=st.integers(1, 255), sig=st.sampled_from(["KILL", "SEGV", "ABRT", "BUS"]),
       signal=st.sampled_from(["Killed", "Aborted (core dumped)", "Segmentation fault"]),
       num=st.sampled_from([6, 9, 11]))
def test_failed_exit_never_continue(tmp_path, before, after, exit_line, code, pos, sig, signal,
                                    num):
    lines = [ln.format(i=i) for i, ln in enumerate(before)]
    lines.append(exit_line.format(code=code, pos=pos, sig=sig, signal=signal, num=num))
    lines += [ln.format(i=100 + i) for i, ln in enumerate(after)]
    got = _answer("\n".join(lines) + "\n", tmp_path)
    assert got["decision"] != "CONTINUE", (lines, got)
    assert got["primary_category"] != "in_progress", (lines, got)


@_SETTINGS
@given(name=st.sampled_from(FILES), data=st.data())
def test_shuffling_benign_info_lines_keeps_the_answer(tmp_path, name, data):
    base = (CORPUS / name).read_text().splitlines()
    slots = data.draw(st.lists(st.integers(0, len(base)), min_size=2, max_size=6))
    infos = data.draw(st.lists(st.sampled_from(BENIGN_INFO), min_size=len(slots),
                               max_size=len(slots)))
    shuffled = data.draw(st.permutations(infos))

    def build(fill: list[str]) -> str:
        out = list(base)
        for at, line in sorted(zip(slots, fill), key=lambda p: -p[0]):
            out.insert(at, line)
        return "\n".join(out) + "\n"

    assert _answer(build(infos), tmp_path, "a.log") == _answer(build(list(shuffled)), tmp_path,
                                                                "b.log")


@_SETTINGS
@given(name=st.sampled_from(FILES), line=st.sampled_from(BENIGN_INFO + BENIGN_OTHER),
       data=st.data())
def test_adding_a_benign_line_anywhere_keeps_the_answer(tmp_path, name, line, data):
    base = (CORPUS / name).read_text().splitlines()
    at = data.draw(st.integers(0, len(base)))
    want = _answer("\n".join(base) + "\n", tmp_path, "a.log")
    got = _answer("\n".join(base[:at] + [line] + base[at:]) + "\n", tmp_path, "b.log")
    assert got == want, (name, at, line)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(RUNNING), exit_line=st.sampled_from(EXITS),
       code=st.sampled_from([-9, -11, -6, 1, 137]), pos=st.integers(1, 255),
       sig=st.sampled_from(["KILL", "SEGV"]), signal=st.sampled_from(["Killed", "Aborted"]),
       num=st.sampled_from([6, 9, 11]), tail=st.integers(0, 3))
def test_a_running_log_with_a_failed_exit_is_never_continue(tmp_path, name, exit_line, code, pos,
                                                            sig, signal, num, tail):
    """A real log of a run still training, plus one launcher line reporting a failed exit
    (followed by up to three more progress lines from other ranks): never CONTINUE."""
    base = (CORPUS / name).read_text().splitlines()
    assert _answer("\n".join(base) + "\n", tmp_path, "a.log")["decision"] == "CONTINUE"
    extra = [exit_line.format(code=code, pos=pos, sig=sig, signal=signal, num=num)]
    extra += [PROGRESS[0].format(i=9000 + i) for i in range(tail)]
    got = _answer("\n".join(base + extra) + "\n", tmp_path, "b.log")
    assert got["decision"] != "CONTINUE", (name, extra, got)


@_SETTINGS
@given(name=st.sampled_from(FILES), data=st.data())
def test_shuffling_a_logs_own_info_lines_keeps_the_answer(tmp_path, name, data):
    """Permute the benign INFO lines already in a real log (NCCL INFO, library INFO lines)
    among their own positions: the answer must not move."""
    base = (CORPUS / name).read_text().splitlines()
    at = [i for i, ln in enumerate(base) if _is_benign_info(ln)]
    order = data.draw(st.permutations(at)) if len(at) >= 2 else at
    out = list(base)
    for dst, src in zip(at, order):
        out[dst] = base[src]
    want = _answer("\n".join(base) + "\n", tmp_path, "a.log")
    assert _answer("\n".join(out) + "\n", tmp_path, "b.log") == want, (name, at, order)


def _is_benign_info(line: str) -> bool:
    """A line that only reports a healthy step of setup: NCCL INFO lines that carry no error
    return code (``-> N``), and INFO lines of a Python logger."""
    if " NCCL INFO " in line:
        return "->" not in line and "error" not in line.lower()
    return " | INFO | " in line or line.startswith("INFO:")
