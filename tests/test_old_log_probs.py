"""``--old-log-probs rollout``: the generator's own log-probs as PPO's old log-probs (one forward
pass fewer per step), and the checks that keep them and ``--rollout-is tis`` honest: the rows'
log-probs must be the quantity the trainer scores (temperature 1, the model's own tokens).

The slow test generates on-policy games at temperature 1 with the hf engine (fp32), converts them,
measures how far the recorded log-probs are from the trainer's own (verl's forward pass), and
trains once with each setting: the two updates land on the same weights to a stated tolerance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.train.batch import read_rows, rows_from_table
from selfplay.train.config import TrainConfig
from selfplay.train.trainer import TrainDataError, _check_rollout_log_probs
from tests.fakes import make_rows, simple_specs, write_rows


def _rows(tmp_path: Path, temperature: float | None, off_policy: bool = False):
    rows = make_rows(simple_specs())
    for r in rows:
        r["temperature"] = temperature
        r["off_policy"] = off_policy and r["reward"] == 1.0
    table = read_rows(write_rows(tmp_path / "t.parquet", rows))
    return rows_from_table(table)


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    return TrainConfig(data=tmp_path / "t.parquet", model="m", out=tmp_path / "o", **kw)


@pytest.mark.parametrize("option", [{"rollout_is": "tis"}, {"old_log_probs": "rollout"}])
def test_log_probs_sampled_at_another_temperature_are_refused(tmp_path, option):
    rows = _rows(tmp_path, 0.7)
    with pytest.raises(TrainDataError, match=r"sampled at temperature 0\.7.*--policy-temperature"):
        _check_rollout_log_probs(rows, _cfg(tmp_path, **option))
    _check_rollout_log_probs(_rows(tmp_path, 1.0), _cfg(tmp_path, **option))  # the same: fine
    _check_rollout_log_probs(rows, _cfg(tmp_path, policy_temperature=0.7, **option))


def test_rollout_old_log_probs_need_the_temperature_and_no_guide_rows(tmp_path):
    cfg = _cfg(tmp_path, old_log_probs="rollout")
    with pytest.raises(TrainDataError, match="does not record"):
        _check_rollout_log_probs(_rows(tmp_path, None), cfg)
    with pytest.raises(TrainDataError, match="guide rows"):
        _check_rollout_log_probs(_rows(tmp_path, 1.0, off_policy=True), cfg)
    # recomputing needs neither; TIS takes rows of an unknown temperature as before
    _check_rollout_log_probs(_rows(tmp_path, None), _cfg(tmp_path))
    _check_rollout_log_probs(_rows(tmp_path, None), _cfg(tmp_path, rollout_is="tis"))


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_old_log_probs_train_like_recomputed_ones(primed_model, tmp_path, temperature):
    """At temperature 1, and at 0.7 with the trainer scoring its policy at 0.7 too."""
    games = tmp_path / "games"
    res = CliRunner().invoke(app, [
        "generate", "--model", str(primed_model), "--out", str(games), "--num-games", "8",
        "--games-per-scenario", "4", "--table-size", "3", "--temperature", str(temperature),
        "--max-new-tokens", "40", "--dtype", "fp32", "--seed", "4",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["convert", "--games", str(games / "games.jsonl"),
                                   "--val-fraction", "0"])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = games / "train.parquet"
    table = pq.read_table(data)
    assert table.column("temperature").to_pylist() == [pytest.approx(temperature)] * len(table)

    # the recorded log-probs against a fresh forward pass of the same weights (fp32)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(primed_model, dtype=torch.float32).eval()
    worst = 0.0
    for row in table.to_pylist():
        ids = row["prompt_ids"] + row["response_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            logp = torch.log_softmax(logits / temperature, -1)
        n = len(row["prompt_ids"])
        got = logp[n - 1 :].gather(1, torch.tensor(row["response_ids"])[:, None])[:, 0]
        mask = np.array(row["response_mask"], bool)
        diff = np.abs(got.numpy()[mask] - np.array(row["rollout_logprobs"])[mask])
        worst = max(worst, float(diff.max()))
    print(f"max |rollout - recomputed| over {table.num_rows} rows: {worst:.2e}", file=sys.stderr)
    assert worst < 1e-3

    # one step over all rows (two mini-batch updates): old log-probs are taken once, before it,
    # in both modes, so the only difference is where they come from
    n = table.num_rows
    outs = {}
    for mode in ("recompute", "rollout"):
        outs[mode] = tmp_path / mode
        res = CliRunner().invoke(app, [
            "train", "--data", str(data), "--model", str(primed_model), "--out", str(outs[mode]),
            "--lr", "1e-3", "--dtype", "fp32", "--old-log-probs", mode,
            "--policy-temperature", str(temperature),
            "--mini-batch-size", str(n // 2),
        ], env={"TRAIN_BATCH_SIZE": str(n), "MICRO_BATCH_SIZE": "4"})  # fmt: skip
        assert res.exit_code == 0, res.output
    steps = {m: json.loads((o / "metrics.json").read_text())["steps"] for m, o in outs.items()}
    assert [s["rows"] for s in steps["rollout"]] == [s["rows"] for s in steps["recompute"]] == [n]
    weights = {
        m: AutoModelForCausalLM.from_pretrained(o, dtype=torch.float32).state_dict()
        for m, o in outs.items()
    }
    base = model.state_dict()
    moved = max(float((weights["recompute"][k] - base[k]).abs().max()) for k in base)
    apart = max(float((weights["rollout"][k] - weights["recompute"][k]).abs().max()) for k in base)
    print(f"update {moved:.2e}, rollout vs recompute {apart:.2e}", file=sys.stderr)
    assert moved > 1e-4 and apart < 0.05 * moved


def test_iterate_refuses_rollout_log_probs_of_another_temperature_before_a_round():
    res = CliRunner().invoke(app, ["iterate", "--old-log-probs", "rollout", "--temperature", "0.7"])
    assert res.exit_code == 1 and "--policy-temperature 1" in res.output
    res = CliRunner().invoke(app, ["iterate", "--rollout-is", "tis", "--temperature", "0.5"])
    assert res.exit_code == 1 and "--rollout-is tis" in res.output
