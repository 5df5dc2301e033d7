"""Tests of `selfplay convert`: games.jsonl -> GRPO training rows (selfplay/convert/)."""

from __future__ import annotations

import math
import random
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from selfplay.convert import (
    SUMMARY_FILE,
    ConvertConfig,
    ConvertError,
    ConvertSummary,
    convert,
    group_id,
    is_val_scenario,
)
from selfplay.convert.rows import (
    BadRecord,
    RecordRows,
    parse_record,
    rows_of_json,
    rows_of_record,
)
from selfplay.fileio import LOCK_NAME, FolderBusy, folder_lock
from selfplay.game.api import Outcome
from selfplay.game.matching.rules import generate_scenario
from selfplay.records import (
    TRAINING_SCHEMA,
    ActionRecord,
    GameRecord,
    RecordError,
    SeatConfig,
    SeatTokens,
    dump_record,
    iter_game_records,
)
from tests.fakes import mask_runs

LLM = SeatConfig(kind="llm", name="tiny", trained=True)
FIXED = SeatConfig(kind="scripted", name="cooperative", trained=False)
_SCENARIOS: dict[str, object] = {}


def scenario(sid: str):
    if sid not in _SCENARIOS:
        base = generate_scenario(len(_SCENARIOS), n=3, hard=False)
        _SCENARIOS[sid] = base.model_copy(update={"id": sid})
    return _SCENARIOS[sid]


def hand_tokens(seat: int, turns: int = 2, fingerprint: str | None = "fp") -> SeatTokens:
    """A hand-made token scheme: prompt 100+seat, 101, 102; own tokens 200+; partner 300+.

    Own turns are [2*10+seat*5+t, ...]; every own token has log-prob -(id / 1000).
    """
    ids, mask = [100 + seat, 101, 102], [0, 0, 0]
    messages = [{"role": "user", "content": f"intro seat {seat}"}]
    for t in range(turns):
        own = [200 + 10 * t + seat, 201 + 10 * t + seat]
        ids += own
        mask += [1, 1]
        messages.append({"role": "assistant", "content": f"own {t}"})
        ids += [300 + t, 301 + t, 302 + t]
        mask += [0, 0, 0]
        messages.append({"role": "user", "content": f"partner {t}"})
    logprobs = [-(i / 1000) if m else 0.0 for i, m in zip(ids, mask)]
    return SeatTokens(
        token_ids=ids, mask=mask, logprobs=logprobs, messages=messages,
        tokenizer_fingerprint=fingerprint,
    )  # fmt: skip


def game(
    gid: str,
    sid: str,
    reward: float,
    *,
    tokens: tuple[SeatTokens | None, SeatTokens | None] | None = None,
    seats: tuple[SeatConfig, SeatConfig] = (LLM, LLM),
    round: int = 0,
    actions: list[ActionRecord] | None = None,
) -> GameRecord:
    if tokens is None:
        tokens = tuple(hand_tokens(s) if seats[s].trained else None for s in (0, 1))
    return GameRecord(
        game_id=gid,
        scenario_id=sid,
        round=round,
        seed=0,
        scenario=scenario(sid),
        seats=seats,
        actions=actions or [],
        tokens=tokens,
        outcome=Outcome.ACCEPTED if reward > 0 else Outcome.MAX_ACTIONS,
        score=int(reward * 100),
        reward=reward,
    )


def write(path: Path, records: list, extra_lines: dict[int, bytes] | None = None) -> Path:
    """Write records as JSONL; extra_lines inserts raw lines at 1-based line numbers."""
    lines = [dump_record(r) if isinstance(r, GameRecord) else r for r in records]
    for lineno, raw in sorted((extra_lines or {}).items()):
        lines.insert(lineno - 1, raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(lines))
    return path


def run(tmp_path: Path, records: list, **kw) -> tuple[ConvertSummary, list[dict], list[dict]]:
    games = write(tmp_path / "games.jsonl", records)
    s = convert(ConvertConfig(games=games, out=tmp_path / "out", **{"val_fraction": 0.0, **kw}))
    train = pq.read_table(s.train_path).to_pylist()
    val = pq.read_table(s.val_path).to_pylist()
    return s, train, val


def variance(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


# ---------------------------------------------------------------------------------------------
# golden conversion


def test_golden_conversion_of_a_small_file(tmp_path):
    records = [
        game("a1", "A", 0.5),
        game("b1", "B", 0.0),
        game("a2", "A", 1.0),
        game("b2", "B", 0.0),  # B: all rewards equal, a group without signal
    ]
    s, train, val = run(tmp_path, records)
    assert val == []
    # rows seen before their group showed a signal wait in the spool and come last
    train.sort(key=lambda r: (r["game_id"], r["seat"]))
    assert [(r["game_id"], r["seat"]) for r in train] == [
        ("a1", 0),
        ("a1", 1),
        ("a2", 0),
        ("a2", 1),
    ]
    row = train[1]  # a1, seat 1
    gid = group_id("matching-3x3/A/r0")
    assert row == {
        "group_id": gid,
        "group_key": "matching-3x3/A/r0",
        "game_id": "a1",
        "scenario_id": "A",
        "seat": 1,
        "round": 0,
        "prompt_ids": [101, 101, 102],
        "response_ids": [201, 202, 300, 301, 302, 211, 212],  # trailing partner turn trimmed
        "response_mask": [1, 1, 0, 0, 0, 1, 1],
        "rollout_logprobs": pytest.approx([-0.201, -0.202, 0, 0, 0, -0.211, -0.212]),
        "reward": 0.5,
        "off_policy": False,  # the model's own seat (a guide's is a trained scripted seat)
        "temperature": None,  # its seat records no sampling parameters
        "turn_states": None,  # episode credit (the default) writes none
        "tokenizer_fingerprint": "fp",
        "messages": [
            {"role": "user", "content": "intro seat 1"},
            {"role": "assistant", "content": "own 0"},
            {"role": "user", "content": "partner 0"},
            {"role": "assistant", "content": "own 1"},
            {"role": "user", "content": "partner 1"},
        ],
        "data_source": "selfplay/dialop-matching",
        "prompt": [{"role": "user", "content": "intro seat 1"}],
        "reward_model": {"style": "rule", "ground_truth": 0.5},
        "extra_info": {"index": gid, "game_id": "a1", "seat": 1},
    }
    assert {r["group_id"] for r in train} == {gid}
    assert [r["reward"] for r in train] == [0.5, 0.5, 1.0, 1.0]
    assert s.games_read == 4
    assert s.rows_candidate == 8
    assert s.rows_written == s.rows_train == 4
    assert (s.groups_seen, s.groups_written, s.groups_degenerate_dropped) == (2, 1, 1)
    assert s.rows_in_degenerate_groups_dropped == 4
    assert s.outcomes == {"accepted": 2, "max_actions": 2}
    assert s.reward.mean == pytest.approx(0.75)
    assert s.reward.std == pytest.approx(0.25)
    assert (s.length_total.p50, s.length_total.max) == (10, 10)
    assert (s.length_prompt.max, s.length_response.max, s.own_tokens.max) == (3, 7, 4)
    assert s.tokenizer_fingerprint == "fp"
    saved = ConvertSummary.model_validate_json((tmp_path / "out" / SUMMARY_FILE).read_bytes())
    assert saved == s


def test_written_files_have_the_training_schema(tmp_path):
    s, _, _ = run(tmp_path, [game("a1", "A", 0.5), game("a2", "A", 1.0)])
    for path in (s.train_path, s.val_path):
        schema = pq.read_schema(path)
        assert schema.names == TRAINING_SCHEMA.names
        # parquet renames list items ("item" -> "element"); the types are the same otherwise
        table = pq.read_table(path).cast(TRAINING_SCHEMA)
        assert table.schema.equals(TRAINING_SCHEMA)
    assert _files(tmp_path / "out") == [
        "convert_summary.json",
        "train.parquet",
        "val.parquet",
    ]  # no temporary or spool file left behind


# ---------------------------------------------------------------------------------------------
# exact tokens: mask-1 tokens are the seat's own actions


def chat_tokens(tok, seat: int, actions: list[ActionRecord], intro: str) -> SeatTokens:
    """Seat tokens the way a ChatML player builds them: template tokens 0, own completions 1."""

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    ids: list[int] = []
    mask: list[int] = []
    messages = [{"role": "user", "content": intro}]
    pending = intro
    rng = random.Random(seat)
    for a in actions:
        if a.seat == seat:
            head = enc(f"<|im_start|>user\n{pending}<|im_end|>\n<|im_start|>assistant\n")
            ids += head
            mask += [0] * len(head)
            own = enc(a.text + "<|im_end|>")
            ids += own
            mask += [1] * len(own)
            ids += enc("\n")
            mask += [0]
            messages.append({"role": "assistant", "content": a.text})
            pending = ""
        else:
            pending += ("\n" if pending else "") + f"Partner: {a.text}"
            messages.append({"role": "user", "content": f"Partner: {a.text}"})
    logprobs = [-rng.random() if m else 0.0 for m in mask]
    return SeatTokens(token_ids=ids, mask=mask, logprobs=logprobs, messages=messages)


def test_mask_one_tokens_decode_to_the_seats_own_actions(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = [
        "[message] Hello partner, what do you know about Ava Li and BLEU?",
        "[message] Ava Li and BLEU: 120. GloVe: Sofia Patel",
        "[propose] Proposal:\nBLEU: Ava Li\nElectra: Daniel Nguyen\nGloVe: Sofia Patel",
        "[accept]",
    ]
    records = []
    for g in range(4):
        actions = [
            ActionRecord(seat=i % 2, text=f"{t} ({g})", kind="message", valid=True)
            for i, t in enumerate(texts)
        ]
        tokens = tuple(chat_tokens(tok, s, actions, f"intro {s}") for s in (0, 1))
        records.append(game(f"g{g}", "S", g / 4, tokens=tokens, actions=actions))
    s, train, _ = run(tmp_path, records)
    assert s.rows_written == 8
    by_game = {r.game_id: r for r in records}
    for row in train:
        spans = mask_runs(row["response_ids"], row["response_mask"])
        decoded = [tok.decode(span) for span in spans]
        own = [
            a.text + "<|im_end|>" for a in by_game[row["game_id"]].actions if a.seat == row["seat"]
        ]
        assert decoded == own
        # the prompt is exactly the tokens before the first generated token
        seat_tokens = by_game[row["game_id"]].tokens[row["seat"]]
        first = seat_tokens.mask.index(1)
        assert row["prompt_ids"] == seat_tokens.token_ids[:first]
        n = len(row["response_ids"])
        assert row["response_ids"] == seat_tokens.token_ids[first : first + n]
        expected_lp = [x if m else 0.0 for x, m in zip(seat_tokens.logprobs, seat_tokens.mask)]
        assert row["rollout_logprobs"] == pytest.approx(expected_lp[first : first + n], abs=1e-6)
        assert row["response_mask"][-1] == 1  # the reward lands on the seat's own last token


@st.composite
def random_seat_tokens(draw) -> SeatTokens:
    """A random layout: a prompt, then spans of own (mask 1) and other tokens (possibly no own
    one), with values up to the limits of int32 ids and float32 log-probs, and unicode chat."""
    spans = st.lists(st.tuples(st.booleans(), st.integers(1, 4)), min_size=1, max_size=5)
    mask = [0] * draw(st.integers(1, 4))
    for own, n in draw(spans):
        mask += [int(own)] * n
    n = len(mask)
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
    logprobs = draw(st.lists(f32, min_size=n, max_size=n))
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=8)}
    )
    messages = draw(st.lists(message, max_size=4))
    return SeatTokens(token_ids=ids, mask=mask, logprobs=logprobs, messages=messages)


def expected_row(tokens: SeatTokens, max_length: int) -> dict | None:
    """The row a seat's tokens should give, computed the obvious way (None: dropped)."""
    own = [i for i, m in enumerate(tokens.mask) if m == 1]
    if not own or own[-1] + 1 > max_length:
        return None
    first, end = own[0], own[-1] + 1
    roles = [m["role"] for m in tokens.messages]
    n_prompt = roles.index("assistant") if "assistant" in roles else len(roles)
    return {
        "prompt_ids": tokens.token_ids[:first],
        "response_ids": tokens.token_ids[first:end],
        "response_mask": tokens.mask[first:end],
        "rollout_logprobs": tokens.logprobs[first:end],  # float32 values: exact
        "messages": tokens.messages,
        "prompt": tokens.messages[:n_prompt],
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seats=st.lists(st.tuples(random_seat_tokens(), random_seat_tokens()), min_size=1, max_size=8),
    max_length=st.integers(2, 30),
    batch_rows=st.integers(1, 4),
)
def test_rows_hold_exactly_the_recorded_tokens(seats, max_length, batch_rows):
    # every game a different reward, in two scenarios: every group of two or more rows is written
    records = [game(f"g{i}", f"s{i % 2}", i / 10, tokens=pair) for i, pair in enumerate(seats)]
    expected = {
        (r.game_id, seat): (r.scenario_id, row)
        for r in records
        for seat in (0, 1)
        if (row := expected_row(r.tokens[seat], max_length)) is not None
    }
    rows_of_scenario = defaultdict(int)
    for sid, _ in expected.values():
        rows_of_scenario[sid] += 1
    expected = {k: row for k, (sid, row) in expected.items() if rows_of_scenario[sid] >= 2}
    with tempfile.TemporaryDirectory() as d:
        cfg = dict(max_length=max_length, batch_rows=batch_rows, keep_degenerate=True)
        if not expected:
            with pytest.raises(ConvertError):
                run(Path(d), records, **cfg)
            return
        s, train, _ = run(Path(d), records, **cfg)
    columns = next(iter(expected.values())).keys()
    assert {(r["game_id"], r["seat"]): {k: r[k] for k in columns} for r in train} == expected
    # the summary's length statistics are those of the written rows
    lengths = {
        "prompt": [len(r["prompt_ids"]) for r in expected.values()],
        "response": [len(r["response_ids"]) for r in expected.values()],
        "own": [sum(r["response_mask"]) for r in expected.values()],
    }
    lengths["total"] = [p + r for p, r in zip(lengths["prompt"], lengths["response"])]
    for name, stats in (
        ("prompt", s.length_prompt),
        ("response", s.length_response),
        ("own", s.own_tokens),
        ("total", s.length_total),
    ):
        values = lengths[name]
        assert (stats.max, stats.mean) == (max(values), round(sum(values) / len(values), 2))


def test_a_line_longer_than_the_read_buffer(tmp_path):
    n = 120_000  # about 1.5 MB of JSON
    big = SeatTokens(token_ids=list(range(n)), mask=[0] + [1] * (n - 1), logprobs=[-0.5] * n)
    records = [game("a1", "A", 0.2, tokens=(big, hand_tokens(1))), game("a2", "A", 0.8)]
    assert len(dump_record(records[0])) > 1 << 20
    s, train, _ = run(tmp_path, records, max_length=n)
    row = next(r for r in train if (r["game_id"], r["seat"]) == ("a1", 0))
    assert (row["prompt_ids"], row["response_ids"]) == ([0], list(range(1, n)))
    assert row["rollout_logprobs"] == [-0.5] * (n - 1)
    assert s.length_total.max == n


# ---------------------------------------------------------------------------------------------
# the two readers: the fast one over parsed JSON and the typed one over GameRecord


def plain_rows(result: RecordRows) -> tuple[list[dict], RecordRows]:
    """A reader's result in comparable form: rows as dicts (arrays as dtype and values), counts."""
    rows = [
        {
            k: (v.dtype.str, v.tolist()) if isinstance(v, np.ndarray) else v
            for k, v in row._asdict().items()
        }
        for row in result.rows
    ]
    return rows, result._replace(rows=[])


def both_readers(record: GameRecord, config: ConvertConfig) -> tuple:
    """The rows of a record by the fast reader, checked to be those of the typed one."""
    obj = orjson.loads(dump_record(record))
    fast = plain_rows(rows_of_json(obj, config))
    assert plain_rows(rows_of_record(parse_record(obj), config)) == fast
    assert plain_rows(rows_of_record(record, config)) == fast
    return fast


def realistic_games(tok) -> list[GameRecord]:
    """Self-play and partner games, both seats and rounds, an invalid ending, seats without tokens
    or own tokens, a row over 100 tokens, ChatML tokens of a real tokenizer."""
    api = SeatConfig(kind="api", name="gpt-4o-mini", trained=False)
    invalid = [ActionRecord(seat=1, text="hm", kind="invalid", valid=False, error="tag")] * 3
    texts = ["[message] Ava Li and BLEU: 120?", "[propose] Proposal:\nBLEU: Ava Li", "[accept]"]
    actions = [
        ActionRecord(seat=i % 2, text=t, kind="message", valid=True) for i, t in enumerate(texts)
    ]
    silent = SeatTokens(token_ids=[1, 2, 3], mask=[0, 0, 0], logprobs=[0.0] * 3)
    return [
        game("sp1", "A", 0.5),
        game("sp2", "A", 1.0, round=1),
        game("p0", "B", 0.25, seats=(LLM, FIXED)),
        game("p1", "B", 0.75, seats=(api, LLM)),
        game("inv", "A", 0.0, actions=invalid).model_copy(update={"outcome": Outcome.INVALID}),
        game("none", "C", 0.5, tokens=(hand_tokens(0), None)),
        game("quiet", "C", 0.2, tokens=(silent, hand_tokens(1, fingerprint=None))),
        game("long", "C", 0.9, tokens=(hand_tokens(0, turns=25), hand_tokens(1))),
        game(
            "chat",
            "D",
            0.6,
            tokens=tuple(chat_tokens(tok, s, actions, f"intro {s}") for s in (0, 1)),
            actions=actions,
        ),
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"group_by": "scenario-seat", "invalid_penalty": 0.5},
        {"max_length": 100, "invalid_penalty": 1.0},
    ],
)
def test_the_fast_and_the_typed_reader_cut_the_same_rows(tiny_model, options):
    from transformers import AutoTokenizer

    config = ConvertConfig(games=Path("g"), out=Path("o"), **options)
    results = [
        both_readers(r, config) for r in realistic_games(AutoTokenizer.from_pretrained(tiny_model))
    ]
    rows = [row for found, _ in results for row in found]
    counts = [c for _, c in results]
    # the set covers what it should: both seats, rounds, partners' seats left out, every drop
    assert {(r["seat"], r["round"]) for r in rows} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert {r["game_id"] for r in rows if r["seat"] == 1} >= {"p1", "inv", "chat"}
    assert "p0" not in {r["game_id"] for r in rows if r["seat"] == 1}
    assert sum(c.no_tokens for c in counts) == 1 and sum(c.no_own for c in counts) == 1
    assert sum(c.too_long for c in counts) == (1 if options.get("max_length") else 0)
    penalty = options.get("invalid_penalty", 0.0)
    inv = {r["seat"]: r["reward"] for r in rows if r["game_id"] == "inv"}
    assert inv == {0: 0.0, 1: -penalty}
    seat_keys = options.get("group_by") == "scenario-seat"
    assert all(r["group_key"].endswith(f"/seat{r['seat']}") == seat_keys for r in rows)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=st.tuples(random_seat_tokens(), random_seat_tokens()), max_length=st.integers(2, 30))
def test_the_readers_agree_on_random_token_layouts(pair, max_length):
    config = ConvertConfig(games=Path("g"), out=Path("o"), max_length=max_length)
    both_readers(game("g", "s", 0.5, tokens=pair), config)


def test_a_nan_log_prob_in_memory_is_refused_as_its_json_is():
    tokens = hand_tokens(0)
    tokens.logprobs[4] = math.nan  # a GameRecord may hold it; its JSON says null
    record = game("nan", "A", 0.5, tokens=(tokens, hand_tokens(1)))
    config = ConvertConfig(games=Path("g"), out=Path("o"))
    with pytest.raises(BadRecord, match="logprobs must be finite"):
        rows_of_record(record, config)
    with pytest.raises(BadRecord, match="logprobs must be finite"):
        rows_of_json(orjson.loads(dump_record(record)), config)


def break_seat0(field: str, index: int, value):
    def change(obj: dict) -> None:
        obj["tokens"][0][field][index] = value

    return change


# hand_tokens(0): the own tokens (mask 1) at 3, 4, 8, 9: the response is indices 3 to 9
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda obj: obj["tokens"][0]["mask"].pop(), id="misaligned"),
        pytest.param(break_seat0("mask", 3, 2), id="mask-2"),
        pytest.param(break_seat0("mask", 0, 1), id="no-prompt"),  # GameRecord allows it
        pytest.param(break_seat0("token_ids", 0, "oops"), id="id-str"),
        pytest.param(break_seat0("token_ids", 5, 2**31), id="id-int64"),  # GameRecord allows it
        pytest.param(break_seat0("logprobs", 4, 1e39), id="logprob-f64"),  # GameRecord allows it
        pytest.param(lambda obj: obj.pop("game_id"), id="no-game-id"),
        pytest.param(lambda obj: obj["seats"].pop(), id="one-seat"),
        pytest.param(lambda obj: obj.update(reward="high"), id="reward-str"),
    ],
)
def test_a_malformed_record_is_refused_by_both_readers(tmp_path, change):
    obj = orjson.loads(dump_record(game("bad", "A", 0.9)))
    change(obj)
    config = ConvertConfig(games=Path("g"), out=Path("o"))
    with pytest.raises(BadRecord):
        rows_of_json(obj, config)
    with pytest.raises(BadRecord):
        rows_of_record(parse_record(obj), config)
    # and convert skips its line, with and without full validation
    lines = [game("a1", "A", 0.2), orjson.dumps(obj) + b"\n", game("a2", "A", 0.8)]
    games = write(tmp_path / "g.jsonl", lines)
    for validate in (False, True):
        s = convert(ConvertConfig(games=games, out=tmp_path / "o", validate_records=validate))
        assert (s.games_read, s.lines_skipped, s.skipped[0][0]) == (2, 1, 2)


# ---------------------------------------------------------------------------------------------
# groups


def test_scenario_seat_keeps_the_seats_apart(tmp_path):
    records = [game("a1", "A", 0.5), game("a2", "A", 1.0), game("a3", "A", 0.0)]
    s, train, _ = run(tmp_path, records, group_by="scenario-seat")
    keys = {r["group_key"]: r["group_id"] for r in train}
    k0, k1 = "matching-3x3/A/r0/seat0", "matching-3x3/A/r0/seat1"
    assert keys == {k0: group_id(k0), k1: group_id(k1)}
    for r in train:
        assert r["group_key"].endswith(f"seat{r['seat']}")
    assert s.groups_written == 2


def test_rounds_are_separate_groups(tmp_path):
    records = [game(f"g{i}", "A", i / 3, round=i % 2) for i in range(4)]
    _, train, _ = run(tmp_path, records)
    assert {r["group_key"] for r in train} == {"matching-3x3/A/r0", "matching-3x3/A/r1"}


def test_fixed_partner_gives_rows_for_the_trained_seat_only(tmp_path):
    records = [game(f"g{i}", "A", i / 2, seats=(LLM, FIXED)) for i in range(3)]
    s, train, _ = run(tmp_path, records)
    assert [r["seat"] for r in train] == [0, 0, 0]
    assert s.rows_candidate == 3
    assert s.trained_seats_without_tokens == 0


def test_trained_seat_without_tokens_is_counted(tmp_path):
    records = [game(f"g{i}", "A", i / 2, tokens=(hand_tokens(0), None)) for i in range(3)]
    s, train, _ = run(tmp_path, records)
    assert s.trained_seats_without_tokens == 3
    assert [r["seat"] for r in train] == [0, 0, 0]


def test_degenerate_groups_are_dropped_or_kept_on_request(tmp_path):
    records = [
        game("a1", "A", 1.0),
        game("a2", "A", 1.0),
        game("b1", "B", 0.2),
        game("b2", "B", 0.4),
    ]
    s, train, _ = run(tmp_path, records)
    assert {r["scenario_id"] for r in train} == {"B"}
    assert s.groups_degenerate_dropped == 1
    s, train, _ = run(tmp_path, records, keep_degenerate=True)
    assert {r["scenario_id"] for r in train} == {"A", "B"}
    assert (s.groups_degenerate_dropped, s.groups_degenerate_kept) == (0, 1)


def test_a_single_row_group_is_never_written(tmp_path):
    records = [
        game("a1", "A", 0.3, seats=(LLM, FIXED)),  # A: one row only
        game("b1", "B", 0.2),
        game("b2", "B", 0.4),
    ]
    for keep in (False, True):
        s, train, _ = run(tmp_path, records, keep_degenerate=keep)
        assert {r["scenario_id"] for r in train} == {"B"}
        assert s.groups_singleton_dropped == 1


def test_all_degenerate_is_an_error_that_says_what_to_do(tmp_path):
    records = [game("a1", "A", 0.0), game("a2", "A", 0.0)]
    with pytest.raises(ConvertError, match="keep-degenerate"):
        run(tmp_path, records)
    assert not (tmp_path / "out" / "train.parquet").exists()
    _, train, _ = run(tmp_path, records, keep_degenerate=True)
    assert len(train) == 4


def test_rows_over_max_length_are_dropped_before_grouping(tmp_path):
    long = hand_tokens(0, turns=5)  # 3 + 5 * 5 - 3 = 25 tokens after trimming
    records = [
        game("a1", "A", 0.1, tokens=(long, hand_tokens(1))),
        game("a2", "A", 0.9, tokens=(hand_tokens(0), hand_tokens(1))),
    ]
    s, train, _ = run(tmp_path, records, max_length=20, group_by="scenario-seat")
    assert s.rows_dropped_over_max_length == 1
    # seat 0 is left with one row: a singleton, dropped; seat 1 keeps its pair
    assert s.groups_singleton_dropped == 1
    assert sorted((r["game_id"], r["seat"]) for r in train) == [("a1", 1), ("a2", 1)]
    assert max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in train) <= 20


def test_a_seat_that_never_generated_is_dropped(tmp_path):
    silent = SeatTokens(token_ids=[1, 2, 3], mask=[0, 0, 0], logprobs=[0.0] * 3)
    records = [game(f"g{i}", "A", i / 2, tokens=(hand_tokens(0), silent)) for i in range(2)]
    s, train, _ = run(tmp_path, records)
    assert s.rows_dropped_no_own_tokens == 2
    assert [r["seat"] for r in train] == [0, 0]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    games=st.lists(
        st.tuples(
            st.integers(0, 5),  # scenario
            st.integers(0, 1),  # round
            st.sampled_from([0.0, 0.5, 1.0]),  # reward
            st.sampled_from([(True, True), (True, False), (False, True)]),  # trained seats
        ),
        min_size=1,
        max_size=25,
    ),
    group_by=st.sampled_from(["scenario", "scenario-seat"]),
    keep=st.booleans(),
    val_fraction=st.sampled_from([0.0, 0.3, 0.6]),
)
def test_every_written_group_carries_a_signal(games, group_by, keep, val_fraction):
    records = []
    for i, (sc, rnd, reward, trained) in enumerate(games):
        seats = tuple(LLM if t else FIXED for t in trained)
        records.append(game(f"g{i}", f"s{sc}", reward, seats=seats, round=rnd))
    # the groups a correct converter writes, computed independently
    expected: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for seat in (0, 1):
            if r.seats[seat].trained:
                key = f"matching-3x3/{r.scenario_id}/r{r.round}" + (
                    f"/seat{seat}" if group_by == "scenario-seat" else ""
                )
                expected[key].append(r.reward)
    kept = {k for k, v in expected.items() if len(v) >= 2 and (keep or len(set(v)) > 1)}
    with tempfile.TemporaryDirectory() as d:
        cfg = dict(group_by=group_by, keep_degenerate=keep, val_fraction=val_fraction)
        try:
            s, train, val = run(Path(d), records, **cfg)
        except ConvertError:
            # nothing to write, or everything in validation: both are reported, never silent
            assert not kept or all(is_val_scenario(k.split("/")[1], val_fraction) for k in kept)
            return
    groups: dict[int, list[dict]] = defaultdict(list)
    for row in train + val:
        groups[row["group_id"]].append(row)
    assert {rows[0]["group_key"] for rows in groups.values()} == kept
    for rows in groups.values():
        assert len(rows) >= 2
        assert len({r["group_key"] for r in rows}) == 1
        assert keep or variance([r["reward"] for r in rows]) > 0
        assert all(r["extra_info"]["index"] == r["group_id"] for r in rows)
    assert not {r["scenario_id"] for r in train} & {r["scenario_id"] for r in val}
    assert s.rows_written == len(train) + len(val) == sum(len(expected[k]) for k in kept)
    assert s.groups_written == len(kept)
    if train + val:
        rewards = [r["reward"] for r in train + val]
        assert s.reward.mean == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert s.reward.std == pytest.approx(math.sqrt(variance(rewards)), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# train / val split


def test_train_and_val_scenarios_are_disjoint_and_the_split_is_stable(tmp_path):
    records = [game(f"g{sc}-{k}", f"scen-{sc}", k / 3) for sc in range(40) for k in range(3)]
    s, train, val = run(tmp_path / "a", records, val_fraction=0.3)
    train_sc, val_sc = {r["scenario_id"] for r in train}, {r["scenario_id"] for r in val}
    assert train_sc and val_sc and not train_sc & val_sc
    assert train_sc | val_sc == {f"scen-{sc}" for sc in range(40)}
    assert (s.scenarios_train, s.scenarios_val) == (len(train_sc), len(val_sc))
    assert val_sc == {f"scen-{sc}" for sc in range(40) if is_val_scenario(f"scen-{sc}", 0.3)}
    # the split depends on the scenario id only, not on the order of the file
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    _, train2, val2 = run(tmp_path / "b", shuffled, val_fraction=0.3)
    assert {r["scenario_id"] for r in val2} == val_sc
    assert sorted((r["game_id"], r["seat"]) for r in train2) == sorted(
        (r["game_id"], r["seat"]) for r in train
    )


def test_group_ids_are_deterministic(tmp_path):
    records = [game(f"g{sc}-{k}", f"s{sc}", k / 3) for sc in range(5) for k in range(3)]
    _, a, _ = run(tmp_path / "a", records)
    _, b, _ = run(tmp_path / "b", records)
    assert [(r["group_id"], r["game_id"], r["seat"]) for r in a] == [
        (r["group_id"], r["game_id"], r["seat"]) for r in b
    ]
    assert {r["group_id"]: r["scenario_id"] for r in a} == {
        group_id(f"matching-3x3/s{i}/r0"): f"s{i}" for i in range(5)
    }
    _, c, _ = run(tmp_path / "c", records[::-1])  # another file order: the same ids
    assert sorted((r["group_id"], r["game_id"], r["seat"]) for r in c) == sorted(
        (r["group_id"], r["game_id"], r["seat"]) for r in a
    )


def test_everything_in_validation_is_an_error(tmp_path):
    sid = next(f"s{i}" for i in range(1000) if is_val_scenario(f"s{i}", 0.5))
    records = [game("a", sid, 0.1), game("b", sid, 0.2)]
    with pytest.raises(ConvertError, match="val-fraction"):
        run(tmp_path, records, val_fraction=0.5)


# ---------------------------------------------------------------------------------------------
# bad input


def test_torn_and_corrupt_lines_are_skipped_and_reported_with_their_line_number(tmp_path):
    good = [game("a1", "A", 0.2), game("a2", "A", 0.8), game("a3", "A", 0.5)]
    misaligned = orjson.loads(dump_record(game("x", "A", 0.9)))
    misaligned["tokens"][0]["mask"].pop()
    bad_mask = orjson.loads(dump_record(game("y", "A", 0.9)))
    bad_mask["tokens"][1]["mask"][4] = 2
    bad_ids = orjson.loads(dump_record(game("z", "A", 0.9)))
    bad_ids["tokens"][0]["token_ids"][0] = "oops"
    torn = dump_record(game("t", "A", 0.9))[:150]  # a write cut off by a crash, no newline
    extra = {
        2: orjson.dumps(misaligned) + b"\n",
        3: b"{not json\n",
        5: orjson.dumps(bad_mask) + b"\n",
        6: orjson.dumps(bad_ids) + b"\n",
        8: torn,
    }
    games = write(tmp_path / "games.jsonl", good, extra)
    s = convert(ConvertConfig(games=games, out=tmp_path / "out", val_fraction=0))
    assert s.games_read == 3
    assert s.lines_skipped == 5
    assert [line for line, _ in s.skipped] == [2, 3, 5, 6, 8]
    reasons = dict(s.skipped)
    assert "must have the same length" in reasons[2]
    assert "not valid JSON" in reasons[3]
    assert "mask values must be 0 or 1" in reasons[5]
    assert "token_ids" in reasons[6]
    assert "not valid JSON" in reasons[8]
    assert {r["game_id"] for r in pq.read_table(s.train_path).to_pylist()} == {"a1", "a2", "a3"}


# hand_tokens(0): ids 100 101 102 | 200 201 | 300 301 302 | 210 211 | 301 302 303, the own tokens
# (mask 1) at 3, 4, 8, 9: the response is indices 3 to 9
@pytest.mark.parametrize(
    ("field", "index", "value", "reason"),
    [
        ("token_ids", 5, 2**31, "token_ids must be int32"),
        ("token_ids", 0, -1, "token_ids must not be negative"),
        ("token_ids", 12, 1.5, "token_ids must be int32"),
        ("mask", 3, 2, "mask values must be 0 or 1"),
        ("mask", 4, "1", "mask values must be 0 or 1"),
        ("mask", 0, 1, "there is no prompt"),
        ("logprobs", 4, "x", "logprobs must be finite float32 numbers"),
        ("logprobs", 9, 1e39, "logprobs must be finite float32 numbers"),  # beyond float32
        ("logprobs", 0, "x", None),  # outside the response: never read
        ("messages", 1, {"role": "user", "content": 7}, "messages must be a list"),
        ("messages", 1, ["user", "hi"], "messages must be a list"),
    ],
)
def test_a_bad_token_value_skips_its_line_and_nothing_else(tmp_path, field, index, value, reason):
    scenarios = ("s0", "s1", "s5")  # s5 falls in the validation split at val_fraction 0.5
    good = [game(f"g{i:02d}", scenarios[i % 3], (i % 4) / 4) for i in range(20)]
    bad = orjson.loads(dump_record(game("bad", "s0", 0.9)))
    bad["tokens"][0][field][index] = value
    blank = b" \t\r\n"  # whitespace only: not a record, not an error
    lines = [*good[:10], orjson.dumps(bad) + b"\n", *good[10:15], blank, *good[15:]]
    cfg = dict(val_fraction=0.5, batch_rows=3)  # several batches, both splits, the spool
    s = convert(ConvertConfig(games=write(tmp_path / "g.jsonl", lines), out=tmp_path / "a", **cfg))
    ref = convert(ConvertConfig(games=write(tmp_path / "r.jsonl", good), out=tmp_path / "b", **cfg))
    assert ref.rows_train and ref.rows_val
    if reason is None:
        assert (s.games_read, s.lines_skipped) == (21, 0)
        return
    assert (s.games_read, s.lines_skipped) == (20, 1)
    [(line, why)] = s.skipped
    assert line == 11 and reason in why
    # the good games give exactly the rows and numbers they give without the bad line
    for name in ("train_path", "val_path"):
        assert pq.read_table(getattr(s, name)).equals(pq.read_table(getattr(ref, name)))
    paths_and_times = {"games_path", "train_path", "val_path", "seconds", "games_per_second"}
    skip = paths_and_times | {"lines_skipped", "skipped"}
    assert s.model_dump(exclude=skip) == ref.model_dump(exclude=skip)


def test_validate_records_checks_the_whole_record(tmp_path):
    bad = orjson.loads(dump_record(game("x", "A", 0.9)))
    bad["outcome"] = "won"  # not an Outcome: only full validation notices
    lines = [game("a1", "A", 0.2), orjson.dumps(bad) + b"\n", game("a2", "A", 0.8)]
    games = write(tmp_path / "games.jsonl", lines)
    fast = convert(ConvertConfig(games=games, out=tmp_path / "fast", val_fraction=0))
    assert (fast.games_read, fast.lines_skipped) == (3, 0)
    full = convert(
        ConvertConfig(games=games, out=tmp_path / "full", val_fraction=0, validate_records=True)
    )
    assert (full.games_read, full.lines_skipped) == (2, 1)
    assert full.skipped[0][0] == 2 and "outcome" in full.skipped[0][1]


def test_empty_input_is_a_clear_error_and_writes_nothing(tmp_path):
    games = tmp_path / "games.jsonl"
    for content in (b"", b"\n\n", b"{torn\n"):
        games.write_bytes(content)
        with pytest.raises(RecordError, match="no usable game records"):
            convert(ConvertConfig(games=games, out=tmp_path / "out"))
        assert _files(tmp_path / "out") == []


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(RecordError, match="does not exist"):
        convert(ConvertConfig(games=tmp_path / "nope.jsonl", out=tmp_path / "out"))


def test_another_schema_version_is_an_error_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.parquet").write_bytes(b"previous run")
    other = orjson.loads(dump_record(game("x", "A", 0.9)))
    other["schema_version"] = 3
    games = write(
        tmp_path / "games.jsonl",
        [game("a1", "A", 0.2), game("a2", "A", 0.8), orjson.dumps(other) + b"\n"],
    )
    with pytest.raises(RecordError, match=r"games.jsonl:3: schema_version 3, this selfplay reads"):
        convert(ConvertConfig(games=games, out=out))
    assert _files(out) == ["train.parquet"]
    assert (out / "train.parquet").read_bytes() == b"previous run"  # untouched


def _files(folder) -> list[str]:
    """What a folder holds, but for the lock a writer leaves (its lock, not the file, is held)."""
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)


def test_convert_refuses_games_a_generate_still_writes_and_cleans_up_after_a_kill(tmp_path):
    games = write(tmp_path / "games.jsonl", [game("a1", "A", 0.2), game("a2", "A", 0.8)])
    with folder_lock(tmp_path, "selfplay generate"), pytest.raises(FolderBusy, match="generate"):
        convert(ConvertConfig(games=games, out=tmp_path))
    assert _files(tmp_path) == ["games.jsonl"]
    left = tmp_path / ".train.convert-12345.parquet"  # what a convert killed by SIGKILL leaves
    left.write_bytes(b"half a file")
    convert(ConvertConfig(games=games, out=tmp_path))
    assert _files(tmp_path) == [
        "convert_summary.json",
        "games.jsonl",
        "train.parquet",
        "val.parquet",
    ]


@pytest.mark.parametrize("validate", [True, False])
def test_version_1_records_still_convert_as_matching_games(tmp_path, validate):
    """Schema 1 (before GameRecord.game) is read by both paths, as the matching game's records;
    a record of a game selfplay does not know is skipped with the known games named."""
    new = [game("a1", "A", 0.2), game("a2", "A", 0.8)]
    old = []
    for record in new:
        obj = orjson.loads(dump_record(record))
        assert obj["schema_version"] == 2 and obj["game"] == "matching"
        del obj["game"]
        old.append(orjson.dumps({**obj, "schema_version": 1}) + b"\n")
    unknown = orjson.loads(dump_record(game("a3", "A", 0.5)))
    unknown["game"] = "chess"
    _, rows_new, _ = run(tmp_path / "new", new, validate_records=validate)
    s, rows_old, _ = run(
        tmp_path / "old", [*old, orjson.dumps(unknown) + b"\n"], validate_records=True
    )
    assert rows_old == rows_new
    assert [(n, "unknown game 'chess'" in why) for n, why in s.skipped] == [(3, True)]
    again = list(iter_game_records(write(tmp_path / "old.jsonl", old)))
    assert [r.game.name for r in again] == ["matching", "matching"]
    assert [r.scenario for r in again] == [r.scenario for r in new]


def test_mixed_tokenizers_are_an_error(tmp_path):
    records = [
        game(
            "a1",
            "A",
            0.2,
            tokens=(hand_tokens(0, fingerprint="x"), hand_tokens(1, fingerprint="x")),
        ),
        game(
            "a2",
            "A",
            0.8,
            tokens=(hand_tokens(0, fingerprint="y"), hand_tokens(1, fingerprint="y")),
        ),
    ]
    with pytest.raises(ConvertError, match="mixes tokenizers"):
        run(tmp_path, records)


def test_games_without_trained_tokens_are_an_error(tmp_path):
    records = [game(f"g{i}", "A", i / 2, seats=(FIXED, FIXED)) for i in range(2)]
    with pytest.raises(ConvertError, match="trained"):
        run(tmp_path, records)


def test_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="val_fraction"):
        ConvertConfig(games=Path("g"), out=Path("o"), val_fraction=1.0)
    with pytest.raises(ValidationError, match="group_by"):
        ConvertConfig(games=Path("g"), out=Path("o"), group_by="game")


# ---------------------------------------------------------------------------------------------
# command line


def test_cli_convert(tmp_path):
    from selfplay.cli import app

    games = write(tmp_path / "games.jsonl", [game(f"g{i}", "A", i / 3) for i in range(3)])
    runner = CliRunner()
    args = ["convert", "--games", str(games), "--out", str(tmp_path / "out")]
    result = runner.invoke(app, [*args, "--val-fraction", "0", "--group-by", "scenario-seat"])
    assert result.exit_code == 0, result.output
    assert "rows written" in result.output
    assert (tmp_path / "out" / "train.parquet").exists()
    assert (tmp_path / "out" / SUMMARY_FILE).exists()
    result = runner.invoke(app, [*args, "--group-by", "game"])
    assert result.exit_code == 1
    assert "--group-by" in " ".join(result.output.split())
    (tmp_path / "empty.jsonl").write_bytes(b"")
    result = runner.invoke(
        app, ["convert", "--games", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o2")]
    )
    assert result.exit_code == 1
    assert "no usable game records" in " ".join(result.output.split())  # rich wraps lines


def test_invalid_penalty_goes_to_the_seat_that_ended_the_game(tmp_path):
    bad = [ActionRecord(seat=1, text="hm", kind="invalid", valid=False, error="tag")] * 3
    ended = game("a1", "A", 0.0, actions=bad).model_copy(update={"outcome": Outcome.INVALID})
    records = [ended, game("a2", "A", 0.6)]
    _, train, _ = run(tmp_path, records)
    assert sorted((r["game_id"], r["seat"], r["reward"]) for r in train)[:2] == [
        ("a1", 0, 0.0),
        ("a1", 1, 0.0),
    ]
    _, train, _ = run(tmp_path, records, invalid_penalty=0.5)
    rewards = {(r["game_id"], r["seat"]): r["reward"] for r in train}
    want = {("a1", 0): 0.0, ("a1", 1): -0.5, ("a2", 0): 0.6, ("a2", 1): 0.6}
    assert rewards == pytest.approx(want)


def test_gzipped_games_read_like_the_plain_file(tmp_path):
    """docs/runs/*/heldout/ publishes games as .jsonl.gz: iter_game_records reads them through
    gzip, the same records in the same order, a torn line still skipped and counted."""
    import gzip

    from selfplay.records import ReadReport, iter_game_records

    good = [game("a1", "A", 0.2), game("a2", "A", 0.8), game("b1", "B", 0.5)]
    plain = write(tmp_path / "games.jsonl", good, {2: b"{not json\n"})
    packed = tmp_path / "games.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    report = ReadReport()
    assert list(iter_game_records(packed, report)) == list(iter_game_records(plain))
    assert [g.game_id for g in iter_game_records(packed)] == ["a1", "a2", "b1"]
    assert [line for line, _ in report.skipped] == [2]


def test_games_of_two_sizes_or_games_never_share_a_group_and_a_repeated_game_is_skipped(tmp_path):
    """One seed draws scenario A at 3x3 and at 4x4, and in matching and matching-advice: the
    four are four groups, each keyed by its game and size; a game id read twice is skipped with
    a warning naming the first line (it would count twice in its group)."""
    from selfplay.game.matching import MATCHING_ADVICE
    from selfplay.game.matching.rules import generate_scenario

    big = generate_scenario(1, 4).model_copy(update={"id": "A"})
    records = [game("a1", "A", 0.2), game("a2", "A", 0.8)]
    records += [game("b1", "A", 0.1).model_copy(update={"scenario": big})]
    records += [game("b2", "A", 0.9).model_copy(update={"scenario": big})]
    records += [game(f"c{i}", "A", i / 2).model_copy(update={"game": MATCHING_ADVICE})
                for i in range(2)]  # fmt: skip
    records += [game("a1", "A", 0.2)]
    s, train, _ = run(tmp_path, records)
    keys = {r["group_key"] for r in train}
    assert keys == {"matching-3x3/A/r0", "matching-4x4/A/r0", "matching-advice-3x3/A/r0"}
    assert s.lines_skipped == 1 and "a1 repeats line 1" in s.skipped[0][1]
    assert sorted(r["game_id"] for r in train).count("a1") == 2  # its two seats, once
