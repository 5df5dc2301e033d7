"""The real verl update on a CPU with a tiny model: it learns, it ignores mask-0 tokens, it saves.

One in-process actor engine is built per module (about 10 s) and shared by the tests that need
verl's worker API directly; the CLI smoke test builds its own (actor + reference worker).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from selfplay.records import TRAINING_SCHEMA
from selfplay.train.batch import rows_from_table
from selfplay.train.config import TrainConfig
from tests.fakes import make_rows, write_rows

pytestmark = pytest.mark.slow

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REDIS_STORE_SERVER_HOST")
ENV_AT_IMPORT = {k: os.environ.get(k) for k in RENDEZVOUS}
PROMPT = [5, 6, 7, 8]
GOOD = [20, 21, 22, 23, 24]
BAD = [30, 31, 32, 33, 34]
MASK = [1, 1, 0, 0, 1]  # a partner turn (mask 0) in the middle of the seat's response


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    from selfplay.train.workers import LocalWorkers

    cfg = TrainConfig(
        data=tmp_path_factory.mktemp("d") / "x.parquet",
        model=str(tiny_model),
        out=tmp_path_factory.mktemp("o"),
        lr=1e-3,
        micro_batch_size=2,
    )
    workers = LocalWorkers(cfg, total_steps=100)
    yield workers
    workers.close()


def planted_rows():
    """One group: the rewarded response GOOD twice, the unrewarded BAD twice."""
    specs = [(0, PROMPT, GOOD, MASK, 1.0), (0, PROMPT, BAD, MASK, 0.0)] * 2
    return rows_from_table(pa.Table.from_pylist(make_rows(specs), schema=TRAINING_SCHEMA))


def batch_with_advantages(rows):
    from selfplay.reward import row_advantages
    from selfplay.train.batch import collate

    batch = collate(rows, pad_id=0)
    adv = torch.from_numpy(row_advantages(rows)).float()[:, None]
    batch["advantages"] = adv * batch["response_mask"].float()
    return batch


def own_logprob(engine, batch) -> torch.Tensor:
    lp = engine.log_probs(batch)["log_probs"]
    return (lp * batch["response_mask"]).sum(-1)


def update_once(engine, batch):
    from selfplay.train.workers import update_inputs

    batch["old_log_probs"] = engine.log_probs(batch)["log_probs"]
    if engine.ref is not None:
        batch["ref_log_prob"] = engine.ref_log_probs(batch)
    return engine.update(update_inputs(batch), mini_batch_size=len(batch["prompts"]), seed=0)


def test_workers_leave_no_rendezvous_in_environ(engine):
    """A held MASTER_PORT left in os.environ would be inherited by every later subprocess
    (iterate's stages), whose own process group then fails to bind it."""
    assert {k: os.environ.get(k) for k in RENDEZVOUS} == ENV_AT_IMPORT


def test_one_step_changes_parameters(engine):
    batch = batch_with_advantages(planted_rows())
    before = engine.full_state_dict()
    metrics = update_once(engine, batch)
    after = engine.full_state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed after one verl update"
    assert float(metrics["grad_norm"][0]) > 0
    assert "actor/pg_loss" in metrics and "actor/pg_clipfrac" in metrics


def test_planted_signal_moves_log_probs(engine):
    rows = planted_rows()
    batch = batch_with_advantages(rows)
    start = own_logprob(engine, batch)
    for _ in range(4):
        update_once(engine, batch)
    end = own_logprob(engine, batch)
    good, bad = rows.rewards == 1.0, rows.rewards == 0.0
    assert (end[good] > start[good] + 0.05).all(), (start, end)
    assert (end[bad] < start[bad] - 0.05).all(), (start, end)


def test_mask0_positions_contribute_nothing(engine):
    batch = batch_with_advantages(planted_rows())
    batch["old_log_probs"] = engine.log_probs(batch)["log_probs"] - 0.05  # a ratio away from 1
    base = engine.loss(batch)
    off = batch["response_mask"] == 0
    g = torch.Generator().manual_seed(0)
    noisy = dict(batch)
    noisy["advantages"] = torch.where(
        off, torch.randn(off.shape, generator=g) * 5, batch["advantages"]
    )
    noisy["old_log_probs"] = torch.where(
        off, torch.randn(off.shape, generator=g) - 3, batch["old_log_probs"]
    )
    assert engine.loss(noisy) == pytest.approx(base, abs=1e-7)
    # ...while the same change on an own (mask-1) token does change the loss
    own = dict(batch)
    own["advantages"] = batch["advantages"].clone()
    own["advantages"][0, 0] += 3.0
    assert engine.loss(own) != pytest.approx(base, abs=1e-4)


def test_saved_hf_dir_reloads_identically_and_generates(engine, tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfplay.train.export import export_hf_dir

    engine.save(str(tmp_path / "ckpt"), 7)
    out = export_hf_dir(tmp_path / "ckpt" / "huggingface", tmp_path / "hf", str(tiny_model))
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert "attn_implementation" not in config
    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.float32
    live = engine.full_state_dict()
    loaded = model.state_dict()
    for k, v in live.items():
        assert torch.equal(v, loaded[k]), k
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]


def test_cli_trains_with_kl_and_tis(tmp_path, tiny_model):
    """`selfplay train` end to end: reference worker (KL), TIS weights, HF dir, metrics.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfplay import cli
    from selfplay.models import tokenizer_fingerprint

    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model))
    specs = []
    for g in range(3):
        for k in range(4):
            specs.append((g, [5 + g, 6, 7], [20 + k, 21, 22, 23], [1, 0, 1, 1], float(k % 2)))
    data = write_rows(tmp_path / "train.parquet", make_rows(specs, fingerprint=fp, logprob=-5.9))
    out = tmp_path / "ckpt"
    locks = set(Path(tempfile.gettempdir()).glob("ckpt_*.lock"))
    res = CliRunner().invoke(
        cli.app,
        [
            "train",
            "--data",
            str(data),
            "--model",
            str(tiny_model),
            "--out",
            str(out),
            "--epochs",
            "2",
            "--lr",
            "1e-3",
            "--mini-batch-size",
            "4",
            "--kl-coef",
            "0.1",
            "--rollout-is",
            "tis",
        ],
        env={"TRAIN_BATCH_SIZE": "8", "MICRO_BATCH_SIZE": "2"},
    )
    assert res.exit_code == 0, res.output
    # verl's checkpoint lock files went to a private temporary folder, removed afterwards
    assert set(Path(tempfile.gettempdir()).glob("ckpt_*.lock")) <= locks
    metrics = json.loads((out / "metrics.json").read_text())
    steps = metrics["steps"]
    assert len(steps) == 2 * 2  # 12 rows -> one batch of 8 and one of 4, per epoch
    for s in steps:
        for key in ("pg_loss", "kl", "clip_frac", "grad_norm", "entropy", "tokens_per_s", "time_s"):
            assert s[key] is not None and np.isfinite(s[key]), key
        assert s["rollout_is_mean"] is not None
    assert 0 <= steps[0]["kl"] < steps[-1]["kl"]  # the reference is the start model
    assert steps[-1]["kl"] > 0
    assert metrics["config"]["batch_size"] == 8 and metrics["config"]["micro_batch_size"] == 2
    assert (out / "verl_checkpoint" / "global_step_4" / "huggingface").is_dir()
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), base.state_dict().values())
    )
    # the same directory refuses to be overwritten, before any training
    res = CliRunner().invoke(
        cli.app, ["train", "--data", str(data), "--model", str(tiny_model), "--out", str(out)]
    )
    assert res.exit_code == 1 and "already holds a model" in " ".join(res.output.split())


def test_ray_launcher_runs_the_same_update_on_cpu(tiny_model, tmp_path):
    """The multi-GPU path (a Ray worker group, reference colocated), on the CPU with one worker."""
    pytest.importorskip("ray")
    from selfplay.train.workers import RayWorkers

    cfg = TrainConfig(
        data=tmp_path / "x.parquet",
        model=str(tiny_model),
        out=tmp_path / "o",
        lr=1e-3,
        micro_batch_size=2,
        launcher="ray",
        kl_coef=0.1,
    )
    assert cfg.use_ray
    workers = RayWorkers(cfg, total_steps=10)
    try:
        batch = batch_with_advantages(planted_rows())
        start = own_logprob(workers, batch)
        metrics = update_once(workers, batch)
        assert float(metrics["grad_norm"][0]) > 0
        end = own_logprob(workers, batch)
        ref = (workers.ref_log_probs(batch) * batch["response_mask"]).sum(-1)
        assert torch.allclose(ref, start, atol=1e-5)  # the reference stays the start model
        good = planted_rows().rewards == 1.0
        assert (end[good] > start[good]).all() and (end[~good] < start[~good]).all()
    finally:
        workers.close()


def test_a_full_disk_leaves_nothing_half_written_and_a_retry_works(tmp_path, monkeypatch):
    """ENOSPC while the model is written: one clear error naming the folder and the free space,
    no partial model in --out, and the same command works once there is room."""
    import errno

    from selfplay.train import trainer
    from selfplay.train.publish import DiskFull

    out = tmp_path / "model"

    def full(cfg, on_step):
        (cfg.out / "verl_checkpoint").mkdir(parents=True)
        (cfg.out / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "_train", full)
    cfg = TrainConfig(data=tmp_path / "x.parquet", model=str(tmp_path), out=out)
    with pytest.raises(DiskFull, match=r"disk filled up .* MiB are free"):
        trainer.train(cfg)
    assert not out.exists() and not list(tmp_path.glob(".model.partial*"))

    def ok(cfg, on_step):
        cfg.out.mkdir(parents=True)
        (cfg.out / "config.json").write_text("{}")
        (cfg.out / trainer.METRICS_FILENAME).write_text('{"config": {"out": "x"}}')
        return trainer.TrainResult(cfg.out, None, cfg.out / trainer.METRICS_FILENAME)

    monkeypatch.setattr(trainer, "_train", ok)
    result = trainer.train(cfg)
    assert result.model_dir == out and (out / "config.json").exists()
    assert json.loads((out / "metrics.json").read_text())["config"]["out"] == str(out)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_scores_are_the_full_heads_scores_at_the_kept_positions(temperature):
    """The log-softmax of the kept positions alone gives the log-probs (and entropies) the full
    head gives there, at the sampling temperature; every other position holds 0."""
    from types import SimpleNamespace

    from verl.utils.torch_functional import entropy_from_logits

    from selfplay.train.lm_head import kept_scores

    gen = torch.Generator().manual_seed(0)
    total, vocab = 11, 17
    logits = torch.randn(total, vocab, generator=gen) * 3
    labels = torch.randint(vocab, (total,), generator=gen)
    index = torch.tensor([2, 3, 7, 10])
    args = {
        "temperature_is_one": temperature == 1.0,
        "temperature_rmpad": torch.full((total,), temperature),
        "input_ids_rmpad_rolled": labels,
    }
    engine = SimpleNamespace(compute_entropy_from_logits=entropy_from_logits)
    got = kept_scores(engine, logits[index].unsqueeze(0), args, index, total, entropy=True)
    full = torch.log_softmax(logits / temperature, dim=-1)
    want = full.gather(-1, labels[:, None]).squeeze(-1)
    others = torch.ones(total, dtype=torch.bool)
    others[index] = False
    assert got.log_probs.shape == got.entropy.shape == (1, total)
    torch.testing.assert_close(got.log_probs[0, index], want[index])
    torch.testing.assert_close(got.entropy[0, index], -(full.exp() * full).sum(-1)[index])
    assert not got.log_probs[0, others].any() and not got.entropy[0, others].any()
    # index None: every position kept (forward-only scoring), nothing spread
    every = kept_scores(engine, logits.unsqueeze(0), args, None, total, entropy=True)
    torch.testing.assert_close(every.log_probs[0], want)
    torch.testing.assert_close(every.entropy[0], -(full.exp() * full).sum(-1))
    # ...with the entropies (a report) only where they are read
    some = kept_scores(
        engine, logits.unsqueeze(0), args, None, total, entropy=True, entropy_at=index
    )
    torch.testing.assert_close(some.log_probs[0], want)
    torch.testing.assert_close(some.entropy[0, index], every.entropy[0, index])
    assert not some.entropy[0, others].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_log_probs_are_verls_per_position_log_probs_and_gradients(dtype, monkeypatch):
    """verl without flash-attn loops over the packed positions one at a time; label_log_probs
    scores blocks of positions (here 3, 3, 3 and 2 of 11) with the same values and gradients."""
    from verl.utils import torch_functional as verl_F

    from selfplay.train import lm_head

    monkeypatch.setattr(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)
    monkeypatch.setattr(verl_F, "NPU_CROSS_ENTROPY_LOSS_AVAILABLE", False)
    monkeypatch.setitem(lm_head._BLOCK_ELEMENTS, "cpu", 3 * 17)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(11, 17, generator=gen) * 3).to(dtype)
    labels = torch.randint(17, (11,), generator=gen)
    weights = torch.randn(11, generator=gen).to(dtype)
    mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = lm_head.label_log_probs(mine, labels)
    want = verl_F.logprobs_from_logits_v2(theirs, labels)
    torch.testing.assert_close(got, want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad)


def test_lm_head_at_trained_positions_gives_the_full_heads_loss_and_update(
    tiny_model, tmp_path, monkeypatch
):
    """`lm_head_positions="trained"` runs the LM head only where the next token is trained; the
    PPO loss, the SFT loss and the weights after an update equal those of verl's full head."""
    from selfplay.train import lm_head
    from selfplay.train.workers import LocalWorkers, sft_inputs, update_inputs

    kept: list[tuple[int, int]] = []
    real = lm_head.kept_positions

    def record(micro_batch, total):
        index = real(micro_batch, total)
        kept.append((total, -1 if index is None else len(index)))
        return index

    monkeypatch.setattr(lm_head, "kept_positions", record)
    scored: dict[str, list[bool]] = {"all": [], "trained": []}  # kept_scores calls: every position?
    real_scores = lm_head.kept_scores

    def spy(engine, logits, output_args, index, total, **kw):
        scored[mode].append(index is None)
        return real_scores(engine, logits, output_args, index, total, **kw)

    monkeypatch.setattr(lm_head, "kept_scores", spy)
    rows = planted_rows()
    got, reports = {}, {}
    for mode in ("all", "trained"):
        cfg = TrainConfig(
            data=tmp_path / "x.parquet", model=str(tiny_model), out=tmp_path / mode, lr=1e-3,
            micro_batch_size=2, lm_head_positions=mode,
        )  # fmt: skip
        workers = LocalWorkers(cfg, total_steps=10)
        batch = batch_with_advantages(rows)
        before = len(scored[mode])
        scoring = workers.log_probs(batch, entropy=True)  # forward-only: every position
        # the trained mode scores these through kept_scores (blocks, not verl's per-token loop)
        if mode == "trained":
            assert len(scored[mode]) > before and all(scored[mode][before:]), scored
        mask = batch["response_mask"].float()
        entropy = (scoring["entropy"] * mask).sum() / mask.sum()
        reports[mode] = scoring["log_probs"] * mask, entropy
        batch["old_log_probs"] = scoring["log_probs"] - 0.05  # ratios off 1
        ppo = workers.loss(batch)
        workers.update(update_inputs(batch), mini_batch_size=len(batch["prompts"]), seed=0)
        weights = workers.full_state_dict()
        workers.use_sft_loss()
        sft = workers.loss(sft_inputs(batch))
        got[mode] = ppo, sft, weights
        workers.close()
    # the trained mode kept the mask-1 positions only: 3 of each row's 9 (PROMPT + response)
    assert kept and all(n == 3 * total // 9 for total, n in kept), kept
    assert not scored["all"] and scored["trained"], scored  # verl's own path in "all" mode
    # forward-only scoring: verl's log-probs, and the entropy report (trained tokens) its mean
    torch.testing.assert_close(reports["trained"][0], reports["all"][0])
    torch.testing.assert_close(reports["trained"][1], reports["all"][1])
    assert got["trained"][0] == pytest.approx(got["all"][0], rel=1e-5, abs=1e-7)
    assert got["trained"][1] == pytest.approx(got["all"][1], rel=1e-5)
    # float rounding only: Adam turns a gradient near its epsilon into a step of about lr (1e-3)
    # either way, so a weight may differ by a small fraction of one step
    for name, value in got["all"][2].items():
        torch.testing.assert_close(got["trained"][2][name], value, rtol=1e-5, atol=1e-5)
