"""Guided GRPO groups: LUFFY's shaped loss (against verl's vanilla loss and its own gradient), the
real verl update on guide rows, and an iterate round with --guide (rows, log-probs, resume)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from selfplay.records import TRAINING_SCHEMA, iter_game_records
from selfplay.reward import row_advantages
from selfplay.train.batch import collate, rows_from_table
from selfplay.train.config import TrainConfig
from selfplay.train.guided import _GUIDE, guided_policy_loss, shaped_token_losses
from tests.fakes import iterate_cmd as _cmd
from tests.fakes import kill_when as _kill_when
from tests.fakes import make_rows
from tests.fakes import run_ok as _run
from tests.fakes import start_killable as _start


@pytest.fixture(scope="module")
def actor_config(tiny_model, tmp_path_factory):
    from verl.utils.config import omega_conf_to_dataclass

    from selfplay.train.workers import worker_config

    cfg = TrainConfig(
        data=tmp_path_factory.mktemp("d") / "x.parquet", model=str(tiny_model), out=Path("o")
    )
    return omega_conf_to_dataclass(worker_config(cfg, 10).actor)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand((3, 5), generator=g) * 3
    new = old + torch.randn((3, 5), generator=g) * 0.5
    adv = torch.randn((3, 1), generator=g).expand(3, 5).clone()
    mask = torch.ones((3, 5))
    mask[1, 3:] = 0
    return old, new, adv, mask


def test_without_guide_tokens_the_loss_is_verls_vanilla(actor_config):
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    old, new, adv, mask = _inputs()
    for agg in ("token-mean", "seq-mean-token-mean"):
        want, _ = compute_policy_loss_vanilla(old, new, adv, mask, agg, actor_config)
        token = _GUIDE.set((torch.zeros_like(mask), 0.1))
        try:
            got, metrics = guided_policy_loss(old, new, adv, mask, agg, actor_config)
        finally:
            _GUIDE.reset(token)
        assert float(got) == pytest.approx(float(want), abs=1e-6)
        assert metrics["actor/guide_token_prob"] == 0.0


def test_guide_tokens_get_the_shaped_objective_and_its_gradient():
    gamma, a = 0.1, 1.5
    logp = torch.tensor([[-4.0, -0.1]], requires_grad=True)
    old = torch.tensor([[-4.0 - 1.0, -0.1]])  # the first token's ratio is e: clipped on-policy
    adv = torch.full((1, 2), a)
    for off in (torch.zeros((1, 2)), torch.ones((1, 2))):
        losses, clipped = shaped_token_losses(
            old, logp, adv, off, gamma=gamma, clip_low=0.2, clip_high=0.2
        )
        (grad,) = torch.autograd.grad(losses.sum(), logp)
        p = logp.detach().exp()
        if off.any():  # d/dlogp of -A p/(p+gamma) = -A gamma p/(p+gamma)^2, no clipping
            torch.testing.assert_close(losses.detach(), -a * p / (p + gamma))
            torch.testing.assert_close(grad, -a * gamma * p / (p + gamma) ** 2)
            assert not clipped.any()
        else:  # on-policy: the clipped token has no gradient, the other -A * ratio
            assert clipped[0, 0] and grad[0, 0] == 0 and grad[0, 1] == pytest.approx(-a)
    # the shaped gradient weighs an unlikely guide token more than a likely one, per log-prob
    w = gamma * p / (p + gamma) ** 2 / p
    assert w[0, 0] > w[0, 1]


PROMPT, GOOD, BAD, MASK = [5, 6, 7, 8], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34], [1, 1, 0, 0, 1]


def _guided_rows():
    """One group: the model's own BAD twice (reward 0), the guide's GOOD twice (reward 1)."""
    specs = [(0, PROMPT, BAD, MASK, 0.0), (0, PROMPT, GOOD, MASK, 1.0)] * 2
    rows = make_rows(specs)
    for r in rows:
        r["off_policy"] = r["reward"] == 1.0
    return rows_from_table(pa.Table.from_pylist(rows, schema=TRAINING_SCHEMA))


@pytest.mark.slow
def test_guide_rows_carry_the_current_policys_log_probs_and_are_learned(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from selfplay.train.workers import LocalWorkers, update_inputs

    rows = _guided_rows()
    batch = collate(rows, pad_id=0)
    assert batch["off_policy"].sum() == 2 * sum(MASK)
    batch["advantages"] = (
        torch.from_numpy(row_advantages(rows)).float()[:, None] * batch["response_mask"].float()
    )
    cfg = TrainConfig(data=tmp_path / "x.parquet", model=str(tiny_model), out=tmp_path, lr=1e-3)
    workers = LocalWorkers(cfg, total_steps=10)
    try:
        workers.use_guided_loss(0.1)
        lp = workers.log_probs(batch)["log_probs"]
        # the no-grad pass is the model's own log-probs of the guide's tokens
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
        ids = torch.tensor([PROMPT + GOOD])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(GOOD)[:, None])[:, 0]
        torch.testing.assert_close(lp[1], want, atol=1e-4, rtol=0)
        start = (lp * batch["response_mask"]).sum(-1)
        for _ in range(4):
            batch["old_log_probs"] = workers.log_probs(batch)["log_probs"]
            metrics = workers.update(update_inputs(batch), mini_batch_size=4, seed=0)
        end = (workers.log_probs(batch)["log_probs"] * batch["response_mask"]).sum(-1)
    finally:
        workers.close()
    assert "actor/guide_token_prob" in metrics
    guide = torch.from_numpy(rows.off_policy)
    assert (end[guide] > start[guide] + 0.05).all(), (start, end)
    assert (end[~guide] < start[~guide] - 0.05).all(), (start, end)


def _guided_cmd(root: Path, model: Path) -> list[str]:
    cmd = _cmd(root, model, "guided")
    cmd[cmd.index("--iterations") + 1] = "1"
    cmd[cmd.index("--eval-scenarios") + 1] = "0"
    return [*cmd, "--guide", "scripted:cooperative", "--guide-games", "1", "--keep-degenerate"]


@pytest.fixture(scope="module")
def guided_run(primed_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("guided_ref")
    _run(_guided_cmd(root, primed_model))
    return root


@pytest.mark.slow
def test_an_iterate_round_with_a_guide_trains_on_its_rows(guided_run, primed_model):
    from selfplay.players.llm import load_chat_format
    from tests.test_sft import _assert_rows_are_the_games_actions

    rdir = guided_run / "data" / "guided" / "round_0"
    own = list(iter_game_records(rdir / "games.jsonl"))
    guides = list(iter_game_records(rdir / "guide.jsonl"))
    scenarios = list(dict.fromkeys(r.scenario_id for r in own))
    assert [g.scenario_id for g in guides] == scenarios  # one guide game on each, in order
    assert all(g.seats[0].name == "cooperative" and g.seats[0].trained for g in guides)
    rows = pq.read_table(rdir / "train.parquet").to_pylist()
    guide_rows = [r for r in rows if r["off_policy"]]
    assert sorted((r["game_id"], r["seat"]) for r in guide_rows) == sorted(
        (g.game_id, s) for g in guides for s in (0, 1)
    )
    assert all(r["game_id"] in {g.game_id for g in own} for r in rows if not r["off_policy"])
    # a guide row's mask-1 tokens are the guide's action texts; it shares its scenario's group
    _assert_rows_are_the_games_actions(
        guide_rows, rdir / "guide.jsonl", load_chat_format(str(primed_model))
    )
    groups = {r["group_id"] for r in rows if not r["off_policy"]}
    assert {r["group_id"] for r in guide_rows} <= groups
    manifest = json.loads((guided_run / "data" / "guided" / "manifest.json").read_text())
    assert manifest["rounds"]["0"]["stages"]["convert"]["info"]["guide_games"] == len(scenarios)
    steps = json.loads(
        (guided_run / "checkpoints" / "guided" / "round_0" / "metrics.json").read_text()
    )["steps"]
    assert steps and all(s["guide_token_prob"] is not None for s in steps)


@pytest.mark.slow
def test_a_guided_round_resumes_after_sigkill(guided_run, primed_model, tmp_path):
    cmd = _guided_cmd(tmp_path, primed_model)
    run = tmp_path / "data" / "guided"
    proc = _start(cmd, SELFPLAY_HOLD_BEFORE="convert")
    _kill_when(proc, lambda: (run / "holding_convert").exists())
    (run / "holding_convert").unlink()
    proc = _start(cmd)  # mid-train, after the guide games and rows were written
    _kill_when(proc, lambda: (tmp_path / "checkpoints" / "guided" / ".round_0.partial").exists())
    _run(cmd)
    ref = guided_run / "data" / "guided" / "round_0"

    def games(path: Path) -> list[dict]:  # all but the wall-clock timings
        return [r.model_dump(mode="json", exclude={"timings"}) for r in iter_game_records(path)]

    assert games(run / "round_0" / "guide.jsonl") == games(ref / "guide.jsonl")
    cols = ["game_id", "seat", "group_id", "response_ids", "off_policy", "reward"]
    assert (
        pq.read_table(run / "round_0" / "train.parquet").select(cols).to_pylist()
        == pq.read_table(ref / "train.parquet").select(cols).to_pylist()
    )

    def sha(root: Path) -> str:
        weights = root / "checkpoints" / "guided" / "round_0" / "model.safetensors"
        return hashlib.sha256(weights.read_bytes()).hexdigest()

    assert sha(tmp_path) == sha(guided_run)


def test_a_guide_is_checked_against_the_algorithm_and_partner():
    from selfplay.iterate.config import IterateConfig

    base = dict(name="r", iterations=1, model="m", engine={"kind": "hf", "model": "m"})
    IterateConfig(**base, guide="scripted:inquisitive")
    for extra, error in [
        ({"guide": "scripted:nobody"}, "must be scripted:NAME"),
        ({"guide": "inquisitive"}, "must be scripted:NAME"),
        ({"guide": "scripted:inquisitive", "algorithm": "expert-iteration"}, "GRPO"),
        ({"guide": "scripted:inquisitive", "partner": "openai:gpt-4.1"}, "not an API"),
    ]:
        with pytest.raises(ValueError, match=error):
            IterateConfig(**base, **extra)


@pytest.mark.slow
def test_the_entropy_bonus_raises_entropy_where_advantages_are_zero(tiny_model, tmp_path):
    """--entropy-coef: with every advantage 0 the policy gradient is 0, so what an update does is
    the bonus's: the entropy of the trained tokens goes up."""
    from selfplay.train.workers import LocalWorkers, update_inputs

    rows = rows_from_table(
        pa.Table.from_pylist(
            make_rows([(0, PROMPT, GOOD, MASK, 1.0), (0, PROMPT, BAD, MASK, 1.0)] * 2),
            schema=TRAINING_SCHEMA,
        )
    )
    batch = collate(rows, pad_id=0)
    batch["advantages"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    cfg = TrainConfig(
        data=tmp_path / "x.parquet", model=str(tiny_model), out=tmp_path, lr=1e-3, entropy_coef=1.0
    )
    workers = LocalWorkers(cfg, total_steps=10)
    mask = batch["response_mask"].float()

    def entropy() -> float:
        return float((workers.log_probs(batch, entropy=True)["entropy"] * mask).sum() / mask.sum())

    try:
        start = entropy()
        for _ in range(3):
            batch["old_log_probs"] = workers.log_probs(batch)["log_probs"]
            metrics = workers.update(update_inputs(batch), 4, seed=0, entropy=True)
        end = entropy()
    finally:
        workers.close()
    assert "actor/entropy_loss" in metrics
    assert end > start + 1e-3, (start, end)
