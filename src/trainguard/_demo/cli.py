"""``trainguard demo``: DDP training on the digits data set that survives injected faults.

Spawns ``--ranks`` active plus ``--reserve-ranks`` spare rank processes, each training under
``trainguard.inprocess.Wrapper`` with DistributedDataParallel over gloo, injects the
``--faults`` schedule (an exception, a hang in a C call, a SIGKILL by default), and ends with a
table of how each fault was detected and recovered, ``summary.json`` and ``timeline.png`` in
``--output-dir``.

Exit status: 0 (PASS) when every planned fault was recovered, no unplanned restart happened, the
checkpoints committed (no failed save) and the test accuracy reached 0.95; 1 otherwise, with
each problem listed (also when the global ``--timeout`` expired); 2 for bad arguments or an
unusable ``--output-dir``
(not a directory, not writable, or a non-empty directory the demo did not make: the demo only
clears directories carrying its ``.trainguard-demo`` marker); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from trainguard.errors import ConfigError

__all__ = ["register"]

_DESCRIPTION = (
    "Spawn active and reserve rank processes that train a classifier on scikit-learn's digits "
    "with DistributedDataParallel over gloo under trainguard.inprocess.Wrapper, inject a fault "
    "schedule, and report how each fault was detected and recovered (table, summary.json, "
    "timeline.png). Exit status: 0 (PASS) when every planned fault was recovered, no unplanned "
    "restart happened, checkpoints committed and test accuracy reached 0.95; 1 otherwise (the "
    "problems are listed), 2 for bad arguments or an unusable --output-dir (the demo only "
    "clears an empty "
    "directory or one it made, marked by a .trainguard-demo file)."
)
_DEFAULTS = {"ranks": 4, "reserve_ranks": 1, "steps": 160, "checkpoint_every": 10}


_KIND_NAMES = {int: "an integer", float: "a number"}


def _positive(kind: type, minimum: float):
    """argparse type: ``kind`` >= ``minimum``; every float flag of the demo is in seconds."""
    unit = " seconds" if kind is float else ""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {_KIND_NAMES[kind]}{unit and ' of' + unit}") from None
        if not value >= minimum:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}{unit} (got {text!r})")
        return value

    return parse


def _room_s() -> float:
    from trainguard._demo._goodput import GoodputConfig

    return GoodputConfig().recovery_room_s


def _faults(text: str):
    from trainguard._demo._schedule import parse_faults

    try:
        return parse_faults(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> list[str]:
    """Add the ``demo`` sub-command; returns the names added."""
    from trainguard._demo._schedule import DEFAULT_FAULTS, FAULT_KINDS
    from trainguard._demo._under_launcher import DEFAULT_LAUNCHER_FAULTS

    kinds = "; ".join(f"{k}: {v}" for k, v in FAULT_KINDS.items())
    p = subparsers.add_parser(
        "demo",
        help="train on digits under in-process restart while faults are injected",
        description=_DESCRIPTION,
    )
    p.add_argument(
        "--ranks",
        metavar="N",
        type=_positive(int, 1),
        default=_DEFAULTS["ranks"],
        help="active ranks (default 4)",
    )
    p.add_argument(
        "--reserve-ranks",
        metavar="N",
        type=_positive(int, 0),
        default=_DEFAULTS["reserve_ranks"],
        help="idle spare ranks that replace removed ones (default 1)",
    )
    p.add_argument(
        "--faults",
        metavar="SCHEDULE",
        type=_faults,
        default=None,
        help=f"comma-separated KIND@rankR:stepS, or 'none' (default {DEFAULT_FAULTS!r}; with "
        f"--launcher {DEFAULT_LAUNCHER_FAULTS!r}); R is the initial rank; {kinds}",
    )
    p.add_argument(
        "--launcher",
        action="store_true",
        help="run the ranks under 'trainguard launch': exceptions and hangs restart in-process, "
        "a dead process restarts the whole job in-job (from the newest checkpoint, at full "
        "world size); PASS needs one launcher cycle per SIGKILL and the full world at the end",
    )
    p.add_argument(
        "--seed",
        metavar="N",
        type=_positive(int, 0),
        default=0,
        help="data split, init and sampling seed (default 0)",
    )
    p.add_argument(
        "--output-dir",
        metavar="DIR",
        default="trainguard-demo",
        help="where summary.json, timeline.png, logs and checkpoints go; must be new, empty "
        "or made by an earlier demo run (default ./trainguard-demo)",
    )
    p.add_argument(
        "--steps",
        metavar="N",
        type=_positive(int, 1),
        default=_DEFAULTS["steps"],
        help="global training steps (default 160)",
    )
    p.add_argument(
        "--checkpoint-every",
        metavar="N",
        type=_positive(int, 1),
        default=_DEFAULTS["checkpoint_every"],
        help="steps between checkpoints (default 10)",
    )
    p.add_argument(
        "--batch-size",
        metavar="N",
        type=_positive(int, 1),
        default=32,
        help="samples per active rank per step (default 32)",
    )
    p.add_argument(
        "--soft-timeout",
        metavar="S",
        type=_positive(float, 0.5),
        default=3.0,
        help="seconds without progress before a hung rank is interrupted (default 3)",
    )
    p.add_argument(
        "--hard-timeout",
        metavar="S",
        type=_positive(float, 1.0),
        default=8.0,
        help="seconds without progress before a hung rank is killed (default 8)",
    )
    p.add_argument("--duration", metavar="S", type=_positive(float, 20.0), default=None,
                   help="instead of the digits run: train a DDP job for S seconds with a fault "
                   "every 30 s from a seeded mix (exception, SIGKILL, hangs, full disk) and print "
                   "its goodput, the figure bench/goodput.py reports (e.g. --duration 180)")
    p.add_argument("--fault-every", metavar="S", type=_positive(float, 5.0), default=30.0,
                   help="with --duration: seconds between faults (default 30, as the benchmark), "
                   "on wall time from the first training step: faults at S, 2S, 3S, ... s, i.e. "
                   "floor(D/S) faults over --duration D, less the last one when it leaves under "
                   f"{_room_s():g} s (hard timeout + restart) to recover before the end "
                   "(--duration 30 --fault-every 8: faults at 8, 16, 24 s); a live status line "
                   "shows step, faults injected/recovered, the committed checkpoint and goodput")
    p.add_argument(
        "--timeout",
        metavar="S",
        type=_positive(float, 10.0),
        default=170.0,
        help="global limit for the whole run, seconds (default 170)",
    )
    p.set_defaults(func=_run, _parser=p)
    return ["demo"]


def _config(args: argparse.Namespace):
    from trainguard._demo._config import DemoConfig
    from trainguard._demo._schedule import validate_faults

    if args.soft_timeout >= args.hard_timeout:
        raise ConfigError(
            f"--soft-timeout ({args.soft_timeout}) must be below "
            f"--hard-timeout ({args.hard_timeout})"
        )
    if args.faults is None:
        from trainguard._demo._schedule import DEFAULT_FAULTS, parse_faults
        from trainguard._demo._under_launcher import DEFAULT_LAUNCHER_FAULTS

        args.faults = parse_faults(DEFAULT_LAUNCHER_FAULTS if args.launcher else DEFAULT_FAULTS)
    validate_faults(args.faults, ranks=args.ranks, reserve=args.reserve_ranks, steps=args.steps)
    return DemoConfig(
        output_dir=str(Path(args.output_dir).resolve()),
        ranks=args.ranks,
        reserve=args.reserve_ranks,
        steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        batch_size=args.batch_size,
        seed=args.seed,
        faults=tuple(args.faults),
        soft_timeout_s=args.soft_timeout,
        hard_timeout_s=args.hard_timeout,
    )


def _run(args: argparse.Namespace) -> int:
    if args.duration is not None:
        return _run_goodput(args)
    try:
        config = _config(args)
    except ConfigError as exc:
        args._parser.error(str(exc))  # exits with status 2
    from rich.console import Console

    from trainguard._demo._launch import launch

    started = time.monotonic()
    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for the table on one line a row
        console = Console(width=max(console.width, 160))
    try:
        sizes, config_path = _prepare(config)
    except ConfigError as exc:  # no usage text: the arguments parsed, the directory is the problem
        args._parser.exit(2, f"{args._parser.prog}: error: {exc}\n")
    faults = ", ".join(f.label for f in config.faults) or "none"
    console.print(
        f"[bold]trainguard demo[/]: {config.ranks} active + {config.reserve} reserve ranks, "
        f"{config.steps} steps, digits ({sizes['train']} train / {sizes['test']} test), "
        f"faults: {faults}"
    )
    if args.launcher:
        from trainguard._demo._under_launcher import run_under_launcher

        return run_under_launcher(config, config_path, timeout_s=args.timeout, console=console)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        result = launch(config, config_path, timeout_s=args.timeout, console=console)
    except (KeyboardInterrupt, _Terminated) as exc:
        console.print("[bold red]interrupted; every rank was stopped")
        return 143 if isinstance(exc, _Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _finish(config, result, console, wall_s=time.monotonic() - started)


def _prepare(config) -> tuple[dict[str, int], Path]:
    """Clear and mark the output dir, write the data split and the config.

    Raises:
        ConfigError: the output dir cannot be used (see ``clear_run_files``) or scikit-learn is
            missing.
    """
    from trainguard._demo._config import OutputDirError, clear_run_files, os_reason
    from trainguard._demo._data import prepare_split

    clear_run_files(config.root)
    try:
        return prepare_split(config.data_path, config.seed), config.save()
    except OSError as exc:  # e.g. the disk is full
        raise OutputDirError(
            f"cannot use output dir '{config.root}': {os_reason(exc, config.root)}"
        ) from exc


def _run_goodput(args: argparse.Namespace) -> int:
    """``--duration``: the goodput run of ``bench/goodput.py``, trainguard mode only."""
    from rich.console import Console
    from rich.table import Table

    from trainguard._demo._config import OutputDirError, clear_run_files
    from trainguard._demo._goodput import GoodputConfig, median_lost, run_modes
    from trainguard._demo._goodput_progress import GoodputProgress

    root = Path(args.output_dir).resolve()
    try:
        clear_run_files(root)
    except OutputDirError as exc:
        args._parser.exit(2, f"{args._parser.prog}: error: {exc}\n")
    cfg = GoodputConfig(duration_s=args.duration, ranks=args.ranks, seed=args.seed,
                        fault_every_s=args.fault_every)
    console = Console()
    console.print(f"[bold]trainguard demo --duration {args.duration:.0f}[/]: {cfg.ranks} ranks "
                  f"train for {args.duration:.0f} s, a fault every {cfg.fault_every_s:.0f} s")
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with GoodputProgress(console, cfg.duration_s) as progress:
            plan, runs, tmpfs, _ = run_modes(cfg, str(root / "goodput"), ("ours",), progress)
    except (KeyboardInterrupt, _Terminated) as exc:
        console.print("[bold red]interrupted; every rank was stopped")
        return 143 if isinstance(exc, _Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    run = runs["ours"]
    table = Table(title="goodput under faults")
    for name in ("fault", "seconds lost", "recovered"):
        table.add_column(name)
    for row in run.figures["faults"]:
        lost = "-" if row["lost_s"] is None else f"{row['lost_s']:.2f}"
        table.add_row(f"{row['kind']} at {row['t']:.0f} s, rank {row['rank']}", lost,
                      "yes" if row["recovered"] else "NO")
    console.print(table)
    lost_med = median_lost(run.figures)
    console.print(
        f"goodput {run.figures['goodput']:.3f} ({run.figures['kept_steps']} steps of "
        f"{run.figures['median_step_ms']:.0f} ms in {run.figures['window_s']:.1f} s; "
        + ("no fault fired" if lost_med is None else f"median {lost_med} s lost per fault") + ")"
        + ("" if tmpfs else "; full disk left out (needs root for a tmpfs)"))
    (root / "goodput.json").write_text(json.dumps(
        {"plan": plan, "figures": run.figures, "exit_codes": run.exit_codes}, indent=2))
    console.print(f"report: {root / 'goodput.json'}", soft_wrap=True)
    problems = goodput_problems(run.figures, run.ok, run.exit_codes)
    if not problems:
        console.print("[bold green]PASS")
        return 0
    console.print(f"[bold red]FAIL[/]: {len(problems)} problem(s); logs in {root / 'goodput'}",
                  soft_wrap=True)
    for problem in problems:
        console.print(f"  - {problem}", highlight=False, markup=False, soft_wrap=True)
    return 1


def goodput_problems(fig: dict, processes_ok: bool, exit_codes: list[int | None]) -> list[str]:
    """What fails a ``--duration`` run: each planned fault that did not fire or was not
    recovered (the job never again completed the step it was at; for a full disk, no checkpoint
    committed after it), and rank processes that failed or outlived the run's limit."""
    problems = []
    for row in fig["faults"]:
        if not row["recovered"]:
            why = "not recovered" if row["fired"] else "not recovered (it never fired)"
            problems.append(f"{row['kind']} at {row['t']:.0f} s on rank {row['rank']}: {why}")
    if not processes_ok:
        problems.append(f"no rank process finished cleanly, or the run timed out "
                        f"(exit codes {exit_codes})")
    return problems


class _Terminated(BaseException):
    """SIGTERM reached the demo: unwind so the launcher stops and reaps every rank."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _finish(config, result, console, wall_s: float) -> int:
    from trainguard._demo._events import read_events
    from trainguard._demo._report import build_summary, render_table
    from trainguard._demo._timeline import plot_timeline

    events = read_events(config.root / "events")
    summary = build_summary(
        events,
        list(config.faults),
        steps=config.steps,
        wall_s=wall_s,
        exits=result.exits,
        timed_out=result.timed_out,
        checkpoint_every=config.checkpoint_every,
    )
    summary["helpers_killed_by_parent"] = result.leftover
    summary["ranks_exited_s"] = round(result.ranks_s, 3)
    summary["launch_time"] = result.t0
    png = config.root / "timeline.png"
    acc = "n/a" if summary["accuracy"] is None else f"{summary['accuracy']:.4f}"
    title = (
        f"trainguard demo: {config.ranks} active + {config.reserve} reserve ranks, accuracy {acc}"
    )
    summary["timeline"] = str(png)
    try:
        plot_timeline(events, png, result.t0, title=title)
        (config.root / "summary.json").write_text(json.dumps(summary, indent=2))
    except OSError as exc:  # e.g. the output disk is full: report it, never a traceback
        summary["problems"].append(f"cannot write the run's outputs to {config.root}: "
                                   f"{exc.strerror or exc}")
        summary["ok"] = False
    console.print(render_table(summary, width=console.width))
    console.print(
        f"summary: {config.root / 'summary.json'}  timeline: {png}  logs: {config.root / 'logs'}"
    )
    return 0 if summary["ok"] else 1
