"""Behaviour cloning (``selfplay sft``): a supervised warm start on token-exact teacher rows.

``sft(SFTConfig) -> SFTResult`` builds rows from one source and fine-tunes the model on them
with verl's SFT loss on the same workers as ``selfplay train`` (``train.sft.train_sft``):

- ``teacher="scripted:NAME"``: plays ``num_games`` games of the scripted policy against itself
  (or ``partner``) on fresh training scenarios; ``teacher="scripted:A:24,scripted:B:4"`` mixes
  teachers, each with its own number of games (its rows are counted apart in ``sources``); the
  cloned seats (``clone``: both, 1 or 2) are recorded by ``TeacherPlayer`` exactly as the LLM
  player would record the model playing those moves (the model's own chat format, mask 1 on the
  action tokens and the end-of-turn token);
- ``games=PATH``: a games.jsonl of our own games, keeping the trained seats of games whose reward
  is at least ``min_reward`` (filtered behaviour cloning);
- ``human_data=PATH``: the game's recorded human games (matching: the DialOp
  ``optimization.jsonl``, 8x8), both seats replayed through our rules and chat format under the
  game's rendering policy (``DialogueGame.human.replays``).

Layout: ``OUT/`` is the new Hugging Face model (as ``selfplay train`` writes it, with
metrics.json); ``OUT/sft_data/`` holds the teacher games (``games.jsonl``) and the rows
(``rows.parquet``, ``records.TRAINING_SCHEMA``) that were trained on, and the replayed human games
(``human_games.jsonl``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from selfplay.convert import ConvertConfig, rows_table
from selfplay.errors import UserError
from selfplay.fileio import refuse_link
from selfplay.game import DEFAULT_GAME, GAMES, GameField, game_of
from selfplay.game.api import MAX_ACTIONS
from selfplay.generate.config import SIZE_HELP, size_of_the_game
from selfplay.generate.teacher import (
    HumanReplay,
    filtered_games,
    human_records,
    play_teacher_games,
    scripted_name,
    teacher_sources,
)
from selfplay.hardware import ComputeDtype
from selfplay.records import GameRecord, append_records
from selfplay.train.config import (
    Epochs,
    Gpus,
    LearningRate,
    LoraAlpha,
    LoraRank,
    MaxLength,
    MicroBatchSize,
)

log = logging.getLogger(__name__)


DATA_DIR = "sft_data"


class SFTError(UserError, ValueError):
    """The SFT sources or options cannot give rows to train on; says what to do."""


PACKAGED = "packaged"  # --human-data: the game's own human games, shipped with selfplay


class SFTConfig(BaseModel):
    """Everything ``sft`` needs: one or more row sources and the training options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="The model to fine-tune (HF directory or id).")
    out: Path = Field(description="Output: the new HF model dir, metrics.json, sft_data/.")
    game: GameField = Field(
        DEFAULT_GAME,
        validate_default=True,
        description=f"The game to play: {', '.join(sorted(GAMES))} (selfplay.game).",
    )
    # sources
    teacher: str | None = Field(
        None,
        description="Clone a scripted policy: scripted:NAME (cooperative, no-talk, shy, random, "
        "inquisitive, explainer), --num-games games; or several, each with its games: "
        "scripted:cooperative:24,scripted:inquisitive:4.",
    )
    partner: str | None = Field(
        None,
        description="teacher: the other seat's scripted policy when one seat is cloned (default: "
        "the teacher).",
    )
    clone: Literal["both", "1", "2"] = Field(
        "both", description="teacher: the seats to clone: both, 1 or 2."
    )
    num_games: int = Field(1000, ge=1, description="teacher: games to play and clone.")
    table_size: int = Field(3, description=SIZE_HELP)
    max_actions: int = Field(MAX_ACTIONS, ge=1, description="teacher: actions per game at most.")
    games: Path | None = Field(
        None, description="Clone our own games: a games.jsonl (filtered by --min-reward)."
    )
    min_reward: float = Field(0.0, description="games: keep games with at least this reward.")
    human_data: Path | None = Field(
        None,
        description="Clone both seats of the game's human games (matching: DialOp's "
        "optimization.jsonl, 8x8), replayed through our rules (the game's rendering policy): "
        "a file, or 'packaged' for the copy shipped with selfplay.",
    )
    seed: int = Field(
        0, ge=0, description="Seed: the teacher games' scenarios and the row order derive from it."
    )
    # training
    epochs: Epochs = 1
    lr: LearningRate = 1e-4
    mini_batch_size: int = Field(8, ge=1, description="Rows per optimizer update.")
    micro_batch_size: MicroBatchSize = 4
    max_length: MaxLength = 4096
    lora_rank: LoraRank = 0
    lora_alpha: LoraAlpha = 16
    dtype: ComputeDtype = "auto"
    gpus: Gpus = 0
    ray_address: str | None = Field(None, description="Train on this Ray cluster.")
    save_verl_checkpoint: bool = Field(False, description="Also write verl's checkpoint.")

    @field_validator("table_size")
    @classmethod
    def _size(cls, size: int, info: ValidationInfo) -> int:
        return size_of_the_game(size, info)

    @field_validator("human_data")
    @classmethod
    def _packaged(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        """'packaged': the game's human games as shipped with selfplay."""
        game = game_of(info)
        if v is not None and str(v) == PACKAGED and game is not None and game.human is not None:
            return game.human.default_path
        return v

    @model_validator(mode="after")
    def _sources(self) -> SFTConfig:
        if self.teacher is None and self.games is None and self.human_data is None:
            raise ValueError("give at least one source: teacher, games or human_data")
        names = self.game.scripted_names
        if self.teacher is not None:
            teacher_sources(self.teacher, self.num_games, names)
        if self.partner is not None:
            scripted_name(self.partner, names)
        if self.human_data is not None and self.game.human is None:
            raise ValueError(f"human_data: the {self.game.name} game has no recorded human games")
        return self

    @property
    def data_dir(self) -> Path:
        return self.out / DATA_DIR


@dataclass
class SFTResult:
    model_dir: Path
    rows_path: Path
    rows: int
    sources: dict[str, int]  # rows per source
    steps: list  # train.sft.SFTStepMetrics


def build_rows(config: SFTConfig, chat) -> tuple[Path, dict[str, int]]:
    """Write OUT/sft_data/rows.parquet from every source; return it and the rows per source."""
    data = config.data_dir
    data.mkdir(parents=True, exist_ok=True)
    cut = ConvertConfig(games=data / "games.jsonl", out=data, max_length=config.max_length)
    tables, sources = [], {}

    def add(name: str, records: Iterable[GameRecord]) -> None:
        table, counts = rows_table(records, cut)
        if counts["too_long"]:
            log.warning("%s: %d rows over --max-length left out", name, counts["too_long"])
        sources[name] = table.num_rows
        tables.append(table)

    if config.teacher is not None:
        games_path = data / "games.jsonl"
        games_path.unlink(missing_ok=True)
        first = 0
        game = config.game
        for name, num_games in teacher_sources(
            config.teacher, config.num_games, game.scripted_names
        ):
            records = play_teacher_games(
                chat,
                game=game,
                teacher=name,
                num_games=num_games,
                first=first,
                **config.model_dump(
                    include={"partner", "clone", "seed", "table_size", "max_actions"}
                ),
            )
            first += num_games
            append_records(games_path, records)
            rewards = [r.reward for r in records]
            log.info(
                "teacher scripted:%s: %d games, mean reward %.3f",
                name,
                len(records),
                sum(rewards) / len(rewards),
            )
            add(f"teacher scripted:{name}", records)
    if config.games is not None:
        if not config.games.is_file():
            raise SFTError(f"--games {config.games} does not exist")
        kept = filtered_games(config.games, config.min_reward)
        add(f"games {config.games} (reward >= {config.min_reward})", kept)
    if config.human_data is not None:
        stats = HumanReplay()
        records = list(human_records(config.game, config.human_data, chat, stats))
        human_path = data / "human_games.jsonl"
        human_path.unlink(missing_ok=True)
        append_records(human_path, records)
        add(f"human games {config.human_data}", records)
        log.info(
            "human games: %d replayed, %d to the accept, %d turns, %d messages dropped before "
            "proposals, stopped early: %s",
            stats.games,
            stats.complete,
            stats.turns,
            stats.dropped_messages,
            stats.stopped or "none",
        )
    table = pa.concat_tables(tables)
    if table.num_rows < config.mini_batch_size:
        raise SFTError(
            f"the sources gave {table.num_rows} rows ({sources}), fewer than one mini-batch of "
            f"{config.mini_batch_size}; add games, lower --min-reward or --mini-batch-size"
        )
    path = refuse_link(data / "rows.parquet")
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)
    return path, sources


def sft(config: SFTConfig, on_step=None) -> SFTResult:
    """Build the rows and fine-tune ``config.model`` on them; see the module docstring."""
    from selfplay.players.llm import load_chat_format
    from selfplay.train.config import TrainConfig
    from selfplay.train.publish import check_new_output
    from selfplay.train.sft import train_sft

    # before the teacher plays a single game; an earlier sft's rows folder is resumed, not refused
    check_new_output(config.out, own=(DATA_DIR,))
    chat = load_chat_format(config.model)
    new = not config.data_dir.exists()
    try:
        rows_path, sources = build_rows(config, chat)
    except BaseException:  # refused (too few rows, a bad source): leave what was there before
        if new:
            shutil.rmtree(config.data_dir, ignore_errors=True)  # teacher games replay exactly
            with contextlib.suppress(OSError):
                config.out.rmdir()  # only when empty
        raise
    shared = set(SFTConfig.model_fields) & set(TrainConfig.model_fields)  # model, out, lr, ...
    tcfg = TrainConfig(
        data=rows_path,
        batch_size=config.mini_batch_size * 4,
        **config.model_dump(include=shared),
    )
    result = train_sft(tcfg, on_step=on_step)
    return SFTResult(config.out, rows_path, result.rows, sources, result.steps)
