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
        task = self.progress.add_task(f"  {name}", total=1)
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self.timings[name] = elapsed
        self.progress.update(task, completed=1, description=f"  {name} [dim]({elapsed:.1f}s)[/dim]")
        self.progress.advance(self.overall)
