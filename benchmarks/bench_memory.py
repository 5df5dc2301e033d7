"""Benchmark generate's memory over thousands of games: resident memory every 100 games.

Plays N games of the tiny test model (a random Qwen2 built offline, so no download) through
`selfplay generate`'s own runner on the hf engine, many in flight, and prints the process's
resident memory (RSS) after every 100 finished games, then the mean RSS over the first and the
last half of the run and their ratio. A generate whose memory grows with the games it has
played (records, statistics or KV kept per game) shows a ratio above 1; flat is about 1.0.

    .venv/bin/python benchmarks/bench_memory.py                     # 2,000 games, 128 in flight
    .venv/bin/python benchmarks/bench_memory.py --games 500 --concurrency 32 --prefix-cache 0
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from selfplay.engines import HFEngineConfig
from selfplay.game.matching.prompts import tokenizer_corpus
from selfplay.generate.config import GenerateConfig
from selfplay.generate.runner import run_generate
from selfplay.models import build_tiny_model

app = typer.Typer(add_completion=False)


def rss_mb() -> float:
    """This process's resident memory now, in MiB (/proc/self/status, Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


class RssEvery:
    """A generate progress hook that samples RSS every ``every`` finished games."""

    def __init__(self, every: int) -> None:
        self.every, self.rows, self.t0 = every, [], time.perf_counter()

    def start(self, stats) -> None:
        self.t0 = time.perf_counter()

    def update(self, stats) -> None:
        if (
            stats.done
            and stats.done % self.every == 0
            and len(self.rows) < stats.done // self.every
        ):
            self.rows.append((stats.done, rss_mb(), time.perf_counter() - self.t0))

    def stop(self, stats) -> None:
        self.update(stats)


def measure(games: int, concurrency: int, prefix_cache: int | None, every: int = 100):
    """RSS samples (games done, MiB, seconds) of one generate of ``games`` tiny-model games."""
    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(Path(d) / "tiny", corpus=tokenizer_corpus())
        cfg = GenerateConfig(
            out=Path(d) / "g",
            num_games=games,
            model=str(model),
            games_per_scenario=4,
            table_size=3,
            max_actions=8,
            concurrency=concurrency,
            sampling={"temperature": 1.0, "max_new_tokens": 24},
        )
        engine = HFEngineConfig(model=str(model), device="cpu", prefix_cache_tokens=prefix_cache)
        hook = RssEvery(every)
        run_generate(cfg, engine, hook)
        return hook.rows


def halves(rows: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Mean RSS over the samples of the first half of the games and of the second half."""
    total = rows[-1][0]
    first = [r for done, r, _ in rows if done <= total // 2]
    last = [r for done, r, _ in rows if done > total // 2]
    return sum(first) / len(first), sum(last) / len(last)


@app.command()
def main(
    games: int = typer.Option(2000, min=200, help="Games to play."),
    concurrency: int = typer.Option(128, min=1, help="Games in flight."),
    prefix_cache: int | None = typer.Option(
        0, help="hf prefix cache tokens (0: off, as the review measured; empty: the default)."
    ),
) -> None:
    rows = measure(games, concurrency, prefix_cache)
    table = Table(title=f"generate RSS: {games} tiny-model games, {concurrency} in flight")
    for col in ("games", "RSS MiB", "seconds"):
        table.add_column(col, justify="right")
    for done, mb, s in rows:
        table.add_row(str(done), f"{mb:.0f}", f"{s:.0f}")
    first, last = halves(rows)
    console = Console()
    console.print(table)
    console.print(
        f"mean RSS, first half {first:.0f} MiB, second half {last:.0f} MiB: ratio "
        f"{last / first:.3f} (flat: within 1.10)"
    )


if __name__ == "__main__":
    app()
