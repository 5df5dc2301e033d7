"""Expert iteration (``--algorithm expert-iteration``): a round samples many games with the current
model, keeps the best of each scenario, and clones them with the SFT loss.

This is filtered behaviour cloning on the model's own games (Liao, Tomlin & Klein, "Efficacy of
Language Model Self-Play in Non-Zero-Sum Games", arXiv 2406.18872; RAFT; ReST). GRPO moves the
policy by the reward differences inside a group, and at CPU scale most of that gradient is noise;
expert iteration turns the same games into a supervised signal with no advantage to estimate: the
kept games are trained on as if a teacher had played them.

The rule (``select_games``): a game is kept when it is among the ``top_k`` best games of its
scenario (highest reward first; ties go to the earlier game in plan order) and its reward is at
least ``min_reward``. With the defaults (top 1, reward >= 0.5) each scenario gives at most its
best game, and only when that game reached an agreement worth at least half the best assignment:
a failed game is never cloned, whatever its scenario's other games did.

With ``ei_above_mean`` a kept game must also score strictly above the mean of its scenario's
games: a scenario whose games all scored alike gives none, so what is cloned is what set a game
apart from the others on its scenario (a binary advantage, as GRPO's sign). Beside shy-strict on
matching-advice, where asking decides 17% of the scenarios (the advised players: asking wins 14%,
loses 3%), a policy that asks in 30% of its games sampled 8 times a scenario keeps asking games
as 67% of the kept ones this way, against 34% with reward >= 0.9 alone (scripted outcomes,
README "Asking").

A kept game can still hold moves the rules refused (a proposal naming one reviewer twice, then a
valid one that was accepted). Cloning those teaches the model to make them, and a round's kept
games then hold more of them (measured: 5 of 32 of the model's kept turns in ``ask4r``'s round 0,
13 of 33 in round 1, and a held-out invalid rate of 0.74). With ``ei_invalid_turns="skip"`` (the
default) the rows keep those turns as context with loss mask 0 (``without_invalid_turns``):
what is cloned is the kept games' valid moves.

With ``ei_replay`` N > 1 (0: every round) a round trains on the kept games of the N latest rounds,
itself included (each earlier round's ``selected.jsonl``, under the same invalid-turn rule), as
ReST grows its dataset: a round keeps tens of games, and cloning only those moves the model by
about what one round's noise does.

The round's stages keep their names (generate, convert, train) so resume, metrics and the report
read an expert-iteration run as any other: the ``convert`` stage writes ``round_K/selected.jsonl``
(the kept games, byte for byte as generate wrote them) and ``round_K/train.parquet`` (their
trained seats' rows, cut as ``convert`` cuts them); the ``train`` stage runs verl's SFT loss on
those rows (``train.sft.train_sft``, as ``selfplay sft`` and the warm start do) at ``--lr``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from selfplay.convert import ConvertConfig, ConvertOptions, rows_table
from selfplay.fileio import atomic_write
from selfplay.iterate.child import hold_if_asked
from selfplay.iterate.config import IterateConfig
from selfplay.manifest import ConvertInfo, StageRecord
from selfplay.records import GameRecord, iter_game_records, line_game_id

log = logging.getLogger(__name__)


def select_games(
    records: Iterable[GameRecord], top_k: int, min_reward: float, above_mean: bool = False
) -> list[GameRecord]:
    """The games expert iteration keeps, in their input order: per scenario the ``top_k`` with
    the highest reward (ties: the earlier game), of those with reward >= ``min_reward`` and, with
    ``above_mean``, strictly above the mean reward of their scenario's games."""
    records = list(records)
    by_scenario: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        by_scenario[r.scenario_id].append(i)
    kept: set[int] = set()
    for indices in by_scenario.values():
        mean = sum(records[i].reward for i in indices) / len(indices)
        eligible = [
            i
            for i in indices
            if records[i].reward >= min_reward
            and (not above_mean or records[i].reward > mean + 1e-9)  # equal rewards: none
        ]
        kept.update(sorted(eligible, key=lambda i: (-records[i].reward, i))[:top_k])
    return [r for i, r in enumerate(records) if i in kept]


def without_invalid_turns(record: GameRecord) -> tuple[GameRecord, int]:
    """``record`` with its trained seats' loss mask set to 0 on the turns the rules refused, and
    how many turns that was. A seat's generated tokens come in one run of mask-1 tokens per
    action it took, in order (each turn is one generation, and the partner's reply or the
    template separates two), so its i-th run is its i-th action."""
    tokens = list(record.tokens)
    skipped = 0
    for seat, t in enumerate(record.tokens):
        if t is None or not record.seats[seat].trained:
            continue
        valid = [a.valid for a in record.actions if a.seat == seat]
        if all(valid):
            continue
        runs = _mask_runs(t.mask)
        if len(runs) != len(valid):
            raise ValueError(
                f"game {record.game_id}: seat {seat} has {len(valid)} actions but "
                f"{len(runs)} runs of generated tokens; cannot tell which turns were invalid"
            )
        mask = list(t.mask)
        for (start, end), ok in zip(runs, valid, strict=True):
            if not ok:
                mask[start:end] = [0] * (end - start)
                skipped += 1
        tokens[seat] = t.model_copy(update={"mask": mask})
    return record.model_copy(update={"tokens": tokens}), skipped


def _mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def select_stage(
    cfg: IterateConfig, k: int, model: str, done: dict[str, StageRecord]
) -> StageRecord:
    """Round ``k``'s games -> the kept games and their rows; skipped (with the reason) when no
    game passes the rule."""
    started = time.time()
    hold_if_asked(cfg.run_dir, "convert")
    rdir = cfg.round_dir(k)
    games = list(iter_game_records(rdir / "games.jsonl"))
    kept = select_games(games, cfg.ei_top_k, cfg.ei_min_reward, cfg.ei_above_mean)
    kept_ids = {r.game_id for r in kept}
    lines = [
        line
        for line in (rdir / "games.jsonl").read_bytes().splitlines(keepends=True)
        if line.strip() and line_game_id(line) in kept_ids
    ]
    atomic_write(rdir / "selected.jsonl", b"".join(lines))
    cut = ConvertConfig(
        games=rdir / "selected.jsonl",
        out=rdir,
        **cfg.model_dump(include=set(ConvertOptions.model_fields)),
    )
    replayed = [
        r
        for j in range(0 if cfg.ei_replay == 0 else max(0, k - cfg.ei_replay + 1), k)
        for r in iter_game_records(cfg.round_dir(j) / "selected.jsonl")
    ]
    cloned, skipped = [*replayed, *kept], 0
    if cfg.ei_invalid_turns == "skip":
        cleaned = [without_invalid_turns(r) for r in cloned]
        cloned, skipped = [r for r, _ in cleaned], sum(n for _, n in cleaned)
    table, counts = rows_table(cloned, cut)
    info = ConvertInfo(
        games=len(games),
        games_kept=len(kept),
        games_replayed=len(replayed),
        scenarios=len({r.scenario_id for r in games}),
        reward_mean_all=_mean(r.reward for r in games),
        reward_mean_kept=_mean(r.reward for r in kept),
        rows_train=table.num_rows,
        rows_too_long=counts["too_long"],
        invalid_turns_skipped=skipped,
    )
    log.info(
        "round %d: kept %d of %d games (top %d per scenario, reward >= %s%s): mean reward %.3f "
        "of all, %.3f of the kept; with %d kept in earlier rounds, %d rows (%d invalid turns "
        "not cloned)",
        k,
        len(kept),
        len(games),
        cfg.ei_top_k,
        cfg.ei_min_reward,
        ", above its scenario's mean" if cfg.ei_above_mean else "",
        info.reward_mean_all or 0.0,
        info.reward_mean_kept or 0.0,
        len(replayed),
        table.num_rows,
        skipped,
    )
    if table.num_rows == 0:
        return StageRecord.since(started, skip_reason="no game passed the rule", info=info)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    path = atomic_write(rdir / "train.parquet", sink.getvalue().to_pybytes())
    return StageRecord.since(
        started,
        artifacts={"train": str(path), "selected": str(rdir / "selected.jsonl")},
        info=info,
    )


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
