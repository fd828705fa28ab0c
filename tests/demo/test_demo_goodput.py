"""``trainguard demo --duration``: the goodput run of ``bench/goodput.py`` for users, end to end
(real rank processes under the Wrapper, a real injected fault, the figure it prints)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.demo.test_demo_e2e import _demo

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_demo_duration_prints_the_goodput_of_its_json_report_and_recovers(tmp_path: Path):
    out = tmp_path / "demo"
    started = time.monotonic()
    # 20 s of training, faults at 6 and 12 s (18 s would leave 2 s, under the 5 s recovery
    # room); seed 7 makes them a hang in a C call and an exception (a SIGKILL with the root-only
    # full-disk kind: one reserve rank then)
    proc = _demo("--duration", "20", "--fault-every", "6", "--ranks", "2", "--seed", "7",
                 "--output-dir", str(out), timeout=100)
    elapsed = time.monotonic() - started
    print(proc.stdout[-4000:], proc.stderr[-2000:], f"demo --duration took {elapsed:.1f} s",
          sep="\n")
    assert proc.returncode == 0, "demo failed; logs in " + str(out / "goodput")
    report = json.loads((out / "goodput.json").read_text())
    fig = report["figures"]
    assert [f["t"] for f in report["plan"]] == [6.0, 12.0]
    assert report["plan"][0]["kind"] == "hang_c", report["plan"]
    for row in fig["faults"]:
        assert row["fired"] and row["recovered"] and 0 <= row["lost_s"] < 15, row
    # the live status, as plain lines (stdout is a pipe here): the faults as they happen
    status = re.findall(r"^\[ *\d+/20 s\] step (\d+) · faults (\d)/2 injected, (\d) recovered"
                        r" · checkpoint (?:step \d+|none yet) · goodput so far \d\.\d{3}$",
                        proc.stdout, re.MULTILINE)
    assert status and status[-1][1:] == ("2", "2"), proc.stdout[-3000:]
    assert [int(s[0]) for s in status] == sorted(int(s[0]) for s in status)
    # the printed figure is the report's, and it is a real measurement of this run
    printed = re.search(r"goodput (\d\.\d{3}) \((\d+) steps of", proc.stdout)
    assert printed, proc.stdout[-2000:]
    assert float(printed.group(1)) == round(fig["goodput"], 3)
    assert int(printed.group(2)) == fig["kept_steps"] > 0
    assert 0.2 < fig["goodput"] < 1.0 and 18.0 < fig["window_s"] < 40.0, fig
    assert str(out / "goodput.json") in proc.stdout.replace("\n", "")
    assert "PASS" in proc.stdout
