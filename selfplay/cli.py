"""The `selfplay` command line: one thin typer function per command.

This is the only module that sees the whole configuration; each command validates its options
into its stage's config and calls the library. Library errors become one clear message and exit 1.
"""

from __future__ import annotations

import logging

import typer
from rich.console import Console

app = typer.Typer(
    help="Self-play RL for language models on the DialOp matching game.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def fail(message: str) -> typer.Exit:
    """Print one clear error line and return the exit to raise."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(1)


# --- commands are added below, one function each -------------------------------------------
