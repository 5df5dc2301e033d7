"""Rows' rewards to advantages: GRPO's group-normalised advantage per row and, for rows written
with turn credit, a per-token advantage (see ``credit``).

Groups are dataset-wide: every row of a group is in the training file, so the advantage of a row
is computed once, over the whole file, before any batch is cut. Normalisation is verl's GRPO
outcome advantage, (r - group mean) / (group std + 1e-6), without the std with ``std_norm``
False (Dr. GRPO); the state groups of turn credit are normalised the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from selfplay.reward.credit import TURN_WEIGHT, turn_spans

__all__ = ["grpo_advantages", "row_advantages", "state_advantages", "token_advantages"]

EPS = 1e-6  # verl's epsilon in compute_grpo_outcome_advantage


class Graded(Protocol):
    """Rows as the trainer holds them (``train.batch.Rows``): what an advantage reads."""

    group_ids: np.ndarray  # [N] int64
    rewards: np.ndarray  # [N] float32


def grpo_advantages(token_level_rewards, response_mask, group_ids: np.ndarray, std_norm=True):
    """verl's GRPO outcome advantage with our group ids (0 on every mask-0 position); tensors
    [B, R] in and out."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    index = np.asarray([str(g) for g in group_ids], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask.float(),
        index=index,
        norm_adv_by_std_in_grpo=std_norm,
    )
    return advantages


def row_advantages(rows: Graded, std_norm: bool = True) -> np.ndarray:
    """One GRPO advantage per row over the whole dataset (groups are dataset-wide)."""
    import torch

    n = len(rows.rewards)
    rewards = torch.zeros((n, 1))
    rewards[:, 0] = torch.from_numpy(np.asarray(rows.rewards, dtype=np.float32))
    adv = grpo_advantages(rewards, torch.ones((n, 1)), rows.group_ids, std_norm=std_norm)
    return adv[:, 0].numpy()


def state_advantages(
    rows: Graded, states: Sequence[np.ndarray | None], std_norm: bool = True
) -> list[np.ndarray]:
    """Per row, one advantage per turn: the row's reward normalised over the turns of its group
    with the same state id (0 for a state no other turn of the group has; rows without states,
    None, get an empty array)."""
    members: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    out = []
    for i, row_states in enumerate(states):
        n = 0 if row_states is None else len(row_states)
        out.append(np.zeros(n, dtype=np.float32))
        for t in range(n):
            members[(int(rows.group_ids[i]), int(row_states[t]))].append((i, t))
    rewards = np.asarray(rows.rewards, dtype=np.float64)
    for turns in members.values():
        if len(turns) < 2:
            continue
        r = rewards[[i for i, _ in turns]]
        a = r - r.mean()
        if std_norm:
            a = a / (r.std(ddof=1) + EPS)
        for (i, t), value in zip(turns, a):
            out[i][t] = value
    return out


def token_advantages(
    rows: Graded,
    masks: Sequence[Sequence[int]],
    states: Sequence[np.ndarray | None],
    episode: np.ndarray,
    std_norm: bool = True,
    weight: float = TURN_WEIGHT,
) -> list[np.ndarray]:
    """Per row, one advantage per response token: the episode advantage ``episode[i]`` on every
    own token plus ``weight`` times its turn's state advantage (0 on mask-0 tokens). A row's
    states must count its mask's runs (ValueError naming the row otherwise)."""
    by_state = state_advantages(rows, states, std_norm)
    out = []
    for i, mask in enumerate(masks):
        m = np.asarray(mask, dtype=np.float32)
        adv = m * np.float32(episode[i])
        spans = turn_spans(m)
        if states[i] is not None:
            if len(spans) != len(states[i]):
                raise ValueError(
                    f"row {i} has {len(spans)} own turns in its response mask but "
                    f"{len(states[i])} turn states"
                )
            for (start, end), value in zip(spans, by_state[i]):
                adv[start:end] += np.float32(weight * value)
        out.append(adv)
    return out
