"""Rows -> verl batches, GRPO advantages and the input checks of `selfplay train` (no workers)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from selfplay.records import TRAINING_SCHEMA
from selfplay.reward import grpo_advantages, row_advantages
from selfplay.train.batch import (
    Rows,
    TrainDataError,
    check_tokenizer,
    collate,
    read_rows,
    rows_from_table,
)
from selfplay.train.config import TrainConfig
from tests.fakes import make_rows, simple_specs, write_rows

# ---------------------------------------------------------------------------------------------
# layout


def test_collate_layout_left_prompts_right_responses():
    rows = rows_from_table(
        pa.Table.from_pylist(
            make_rows(
                [
                    (0, [1, 2, 3], [7, 8, 9, 10], [1, 0, 1, 0], 1.0),
                    (0, [4], [11, 12], [1, 1], 0.0),
                ]
            ),
            schema=TRAINING_SCHEMA,
        )
    )
    b = collate(rows, pad_id=0)
    assert b["prompts"].tolist() == [[1, 2, 3], [0, 0, 4]]
    assert b["responses"].tolist() == [[7, 8, 9, 10], [11, 12, 0, 0]]
    assert b["input_ids"].tolist() == [[1, 2, 3, 7, 8, 9, 10], [0, 0, 4, 11, 12, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 7, [0, 0, 1, 1, 1, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 2, 2]]
    assert b["response_mask"].tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    # the reward sits on the last own (mask-1) token, not on the last token
    assert b["token_level_rewards"].tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert b["rollout_log_probs"].tolist() == [[-1, 0, -1, 0], [-1, -1, 0, 0]]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 6),
            st.lists(st.integers(0, 1), min_size=1, max_size=8).filter(any),
            st.floats(-2, 2),
        ),
        min_size=2,
        max_size=6,
    )
)
def test_collate_invariants(spec):
    specs = [(0, list(range(3, 3 + p)), [20 + j for j in range(len(m))], m, r) for p, m, r in spec]
    rows = rows_from_table(pa.Table.from_pylist(make_rows(specs), schema=TRAINING_SCHEMA))
    b = collate(rows, pad_id=0)
    p_len = b["prompts"].shape[1]
    for i, (p, m, r) in enumerate(spec):
        assert b["attention_mask"][i, :p_len].sum() == p
        assert b["attention_mask"][i, p_len:].sum() == len(m)
        assert b["response_mask"][i].sum() == sum(m)
        assert b["response_mask"][i].bool().le(b["attention_mask"][i, p_len:].bool()).all()
        assert b["token_level_rewards"][i].sum() == pytest.approx(np.float32(r))
        valid = b["attention_mask"][i].bool()
        assert b["position_ids"][i][valid].tolist() == list(range(p + len(m)))


def test_grpo_advantages_are_groupwise_and_masked():
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1], [0, 1, 1]])
    rewards = torch.zeros(4, 3)
    rewards[0, 2], rewards[1, 1], rewards[2, 2], rewards[3, 2] = 1.0, 0.0, 0.5, 0.5
    adv = grpo_advantages(rewards, mask, np.array([7, 7, 9, 9]))
    assert (adv[mask == 0] == 0).all()
    assert adv[0, 0] > 0 and adv[1, 0] < 0  # rewarded row up, the other down
    assert torch.allclose(adv[0][mask[0] == 1], adv[0, 0].expand(2))
    assert (adv[2:] == 0).all()  # equal rewards in a group train nothing
    no_std = grpo_advantages(rewards, mask, np.array([7, 7, 9, 9]), std_norm=False)
    assert no_std[0, 0] == pytest.approx(0.5)


def test_row_advantages_use_dataset_wide_groups():
    rows = rows_from_table(pa.Table.from_pylist(make_rows(simple_specs()), schema=TRAINING_SCHEMA))
    adv = row_advantages(rows)
    for g in (0, 1):
        sel = rows.group_ids == g
        assert abs(adv[sel].mean()) < 1e-5
        assert adv[sel].std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def test_rows_select_keeps_alignment():
    rows = rows_from_table(pa.Table.from_pylist(make_rows(simple_specs()), schema=TRAINING_SCHEMA))
    sub = rows.select([5, 1])
    assert isinstance(sub, Rows) and len(sub) == 2
    assert sub.prompts[0] == rows.prompts[5] and sub.rewards[1] == rows.rewards[1]


# ---------------------------------------------------------------------------------------------
# bad input: a clear error before any worker is built


def test_missing_and_empty_parquet(tmp_path):
    with pytest.raises(TrainDataError, match="does not exist"):
        read_rows(tmp_path / "nope.parquet")
    empty = write_rows(tmp_path / "empty.parquet", [])
    with pytest.raises(TrainDataError, match="no rows"):
        read_rows(empty)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(TrainDataError, match="not a readable parquet"):
        read_rows(tmp_path / "junk.parquet")


def test_schema_mismatch_names_the_columns(tmp_path):
    table = pa.Table.from_pylist(make_rows(simple_specs()), schema=TRAINING_SCHEMA)
    pq.write_table(table.drop_columns(["response_mask"]), tmp_path / "a.parquet")
    with pytest.raises(TrainDataError, match="missing column 'response_mask'"):
        read_rows(tmp_path / "a.parquet")
    floats = table.set_column(
        table.schema.get_field_index("prompt_ids"),
        "prompt_ids",
        pa.array([[float(x) for x in r] for r in table.column("prompt_ids").to_pylist()]),
    )
    pq.write_table(floats, tmp_path / "b.parquet")
    with pytest.raises(TrainDataError, match=r"column 'prompt_ids' is list<\w+: double>"):
        read_rows(tmp_path / "b.parquet")


def test_tokenizer_fingerprint_must_match():
    table = pa.Table.from_pylist(
        make_rows(simple_specs(), fingerprint="aaa"), schema=TRAINING_SCHEMA
    )
    check_tokenizer(table, "aaa", "m")
    with pytest.raises(TrainDataError, match="tokenized with tokenizer"):
        check_tokenizer(table, "bbb", "m")
    unmarked = pa.Table.from_pylist(
        make_rows(simple_specs(), fingerprint=None), schema=TRAINING_SCHEMA
    )
    with pytest.raises(TrainDataError, match="no tokenizer_fingerprint"):
        check_tokenizer(unmarked, "aaa", "m")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ((0, [], [1, 2], [1, 1], 1.0), "empty prompt"),
        ((0, [1], [1, 2], [1], 1.0), "same length"),
        ((0, [1], [1, 2], [0, 0], 1.0), "no own"),
        ((0, [1], [1, 2], [1, 2], 1.0), "0 or 1"),
    ],
)
def test_malformed_rows(spec, message):
    specs = [spec, (0, [1], [1], [1], 0.0)]
    with pytest.raises(TrainDataError, match=message):
        rows_from_table(pa.Table.from_pylist(make_rows(specs), schema=TRAINING_SCHEMA))


def test_singleton_groups_are_refused():
    specs = [(0, [1], [2], [1], 1.0), (0, [1], [3], [1], 0.0), (5, [1], [2], [1], 1.0)]
    with pytest.raises(TrainDataError, match="single row"):
        rows_from_table(pa.Table.from_pylist(make_rows(specs), schema=TRAINING_SCHEMA))


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(data=tmp_path, model="m", out=tmp_path, batch_size=6, mini_batch_size=4)
    with pytest.raises(ValueError, match="loss_agg"):
        TrainConfig(data=tmp_path, model="m", out=tmp_path, loss_agg="mean")
    with pytest.raises(ValueError, match="ray_address"):
        TrainConfig(data=tmp_path, model="m", out=tmp_path, nodes=2)


@pytest.fixture(scope="module")
def fingerprint(tiny_model) -> str:
    from transformers import AutoTokenizer

    from selfplay.models import tokenizer_fingerprint

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model))


def test_plan_checks_sizes_and_flat_groups(tmp_path, tiny_model, fingerprint):
    from selfplay.train.trainer import plan

    data = write_rows(tmp_path / "t.parquet", make_rows(simple_specs(), fingerprint=fingerprint))
    p = plan(TrainConfig(data=data, model=str(tiny_model), out=tmp_path / "o", mini_batch_size=4))
    assert (p.batch_size, p.mini_batch_size, p.steps_per_epoch) == (8, 4, 1)
    p = plan(TrainConfig(data=data, model=str(tiny_model), out=tmp_path / "o", batch_size=4))
    assert p.steps_per_epoch == 2
    with pytest.raises(TrainDataError, match="too few for one mini-batch of 16"):
        plan(TrainConfig(data=data, model=str(tiny_model), out=tmp_path / "o", batch_size=16))
    flat = [(g, p, r, m, 1.0) for g, p, r, m, _ in simple_specs()]
    data = write_rows(tmp_path / "f.parquet", make_rows(flat, fingerprint=fingerprint))
    with pytest.raises(TrainDataError, match="equal rewards"):
        plan(TrainConfig(data=data, model=str(tiny_model), out=tmp_path / "o"))


@pytest.mark.parametrize(
    ("groups", "per_group", "micro", "want"),
    [(2, 4, 4, 4), (2, 3, 4, 3), (3, 3, 4, 3), (2, 5, 4, 2)],
)
def test_plan_micro_batch_divides_the_mini_batch(
    tmp_path, tiny_model, fingerprint, groups, per_group, micro, want
):
    """verl asserts mini % micro == 0; any row count must train (13 rows once crashed)."""
    from selfplay.train.trainer import plan

    specs = simple_specs(groups=groups, per_group=per_group)
    data = write_rows(tmp_path / "t.parquet", make_rows(specs, fingerprint=fingerprint))
    cfg = TrainConfig(data=data, model=str(tiny_model), out=tmp_path / "o", micro_batch_size=micro)
    p = plan(cfg)
    assert p.mini_batch_size == groups * per_group
    assert p.micro_batch_size == want and p.mini_batch_size % p.micro_batch_size == 0


def test_cli_reports_bad_input_before_training(tmp_path, tiny_model, fingerprint, monkeypatch):
    from selfplay import cli
    from selfplay.train import workers

    def no_workers(*_a, **_k):
        raise AssertionError("workers must not be built for bad input")

    monkeypatch.setattr(workers, "open_workers", no_workers)
    runner = CliRunner()
    base = ["train", "--model", str(tiny_model), "--out", str(tmp_path / "o")]

    empty = write_rows(tmp_path / "empty.parquet", [])
    res = runner.invoke(cli.app, [*base, "--data", str(empty)])
    assert res.exit_code == 1 and "no rows" in " ".join(res.output.split())

    other = write_rows(tmp_path / "x.parquet", make_rows(simple_specs(), fingerprint="other"))
    res = runner.invoke(cli.app, [*base, "--data", str(other)])
    assert res.exit_code == 1 and "tokenized with tokenizer" in " ".join(res.output.split())

    good = write_rows(tmp_path / "g.parquet", make_rows(simple_specs(), fingerprint=fingerprint))
    res = runner.invoke(cli.app, [*base, "--data", str(good)], env={"TRAIN_BATCH_SIZE": "64"})
    assert res.exit_code == 1 and "too few for one mini-batch of 64" in " ".join(res.output.split())

    res = runner.invoke(cli.app, [*base, "--data", str(good), "--rollout-is", "is"])
    assert res.exit_code == 1 and "--rollout-is" in " ".join(res.output.split())
