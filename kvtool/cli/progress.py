"""Progress on stderr for the long commands (calibrate, eval, inspect gini, a calibration announced
by generate/bench): one bar per stage, each created when its stage first reports."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class StageBars:
    """Rich progress bars on stderr, one per calibration stage, each created when its stage first
    reports. The display starts with the first report, so an early error prints nothing else.

    The bars are redrawn from the reports, at most every REDRAW_SECONDS, not by rich's refresh
    thread: that thread redraws ten times a second and takes the interpreter lock from the one-token
    loops it reports on, which slows calibration's one-token forwards."""

    REDRAW_SECONDS = 0.5

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<19}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,
        )
        self._tasks: dict[str, TaskID] = {}
        self._started = False
        self._drawn = 0.0

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self._started:
            self._progress.start()
            self._started = True
        if stage not in self._tasks:
            self._tasks[stage] = self._progress.add_task(stage, total=max(total, 1))
        self._progress.update(self._tasks[stage], completed=min(done, total), total=max(total, 1))
        now = time.monotonic()
        if done >= total or now - self._drawn >= self.REDRAW_SECONDS:
            self._progress.refresh()
            self._drawn = now

    def __enter__(self) -> "StageBars":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started:
            self._progress.stop()
