"""Plots and a markdown summary of a run, from its per-round metrics (data/RUN/metrics.jsonl).

``write_report(run_dir)`` draws reward per round (with its 95% interval, the scripted baselines and
the human reference as lines), agreement, actions, invalid rate and questions per game, and writes
REPORT.md embedding them with the table of rounds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt
import orjson
from pydantic import ValidationError

from selfplay.errors import UserError, first_problem
from selfplay.evaluate.human import comparable, human_label
from selfplay.evaluate.report import save_figure
from selfplay.evaluate.scripted import evaluate_scripted
from selfplay.fileio import atomic_write
from selfplay.game.api import DialogueGame
from selfplay.iterate.test_split import FINAL, MODEL_ROWS, START_ROWS, games_file
from selfplay.manifest import MANIFEST_FILE, Manifest, RunSettings, read_manifest
from selfplay.metrics import HeldOut, RoundMetrics

log = logging.getLogger(__name__)


class ReportError(UserError, ValueError):
    """A run directory without metrics to report."""


def _fmt(x, fmt: str = ".3f") -> str:
    """A table cell: blank for a missing or undefined (NaN) statistic."""
    return "" if x is None or x != x else format(x, fmt)


def read_metrics(run_dir: str | Path) -> list[RoundMetrics]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ReportError(f"{path} does not exist: run `selfplay iterate` for this run first")
    rows = []
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(RoundMetrics.model_validate(orjson.loads(line)))
        except (orjson.JSONDecodeError, ValidationError) as e:
            problem = first_problem(e) if isinstance(e, ValidationError) else f"not JSON: {e}"
            raise ReportError(
                f"{path} has a corrupt line (line {lineno}, {problem}); it is rewritten from the "
                "manifest by re-running the run's `selfplay iterate` command"
            ) from None
    if not rows:
        raise ReportError(f"{path} has no finished round yet")
    return sorted(rows, key=lambda r: r.round)


def baseline_rewards(
    game: DialogueGame, n: int = 8, num_games: int = 50, seed: int = 0
) -> dict[str, float]:
    """Mean reward of each of ``game``'s scripted baselines in self-play on held-out scenarios."""
    return {
        name: evaluate_scripted(
            game, (name, name), num_games=num_games, seed=seed, n=n
        ).summary.reward_mean
        for name in game.baselines
    }


def _line_plot(rows, key, title, ylabel, path, *, ci=None, hlines=None) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    rounds = [r.round for r in rows]
    values = [getattr(r, key) for r in rows]
    ax.plot(rounds, values, marker="o", color="tab:blue", label="model")
    if ci is not None:
        lo = [getattr(r, ci[0]) for r in rows]
        hi = [getattr(r, ci[1]) for r in rows]
        ax.fill_between(rounds, lo, hi, color="tab:blue", alpha=0.2, label="95% CI")
    for i, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle="--", color=f"C{i + 1}", label=f"{label} ({value:.3f})")
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xticks(rounds)
    ax.grid(alpha=0.3)
    if ci is not None or hlines:
        ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def _run_manifest(run_dir: Path) -> Manifest | None:
    """The run's manifest, or None for a folder that has metrics.jsonl alone."""
    path = run_dir / MANIFEST_FILE
    return read_manifest(path) if path.exists() else None


def _heldout_plot(
    rows,
    heldout: dict[int, HeldOut],
    baselines: dict[str, HeldOut],
    path: Path,
    initial: HeldOut | None = None,
) -> Path:
    """Held-out reward of the model after k rounds (k = 0: the starting model) with its 95%
    interval, beside the reward of each round's training games and the scripted baselines on
    the same held-out scenarios."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    ks = sorted(heldout)
    points = [heldout[k] for k in ks]
    if initial is not None:  # the model before the warm start, at x = -1
        ks, points = [-1, *ks], [initial, *points]
    mean = [h.reward_mean for h in points]
    lo = [h.reward_ci_low for h in points]
    hi = [h.reward_ci_high for h in points]
    ax.plot(ks, mean, marker="o", color="tab:blue", label="held-out (greedy)")
    ax.fill_between(ks, lo, hi, color="tab:blue", alpha=0.2, label="held-out 95% CI")
    ax.plot(
        [r.round for r in rows],
        [r.reward_mean for r in rows],
        marker="s",
        color="tab:gray",
        alpha=0.7,
        label="training games (sampled)",
    )
    for i, (name, b) in enumerate(sorted(baselines.items())):
        ax.axhline(
            b.reward_mean,
            linestyle="--",
            color=f"C{i + 2}",
            label=f"scripted {name} ({_fmt(b.reward_mean)})",
        )
    xlabel = "GRPO rounds behind the model" + (" (-1: before the warm start)" if initial else "")
    ax.set(xlabel=xlabel, ylabel="normalised reward")
    ax.set_title("Held-out reward per round")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def _questions_plot(rows, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    rounds = [r.round for r in rows]
    for key, label in (
        ("questions_per_game", "all"),
        ("direct_questions_per_game", "direct (reviewer + paper)"),
        ("general_questions_per_game", "general"),
    ):
        ax.plot(rounds, [getattr(r, key) for r in rows], marker="o", label=label)
    ax.set(xlabel="round", ylabel="questions per game", title="Questions per game")
    ax.set_xticks(rounds)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def _heldout_table(manifest: Manifest) -> list[str]:
    cfg = manifest.settings
    held = manifest.heldout
    warm = manifest.warm_start
    md = [
        "## Held-out evaluation (dev split)",
        "",
        f"Greedy games on {cfg.eval_scenarios} fixed held-out {cfg.table_size}x"
        f"{cfg.table_size} scenarios (eval seed {cfg.eval_seed}; never training "
        "scenarios), the same every round.",
        "",
    ]
    if cfg.partner:
        md += [
            f"The other seat is always `{cfg.partner}`: every row, baselines included, is the "
            f"named player in seat {cfg.policy_seat} beside it.",
            "",
        ]
    if warm:
        info = warm.info  # a WarmStartInfo; no rows for a model given as is
        extra = (
            f" ({info.rows} rows, {info.updates} updates, loss "
            f"{info.loss_first or 0:.3f} -> {info.loss_last or 0:.3f})"
            if info.rows is not None
            else ""
        )
        md += [
            f"Warm start: `{cfg.warm_start}` in {warm.seconds:.0f} s{extra}.",
            "",
        ]
    md += [
        "| model | reward [95% CI] | agreement | invalid rate | questions (direct) | actions "
        "| same first proposal | stated values true |",
        "|---|---|---|---|---|---|---|---|",
    ]

    f = _fmt

    def line(name: str, h: HeldOut) -> str:
        return (
            f"| {name} | {f(h.reward_mean)} [{f(h.reward_ci_low)}, "
            f"{f(h.reward_ci_high)}] | {f(h.agreement_rate)} "
            f"| {f(h.invalid_action_rate)} | {f(h.questions_per_game, '.2f')} "
            f"({f(h.direct_questions_per_game, '.2f')}) | {f(h.mean_actions, '.1f')} "
            f"| {f(h.same_proposal_share, '.2f')} | {f(h.stated_value_accuracy, '.2f')} |"
        )

    if manifest.heldout_initial:
        md.append(line("initial model (before the warm start)", manifest.heldout_initial))
    for k in sorted(held):
        start = "warm-started model" if warm else "start"
        md.append(line(start if k == 0 else f"after round {k - 1}", held[k]))
    for name, b in sorted(manifest.baselines.items()):
        md.append(line(f"scripted {name}", b))
    return md


def test_files(manifest: Manifest) -> tuple[Path | None, Path | None, dict[str, Path]]:
    """The test split's games files: (final, start, baselines by name); None where absent."""
    test = manifest.test
    if not test:
        return None, None, {}
    folder = next(iter(test.values())).path or ""  # one evaluation played every row
    files = {row: games_file(folder, row) for row in test}
    start = next((files[k] for k in START_ROWS if k in test), None)
    base = {k: v for k, v in files.items() if k not in MODEL_ROWS}
    return files.get(FINAL, start), start, base


def _test_section(manifest: Manifest) -> list[str]:
    """The headline: the test split's rows (played once, after the last round) and the panel of
    what the final model learned there (``evaluate.learned``)."""
    from selfplay.evaluate.learned import panel

    cfg, test = manifest.settings, manifest.test
    n = next(iter(test.values())).games
    md = [
        "## Test split (the headline)",
        "",
        f"Greedy games on {n} {cfg.table_size}x{cfg.table_size} scenarios of the test split "
        f"(eval seed {cfg.eval_seed}, a seed space no round or recipe choice saw), played once "
        "after the last round.",
        "",
        "| row | reward [95% CI] | agreement | questions (direct) | actions |",
        "|---|---|---|---|---|",
    ]
    f = _fmt
    for name, h in test.items():
        md.append(
            f"| {name} | {f(h.reward_mean)} [{f(h.reward_ci_low)}, {f(h.reward_ci_high)}] "
            f"| {f(h.agreement_rate)} | {f(h.questions_per_game, '.2f')} "
            f"({f(h.direct_questions_per_game, '.2f')}) | {f(h.mean_actions, '.1f')} |"
        )
    final, start, base = test_files(manifest)
    if final is not None and final.name != (start.name if start else None):
        md += ["", *panel(final, start, base, "test")]
    return [*md, ""]


def paired_differences(
    run_dir: Path, manifest: Manifest
) -> list[tuple[str, int, float, float, float]]:
    """(comparison, scenarios, mean, lo, hi): the final model's held-out reward minus the
    starting model's and minus each scripted baseline's, paired by scenario (95% t-interval),
    as ``selfplay compare`` pairs them (a scenario matched by id and content). A set whose
    games are not on disk, or that shares no scenario with the final model's, is left out."""
    from selfplay.evaluate.compare import CompareError, load_games, paired

    held = manifest.heldout
    if len(held) < 2:
        return []
    final = max(held)

    def games(h: HeldOut, file: str) -> Path:
        return Path(h.path or "") / "games" / file

    if not held[final].path or 0 not in held:
        return []
    last_path = games(held[final], "model-model.jsonl")
    others = {"start (after 0 rounds)": games(held[0], "model-model.jsonl")}
    for name, b in sorted(manifest.baselines.items()):
        others[f"scripted {name}"] = games(b, f"baseline-{name}.jsonl")
    if not last_path.exists():
        return []
    last = load_games(last_path, f"after {final} rounds")
    out = []
    for label, path in others.items():
        if not path.exists():
            continue
        try:
            d = paired(load_games(path, label), last)
        except CompareError as e:
            log.warning("held-out pairing left out: %s", e)
            continue
        out.append((f"after {final} rounds - {label}", d.scenarios, d.mean, d.low, d.high))
    return out


def _reward_vs_questions(run_dir: Path, rows, path: Path) -> Path | None:
    """Per-game reward against questions asked, one colour per round (needs the games files)."""
    from selfplay.metrics import questions_by_seat
    from selfplay.records import iter_game_records

    points = []
    for r in rows:
        games = run_dir / f"round_{r.round}" / "games.jsonl"
        if games.exists():
            for g in iter_game_records(games):
                points.append((r.round, sum(questions_by_seat(g)), g.reward))
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for k in sorted({p[0] for p in points}):
        xs = [q for rk, q, _ in points if rk == k]
        ys = [w for rk, _, w in points if rk == k]
        ax.scatter(xs, ys, s=12, alpha=0.6, label=f"round {k}")
    ax.set(xlabel="questions in the game", ylabel="normalised reward", title="Reward vs questions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def write_report(
    run_dir: str | Path, *, n: int | None = None, baselines: dict | None = None
) -> Path:
    """Write PNG plots and REPORT.md into ``run_dir``; return the REPORT.md path.

    The table size (for the scripted baselines) is the run's own, from its manifest, unless
    ``n`` is given."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    manifest = _run_manifest(run_dir)
    settings = manifest.settings if manifest else RunSettings()  # none: the defaults
    n = n or settings.table_size
    game = settings.game
    if not game.min_size <= n <= game.max_size:
        raise ReportError(
            f"--table-size {n}: the {game.name} game's sizes are {game.min_size} to {game.max_size}"
        )
    where = f"{n}x{n}, scripted self-play on 50 held-out scenarios"
    if baselines is None and manifest and manifest.baselines:  # the run's own held-out scenarios
        baselines = {k: v.reward_mean for k, v in manifest.baselines.items()}
        partner = manifest.settings.partner
        who = f"each scripted policy + `{partner}`" if partner else "scripted self-play"
        where = f"{who} on this run's held-out scenarios"
    if baselines is None:
        baselines = baseline_rewards(game, n)
    lines = {f"scripted {k}": v for k, v in baselines.items()}
    if comparable(game, n):  # humans played tables of this size only
        lines[human_label(game)] = game.human.reference
    plots = {
        "reward": _line_plot(
            rows,
            "reward_mean",
            "Mean normalised reward",
            "reward",
            run_dir / "reward.png",
            ci=("reward_ci_low", "reward_ci_high"),
            hlines=lines,
        ),
        "agreement": _line_plot(
            rows, "agreement_rate", "Agreement rate", "share of games", run_dir / "agreement.png"
        ),
        "actions": _line_plot(
            rows, "mean_actions", "Actions per game", "actions", run_dir / "actions.png"
        ),
        "invalid": _line_plot(
            rows,
            "invalid_action_rate",
            "Invalid-action rate",
            "share of actions",
            run_dir / "invalid.png",
        ),
        "questions": _questions_plot(rows, run_dir / "questions.png"),
    }
    scatter = _reward_vs_questions(run_dir, rows, run_dir / "reward_vs_questions.png")
    if scatter is not None:
        plots["reward vs questions"] = scatter
    md = [f"# Run report: {run_dir.name}", ""]
    if manifest and manifest.test:
        md += _test_section(manifest)
    if manifest and manifest.heldout:
        plots = {
            "held-out reward": _heldout_plot(
                rows,
                manifest.heldout,
                manifest.baselines,
                run_dir / "heldout.png",
                manifest.heldout_initial,
            ),
            **plots,
        }
        md += _heldout_table(manifest)
        diffs = paired_differences(run_dir, manifest)
        if diffs:
            md += ["", "Paired by held-out scenario (95% t-interval):", ""]
            md += ["| difference | scenarios | mean [95% CI] |", "|---|---|---|"]
            md += [f"| {c} | {n} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] |" for c, n, m, lo, hi in diffs]
        md.append("")
    md.append("## Training games per round")
    md.append("")
    md.append(
        "| round | games | reward [95% CI] | agreement | actions | words | invalid | questions "
        "(direct) | q-reward r | loss (pg; EI: SFT) | kl | clip frac | train tok/s | update |"
    )
    md.append("|---" * 14 + "|")
    for r in rows:
        t = r.train or {}

        f = _fmt

        md.append(
            f"| {r.round} | {r.games} | {f(r.reward_mean)} "
            f"[{f(r.reward_ci_low)}, {f(r.reward_ci_high)}] "
            f"| {f(r.agreement_rate)} | {f(r.mean_actions, '.2f')} "
            f"| {f(r.mean_words, '.1f')} | {f(r.invalid_action_rate)} "
            f"| {f(r.questions_per_game, '.2f')} "
            f"({f(r.direct_questions_per_game, '.2f')}) "
            f"| {f(r.question_reward_corr, '.2f')} "
            f"| {f(t.get('pg_loss') if t.get('pg_loss') is not None else t.get('loss'), '.4f')} "
            f"| {f(t.get('kl'), '.4f')} | {f(t.get('clip_frac'), '.3f')} "
            f"| {f(t.get('tokens_per_s'), '.0f')} "
            f"| {'skipped: ' + r.skip_reason if r.skip_reason else 'trained'} |"
        )
    md.append("")
    md.append(
        f"Baselines ({where}): "
        + ", ".join(f"{k} {v:.3f}" for k, v in baselines.items())
        + _human_note(game, n)
    )
    md.append("")
    for name, path in plots.items():
        md.append(f"![{name}]({path.name})")
        md.append("")
    out = run_dir / "REPORT.md"
    atomic_write(out, "\n".join(md))
    log.info("wrote %s and %d plots", out, len(plots))
    return out


def _human_note(game: DialogueGame, n: int) -> str:
    """The human reference after the baselines, with the size of the tables they played (on a
    table of another size it is no line of the plots)."""
    human = game.human
    if human is None:
        return "."
    k = human.table_size
    note = f"; {human_label(game)} reference {human.reference} ({human.reference_games} games)"
    if comparable(game, n):
        return note + "."
    return note + f", on {k}x{k} tables: not drawn beside {n}x{n}."
