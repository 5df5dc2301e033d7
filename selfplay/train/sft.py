"""Behaviour cloning on the trainer's workers: verl's SFT loss on the mask-1 tokens of the
rows (``train_sft``), the update ``selfplay sft`` and iterate's warm start run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from selfplay.train.batch import (
    collate,
)
from selfplay.train.config import TrainConfig
from selfplay.train.publish import publish
from selfplay.train.trainer import (
    TrainResult,
    batch_sizes,
    drive_updates,
    export_result,
    load_rows,
    mean_metric,
    micro_batch,
    minibatch_chunks,
)

log = logging.getLogger(__name__)


@dataclass
class SFTStepMetrics:
    """One call of SFT updates (one or more optimizer updates, one per mini-batch)."""

    step: int  # optimizer updates so far
    epoch: int
    rows: int
    tokens: int  # all tokens of the rows (prompt and response)
    trained_tokens: int  # mask-1 tokens, the ones the loss is on
    loss: float  # mean negative log-likelihood per trained token, over the mini-batches
    grad_norm: float
    lr: float
    time_s: float
    tokens_per_s: float

    def line(self, total: int) -> str:
        return (
            f"SFT update {self.step}/{total}: loss {self.loss:.4f}, "
            f"grad_norm {self.grad_norm:.3f}, {self.tokens_per_s:.0f} tokens/s"
        )


def train_sft(
    cfg: TrainConfig,
    on_step: Callable[[SFTStepMetrics, int], None] | None = None,
) -> TrainResult:
    """Supervised fine-tuning on the mask-1 tokens of ``cfg.data`` (rows need no groups), through
    the same verl workers as ``train`` with verl's SFT loss. ``batch_size`` rows go to the workers
    at a time and each ``mini_batch_size`` of them is one optimizer update."""
    return publish(cfg, lambda staged: _train_sft(staged, on_step))


def _train_sft(cfg: TrainConfig, on_step) -> TrainResult:
    rows, pad_id = load_rows(cfg, groups=False)
    batch, mini, steps_per_epoch = batch_sizes(len(rows), cfg)
    cfg = cfg.model_copy(update={"micro_batch_size": micro_batch(mini, cfg)})
    updates_per_epoch = sum(
        len(idx) // mini
        for idx in minibatch_chunks(len(rows), batch, mini, steps_per_epoch, 0, cfg.seed)
    )
    total = updates_per_epoch * cfg.epochs
    log.info(
        "SFT on %d rows: %d update(s) per epoch x %d epoch(s), mini-batch %d, micro %d",
        len(rows),
        updates_per_epoch,
        cfg.epochs,
        mini,
        cfg.micro_batch_size,
    )
    from selfplay.train.workers import sft_inputs

    def one(workers, epoch: int, idx: np.ndarray, step: int) -> tuple[SFTStepMetrics, int]:
        t0 = time.perf_counter()
        padded = collate(rows.select(idx), pad_id)
        metrics = workers.update(sft_inputs(padded), mini, cfg.seed + step)
        elapsed = time.perf_counter() - t0
        tokens = int(padded["attention_mask"].sum())
        sm = SFTStepMetrics(
            step=step + len(idx) // mini,
            epoch=epoch,
            rows=len(idx),
            tokens=tokens,
            trained_tokens=int(padded["response_mask"].sum()),
            loss=mean_metric(metrics, "loss") or 0.0,
            grad_norm=mean_metric(metrics, "grad_norm") or 0.0,
            lr=mean_metric(metrics, "lr") or cfg.lr,
            time_s=elapsed,
            tokens_per_s=tokens / max(elapsed, 1e-9),
        )
        return sm, len(idx) // mini

    batches = (
        (e, idx)
        for e in range(cfg.epochs)
        for idx in minibatch_chunks(len(rows), batch, mini, steps_per_epoch, e, cfg.seed)
    )
    result = drive_updates(
        cfg, len(rows), total, batches, one, on_step, prepare=lambda w: w.use_sft_loss()
    )
    export_result(cfg, result, [asdict(s) for s in result.steps], algorithm="sft")
    return result
