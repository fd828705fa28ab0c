"""The demo's timeline picture (PNG, matplotlib Agg): steps, faults and restarts per rank.

Top panel: global step against time, one line per rank and iteration, so the roll-back to the
last checkpoint after each restart is visible. Bottom panel: one lane per initial rank showing
start-up/reserve time, training per iteration, faults and the process's end. Restarts (detection
to the last rank's re-entry) are shaded in both panels.
"""

from __future__ import annotations

import os
from collections import defaultdict

from trainguard._demo._report import restart_groups

__all__ = ["plot_timeline"]

_FAULT_STYLE = {
    "exception": ("X", "tab:red"),
    "hang": ("P", "tab:purple"),
    "sigkill": ("v", "black"),
}


def _series(events: dict[int, list[dict]], t0: float):
    """Per rank and iteration: lists of (time, step)."""
    out: dict[int, dict[int, list[tuple[float, int]]]] = defaultdict(lambda: defaultdict(list))
    for rank, evs in events.items():
        for e in evs:
            if e.get("ev") == "step":
                out[rank][e["iteration"]].append((e["t"] - t0, e["step"]))
    return out


def _shade_restarts(axes, events: dict[int, list[dict]], t0: float) -> None:
    for group in restart_groups(events).values():
        start, end = group["detection_time"], group["reentry_time"]
        if start is None or end is None:
            continue
        for ax in axes:
            ax.axvspan(start - t0, end - t0, color="orange", alpha=0.3, lw=0)
        axes[0].annotate(
            f"restart→it{group['into_iteration']}",
            (end - t0, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            ha="left",
            va="top",
            rotation=90,
            color="darkorange",
        )


def _bar(ax, rank: int, start: float, end: float, **style) -> None:
    ax.broken_barh([(start, max(end - start, 0.01))], (rank - 0.35, 0.7), **style)


def _lane(
    ax, rank: int, evs: list[dict], per_it: dict, colors: dict, restarts: dict, t0: float
) -> None:
    start = next((e["t"] - t0 for e in evs if e["ev"] == "start"), 0.0)
    enter = next((e["t_fn"] - t0 for e in evs if e["ev"] == "enter" and "t_fn" in e), None)
    last = max((e["t"] - t0 for e in evs), default=start)
    _bar(ax, rank, start, enter if enter is not None else last, color="0.85")
    for e in evs:
        if e["ev"] == "enter" and e["iteration"] in per_it and "t_fn" in e:  # set-up + reload
            _bar(
                ax,
                rank,
                e["t_fn"] - t0,
                per_it[e["iteration"]][0][0],
                color=colors[e["iteration"]],
                alpha=0.35,
            )
    for it, points in sorted(per_it.items()):
        _bar(ax, rank, points[0][0], points[-1][0], color=colors[it])
    for e in evs:
        if e["ev"] == "fault":
            marker, color = _FAULT_STYLE.get(e["kind"], ("o", "red"))
            group = restarts.get(e["iteration"] + 1)
            if e["kind"] == "hang" and group and group["detection_time"]:
                _bar(
                    ax,
                    rank,
                    e["t"] - t0,
                    group["detection_time"] - t0,
                    facecolor="none",
                    edgecolor=color,
                    hatch="///",
                )
            ax.plot(e["t"] - t0, rank, marker=marker, color=color, ms=11, mec="white")
            ax.annotate(
                e["kind"],
                (e["t"] - t0, rank + 0.38),
                fontsize=8,
                ha="center",
                va="top",
                color=color,
            )
        elif e["ev"] == "exit":
            ax.plot(e["t"] - t0, rank, marker="|", color="black", ms=14)


def _lanes(ax, events: dict[int, list[dict]], series, t0: float) -> None:
    colors = _iteration_colors(series)
    restarts = restart_groups(events)
    for rank, evs in sorted(events.items()):
        _lane(ax, rank, evs, series[rank], colors, restarts, t0)
    ax.set_yticks(sorted(events), [f"rank {r}" for r in sorted(events)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since launch")
    ax.set_title(
        "grey: start-up / reserve · pale: process group + checkpoint reload · colour: training "
        "(by iteration) · hatched: hung · |: exit",
        fontsize=9,
    )


def _iteration_colors(series) -> dict[int, tuple]:
    import matplotlib

    iterations = sorted({it for per_rank in series.values() for it in per_rank})
    palette = matplotlib.colormaps["tab10"]
    return {it: palette(i % 10) for i, it in enumerate(iterations)}


def _mark_faults(ax, events: dict[int, list[dict]], t0: float) -> list:
    """Fault markers on the step panel; returns the label annotations.

    The step line reaches a fault's point from the lower left and the next iteration starts to
    its right, so the label goes above and to the left of the point, on a pale box.
    """
    labels = []
    for evs in events.values():
        for e in evs:
            if e["ev"] != "fault":
                continue
            marker, color = _FAULT_STYLE.get(e["kind"], ("o", "red"))
            point = (e["t"] - t0, e["step"] - 1)
            ax.plot(*point, marker=marker, color=color, ms=11, mec="white", zorder=4)
            labels.append(
                ax.annotate(
                    f"{e['kind']} @rank{e['rank']}",
                    point,
                    xytext=(-7, 7),
                    textcoords="offset points",
                    ha="right",
                    va="bottom",
                    fontsize=8,
                    color=color,
                    zorder=5,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
                )
            )
    return labels


def _draw(events: dict[int, list[dict]], t0: float, title: str = ""):
    """The timeline figure (matplotlib ``Figure``, Agg); the caller saves and closes it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    series = _series(events, t0)
    colors = _iteration_colors(series)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for rank, per_it in sorted(series.items()):
        for it, points in sorted(per_it.items()):
            xs, ys = zip(*points)
            top.plot(
                xs,
                ys,
                color=colors[it],
                lw=1.5,
                alpha=0.8,
                label=f"iteration {it}" if rank == min(series) else None,
            )
    _mark_faults(top, events, t0)
    for evs in events.values():
        for e in evs:
            if e["ev"] == "checkpoint":
                top.plot(e["t"] - t0, e["step"], marker="^", color="0.4", ms=4)
    top.set_ylabel("global step (▲ = checkpoint)")
    top.set_title(title or "trainguard demo timeline", fontsize=11)
    top.legend(loc="upper left", fontsize=8)
    top.grid(alpha=0.3)
    _lanes(bottom, events, series, t0)
    _shade_restarts((top, bottom), events, t0)
    starts = [e["t"] - t0 for evs in events.values() for e in evs if e["ev"] == "start"]
    if starts:  # the time before is interpreter + torch import; say so instead of drawing it
        bottom.set_xlim(left=min(starts) - 0.5)
        bottom.annotate(
            f"ranks started {min(starts):.1f}-{max(starts):.1f} s after launch (imports)",
            (0.005, -0.2),
            xycoords="axes fraction",
            fontsize=8,
            color="0.4",
        )
    fig.tight_layout()
    return fig


def plot_timeline(
    events: dict[int, list[dict]], path: str | os.PathLike, t0: float, title: str = ""
) -> str:
    """Draw the run in ``events`` to ``path`` (PNG); ``t0`` is the launch time (wall-clock s)."""
    from matplotlib import pyplot as plt

    fig = _draw(events, t0, title)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return os.fspath(path)
