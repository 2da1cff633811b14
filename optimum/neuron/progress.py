"""A small rich progress display for long operations (export, conversion, benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class StepProgress:
    """An overall bar plus one line per step, each with its elapsed time."""

    def __init__(self, title: str, total: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.overall = self.progress.add_task(title, total=total)
        self.timings: dict[str, float] = {}

    def __enter__(self) -> StepProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time one step, shown as its own line while it runs and with its duration afterwards."""
        line = self.line(name)
        yield
        line.finish()

    def line(self, name: str) -> Line:
        """A line for a step that runs beside others (a graph compiled by another process): shown from now, finished
        by `Line.finish`."""
        return Line(self, name)


class Line:
    """One step's line of a `StepProgress`."""

    def __init__(self, owner: StepProgress, name: str) -> None:
        self.owner, self.name = owner, name
        self.task = owner.progress.add_task(f"  {name}", total=1)
        self.start = time.perf_counter()

    def update(self, note: str) -> None:
        """Show ``note`` beside the running step's name (how far it is)."""
        self.owner.progress.update(self.task, description=f"  {self.name} [dim]({note})[/dim]")

    def finish(self, note: str = "") -> None:
        """Mark the step done: its line shows ``note`` (or the elapsed time) and the overall bar advances."""
        elapsed = time.perf_counter() - self.start
        self.owner.timings[self.name] = elapsed
        text = note or f"{elapsed:.1f}s"
        self.owner.progress.update(self.task, completed=1, description=f"  {self.name} [dim]({text})[/dim]")
        self.owner.progress.advance(self.owner.overall)
