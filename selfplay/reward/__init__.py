"""The reward seam: from a finished game to a row's reward, its group and its advantage.

The map, every stop of the learning signal and where it lives::

    game rules ──► GameRecord ──► row reward ──► group ──► advantage ──► loss
    (the game)     (records)      shaping.py     groups.py  advantage.py  (train: verl / guided)
                                  credit.py: which turns share a state (--credit turn)

1. **Task reward** (the game's rules): an accepted proposal scores, shared by both seats; the
   game writes it into ``GameRecord.reward`` with the ``outcome``. Nothing here changes it.
2. **Row reward** (``shaping.row_reward``, called by both readers of ``selfplay.convert.rows``
   from a ``shaping.GameResult``): the task reward, ``-invalid_penalty`` for the seat whose
   invalid actions ended the game, then the shaping named by ``reward_shaping`` (a function
   registered with ``@shaping("name")``; ``none`` by default).
3. **Group** (``groups``): which rows compete (``group_by``: a scenario's rows in one round, or
   per seat), their stable ids, the validation split, and which groups are written (two rows or
   more, rewards that differ unless ``keep_degenerate``).
4. **Credit** (``credit``): ``episode`` puts one advantage on a row; ``turn`` also writes each
   own turn's state id (``turn_states``), so turns that start from the same tokens form a group
   of their own (GiGPO).
5. **Advantage** (``advantage``, run by the trainer over the whole file): verl's GRPO
   advantage per row (``std_norm``), plus with turn states the per-turn state advantage, per
   token (``token_advantages``).
6. **Loss** (not here: ``selfplay.train``): verl's PPO-clip policy loss takes the per-token
   advantages; guide rows take LUFFY's shaped loss (``selfplay.train.guided``).

The options: ``invalid_penalty``, ``reward_shaping``, ``group_by``, ``keep_degenerate``,
``credit`` (convert and iterate, ``selfplay.convert.config``); ``std_norm`` (train and iterate).

This package imports only the shared vocabulary (and numpy, torch and verl inside functions), so
both convert and the self-contained train package can use it.
"""

from __future__ import annotations

from selfplay.reward.advantage import (
    grpo_advantages,
    row_advantages,
    state_advantages,
    token_advantages,
)
from selfplay.reward.credit import CREDITS, TURN_WEIGHT, Credit, check_credit, turn_spans
from selfplay.reward.groups import GroupBy, Groups, game_kind, group_id, group_key, is_val_scenario
from selfplay.reward.shaping import SHAPINGS, GameResult, check_shaping, row_reward, shaping

__all__ = [
    "CREDITS",
    "SHAPINGS",
    "TURN_WEIGHT",
    "Credit",
    "GameResult",
    "GroupBy",
    "Groups",
    "check_credit",
    "check_shaping",
    "game_kind",
    "group_id",
    "group_key",
    "grpo_advantages",
    "is_val_scenario",
    "row_advantages",
    "row_reward",
    "shaping",
    "state_advantages",
    "token_advantages",
    "turn_spans",
]
