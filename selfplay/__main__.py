"""`python -m selfplay` runs the CLI (same as the `selfplay` console script)."""

from selfplay.cli import app

app()
