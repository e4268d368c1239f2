"""The demo's progress bar, drawn by rich: redrawn in place on a terminal; elsewhere (a log file, a
pipe) rich writes only the final line."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def training_progress(total: int, stream):
    """A context giving `update(step, loss)`, which shows `step` of `total` and the loss."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        console=Console(file=stream, highlight=False),
        redirect_stdout=False,  # the report is printed after the bar, never under it
        redirect_stderr=False,
    )
    task = progress.add_task("training", total=total, loss=float("nan"))

    def update(step: int, loss: float) -> None:
        progress.update(task, completed=step, loss=loss)

    with progress:
        yield update
