"""Teacher games: scripted teachers' and the human games' moves played through our rules and
recorded as the model's own turns (the warm start's rows).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from selfplay.game.matching.human import HumanReplay, human_turns, load_human_games
from selfplay.records import GameRecord, SeatConfig, iter_game_records

SFT_SPACE = 0x5E1F_5F7A  # first word of the teacher games' scenario seeds (even, like training)


def scripted_name(spec: str) -> str:
    """``scripted:NAME`` (or a bare NAME) -> NAME; ValueError naming the accepted forms."""
    from selfplay.game.matching.scripted import SCRIPTED_NAMES

    kind, sep, name = spec.partition(":")
    if not sep:
        kind, name = "scripted", spec
    if kind != "scripted" or name not in SCRIPTED_NAMES:
        raise ValueError(
            f"teacher {spec!r} must be scripted:NAME with NAME one of {', '.join(SCRIPTED_NAMES)}"
        )
    return name


def teacher_sources(spec: str, num_games: int | None) -> tuple[tuple[str, int], ...]:
    """The teacher sources of ``spec`` as (NAME, GAMES) pairs: ``scripted:NAME`` plays
    ``num_games`` games; ``scripted:NAME:GAMES[,scripted:NAME:GAMES...]`` mixes several scripted
    teachers, each with its own count (e.g. ``scripted:cooperative:24,scripted:inquisitive:4``
    puts asking in the cloned model's support at a low rate). ``num_games`` None: every source
    must give its count (iterate's ``--warm-start``). ValueError naming the forms."""
    sources = []
    for part in spec.split(","):
        head, sep, count = part.strip().rpartition(":")
        if sep and head.startswith("scripted:") and count.isdigit():
            games = int(count)
            if games < 1:
                raise ValueError(f"teacher {part!r}: GAMES must be at least 1")
        elif "," in spec or num_games is None:
            raise ValueError(
                f"teacher {part!r}: each source is scripted:NAME:GAMES, e.g. "
                "scripted:cooperative:1000, or scripted:cooperative:24,scripted:inquisitive:4"
            )
        else:
            head, games = part.strip(), num_games
        sources.append((scripted_name(head), games))
    names = [n for n, _ in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"teacher {spec!r} names a scripted policy twice")
    return tuple(sources)


def teacher_seed(seed: int, index: int) -> int:
    """Scenario seed of teacher game ``index``: even, like training seeds, so never a held-out
    evaluation scenario (those are odd), and in its own space apart from generate's."""
    from selfplay.seeds import scenario_seed

    return scenario_seed(seed ^ SFT_SPACE, 0, index)


def play_teacher_games(
    chat,
    *,
    teacher: str,
    partner: str | None,
    clone: Literal["both", "1", "2"],
    num_games: int,
    seed: int,
    table_size: int,
    max_actions: int,
    first: int = 0,
) -> list[GameRecord]:
    """``num_games`` games of scripted ``teacher`` (against ``partner``, else itself) on fresh
    training scenarios (teacher game indices ``first``, ``first + 1``, ...: a second source of a
    mixed warm start starts where the first ended, so no two games share a scenario), its cloned
    seats recorded token-exactly under ``chat``."""
    from selfplay.game.matching.rules import generate_scenario
    from selfplay.game.matching.scripted import make_scripted
    from selfplay.generate.play import play_game
    from selfplay.players.teacher import TeacherPlayer
    from selfplay.seeds import derive_seed

    name = scripted_name(teacher)
    names = (name, scripted_name(partner) if partner else name)
    cloned = {"both": (0, 1), "1": (0,), "2": (1,)}[clone]

    async def run() -> list[GameRecord]:
        records = []
        for i in range(first, first + num_games):
            sseed = teacher_seed(seed, i)
            scenario = generate_scenario(sseed, table_size)
            gseed = derive_seed(SFT_SPACE, seed, i)
            seats = []
            for seat in (0, 1):
                policy = names[0] if seat in cloned else names[1]
                player = make_scripted(policy, scenario, seat, seed=derive_seed(gseed, seat))
                seats.append(TeacherPlayer(player, chat) if seat in cloned else player)
            records.append(
                await play_game(
                    scenario,
                    (seats[0], seats[1]),
                    game_id=f"sft-s{sseed}-g0",
                    seed=gseed,
                    max_actions=max_actions,
                )
            )
        return records

    return asyncio.run(run())


def filtered_games(path: Path, min_reward: float) -> Iterator[GameRecord]:
    """The games of ``path`` whose reward is at least ``min_reward``."""
    for record in iter_game_records(path):
        if record.reward >= min_reward:
            yield record


class _Replay:
    """A seat that plays back its logged turns; raises when the log has no more for it."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.config = SeatConfig(kind="scripted", name="human")

    async def act(self, observation: str) -> str:
        if not self.texts:
            raise LookupError("the human log has no further turn for this seat")
        return self.texts.pop(0)

    def tokens(self) -> None:
        return None


def human_records(path: Path, chat, stats: HumanReplay | None = None) -> Iterator[GameRecord]:
    """Every human game of ``path`` replayed with both seats recorded under ``chat``."""
    from selfplay.game.matching.rules import scenario_from_arrays
    from selfplay.generate.play import play_game
    from selfplay.players.teacher import TeacherPlayer

    stats = stats if stats is not None else HumanReplay()
    for i, game in enumerate(load_human_games(path)):
        first = game["action_log"][0]["player"]
        order = (first, 1 - first)
        scenario = scenario_from_arrays(
            game["table"],
            tuple(game[f"mask{p + 1}"] for p in order),
            tuple(game[f"scale{p + 1}"] for p in order),
            scenario_id=f"human-{i}",
        )
        turns, stopped, dropped = human_turns(game, scenario.n)
        seats = tuple(
            TeacherPlayer(_Replay([t for s, t in turns if s == seat]), chat) for seat in (0, 1)
        )
        record = asyncio.run(
            # a replay that stops early ends as out of actions, its turns all played
            play_game(scenario, seats, game_id=f"human-{i}", seed=i, max_actions=max(len(turns), 1))
        )
        stats.games += 1
        stats.turns += len(turns)
        stats.dropped_messages += dropped
        if stopped is None:
            stats.complete += 1
        else:
            stats.stopped[stopped] = stats.stopped.get(stopped, 0) + 1
        yield record
