"""Held-out games of several runs side by side, paired by scenario (``selfplay compare``).

Each argument names one set of held-out games:

- a run (``data/NAME``, or ``NAME`` under ``--data-root``): the games its manifest records for
  the final model; ``RUN@start`` the model it started from (warm-started, when it had a warm
  start), ``RUN@K`` the model after K rounds;
- a published run (``docs/runs/NAME``, written by ``scripts/publish_run.py``): its
  ``heldout/final.jsonl.gz``, or with ``@start`` its ``heldout/warm_start.jsonl.gz``;
- a games file (``.jsonl`` or ``.jsonl.gz``), as ``selfplay eval`` or ``generate`` wrote it.

Every set is summarised like an evaluation row; every set after the first is also paired with the
first by scenario: the mean difference of the scenarios' rewards over the scenarios both played,
with its 95% t-interval. A scenario is matched by its id and its content, so two sets drawn with
the same seed at different table sizes are refused rather than paired.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from selfplay.errors import UserError
from selfplay.metrics import GameSummary, mean_ci, questions_by_seat, summarize
from selfplay.records import GameRecord, iter_game_records


class CompareError(UserError, ValueError):
    """An argument of ``selfplay compare`` that names no held-out games, or sets that cannot be
    paired."""


@dataclass(frozen=True)
class HeldoutSet:
    """One set of held-out games: where it came from, its summary, its reward per scenario."""

    label: str
    path: Path
    summary: GameSummary
    asking_share: float  # games with at least one question (either seat)
    rewards: dict[str, float]  # scenario id -> mean reward of its games
    digests: dict[str, str]  # scenario id -> digest of the scenario's content


@dataclass(frozen=True)
class Paired:
    """``label``'s reward minus the first set's, paired by scenario."""

    label: str
    against: str
    scenarios: int
    mean: float
    low: float
    high: float


def games_path(spec: str, data_root: Path = Path("data")) -> Path:
    """The games file an argument names (module docstring), or a ``CompareError`` saying why
    none."""
    where, at, when = spec.rpartition("@") if "@" in spec else (spec, "", "")
    path = Path(where)
    if path.is_file():
        if at:
            raise CompareError(f"{spec}: @{when} names a run's model, not a games file's")
        return path
    if not path.is_dir() and not path.is_absolute() and (data_root / where).is_dir():
        path = data_root / where
    if not path.is_dir():
        raise CompareError(f"{spec}: neither a games file nor a run folder")
    path = path.resolve()  # its folder's parents locate the evaluations (_evaluation_games)
    manifest = path / "manifest.json"
    held = {}
    if manifest.is_file():
        held = {int(k): v for k, v in json.loads(manifest.read_bytes()).get("heldout", {}).items()}
    when = when or "final"
    published = path / "heldout" / {"start": "warm_start", "final": "final"}.get(when, "-")
    for suffix in (".jsonl.gz", ".jsonl"):
        if published.with_suffix(suffix).is_file():
            return published.with_suffix(suffix)
    if not held:
        raise CompareError(f"{spec}: no held-out evaluation in {path} (manifest.json, heldout/)")
    if when == "start":
        k = min(held)
    elif when == "final":
        k = max(held)
    elif when.isdigit() and int(when) in held:
        k = int(when)
    else:
        rounds = ", ".join(str(k) for k in sorted(held))
        raise CompareError(f"{spec}: @{when}: use @start, @final or a round count ({rounds})")
    return _evaluation_games(path, held[k], spec)


def _evaluation_games(run_dir: Path, entry: dict, spec: str) -> Path:
    """An evaluation's games file; its folder is relative to where iterate ran, which is the cwd
    or the folder above the data root."""
    folder = Path(entry.get("path") or "")
    for base in (Path.cwd(), run_dir.parent.parent):
        games = (folder if folder.is_absolute() else base / folder) / "games" / "model-model.jsonl"
        if games.is_file():
            return games
    raise CompareError(f"{spec}: the manifest's held-out games {folder}/games are not on disk")


def load(spec: str, data_root: Path = Path("data")) -> HeldoutSet:
    return load_games(games_path(spec, data_root), spec)


def load_games(path: Path, label: str) -> HeldoutSet:
    """The held-out set of one games file, named ``label``."""
    return games_set(list(iter_game_records(path)), path, label)


def games_set(records: list[GameRecord], path: Path, label: str) -> HeldoutSet:
    """The held-out set of games already read from ``path`` (a reader that needs the records
    too reads the file once)."""
    if not records:
        raise CompareError(f"{label}: {path} holds no games")
    by: dict[str, list[float]] = {}
    digests: dict[str, str] = {}
    for g in records:
        digest = _digest(g.scenario)
        if digests.setdefault(g.scenario_id, digest) != digest:
            raise CompareError(f"{label}: two scenarios named {g.scenario_id} in {path}")
        by.setdefault(g.scenario_id, []).append(g.reward)
    return HeldoutSet(
        label=label,
        path=path,
        summary=summarize(records),
        asking_share=sum(sum(questions_by_seat(g)) > 0 for g in records) / len(records),
        rewards={k: sum(v) / len(v) for k, v in by.items()},
        digests=digests,
    )


def _digest(scenario) -> str:
    dump = scenario.model_dump_json() if hasattr(scenario, "model_dump_json") else repr(scenario)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def paired(first: HeldoutSet, other: HeldoutSet) -> Paired:
    """``other`` minus ``first`` over the scenarios both played (the same id and content)."""
    common = sorted(first.rewards.keys() & other.rewards.keys())
    differ = [s for s in common if first.digests[s] != other.digests[s]]
    if differ:
        raise CompareError(
            f"{other.label} and {first.label} name different scenarios {differ[0]}"
            f"{' and more' if len(differ) > 1 else ''} alike (another table size or game?)"
        )
    if not common:
        raise CompareError(
            f"{other.label} and {first.label} share no scenario: evaluate both with the same "
            "--eval-seed and table size"
        )
    mean, low, high = mean_ci(other.rewards[s] - first.rewards[s] for s in common)
    return Paired(other.label, first.label, len(common), mean, low, high)


def compare(
    specs: list[str], data_root: Path = Path("data")
) -> tuple[list[HeldoutSet], list[Paired]]:
    """Every set's summary, and every set after the first paired with the first."""
    if len(specs) < 2:
        raise CompareError("compare needs two or more sets of held-out games")
    sets = [load(s, data_root) for s in specs]
    return sets, [paired(sets[0], s) for s in sets[1:]]


SET_COLUMNS = (
    "held-out games",
    "games",
    "scenarios",
    "reward [95% CI]",
    "agreement",
    "invalid rate",
    "questions/game (direct)",
    "games asking",
    "actions",
)
PAIRED_COLUMNS = ("difference", "scenarios", "mean [95% CI]")


def _ci(mean: float, low: float, high: float, sign: str = "") -> str:
    return f"{mean:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


def tables(
    sets: list[HeldoutSet], pairs: list[Paired]
) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    """(title, columns, rows) of the two tables ``selfplay compare`` prints."""
    rows = []
    for s in sets:
        m = s.summary
        rows.append(
            (
                s.label,
                str(m.games),
                str(len(s.rewards)),
                _ci(m.reward_mean, m.reward_ci_low, m.reward_ci_high),
                f"{m.agreement_rate:.3f}",
                f"{m.invalid_action_rate:.3f}",
                f"{m.questions_per_game:.2f} ({m.direct_questions_per_game:.2f})",
                f"{s.asking_share:.2f}",
                f"{m.mean_actions:.1f}",
            )
        )
    diffs = [
        (f"{p.label} - {p.against}", str(p.scenarios), _ci(p.mean, p.low, p.high, "+"))
        for p in pairs
    ]
    return [
        ("Held-out games", SET_COLUMNS, rows),
        ("Paired by scenario (95% t-interval)", PAIRED_COLUMNS, diffs),
    ]


def markdown(sets: list[HeldoutSet], pairs: list[Paired]) -> str:
    """The two tables as Markdown (for a report or a README)."""
    out = []
    for title, columns, rows in tables(sets, pairs):
        out += [f"{title}:", "", "| " + " | ".join(columns) + " |"]
        out.append("|" + "---|" * len(columns))
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    return "\n".join(out)
