"""Guided GRPO groups (``--guide scripted:NAME``): a round's groups get games of a scripted guide on
the same scenarios, recorded as the model's own turns, so that a behaviour the model never samples
(asking the shy partner) can still be in a group with a reward to compare.

After generate, for every scenario of the round (``--guide-when always``) or only those where
every one of the model's games scored 0 (``failed``: no own game to learn from, LUFFY's "all
samples failed" case), ``--guide-games`` games are played with the guide in the model's seats:
self-play puts the guide in both seats, a scripted ``--partner`` keeps its seat. The guide's
seats are ``TeacherPlayer`` seats: the model's own chat template and tokens, mask 1 on the
guide's action tokens (as ``selfplay sft`` records a teacher). Their records go to
``round_K/guide.jsonl``; convert reads ``round_K/guided.jsonl`` (the model's games, then the
guide's) and groups them by scenario like any other game, so a guide row's advantage is its
reward against the group's mean. Its rows carry ``off_policy`` and the trainer gives those tokens
LUFFY's shaped objective (``selfplay.train.guided``); their log-probs are the current policy's,
taken by the trainer's no-grad pass like every row's.

Guide games are scripted and seeded from the run's seed, round and scenario: a convert that is
killed and restarted plays the same ones. ``--guide-rounds N`` plays them in the first N rounds
only (then GRPO goes on alone on the model's own games).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from selfplay.fileio import atomic_write
from selfplay.iterate.config import IterateConfig
from selfplay.manifest import ConvertInfo
from selfplay.records import GameRecord, dump_record, iter_game_records
from selfplay.seeds import derive_seed

log = logging.getLogger(__name__)

GUIDE_SPACE = 0x5E1F_6D1E  # first word of the guide games' seeds


def guide_active(cfg: IterateConfig, k: int) -> bool:
    """Whether round ``k`` adds guide games."""
    return cfg.guide is not None and (cfg.guide_rounds is None or k < cfg.guide_rounds)


def guide_games(
    cfg: IterateConfig, k: int, records: Iterable[GameRecord], chat
) -> list[GameRecord]:
    """The guide games of round ``k`` for the scenarios of ``records`` (in their order)."""
    from selfplay.generate.play import play_game
    from selfplay.generate.rollout import Seating, scripted_seat
    from selfplay.players.partners import ScriptedPartner
    from selfplay.players.teacher import TeacherPlayer

    game = cfg.game
    guide = cfg.guide.split(":", 1)[1]  # checked by the config: scripted:NAME

    def teacher(scenario, seat: int, seed: int):
        return TeacherPlayer(
            game.scripted(guide, scenario, seat, seed=derive_seed(seed, seat)), chat
        )

    partner = cfg.partner
    other = scripted_seat(partner.name, game) if isinstance(partner, ScriptedPartner) else None
    seating = Seating(teacher, other, cfg.policy_seat)
    scenarios: dict[str, tuple[object, list[float]]] = {}
    for r in records:
        scenarios.setdefault(r.scenario_id, (r.scenario, []))[1].append(r.reward)

    async def play() -> list[GameRecord]:
        out = []
        for i, (sid, (scenario, rewards)) in enumerate(scenarios.items()):
            if cfg.guide_when == "failed" and max(rewards) > 0:
                continue
            for j in range(cfg.guide_games):
                seed = derive_seed(GUIDE_SPACE, cfg.seed, k, i, j)
                out.append(
                    await play_game(
                        scenario,
                        seating.players(scenario, seed),
                        game_id=f"r{k}-{sid}-guide{j}",
                        seed=seed,
                        round=k,
                        max_actions=cfg.max_actions,
                        max_invalid=cfg.max_invalid,
                        game=game,
                    )
                )
        return out

    return asyncio.run(play())


def write_guided_games(cfg: IterateConfig, k: int, model: str) -> tuple[object, ConvertInfo]:
    """Write round ``k``'s guide games and the file convert reads (the model's games, then the
    guide's); return that file's path and what the convert stage records of them (its guide
    fields)."""
    from selfplay.players.llm import load_chat_format

    rdir = cfg.round_dir(k)
    own = rdir / "games.jsonl"
    records = list(iter_game_records(own))
    guides = guide_games(cfg, k, records, load_chat_format(model))
    guide_lines = b"".join(dump_record(r) for r in guides)
    atomic_write(rdir / "guide.jsonl", guide_lines)
    data = own.read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    path = atomic_write(rdir / "guided.jsonl", data + guide_lines)
    rewards = [r.reward for r in guides]
    info = ConvertInfo(
        guide_games=len(guides),
        guide_reward_mean=sum(rewards) / len(rewards) if rewards else None,
        guided_scenarios=len({r.scenario_id for r in guides}),
    )
    log.info(
        "round %d: %d guide games (%s) on %d scenarios, mean reward %s",
        k,
        len(guides),
        cfg.guide,
        info.guided_scenarios,
        f"{info.guide_reward_mean:.3f}" if rewards else "-",
    )
    return path, info
