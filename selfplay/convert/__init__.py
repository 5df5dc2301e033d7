"""Games to GRPO training rows: one parquet row per (game, trained seat), grouped across games.

``convert(ConvertConfig) -> ConvertSummary`` reads a games.jsonl and writes ``train.parquet``,
``val.parquet`` (both with ``records.TRAINING_SCHEMA``) and ``convert_summary.json``.

A row's reward, its group and (with ``credit="turn"``) its turn states come from the reward seam,
``selfplay.reward``, whose docstring maps the whole path from game to advantage. Groups span
games (a cooperative game gives both seats one reward); groups whose rewards are all equal carry
no signal and are dropped unless ``keep_degenerate``; a group of one row is never written (its
advantage would be the raw reward).

Rows are cut from the exact tokens in the record, never re-tokenised: the prompt is the seat's
tokens before its first generated token, the response the rest up to its last generated token
(trailing partner/template tokens are context for nothing and are trimmed, so the last response
token is the seat's own and a trainer that puts the reward on the last token puts it there),
the response mask and rollout log-probs are the record's, aligned with the response.

Memory does not grow with the file, and the games are parsed once: a row goes straight to the
parquet output as soon as its group is known to be written (two rows with different rewards), and
earlier rows of a group wait in an Arrow spool on disk; after the last line the spooled rows of
kept groups are copied over. Only per-group counts and reward ranges stay in memory. Everything is
written under temporary names and renamed into place only when all of it succeeded. The train/val
split is a hash of the scenario id, so no scenario is in both files and the split does not depend
on file order. Group ids are a stable hash of the group key, so the same games give the same ids
in any file order (a resumed generate writes games in another order). The JSON is read with
orjson and only the needed fields are checked (schema version, types, aligned token lists);
``validate_records`` adds full pydantic validation.

The package, one job a module, imported in this order (each only from those before it):
``config``
(``ConvertConfig``), ``rows`` (a record to its rows: the fast JSON reader and the typed one),
``parquet`` (Arrow batches, writers, spool), ``stats`` (reward and length statistics). This
module is the driver: ``convert``, its summary and errors, and ``rows_table``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import orjson
import pyarrow as pa
from pydantic import BaseModel

from selfplay.convert.config import ConvertConfig, ConvertOptions
from selfplay.convert.parquet import IO_BUFFER, SPLITS, Writers, copy_spool, to_batch
from selfplay.convert.rows import (
    BadRecord,
    RecordRows,
    Row,
    parse_record,
    rows_of_json,
    rows_of_record,
)
from selfplay.convert.stats import LengthStats, RewardStats, Stats
from selfplay.errors import UserError
from selfplay.fileio import folder_lock, refuse_link
from selfplay.records import TRAINING_SCHEMA, GameRecord, RecordError, check_record_version
from selfplay.reward import GroupBy, Groups, group_id, group_key, is_val_scenario

__all__ = [
    "MAX_REPORTED_SKIPS",
    "SUMMARY_FILE",
    "TRAIN_FILE",
    "VAL_FILE",
    "ConvertConfig",
    "ConvertError",
    "ConvertOptions",
    "ConvertSummary",
    "GroupBy",
    "LengthStats",
    "NoSignalError",
    "RewardStats",
    "convert",
    "group_id",
    "group_key",
    "is_val_scenario",
    "rows_table",
]

log = logging.getLogger(__name__)

TRAIN_FILE = "train.parquet"
VAL_FILE = "val.parquet"
SUMMARY_FILE = "convert_summary.json"
MAX_REPORTED_SKIPS = 100  # the summary lists this many skipped lines; the count is always exact


class ConvertError(UserError, ValueError):
    """The games cannot give a usable training set; the message says what to change."""


class NoSignalError(ConvertError):
    """Every group is degenerate (equal rewards) or a singleton: the games carry no signal."""


class ConvertSummary(BaseModel):
    """What one conversion read, dropped and wrote (also saved as convert_summary.json)."""

    games_path: str
    train_path: str
    val_path: str
    group_by: GroupBy
    val_fraction: float
    max_length: int
    keep_degenerate: bool
    reward_shaping: str = "none"
    credit: str = "episode"
    lines_skipped: int = 0  # torn, corrupt or invalid lines (see skipped)
    skipped: list[tuple[int, str]] = []  # (line number, reason), the first MAX_REPORTED_SKIPS
    games_read: int = 0
    outcomes: dict[str, int] = {}
    rows_candidate: int = 0  # trained seats with tokens
    trained_seats_without_tokens: int = 0
    rows_dropped_no_own_tokens: int = 0  # the seat never generated a token in that game
    rows_dropped_over_max_length: int = 0
    groups_seen: int = 0
    groups_written: int = 0
    groups_degenerate_dropped: int = 0  # all rewards equal: no GRPO signal
    rows_in_degenerate_groups_dropped: int = 0
    groups_degenerate_kept: int = 0  # only with keep_degenerate
    groups_singleton_dropped: int = 0
    rows_written: int = 0
    rows_train: int = 0
    rows_val: int = 0
    groups_train: int = 0
    groups_train_with_signal: int = 0  # train groups whose rewards differ (advantage != 0)
    groups_val: int = 0
    scenarios_train: int = 0
    scenarios_val: int = 0
    reward: RewardStats = RewardStats()
    length_total: LengthStats = LengthStats()  # prompt + response tokens
    length_prompt: LengthStats = LengthStats()
    length_response: LengthStats = LengthStats()
    own_tokens: LengthStats = LengthStats()  # mask-1 tokens per row
    tokenizer_fingerprint: str | None = None
    seconds: float = 0.0
    games_per_second: float = 0.0


# ---------------------------------------------------------------------------------------------
# Pass 1: lines -> rows, written at once when their group is known to be kept, else spooled
#
# Speed matters here (thousands of games of ~3,000 tokens per second). Parsing the JSON and
# freeing the parsed Python objects is about half of the time, the parquet encoding and zstd
# compression a quarter; see rows.py and parquet.py for the rest.


def _count(s: ConvertSummary, r: RecordRows) -> None:
    """Add what one valid record adds to the summary besides its rows."""
    s.games_read += 1
    s.outcomes[r.outcome] = s.outcomes.get(r.outcome, 0) + 1
    s.trained_seats_without_tokens += r.no_tokens
    s.rows_candidate += len(r.rows) + r.no_own + r.too_long
    s.rows_dropped_no_own_tokens += r.no_own
    s.rows_dropped_over_max_length += r.too_long


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector. The parsed records are acyclic and freed by reference
    counting; the collector would only rescan the containers each line allocates (10-25%)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Pass1:
    """Streams the games once: skips bad lines, cuts rows, tracks groups, routes rows."""

    def __init__(self, config: ConvertConfig, summary: ConvertSummary, out: Writers) -> None:
        self.config, self.summary, self.out = config, summary, out
        self.groups = Groups(config.val_fraction, config.keep_degenerate)
        self.fingerprints: set[str] = set()
        self.seen: dict[str, int] = {}  # game id -> the line it was first read from

    def skip(self, lineno: int, reason: str) -> None:
        s = self.summary
        s.lines_skipped += 1
        if len(s.skipped) < MAX_REPORTED_SKIPS:
            s.skipped.append((lineno, reason))
        log.warning("%s:%d: skipping line: %s", self.config.games, lineno, reason)

    def route(self, rows: list[Row]) -> None:
        """A row goes straight to the output once its group is known to be written, else to the
        spool (see Groups.add)."""
        for row in rows:
            g = self.groups.add(row.group_key, row.scenario_id, row.reward)
            self.out.add(g.split, "out" if g.kept else "spool", row, g.gid)
            if row.tokenizer_fingerprint is not None:
                self.fingerprints.add(row.tokenizer_fingerprint)

    def run(self) -> None:
        config = self.config
        with config.games.open("rb", buffering=IO_BUFFER) as f:
            for lineno, line in enumerate(f, start=1):
                if line.isspace():  # not line.strip(): that copies every line to test it
                    continue
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    self.skip(lineno, f"not valid JSON, torn or corrupt ({e})")
                    continue
                if not isinstance(obj, dict):
                    self.skip(lineno, "not a JSON object")
                    continue
                try:
                    check_record_version(obj, f"{config.games}:{lineno}")
                except RecordError as e:
                    raise RecordError(f"{e}. Nothing was written.") from None
                try:
                    if config.validate_records:
                        parse_record(obj)  # a gate only: the rows are cut from the JSON
                    record_rows = rows_of_json(obj, config)
                except BadRecord as e:
                    self.skip(lineno, f"invalid record: {e}")
                    continue
                first = self.seen.setdefault(record_rows.game_id, lineno)
                if first != lineno:  # the same game twice would count twice in its group
                    self.skip(lineno, f"game id {record_rows.game_id} repeats line {first}")
                    continue
                _count(self.summary, record_rows)
                self.route(record_rows.rows)


# ---------------------------------------------------------------------------------------------
# The stage


def convert(config: ConvertConfig) -> ConvertSummary:
    """Convert a games.jsonl into train/val parquet files and a summary; see the module docstring.

    Raises RecordError for a missing or empty file or another schema version, ConvertError when no
    usable training set results; in both cases nothing is written.
    """
    games = config.games
    if not games.is_file():
        raise RecordError(f"{games} does not exist or is not a file; pass the games.jsonl path")
    # a generate still writing the games holds their folder: refused, not half-read
    with contextlib.ExitStack() as locks:
        for folder in dict.fromkeys((games.parent.resolve(), config.out.resolve())):
            locks.enter_context(folder_lock(folder, "selfplay convert"))
        return _convert_locked(config)


def _convert_locked(config: ConvertConfig) -> ConvertSummary:
    start = time.perf_counter()
    games, out = config.games, config.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.convert-*"):  # left by a killed convert (the lock is ours now)
        log.warning("removing %s, left by a convert that did not finish", stale)
        stale.unlink(missing_ok=True)
    final = {"train": out / TRAIN_FILE, "val": out / VAL_FILE, "summary": out / SUMMARY_FILE}
    for path in final.values():
        refuse_link(path)  # a rename would replace a link planted there; say so before any work
    summary = ConvertSummary(
        games_path=str(games),
        train_path=str(final["train"]),
        val_path=str(final["val"]),
        group_by=config.group_by,
        val_fraction=config.val_fraction,
        max_length=config.max_length,
        keep_degenerate=config.keep_degenerate,
        reward_shaping=config.reward_shaping,
        credit=config.credit,
    )
    # everything is written under temporary names and renamed only when all of it succeeded
    tag = f".convert-{os.getpid()}"
    tmp = {
        "train": out / f".train{tag}.parquet",
        "val": out / f".val{tag}.parquet",
        "spool_train": out / f".train{tag}.spool.arrows",
        "spool_val": out / f".val{tag}.spool.arrows",
        "summary": out / f".summary{tag}.json",
    }
    stats = Stats(config.max_length)
    writers: Writers | None = None
    try:
        writers = Writers(
            tmp,
            batch_rows=config.batch_rows,
            compression=config.compression,
            data_source=config.data_source,
            on_write=stats.add,
        )
        state = _Pass1(config, summary, writers)
        with _no_cyclic_gc():
            state.run()
        writers.close_spools()
        log.debug("pass 1 (read, cut, write, spool) took %.2fs", time.perf_counter() - start)
        _check_usable(state)
        kept = _decide_groups(state)
        for split in SPLITS:
            copy_spool(tmp[f"spool_{split}"], split, kept, writers)
        writers.close()
        summary.rows_train, summary.rows_val = writers.rows["train"], writers.rows["val"]
        _fill_summary(state, stats)
        summary.seconds = round(time.perf_counter() - start, 3)
        summary.games_per_second = round(summary.games_read / max(summary.seconds, 1e-9), 1)
        tmp["summary"].write_bytes(
            orjson.dumps(summary.model_dump(mode="json"), option=orjson.OPT_INDENT_2)
        )
        for name in ("train", "val", "summary"):
            os.replace(tmp[name], final[name])
    finally:
        if writers is not None:
            writers.close()
        for p in tmp.values():
            p.unlink(missing_ok=True)
    log.info(
        "converted %d games into %d train + %d val rows in %d groups "
        "(%d degenerate groups dropped, %d rows over %d tokens dropped) in %.1fs",
        summary.games_read,
        summary.rows_train,
        summary.rows_val,
        summary.groups_written,
        summary.groups_degenerate_dropped,
        summary.rows_dropped_over_max_length,
        config.max_length,
        summary.seconds,
    )
    return summary


def _check_usable(state: _Pass1) -> None:
    s, path = state.summary, state.config.games
    if s.games_read == 0:
        detail = ""
        if s.skipped:
            line, reason = s.skipped[0]
            detail = f" ({s.lines_skipped} lines skipped; line {line}: {reason})"
        raise RecordError(f"{path} has no usable game records{detail}; nothing was written")
    if s.rows_candidate == 0:
        raise ConvertError(
            f"{path}: none of the {s.games_read} games has a seat marked trained with recorded "
            "tokens (SeatConfig.trained and an LLM player); nothing to train on, nothing written"
        )
    if len(state.fingerprints) > 1:
        raise ConvertError(
            f"{path} mixes tokenizers (fingerprints {sorted(state.fingerprints)}); token ids of "
            "different tokenizers cannot train one model: convert the games of each model "
            "separately. Nothing was written."
        )


def _decide_groups(state: _Pass1) -> pa.Array:
    """Count the fate of every group; return the ids of the kept ones (an error if none is)."""
    s, cfg = state.summary, state.config
    kept, counts = state.groups.decide()
    for name, value in dataclasses.asdict(counts).items():
        setattr(s, name, value)
    if not kept:
        raise NoSignalError(
            f"{cfg.games}: no group carries a training signal: of {s.groups_seen} groups, "
            f"{s.groups_degenerate_dropped} have the same reward on every row and "
            f"{s.groups_singleton_dropped} have a single row "
            f"({s.rows_dropped_over_max_length} rows were over --max-length "
            f"{cfg.max_length}, {s.rows_dropped_no_own_tokens} had no own tokens). GRPO learns "
            "only where rewards differ within a scenario: play more games per scenario, start "
            "from a policy that sometimes agrees, or pass keep_degenerate (--keep-degenerate) to "
            "write them anyway. Nothing was written."
        )
    if s.groups_train == 0:
        raise ConvertError(
            f"{cfg.games}: every written group fell in the validation split "
            f"(val_fraction {cfg.val_fraction}); lower --val-fraction (0 disables validation) "
            "or play more scenarios. Nothing was written."
        )
    return pa.array(kept, pa.int64())


def _fill_summary(state: _Pass1, stats: Stats) -> None:
    s = state.summary
    s.groups_written = s.groups_train + s.groups_val
    s.rows_written = s.rows_train + s.rows_val
    if s.rows_val == 0 and state.config.val_fraction > 0:
        log.warning(
            "no scenario fell in the validation split (val_fraction %s, %d scenarios): "
            "val.parquet is empty",
            state.config.val_fraction,
            s.scenarios_train,
        )
    s.reward = stats.reward()
    s.length_total = stats.length("total")
    s.length_prompt = stats.length("prompt")
    s.length_response = stats.length("response")
    s.own_tokens = stats.length("own")
    s.tokenizer_fingerprint = next(iter(state.fingerprints), None)


# ---------------------------------------------------------------------------------------------
# Rows without groups


def rows_table(
    records: Iterable[GameRecord], config: ConvertConfig
) -> tuple[pa.Table, dict[str, int]]:
    """Every trained seat's row of ``records`` in one table (no groups decided, nothing dropped
    but rows without own tokens or over ``max_length``), cut exactly as ``convert`` cuts them;
    group ids are the group keys' hashes. For behaviour cloning, where rows need no GRPO group.
    Returns the table and the counts of rows written, without own tokens and too long. Raises
    rows.BadRecord for a record whose tokens cannot be training rows."""
    pairs: list[tuple[Row, int]] = []
    counts = {"rows": 0, "no_own": 0, "too_long": 0}
    for record in records:
        r = rows_of_record(record, config)
        counts["no_own"] += r.no_own
        counts["too_long"] += r.too_long
        pairs.extend((row, group_id(row.group_key)) for row in r.rows)
    counts["rows"] = len(pairs)
    if not pairs:
        return TRAINING_SCHEMA.empty_table(), counts
    return pa.Table.from_batches([to_batch(pairs, config.data_source)]), counts
