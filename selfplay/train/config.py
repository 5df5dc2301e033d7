"""The training stage's configuration: one validated pydantic model, ``TrainConfig``.

Batch sizes count training rows (one row = one seat of one game):
``batch_size`` rows per step (their old log-probs are computed together), split into
``mini_batch_size`` rows per optimizer update, each processed ``micro_batch_size`` rows at a time
per device (gradient accumulation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossAgg = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
KlType = Literal["k1", "abs", "k2", "k3", "low_var_kl", "mse"]
RolloutIS = Literal["none", "tis"]


class TrainConfig(BaseModel):
    """Everything ``selfplay.train.train`` needs; nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: Path = Field(description="train.parquet written by `selfplay convert`")
    model: str = Field(description="HF model directory or id the rows' tokens were made with")
    out: Path = Field(description="output directory: the new HF model, verl checkpoint, metrics")

    epochs: int = Field(1, ge=1)
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    clip_grad: float = Field(1.0, gt=0.0)
    batch_size: int | None = Field(None, ge=1, description="rows per step; None = all rows")
    mini_batch_size: int | None = Field(
        None, ge=1, description="rows per optimizer update; None = batch_size"
    )
    micro_batch_size: int = Field(4, ge=1, description="rows per forward/backward per device")
    loss_agg: LossAgg = "token-mean"
    std_norm: bool = Field(True, description="divide GRPO advantages by the group std")
    clip_ratio: float = Field(0.2, gt=0.0, lt=1.0)
    clip_ratio_high: float | None = Field(None, gt=0.0, description="None = clip_ratio")
    kl_coef: float = Field(0.0, ge=0.0, description="KL loss weight vs the starting model")
    kl_type: KlType = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0.0)
    rollout_is: RolloutIS = "none"
    tis_cap: float = Field(2.0, gt=1.0, description="truncation of the rollout IS weight")

    gpus: int = Field(0, ge=0, description="0 = CPU; >= 1 = that many GPUs")
    ray_address: str | None = Field(None, description="attach to this Ray cluster")
    launcher: Literal["auto", "local", "ray"] = Field(
        "auto", description="auto: in-process for CPU or 1 GPU, Ray otherwise"
    )
    nodes: int = Field(1, ge=1, description="nodes of the Ray cluster to use (gpus per node)")
    dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="None: fp32 on CPU, bf16 on GPU"
    )
    attn_implementation: str = "sdpa"
    remove_padding: bool = Field(
        True, description="pack rows without padding (verl's rmpad path); False: padded batches"
    )
    gradient_checkpointing: bool = False
    seed: int = Field(0, ge=0)
    max_length: int | None = Field(
        None, ge=2, description="refuse rows whose prompt+response is longer"
    )
    save_verl_checkpoint: bool = Field(True, description="also write verl's resumable checkpoint")
    resume_from: Path | None = Field(None, description="a verl checkpoint dir (global_step_N)")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if (
            self.batch_size is not None
            and self.mini_batch_size is not None
            and self.batch_size % self.mini_batch_size
        ):
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of mini_batch_size "
                f"({self.mini_batch_size})"
            )
        if self.ray_address and self.gpus == 0:
            raise ValueError("ray_address needs gpus >= 1 (GPUs per node to use)")
        if self.launcher == "ray" and self.gpus == 0 and self.ray_address:
            raise ValueError("ray_address needs gpus >= 1")
        if self.nodes > 1 and not self.ray_address:
            raise ValueError("nodes > 1 needs ray_address (an existing Ray cluster)")
        return self

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"

    @property
    def world_size(self) -> int:
        return max(1, self.gpus) * self.nodes

    @property
    def use_ray(self) -> bool:
        if self.launcher == "ray":
            return True
        if self.launcher == "local":
            return False
        return self.ray_address is not None or self.world_size > 1

    @property
    def param_dtype(self) -> str:
        return self.dtype or ("bf16" if self.gpus > 0 else "fp32")
