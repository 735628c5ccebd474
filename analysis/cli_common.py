"""Shared pieces of the command line: the typer app, the console, progress bars."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="trainsim: trace-driven performance modeling of distributed training.")
# Wide enough for the result tables when output goes to a file or a CI log (not a terminal).
console = Console(width=None if sys.stdout.isatty() else 150)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)
