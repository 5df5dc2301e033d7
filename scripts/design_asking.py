"""Where does asking pay? Scripted players on a design seed, before any training.

For each setting (game view, table size, action limit, partner) it plays the strongest
non-asking policy (``proposer``) and every asking scripted policy on the same scenarios of the
dev split under a design eval seed (never the test split), and prints, per setting: each
policy's mean reward, the best asking policy's paired difference over ``proposer`` with a 95%
t-interval, and per scenario where asking pays (the best asker above ``proposer``), costs, or
changes nothing. A setting for a learning experiment is one whose interval is above zero and
where asking pays in some scenarios but not all (so that a model can learn *when* to ask).

    python scripts/design_asking.py --seed 101 --games 96
    python scripts/design_asking.py --games 96 --json docs/experiments/asking-design.json
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from selfplay.evaluate.scripted import play_scripted
from selfplay.game import get_game

ASKERS = ("inquisitive", "advised-asker", "advised-late-asker", "asker")
app = typer.Typer(add_completion=False)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Mean of a - b and its 95% t-interval (pairs by index)."""
    from scipy import stats

    d = a - b
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else 0
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def design_row(game: str, n: int, max_actions: int, partner: str, seed: int, games: int) -> dict:
    """One setting's scripted rewards, paired difference and per-scenario value of asking."""
    g = get_game(game)
    rewards = {}
    for name in ("proposer", *ASKERS):
        records = play_scripted(
            g, (name, partner), num_games=games, seed=seed, n=n, max_actions=max_actions
        )
        rewards[name] = np.array([r.reward for r in records])
    best = max(ASKERS, key=lambda a: rewards[a].mean())
    mean, low, high = paired(rewards[best], rewards["proposer"])
    gain = rewards[best] - rewards["proposer"]
    return {
        "game": game,
        "n": n,
        "max_actions": max_actions,
        "partner": partner,
        "seed": seed,
        "games": games,
        "rewards": {k: float(v.mean()) for k, v in rewards.items()},
        "best_asker": best,
        "best_minus_proposer": [mean, low, high],
        "scenarios_asking_pays": int((gain > 1e-9).sum()),
        "scenarios_asking_costs": int((gain < -1e-9).sum()),
    }


@app.command()
def main(
    seed: int = typer.Option(101, help="Design eval seed (dev split; not the run's eval seed)."),
    games: int = typer.Option(96, min=2, help="Scenarios per setting."),
    views: str = typer.Option("matching,matching-cap2", help="Games, comma-separated."),
    sizes: str = typer.Option("3,4", help="Table sizes, comma-separated."),
    actions: str = typer.Option("20,30", help="Action limits, comma-separated."),
    partners: str = typer.Option("shy,shy-strict", help="Partners, comma-separated."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the rows as JSON."),
) -> None:
    """Print the design table: every setting's scripted rewards and the value of asking."""
    split = [v.split(",") for v in (views, sizes, actions, partners)]
    table = Table(title=f"Where asking pays: design seed {seed} (dev split), {games} scenarios")
    for col in ("game", "n", "actions", "partner", "proposer", "best asker", "best - proposer"):
        table.add_column(col)
    table.add_column("pays / costs / same")
    rows = []
    for game, n, a, partner in itertools.product(*split):
        row = design_row(game, int(n), int(a), partner, seed, games)
        rows.append(row)
        mean, low, high = row["best_minus_proposer"]
        pays, costs = row["scenarios_asking_pays"], row["scenarios_asking_costs"]
        best = row["best_asker"]
        table.add_row(
            game,
            n,
            a,
            partner,
            f"{row['rewards']['proposer']:.3f}",
            f"{best} {row['rewards'][best]:.3f}",
            f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]",
            f"{pays} / {costs} / {games - pays - costs}",
        )
    Console(width=160).print(table)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    app()
