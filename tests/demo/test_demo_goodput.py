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
    # 20 s of training, a fault at 6 s (the next one would fall in the last 10 s); seed 2 makes
    # it an exception with or without the full-disk kind (root-only), so no reserve rank starts
    proc = _demo("--duration", "20", "--fault-every", "6", "--ranks", "2", "--seed", "2",
                 "--output-dir", str(out), timeout=100)
    elapsed = time.monotonic() - started
    print(proc.stdout[-4000:], proc.stderr[-2000:], f"demo --duration took {elapsed:.1f} s",
          sep="\n")
    assert proc.returncode == 0, "demo failed; logs in " + str(out / "goodput")
    report = json.loads((out / "goodput.json").read_text())
    fig = report["figures"]
    assert [(f["kind"], f["t"]) for f in report["plan"]] == [("exception", 6.0)]
    row = fig["faults"][0]
    assert row["fired"] and row["recovered"] and 0 <= row["lost_s"] < 15, row
    # the printed figure is the report's, and it is a real measurement of this run
    printed = re.search(r"goodput (\d\.\d{3}) \((\d+) steps of", proc.stdout)
    assert printed, proc.stdout[-2000:]
    assert float(printed.group(1)) == round(fig["goodput"], 3)
    assert int(printed.group(2)) == fig["kept_steps"] > 0
    assert 0.2 < fig["goodput"] < 1.0 and 18.0 < fig["window_s"] < 40.0, fig
    assert str(out / "goodput.json") in proc.stdout.replace("\n", "")
    assert "PASS" in proc.stdout
