"""The training stage's configuration: one validated pydantic model, ``TrainConfig``.

Batch sizes count training rows (one row = one seat of one game):
``batch_size`` rows per step (their old log-probs are computed together), split into
``mini_batch_size`` rows per optimizer update, each processed ``micro_batch_size`` rows at a time
per device (gradient accumulation).

``TrainerOptions`` are the options ``selfplay train`` shares with every round of ``selfplay
iterate``; the ``Annotated`` field types below it are shared with ``selfplay sft`` (its defaults
are its own). Each field's ``description`` is its command-line help.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from selfplay.hardware import ComputeDtype, resolve_dtype

# one causal SDPA call per packed row (selfplay/train/attention.py registers it with transformers)
PACKED_SDPA = "sdpa_packed"
LossAgg = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
KlType = Literal["k1", "abs", "k2", "k3", "low_var_kl", "mse"]
RolloutIS = Literal["none", "tis"]


# Fields that ``selfplay sft`` shares too, with its own defaults.
LearningRate = Annotated[float, Field(gt=0.0, description="Learning rate (AdamW).")]
Epochs = Annotated[int, Field(ge=1, description="Passes over the rows.")]
MicroBatchSize = Annotated[
    int,
    Field(
        ge=1,
        description="Rows per forward/backward per device.",
        json_schema_extra={"envvar": "MICRO_BATCH_SIZE"},
    ),
]
Gpus = Annotated[int, Field(ge=0, description="GPUs per node (0: CPU, in-process).")]
MaxLength = Annotated[
    int, Field(ge=2, description="Rows with more prompt + response tokens are left out.")
]
LoraRank = Annotated[
    int,
    Field(
        ge=0,
        description="LoRA rank (0: full fine-tuning): train low-rank adapters on every linear "
        "layer (verl's peft path); the exported model has them merged in.",
    ),
]
LoraAlpha = Annotated[
    int, Field(ge=1, description="LoRA scale: the adapters add alpha / rank * B A.")
]


class TrainerOptions(BaseModel):
    """The GRPO update and where it runs: the options ``selfplay train`` and every round of
    ``selfplay iterate`` share."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: LearningRate = 1e-6
    batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per step (default: all rows).",
        json_schema_extra={"envvar": "TRAIN_BATCH_SIZE"},
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per optimizer update (default: the batch size; in iterate, a round's "
        "rows / --updates-per-round).",
    )
    micro_batch_size: MicroBatchSize = 4
    loss_agg: LossAgg = Field(
        "token-mean",
        description="How the GRPO loss averages tokens (verl's loss_agg_mode): token-mean (long "
        "rows weigh more), seq-mean-token-mean (every row weighs the same), token-sum, "
        "seq-mean-token-sum, seq-mean-token-sum-norm.",
    )
    std_norm: bool = Field(True, description="Divide GRPO advantages by the group's std.")
    kl_coef: float = Field(
        0.0, ge=0.0, description="KL loss weight against the starting model (0: none)."
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus in the GRPO loss.")
    guide_gamma: float = Field(
        0.1,
        gt=0.0,
        description="Guide rows (iterate --guide): LUFFY's policy shaping p / (p + gamma) of "
        "each guide token's probability p replaces the clipped ratio; smaller gamma pushes "
        "harder on the guide tokens the model finds unlikely.",
    )
    rollout_is: RolloutIS = Field(
        "none",
        description="none: actor log-probs only; tis: truncated importance sampling against the "
        "rollout log-probs.",
    )
    policy_temperature: float = Field(
        1.0,
        gt=0.0,
        description="The temperature the trainer scores its policy at, log-softmax(logits / T): "
        "the generation temperature trains the policy that sampled the rows (verl's convention) "
        "and makes the generator's log-probs usable (--rollout-is tis, --old-log-probs rollout).",
    )
    old_log_probs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description="recompute: the actor scores the rows before each step (one more forward "
        "pass); rollout: the generator's own log-probs stand in for them (no pass), for rows the "
        "model sampled itself at --policy-temperature from the weights being trained.",
    )
    lora_rank: LoraRank = 0
    lora_alpha: LoraAlpha = 16
    dtype: ComputeDtype = "auto"
    gpus: Gpus = 0
    ray_address: str | None = Field(
        None,
        description="Train on this Ray cluster (auto: the one this node joined); needs --gpus.",
    )
    nodes: int = Field(1, ge=1, description="Nodes of that Ray cluster (--gpus per node).")

    @property
    def rollout_log_prob_uses(self) -> list[str]:
        """The options that read the generator's log-probs as the trainer's own (their flags)."""
        return [
            flag
            for flag, on in (
                ("--rollout-is tis", self.rollout_is == "tis"),
                ("--old-log-probs rollout", self.old_log_probs == "rollout"),
            )
            if on
        ]

    def scores_like(self, sampled: float) -> bool:
        """Whether tokens sampled at temperature ``sampled`` carry the log-probs this trainer
        scores (log-softmax(logits / policy_temperature)); greedy (0) carries the plain ones."""
        return abs((sampled or 1.0) - self.policy_temperature) <= 1e-6  # float32 columns


class TrainConfig(TrainerOptions):
    """Everything ``selfplay.train.train`` needs; nothing else."""

    data: Path = Field(description="train.parquet written by `selfplay convert`")
    model: str = Field(description="HF model directory or id the rows' tokens were made with")
    out: Path = Field(description="output directory: the new HF model, verl checkpoint, metrics")

    epochs: Epochs = 1
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    clip_grad: float = Field(1.0, gt=0.0, description="Gradient norm clipping.")
    clip_ratio: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip ratio.")
    clip_ratio_high: float | None = Field(None, gt=0.0, description="None = clip_ratio")
    kl_type: KlType = Field("low_var_kl", description="verl's KL estimator.")
    tis_cap: float = Field(2.0, gt=1.0, description="truncation of the rollout IS weight")

    launcher: Literal["auto", "local", "ray"] = Field(
        "auto", description="auto: in-process for CPU or 1 GPU, Ray otherwise"
    )
    attn_implementation: str = Field(
        "auto",
        description="the model's attention in training: auto = sdpa_packed (one causal SDPA call "
        "per packed row, selfplay/train/attention.py) when remove_padding, else sdpa; or a "
        "transformers name (sdpa, eager, flash_attention_2)",
    )
    remove_padding: bool = Field(
        True, description="pack rows without padding (verl's rmpad path); False: padded batches"
    )
    lm_head_positions: Literal["trained", "all"] = Field(
        "trained",
        description="where a training forward runs the LM head: trained = only at the positions "
        "whose next token the loss trains on (the same loss, fewer FLOPs; in-process launcher), "
        "with every forward's log-probs taken over blocks of positions instead of verl's loop "
        "over single tokens; all = every position, verl's own path (selfplay/train/lm_head.py)",
    )
    gradient_checkpointing: bool = False
    seed: int = Field(0, ge=0, description="Seed of the update (row order, initialisation).")
    max_length: int | None = Field(
        None, ge=2, description="refuse rows whose prompt+response is longer"
    )
    save_verl_checkpoint: bool = Field(True, description="also write verl's resumable checkpoint")
    resume_from: Path | None = Field(None, description="verl checkpoint dir to resume from.")

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
        if self.attn_implementation == PACKED_SDPA and not self.remove_padding:
            raise ValueError(
                f"attn_implementation {PACKED_SDPA} needs packed rows: remove_padding true, or "
                "attn_implementation sdpa"
            )
        return self

    @property
    def attention(self) -> str:
        """The transformers attention implementation the workers load the model with."""
        if self.attn_implementation != "auto":
            return self.attn_implementation
        return PACKED_SDPA if self.remove_padding else "sdpa"

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
        return resolve_dtype(self.dtype, self.device)
