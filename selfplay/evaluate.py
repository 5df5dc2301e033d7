"""Evaluation on held-out scenarios: models, scripted baselines, humans and cross-play side by side.

Held-out scenarios. Evaluation scenario ``i`` under eval seed ``s`` has seed
``eval_scenario_seed(s, i)``: a 63-bit SeedSequence hash of (EVAL_SPACE, s, i), shifted left by
one with the low bit set, so every evaluation seed is odd. Training scenario seeds
(``runner.scenario_seed``) are the same kind of hash shifted left with the low bit clear, so every
training seed is even: the two sets can never share a seed, for any run seed, round or index, and
an evaluation never replays a training scenario.

``run_eval(config)`` plays, on the same ``num_scenarios`` held-out scenarios:

- every model of ``config.models`` (an HF directory or id, or ``embedded``) in self-play, or in
  seat 1 against a scripted ``partner`` in seat 2; greedy (temperature 0) by default, or sampled
  with ``games_per_scenario`` games per scenario;
- every scripted baseline (cooperative, no-talk, random) the same way (in self-play, or against
  the partner);
- with ``cross_play``, every ordered pair of distinct models (model A in seat 1, model B in seat 2)
  for a matrix of rewards and, per model, the gap between its self-play reward and its mean
  cross-play reward (a gap that widens across rounds means private conventions).

It adds the human reference row (the 134 DialOp human games: computed from
``dialop-data/optimization.jsonl`` when the file is found, else the stored constant with its
source) and returns an ``EvalResult`` whose ``rows`` are the table. Each model is loaded once
(one engine per model; with ``cross_play`` all models are held at once). A model that cannot be
loaded, or whose engine dies, becomes a row with an ``error`` and the rest are still evaluated;
``run_eval`` raises ``EvalError`` only when every model failed, after the other rows are done
(``EvalError.result`` holds them).

``play_scripted`` / ``evaluate_scripted`` are the quick scripted-pair evaluation (one summary of
two scripted policies), used by ``selfplay eval --players`` and the run report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from selfplay.engines import EngineFailure, HFEngineConfig, open_engine
from selfplay.errors import UserError
from selfplay.game.matching import Scenario, generate_scenario
from selfplay.metrics import classify_question, mean_ci, summarize
from selfplay.partners import PartnerOptions
from selfplay.play import play_game
from selfplay.players.llm import ChatFormat, LLMPlayer, derive_seed, load_chat_format
from selfplay.players.scripted import SCRIPTED_NAMES, make_scripted
from selfplay.records import GameRecord, SamplingParams, append_records

log = logging.getLogger(__name__)

EVAL_SPACE = 0x5E1F_E7A1  # a fixed first word of every evaluation seed sequence
BASELINES = ("cooperative", "no-talk", "random")
HUMAN_DATA_ENV = "SELFPLAY_HUMAN_DATA"
# ../shared/dialop-data beside the repository (where tests/conftest.py finds the human games too)
DEFAULT_HUMAN_DATA = (
    Path(__file__).resolve().parents[2] / "shared" / "dialop-data" / "optimization.jsonl"
)
HUMAN_SOURCE = (
    "mean normalised reward (score / best assignment) of the 134 human games of DialOp "
    "(Lin et al., 'Decision-Oriented Dialogue for Human-AI Collaboration', "
    "dialop-data/optimization.jsonl)"
)
EVAL_SCHEMA_VERSION = 1


def _hash63(*words: int) -> int:
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0]) >> 1


def eval_scenario_seed(seed: int, index: int) -> int:
    """Seed of held-out scenario ``index`` under eval seed ``seed``: always odd (never a training
    seed, which ``runner.scenario_seed`` makes even)."""
    return (_hash63(EVAL_SPACE, seed, index) << 1) | 1


def eval_game_seed(seed: int, index: int, k: int) -> int:
    """Seed of game ``k`` on held-out scenario ``index``; the seats' sampling derives from it."""
    return derive_seed(EVAL_SPACE, seed, index, k)


# ---------------------------------------------------------------------------------------------
# Scripted pairs: the quick evaluation behind `selfplay eval --players a,b`


def play_scripted(
    players: tuple[str, str],
    *,
    num_games: int,
    seed: int,
    n: int = 8,
    max_actions: int = 30,
    max_invalid: int = 3,
) -> list[GameRecord]:
    """Play ``num_games`` games of two scripted policies, one fresh held-out scenario each."""

    async def run() -> list[GameRecord]:
        records = []
        for i in range(num_games):
            sseed = eval_scenario_seed(seed, i)
            scenario = generate_scenario(sseed, n)
            seats = (
                make_scripted(players[0], scenario, 0, seed=sseed + 1),
                make_scripted(players[1], scenario, 1, seed=sseed + 2),
            )
            records.append(
                await play_game(
                    scenario,
                    seats,
                    game_id=f"eval-{i}",
                    seed=sseed,
                    max_actions=max_actions,
                    max_invalid=max_invalid,
                )
            )
        return records

    return asyncio.run(run())


def evaluate_scripted(players: tuple[str, str], **kwargs) -> dict:
    """Summary (see metrics.summarize) of scripted games plus the pair that played them."""
    summary = summarize(play_scripted(players, **kwargs))
    return {"players": list(players), **kwargs, **summary}


# ---------------------------------------------------------------------------------------------
# Config and result


class EvalError(UserError, ValueError):
    """The evaluation cannot give a result as asked; says what to do.

    ``result`` holds what was evaluated before the failure (baselines, human row, errors), if any.
    """

    def __init__(self, message: str, result: EvalResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class ModelSpec(BaseModel):
    """A model to evaluate: its label in the table and what to load (dir, HF id, ``embedded``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str = Field(min_length=1)
    model: str = Field(min_length=1)


def _scripted_name(name: str) -> str:
    if name not in SCRIPTED_NAMES:
        raise ValueError(
            f"{name!r} is not a scripted policy; choose from {', '.join(SCRIPTED_NAMES)}"
        )
    return name


class EvalConfig(PartnerOptions):
    """Everything one evaluation needs (``selfplay eval`` builds it from its options)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: tuple[ModelSpec, ...] = Field(min_length=1)
    num_scenarios: int = Field(100, ge=1)
    games_per_scenario: int = Field(1, ge=1)
    seed: int = Field(7, ge=0)  # eval seed: picks the held-out scenario set
    table_size: int = Field(8, ge=3, le=8)
    max_actions: int = Field(30, ge=1)
    max_invalid: int = Field(3, ge=1)
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    baselines: tuple[str, ...] = BASELINES
    cross_play: bool = False
    concurrency: int | None = Field(None, ge=1)  # games in flight per row; None: all of them
    device: str | None = None
    max_batch_size: int = Field(64, ge=1)
    human_data: Path | None = None  # None: $SELFPLAY_HUMAN_DATA, else ../shared/dialop-data
    out: Path | None = None  # when set, every game is kept in OUT/games/<row>.jsonl

    @field_validator("baselines")
    @classmethod
    def _baselines_known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_scripted_name(b) for b in v)

    @field_validator("models")
    @classmethod
    def _labels_unique(cls, v: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
        labels = [m.label for m in v]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"each model must be named once; repeated: {', '.join(dup)}")
        return v

    @field_validator("human_data")
    @classmethod
    def _human_data_exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(
                f"{v} does not exist; point it at dialop-data/optimization.jsonl or leave it "
                "unset to use the stored human reference"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if self.games_per_scenario > 1 and self.sampling.temperature == 0:
            raise ValueError(
                "games_per_scenario: several games per scenario only differ when sampled; "
                "set a temperature above 0 or play 1 game per scenario"
            )
        if self.cross_play and self.partner is not None:
            raise ValueError(
                "cross_play: cross-play pairs the models with each other; drop the partner"
            )
        if self.cross_play and len(self.models) < 2:
            raise ValueError("cross_play: needs at least two models")
        return self


Kind = Literal["model", "baseline", "human", "cross"]


class EvalRow(BaseModel):
    """One line of the table: who played which seat and metrics.summarize of their games.

    Metric fields are None where they do not apply (a model that failed to load; the invalid
    rate of humans, whose interface allowed only valid moves).
    """

    name: str
    kind: Kind
    seat1: str
    seat2: str
    model: str | None = None  # the resolved model path of a model row
    error: str | None = None
    source: str | None = None  # where a human row's numbers come from
    games: int = 0
    reward_mean: float | None = None
    reward_ci_low: float | None = None
    reward_ci_high: float | None = None
    reward_std: float | None = None
    agreement_rate: float | None = None
    mean_actions: float | None = None
    mean_words: float | None = None
    invalid_action_rate: float | None = None
    optimal_rate: float | None = None
    questions_per_game: float | None = None
    direct_questions_per_game: float | None = None  # naming a reviewer and a paper
    general_questions_per_game: float | None = None
    outcomes: dict[str, int] = {}
    seconds: float = 0.0


class CrossPlay(BaseModel):
    """Rewards of every ordered model pair: ``reward[i][j]`` has ``models[i]`` in seat 1 and
    ``models[j]`` in seat 2; the diagonal is self-play. ``gap`` = self-play minus the mean of the
    model's cross-play rewards in both seats."""

    models: list[str]
    reward: list[list[float | None]]  # None: that pair failed
    games: list[list[int]]
    self_play: dict[str, float | None]
    cross_play_mean: dict[str, float | None]
    gap: dict[str, float | None]


class EvalResult(BaseModel):
    """What ``run_eval`` found; ``save_result`` writes it as eval.json."""

    schema_version: Literal[1] = EVAL_SCHEMA_VERSION
    config: dict
    scenario_seeds: list[int]
    rows: list[EvalRow]
    cross_play: CrossPlay | None = None
    errors: dict[str, str] = {}
    seconds: float = 0.0

    def row(self, name: str, kind: Kind | None = None) -> EvalRow:
        for r in self.rows:
            if r.name == name and (kind is None or r.kind == kind):
                return r
        raise KeyError(f"no row named {name!r} in this evaluation")


def save_result(result: EvalResult, path: str | Path) -> Path:
    """Write eval.json (replaced atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    tmp.replace(path)
    return path


def run_models(run: str, data_root: str | Path = "data") -> list[ModelSpec]:
    """The models of a `selfplay iterate` run: the initial model, then each trained checkpoint
    (labelled ``initial``, ``round_0``, ``round_1``, ... after checkpoints/RUN/round_K)."""
    from selfplay.iterate import Manifest

    path = Path(data_root) / run / "manifest.json"
    if not path.is_file():
        raise EvalError(
            f"{path} does not exist: name a run started with `selfplay iterate` "
            "(and pass --data-root when it is not under data/)"
        )
    manifest = Manifest.model_validate(json.loads(path.read_text()))
    initial = (
        manifest.rounds[min(manifest.rounds)].model
        if manifest.rounds
        else manifest.config.get("model")
    )
    if not initial:
        raise EvalError(f"{path} names no initial model; is it a selfplay run manifest?")
    specs = [ModelSpec(label="initial", model=str(initial))]
    for k in sorted(manifest.rounds):
        train = manifest.rounds[k].stages.get("train")
        if train is not None and "model" in train.artifacts:
            specs.append(ModelSpec(label=f"round_{k}", model=train.artifacts["model"]))
    return specs


# ---------------------------------------------------------------------------------------------
# The human reference


def human_reference(path: str | Path | None = None) -> EvalRow:
    """The human row: computed from the DialOp human games when found, else the stored constant.

    ``path`` None: $SELFPLAY_HUMAN_DATA, else ../shared/dialop-data/optimization.jsonl beside the
    repository. Reward is score / best assignment (the dataset's result.norm).
    """
    from selfplay.report import HUMAN_REFERENCE  # report imports this module

    file = Path(path or os.environ.get(HUMAN_DATA_ENV) or DEFAULT_HUMAN_DATA)
    base = {"name": "human", "kind": "human", "seat1": "human", "seat2": "human"}
    if not file.is_file():
        return EvalRow(
            **base,
            games=134,
            reward_mean=HUMAN_REFERENCE,
            agreement_rate=1.0,
            source=f"stored constant selfplay.report.HUMAN_REFERENCE: {HUMAN_SOURCE}; "
            f"{file} was not found",
        )
    games = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    if not games:
        raise EvalError(f"{file} holds no human games; point --human-data at optimization.jsonl")
    rewards, actions, words, agreed = [], [], [], 0
    direct, general = [], []
    for g in games:
        rewards.append(g["result"]["score"] / g["best_assignment_reward"])
        log_ = g["action_log"]
        messages = [a["message"]["data"] for a in log_ if a["type"] == "message"]
        actions.append(len(log_))
        words.append(sum(len(m.split()) for m in messages))
        kinds = [classify_question(m) for m in messages]
        direct.append(kinds.count("direct"))
        general.append(kinds.count("general"))
        agreed += any(a["type"] == "proposal_response" and a["response"]["accept"] for a in log_)
    mean, lo, hi = mean_ci(rewards)
    return EvalRow(
        **base,
        games=len(games),
        reward_mean=mean,
        reward_ci_low=lo,
        reward_ci_high=hi,
        reward_std=float(np.std(rewards, ddof=1)),
        agreement_rate=agreed / len(games),
        mean_actions=float(np.mean(actions)),
        mean_words=float(np.mean(words)),
        questions_per_game=float(np.mean(direct) + np.mean(general)),
        direct_questions_per_game=float(np.mean(direct)),
        general_questions_per_game=float(np.mean(general)),
        optimal_rate=float(np.mean([r >= 1.0 for r in rewards])),
        source=f"computed from {len(games)} human games in {file} ({HUMAN_SOURCE}); "
        "8x8 tables, actions count messages, proposals and responses",
    )


# ---------------------------------------------------------------------------------------------
# Playing


@dataclass
class _Loaded:
    spec: ModelSpec
    path: str
    engine: object
    chat: ChatFormat


SeatFactory = Callable[[Scenario, int, int], object]  # (scenario, seat, game seed) -> Player


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


class _Evaluation:
    """One evaluation in progress: the scenarios, the loaded models and the rows so far."""

    def __init__(self, config: EvalConfig) -> None:
        self.config = config
        self.seeds = [eval_scenario_seed(config.seed, i) for i in range(config.num_scenarios)]
        self.scenarios: list[Scenario] = []
        self.games_dir = config.out / "games" if config.out is not None else None
        self.partner_client = None  # an API partner's client, shared by every row

    async def prepare(self) -> None:
        from selfplay.players.api import api_partner_config, open_partner_client

        cfg = self.config
        self.scenarios = await asyncio.to_thread(
            lambda: [generate_scenario(s, cfg.table_size) for s in self.seeds]
        )
        if self.games_dir is not None:
            self.games_dir.mkdir(parents=True, exist_ok=True)
        api = api_partner_config(cfg, cfg.out)
        if api is not None:
            self.partner_client = open_partner_client(api)

    async def aclose(self) -> None:
        if self.partner_client is not None:
            await self.partner_client.aclose()

    def _partner(self) -> SeatFactory:
        """The --partner seat: a scripted policy or the API partner."""
        if self.partner_client is None:
            return self._scripted(self.config.partner)
        from selfplay.players.api import ApiPartner

        client = self.partner_client
        return lambda scenario, seat, gseed: ApiPartner(client)

    def _llm(self, lm: _Loaded) -> SeatFactory:
        sampling = self.config.sampling

        def make(scenario: Scenario, seat: int, gseed: int) -> LLMPlayer:
            return LLMPlayer(
                lm.engine,
                lm.chat,
                sampling=sampling,
                seed=derive_seed(gseed, seat),
                name=lm.path,
                trained=False,
            )

        return make

    @staticmethod
    def _scripted(name: str) -> SeatFactory:
        def make(scenario: Scenario, seat: int, gseed: int):
            return make_scripted(name, scenario, seat, seed=derive_seed(gseed, seat))

        return make

    async def play(
        self, file: str, seat1: SeatFactory, seat2: SeatFactory, *, quiet: bool = False
    ) -> list[GameRecord]:
        """Every game of one row (all scenarios x games_per_scenario), in plan order."""
        cfg = self.config
        plan = [(i, k) for i in range(cfg.num_scenarios) for k in range(cfg.games_per_scenario)]
        limit = asyncio.Semaphore(cfg.concurrency or len(plan))
        done = 0
        every = max(1, len(plan) // 10)

        async def one(i: int, k: int) -> GameRecord:
            nonlocal done
            async with limit:
                scenario, gseed = self.scenarios[i], eval_game_seed(cfg.seed, i, k)
                record = await play_game(
                    scenario,
                    (seat1(scenario, 0, gseed), seat2(scenario, 1, gseed)),
                    game_id=f"eval-s{self.seeds[i]}-g{k}",
                    seed=gseed,
                    max_actions=cfg.max_actions,
                    max_invalid=cfg.max_invalid,
                )
            done += 1
            if done % every == 0 or done == len(plan):
                log.log(
                    logging.DEBUG if quiet else logging.INFO,
                    "eval %s: %d/%d games",
                    file,
                    done,
                    len(plan),
                )
            return record

        tasks = [asyncio.ensure_future(one(i, k)) for i, k in plan]
        try:
            records = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
        if self.games_dir is not None:
            path = self.games_dir / f"{_slug(file)}.jsonl"
            path.unlink(missing_ok=True)
            await asyncio.to_thread(append_records, path, records)
        return records

    async def load(self, spec: ModelSpec) -> _Loaded:
        from selfplay.models import resolve_model

        path = await asyncio.to_thread(resolve_model, spec.model)
        chat = await asyncio.to_thread(load_chat_format, path)
        engine_cfg = HFEngineConfig(
            model=path, device=self.config.device, max_batch_size=self.config.max_batch_size
        )
        engine = await asyncio.to_thread(open_engine, engine_cfg)
        await engine.start()
        return _Loaded(spec, path, engine, chat)


def _row(name: str, kind: Kind, seat1: str, seat2: str, records, started: float, **extra):
    summary = summarize(records)
    summary = {
        k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summary.items()
    }
    return EvalRow(
        name=name,
        kind=kind,
        seat1=seat1,
        seat2=seat2,
        seconds=time.perf_counter() - started,
        **extra,
        **summary,
    )


def _ordered(names: tuple[str, str], config: EvalConfig) -> tuple[str, str]:
    """(policy, partner) names in seat order: the policy takes seat ``config.policy_seat``."""
    return names if config.policy_seat == 1 else (names[1], names[0])


async def run_eval_async(config: EvalConfig) -> EvalResult:
    """Evaluate every model, baseline and (optionally) model pair; see the module docstring."""
    started = time.perf_counter()
    ev = _Evaluation(config)
    await ev.prepare()
    rows: list[EvalRow] = []
    errors: dict[str, str] = {}
    kept: list[_Loaded] = []  # held for cross-play
    partner = config.partner

    def failed(label: str, names: tuple[str, str], model: str, msg: str) -> None:
        """A model's row when it could not be evaluated; the others still are."""
        log.error("%s", msg)
        errors[label] = msg
        seat1, seat2 = names
        rows.append(
            EvalRow(name=label, kind="model", seat1=seat1, seat2=seat2, model=model, error=msg)
        )

    try:
        for spec in config.models:
            t0 = time.perf_counter()
            seat2_name = partner or spec.label
            names = _ordered((spec.label, seat2_name), config)

            try:
                lm = await ev.load(spec)
            except Exception as e:  # any loading failure is this model's, not the evaluation's
                msg = f"model {spec.label!r} ({spec.model}) could not be loaded: "
                failed(spec.label, names, spec.model, msg + f"{type(e).__name__}: {e}")
                continue
            other = ev._partner() if partner else ev._llm(lm)
            seats = (ev._llm(lm), other) if config.policy_seat == 1 else (other, ev._llm(lm))
            try:
                log.info(
                    "eval: %s (%d games)",
                    spec.label,
                    config.num_scenarios * config.games_per_scenario,
                )
                records = await ev.play(f"model-{spec.label}", *seats)
            except EngineFailure as e:
                msg = f"model {spec.label!r} ({lm.path}) failed while playing: {e}"
                failed(spec.label, names, lm.path, msg)
                await lm.engine.aclose()
                continue
            rows.append(_row(spec.label, "model", *names, records, t0, model=lm.path))
            log.info("eval: %s reward %.3f", spec.label, rows[-1].reward_mean or 0.0)
            if config.cross_play:
                kept.append(lm)
            else:
                await lm.engine.aclose()
        cross = await _cross_play(ev, kept, rows, errors) if len(kept) >= 2 else None
        for name in config.baselines:
            t0 = time.perf_counter()
            own, other = ev._scripted(name), ev._partner() if partner else ev._scripted(name)
            seats = (own, other) if config.policy_seat == 1 else (other, own)
            records = await ev.play(f"baseline-{name}", *seats, quiet=True)
            names = _ordered((name, partner or name), config)
            rows.append(_row(name, "baseline", *names, records, t0))
    finally:
        for lm in kept:
            await lm.engine.aclose()
        await ev.aclose()
    rows.append(human_reference(config.human_data))
    result = EvalResult(
        config=config.model_dump(mode="json"),
        scenario_seeds=ev.seeds,
        rows=rows,
        cross_play=cross,
        errors=errors,
        seconds=time.perf_counter() - started,
    )
    if all(r.error for r in rows if r.kind == "model"):
        raise EvalError(
            "no model could be evaluated:\n" + "\n".join(f"- {m}" for m in errors.values()),
            result,
        )
    return result


async def _cross_play(
    ev: _Evaluation, kept: Sequence[_Loaded], rows: list[EvalRow], errors: dict[str, str]
) -> CrossPlay | None:
    labels = [lm.spec.label for lm in kept]
    self_play = {r.name: r for r in rows if r.kind == "model" and r.error is None}
    n = len(kept)
    reward: list[list[float | None]] = [[None] * n for _ in range(n)]
    games = [[0] * n for _ in range(n)]
    for i, a in enumerate(kept):
        reward[i][i] = self_play[a.spec.label].reward_mean
        games[i][i] = self_play[a.spec.label].games
        for j, b in enumerate(kept):
            if i == j:
                continue
            t0 = time.perf_counter()
            name = f"{a.spec.label} + {b.spec.label}"
            log.info("eval: cross-play %s", name)
            try:
                records = await ev.play(f"cross-{name}", ev._llm(a), ev._llm(b))
            except EngineFailure as e:
                errors[name] = f"cross-play {name} failed: {e}"
                rows.append(
                    EvalRow(
                        name=name,
                        kind="cross",
                        seat1=a.spec.label,
                        seat2=b.spec.label,
                        error=errors[name],
                    )
                )
                continue
            row = _row(name, "cross", a.spec.label, b.spec.label, records, t0)
            rows.append(row)
            reward[i][j], games[i][j] = row.reward_mean, row.games
    cross_mean, gap = {}, {}
    for i, label in enumerate(labels):
        others = [v for j in range(n) if j != i for v in (reward[i][j], reward[j][i])]
        others = [v for v in others if v is not None]
        own = reward[i][i]
        cross_mean[label] = float(np.mean(others)) if others else None
        gap[label] = own - cross_mean[label] if own is not None and others else None
    return CrossPlay(
        models=labels,
        reward=reward,
        games=games,
        self_play={label: reward[i][i] for i, label in enumerate(labels)},
        cross_play_mean=cross_mean,
        gap=gap,
    )


def run_eval(config: EvalConfig) -> EvalResult:
    return asyncio.run(run_eval_async(config))
