"""GRPO groups: which rows share a group (key and id), which scenarios are validation, and which
groups are written (two rows or more, rewards that differ unless degenerate groups are kept).

Why groups span games: the matching game is cooperative, so both seats of one game get the same
reward, and GRPO's advantage (r - group mean) / group std is 0 for a group of equal rewards. A
group is therefore every trained row of one scenario in one round (``GroupBy.SCENARIO``) or of
one scenario, round and seat (``GroupBy.SCENARIO_SEAT``)."""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from enum import StrEnum


class GroupBy(StrEnum):
    SCENARIO = "scenario"  # every trained row of a scenario (both seats) in one round
    SCENARIO_SEAT = "scenario-seat"  # as above, but each seat is its own group


def is_val_scenario(scenario_id: str, val_fraction: float) -> bool:
    """Whether a scenario is in the validation split: a stable hash of its id, not file order."""
    if val_fraction <= 0.0:
        return False
    h = hashlib.blake2b(scenario_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < val_fraction


def group_id(key: str) -> int:
    """A non-negative int64 from the group key (blake2b), the same in every file order."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def group_key(group_by: GroupBy, scenario_id: str, round: int, seat: int, kind: str = "") -> str:
    """The readable group key. The round is part of it: one group = one policy on one scenario.
    ``kind`` (``game_kind``: the game and its table size) leads it, so games of two games or
    sizes drawn with one seed (the same scenario id) never share a group."""
    key = f"{kind}/{scenario_id}/r{round}" if kind else f"{scenario_id}/r{round}"
    return key + f"/seat{seat}" if group_by is GroupBy.SCENARIO_SEAT else key


def game_kind(game: str, scenario: object) -> str:
    """``matching-3x3``: a record's game and, where its scenario has one (``n``), table size."""
    n = scenario.get("n") if isinstance(scenario, dict) else getattr(scenario, "n", None)
    return f"{game}-{n}x{n}" if isinstance(n, int) else game


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(slots=True)
class Group:
    gid: int  # group_id(key): independent of file order
    split: str  # "train" | "val"
    scenario_id: str
    rows: int = 0
    lo: float = math.inf  # reward range as float32, the precision the file stores
    hi: float = -math.inf
    kept: bool = False  # known to be written: never changes back once True


@dataclass
class GroupCounts:
    """The fate of every group once all rows are seen; the names are ConvertSummary's fields."""

    groups_seen: int = 0
    groups_degenerate_dropped: int = 0
    rows_in_degenerate_groups_dropped: int = 0
    groups_degenerate_kept: int = 0
    groups_singleton_dropped: int = 0
    groups_train: int = 0
    groups_train_with_signal: int = 0
    groups_val: int = 0
    scenarios_train: int = 0
    scenarios_val: int = 0


@dataclass
class Groups:
    """Every group seen so far: its split, row count and reward range (constant memory per group,
    nothing per row)."""

    val_fraction: float
    keep_degenerate: bool
    by_key: dict[str, Group] = field(default_factory=dict)

    def add(self, key: str, scenario_id: str, reward: float) -> Group:
        """Count one row of group ``key``; the group's ``kept`` then says whether the row can be
        written at once. A group is known to be written when it has two rows and two different
        rewards (or two rows, with keep_degenerate); earlier rows of a group wait in the spool,
        in a normal run a small fraction of all rows."""
        g = self.by_key.get(key)
        if g is None:
            val = is_val_scenario(scenario_id, self.val_fraction)
            g = self.by_key[key] = Group(group_id(key), "val" if val else "train", scenario_id)
        r = _f32(reward)
        g.rows += 1
        g.lo = min(g.lo, r)
        g.hi = max(g.hi, r)
        if not g.kept and g.rows >= 2 and (g.lo != g.hi or self.keep_degenerate):
            g.kept = True
        return g

    def decide(self) -> tuple[list[int], GroupCounts]:
        """The ids of the kept groups and the count of every group's fate."""
        kept: list[int] = []
        c = GroupCounts(groups_seen=len(self.by_key))
        scenarios: dict[str, set[str]] = {"train": set(), "val": set()}
        for g in self.by_key.values():
            if g.kept:
                kept.append(g.gid)
                scenarios[g.split].add(g.scenario_id)
                c.groups_degenerate_kept += g.lo == g.hi
                if g.split == "train":
                    c.groups_train += 1
                    c.groups_train_with_signal += g.lo != g.hi
                else:
                    c.groups_val += 1
            elif g.rows < 2:
                c.groups_singleton_dropped += 1
            else:
                c.groups_degenerate_dropped += 1
                c.rows_in_degenerate_groups_dropped += g.rows
        c.scenarios_train, c.scenarios_val = len(scenarios["train"]), len(scenarios["val"])
        return kept, c
