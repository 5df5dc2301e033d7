"""Games to GRPO training rows: one parquet row per (game, trained seat), grouped across games.

``convert(ConvertConfig) -> ConvertSummary`` reads a games.jsonl and writes ``train.parquet``,
``val.parquet`` (both with ``records.TRAINING_SCHEMA``) and ``convert_summary.json``.

Why groups span games: the matching game is cooperative, so both seats of one game get the same
reward, and GRPO's advantage (r - group mean) / group std is 0 for a group of equal rewards. A
group is therefore every trained row of one scenario in one round (``group_by="scenario"``) or of
one scenario, round and seat (``"scenario-seat"``). Groups whose rewards are all equal carry no
signal and are dropped unless ``keep_degenerate``; a group of one row is never written (its
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
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import math
import os
import struct
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from selfplay.errors import UserError
from selfplay.records import SCHEMA_VERSION, TRAINING_SCHEMA, GameRecord, RecordError

log = logging.getLogger(__name__)

TRAIN_FILE = "train.parquet"
VAL_FILE = "val.parquet"
SUMMARY_FILE = "convert_summary.json"
MAX_REPORTED_SKIPS = 100  # the summary lists this many skipped lines; the count is always exact
# file buffers: a game is a ~100 KB line and a spooled batch a few MB; with the default 8 KB a line
# is copied in many pieces and the spool written in thousands of small system calls
_IO_BUFFER = 1 << 20


class ConvertError(UserError, ValueError):
    """The games cannot give a usable training set; the message says what to change."""


class NoSignalError(ConvertError):
    """Every group is degenerate (equal rewards) or a singleton: the games carry no signal."""


class GroupBy(StrEnum):
    SCENARIO = "scenario"  # every trained row of a scenario (both seats) in one round
    SCENARIO_SEAT = "scenario-seat"  # as above, but each seat is its own group


class ConvertConfig(BaseModel):
    """Options of the convert stage (``selfplay convert``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    games: Path = Field(description="games.jsonl to read")
    out: Path = Field(description="directory for train.parquet, val.parquet, convert_summary.json")
    group_by: GroupBy = GroupBy.SCENARIO
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # training never reads val rows
    max_length: int = Field(4096, ge=2, description="rows with more prompt+response tokens drop")
    keep_degenerate: bool = False
    # a seat whose invalid actions ended the game (outcome "invalid") gets -invalid_penalty
    # instead of the shared 0; its partner keeps 0 (a per-seat format penalty, as in SPIRAL)
    invalid_penalty: float = Field(0.0, ge=0.0)
    validate_records: bool = Field(False, description="full pydantic validation (slower)")
    batch_rows: int = Field(256, ge=1, description="rows per parquet row group")
    compression: Literal["zstd", "lz4", "snappy", "none"] = "zstd"
    data_source: str = "selfplay/dialop-matching"


class LengthStats(BaseModel):
    """Nearest-rank percentiles of a per-row token count over the written rows."""

    mean: float = 0.0
    p50: int = 0
    p90: int = 0
    p99: int = 0
    max: int = 0


class RewardStats(BaseModel):
    """The reward over the written rows (population std)."""

    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0


class ConvertSummary(BaseModel):
    """What one conversion read, dropped and wrote (also saved as convert_summary.json)."""

    games_path: str
    train_path: str
    val_path: str
    group_by: GroupBy
    val_fraction: float
    max_length: int
    keep_degenerate: bool
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
# compression a quarter. The token lists go from the parsed JSON into typed buffers with
# struct.pack and bytearray, which check every value and are the fastest such conversions at
# hand (array.fromlist and numpy take 1.4-3x as long per value, pa.array longer still); each
# batch becomes Arrow list arrays by copying those buffers once, into memory of Arrow's pool.

_MESSAGES_TYPE = TRAINING_SCHEMA.field("messages").type
_REWARD_MODEL_FIELDS = list(TRAINING_SCHEMA.field("reward_model").type)
_EXTRA_INFO_FIELDS = list(TRAINING_SCHEMA.field("extra_info").type)
_DICT_COLUMNS = ["group_key", "scenario_id", "tokenizer_fingerprint", "data_source"]
_SPLITS = ("train", "val")


class _BadRecord(ValueError):
    """A line that parses as JSON but is not a usable game record (skipped and reported)."""


class _Row(NamedTuple):
    """One cut row; token data already in typed arrays (validated) ready to be joined."""

    group_key: str
    game_id: str
    scenario_id: str
    seat: int
    round: int
    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    response_mask: np.ndarray  # int8 0/1
    rollout_logprobs: np.ndarray  # float32
    reward: float
    tokenizer_fingerprint: str | None
    messages: list[dict[str, str]]
    n_prompt_messages: int


class _LineCounts(NamedTuple):
    """What one valid record adds to the summary besides its rows."""

    outcome: str
    no_tokens: int
    no_own: int
    too_long: int
    rows: int

    def apply(self, s: ConvertSummary) -> None:
        s.games_read += 1
        s.outcomes[self.outcome] = s.outcomes.get(self.outcome, 0) + 1
        s.trained_seats_without_tokens += self.no_tokens
        s.rows_candidate += self.rows + self.no_own + self.too_long
        s.rows_dropped_no_own_tokens += self.no_own
        s.rows_dropped_over_max_length += self.too_long


@dataclass(slots=True)
class _Group:
    gid: int  # group_id(key): independent of file order
    split: str  # "train" | "val"
    scenario_id: str
    rows: int = 0
    lo: float = math.inf  # reward range as float32, the precision the file stores
    hi: float = -math.inf
    kept: bool = False  # known to be written: never changes back once True


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def is_val_scenario(scenario_id: str, val_fraction: float) -> bool:
    """Whether a scenario is in the validation split: a stable hash of its id, not file order."""
    if val_fraction <= 0.0:
        return False
    h = hashlib.blake2b(scenario_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < val_fraction


def group_id(key: str) -> int:
    """A non-negative int64 from the group key (blake2b), the same in every file order."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def group_key(group_by: GroupBy, scenario_id: str, round: int, seat: int) -> str:
    """The readable group key. The round is part of it: one group = one policy on one scenario."""
    key = f"{scenario_id}/r{round}"
    return key + f"/seat{seat}" if group_by is GroupBy.SCENARIO_SEAT else key


def _need(obj: dict, name: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise _BadRecord(
            f"{where}{name} is missing or not a {' or '.join(k.__name__ for k in kinds)}"
        )
    return value


def _rows_of_record(obj: dict, config: ConvertConfig) -> tuple[list[_Row], _LineCounts]:
    """The training rows of one parsed record; raises _BadRecord for a record that is not usable."""
    game_id = _need(obj, "game_id", str)
    scenario_id = _need(obj, "scenario_id", str)
    rnd = obj.get("round", 0)
    if not isinstance(rnd, int) or isinstance(rnd, bool):
        raise _BadRecord("round is not an int")
    reward = _need(obj, "reward", (int, float))
    if not math.isfinite(reward):
        raise _BadRecord(f"reward {reward!r} is not a finite number")
    seats = _need(obj, "seats", list)
    tokens = obj.get("tokens", [None, None])
    if len(seats) != 2 or not isinstance(tokens, list) or len(tokens) != 2:
        raise _BadRecord("seats and tokens must each have two entries (seats 0 and 1)")

    rows: list[_Row] = []
    no_tokens = no_own = too_long = 0
    offender = _invalid_offender(obj) if config.invalid_penalty else None
    for seat in (0, 1):
        seat_cfg = seats[seat]
        if not isinstance(seat_cfg, dict):
            raise _BadRecord(f"seats[{seat}] is not an object")
        if not seat_cfg.get("trained", False):
            continue
        tok = tokens[seat]
        if tok is None:
            no_tokens += 1
            continue
        if not isinstance(tok, dict):
            raise _BadRecord(f"tokens[{seat}] is not an object")
        row = _cut(tok, seat, config)
        if row == "no_own":
            no_own += 1
        elif row == "too_long":
            too_long += 1
        else:
            ids, first, end, mask, logprobs, messages, fingerprint = row
            rows.append(
                _Row(
                    group_key=group_key(config.group_by, scenario_id, rnd, seat),
                    game_id=game_id,
                    scenario_id=scenario_id,
                    seat=seat,
                    round=rnd,
                    prompt_ids=ids[:first],
                    response_ids=ids[first:end],
                    response_mask=np.frombuffer(mask, np.int8)[first:end],
                    rollout_logprobs=logprobs,
                    reward=-config.invalid_penalty if seat == offender else float(reward),
                    tokenizer_fingerprint=fingerprint,
                    messages=messages,
                    n_prompt_messages=next(
                        (i for i, m in enumerate(messages) if m["role"] == "assistant"),
                        len(messages),
                    ),
                )
            )
    counts = _LineCounts(str(obj.get("outcome")), no_tokens, no_own, too_long, len(rows))
    return rows, counts


def _invalid_offender(obj: dict) -> int | None:
    """The seat whose consecutive invalid actions ended a game with outcome "invalid"."""
    if obj.get("outcome") != "invalid":
        return None
    actions = obj.get("actions")
    if not isinstance(actions, list) or not actions or not isinstance(actions[-1], dict):
        return None
    seat = actions[-1].get("seat")
    return seat if seat in (0, 1) else None


def _cut(
    tok: dict, seat: int, config: ConvertConfig
) -> (
    tuple[np.ndarray, int, int, bytearray, np.ndarray, list, str | None]
    | Literal["no_own", "too_long"]
):
    """Check one seat's tokens and find its prompt/response cut; "no_own" / "too_long" to drop.

    Returns (token ids, first own index, one past the last own index, mask bytes, response
    log-probs, messages, tokenizer fingerprint)."""
    where = f"tokens[{seat}]."
    ids_list = _need(tok, "token_ids", list, where)
    mask_list = _need(tok, "mask", list, where)
    lp_list = _need(tok, "logprobs", list, where)
    n = len(ids_list)
    if len(mask_list) != n or len(lp_list) != n:
        raise _BadRecord(
            f"tokens[{seat}]: token_ids ({n}), mask ({len(mask_list)}) and logprobs "
            f"({len(lp_list)}) must have the same length"
        )
    messages = tok.get("messages") or []
    fingerprint = tok.get("tokenizer_fingerprint")
    if not isinstance(messages, list) or not all(
        type(m) is dict and type(m.get("role")) is str and type(m.get("content")) is str
        for m in messages
    ):
        raise _BadRecord(f"{where}messages must be a list of {{role, content}} strings")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise _BadRecord(f"{where}tokenizer_fingerprint is not a string")
    try:
        mask = bytearray(mask_list)  # checks: ints in 0..255 (3x faster than bytes())
    except (TypeError, ValueError):
        raise _BadRecord(f"{where}mask values must be 0 or 1") from None
    n_own = mask.count(1)
    if n_own + mask.count(0) != n:
        raise _BadRecord(f"{where}mask values must be 0 or 1")
    if n_own == 0:
        return "no_own"
    first, end = mask.find(1), mask.rfind(1) + 1
    if first == 0:
        raise _BadRecord(f"tokens[{seat}] starts with a generated token: there is no prompt")
    try:
        ids = np.frombuffer(struct.pack(f"={n}i", *ids_list), np.int32)  # checks: int32
    except struct.error as e:
        raise _BadRecord(f"{where}token_ids must be int32 ({e})") from None
    if ids.min() < 0:
        raise _BadRecord(f"{where}token_ids must not be negative")
    try:
        # checks: numbers that fit float32 (struct refuses larger ones; JSON has no inf or nan,
        # so every packed log-prob is finite)
        logprobs = np.frombuffer(struct.pack(f"={end - first}f", *lp_list[first:end]), np.float32)
    except (struct.error, OverflowError):
        raise _BadRecord(f"{where}logprobs must be finite float32 numbers") from None
    if end > config.max_length:
        return "too_long"
    return ids, first, end, mask, logprobs, messages, fingerprint


def rows_table(
    records: Iterable[GameRecord], config: ConvertConfig
) -> tuple[pa.Table, dict[str, int]]:
    """Every trained seat's row of ``records`` in one table (no groups decided, nothing dropped
    but rows without own tokens or over ``max_length``), cut exactly as ``convert`` cuts them;
    group ids are the group keys' hashes. For behaviour cloning, where rows need no GRPO group.
    Returns the table and the counts of rows written, without own tokens and too long."""
    pairs: list[tuple[_Row, int]] = []
    counts = {"rows": 0, "no_own": 0, "too_long": 0}
    for record in records:
        rows, c = _rows_of_record(orjson.loads(record.model_dump_json()), config)
        counts["no_own"] += c.no_own
        counts["too_long"] += c.too_long
        pairs.extend((row, group_id(row.group_key)) for row in rows)
    counts["rows"] = len(pairs)
    if not pairs:
        return TRAINING_SCHEMA.empty_table(), counts
    return pa.Table.from_batches([_batch(pairs, config.data_source)]), counts


def _list_array(
    chunks: list[np.ndarray], lengths: np.ndarray, dtype: type, arrow_type: pa.DataType
) -> pa.Array:
    """One list array of the rows' token arrays. The values are copied into a buffer of Arrow's
    memory pool, which keeps its pages between batches: a bytes object of over a MB for every
    batch (b"".join) was mapped fresh from the kernel each time, at a page fault per 4 KB."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    buf = pa.allocate_buffer(int(offsets[-1]) * np.dtype(dtype).itemsize)
    np.concatenate(chunks, out=np.frombuffer(buf, dtype=dtype))
    values = pa.Array.from_buffers(arrow_type.value_type, int(offsets[-1]), [None, buf])
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=arrow_type)


def _batch(rows: list[tuple[_Row, int]], data_source: str) -> pa.RecordBatch:
    """(row, group id) pairs -> one batch in TRAINING_SCHEMA, from flat buffers."""
    f = TRAINING_SCHEMA.field
    n = len(rows)
    n_prompt = np.fromiter((len(r.prompt_ids) for r, _ in rows), np.int64, n)
    n_response = np.fromiter((len(r.response_ids) for r, _ in rows), np.int64, n)
    gid = pa.array([g for _, g in rows], pa.int64())
    game_id = pa.array([r.game_id for r, _ in rows], pa.string())
    seat = pa.array([r.seat for r, _ in rows], pa.int8())
    reward = pa.array([r.reward for r, _ in rows], pa.float32())
    messages = pa.array([r.messages for r, _ in rows], type=_MESSAGES_TYPE)
    columns = {
        "group_id": gid,
        "group_key": pa.array([r.group_key for r, _ in rows], pa.string()),
        "game_id": game_id,
        "scenario_id": pa.array([r.scenario_id for r, _ in rows], pa.string()),
        "seat": seat,
        "round": pa.array([r.round for r, _ in rows], pa.int32()),
        "prompt_ids": _list_array(
            [r.prompt_ids for r, _ in rows], n_prompt, np.int32, f("prompt_ids").type
        ),
        "response_ids": _list_array(
            [r.response_ids for r, _ in rows], n_response, np.int32, f("response_ids").type
        ),
        "response_mask": _list_array(
            [r.response_mask for r, _ in rows], n_response, np.int8, f("response_mask").type
        ),
        "rollout_logprobs": _list_array(
            [r.rollout_logprobs for r, _ in rows],
            n_response,
            np.float32,
            f("rollout_logprobs").type,
        ),
        "reward": reward,
        "tokenizer_fingerprint": pa.array([r.tokenizer_fingerprint for r, _ in rows], pa.string()),
        "messages": messages,
        "data_source": pa.repeat(pa.scalar(data_source, pa.string()), n),
        # converted again rather than cut from `messages`: a take is slower for a few messages
        "prompt": pa.array(
            [r.messages[: r.n_prompt_messages] for r, _ in rows], type=_MESSAGES_TYPE
        ),
        "reward_model": pa.StructArray.from_arrays(
            [pa.repeat(pa.scalar("rule", pa.string()), n), reward], fields=_REWARD_MODEL_FIELDS
        ),
        "extra_info": pa.StructArray.from_arrays([gid, game_id, seat], fields=_EXTRA_INFO_FIELDS),
    }
    return pa.RecordBatch.from_arrays(
        [columns[f.name] for f in TRAINING_SCHEMA], schema=TRAINING_SCHEMA
    )


def _ones_per_list(lists: pa.ListArray) -> np.ndarray:
    """How many values of each list of a 0/1 list array are 1. One count per list: a sum over
    the whole batch at once would first cast every int8 value to a new int64 array."""
    offsets = lists.offsets.to_numpy().tolist()
    values = lists.values.to_numpy()
    return np.fromiter(
        (np.count_nonzero(values[a:b]) for a, b in itertools.pairwise(offsets)),
        np.int64,
        len(lists),
    )


class _Stats:
    """Reward moments and token-length histograms of the written rows (constant memory)."""

    def __init__(self, max_length: int) -> None:
        self.n, self.total, self.total_sq = 0, 0.0, 0.0
        self.lo, self.hi = math.inf, -math.inf
        self.hists = {k: _Hist(max_length) for k in ("total", "prompt", "response", "own")}

    def add(self, batch: pa.RecordBatch) -> None:
        r = batch["reward"].to_numpy().astype(np.float64)
        self.n += len(r)
        self.total += float(r.sum())
        self.total_sq += float((r * r).sum())
        self.lo = min(self.lo, float(r.min()))
        self.hi = max(self.hi, float(r.max()))
        prompt = pc.list_value_length(batch["prompt_ids"]).to_numpy()
        response = pc.list_value_length(batch["response_ids"]).to_numpy()
        own = _ones_per_list(batch["response_mask"])
        self.hists["prompt"].add(prompt)
        self.hists["response"].add(response)
        self.hists["total"].add(prompt + response)
        self.hists["own"].add(own)

    def reward(self) -> RewardStats:
        if self.n == 0:
            return RewardStats()
        mean = self.total / self.n
        var = max(self.total_sq / self.n - mean * mean, 0.0)
        return RewardStats(
            mean=round(mean, 6), std=round(math.sqrt(var), 6), min=self.lo, max=self.hi
        )


class _Hist:
    """Exact counts of a bounded non-negative integer, for percentiles in constant memory."""

    def __init__(self, size: int) -> None:
        self.counts = np.zeros(size + 1, dtype=np.int64)

    def add(self, values: np.ndarray) -> None:
        self.counts += np.bincount(values, minlength=len(self.counts))[: len(self.counts)]

    def stats(self) -> LengthStats:
        n = int(self.counts.sum())
        if n == 0:
            return LengthStats()
        cum = np.cumsum(self.counts)
        values = np.arange(len(self.counts))

        def pct(p: float) -> int:
            return int(np.searchsorted(cum, math.ceil(p / 100 * n)))

        return LengthStats(
            mean=round(float((self.counts * values).sum()) / n, 2),
            p50=pct(50),
            p90=pct(90),
            p99=pct(99),
            max=int(values[self.counts > 0].max()),
        )


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


class _Writers:
    """The two parquet outputs and the two spools, each fed in batches of rows."""

    def __init__(self, config: ConvertConfig, paths: dict[str, Path], stats: _Stats) -> None:
        self.config, self.stats = config, stats
        self.rows = {"train": 0, "val": 0}
        self.pending: dict[tuple[str, str], list[tuple[_Row, int]]] = {}
        self.parquet: dict[str, pq.ParquetWriter] = {}
        self.spools: dict[str, pa.ipc.RecordBatchStreamWriter] = {}
        self._files: list[pa.NativeFile] = []
        for split in _SPLITS:
            self.parquet[split] = pq.ParquetWriter(
                str(paths[split]),
                TRAINING_SCHEMA,
                compression=config.compression,
                # dictionary encoding of token lists costs 4x the write time for nothing
                use_dictionary=_DICT_COLUMNS,
                write_statistics=False,  # min/max of token lists help no reader and cost 20%
            )
            # buffered: the IPC writer issues a write call for every buffer of a batch
            sink = pa.output_stream(str(paths[f"spool_{split}"]), buffer_size=_IO_BUFFER)
            self._files.append(sink)
            self.spools[split] = pa.ipc.new_stream(sink, TRAINING_SCHEMA)
            for dest in ("out", "spool"):
                self.pending[(split, dest)] = []

    def add(self, split: str, dest: str, row: _Row, gid: int) -> None:
        batch = self.pending[(split, dest)]
        batch.append((row, gid))
        if len(batch) >= self.config.batch_rows:
            self.flush(split, dest)

    def flush(self, split: str, dest: str) -> None:
        rows = self.pending[(split, dest)]
        if not rows:
            return
        batch = _batch(rows, self.config.data_source)
        rows.clear()
        if dest == "out":
            self.write(split, batch)
        else:
            self.spools[split].write_batch(batch)

    def write(self, split: str, batch: pa.RecordBatch) -> None:
        self.stats.add(batch)
        self.parquet[split].write_batch(batch)
        self.rows[split] += batch.num_rows

    def close_spools(self) -> None:
        for key in self.pending:
            self.flush(*key)
        for spool in self.spools.values():
            spool.close()
        for f in self._files:
            f.close()
        self._files = []

    def close(self) -> None:
        for f in self._files:
            f.close()
        for w in self.parquet.values():
            w.close()


class _Pass1:
    """Streams the games once: skips bad lines, cuts rows, tracks groups, routes rows."""

    def __init__(self, config: ConvertConfig, summary: ConvertSummary, out: _Writers) -> None:
        self.config, self.summary, self.out = config, summary, out
        self.groups: dict[str, _Group] = {}
        self.fingerprints: set[str] = set()

    def skip(self, lineno: int, reason: str) -> None:
        s = self.summary
        s.lines_skipped += 1
        if len(s.skipped) < MAX_REPORTED_SKIPS:
            s.skipped.append((lineno, reason))
        log.warning("%s:%d: skipping line: %s", self.config.games, lineno, reason)

    def route(self, rows: list[_Row]) -> None:
        """A row goes straight to the output once its group is known to be written: it has two
        rows and two different rewards (or two rows, with keep_degenerate). Earlier rows of a
        group wait in the spool; in a normal run that is a small fraction of all rows."""
        config = self.config
        for row in rows:
            g = self.groups.get(row.group_key)
            if g is None:
                val = is_val_scenario(row.scenario_id, config.val_fraction)
                g = self.groups[row.group_key] = _Group(
                    group_id(row.group_key), "val" if val else "train", row.scenario_id
                )
            r = _f32(row.reward)
            g.rows += 1
            g.lo = min(g.lo, r)
            g.hi = max(g.hi, r)
            if not g.kept and g.rows >= 2 and (g.lo != g.hi or config.keep_degenerate):
                g.kept = True
            self.out.add(g.split, "out" if g.kept else "spool", row, g.gid)
            if row.tokenizer_fingerprint is not None:
                self.fingerprints.add(row.tokenizer_fingerprint)

    def run(self) -> None:
        config = self.config
        with config.games.open("rb", buffering=_IO_BUFFER) as f:
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
                version = obj.get("schema_version")
                if version != SCHEMA_VERSION:
                    raise RecordError(
                        f"{config.games}:{lineno}: schema_version {version!r}, this selfplay "
                        f"reads {SCHEMA_VERSION}; regenerate the games or use a matching selfplay "
                        "version. Nothing was written."
                    )
                if config.validate_records:
                    try:
                        GameRecord.model_validate(obj)
                    except ValidationError as e:
                        err = e.errors()[0]
                        loc = ".".join(str(p) for p in err["loc"])
                        self.skip(lineno, f"invalid record: {loc}: {err['msg']}")
                        continue
                try:
                    rows, counts = _rows_of_record(obj, config)
                except _BadRecord as e:
                    self.skip(lineno, f"invalid record: {e}")
                    continue
                counts.apply(self.summary)
                self.route(rows)


def _copy_spool(path: Path, split: str, kept: pa.Array, out: _Writers) -> None:
    """Pass 2: the spooled rows of groups that turned out to be kept go to the output."""
    with pa.input_stream(str(path), buffer_size=_IO_BUFFER) as source:
        for batch in pa.ipc.open_stream(source):
            batch = batch.filter(pc.is_in(batch["group_id"], value_set=kept))
            if batch.num_rows:
                out.write(split, batch)


# ---------------------------------------------------------------------------------------------
# The stage


def convert(config: ConvertConfig) -> ConvertSummary:
    """Convert a games.jsonl into train/val parquet files and a summary; see the module docstring.

    Raises RecordError for a missing or empty file or another schema version, ConvertError when no
    usable training set results; in both cases nothing is written.
    """
    start = time.perf_counter()
    games = config.games
    if not games.is_file():
        raise RecordError(f"{games} does not exist or is not a file; pass the games.jsonl path")
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    final = {"train": out / TRAIN_FILE, "val": out / VAL_FILE, "summary": out / SUMMARY_FILE}
    summary = ConvertSummary(
        games_path=str(games),
        train_path=str(final["train"]),
        val_path=str(final["val"]),
        group_by=config.group_by,
        val_fraction=config.val_fraction,
        max_length=config.max_length,
        keep_degenerate=config.keep_degenerate,
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
    stats = _Stats(config.max_length)
    writers: _Writers | None = None
    try:
        writers = _Writers(config, tmp, stats)
        state = _Pass1(config, summary, writers)
        with _no_cyclic_gc():
            state.run()
        writers.close_spools()
        log.debug("pass 1 (read, cut, write, spool) took %.2fs", time.perf_counter() - start)
        _check_usable(state)
        kept = _decide_groups(state)
        for split in _SPLITS:
            _copy_spool(tmp[f"spool_{split}"], split, kept, writers)
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
    kept: list[int] = []
    s.groups_seen = len(state.groups)
    for g in state.groups.values():
        if g.kept:
            kept.append(g.gid)
            s.groups_degenerate_kept += g.lo == g.hi
            if g.split == "train":
                s.groups_train += 1
                s.groups_train_with_signal += g.lo != g.hi
            else:
                s.groups_val += 1
        elif g.rows < 2:
            s.groups_singleton_dropped += 1
        else:
            s.groups_degenerate_dropped += 1
            s.rows_in_degenerate_groups_dropped += g.rows
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


def _fill_summary(state: _Pass1, stats: _Stats) -> None:
    s = state.summary
    s.groups_written = s.groups_train + s.groups_val
    s.rows_written = s.rows_train + s.rows_val
    scenarios: dict[str, set[str]] = {"train": set(), "val": set()}
    for g in state.groups.values():
        if g.kept:
            scenarios[g.split].add(g.scenario_id)
    s.scenarios_train, s.scenarios_val = len(scenarios["train"]), len(scenarios["val"])
    if s.rows_val == 0 and state.config.val_fraction > 0:
        log.warning(
            "no scenario fell in the validation split (val_fraction %s, %d scenarios): "
            "val.parquet is empty",
            state.config.val_fraction,
            s.scenarios_train,
        )
    s.reward = stats.reward()
    s.length_total = stats.hists["total"].stats()
    s.length_prompt = stats.hists["prompt"].stats()
    s.length_response = stats.hists["response"].stats()
    s.own_tokens = stats.hists["own"].stats()
    s.tokenizer_fingerprint = next(iter(state.fingerprints), None)
