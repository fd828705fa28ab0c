"""Smoke test of ``bench/straggler.py``'s in-process parts (the 4-rank parts are the dist tests)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "straggler.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_straggler", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_micro_figures_and_window_report_are_measured():
    bench = _load()
    res = bench.micro(2000)
    print(res)
    for key in ("mark_us", "floor_us", "coll_wrap_us", "step_marks_us", "window_close_us",
                "window_summary_us"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    assert res["mark_us"] < 50 and res["window_summary_us"] < 20_000  # plausible, not fast
    ms = bench.window_report_ms(world=4, repeats=3)
    assert 0 < ms < 1000
