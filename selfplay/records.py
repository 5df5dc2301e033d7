"""Stage contracts: the typed, versioned records that cross stage boundaries, and their JSONL I/O.

- ``GameRecord``: one finished game, one JSON line in games.jsonl (written by the runner).
- ``TRAINING_SCHEMA``: the pyarrow schema of one training row per (game, trained seat) (convert);
  it lives in ``selfplay.training_schema``, which imports nothing of the game, and is re-exported.
Readers are strict about the schema version and tolerant of a torn or corrupt line: it is skipped
and reported with its line number, never silently dropped.
"""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from selfplay.errors import UserError
from selfplay.fileio import open_output
from selfplay.game import DEFAULT_GAME, GameField
from selfplay.game.api import DialogueGame, Outcome
from selfplay.seats import SamplingParams, SeatConfig, SeatTokens
from selfplay.training_schema import TRAINING_SCHEMA, TRAINING_SCHEMA_VERSION

__all__ = [  # the record models and readers; the seat models and training-row schema re-exported
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "TRAINING_SCHEMA",
    "TRAINING_SCHEMA_VERSION",
    "ActionRecord",
    "GameRecord",
    "ReadReport",
    "RecordError",
    "SamplingParams",
    "SeatConfig",
    "SeatTokens",
    "append_records",
    "check_record_version",
    "dump_record",
    "iter_game_records",
    "iter_jsonl",
    "repair_jsonl_tail",
]

log = logging.getLogger(__name__)

# games.jsonl: version 2 added ``GameRecord.game``; version 1 files are the matching game's and
# are still read (their records get ``game="matching"``).
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)


class RecordError(UserError, ValueError):
    """A record file that cannot be used as a whole (missing, empty, another schema version)."""


class ActionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seat: int
    text: str
    kind: str
    valid: bool
    error: str | None = None
    proposal: list[tuple[int, int]] | None = None


class GameRecord(BaseModel):
    """One finished game. ``scenario`` is an instance of the game's ``scenario_type``."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1, 2] = SCHEMA_VERSION
    # the game object (stored as its name, one in selfplay.game.GAMES or an installed game's)
    game: GameField = Field(DEFAULT_GAME, validate_default=True)
    game_id: str
    scenario_id: str
    round: int = 0
    seed: int  # the seed every random draw of this game derives from
    scenario: Any
    seats: tuple[SeatConfig, SeatConfig]
    actions: list[ActionRecord]
    tokens: tuple[SeatTokens | None, SeatTokens | None] = (None, None)
    outcome: Outcome
    error: str | None = None
    score: int
    reward: float
    counts: dict[str, int] = {}
    timings: dict[str, float] = {}

    @field_validator("scenario")
    @classmethod
    def _game_scenario(cls, value: Any, info: ValidationInfo) -> Any:
        if "game" not in info.data:
            raise ValueError("the scenario cannot be read without a known game")
        kind = info.data["game"].scenario_type
        return value if isinstance(value, kind) else kind.model_validate(value)


# ---------------------------------------------------------------------------------------------
# JSONL


@dataclass
class ReadReport:
    """What a tolerant read skipped: (line number, reason) for each unusable line."""

    skipped: list[tuple[int, str]] = field(default_factory=list)


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, object, None) for each non-blank line of a JSONL file, or (line number,
    None, reason) for a line that is not valid JSON (a torn or corrupt line). A ``.gz`` path is
    read through gzip (docs/runs/*/heldout/ publishes held-out games that way)."""
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield lineno, orjson.loads(line), None
                except orjson.JSONDecodeError as e:
                    yield lineno, None, f"not valid JSON ({e})"


def iter_game_records(path: str | Path, report: ReadReport | None = None) -> Iterator[GameRecord]:
    """Yield the records of a games.jsonl; skip (and report) torn or corrupt lines.

    A record of another schema version is an error for the whole file, not a skipped line.
    """
    report = report if report is not None else ReadReport()
    path = Path(path)
    if not path.exists():
        raise RecordError(f"{path} does not exist")
    for lineno, obj, bad in iter_jsonl(path):
        if bad is not None:
            report.skipped.append((lineno, bad))
            log.warning("%s:%d: skipping a torn or corrupt line", path, lineno)
            continue
        check_record_version(obj, f"{path}:{lineno}")
        try:
            yield GameRecord.model_validate(obj)
        except ValidationError as e:
            report.skipped.append((lineno, f"invalid record: {e.errors()[0]['msg']}"))
            log.warning("%s:%d: skipping an invalid record", path, lineno)


def check_record_version(obj: Any, where: str) -> None:
    """``RecordError`` unless ``obj`` is a game record of a version this selfplay reads."""
    version = obj.get("schema_version") if isinstance(obj, dict) else None
    if version not in READABLE_SCHEMA_VERSIONS:
        readable = " and ".join(map(str, READABLE_SCHEMA_VERSIONS))
        raise RecordError(
            f"{where}: schema_version {version!r}, this selfplay reads {readable}; "
            "regenerate the games or use a matching selfplay version"
        )


def known_game(obj: dict) -> str | None:
    """The game a record's JSON names (schema 1 records name none: the matching game), or None
    when no registered game has that name (the fast readers' check of ``GameRecord.game``)."""
    name = obj.get("game", DEFAULT_GAME)
    if not isinstance(name, str):
        return None
    try:
        return _GAME.validate_python(name).name  # the field's own check, as GameRecord's
    except ValidationError:
        return None


_GAME: TypeAdapter[DialogueGame] = TypeAdapter(GameField)


def line_game_id(line: bytes) -> str | None:
    """The ``game_id`` of one games.jsonl line, or None (a torn or foreign line)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return obj.get("game_id") if isinstance(obj, dict) else None


def dump_record(record: BaseModel) -> bytes:
    return orjson.dumps(record.model_dump(mode="json")) + b"\n"


def append_records(path: str | Path, records: list[GameRecord]) -> None:
    """Append records and flush them to disk (each game is durable as soon as it is written)."""
    with open_output(path, "ab") as f:
        for record in records:
            f.write(dump_record(record))
        f.flush()
        os.fsync(f.fileno())


def repair_jsonl_tail(path: str | Path) -> int:
    """Drop a torn last line (a write cut off by a crash) so appends start on a clean line.

    Returns the number of bytes removed (0 when the file ends with a complete line).
    """
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open_output(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # find the last newline; everything after it is the torn line
        pos, chunk = size, 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            buf = f.read(pos - start)
            idx = buf.rfind(b"\n")
            if idx >= 0:
                cut = start + idx + 1
                break
            pos = start
        else:
            cut = 0
        f.truncate(cut)
    log.warning("%s: dropped a torn last line (%d bytes)", path, size - cut)
    return size - cut
