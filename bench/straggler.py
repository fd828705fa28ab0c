"""Benchmark of trainguard.straggler: mark cost, step overhead, report latency, detection quality.

Measured in one run, each with its baseline:

* ``mark_us``: one section entry + exit (``with section:``), minus an empty loop; baseline: the
  floor (two ``perf_counter_ns`` reads and a list append) and, with ``--nvrx-python``, NVRx's
  ``detection_section`` (CPU path, CUPTI stubbed);
* ``step_overhead_pct``: per-step instrumentation of a 10 ms step (two sections, one data wait,
  one wrapped collective, the step mark, plus closing and summarising the window amortised over
  its steps), timed in a tight loop, over 10 ms; ``step_overhead_ab_pct`` is the same from an A/B
  run of real 10 ms sleep steps (noisy, for reference);
* ``window_report_ms``: publish 4 ranks' summaries to a TCPStore, collect them and score the
  window (the aggregator's work per window); NVRx: its collective ``generate_report`` (1 rank);
* ``detect_windows`` / ``est_loss_error_pct``: 4 gloo ranks, 10 ms sleep compute, rank 1 1.3x
  from step 200: windows from onset to the flag (inclusive), |estimated - injected loss| in
  points, where the injected loss is the what-if: 3 ms per step over the median step time after
  onset (``est_loss_error_measured_pct`` compares with the before/after step-time change
  instead, which a loaded machine's drift distorts); ``whole_step_score_straggler``: the straggler's
  score for a whole-step section that
  contains the all-reduce (NVRx's is given by ``nvrx_whole_step_score_straggler``);
* ``false_positive_rate``: flagged (rank, window) pairs over scored pairs in 1000 uniform steps.

Prints a rich table, then one JSON line. Run:
``.venv/bin/python bench/straggler.py [--nvrx-python /work/nvrx-venv/bin/python] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from time import perf_counter_ns
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

WINDOW = 20


def _loop_ns(n: int) -> int:
    t0 = perf_counter_ns()
    for _ in range(n):
        pass
    return perf_counter_ns() - t0


def micro(n: int, chunk: int = 2000) -> dict[str, float]:
    """Mark, wrapper and per-step costs in one process (no process group needed).

    ``n`` marks in chunks of ``chunk``; each figure is the best chunk (short chunks often run
    without being preempted, so the minimum is the cost, not the machine's load).
    """
    repeats = max(5, n // chunk)
    n = chunk
    from trainguard.straggler import Detector, MemoryTransport, _collectives
    from trainguard.straggler._recorder import Recorder
    from trainguard.straggler._stats import summarize

    # no window closes inside the timed loops (the reporter thread would compete for the GIL
    # with a backlog no real job produces); closing and summarising are timed separately below
    Detector.initialize(rank=0, world_size=1, transport=MemoryTransport(), window_steps=10 ** 9,
                        report_time_interval=0, time_collectives=False)
    try:
        rec = Detector._get().recorder
        sec = Detector.detection_section("x")
        sec2 = Detector.detection_section("y")
        dw = Detector.data_wait()
        noop = _collectives._wrap(rec, lambda: None)
        floor: list[int] = []

        def marks() -> None:
            for _ in range(n):
                with sec:
                    pass

        def lookups() -> None:
            for _ in range(n):
                with Detector.detection_section("x"):
                    pass

        def floors() -> None:
            for _ in range(n):
                a = perf_counter_ns()
                floor.append(perf_counter_ns() - a)
            floor.clear()

        def wrapped() -> None:
            for _ in range(n):
                noop()

        def step() -> None:  # one 10 ms step's instrumentation, without the sleeps
            for _ in range(n):
                with dw:
                    pass
                with sec:
                    noop()
                with sec2:
                    pass
                Detector.step()

        loops = {"mark_us": marks, "mark_lookup_us": lookups, "floor_us": floors,
                 "coll_wrap_us": wrapped, "step_marks_us": step}
        raw = {k: float("inf") for k in [*loops, "empty"]}
        for _ in range(repeats):
            raw["empty"] = min(raw["empty"], _loop_ns(n))
            for key, fn in loops.items():
                t0 = perf_counter_ns()
                fn()
                raw[key] = min(raw[key], perf_counter_ns() - t0)
        best = {k: (raw[k] - raw["empty"]) / n / 1e3 for k in loops}
        best["window_close_us"] = _best_window_close(Recorder, repeats) / 1e3
        best["window_summary_us"] = _best_window_summary(summarize, repeats) / 1e3
    finally:
        Detector.shutdown()
    return best


def _best_window_close(recorder_cls: Any, repeats: int) -> float:
    """Closing a window on the training thread (list swaps), best of ``repeats``; ns."""
    closer = recorder_cls(WINDOW)
    closer.section("x")
    best = float("inf")
    for _ in range(repeats):
        closer._step, closer._wait, closer._data = [1] * WINDOW, [1] * WINDOW, [0] * WINDOW
        t0 = perf_counter_ns()
        closer._close()
        best = min(best, perf_counter_ns() - t0)
    return best


def _best_window_summary(summarize: Any, repeats: int) -> float:
    """The reporter thread's work per window (compute derivation, 4 metrics + 2 sections
    summarised, JSON encoding), best of ``repeats``; ns."""
    data = [10_000_000 + i for i in range(WINDOW)]
    best = float("inf")
    for _ in range(repeats):
        t0 = perf_counter_ns()
        compute = [s - w - d for s, w, d in zip(data, data, data)]
        summarize(compute)
        for _ in range(5):
            summarize(data)
        json.dumps({"m": [list(summarize(data))] * 6})
        best = min(best, perf_counter_ns() - t0)
    return best


def window_report_ms(world: int = 4, repeats: int = 20) -> float:
    """Publish ``world`` summaries to a real TCPStore, collect and score them; median ms."""
    import torch.distributed as dist

    from trainguard._core.net import free_port
    from trainguard.straggler import ScoringConfig, StoreTransport
    from trainguard.straggler.scores import Scorer

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    transport = StoreTransport(store, "bench")
    scorer = Scorer(ScoringConfig(), world)
    m = {k: [10.0, 0.1, 10.5, WINDOW] for k in ("step", "compute", "wait", "data")}
    times = []
    for w in range(repeats):
        for r in range(world):
            transport.publish({"rank": r, "node": f"n{r}", "window": w, "steps": WINDOW,
                               "metrics": m, "sections": {"fwd": [5.0, 0.1, 5.2, WINDOW]}})
        t0 = time.perf_counter()
        got = transport.collect(w)
        scorer.score(w, got)
        times.append((time.perf_counter() - t0) * 1e3)
        transport.discard(w)
    del store
    return statistics.median(times)


def ab_overhead(steps: int) -> float:
    """Real 10 ms sleep steps with and without the instrumentation; overhead in % (noisy)."""
    from trainguard.straggler import Detector, MemoryTransport

    def run(instrumented: bool) -> float:
        if instrumented:
            Detector.initialize(rank=0, world_size=1, transport=MemoryTransport(),
                                window_steps=WINDOW, report_time_interval=0)
        durations = []
        try:
            for _ in range(steps):
                t0 = perf_counter_ns()
                if instrumented:
                    with Detector.detection_section("fwd"):
                        time.sleep(0.010)
                    Detector.step()
                else:
                    time.sleep(0.010)
                durations.append(perf_counter_ns() - t0)
        finally:
            if instrumented:
                Detector.shutdown()
        return statistics.median(durations)

    base, inst = [], []
    for _ in range(3):
        base.append(run(False))
        inst.append(run(True))
    return 100.0 * (min(inst) - min(base)) / min(base)


def _launch(cfg: dict[str, Any], timeout_s: float) -> list[Any]:
    from trainguard.testing import run_ranks

    results = run_ranks("_straggler_workload:run", 4, timeout_s=timeout_s,
                        pythonpath=[str(BENCH)], env={"TG_STRAG_CFG": json.dumps(cfg)})
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise RuntimeError(f"rank {bad[0].rank} failed:\n{bad[0].stderr[-2000:]}")
    return [r.result for r in results]


def detection(compute_ms: float, onset: int, steps: int) -> dict[str, float]:
    reports = _launch({"steps": steps, "window": WINDOW, "compute_ms": compute_ms,
                       "collective": "all", "slow": [{"rank": 1, "start": onset,
                                                      "end": 10 ** 9, "factor": 1.3}]},
                      timeout_s=300)[0]["reports"]
    onset_w = onset // WINDOW
    first = next((r for r in reports if any(s["rank"] == 1 for s in r["stragglers"])), None)
    out: dict[str, float] = {"detect_windows": float("nan"), "est_loss_error_pct": float("nan")}
    before = statistics.median(r["step_ms_median"] for r in reports if 3 <= r["window"] < onset_w)
    after = statistics.median(r["step_ms_median"] for r in reports if r["window"] >= onset_w)
    out["measured_loss_pct"] = 100.0 * (after - before) / after
    # what-if truth: removing the injected 0.3 x compute_ms from the critical path of each step
    out["injected_loss_pct"] = 100.0 * 0.3 * compute_ms / after
    if first is not None:
        s = next(s for s in first["stragglers"] if s["rank"] == 1)
        out["detect_windows"] = first["window"] - onset_w + 1
        out["est_loss_pct"] = s["est_loss_pct"]
        out["est_loss_error_pct"] = abs(s["est_loss_pct"] - out["injected_loss_pct"])
        out["est_loss_error_measured_pct"] = abs(s["est_loss_pct"] - out["measured_loss_pct"])
        out["kind"] = s["kind"]  # type: ignore[assignment]
    late = [r for r in reports if r["window"] >= onset_w + 2]
    out["whole_step_score_straggler"] = statistics.median(
        r["section_relative_perf_scores"]["step"]["1"] for r in late)
    return out


def false_positives(compute_ms: float, steps: int) -> dict[str, float]:
    reports = _launch({"steps": steps, "window": WINDOW, "compute_ms": compute_ms,
                       "collective": "all"}, timeout_s=300)[0]["reports"]
    scored = [r for r in reports if not r["warmup"]]
    pairs = sum(len(r["per_rank"]) for r in scored)
    flagged = sum(len(r["stragglers"]) for r in scored)
    return {"false_positive_rate": flagged / pairs if pairs else float("nan"),
            "fp_windows": len(scored), "fp_flagged": flagged}


def nvrx(python: str, n: int, compute_ms: float, steps: int) -> dict[str, Any]:
    """NVRx's detector (CPU section path, CUPTI stubbed): mark, report, whole-step scores."""
    from trainguard._core.net import free_port

    script = str(BENCH / "_straggler_nvrx.py")
    with tempfile.TemporaryDirectory(prefix="tg-nvrx-np-") as np_dir:
        # NVRx's virtualenv has no numpy, which its report path needs (all_gather_object):
        # lend it ours, alone (no other package of this environment leaks in).
        import numpy

        src = Path(numpy.__file__).parent
        for name in (src, src.with_name("numpy.libs")):
            if name.exists():
                os.symlink(name, Path(np_dir) / name.name)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "PYTHONPATH": np_dir}
        return _nvrx_runs(python, script, env, n, compute_ms, steps)


def _nvrx_runs(python: str, script: str, env: dict[str, str], n: int, compute_ms: float,
               steps: int) -> dict[str, Any]:
    from trainguard._core.net import free_port
    from trainguard._core.procs import terminate_processes

    out = subprocess.run([python, script, "mark", str(n)], env=env, capture_output=True,
                         check=False, text=True, timeout=300)
    res = _parse_nvrx(out.stdout, out.stderr)
    cfg = json.dumps({"steps": steps, "compute_ms": compute_ms, "slow_rank": 1, "factor": 1.3})
    port = str(free_port())
    procs = [subprocess.Popen([python, script, "rank"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": "4",
                                   "NVRX_CFG": cfg}) for r in range(4)]
    try:
        stdout, stderr = procs[0].communicate(timeout=300)
        for p in procs[1:]:
            p.communicate(timeout=60)
    finally:
        terminate_processes(procs, grace_s=2.0)
    scores = _parse_nvrx(stdout, stderr)
    return {"nvrx_mark_us": res["mark_us"], "nvrx_report_ms": res["report_ms"],
            "nvrx_whole_step_score_straggler": scores["whole_step"]["1"],
            "nvrx_compute_score_straggler": scores["compute_only"]["1"],
            "nvrx_whole_step_scores": scores["whole_step"]}


def _parse_nvrx(stdout: str, stderr: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith("NVRX_RESULT "):
            return dict(json.loads(line[len("NVRX_RESULT "):]))
    raise RuntimeError("NVRx run printed no result:\n" + stderr[-2000:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrx-python", help="interpreter with nvidia-resiliency-ext installed")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and steps (smoke)")
    ap.add_argument("--marks", type=int, default=200_000, help="section marks per sample")
    args = ap.parse_args()
    n = 20_000 if args.quick else args.marks
    res: dict[str, Any] = micro(n)
    window_us = res["window_close_us"] + res["window_summary_us"]
    step_cost_us = res["step_marks_us"] + window_us / WINDOW
    res["step_cost_us"] = step_cost_us
    res["load_avg_1min"] = os.getloadavg()[0]
    res["step_overhead_pct"] = 100.0 * step_cost_us / 10_000.0
    res["window_report_ms"] = window_report_ms()
    res["step_overhead_ab_pct"] = ab_overhead(60 if args.quick else 300)
    onset, steps = (100, 200) if args.quick else (200, 340)
    res.update(detection(10.0, onset, steps))
    res.update(false_positives(5.0 if args.quick else 10.0, 200 if args.quick else 1000))
    if args.nvrx_python:
        res.update(nvrx(args.nvrx_python, n, 10.0, 50 if args.quick else 100))
    _table(res)
    keys = ["mark_us", "step_overhead_pct", "window_report_ms", "detect_windows",
            "false_positive_rate", "est_loss_error_pct"]
    final = {k: res[k] for k in keys}
    final.update({k: v for k, v in res.items() if k not in final})
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in final.items()}))
    return 0


def _table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="trainguard.straggler (4 gloo ranks, sleep-model compute)")
    for col in ("figure", "trainguard", "baseline", "target"):
        t.add_column(col)
    na = "not run (no --nvrx-python)"

    def g(key: str, fmt: str = ".3f") -> str:
        v = res.get(key)
        return na if v is None else (format(v, fmt) if isinstance(v, float) else str(v))

    t.add_row("mark_us (section entry+exit)", g("mark_us"),
              f"floor {g('floor_us')}; NVRx {g('nvrx_mark_us')}", "<= 1")
    t.add_row("collective wrapper us", g("coll_wrap_us"), "-", "-")
    t.add_row("step_overhead_pct (10 ms step)", g("step_overhead_pct", ".4f"),
              f"A/B sleep steps {g('step_overhead_ab_pct')}", "<= 0.1")
    t.add_row("window_report_ms (4 ranks)", g("window_report_ms"),
              f"NVRx report (1 rank) {g('nvrx_report_ms')}", "-")
    t.add_row("detect_windows (1.3x from step 200)", g("detect_windows", ".0f"), "-", "<= 3")
    t.add_row("est_loss_error_pct (points)", g("est_loss_error_pct", ".2f"),
              f"est {g('est_loss_pct', '.1f')} %, injected {g('injected_loss_pct', '.1f')} %, "
              f"before/after {g('measured_loss_pct', '.1f')} %", "<= 5")
    t.add_row("false_positive_rate (1000 uniform steps)", g("false_positive_rate", ".4f"),
              f"{res.get('fp_windows')} windows", "0")
    t.add_row("straggler score, whole-step section", g("whole_step_score_straggler"),
              f"NVRx {g('nvrx_whole_step_score_straggler')} (compute-only "
              f"{g('nvrx_compute_score_straggler')})", "< 1 (found)")
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
