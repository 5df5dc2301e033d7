"""Evaluation on held-out scenarios: models, scripted baselines, humans and cross-play side by side.

Held-out scenarios. Evaluation scenario ``i`` under eval seed ``s`` has seed
``eval_scenario_seed(s, i)``, always odd; training scenario seeds are always even, so an
evaluation never replays a training scenario (both spaces, and why they are disjoint:
``selfplay.seeds``). Every row plays the same plan (``rollout.eval_plan``) through the same loop
and seating as ``selfplay generate`` (``rollout.play_many``, ``rollout.seating``).

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
``dialop-data/optimization.jsonl`` when the file is found, else the stored constant
``HUMAN_REFERENCE`` with its source) and returns an ``EvalResult`` whose ``rows`` are the table.
Each row is built from ``metrics.summarize`` key by key (``summary_fields``): a summary key the row
neither has nor leaves out on purpose (``NOT_IN_ROW``) is an error, never a silent drop.

Engines. Each model is loaded once, on its own engine: ``config.engine`` is a template (any
``EngineConfig``: hf or SGLang) whose ``model`` is replaced by the model's path; without one, the
hf engine on ``device`` with ``max_batch_size``. With ``cross_play`` all models are held at once.
A launched SGLang server serves model ``j`` (its position in ``models``) on port ``port + j``, so
that cross-play can hold them side by side. An attached SGLang server (``engine.url``: one server,
several models) is given each model's weights with ``update_weights_from_disk(path)`` before that
model's rows (the path must be readable by the server; the server keeps the last model's weights
afterwards); it holds one model at a time, so cross-play refuses it. A model that cannot be
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from selfplay.engines import (
    Engine,
    EngineConfig,
    EngineFailure,
    HFEngineConfig,
    SGLangEngineConfig,
    open_engine,
)
from selfplay.errors import UserError
from selfplay.game import MATCHING, DialogueGame, game_of, get_game
from selfplay.game.matching_scripted import make_scripted
from selfplay.generate_config import PlayOptions
from selfplay.hardware import ComputeDtype
from selfplay.manifest import read_manifest
from selfplay.metrics import GameSummary, mean_ci, summarize
from selfplay.partners import PartnerOptions
from selfplay.players.llm import ChatFormat, load_chat_format
from selfplay.records import GameRecord, SamplingParams, append_records
from selfplay.rollout import (
    GameSpec,
    Scenarios,
    SeatFactory,
    Seating,
    eval_plan,
    llm_seat,
    play_plan,
    scripted_seat,
    seating,
)
from selfplay.seeds import EVAL_SPACE as EVAL_SPACE  # re-exports: the held-out seed space
from selfplay.seeds import eval_game_seed as eval_game_seed  # lived here before selfplay.seeds
from selfplay.seeds import eval_scenario_seed

log = logging.getLogger(__name__)

BASELINES = ("cooperative", "no-talk", "random")
HUMAN_REFERENCE = 0.921  # mean normalised reward of the 134 DialOp human games (shared/dialop-data)
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
# validation context of a stored eval.json: checks of files the evaluation read are skipped
STORED = "stored"


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
    """Play ``num_games`` games of two scripted policies, one fresh held-out scenario each.

    Game ``i`` has id ``eval-{i}`` and seed ``eval_scenario_seed(seed, i)``; seat ``s`` plays with
    seed + 1 + s (the seeds these games always had, kept so that stored baselines still hold).
    """

    def seat(name: str) -> SeatFactory:
        return lambda scenario, s, gseed: make_scripted(name, scenario, s, seed=gseed + 1 + s)

    plan = []
    for i in range(num_games):
        sseed = eval_scenario_seed(seed, i)
        plan.append(GameSpec(i, i, sseed, 0, f"eval-{i}", sseed))

    async def run() -> list[GameRecord]:
        scenarios = Scenarios(n)
        try:
            pair = Seating(seat(players[0]), seat(players[1]))
            limits = dict(max_actions=max_actions, max_invalid=max_invalid)
            return await play_plan(plan, pair, scenarios, **limits)
        finally:
            scenarios.close()

    return asyncio.run(run())


def evaluate_scripted(players: tuple[str, str], **kwargs) -> dict:
    """Summary (see metrics.summarize) of scripted games plus the pair that played them."""
    summary = summarize(play_scripted(players, **kwargs))
    return {"players": list(players), **kwargs, **summary.model_dump(exclude={"partner"})}


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


def default_baselines(game: DialogueGame) -> tuple[str, ...]:
    """Eval's baseline rows when none are named: ``BASELINES`` for the matching game, another
    game's own scripted players."""
    return BASELINES if game is MATCHING else tuple(game.scripted_names)


def _scripted_name(name: str, names: Sequence[str]) -> str:
    if name not in names:
        raise ValueError(f"{name!r} is not a scripted policy; choose from {', '.join(names)}")
    return name


DEFAULT_MAX_BATCH = HFEngineConfig.model_fields["max_batch_size"].default


class EvalConfig(PartnerOptions, PlayOptions):
    """Everything one evaluation needs (``selfplay eval`` builds it from its options; each
    field's ``description`` is its option's help). The table and limits of a game are
    generate's ``PlayOptions``, so eval plays exactly the games generate plays."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: tuple[ModelSpec, ...] = Field(
        min_length=1,
        description="Models to evaluate: HF dirs or ids, or 'embedded'; each with its label in "
        "the table.",
    )
    num_scenarios: int = Field(
        100, ge=1, description="Held-out scenarios; every row plays the same ones."
    )
    games_per_scenario: int = Field(1, ge=1, description="Games per scenario (needs sampling).")
    seed: int = Field(7, ge=0, description="Eval seed: picks the held-out scenarios (odd seeds).")
    sampling: SamplingParams = Field(
        SamplingParams(temperature=0.0),
        description="The models' sampling: temperature (0: greedy, deterministic), top-p and "
        "tokens per action at most.",
    )
    baselines: tuple[str, ...] | None = Field(
        None,
        validate_default=True,  # None becomes the game's default_baselines
        description="Scripted baseline rows (empty for none; default: cooperative, no-talk, "
        "random; another game: its scripted players).",
    )
    cross_play: bool = Field(
        False, description="Also play every ordered pair of models; matrix and gaps."
    )
    concurrency: int | None = Field(
        None, ge=1, description="Games in flight per row (default: all of them)."
    )
    engine: EngineConfig | None = Field(
        None,
        description="Engine template of every model (hf or sglang, by its kind); its model is "
        "replaced by each model's path. Default: hf on --device with --max-batch-size.",
    )
    device: str | None = Field(
        None, description="hf: cpu, cuda, cuda:1 (default: cuda if any). Without --engine only."
    )
    max_batch_size: int = Field(
        DEFAULT_MAX_BATCH,
        ge=1,
        description="hf: requests decoded together at most. Without --engine only.",
    )
    dtype: ComputeDtype = "auto"
    human_data: Path | None = Field(
        None,
        description="DialOp optimization.jsonl for the human row (default: $SELFPLAY_HUMAN_DATA, "
        "else ../shared/dialop-data).",
    )
    out: Path | None = Field(
        None,
        description="Output folder: every game is kept in OUT/games/<row>.jsonl (and an API "
        "partner's cache and usage); default: games are not kept.",
    )

    @field_validator("baselines")
    @classmethod
    def _baselines_known(cls, v: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...]:
        game = game_of(info) or MATCHING
        if v is None:
            return default_baselines(game)
        return tuple(_scripted_name(b, game.scripted_names) for b in v)

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
    def _human_data_exists(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        # a stored eval.json names the file it was run with; reading it back needs no file
        if v is not None and not (info.context or {}).get(STORED) and not v.is_file():
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
        if self.engine is not None and (
            self.device is not None
            or self.max_batch_size != DEFAULT_MAX_BATCH
            or self.dtype != "auto"
        ):
            raise ValueError(
                "device: device, dtype and max_batch_size configure the default hf engine; with an "
                "engine config, set them on it (engine.device, engine.max_batch_size)"
            )
        if self.cross_play and isinstance(self.engine, SGLangEngineConfig) and self.engine.url:
            raise ValueError(
                "cross_play: an attached SGLang server holds one model at a time and cross-play "
                "needs every model at once; launch the servers (no engine url) or use hf"
            )
        return self

    def engine_for(self, model: str, index: int = 0) -> EngineConfig:
        """The engine config of ``model``, the ``index``-th of ``models``: the template with the
        model's path (a launched SGLang server on port + index)."""
        if self.engine is None:
            return HFEngineConfig(
                model=model,
                device=self.device,
                max_batch_size=self.max_batch_size,
                dtype=self.dtype,
            )
        update: dict = {"model": model}
        if isinstance(self.engine, SGLangEngineConfig) and not self.engine.url:
            update["port"] = self.engine.port + index
        return self.engine.model_copy(update=update)


Kind = Literal["model", "baseline", "human", "cross"]


class EvalRow(BaseModel):
    """One line of the table: who played which seat and metrics.summarize of their games.

    Metric fields are None where they do not apply (a model that failed to load; the invalid
    rate of humans, whose interface allowed only valid moves). Unknown fields are refused.
    """

    model_config = ConfigDict(extra="forbid")

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


# metrics.summarize keys without a column in the table, on purpose: per-seat question counts and
# the question/reward correlation belong to a run's report (rounds), not to this table.
NOT_IN_ROW = frozenset(
    {"questions_per_game_seat0", "questions_per_game_seat1", "question_reward_corr"}
)


def summary_fields(summary: GameSummary) -> dict:
    """The EvalRow fields of a ``metrics.summarize`` result (NaN becomes None). Every key is a
    row field or in ``NOT_IN_ROW``; any other key raises, so a new metric is never dropped."""
    fields = summary.model_dump(exclude={*NOT_IN_ROW, "partner"})
    unknown = sorted(fields.keys() - EvalRow.model_fields.keys())
    if unknown:
        raise TypeError(
            f"metrics.summarize returned {', '.join(unknown)}, which EvalRow does not have: add "
            "a field to EvalRow or the key to evaluate.NOT_IN_ROW"
        )
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in fields.items()}


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
    """What ``run_eval`` found; ``save_result`` writes it as eval.json, ``load_result`` reads it."""

    schema_version: Literal[1] = EVAL_SCHEMA_VERSION
    config: EvalConfig
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


def load_result(path: str | Path) -> EvalResult:
    """Read an eval.json written by ``save_result``. The files the evaluation read (the human
    data) need not exist any more, and config fields this version no longer has are dropped with
    a warning, so an eval.json of an older selfplay still reads."""
    data = json.loads(Path(path).read_text())
    config = data.get("config")
    if isinstance(config, dict):
        gone = sorted(set(config) - set(EvalConfig.model_fields))
        if gone:
            log.warning("%s: ignoring config fields of an older selfplay: %s", path, gone)
            data["config"] = {k: v for k, v in config.items() if k not in gone}
    try:
        return EvalResult.model_validate(data, context={STORED: True})
    except ValidationError as e:
        raise EvalError(f"{path} is not an eval.json this selfplay can read: {e}") from None


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
    path = Path(data_root) / run / "manifest.json"
    if not path.is_file():
        raise EvalError(
            f"{path} does not exist: name a run started with `selfplay iterate` "
            "(and pass --data-root when it is not under data/)"
        )
    manifest = read_manifest(path)
    initial = (
        manifest.rounds[min(manifest.rounds)].model if manifest.rounds else manifest.settings.model
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
    file = Path(path or os.environ.get(HUMAN_DATA_ENV) or DEFAULT_HUMAN_DATA)
    base = {"name": "human", "kind": "human", "seat1": "human", "seat2": "human"}
    if not file.is_file():
        return EvalRow(
            **base,
            games=134,
            reward_mean=HUMAN_REFERENCE,
            agreement_rate=1.0,
            source=f"stored constant selfplay.evaluate.HUMAN_REFERENCE: {HUMAN_SOURCE}; "
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
        kinds = [MATCHING.classify_question(m) for m in messages]  # the human games are matching
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
    engine: Engine
    chat: ChatFormat


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


class _Evaluation:
    """One evaluation in progress: the plan and its scenarios, the partner, loading models."""

    def __init__(self, config: EvalConfig) -> None:
        self.config = config
        self.seeds = [eval_scenario_seed(config.seed, i) for i in range(config.num_scenarios)]
        self.plan = eval_plan(config.seed, config.num_scenarios, config.games_per_scenario)
        self.game = get_game(config.game)
        self.scenarios = Scenarios(config.table_size, keep=True, game=self.game)  # every row
        self.games_dir = config.out / "games" if config.out is not None else None
        self.partner_client = None  # an API partner's client, shared by every row

    async def prepare(self) -> None:
        from selfplay.players.api import api_partner_config, open_partner_client

        cfg = self.config
        await self.scenarios.warm(self.plan)
        if self.games_dir is not None:
            self.games_dir.mkdir(parents=True, exist_ok=True)
        api = api_partner_config(cfg, cfg.out)
        if api is not None:
            self.partner_client = open_partner_client(api)

    async def aclose(self) -> None:
        self.scenarios.close()
        if self.partner_client is not None:
            await self.partner_client.aclose()

    def seating(self, policy: SeatFactory) -> Seating:
        """``policy`` in ``policy_seat`` across the configured partner (or in both seats)."""
        cfg = self.config
        return seating(
            policy,
            cfg.partner,
            policy_seat=cfg.policy_seat,
            partner_client=self.partner_client,
            game=self.game,
        )

    def llm(self, lm: _Loaded) -> SeatFactory:
        return llm_seat(lm.engine, lm.chat, self.config.sampling, name=lm.path, trained=False)

    async def play(self, file: str, seats: Seating, *, quiet: bool = False) -> list[GameRecord]:
        """Every game of one row (all scenarios x games_per_scenario), in plan order."""
        cfg = self.config
        total = len(self.plan)
        every = max(1, total // 10)
        done = 0

        def finished(spec: GameSpec, record: GameRecord) -> None:
            nonlocal done
            done += 1
            if done % every == 0 or done == total:
                level = logging.DEBUG if quiet else logging.INFO
                log.log(level, "eval %s: %d/%d games", file, done, total)

        records = await play_plan(
            self.plan,
            seats,
            self.scenarios,
            concurrency=cfg.concurrency,
            max_actions=cfg.max_actions,
            max_invalid=cfg.max_invalid,
            on_game=finished,
        )
        if self.games_dir is not None:
            path = self.games_dir / f"{_slug(file)}.jsonl"
            path.unlink(missing_ok=True)
            await asyncio.to_thread(append_records, path, records)
        return records

    async def load(self, spec: ModelSpec) -> _Loaded:
        """Start ``spec``'s engine (an attached SGLang server is given its weights)."""
        from selfplay.models import resolve_model

        path = await asyncio.to_thread(resolve_model, spec.model)
        chat = await asyncio.to_thread(load_chat_format, path)
        engine_cfg = self.config.engine_for(path, self.config.models.index(spec))
        engine = await asyncio.to_thread(open_engine, engine_cfg)
        try:
            await engine.start()
            if isinstance(engine_cfg, SGLangEngineConfig) and engine_cfg.url:
                await engine.update_weights_from_disk(path)  # type: ignore[attr-defined]
        except BaseException:
            await engine.aclose()
            raise
        return _Loaded(spec, path, engine, chat)


def _row(name: str, kind: Kind, seat1: str, seat2: str, records, started: float, **extra):
    return EvalRow(
        name=name,
        kind=kind,
        seat1=seat1,
        seat2=seat2,
        seconds=time.perf_counter() - started,
        **extra,
        **summary_fields(summarize(records)),
    )


def _ordered(names: tuple[str, str], config: EvalConfig) -> tuple[str, str]:
    """(policy, partner) names in seat order: the policy takes seat ``config.policy_seat``."""
    return names if config.policy_seat == 1 else (names[1], names[0])


async def run_eval_async(config: EvalConfig) -> EvalResult:
    """Evaluate every model, baseline and (optionally) model pair; see the module docstring."""
    started = time.perf_counter()
    ev = _Evaluation(config)
    rows: list[EvalRow] = []
    errors: dict[str, str] = {}
    kept: list[_Loaded] = []  # engines open now: the models held for cross-play, or the current
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
        await ev.prepare()
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
            kept.append(lm)  # closed below whatever happens (Ctrl-C included)
            try:
                log.info("eval: %s (%d games)", spec.label, len(ev.plan))
                records = await ev.play(f"model-{spec.label}", ev.seating(ev.llm(lm)))
            except EngineFailure as e:
                msg = f"model {spec.label!r} ({lm.path}) failed while playing: {e}"
                failed(spec.label, names, lm.path, msg)
                kept.remove(lm)
                await lm.engine.aclose()
                continue
            rows.append(_row(spec.label, "model", *names, records, t0, model=lm.path))
            log.info("eval: %s reward %.3f", spec.label, rows[-1].reward_mean or 0.0)
            if not config.cross_play:
                kept.remove(lm)
                await lm.engine.aclose()
        cross = await _cross_play(ev, kept, rows, errors) if len(kept) >= 2 else None
        for name in config.baselines:
            t0 = time.perf_counter()
            seats = ev.seating(scripted_seat(name, ev.game))
            records = await ev.play(f"baseline-{name}", seats, quiet=True)
            names = _ordered((name, partner or name), config)
            rows.append(_row(name, "baseline", *names, records, t0))
    finally:
        for lm in kept:
            await lm.engine.aclose()
        await ev.aclose()
    if config.game == MATCHING.name:  # the human games are matching games
        rows.append(human_reference(config.human_data))
    result = EvalResult(
        config=config,
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
                records = await ev.play(f"cross-{name}", Seating(ev.llm(a), ev.llm(b)))
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
