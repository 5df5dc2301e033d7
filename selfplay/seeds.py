"""The seed spaces: every scenario and game seed of training and of evaluation comes from here.

- Training scenario ``index`` of (run seed, round) has seed ``scenario_seed(seed, round, index)``:
  a 63-bit SeedSequence hash of (TRAIN_SPACE, seed, round, index) shifted left by one, so it is
  always **even**. Its game ``k`` has seed ``game_seed(seed, round, index, k)``.
- Held-out scenario ``index`` under eval seed ``s`` has seed ``eval_scenario_seed(s, index)``: a
  63-bit SeedSequence hash of (EVAL_SPACE, s, index) shifted left by one with the low bit set, so
  it is always **odd**. Its game ``k`` has seed ``eval_game_seed(s, index, k)``.

- Held-out scenarios come in two splits (``SPLITS``): ``dev``, the seeds above, which per-round
  curves and recipe choices use, and ``test``, played once at the end of a run (``selfplay
  iterate --test-scenarios``, ``selfplay eval --split test``): the same formulas with
  TEST_SPACE as the first word (``heldout_scenario_seed``, ``heldout_game_seed``). Both are odd;
  the two splits are separate hash domains (a shared seed would be a 63-bit hash collision,
  and ``tests/test_game.py`` checks the first thousands of each apart).

Why the spaces are disjoint: the low bit alone separates them, for any seed, round or index, so an
evaluation never replays a training scenario (the distinct first words, TRAIN_SPACE and
EVAL_SPACE, also keep the game seeds apart). Every sampling seed of a game derives from its game
seed (``derive_seed``), which the record stores. Changing a formula here changes every game id
and seed of every existing run folder: don't.
"""

from __future__ import annotations

import hashlib

import numpy as np

TRAIN_SPACE = 0x5E1F_9A3E  # the first word of every training seed sequence
EVAL_SPACE = 0x5E1F_E7A1  # the first word of every evaluation seed sequence (the dev split)
TEST_SPACE = 0x5E1F_7E57  # the first word of every test-split seed sequence
SPLITS = ("dev", "test")
EVAL_SEED = 7  # the eval seed of ``selfplay eval`` and of a run's held-out scenarios unless given
_SPACE = {"dev": EVAL_SPACE, "test": TEST_SPACE}

__all__ = [
    "EVAL_SEED",
    "EVAL_SPACE",
    "SPLITS",
    "TEST_SPACE",
    "TRAIN_SPACE",
    "derive_seed",
    "eval_game_seed",
    "eval_scenario_seed",
    "game_seed",
    "heldout_game_seed",
    "heldout_scenario_seed",
    "scenario_seed",
]


def derive_seed(*words: int) -> int:
    """A 63-bit seed from non-negative integer words (run seed, round, scenario, game, seat, turn).

    A hash (BLAKE2b) rather than a SeedSequence: it is called once per action and must be cheap.
    """
    data = b"".join(int(w).to_bytes(16, "little") for w in words)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _hash63(*words: int) -> int:
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0]) >> 1


def scenario_seed(seed: int, round: int, index: int) -> int:
    """Seed of training scenario ``index``: always even, so never an evaluation seed."""
    return _hash63(TRAIN_SPACE, seed, round, index) << 1


def game_seed(seed: int, round: int, index: int, k: int) -> int:
    """Seed of game ``k`` on training scenario ``index``; the seats' sampling derives from it."""
    return derive_seed(TRAIN_SPACE, seed, round, index, k)


def eval_scenario_seed(seed: int, index: int) -> int:
    """Seed of held-out scenario ``index`` under eval seed ``seed``: always odd (never a training
    seed, which ``scenario_seed`` makes even)."""
    return (_hash63(EVAL_SPACE, seed, index) << 1) | 1


def eval_game_seed(seed: int, index: int, k: int) -> int:
    """Seed of game ``k`` on held-out scenario ``index``; the seats' sampling derives from it."""
    return derive_seed(EVAL_SPACE, seed, index, k)


def _space(split: str) -> int:
    if split not in _SPACE:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return _SPACE[split]


def heldout_scenario_seed(split: str, seed: int, index: int) -> int:
    """Seed of held-out scenario ``index`` of ``split`` (dev: ``eval_scenario_seed``) under eval
    seed ``seed``: always odd."""
    return (_hash63(_space(split), seed, index) << 1) | 1


def heldout_game_seed(split: str, seed: int, index: int, k: int) -> int:
    """Seed of game ``k`` on held-out scenario ``index`` of ``split`` (dev: ``eval_game_seed``)."""
    return derive_seed(_space(split), seed, index, k)
