"""Where a row's advantage lands: the credit options (``--credit``) and the turn states they need.

- ``episode`` (the default): one advantage per row, its group's GRPO advantage, on every own
  token of the row.
- ``turn``: GiGPO's two levels (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
  Agent Training"): each own turn of a row gets the row's episode advantage plus ``TURN_WEIGHT``
  times a state advantage, the row's reward normalised over the turns, across the group's rows,
  that start from the same state. A state is the exact token ids the seat had seen before the
  turn (its prompt and the response up to the turn) and the seat: the K games of a scenario share
  their opening, so every game's first turn is in one state group, and a later turn shares one
  only with games that went the same way so far. A state no other row reaches has state
  advantage 0 (its turn keeps the episode advantage alone).

A turn is a run of own (mask-1) tokens in the response: one run per action of the seat. Convert
writes the state id of each turn of a row (``turn_states``, one int64 per run, in order); the
trainer puts the two-level advantage on each run (``advantage.token_advantages``). A credit is one
entry of ``CREDITS``: its name, and the per-turn state ids a row carries (None: none).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["CREDITS", "TURN_WEIGHT", "Credit", "check_credit", "turn_spans", "turn_states"]

# GiGPO's omega, the weight of the state-level advantage (1 in all of the paper's runs)
TURN_WEIGHT = 1.0


def turn_spans(mask: np.ndarray | list[int]) -> list[tuple[int, int]]:
    """The (start, end) of each run of 1s in a response mask, in order: one per own turn."""
    m = np.asarray(mask, dtype=np.int8)
    edges = np.diff(np.concatenate(([0], m, [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def turn_states(
    prompt_ids: np.ndarray, response_ids: np.ndarray, mask: np.ndarray, seat: int
) -> np.ndarray:
    """One state id per own turn: a stable hash (blake2b, non-negative int64) of the seat and
    the exact int32 token ids before the turn's first token."""
    h = hashlib.blake2b(digest_size=8)
    h.update(bytes([seat]))
    h.update(np.ascontiguousarray(prompt_ids, dtype=np.int32).tobytes())
    response = np.ascontiguousarray(response_ids, dtype=np.int32)
    out, done = [], 0
    for start, _ in turn_spans(mask):
        h.update(response[done:start].tobytes())
        done = start
        out.append(int.from_bytes(h.copy().digest(), "big") >> 1)
    return np.asarray(out, dtype=np.int64)


States = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class Credit:
    """A credit option: its name, what it does, and the turn states its rows carry."""

    name: str
    help: str
    states: States | None = None  # (prompt, response, mask, seat) -> one state id per turn


CREDITS: dict[str, Credit] = {
    c.name: c
    for c in (
        Credit("episode", "one advantage per row, its group's, on every own token"),
        Credit(
            "turn",
            "the episode advantage plus, on each turn, the advantage among the group's turns "
            "that start from the same tokens (GiGPO)",
            turn_states,
        ),
    )
}


def check_credit(name: str) -> str:
    """``name`` if it is a credit option, else a ValueError that lists the known ones."""
    if name not in CREDITS:
        raise ValueError(f"unknown credit {name!r}; known: {', '.join(CREDITS)}")
    return name
