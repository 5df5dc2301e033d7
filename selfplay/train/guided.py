"""The loss of guided GRPO groups: off-policy rows (a scripted guide's turns, ``off_policy`` in
the training rows) trained with LUFFY's policy shaping, the model's own rows with PPO's clipped
objective, in one GRPO group and one aggregated loss.

LUFFY (Yan et al., "Learning to Reason under Off-Policy Guidance", arXiv 2504.14945) adds guide
trajectories to a GRPO group and replaces their importance ratio pi_theta / pi_guide by the shaped
f(pi_theta) = pi_theta / (pi_theta + gamma), unclipped. Its gradient, gamma / (pi + gamma)^2 times
grad pi, is largest on the guide's tokens the model finds unlikely, where the clipped ratio would
stop learning (a ratio far above 1 + eps is clipped: no gradient) or, taken as is, would be
dominated by a few tokens. The guide is a deterministic scripted player (pi_guide = 1), so the
shaped term needs only the current policy's probability of each guide token: the trainer's
no-grad pass computes it (``old_log_probs`` of those rows, under the weights the step starts
from), and the loss uses the probability under the weights being updated.

verl computes the policy loss through its registry (``config.policy_loss.loss_mode``), called
inside verl's ``ppo_loss`` with the padded ``old_log_prob``/``log_prob``/``advantages`` only; the
off-policy mask reaches it through a context variable that ``guided_ppo_loss`` sets around that
call. Entropy bonus and KL to the reference stay verl's.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

LOSS_MODE = "selfplay_guided"

# (off-policy mask [B, R] as float, gamma) for the policy loss verl calls inside ppo_loss
_GUIDE: contextvars.ContextVar[tuple[torch.Tensor, float] | None] = contextvars.ContextVar(
    "selfplay_guide", default=None
)


def shaped_token_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    off_policy: torch.Tensor,
    *,
    gamma: float,
    clip_low: float,
    clip_high: float,
    clip_c: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses [B, R]: on-policy tokens PPO's clipped (and dual-clipped) -A * ratio, as
    verl's vanilla loss computes them; off-policy tokens -A * p / (p + gamma), p = exp(log_prob).
    Returns the losses and the on-policy tokens where clipping was active."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-advantages * clip_c, clipped)
    on_policy = torch.where(advantages < 0, dual, clipped)
    p = torch.exp(log_prob)
    shaped = -advantages * p / (p + gamma)
    off = off_policy.bool()
    return torch.where(off, shaped, on_policy), torch.gt(loss2, loss1) & ~off


def guided_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's policy-loss signature; registered as ``LOSS_MODE``."""
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo.core_algos import agg_loss

    guide = _GUIDE.get()
    if guide is None:
        raise RuntimeError(f"loss_mode {LOSS_MODE} runs only inside guided_ppo_loss")
    off, gamma = guide
    off = off.to(log_prob.device)
    clip = config.clip_ratio
    losses, clipped = shaped_token_losses(
        old_log_prob,
        log_prob,
        advantages,
        off,
        gamma=gamma,
        clip_low=config.clip_ratio_low if config.clip_ratio_low is not None else clip,
        clip_high=config.clip_ratio_high if config.clip_ratio_high is not None else clip,
        clip_c=config.get("clip_ratio_c", 3.0),
    )
    if rollout_is_weights is not None:  # only the model's own tokens have a rollout policy
        losses = losses * torch.where(off.bool(), torch.ones_like(losses), rollout_is_weights)
    mask = response_mask.bool()
    on, offm = mask & ~off.bool(), mask & off.bool()
    pg_loss = agg_loss(
        loss_mat=losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
        **config.global_batch_info,
    )  # fmt: skip
    metrics = {
        "actor/pg_clipfrac": verl_F.masked_mean(clipped.float(), on).detach().item()
        if on.any()
        else 0.0,
        "actor/ppo_kl": verl_F.masked_mean(old_log_prob - log_prob, on).detach().item()
        if on.any()
        else 0.0,
        "actor/guide_token_prob": verl_F.masked_mean(torch.exp(log_prob), offm).detach().item()
        if offm.any()
        else 0.0,
    }
    return pg_loss, metrics


def guided_ppo_loss(config, model_output, data, dp_group=None, *, gamma: float):
    """verl's ``ppo_loss`` with the batch's off-policy mask handed to ``guided_policy_loss``."""
    from verl.workers.utils.losses import ppo_loss

    off = data.select("off_policy").to_padded_tensor()["off_policy"]
    token = _GUIDE.set((off, gamma))
    try:
        return ppo_loss(config, model_output, data, dp_group)
    finally:
        _GUIDE.reset(token)


def register() -> None:
    """Register ``guided_policy_loss`` in verl's policy-loss registry (idempotent)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    POLICY_LOSS_REGISTRY.setdefault(LOSS_MODE, guided_policy_loss)
