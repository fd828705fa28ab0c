"""The README's "Using them together" snippet, run as written on two ranks with real faults.

An exception on rank 1 at step 25 restarts both ranks in place; a SIGKILL of rank 1 at step 45
leaves rank 0 to finish alone (DCP reshards the checkpoint from 2 ranks to 1). Each restart must
resume from the newest checkpoint committed on disk (never an older one), and the run ends with
step 60 committed.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from trainguard.checkpointing import CheckpointManager
from trainguard.testing import Fault, FaultKind, FaultPlan, run_ranks

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
README = HERE.parents[1] / "README.md"


def readme_snippet() -> str:
    text = README.read_text()
    section = text.split("## Using them together", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"<!-- together-snippet -->\n```python\n(.*?)```", section, re.DOTALL)
    assert match, "README: no python block after <!-- together-snippet --> in 'Using them together'"
    return match.group(1)


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _resumes(steps: list[dict]) -> list[tuple[int, int, int]]:
    """(step the run was at, newest step committed on disk then, step it resumed from) for
    every roll-back in a rank's step log."""
    out = []
    for before, after in itertools.pairwise(steps):
        if after["step"] <= before["step"]:
            out.append((before["step"], before["newest"], after["step"] - 1))
    return out


@pytest.mark.timeout(300)
def test_readme_together_snippet_survives_an_exception_and_a_sigkill(tmp_path: Path):
    (tmp_path / "readme_together.py").write_text(readme_snippet())
    ckpt_dir = tmp_path / "ckpt"
    plan = FaultPlan([Fault(rank=1, kind=FaultKind.RAISE, step=25),
                      Fault(rank=1, kind=FaultKind.SIGKILL, step=45)])
    results = run_ranks("_readme_rank:main", 2, timeout_s=240, plan=plan,
                        pythonpath=[str(HERE), str(tmp_path)],
                        env={"CKPT_DIR": str(ckpt_dir), "TRAINGUARD_LOG_LEVEL": "WARNING"})
    for r in results:
        print(f"--- rank {r.rank}: exit {r.returncode}, result {r.result}, {r.wall_s:.1f} s\n"
              f"{r.stderr[-2500:]}")
    assert results[0].returncode == 0 and results[0].result == 60
    assert results[1].returncode == -9  # the planned SIGKILL
    steps0 = _steps(tmp_path / "steps0.jsonl")
    resumes = _resumes(steps0)
    print("rank 0 rolled back (at, newest committed then, resumed from):", resumes)
    assert [at for at, _, _ in resumes] == [25, 45], resumes  # one restart per fault, no other
    for at, newest, resumed in resumes:
        # the newest commit (one in flight at the fault may have completed since), never older
        assert newest <= resumed < at and resumed % 10 == 0, resumes
    killed_at = next(i for i, s in enumerate(steps0) if s["step"] == 45)
    after_kill = steps0[killed_at + 1:]
    assert after_kill and all(s["world"] == 1 for s in after_kill), after_kill[:3]
    assert all(s["world"] == 2 for s in steps0[:killed_at + 1])
    assert CheckpointManager(str(ckpt_dir), 2).committed_steps()[-1] == 60
    # The same command again on the finished directory (a user re-running the job): both ranks
    # resume at step 60 (DCP reshards it to 2 ranks), train nothing and return 60 at once. It
    # raised UnboundLocalError in every iteration before, restarting forever.
    again = run_ranks("_readme_rank:main", 2, timeout_s=120, plan=FaultPlan([]),
                      pythonpath=[str(HERE), str(tmp_path)],
                      env={"CKPT_DIR": str(ckpt_dir), "TRAINGUARD_LOG_LEVEL": "WARNING"})
    assert [(r.returncode, r.result) for r in again] == [(0, 60), (0, 60)], \
        [r.stderr[-1500:] for r in again]
    assert _steps(tmp_path / "steps0.jsonl") == steps0  # no step trained
