"""Teacher games: a game's scripted teachers and its recorded human games played through its rules
and recorded as the model's own turns (the warm start's rows).

Teacher games are played like every other game, through ``rollout.play_plan``: one fresh training
scenario each (``teacher_seed``), the game seed ``derive_seed(SFT_SPACE, seed, index)``, the cloned
seats wrapped in ``TeacherPlayer``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from selfplay.game.api import MAX_INVALID, DialogueGame
from selfplay.records import GameRecord, SeatConfig, iter_game_records

SFT_SPACE = 0x5E1F_5F7A  # first word of the teacher games' scenario seeds (even, like training)


def scripted_name(spec: str, names: tuple[str, ...]) -> str:
    """``scripted:NAME`` (or a bare NAME) -> NAME, one of the game's scripted ``names``;
    ValueError naming the accepted forms."""
    kind, sep, name = spec.partition(":")
    if not sep:
        kind, name = "scripted", spec
    if kind != "scripted" or name not in names:
        raise ValueError(
            f"teacher {spec!r} must be scripted:NAME with NAME one of {', '.join(names)}"
        )
    return name


def teacher_sources(
    spec: str, num_games: int | None, names: tuple[str, ...]
) -> tuple[tuple[str, int], ...]:
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
        sources.append((scripted_name(head, names), games))
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
    game: DialogueGame,
    teacher: str,
    partner: str | None,
    clone: Literal["both", "1", "2"],
    num_games: int,
    seed: int,
    table_size: int,
    max_actions: int,
    first: int = 0,
) -> list[GameRecord]:
    """``num_games`` games of ``game``'s scripted ``teacher`` (against ``partner``, else itself)
    on fresh training scenarios (teacher game indices ``first``, ``first + 1``, ...: a second
    source of a mixed warm start starts where the first ended, so no two games share a scenario),
    its cloned seats recorded token-exactly under ``chat``; in plan order."""
    from selfplay.generate.rollout import GameSpec, Scenarios, Seating, play_plan, scripted_seat
    from selfplay.players.teacher import TeacherPlayer
    from selfplay.seeds import derive_seed

    name = scripted_name(teacher, game.scripted_names)
    other = scripted_name(partner, game.scripted_names) if partner else name

    def cloned(policy: str):
        seat = scripted_seat(policy, game)
        return lambda scenario, s, gseed: TeacherPlayer(seat(scenario, s, gseed), chat)

    if clone == "both":
        seating = Seating(cloned(name))
    else:  # the cloned seat is the policy's, the partner plays uncloned
        seating = Seating(cloned(name), scripted_seat(other, game), policy_seat=int(clone))
    plan = []
    for i in range(first, first + num_games):
        sseed = teacher_seed(seed, i)
        gseed = derive_seed(SFT_SPACE, seed, i)
        plan.append(GameSpec(i - first, i - first, sseed, 0, f"sft-s{sseed}-g0", gseed))

    async def run() -> list[GameRecord]:
        scenarios = Scenarios(table_size, game=game)
        try:
            return await play_plan(
                plan, seating, scenarios, max_actions=max_actions, max_invalid=MAX_INVALID
            )
        finally:
            scenarios.close()

    return asyncio.run(run())


def filtered_games(path: Path, min_reward: float) -> Iterator[GameRecord]:
    """The games of ``path`` whose reward is at least ``min_reward``."""
    for record in iter_game_records(path):
        if record.reward >= min_reward:
            yield record


@dataclass
class HumanReplay:
    """What the game's rendering policy did to one file's human games."""

    games: int = 0
    complete: int = 0  # replayed to the logged end
    turns: int = 0
    dropped_messages: int = 0  # logged messages the rendering policy could not keep
    stopped: dict[str, int] = field(default_factory=dict)  # why a replay ended early


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


def human_records(
    game: DialogueGame, path: Path, chat, stats: HumanReplay | None = None
) -> Iterator[GameRecord]:
    """Every recorded human game of ``game`` in ``path`` replayed (``game.human.replays``) with
    both seats recorded under ``chat``."""
    from selfplay.generate.play import play_game
    from selfplay.players.teacher import TeacherPlayer

    if game.human is None:
        raise ValueError(f"the {game.name} game has no recorded human games")
    stats = stats if stats is not None else HumanReplay()
    for i, replay in enumerate(game.human.replays(path)):
        turns = replay.turns
        seats = tuple(
            TeacherPlayer(_Replay([t for s, t in turns if s == seat]), chat) for seat in (0, 1)
        )
        record = asyncio.run(
            # a replay that stops early ends as out of actions, its turns all played
            play_game(
                replay.scenario,
                seats,
                game_id=f"human-{i}",
                seed=i,
                max_actions=max(len(turns), 1),
                game=game,
            )
        )
        stats.games += 1
        stats.turns += len(turns)
        stats.dropped_messages += replay.dropped_messages
        if replay.stopped is None:
            stats.complete += 1
        else:
            stats.stopped[replay.stopped] = stats.stopped.get(replay.stopped, 0) + 1
        yield record
