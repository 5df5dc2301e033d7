"""One game record to its training rows: a row per trained seat, cut from the record's tokens.

Two readers cut the same rows and refuse the same records with ``BadRecord``:

- ``rows_of_json``, the fast path ``convert`` streams through: it reads the dict orjson parsed
  from a games.jsonl line and checks by hand only the fields the cut reads (types, two seats,
  aligned token lists), without building a ``GameRecord``;
- ``rows_of_record``, the typed path: a ``GameRecord`` (``parse_record`` validates a parsed line
  into one), for records already in memory.

Both end in the same cut, which checks what a record may hold and the training file may not (ids
beyond int32, log-probs beyond float32, mask values other than 0/1, a seat with no prompt).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Any, NamedTuple

import numpy as np
from pydantic import ValidationError

from selfplay.convert.config import ConvertConfig
from selfplay.records import GameRecord, SeatTokens, known_game
from selfplay.reward import CREDITS, GameResult, game_kind, group_key, row_reward
from selfplay.seats import SeatConfig

# Speed matters here (thousands of games of ~3,000 tokens per second). The token lists go from
# the parsed JSON into typed buffers with struct.pack and bytearray, which check every value and
# are the fastest such conversions at hand (array.fromlist and numpy take 1.4-3x as long per
# value, pa.array longer still).


class BadRecord(ValueError):
    """A record that parses but is not a usable game record (convert skips and reports its line)."""


class Row(NamedTuple):
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
    off_policy: bool = False  # a scripted guide's turns (a trained seat of kind "scripted")
    temperature: float | None = None  # the seat's sampling temperature (None: not sampled)
    turn_states: np.ndarray | None = None  # int64 state id per own turn (--credit turn only)


class RecordRows(NamedTuple):
    """The rows of one record and what else it adds to the summary."""

    rows: list[Row]
    outcome: str
    no_tokens: int  # trained seats without recorded tokens
    no_own: int  # trained seats that never generated a token: no row
    too_long: int  # rows over max_length: dropped
    game_id: str = ""


class _Game(NamedTuple):
    """The record-level fields the cut reads, checked by the reader."""

    game_id: str
    scenario_id: str
    round: int
    result: GameResult  # what the row's reward reads (selfplay.reward.row_reward)
    kind: str = ""  # reward.game_kind: the game and its table size


class _SeatLists(NamedTuple):
    """One trained seat's tokens as the reader found them; the cut checks the values."""

    token_ids: list
    mask: list
    logprobs: list
    messages: Any
    fingerprint: Any
    off_policy: bool  # the seat was played by a scripted guide/teacher, not the model
    temperature: float | None  # the seat's sampling temperature, None when it did not sample


class _Drop(Enum):
    """Why a trained seat with tokens gives no row (not an error: counted in the summary)."""

    NO_OWN = "no_own"
    TOO_LONG = "too_long"


# ---------------------------------------------------------------------------------------------
# The two readers


def rows_of_json(obj: dict, config: ConvertConfig) -> RecordRows:
    """The fast path: the rows of a record as orjson parsed it. Raises BadRecord for a record
    that is not usable; the fields the cut does not read are not looked at (parse_record checks
    them all, ConvertConfig.validate_records puts it in front)."""
    game_id = _need(obj, "game_id", str)
    scenario_id = _need(obj, "scenario_id", str)
    name = known_game(obj)
    if name is None:
        raise BadRecord(f"game {obj.get('game')!r} is not a game this selfplay knows")
    rnd = obj.get("round", 0)
    if not isinstance(rnd, int) or isinstance(rnd, bool):
        raise BadRecord("round is not an int")
    reward = _finite(_need(obj, "reward", (int, float)))
    seats = _need(obj, "seats", list)
    tokens = obj.get("tokens", [None, None])
    if len(seats) != 2 or not isinstance(tokens, list) or len(tokens) != 2:
        raise BadRecord("seats and tokens must each have two entries (seats 0 and 1)")
    kind = game_kind(name, obj.get("scenario"))
    game = _Game(game_id, scenario_id, rnd, GameResult.of_json(obj, reward), kind)
    return _rows(game, _json_seats(seats, tokens), config, from_json=True)


def rows_of_record(record: GameRecord, config: ConvertConfig) -> RecordRows:
    """The typed path: the rows of a GameRecord, exactly those rows_of_json cuts from its JSON.
    Raises BadRecord where the record holds values the training file cannot."""
    game = _Game(
        record.game_id,
        record.scenario_id,
        record.round,
        GameResult.of_record(record, _finite(record.reward)),
        game_kind(record.game.name, record.scenario),
    )
    seats = (
        (seat, _seat_lists(t, record.seats[seat]))
        for seat, t in enumerate(record.tokens)
        if record.seats[seat].trained
    )
    return _rows(game, seats, config, from_json=False)


def _seat_lists(t: SeatTokens | None, seat: SeatConfig) -> _SeatLists | None:
    if t is None:
        return None
    temperature = seat.sampling.temperature if seat.sampling is not None else None
    return _SeatLists(
        t.token_ids, t.mask, t.logprobs, t.messages, t.tokenizer_fingerprint,
        seat.kind == "scripted", temperature,
    )  # fmt: skip


def parse_record(obj: dict) -> GameRecord:
    """Full pydantic validation of a parsed line; BadRecord naming the first invalid field."""
    try:
        return GameRecord.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise BadRecord(f"{loc}: {err['msg']}") from None


def _need(obj: dict, name: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise BadRecord(
            f"{where}{name} is missing or not a {' or '.join(k.__name__ for k in kinds)}"
        )
    return value


def _finite(reward: float) -> float:
    if not math.isfinite(reward):
        raise BadRecord(f"reward {reward!r} is not a finite number")
    return float(reward)


def _temperature(sampling: Any) -> float | None:
    """A parsed seat's sampling temperature (None when the seat records no sampling)."""
    t = sampling.get("temperature") if isinstance(sampling, dict) else None
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


def _json_seats(seats: list, tokens: list) -> Iterator[tuple[int, _SeatLists | None]]:
    """The trained seats of a parsed record with their token lists (None: no tokens recorded).
    A generator, so each seat is checked when the cut reaches it: of two faults, the reason
    reported is the first one met, seat 0's cut before seat 1's fields."""
    for seat in (0, 1):
        seat_cfg = seats[seat]
        if not isinstance(seat_cfg, dict):
            raise BadRecord(f"seats[{seat}] is not an object")
        if not seat_cfg.get("trained", False):
            continue
        tok = tokens[seat]
        if tok is None:
            yield seat, None
            continue
        if not isinstance(tok, dict):
            raise BadRecord(f"tokens[{seat}] is not an object")
        where = f"tokens[{seat}]."
        yield (
            seat,
            _SeatLists(
                _need(tok, "token_ids", list, where),
                _need(tok, "mask", list, where),
                _need(tok, "logprobs", list, where),
                tok.get("messages") or [],
                tok.get("tokenizer_fingerprint"),
                seat_cfg.get("kind") == "scripted",
                _temperature(seat_cfg.get("sampling")),
            ),
        )


# ---------------------------------------------------------------------------------------------
# The cut, shared by both readers


def _rows(
    game: _Game,
    seats: Iterable[tuple[int, _SeatLists | None]],
    config: ConvertConfig,
    *,
    from_json: bool,
) -> RecordRows:
    rows: list[Row] = []
    no_tokens = no_own = too_long = 0
    for seat, tok in seats:
        if tok is None:
            no_tokens += 1
            continue
        row = _cut(game, seat, tok, config, from_json)
        if row is _Drop.NO_OWN:
            no_own += 1
        elif row is _Drop.TOO_LONG:
            too_long += 1
        else:
            rows.append(row)
    return RecordRows(rows, game.result.outcome, no_tokens, no_own, too_long, game.game_id)


def _cut(
    game: _Game, seat: int, tok: _SeatLists, config: ConvertConfig, from_json: bool
) -> Row | _Drop:
    """Check one seat's tokens and cut its row: the prompt is the tokens before the seat's first
    generated token, the response the rest up to its last generated token. Trailing partner and
    template tokens are context for nothing and are trimmed, so the last response token is the
    seat's own and a trainer that puts the reward on the last token puts it there. ``from_json``:
    the values came from orjson, which has no inf or nan."""
    where = f"tokens[{seat}]."
    n = len(tok.token_ids)
    if len(tok.mask) != n or len(tok.logprobs) != n:
        raise BadRecord(
            f"tokens[{seat}]: token_ids ({n}), mask ({len(tok.mask)}) and logprobs "
            f"({len(tok.logprobs)}) must have the same length"
        )
    messages, fingerprint = tok.messages, tok.fingerprint
    if not isinstance(messages, list) or not all(
        type(m) is dict and type(m.get("role")) is str and type(m.get("content")) is str
        for m in messages
    ):
        raise BadRecord(f"{where}messages must be a list of {{role, content}} strings")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise BadRecord(f"{where}tokenizer_fingerprint is not a string")
    try:
        mask = bytearray(tok.mask)  # checks: ints in 0..255 (3x faster than bytes())
    except (TypeError, ValueError):
        raise BadRecord(f"{where}mask values must be 0 or 1") from None
    n_own = mask.count(1)
    if n_own + mask.count(0) != n:
        raise BadRecord(f"{where}mask values must be 0 or 1")
    if n_own == 0:
        return _Drop.NO_OWN
    first, end = mask.find(1), mask.rfind(1) + 1
    if first == 0:
        raise BadRecord(f"tokens[{seat}] starts with a generated token: there is no prompt")
    try:
        ids = np.frombuffer(struct.pack(f"={n}i", *tok.token_ids), np.int32)  # checks: int32
    except struct.error as e:
        raise BadRecord(f"{where}token_ids must be int32 ({e})") from None
    if ids.min() < 0:
        raise BadRecord(f"{where}token_ids must not be negative")
    try:
        # checks: numbers that fit float32 (struct refuses larger ones); JSON has no inf or nan,
        # a GameRecord in memory may hold them (a check of 2 us a seat the fast path skips)
        lp = tok.logprobs[first:end]
        logprobs = np.frombuffer(struct.pack(f"={end - first}f", *lp), np.float32)
        finite = from_json or bool(np.isfinite(logprobs).all())
    except (struct.error, OverflowError):
        finite = False
    if not finite:
        raise BadRecord(f"{where}logprobs must be finite float32 numbers")
    if end > config.max_length:
        return _Drop.TOO_LONG
    response_mask = np.frombuffer(mask, np.int8)[first:end]
    states = CREDITS[config.credit].states  # the turn states of --credit turn
    turn_states = None
    if states is not None:
        turn_states = states(ids[:first], ids[first:end], response_mask, seat)
    return Row(
        group_key=group_key(config.group_by, game.scenario_id, game.round, seat, game.kind),
        game_id=game.game_id,
        scenario_id=game.scenario_id,
        seat=seat,
        round=game.round,
        prompt_ids=ids[:first],
        response_ids=ids[first:end],
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        reward=row_reward(
            game.result, seat, invalid_penalty=config.invalid_penalty, shaping=config.reward_shaping
        ),
        tokenizer_fingerprint=fingerprint,
        messages=messages,
        n_prompt_messages=next(
            (i for i, m in enumerate(messages) if m["role"] == "assistant"),
            len(messages),
        ),
        off_policy=tok.off_policy,
        temperature=None if tok.off_policy else tok.temperature,
        turn_states=turn_states,
    )
