"""eval.md and PNG plots of an ``EvalResult``: the table, a bar chart with intervals, cross-play.

``write_eval_report(result, out)`` writes, beside eval.json:

- ``reward.png``: mean normalised reward per row with its 95% interval (models, baselines, humans);
- ``cross_play.png``: the cross-play heat map (seat 1 by row, seat 2 by column), when there is one;
- ``eval.md``: the settings, the table, the cross-play matrix and gaps, errors, and the plots.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt

from selfplay.evaluate.config import CrossPlay, EvalResult, EvalRow
from selfplay.fileio import atomic_write, refuse_link
from selfplay.players.partners import stored_partner

COLORS = {"model": "tab:blue", "baseline": "tab:gray", "human": "tab:green"}


def save_figure(fig, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it (pyplot keeps open figures alive)."""
    try:
        fig.tight_layout()
        fig.savefig(refuse_link(path))  # matplotlib would write through a link planted there
    finally:
        plt.close(fig)
    return path


def table_rows(result: EvalResult) -> list[EvalRow]:
    """The rows of the main table: models, baselines, humans (cross-play pairs have their own)."""
    return [r for r in result.rows if r.kind != "cross"]


def _f(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def reward_cell(r: EvalRow) -> str:
    if r.error:
        return "error"
    if r.reward_ci_low is None or r.reward_ci_high is None:
        return _f(r.reward_mean)
    return f"{_f(r.reward_mean)} [{_f(r.reward_ci_low)}, {_f(r.reward_ci_high)}]"


COLUMNS = (
    "row",
    "seats (1 + 2)",
    "games",
    "reward [95% CI]",
    "agreement",
    "actions",
    "words",
    "invalid rate",
    "same first proposal",
    "stated values true",
    "questions/game",
)


def row_cells(r: EvalRow) -> list[str]:
    return [
        f"{r.name} ({r.kind})",
        f"{r.seat0} + {r.seat1}",
        str(r.games),
        reward_cell(r),
        _f(r.agreement_rate),
        _f(r.mean_actions, 1),
        _f(r.mean_words, 1),
        _f(r.invalid_action_rate),
        _f(r.same_proposal_share, 2),
        _f(r.stated_value_accuracy, 2),
        _f(r.questions_per_game, 2),
    ]


def plot_rewards(result: EvalResult, path: Path) -> Path:
    rows = [r for r in table_rows(result) if r.reward_mean is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 2), 3.8), dpi=110)
    x = range(len(rows))
    means = [r.reward_mean for r in rows]
    lo = [
        r.reward_mean - (r.reward_ci_low if r.reward_ci_low is not None else r.reward_mean)
        for r in rows
    ]
    hi = [
        (r.reward_ci_high if r.reward_ci_high is not None else r.reward_mean) - r.reward_mean
        for r in rows
    ]
    ax.bar(x, means, color=[COLORS[r.kind] for r in rows], yerr=[lo, hi], capsize=4)
    ax.set_xticks(list(x), [r.name for r in rows], rotation=30, ha="right")
    ax.set_ylabel("normalised reward")
    ax.set_ylim(0, 1.05)
    cfg = result.config
    ax.set_title(
        f"{cfg.num_scenarios} held-out scenarios, {cfg.table_size}x{cfg.table_size} (95% CI)",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def plot_cross_play(cross: CrossPlay, path: Path) -> Path:
    import numpy as np

    n = len(cross.models)
    m = np.array([[np.nan if v is None else v for v in row] for row in cross.reward], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 * n + 2.5, 1.0 * n + 1.8), dpi=110)
    im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis")
    for i in range(n):
        for j in range(n):
            text = "–" if np.isnan(m[i, j]) else f"{m[i, j]:.2f}"
            ax.text(j, i, text, ha="center", va="center", color="w" if m[i, j] < 0.6 else "k")
    ax.set_xticks(range(n), cross.models, rotation=30, ha="right")
    ax.set_yticks(range(n), cross.models)
    ax.set_xlabel("seat 2")
    ax.set_ylabel("seat 1")
    ax.set_title("cross-play reward (diagonal: self-play)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return save_figure(fig, path)


def markdown(result: EvalResult, plots: dict[str, Path]) -> str:
    cfg = result.config
    s = cfg.sampling
    partner = stored_partner(cfg.partner)  # None: self-play
    lines = [
        "# selfplay eval",
        "",
        f"{cfg.num_scenarios} held-out scenarios of the **{cfg.split} split** "
        f"({cfg.table_size}x{cfg.table_size}, eval seed {cfg.seed}; odd seeds, never a training "
        "scenario), "
        f"{cfg.games_per_scenario} game(s) per scenario, temperature {s.temperature}"
        + (" (greedy)" if s.temperature == 0 else f", top-p {s.top_p}")
        + f", at most {cfg.max_actions} actions. Seat 2: "
        + (f"scripted `{partner}`." if partner else "the same policy (self-play).")
        + f" Models on the {cfg.engine.kind if cfg.engine else 'hf'} engine."
        + f" {result.seconds:.0f} s.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in table_rows(result)]
    lines.append("")
    for r in table_rows(result):
        if r.kind == "model" and r.model and r.model != r.name:
            lines.append(f"- `{r.name}`: {r.model}")
        if r.source:
            lines.append(f"- {r.name}: {r.source}")
    cross = result.cross_play
    if cross is not None:
        lines += [
            "",
            "## Cross-play",
            "",
            "Rows: seat 1, columns: seat 2; the diagonal is self-play.",
            "",
            "| seat 1 \\ seat 2 | " + " | ".join(cross.models) + " |",
            "|" + "---|" * (len(cross.models) + 1),
        ]
        for label, row in zip(cross.models, cross.reward):
            lines.append(f"| {label} | " + " | ".join(_f(v) for v in row) + " |")
        lines += [
            "",
            "| model | self-play | mean cross-play | gap |",
            "|---|---|---|---|",
        ]
        for label in cross.models:
            lines.append(
                f"| {label} | {_f(cross.self_play[label])} | {_f(cross.cross_play_mean[label])} "
                f"| {_f(cross.gap[label])} |"
            )
        lines += [
            "",
            "A gap that widens across rounds means a model drifts into conventions only it "
            "understands.",
        ]
    elif cfg.cross_play:
        lines += ["", "Cross-play was asked for but fewer than two models could be evaluated."]
    if result.errors:
        lines += ["", "## Errors", ""]
        lines += [f"- **{name}**: {msg}" for name, msg in result.errors.items()]
    if plots:
        lines.append("")
        lines += [f"![{name}]({p.name})" for name, p in plots.items()]
    return "\n".join(lines) + "\n"


def write_eval_report(result: EvalResult, out: str | Path) -> dict[str, Path]:
    """Write reward.png, cross_play.png (with cross-play) and eval.md into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}
    if any(r.reward_mean is not None for r in table_rows(result)):
        plots["reward"] = plot_rewards(result, out / "reward.png")
    if result.cross_play is not None:
        plots["cross-play"] = plot_cross_play(result.cross_play, out / "cross_play.png")
    md = out / "eval.md"
    atomic_write(md, markdown(result, plots))
    return {"eval.md": md, **{p.name: p for p in plots.values()}}


def console_table(result: EvalResult, num_scenarios: int):
    """The rows of an evaluation as a rich table (what ``selfplay eval`` prints)."""
    from rich.table import Table

    table = Table(title=f"eval: {num_scenarios} held-out scenarios (seats in eval.md)")
    for col in (
        "row",
        "games",
        "reward",
        "95% CI",
        "agree",
        "actions",
        "words",
        "invalid",
        "q/game",
    ):
        table.add_column(col, justify="left" if col == "row" else "right", overflow="fold")
    for r in table_rows(result):
        cells = row_cells(r)  # name, seats, games, reward [lo, hi], agreement, ...
        reward, _, ci = cells[3].partition(" ")
        ci = ci.replace(", ", ",")
        table.add_row(r.name, cells[2], reward, ci, *cells[4:])
    return table
