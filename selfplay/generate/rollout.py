"""The one rollout path: which games to play, who sits in each seat, and playing many at once.

``selfplay generate`` (``runner``) and ``selfplay eval`` (``evaluate``) both play their games here;
they differ only in their plan and in what they do with each finished game.

- **Plan.** A ``GameSpec`` is one game: its position in the plan, its scenario (index and seed),
  its number ``k`` on that scenario, its id and its seed. ``training_plan`` and ``eval_plan`` give
  the two plans, from the two disjoint seed spaces of ``selfplay.seeds`` (training scenario seeds
  even, ids ``r{round}-s{scenario seed}-g{k}``; held-out seeds odd, ids ``eval-s{seed}-g{k}``).
- **Seating.** A ``SeatFactory`` makes one seat's player from (scenario, seat index, game seed);
  every player's own seed is ``derive_seed(game seed, seat)``. ``seating(policy, partner)`` puts
  the policy in both seats (self-play) or in ``policy_seat`` (1 or 2; 2 lets the partner move
  first) across a partner spec: ``scripted:NAME`` or ``openai:MODEL`` through a shared
  ``PartnerClient``. ``Seating(policy, partner)`` with any two factories seats anything else
  (cross-play of two models, a scripted pair).
- **Scenarios.** ``Scenarios`` makes scenarios off the event loop, in a thread per core, ahead of
  the games that need them; by default it forgets a scenario once the plan has moved past it.
- **Playing.** ``play_many`` plays a plan with at most ``concurrency`` games in flight (all of
  them by default), every game's requests going to the engines the seats share, and hands each
  finished record to ``on_game`` at once (the writer, summary and progress live there). When
  anything fails (an ``EngineFailure``, a callback, Ctrl-C's cancellation) the games in flight
  are cancelled and awaited before the error propagates: a game is either handed to ``on_game``
  whole or not at all. ``play_plan`` returns a whole plan's records in plan order.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from selfplay.engines import Engine
from selfplay.game.api import DialogueGame
from selfplay.generate.play import play_game
from selfplay.players import Player
from selfplay.players.api import ApiPartner, PartnerClient
from selfplay.players.llm import ChatFormat, LLMPlayer
from selfplay.players.partners import (
    OpenAIPartner,
    PartnerSpec,
    ScriptedPartner,
    SelfPlay,
    policy_seat_index,
)
from selfplay.records import GameRecord, SamplingParams
from selfplay.seeds import (
    derive_seed,
    game_seed,
    heldout_game_seed,
    heldout_scenario_seed,
    scenario_seed,
)

# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class GameSpec:
    """One planned game."""

    index: int  # position in the plan
    scenario_index: int
    scenario_seed: int
    k: int  # game number on its scenario
    game_id: str
    seed: int


def training_plan(
    seed: int, round: int, num_games: int, games_per_scenario: int
) -> Iterator[GameSpec]:
    """A generate run's games in order: scenario 0's K games, scenario 1's, ... (lazy)."""
    for i in range(math.ceil(num_games / games_per_scenario)):
        sseed = scenario_seed(seed, round, i)
        for k in range(games_per_scenario):
            index = i * games_per_scenario + k
            if index >= num_games:
                return
            yield GameSpec(
                index=index,
                scenario_index=i,
                scenario_seed=sseed,
                k=k,
                game_id=f"r{round}-s{sseed}-g{k}",
                seed=game_seed(seed, round, i, k),
            )


def eval_plan(
    seed: int, num_scenarios: int, games_per_scenario: int, split: str = "dev"
) -> list[GameSpec]:
    """An evaluation row's games: every held-out scenario of ``split`` (``seeds.SPLITS``),
    ``games_per_scenario`` games each; test-split game ids start with ``test-``."""
    plan = []
    prefix = "eval" if split == "dev" else split
    for i in range(num_scenarios):
        sseed = heldout_scenario_seed(split, seed, i)
        for k in range(games_per_scenario):
            plan.append(
                GameSpec(
                    index=len(plan),
                    scenario_index=i,
                    scenario_seed=sseed,
                    k=k,
                    game_id=f"{prefix}-s{sseed}-g{k}",
                    seed=heldout_game_seed(split, seed, i, k),
                )
            )
    return plan


# ---------------------------------------------------------------------------------------------
# Seating

Scenario = Any  # one game's scenario (its DialogueGame.scenario_type)
SeatFactory = Callable[[Scenario, int, int], Player]  # (scenario, seat index, game seed) -> Player


def llm_seat(
    engine: Engine,
    chat: ChatFormat,
    sampling: SamplingParams,
    *,
    name: str | None = None,
    trained: bool = True,
) -> SeatFactory:
    """A model's seat; ``name`` is what the record says it was (default: the engine's name)."""

    def make(scenario: Scenario, seat: int, seed: int) -> Player:
        return LLMPlayer(
            engine,
            chat,
            sampling=sampling,
            seed=derive_seed(seed, seat),
            name=name,
            trained=trained,
        )

    return make


def scripted_seat(name: str, game: DialogueGame) -> SeatFactory:
    """The seat of ``game``'s scripted policy ``name`` (one of its ``scripted_names``)."""

    def make(scenario: Scenario, seat: int, seed: int) -> Player:
        return game.scripted(name, scenario, seat, seed=derive_seed(seed, seat))

    return make


@dataclass(frozen=True)
class Seating:
    """Who plays a game: ``policy`` in both seats (``partner`` None: self-play) or in seat
    ``policy_seat`` (1 or 2) with ``partner`` in the other."""

    policy: SeatFactory
    partner: SeatFactory | None = None
    policy_seat: int = 1

    def __post_init__(self) -> None:
        if self.policy_seat not in (1, 2):
            raise ValueError(f"policy_seat is 1 or 2, not {self.policy_seat!r}")

    def players(self, scenario: Scenario, seed: int) -> tuple[Player, Player]:
        """The two seats of the game with seed ``seed``, seat 0 (moves first) first."""
        if self.partner is None:
            return self.policy(scenario, 0, seed), self.policy(scenario, 1, seed)
        policy = policy_seat_index(self.policy_seat)
        own = self.policy(scenario, policy, seed)
        other = self.partner(scenario, 1 - policy, seed)
        return (own, other) if policy == 0 else (other, own)


def seating(
    policy: SeatFactory,
    partner: PartnerSpec = SelfPlay(),
    *,
    policy_seat: int = 1,
    partner_client: PartnerClient | None = None,
    game: DialogueGame,
) -> Seating:
    """The seating of ``policy`` across a partner spec (a config's ``partner``).

    An ``openai:MODEL`` partner needs ``partner_client``: every game's API seat shares it (its
    concurrency, reply cache and call cap); the caller opens and closes it.
    """
    match partner:
        case SelfPlay():
            return Seating(policy, None, policy_seat)
        case ScriptedPartner(name=name):
            return Seating(policy, scripted_seat(name, game), policy_seat)
        case OpenAIPartner(model=model):
            if partner_client is None:
                raise ValueError(
                    f"partner openai:{model} needs a PartnerClient: pass partner_client "
                    "(open_partner_client opens one from the config)"
                )
            client = partner_client
            return Seating(policy, lambda scenario, seat, seed: ApiPartner(client), policy_seat)


# ---------------------------------------------------------------------------------------------
# Scenarios


class Scenarios:
    """Scenarios of one size of ``game`` made off the event loop, each shared by its games.

    ``get(spec)`` returns the future of ``spec``'s scenario, starting it when needed;
    ``prefetch(spec)`` only starts it. Plans hand specs out in scenario order, so asking for
    scenario ``i`` forgets every earlier one (games already holding its future keep it) and
    memory stays flat however long the plan; ``keep=True`` keeps them all, for an evaluation
    whose rows replay the same scenarios.
    """

    def __init__(self, size: int, *, game: DialogueGame, keep: bool = False) -> None:
        self.size = size
        self.keep = keep
        self.game = game
        self._cache: dict[int, tuple[int, asyncio.Future[Scenario]]] = {}  # seed: (index, future)
        # One thread per core: numpy releases the GIL only in the large steps of a scenario, so
        # asyncio's default pool (cores + 4 threads) made 64 scenarios no faster than one thread
        # on 2 cores (0.73 s), and 2 threads 30% faster (0.54 s).
        self._pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="scenarios")

    def prefetch(self, spec: GameSpec) -> asyncio.Future[Scenario]:
        entry = self._cache.get(spec.scenario_seed)
        if entry is None:
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, self.game.new_scenario, spec.scenario_seed, self.size
            )
            entry = self._cache[spec.scenario_seed] = (spec.scenario_index, future)
        return entry[1]

    def get(self, spec: GameSpec) -> asyncio.Future[Scenario]:
        if not self.keep:
            for seed in [s for s, (i, _) in self._cache.items() if i < spec.scenario_index]:
                del self._cache[seed]
        return self.prefetch(spec)

    async def warm(self, specs: Iterable[GameSpec]) -> None:
        """Make the scenarios of ``specs`` now (so that their games start together)."""
        await asyncio.gather(*(self.prefetch(s) for s in specs))

    def close(self) -> None:
        """Stop the threads; scenarios being made are dropped (no game is waiting for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# Playing

GameCallback = Callable[[GameSpec, GameRecord], None]


async def play_many(
    specs: Iterable[GameSpec],
    seating: Seating,
    scenarios: Scenarios,
    *,
    count: int,
    max_actions: int,
    max_invalid: int,
    round: int = 0,
    concurrency: int | None = None,
    on_game: GameCallback | None = None,
) -> None:
    """Play the ``count`` games of ``specs`` (read lazily, in order), ``concurrency`` at a time
    (None: all of them), handing each finished record to ``on_game`` as it finishes.

    The scenarios of the first wave are made before any game starts, so those games start (and
    batch) together; the scenarios of the next wave are made while the first is played. On any
    error, games in flight are cancelled and awaited, then the error propagates.
    """
    width = min(concurrency or count, count)
    if width <= 0:
        return
    pending = iter(specs)
    queue = deque(itertools.islice(pending, 2 * width))
    await scenarios.warm(itertools.islice(queue, width))
    for spec in itertools.islice(queue, width, None):
        scenarios.prefetch(spec)

    def take() -> GameSpec | None:
        if not queue:
            return None
        spec = queue.popleft()
        following = next(pending, None)
        if following is not None:
            queue.append(following)
            scenarios.prefetch(following)
        return spec

    async def worker() -> None:
        while (spec := take()) is not None:
            scenario = await scenarios.get(spec)
            record = await play_game(
                scenario,
                seating.players(scenario, spec.seed),
                game_id=spec.game_id,
                seed=spec.seed,
                round=round,
                max_actions=max_actions,
                max_invalid=max_invalid,
                game=scenarios.game,
            )
            if on_game is not None:
                on_game(spec, record)

    tasks = [asyncio.create_task(worker(), name=f"game-worker-{i}") for i in range(width)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def play_plan(
    plan: Sequence[GameSpec],
    seating: Seating,
    scenarios: Scenarios,
    *,
    on_game: GameCallback | None = None,
    **options,
) -> list[GameRecord]:
    """``play_many`` of a whole plan (``spec.index`` its position); the records in plan order.
    ``options``: ``play_many``'s keywords but ``count``."""
    records: list[GameRecord | None] = [None] * len(plan)

    def keep(spec: GameSpec, record: GameRecord) -> None:
        records[spec.index] = record
        if on_game is not None:
            on_game(spec, record)

    await play_many(plan, seating, scenarios, count=len(plan), on_game=keep, **options)
    return records  # type: ignore[return-value]  # every game finished, or play_many raised
