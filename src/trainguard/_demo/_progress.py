"""The parent's live view of a demo run, fed by the ranks' events (see ``_events``).

On a terminal it is a rich ``Live`` display (a progress bar of global steps, which moves back
when a restart rolls back to the last checkpoint, plus one status line per rank); elsewhere it
prints one plain line per notable event, so CI logs stay readable.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainguard._core.procs import describe_exit

__all__ = ["RunView"]


class RunView:
    """Tracks per-rank status from events and renders it.

    Args:
        console: where to print.
        steps: total global steps; faults: number of scheduled faults; world_size: processes.
    """

    def __init__(self, console: Console, steps: int, faults: int, world_size: int) -> None:
        self.console = console
        self.faults_total = faults
        self.faults_fired = 0
        self.restarts: set[int] = set()
        self.status = {r: "launching" for r in range(world_size)}
        self.step = {r: 0 for r in range(world_size)}
        self.iteration = 0
        self.progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
            TimeElapsedColumn(), TextColumn("{task.description}"), console=console,
        )
        self.task = self.progress.add_task("", total=steps)

    def _note(self, message: str, live: bool) -> None:
        if not live:
            self.console.print(message, highlight=False)

    def feed(self, events: list[dict], live: bool) -> None:
        """Update from new events; without a live display, print notable ones.

        Events are handled in time order, not file order: one poll may bring a restart logged
        by rank 0 together with the fault that caused it, logged earlier by rank 1.
        """
        for e in sorted(events, key=lambda e: float(e.get("t", 0.0))):
            rank, ev = e["rank"], e["ev"]
            if ev == "start":
                self.status[rank] = "started; waiting for the wrapper (reserve ranks idle here)"
            elif ev == "enter":
                self.iteration = max(self.iteration, e["iteration"])
                self.status[rank] = (
                    f"training: active rank {e['active_rank']}/{e['active_world_size']}, "
                    f"iteration {e['iteration']}, resumed at step {e['resume_step']}"
                )
                self.step[rank] = e["resume_step"]
                if e["active_rank"] == 0:
                    self._note(
                        f"iteration {e['iteration']}: {e['active_world_size']} active ranks, "
                        f"resuming after step {e['resume_step']}",
                        live,
                    )
            elif ev == "step":
                self.step[rank] = e["step"]
            elif ev == "fault":
                self.faults_fired += 1
                self.status[rank] = f"FAULT injected: {e['kind']} at step {e['step']}"
                self._note(f"rank {rank}: injected {e['kind']} at step {e['step']}", live)
            elif ev == "restart" and e.get("into_iteration") not in self.restarts:
                self.restarts.add(int(e.get("into_iteration", -1)))
                self._note(
                    f"restart into iteration {e.get('into_iteration')} "
                    f"(cause: {e.get('cause')}, ranks {e.get('fault_ranks')})",
                    live,
                )
            elif ev == "done":
                self.status[rank] = f"done, test accuracy {e['accuracy']:.4f}"
            elif ev == "exit" and e.get("status") == "error":
                self.status[rank] = f"left the job: {e.get('error')}"
            elif ev == "exit" and e.get("status") == "reserve":
                self.status[rank] = "finished in reserve (not needed)"
        self._refresh()

    def process_exited(self, rank: int, returncode: int, live: bool) -> None:
        text = describe_exit(returncode)
        if returncode != 0 or not self.status[rank].startswith(("done", "finished")):
            self.status[rank] = f"process ended ({text}); last: " + self.status[rank]
        self._note(f"rank {rank}: process ended ({text})", live)

    def _refresh(self) -> None:
        active = [
            s for r, s in self.step.items() if self.status[r].startswith(("training", "FAULT"))
        ]
        completed = max(active or self.step.values() or [0])
        self.progress.update(
            self.task,
            completed=completed,
            description=f"iteration {self.iteration} · "
            f"faults {self.faults_fired}/{self.faults_total}"
            f" · restarts {len(self.restarts)}",
        )

    def renderable(self) -> Any:
        table = Table.grid(padding=(0, 2))
        for rank, status in sorted(self.status.items()):
            table.add_row(f"rank {rank}", f"step {self.step[rank]:>4}", status)
        return Group(self.progress, table)
