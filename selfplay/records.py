"""Stage contracts: the typed, versioned records that cross stage boundaries, and their JSONL I/O.

- ``GameRecord``: one finished game, one JSON line in games.jsonl (written by the runner).
- ``TRAINING_SCHEMA``: the pyarrow schema of one training row per (game, trained seat) (convert).
Readers are strict about the schema version and tolerant of a torn or corrupt line: it is skipped
and reported with its line number, never silently dropped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from selfplay.errors import UserError
from selfplay.game.matching import Scenario
from selfplay.game.protocol import Outcome

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class RecordError(UserError, ValueError):
    """A record file that cannot be used as a whole (missing, empty, another schema version)."""


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(
        0.7,
        ge=0.0,
        description="Sampling temperature (0: greedy).",
        json_schema_extra={"envvar": "TEMPERATURE"},
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the top tokens of this mass."
    )
    max_new_tokens: int = Field(256, ge=1, description="Tokens per action at most.")
    seed: int | None = Field(None, description="The request's sampling seed (set per turn).")


class SeatConfig(BaseModel):
    """Who plays a seat: an LLM (model path or id), a scripted policy, or an API model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["llm", "scripted", "api"]
    name: str
    trained: bool = False  # whether this seat's tokens become training rows
    sampling: SamplingParams | None = None


class ActionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seat: int
    text: str
    kind: str
    valid: bool
    error: str | None = None
    proposal: list[tuple[int, int]] | None = None


class SeatTokens(BaseModel):
    """Exactly what one seat's model saw and produced, as one append-only token list.

    ``mask[i] == 1`` marks tokens the seat's own model generated; ``logprobs[i]`` is their behaviour
    log-probability (0.0 where mask is 0). ``messages`` is the readable chat of the same tokens.
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, str]] = []
    tokenizer_fingerprint: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> SeatTokens:
        n = len(self.token_ids)
        if len(self.mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), mask ({len(self.mask)}) and logprobs ({len(self.logprobs)}) "
                "must have the same length"
            )
        if not set(self.mask) <= {0, 1}:
            raise ValueError("mask values must be 0 or 1")
        return self


class GameRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    game_id: str
    scenario_id: str
    round: int = 0
    seed: int  # the seed every random draw of this game derives from
    scenario: Scenario
    seats: tuple[SeatConfig, SeatConfig]
    actions: list[ActionRecord]
    tokens: tuple[SeatTokens | None, SeatTokens | None] = (None, None)
    outcome: Outcome
    error: str | None = None
    score: int
    reward: float
    counts: dict[str, int] = {}
    timings: dict[str, float] = {}


# ---------------------------------------------------------------------------------------------
# JSONL


@dataclass
class ReadReport:
    """What a tolerant read skipped: (line number, reason) for each unusable line."""

    skipped: list[tuple[int, str]] = field(default_factory=list)


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, object, None) for each non-blank line of a JSONL file, or (line number,
    None, reason) for a line that is not valid JSON (a torn or corrupt line)."""
    with path.open("rb") as f:
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
        version = obj.get("schema_version") if isinstance(obj, dict) else None
        if version != SCHEMA_VERSION:
            raise RecordError(
                f"{path}:{lineno}: schema_version {version!r}, this selfplay reads "
                f"{SCHEMA_VERSION}; regenerate the games or use a matching selfplay version"
            )
        try:
            yield GameRecord.model_validate(obj)
        except ValidationError as e:
            report.skipped.append((lineno, f"invalid record: {e.errors()[0]['msg']}"))
            log.warning("%s:%d: skipping an invalid record", path, lineno)


def dump_record(record: BaseModel) -> bytes:
    return orjson.dumps(record.model_dump(mode="json")) + b"\n"


def append_records(path: str | Path, records: list[GameRecord]) -> None:
    """Append records and flush them to disk (each game is durable as soon as it is written)."""
    with Path(path).open("ab") as f:
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
    with path.open("rb+") as f:
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


# ---------------------------------------------------------------------------------------------
# Training rows (parquet)

TRAINING_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("group_key", pa.string(), nullable=False),
        pa.field("game_id", pa.string(), nullable=False),
        pa.field("scenario_id", pa.string(), nullable=False),
        pa.field("seat", pa.int8(), nullable=False),
        pa.field("round", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("tokenizer_fingerprint", pa.string()),
        pa.field(
            "messages",
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
        ),
        # verl-style columns, so the file also reads as an ordinary verl dataset
        pa.field("data_source", pa.string()),
        pa.field("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        pa.field(
            "reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.float32())])
        ),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    ("index", pa.int64()),
                    ("game_id", pa.string()),
                    ("seat", pa.int8()),
                ]
            ),
        ),
    ],
    metadata={b"selfplay_schema_version": str(SCHEMA_VERSION).encode()},
)
