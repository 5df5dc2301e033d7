"""Offline GRPO: ``train(TrainConfig) -> TrainResult``.

1. Check everything that can be checked without a device: the parquet (schema, rows), the
   tokenizer fingerprint of the rows against ``--model``'s, batch sizes against the row count.
2. GRPO advantages over the whole data set with the reward seam (``selfplay.reward``: verl's own
   function per row, groups dataset-wide; rows with turn states get per-token turn credit).
3. Per step: the actor recomputes the old log-probs (and, with ``rollout_is="tis"``, verl's
   truncated importance weights against the generator's log-probs); the reference worker gives
   reference log-probs when a KL loss is on; verl's PPO-clip update runs on the batch.
4. Save verl's checkpoint (resumable) and export a clean Hugging Face directory; write
   metrics.json with one entry per step.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from selfplay.reward import row_advantages, token_advantages
from selfplay.train.batch import (
    Rows,
    TrainDataError,
    check_token_ids,
    check_tokenizer,
    collate,
    read_rows,
    rows_from_table,
)
from selfplay.train.config import TrainConfig
from selfplay.train.publish import METRICS_FILENAME, publish

log = logging.getLogger(__name__)


CHECKPOINT_DIRNAME = "verl_checkpoint"


@dataclass
class StepMetrics:
    """One optimizer step's numbers (means over its mini-batches)."""

    step: int
    epoch: int
    rows: int
    tokens: int
    pg_loss: float
    loss: float
    kl: float | None  # KL loss vs the reference model (None without one)
    ppo_kl: float  # approximate KL between the updated policy and the old log-probs
    clip_frac: float
    grad_norm: float
    entropy: float  # mean per-token entropy of the policy before the step (own tokens)
    lr: float
    time_s: float
    tokens_per_s: float
    update_tokens_per_s: float
    rollout_is_mean: float | None = None
    guide_token_prob: float | None = None  # guided groups: mean probability of guide tokens

    def line(self, total: int) -> str:
        return (
            f"step {self.step}/{total}: pg_loss {self.pg_loss:.4f}, "
            f"grad_norm {self.grad_norm:.3f}, clip {self.clip_frac:.3f}, "
            f"{self.tokens_per_s:.0f} tokens/s"
        )


@dataclass
class TrainResult:
    model_dir: Path
    checkpoint_dir: Path | None
    metrics_path: Path
    steps: list = field(default_factory=list)  # StepMetrics (train) or SFTStepMetrics (sft)
    rows: int = 0
    updates: int = 0  # optimizer updates (one per mini-batch)


@dataclass(frozen=True)
class Plan:
    """What will be trained, decided before any model is loaded."""

    rows: Rows
    advantages: np.ndarray  # [N] one GRPO advantage per row (the episode's)
    pad_id: int
    batch_size: int
    mini_batch_size: int
    steps_per_epoch: int
    micro_batch_size: int  # per device; divides mini_batch_size / world size (verl requires it)
    token_advantages: list[np.ndarray] | None = None  # per row, per response token (turn credit)


def _vocab_size(model: str, tokenizer) -> int:
    """Rows of ``model``'s input embedding (its config's vocab_size; the tokenizer's length
    where the config cannot be read): the ids it can be trained on."""
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(model).vocab_size)
    except (OSError, ValueError, AttributeError, TypeError):
        return len(tokenizer)


def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise TrainDataError(
            f"cannot load the tokenizer of --model {model} ({e}); pass a local HF model directory"
        ) from e


def batch_sizes(n: int, cfg: TrainConfig) -> tuple[int, int, int]:
    """(rows per step, rows per optimizer update, steps per epoch) for ``n`` rows."""
    mini = cfg.mini_batch_size or cfg.batch_size or n
    if n < mini:
        raise TrainDataError(
            f"{n} training rows are too few for one mini-batch of {mini}; lower "
            "--mini-batch-size / --batch-size (TRAIN_BATCH_SIZE) or generate more games"
        )
    if mini % cfg.world_size:
        raise TrainDataError(
            f"the mini-batch ({mini} rows) must split evenly over {cfg.world_size} devices"
        )
    batch = cfg.batch_size or (n // mini) * mini
    batch = min(batch, (n // mini) * mini)
    steps = n // batch
    rest = n - steps * batch
    if rest >= mini:
        steps += 1  # a last, smaller batch of whole mini-batches
    dropped = rest % mini if rest >= mini else rest
    if dropped:
        log.warning(
            "%d of %d rows do not fill a mini-batch of %d and are left out of each epoch "
            "(a different %d each epoch)",
            dropped,
            n,
            mini,
            dropped,
        )
    return batch, mini, steps


def micro_batch(mini: int, cfg: TrainConfig) -> int:
    """The largest micro-batch up to ``cfg.micro_batch_size`` that divides a device's share."""
    per_device = mini // cfg.world_size
    micro = max(
        d for d in range(1, min(cfg.micro_batch_size, per_device) + 1) if per_device % d == 0
    )
    if micro != cfg.micro_batch_size:
        log.info(
            "micro-batch %d -> %d so that it divides the mini-batch (%d rows per device)",
            cfg.micro_batch_size,
            micro,
            per_device,
        )
    return micro


def load_rows(cfg: TrainConfig, *, groups: bool = True) -> tuple[Rows, int]:
    """The checked rows of ``cfg.data`` (made with ``cfg.model``'s tokenizer) and the pad id;
    ``groups=False`` for behaviour cloning, whose rows need no GRPO group."""
    from selfplay.models import tokenizer_fingerprint

    table = read_rows(cfg.data)
    tokenizer = _load_tokenizer(cfg.model)
    check_tokenizer(table, tokenizer_fingerprint(tokenizer), cfg.model)
    check_token_ids(table, _vocab_size(cfg.model, tokenizer), cfg.data, cfg.model)
    rows = rows_from_table(table, max_length=cfg.max_length, groups=groups)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    if pad_id is None:
        raise TrainDataError(f"the tokenizer of {cfg.model} has neither a pad nor an EOS token")
    return rows, pad_id


def plan(cfg: TrainConfig) -> Plan:
    """Read and check the rows and sizes; raise ``TrainDataError`` with what to do."""
    rows, pad_id = load_rows(cfg)
    n = len(rows)
    _check_rollout_log_probs(rows, cfg)
    batch, mini, steps = batch_sizes(n, cfg)
    advantages = row_advantages(rows, std_norm=cfg.std_norm)
    flat = int((advantages == 0).sum())
    if flat == n:
        raise TrainDataError(
            "every GRPO group has equal rewards, so every advantage is 0 and training would "
            "change nothing; groups must span games of one scenario with different outcomes"
        )
    if flat:
        log.info("%d of %d rows have advantage 0 (their group's rewards are all equal)", flat, n)
    micro = micro_batch(mini, cfg)
    per_token = None
    if rows.turn_states is not None:
        per_token = token_advantages(
            rows, rows.masks, rows.turn_states, advantages, std_norm=cfg.std_norm
        )
        with_states = sum(s is not None for s in rows.turn_states)
        log.info("turn credit: %d of %d rows carry turn states", with_states, n)
    return Plan(rows, advantages, pad_id, batch, mini, steps, micro, per_token)


def _check_rollout_log_probs(rows: Rows, cfg: TrainConfig) -> None:
    """The generator's log-probs stand for the trainer's only where they are the same quantity:
    present, the model's own (no guide row), and sampled at the temperature the trainer scores its
    policy at, ``--policy-temperature`` (greedy rows, 0, carry the plain log-softmax: 1)
    (``--rollout-is tis`` compares them, ``--old-log-probs rollout`` uses them as they are)."""
    uses = cfg.rollout_log_prob_uses
    if not uses:
        return
    what = " and ".join(uses)
    if not any(any(lp != 0.0 for lp in row) for row in rows.rollout_logprobs):
        raise TrainDataError(
            f"{what} needs the generator's log-probs, but every rollout_logprobs value is 0; "
            "generate with an engine that returns log-probs, or leave the option out"
        )
    temps = rows.temperature
    known = temps[np.isfinite(temps)] if temps is not None else np.array([])
    policy = cfg.policy_temperature
    off = sorted({round(float(t), 6) for t in known if not cfg.scores_like(float(t))})
    if off:
        raise TrainDataError(
            f"{what}: rows were sampled at temperature {', '.join(f'{t:g}' for t in off)}, so "
            "their log-probs are log-softmax(logits / T) while the trainer scores the policy at "
            f"--policy-temperature {policy:g}: the two are not the same quantity. Set "
            "--policy-temperature to the generation temperature, or leave the option out"
        )
    if cfg.old_log_probs == "rollout":
        if rows.off_policy is not None:
            raise TrainDataError(
                "--old-log-probs rollout: guide rows (off_policy) have no generator log-probs; "
                "recompute them (leave the option out)"
            )
        if temps is None or len(known) < len(temps):
            raise TrainDataError(
                "--old-log-probs rollout needs each row's sampling temperature, which this file "
                "does not record (written before the temperature column); convert the games "
                "again with this selfplay"
            )


def _epoch_batches(p: Plan, epoch: int, seed: int) -> list[np.ndarray]:
    chunks = minibatch_chunks(
        len(p.rows), p.batch_size, p.mini_batch_size, p.steps_per_epoch, epoch, seed
    )
    return [np.sort(c) for c in chunks]


def step_batch(p: Plan, idx: np.ndarray) -> dict[str, torch.Tensor]:
    """The padded tensors of rows ``idx`` with their advantages (0 on mask-0 positions)."""
    rows = p.rows.select(idx)
    batch = collate(rows, p.pad_id)
    if p.token_advantages is None:
        adv = torch.from_numpy(p.advantages[idx]).float()[:, None]
        batch["advantages"] = adv * batch["response_mask"].float()
        return batch
    adv = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    for row, i in enumerate(idx):
        values = p.token_advantages[int(i)]
        adv[row, : len(values)] = torch.from_numpy(values)
    batch["advantages"] = adv
    return batch


def add_old_log_probs(workers, batch: dict[str, torch.Tensor], cfg: TrainConfig) -> dict:
    """Old log-probs from the actor (or, ``--old-log-probs rollout``, the generator's: one
    forward pass fewer); TIS weights and reference log-probs where configured."""
    extra: dict[str, float] = {}
    if cfg.old_log_probs == "rollout":
        batch["old_log_probs"] = batch["rollout_log_probs"].clone()  # 0 where the mask is 0
    else:
        out = workers.log_probs(batch, entropy=True)
        batch["old_log_probs"] = out["log_probs"]
        mask = batch["response_mask"].float()
        if "entropy" in out:
            extra["entropy"] = float((out["entropy"] * mask).sum() / mask.sum())
    if cfg.rollout_is == "tis":
        from verl.trainer.ppo.rollout_corr_helper import (
            compute_rollout_correction_and_rejection_mask,
        )

        weights, _, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=batch["old_log_probs"],
            rollout_log_prob=batch["rollout_log_probs"],
            response_mask=batch["response_mask"],
            rollout_is="token",
            rollout_is_threshold=cfg.tis_cap,
        )
        batch["rollout_is_weights"] = weights.batch["rollout_is_weights"]
        extra["rollout_is_mean"] = float(metrics.get("rollout_corr/rollout_is_mean", float("nan")))
    if cfg.kl_coef > 0:
        batch["ref_log_prob"] = workers.ref_log_probs(batch)
    return extra


def mean_metric(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    return float(np.mean([float(v) for v in values]))


def train(
    cfg: TrainConfig,
    on_step: Callable[[StepMetrics, int], None] | None = None,
) -> TrainResult:
    """Run offline GRPO as ``cfg`` says; ``on_step(metrics, total_steps)`` after each step."""
    return publish(cfg, lambda staged: _train(staged, on_step))


def _train(cfg: TrainConfig, on_step) -> TrainResult:
    p = plan(cfg)
    cfg = cfg.model_copy(update={"micro_batch_size": p.micro_batch_size})
    total = p.steps_per_epoch * cfg.epochs
    log.info(
        "training %d rows: %d step(s) per epoch x %d epoch(s), batch %d, mini-batch %d, micro %d",
        len(p.rows),
        p.steps_per_epoch,
        cfg.epochs,
        p.batch_size,
        p.mini_batch_size,
        cfg.micro_batch_size,
    )
    guided = p.rows.off_policy is not None
    if guided:
        if cfg.use_ray:
            raise TrainDataError(
                "the rows hold guide rows (off_policy), whose loss runs with the local launcher "
                "only (CPU or one GPU); train on one device or convert without --guide"
            )
        n_guide = int(p.rows.off_policy.sum())
        log.info("%d guide row(s): LUFFY's shaped loss, gamma %s", n_guide, cfg.guide_gamma)
    from selfplay.train.workers import update_inputs

    def one(workers, epoch: int, idx: np.ndarray, step: int) -> tuple[StepMetrics, int]:
        t0 = time.perf_counter()
        batch = step_batch(p, idx)
        extra = add_old_log_probs(workers, batch, cfg)
        t1 = time.perf_counter()
        metrics = workers.update(
            update_inputs(batch), p.mini_batch_size, cfg.seed + step + 1,
            entropy=cfg.entropy_coef > 0,
        )  # fmt: skip
        t2 = time.perf_counter()
        tokens = int(batch["attention_mask"].sum())
        sm = StepMetrics(
            step=step + 1,
            epoch=epoch,
            rows=len(idx),
            tokens=tokens,
            pg_loss=mean_metric(metrics, "actor/pg_loss") or 0.0,
            loss=mean_metric(metrics, "loss") or 0.0,
            kl=mean_metric(metrics, "kl_loss"),
            ppo_kl=mean_metric(metrics, "actor/ppo_kl") or 0.0,
            clip_frac=mean_metric(metrics, "actor/pg_clipfrac") or 0.0,
            grad_norm=mean_metric(metrics, "grad_norm") or 0.0,
            entropy=extra.get("entropy", mean_metric(metrics, "actor/entropy_loss") or 0.0),
            lr=mean_metric(metrics, "lr") or cfg.lr,
            time_s=t2 - t0,
            tokens_per_s=tokens / max(t2 - t0, 1e-9),
            update_tokens_per_s=tokens / max(t2 - t1, 1e-9),
            rollout_is_mean=extra.get("rollout_is_mean"),
            guide_token_prob=mean_metric(metrics, "actor/guide_token_prob") if guided else None,
        )
        return sm, len(idx) // p.mini_batch_size

    batches = ((e, idx) for e in range(cfg.epochs) for idx in _epoch_batches(p, e, cfg.seed))

    def prepare(workers) -> None:
        if cfg.resume_from is not None:
            workers.load(str(cfg.resume_from))
        if guided:
            workers.use_guided_loss(cfg.guide_gamma)

    result = drive_updates(cfg, len(p.rows), total, batches, one, on_step, prepare=prepare)
    signal = len(np.unique(p.rows.group_ids[p.advantages != 0]))
    export_result(cfg, result, [asdict(s) for s in result.steps], groups_with_signal=signal)
    return result


def drive_updates(cfg: TrainConfig, rows: int, total: int, batches, one, on_step, *, prepare=None):
    """The loop ``train`` and ``train_sft`` share: open the workers, run ``one(workers, epoch,
    idx, step) -> (metrics, optimizer updates)`` on every batch (logging each step's line and
    calling ``on_step``), save verl's checkpoint, always close the workers."""
    torch.manual_seed(cfg.seed)
    from selfplay.train.workers import open_workers

    cfg.out.mkdir(parents=True, exist_ok=True)
    workers = open_workers(cfg, total)
    result = TrainResult(
        model_dir=cfg.out, checkpoint_dir=None, metrics_path=cfg.out / METRICS_FILENAME, rows=rows
    )
    try:
        if prepare is not None:
            prepare(workers)
        step = 0
        for epoch, idx in batches:
            sm, updates = one(workers, epoch, idx, step)
            step = sm.step
            result.updates += updates
            result.steps.append(sm)
            log.info("%s", sm.line(total))
            if on_step is not None:
                on_step(sm, total)
        _save(workers, cfg, step, result)
    finally:
        workers.close()
    return result


def _save(workers, cfg: TrainConfig, step: int, result: TrainResult) -> None:
    ckpt = cfg.out / CHECKPOINT_DIRNAME / f"global_step_{step}"
    workers.save(str(ckpt), step)
    result.checkpoint_dir = ckpt


def export_result(cfg: TrainConfig, result: TrainResult, steps: list[dict], **extra) -> None:
    """The HF directory from the saved checkpoint, verl's checkpoint kept or removed, and
    metrics.json (config, rows, one entry per step)."""
    from selfplay.train.export import export_hf_dir

    assert result.checkpoint_dir is not None
    lora = (cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None
    export_hf_dir(
        result.checkpoint_dir / "huggingface", cfg.out, tokenizer_source=cfg.model, lora=lora
    )
    if not cfg.save_verl_checkpoint:
        shutil.rmtree(cfg.out / CHECKPOINT_DIRNAME, ignore_errors=True)
        result.checkpoint_dir = None
    result.metrics_path.write_text(
        json.dumps(
            {"config": cfg.model_dump(mode="json"), "rows": result.rows, **extra, "steps": steps},
            indent=2,
        )
        + "\n"
    )
    from selfplay.train.model_card import write_card

    settings = cfg.model_dump(
        mode="json",
        include={"epochs", "lr", "batch_size", "mini_batch_size", "loss_agg", "kl_coef"}
        | {"clip_ratio", "entropy_coef", "rollout_is", "std_norm", "seed", "dtype", "lora_rank"},
    )
    write_card(
        cfg.out,
        base_model=cfg.model,
        algorithm=extra.get("algorithm", "grpo"),
        data={
            "path": str(cfg.data),
            "rows": result.rows,
            "groups_with_signal": extra.get("groups_with_signal"),
        },
        settings={**settings, "updates": result.updates},
    )


def minibatch_chunks(
    n: int, batch: int, mini: int, steps: int, epoch: int, seed: int
) -> list[np.ndarray]:
    """An epoch's row indices in ``steps`` chunks of whole mini-batches (shuffled per epoch)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    out, start = [], 0
    for _ in range(steps):
        size = min(batch, ((n - start) // mini) * mini)
        out.append(order[start : start + size])
        start += size
    return out
